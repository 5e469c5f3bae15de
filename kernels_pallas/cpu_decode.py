"""Paged decode attention as a C++ kernel for XLA:CPU, called through the XLA FFI.

XLA:CPU cannot fuse a page gather into a dot, so the XLA path copies every page of a decode tile
and runs batched matmuls of a few columns over the copy (about 3 GB/s of K/V). The kernel in
`cpu/paged_decode.cc` reads each K/V row once, in place, for all query heads of its group, and
shares (sequence, KV head) pairs among XLA's intra-op threads.

The source is compiled with the system C++ compiler on first use, against the FFI headers that
jaxlib ships, into a cache directory keyed by the source and the jaxlib version (6 s once). If
no compiler is found or the build fails, `available()` is False, a warning says why, and the XLA
path runs instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata

SOURCE = Path(__file__).parent / "cpu" / "paged_decode.cc"
TARGET = "pagedjax_paged_decode"
MAX_GROUP = 8  # query heads per KV head the kernel handles


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDJAX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pagedjax"
    )
    return Path(root)


def _build() -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + jax.__version__.encode() + jax.lib.__version__.encode())
    library = _cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = Path(tmp) / library.name
        command = [
            compiler, "-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC",
            "-w", f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(built),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)  # atomic: concurrent builds leave one complete file
    return library


@functools.cache
def available() -> bool:
    """Builds (once) and registers the kernel; False, with a warning, if that fails."""
    if os.environ.get("PAGEDJAX_DISABLE_CPU_KERNEL"):
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.PagedDecode), platform="cpu")
    except (OSError, RuntimeError) as error:
        warnings.warn(
            f"C++ decode attention unavailable, using the XLA path: {error}", stacklevel=2
        )
        return False
    return True


def supports(q: jax.Array, cache: KVCache) -> bool:
    """Whether the kernel handles this call: a float32 pool, at most 8 query heads per KV head,
    a head_dim that is a multiple of 8, on the CPU, and the kernel built."""
    return (
        jax.default_backend() == "cpu"
        and cache.k.dtype == jnp.float32
        and cache.k_scale is None
        and q.shape[1] // cache.k.shape[1] <= MAX_GROUP
        and q.shape[2] % 8 == 0
        and available()
    )


def paged_decode_cpu(
    q: jax.Array,  # [T, num_q_heads, head_dim] float32
    cache: KVCache,  # k, v: [L, num_kv_heads, num_blocks, block_size, head_dim] float32
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim] float32; rows of non-decode sequences are zero
    """Attention of every decode row (a sequence whose q_len is 1); call when `supports`."""
    window = 0 if sliding_window is None else sliding_window
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q,
        cache.k,
        cache.v,
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
        jnp.reshape(jnp.asarray(window, jnp.int32), (1,)),
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale=np.float32(scale),
        soft_cap=np.float32(soft_cap or 0.0),
    )
