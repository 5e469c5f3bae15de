"""Builds and registers the C++ kernels for XLA:CPU (`csrc/*.cc`), called through the XLA FFI.

The sources are compiled together with the system C++ compiler on first use, against the FFI
headers that jaxlib ships, into one library in a cache directory keyed by the sources and the
jax version, so the build runs once per machine. If no compiler is found or the build fails,
`available()` is False and a warning says why: the CPU platform then runs XLA instead
(`pagedjax/platforms/cpu.py`). `PAGEDJAX_DISABLE_CPU_KERNEL=1` does the same on purpose.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cc"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# FFI target name -> the handler symbol the sources export.
TARGETS = {
    "pagedjax_paged_attention": "PagedAttention",
    "pagedjax_kv_write": "KvWrite",
    "pagedjax_packed_matmul": "PackedMatmul",
    "pagedjax_quantized_matmul": "QuantizedMatmul",
    "pagedjax_grouped_packed_matmul": "GroupedPackedMatmul",
    "pagedjax_greedy_sample": "GreedySample",
    "pagedjax_token_logprobs": "TokenLogprobs",
    "pagedjax_random_sample": "RandomSample",
}


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDJAX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pagedjax"
    )
    return Path(root)


def _build() -> Path:
    key = hashlib.sha256(jax.__version__.encode() + jax.lib.__version__.encode())
    for source in SOURCES + HEADERS:
        key.update(source.name.encode() + source.read_bytes())
    library = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
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
            "-w", f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(built),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)  # atomic: concurrent builds leave one complete file
    return library


@functools.cache
def available() -> bool:
    """Builds (once) and registers the kernels; False, with a warning, if that fails."""
    if os.environ.get("PAGEDJAX_DISABLE_CPU_KERNEL"):
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
        for target, symbol in TARGETS.items():
            capsule = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    except (OSError, RuntimeError, AttributeError) as error:
        warnings.warn(f"C++ CPU kernels unavailable, using XLA instead: {error}", stacklevel=2)
        return False
    return True


def ffi_call(target: str, result_shape_dtypes, **options) -> Callable[..., Any]:
    """`jax.ffi.ffi_call` of one of these kernels, built and registered first (`options`:
    ffi_call's keywords, such as input_output_aliases)."""
    if not available():
        raise RuntimeError(
            f"the C++ CPU kernel {target} is not available here (see the warning above); "
            "run on the CPU platform's XLA path instead"
        )
    return jax.ffi.ffi_call(target, result_shape_dtypes, **options)
