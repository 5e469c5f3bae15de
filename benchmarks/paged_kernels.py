"""GPU benchmark of the Pallas attention kernels against JAX's bundled Pallas paged attention and
the XLA (pure jnp) reference, in one run, on one device.

    python benchmarks/paged_kernels.py --out DIR [--iters 20] [--quick] [--large-pool[-only]]
        [--tiny] [--smoke (--tiny --quick --iters 2: a CPU run of seconds; --out optional)]

Decode batches (batch x context) 1x32k, 16x4k, 64x2k, 256x1k with 32 query heads, 8 KV heads,
head_dim 128, bf16 (and fp8 for our kernel), page size 16; plus a mixed step of prefill chunks
and decode tokens, and one with a 32k-token decode row among them (the kernels route a mixed
step's long decode rows to split-K; "pallas_ragged_long_rows_unsplit" keeps them in the ragged
kernel, as before). For each: median time per call, achieved KV bandwidth (unique KV bytes of
the visible context / time) and its fraction of a measured device copy bandwidth. Prints a
table and writes DIR/kernels.json. Needs a GPU; each measurement is guarded so one failure
(e.g. a peer that rejects a shape) is recorded and the rest still run.

--large-pool adds decode steps over pools past 4 GiB (bf16 and fp8: 64-bit offsets) and an
fp8 pool of 3 GiB (read one layer at a time), with the sequences' pages at the top of the pool
(the highest block ids) and NaN everywhere else: both kernels are timed and checked against
the reference (finite, max error). Each is skipped when the device has too little free memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from report import add_smoke_flag, results_dir  # noqa: E402  (the script's own directory)

from kernels_pallas.backend import AttentionSpec  # noqa: E402
from kernels_pallas.decode_attention import (  # noqa: E402
    DecodeConfig,
    choose_num_splits,
    device_sm_count,
)
from kernels_pallas.kv_cache import KVCache  # noqa: E402
from kernels_pallas.metadata import AttentionMetadata, build_metadata  # noqa: E402
from kernels_pallas.mosaic_decode_attention import (  # noqa: E402
    PALLAS_MOSAIC,
    mosaic_decode_attention_kernel,
)
from kernels_pallas.paged_attention import paged_attention  # noqa: E402
from kernels_pallas.ragged_paged_attention import RaggedConfig  # noqa: E402
from kernels_pallas.reference import ragged_paged_attention  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 32, 8, 128, 16, 2
LAYER = 1  # not layer 0: the kernels must index the stacked pool
DECODE_SHAPES = [(1, 32768), (16, 4096), (64, 2048), (256, 1024)]
# Mixed step: (q_len, context) per sequence: prefill chunks and decode tokens.
MIXED_STEP = [(512, 2048), (512, 1024), (256, 256)] + [(1, 2048)] * 61
# A long conversation's decode row sharing a step with prefill chunks and shorter decodes.
MIXED_LONG_STEP = [(512, 2048), (256, 256), (1, 32768)] + [(1, 1024)] * 8
# Tilings besides the defaults, timed on the bf16 cases to choose the next defaults from:
# num_stages 3 streams tile t + 1 while tile t is consumed (docs/kernels.md), at the cost of
# a second K and V buffer of shared memory.
TUNING_VARIANTS = {
    "decode": {
        "pallas_split_k_stages3": DecodeConfig(num_stages=3),
        "pallas_split_k_kt32_stages3": DecodeConfig(kv_tile_tokens=32, num_stages=3),
    },
    "ragged": {"pallas_ragged_stages3": RaggedConfig(num_stages=3)},
}
# Skip the XLA reference when its per-token page gather would exceed this (it materialises
# [T, pages, Hkv, block, D] in float32 for K and for V).
REFERENCE_GATHER_LIMIT = 24 << 30
# --large-pool: (name, pool dtype, GiB per K or V array). Past 4 GiB the Triton lowering uses
# 64-bit offsets; an fp8 pool of 2-4 GiB is read through a copy of the step's layer.
LARGE_POOL_CASES = [
    ("large_pool_bf16_6g", jnp.bfloat16, 6),
    ("large_pool_fp8_6g", jnp.float8_e4m3fn, 6),
    ("large_pool_fp8_3g", jnp.float8_e4m3fn, 3),
]
# 16 decode sequences of ~4k tokens; the last page of each is partly past its context.
LARGE_POOL_SEQS = [(1, 4096 - 5)] * 16


REPEATS = 5  # timed runs of `iters` calls a timing's median is taken over


def timed(fn: Callable[..., Any], *args: Any, iters: int, repeats: int = REPEATS) -> float:
    """Median seconds per call: `iters` back-to-back calls per repeat, synchronised once."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / iters)
    return statistics.median(per_call)


@dataclass(frozen=True)
class Ceilings:
    """Measured device bandwidths in bytes/s: what a kernel's KV bytes per second are held to."""

    copy: float  # an elementwise pass, bytes read + written (the yardstick)
    read: float  # a read-only pass: a decode kernel's own ceiling


def copy_bandwidth(iters: int, elements: int = 1 << 30) -> float:
    """Device memory bandwidth in bytes/s of an elementwise pass (read + write) over 2 GiB."""
    x = jax.random.normal(jax.random.key(1), (elements,), jnp.bfloat16)
    seconds = timed(jax.jit(lambda x: x + 1), x, iters=iters)
    return 2 * x.nbytes / seconds


def read_bandwidth(iters: int, elements: int = 1 << 30) -> float:
    """Device memory bandwidth in bytes/s of a read-only pass (a max) over 2 GiB: the ceiling
    of a decode kernel, which reads the KV and writes next to nothing."""
    x = jax.random.normal(jax.random.key(2), (elements,), jnp.bfloat16)
    seconds = timed(jax.jit(jnp.max), x, iters=iters)
    return x.nbytes / seconds


def torch_copy_bandwidth(elements: int = 1 << 30) -> float | None:
    """PyTorch's device-to-device copy (read + write) in bytes/s, a cross-check of XLA's
    elementwise pass; None without a CUDA build of torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.randn(elements, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(6):
        start.record()
        for _ in range(10):
            y.copy_(x)
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / 10)
    del x, y
    torch.cuda.empty_cache()
    return 2 * elements * 2 / statistics.median(per_call[1:])


def make_step(
    seqs: list[tuple[int, int]], kv_dtype: jnp.dtype | type, seed: int = 0
) -> tuple[jax.Array, KVCache, AttentionMetadata, int]:
    """A pool with exactly the step's pages (+ the null block), shuffled, in NUM_LAYERS layers."""
    rng = np.random.default_rng(seed)
    pages = [-(-ctx // BLOCK_SIZE) for _, ctx in seqs]
    num_blocks = 1 + sum(pages)
    order = rng.permutation(np.arange(1, num_blocks))
    tables, used = [], 0
    for n in pages:
        tables.append(order[used : used + n].tolist())
        used += n
    metadata = build_metadata([q for q, _ in seqs], [c for _, c in seqs], tables, BLOCK_SIZE)
    metadata = jax.tree.map(jnp.asarray, metadata)
    shape = (NUM_LAYERS, NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
    key_k, key_v, key_q = jax.random.split(jax.random.key(seed), 3)
    k = (jax.random.normal(key_k, shape, jnp.bfloat16)).astype(kv_dtype)
    v = (jax.random.normal(key_v, shape, jnp.bfloat16)).astype(kv_dtype)
    num_tokens = sum(q for q, _ in seqs)
    q = jax.random.normal(key_q, (num_tokens, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    kv_bytes = sum(p * BLOCK_SIZE for p in pages) * NUM_KV_HEADS * HEAD_DIM * 2
    kv_bytes *= jnp.dtype(kv_dtype).itemsize
    return q, KVCache(k, v), metadata, kv_bytes


def top_block_tables(
    seqs: list[tuple[int, int]], num_blocks: int, seed: int = 0
) -> list[list[int]]:
    """Each sequence's pages drawn, shuffled, from the highest block ids of the pool, so the
    kernels' page offsets reach the pool's end."""
    pages = [-(-ctx // BLOCK_SIZE) for _, ctx in seqs]
    top = np.random.default_rng(seed).permutation(np.arange(num_blocks - sum(pages), num_blocks))
    starts = np.cumsum([0, *pages])
    return [top[a:b].tolist() for a, b in zip(starts[:-1], starts[1:], strict=True)]


def large_pool_blocks(kv_dtype: jnp.dtype | type, gib: float) -> int:
    """Blocks of a pool of `gib` GiB per K or V array, NUM_LAYERS layers."""
    block_bytes = NUM_LAYERS * NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM * jnp.dtype(kv_dtype).itemsize
    return int(gib * (1 << 30)) // block_bytes


def make_large_pool_step(
    seqs: list[tuple[int, int]], kv_dtype: jnp.dtype | type, gib: float, seed: int = 0
) -> tuple[jax.Array, KVCache, AttentionMetadata, int]:
    """A pool of `gib` GiB per array, NaN except the step's context, which sits in the highest
    block ids (the last page of a sequence past its length is NaN too)."""
    num_blocks = large_pool_blocks(kv_dtype, gib)
    tables = top_block_tables(seqs, num_blocks, seed)
    metadata = build_metadata([q for q, _ in seqs], [c for _, c in seqs], tables, BLOCK_SIZE)
    metadata = jax.tree.map(jnp.asarray, metadata)
    ids = jnp.asarray(np.concatenate(tables), jnp.int32)  # [P]
    # [P, block]: the positions of each used page that hold context
    positions = [np.arange(len(t) * BLOCK_SIZE).reshape(-1, BLOCK_SIZE) for t in tables]
    written = np.concatenate([pos < c for pos, (_, c) in zip(positions, seqs, strict=True)])
    mask = jnp.asarray(written)[None, None, :, :, None]
    shape = (NUM_LAYERS, NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
    pages_shape = (NUM_LAYERS, NUM_KV_HEADS, ids.shape[0], BLOCK_SIZE, HEAD_DIM)

    @jax.jit
    def nan_pool():
        return jnp.full(shape, jnp.nan, kv_dtype)

    # Donated, so the scatter of the step's pages does not hold two pools at once.
    @functools.partial(jax.jit, donate_argnums=0)
    def scatter(pool, key):
        values = jax.random.normal(key, pages_shape, jnp.bfloat16)
        return pool.at[:, :, ids].set(jnp.where(mask, values, jnp.nan).astype(kv_dtype))

    key_k, key_v, key_q = jax.random.split(jax.random.key(seed), 3)
    k, v = scatter(nan_pool(), key_k), scatter(nan_pool(), key_v)
    num_tokens = sum(q for q, _ in seqs)
    q = jax.random.normal(key_q, (num_tokens, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    kv_bytes = sum(c for _, c in seqs) * NUM_KV_HEADS * HEAD_DIM * 2
    kv_bytes *= jnp.dtype(kv_dtype).itemsize
    return q, KVCache(k, v), metadata, kv_bytes


def free_device_bytes(device: jax.Device) -> int:
    """Bytes the device can still allocate; 0 where it does not say (a CPU)."""
    stats = device.memory_stats() or {}
    return max(stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0), 0)


def run_large_pool_case(
    name: str,
    kv_dtype: jnp.dtype | type,
    gib: float,
    *,
    iters: int,
    ceilings: Ceilings,
    seqs: list[tuple[int, int]] = LARGE_POOL_SEQS,
    tiny: bool = False,  # a CPU smoke run: a pool of gib MiB, no memory check
) -> dict:
    """Both kernels on a decode step whose pages sit at the top of a `gib` GiB pool (NaN
    elsewhere): timings, whether the output is finite, and its error against the reference."""
    result = {"case": name, "kv_dtype": jnp.dtype(kv_dtype).name, "pool_gib": gib, "timings": {}}
    device = jax.devices()[0]
    needed = 2 * gib * (1 << 30) + (2 << 30)  # K, V and room for the step
    if not tiny and (device.platform != "gpu" or free_device_bytes(device) < needed):
        result["skipped"] = f"needs a GPU with {needed / (1 << 30):.0f} GiB free"
        return result
    pool_gib = gib / 1024 if tiny else gib
    q, cache, metadata, kv_bytes = make_large_pool_step(seqs, kv_dtype, pool_gib)
    result.update(num_blocks=cache.k.shape[2], pool_bytes=2 * cache.k.nbytes, kv_bytes=kv_bytes)
    scale = HEAD_DIM**-0.5
    k_scale = 1.0 if jnp.dtype(kv_dtype).itemsize == 1 else None
    candidates = {
        label: jax.jit(
            lambda q, c, m, decode=decode: paged_attention(
                q, c, LAYER, m, scale=scale, decode_only=decode, k_scale=k_scale,
                v_scale=k_scale,
            )
        )
        for label, decode in (("pallas_ragged", False), ("pallas_split_k", True))
    }  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:  # the fp8 2-4 GiB layer copy
        warnings.simplefilter("always")
        for label, fn in candidates.items():
            result["timings"][label] = measure(fn, (q, cache, metadata), kv_bytes, iters, ceilings)
    result["warnings"] = sorted({str(w.message) for w in caught})
    want = ragged_paged_attention(q, cache, LAYER, metadata, scale=scale)
    want = np.asarray(want.astype(jnp.float32))
    result["reference_finite"] = bool(np.isfinite(want).all())
    for label, fn in candidates.items():
        if "error" in result["timings"][label]:
            continue
        got = np.asarray(fn(q, cache, metadata).astype(jnp.float32))
        result["timings"][label]["finite"] = bool(np.isfinite(got).all())
        result["timings"][label]["max_abs_error_vs_reference"] = float(np.abs(got - want).max())
    return result


def bundled_peer(
    q: jax.Array, cache: KVCache, metadata: AttentionMetadata
) -> tuple[Callable[..., jax.Array], tuple[jax.Array, ...]]:
    """JAX's jax.experimental.pallas.ops.gpu.paged_attention on its own layout: one layer's
    [Hkv, pages, page, D] pool (made outside the timing), tables padded to its k_splits."""
    from jax.experimental.pallas.ops.gpu import paged_attention as peer

    k_splits = 16
    k_pages, v_pages = cache.k[LAYER], cache.v[LAYER]
    tables = metadata.block_tables
    width = -(-tables.shape[1] // (k_splits * 8)) * (k_splits * 8)
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    lengths = metadata.seq_lens
    interpret = jax.default_backend() != "gpu"  # the CPU smoke run: Pallas runs interpreted
    fn = jax.jit(
        lambda q, k, v, t, n: peer.paged_attention(
            q, k, v, t, n, k_splits=k_splits, interpret=interpret
        )
    )
    return fn, (q, k_pages, v_pages, tables, lengths)


def mosaic_runs(kv_dtype: jnp.dtype | type) -> bool:
    """Whether the Mosaic GPU decode kernel runs this pool here (compiled on Hopper, or in
    Mosaic GPU's interpret mode on jax >= 0.11)."""
    spec = AttentionSpec(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, jnp.dtype(kv_dtype).name, BLOCK_SIZE)
    return PALLAS_MOSAIC.supports(spec) is None


def run_case(
    name: str,
    seqs: list[tuple[int, int]],
    kv_dtype: jnp.dtype | type,
    *,
    decode: bool,
    iters: int,
    ceilings: Ceilings,
    with_peers: bool,
    repeats: int = REPEATS,
) -> dict:
    """One step's shape: each kernel's median time over `repeats` runs of `iters` calls."""
    q, cache, metadata, kv_bytes = make_step(seqs, kv_dtype)
    scale = HEAD_DIM**-0.5
    timings: dict[str, dict] = {}
    result = {
        "case": name,
        "kv_dtype": jnp.dtype(kv_dtype).name,
        "num_seqs": len(seqs),
        "num_tokens": int(q.shape[0]),
        "kv_bytes": kv_bytes,
        "pool_bytes": 2 * cache.k.nbytes,
        "timings": timings,
    }
    if decode:
        result["num_splits"] = choose_num_splits(
            len(seqs), NUM_KV_HEADS, metadata.block_tables.shape[1] * BLOCK_SIZE
        )
    k_scale = 1.0 if jnp.dtype(kv_dtype).itemsize == 1 else None
    candidates = {
        "pallas_ragged": jax.jit(
            lambda q, c, m: paged_attention(
                q, c, LAYER, m, scale=scale, decode_only=False, k_scale=k_scale, v_scale=k_scale
            )
        ),
    }
    if decode:
        candidates["pallas_split_k"] = jax.jit(
            lambda q, c, m: paged_attention(
                q, c, LAYER, m, scale=scale, decode_only=True, k_scale=k_scale, v_scale=k_scale
            )
        )
    if decode and mosaic_runs(kv_dtype):  # the Triton split-K kernel's successor
        candidates["pallas_mosaic_split_k"] = jax.jit(
            lambda q, c, m: paged_attention(
                q, c, LAYER, m, scale=scale, decode_only=True,
                decode_kernel=mosaic_decode_attention_kernel,
            )
        )  # fmt: skip
    if with_peers:  # tuning candidates: num_stages 3 double-buffers the KV tiles
        for label, config in TUNING_VARIANTS["decode" if decode else "ragged"].items():
            configs = {"decode_config" if decode else "ragged_config": config}
            candidates[label] = jax.jit(
                lambda q, c, m, configs=configs: paged_attention(
                    q, c, LAYER, m, scale=scale, decode_only=decode, k_scale=k_scale,
                    v_scale=k_scale, **configs,
                )
            )  # fmt: skip
    if with_peers and not decode:  # as before: every row of a mixed step in the ragged kernel
        no_split = DecodeConfig(mixed_long_rows=0)
        candidates["pallas_ragged_long_rows_unsplit"] = jax.jit(
            lambda q, c, m: paged_attention(
                q, c, LAYER, m, scale=scale, decode_only=False, k_scale=k_scale,
                v_scale=k_scale, decode_config=no_split,
            )
        )  # fmt: skip
    gather_bytes = q.shape[0] * metadata.block_tables.shape[1] * BLOCK_SIZE * NUM_KV_HEADS
    gather_bytes *= HEAD_DIM * 4 * 2
    if with_peers and gather_bytes <= REFERENCE_GATHER_LIMIT:
        candidates["xla_reference"] = jax.jit(
            lambda q, c, m: ragged_paged_attention(q, c, LAYER, m, scale=scale)
        )
    for label, fn in candidates.items():
        timings[label] = measure(fn, (q, cache, metadata), kv_bytes, iters, ceilings, repeats)
    if with_peers and decode:
        try:
            fn, args = bundled_peer(q, cache, metadata)
            timings["jax_bundled_paged_attention"] = measure(
                fn, args, kv_bytes, iters, ceilings, repeats
            )
        except Exception as error:  # the peer has its own shape rules; record, go on
            timings["jax_bundled_paged_attention"] = {"error": repr(error)[:500]}
    if "xla_reference" in candidates and "pallas_ragged" in timings:
        result["max_abs_error_vs_reference"] = max_error(candidates, q, cache, metadata)
    return result


def measure(
    fn: Callable[..., jax.Array],
    args: tuple,
    kv_bytes: int,
    iters: int,
    ceilings: Ceilings,
    repeats: int = REPEATS,
) -> dict:
    try:
        seconds = timed(fn, *args, iters=iters, repeats=repeats)
    except Exception as error:
        traceback.print_exc()
        return {"error": repr(error)[:500]}
    bandwidth = kv_bytes / seconds
    return {
        "us": seconds * 1e6,
        "kv_gb_per_s": bandwidth / 1e9,
        "fraction_of_copy_bw": bandwidth / ceilings.copy,
        "fraction_of_read_bw": bandwidth / ceilings.read,
    }


def max_error(
    candidates: dict[str, Callable[..., jax.Array]],
    q: jax.Array,
    cache: KVCache,
    metadata: AttentionMetadata,
) -> dict:
    want = np.asarray(candidates["xla_reference"](q, cache, metadata).astype(jnp.float32))
    errors = {}
    for label in candidates:
        if label.startswith("pallas"):
            got = np.asarray(candidates[label](q, cache, metadata).astype(jnp.float32))
            errors[label] = float(np.abs(got - want).max())
    return errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None, help="required unless --smoke")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="two decode shapes, no fp8")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run of the script itself")
    parser.add_argument(
        "--large-pool",
        action="store_true",
        help="also decode over pools of 6 GiB (bf16, fp8) and 3 GiB (fp8), pages at the top",
    )
    parser.add_argument(
        "--large-pool-only", action="store_true", help="only the --large-pool cases"
    )
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # gpu_check's CPU dry run of this script; flags win
        parser.set_defaults(tiny=True, quick=True, iters=2)
    args = parser.parse_args()
    if args.out is None:
        if not args.smoke:
            parser.error("--out is required")
        args.out = results_dir(smoke=True)
    args.out.mkdir(parents=True, exist_ok=True)

    device = jax.devices()[0]
    elements = 1 << 20 if args.tiny else 1 << 30
    torch_copy = torch_copy_bandwidth(elements) if jax.default_backend() == "gpu" else None
    ceilings = Ceilings(copy_bandwidth(args.iters, elements), read_bandwidth(args.iters, elements))
    report = {
        "device": device.device_kind,
        "backend": jax.default_backend(),
        "sm_count": device_sm_count(device),
        "jax": jax.__version__,
        "copy_bandwidth_gb_per_s": ceilings.copy / 1e9,
        "read_bandwidth_gb_per_s": ceilings.read / 1e9,
        "torch_copy_bandwidth_gb_per_s": torch_copy / 1e9 if torch_copy else None,
        "config": dict(
            q_heads=NUM_Q_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block=BLOCK_SIZE
        ),
        "cases": [],
    }
    print(
        f"{device.device_kind}: copy bandwidth {ceilings.copy / 1e9:.0f} GB/s, read "
        f"{ceilings.read / 1e9:.0f} GB/s"
        + (f", torch copy {torch_copy / 1e9:.0f} GB/s" if torch_copy else ""),
        flush=True,
    )
    shapes = DECODE_SHAPES[::2] if args.quick else DECODE_SHAPES
    dtypes = [jnp.bfloat16] if args.quick else [jnp.bfloat16, jnp.float8_e4m3fn]
    mixed = MIXED_STEP
    if args.tiny:
        shapes, mixed = [(2, 256)], [(16, 64), (1, 128), (1, 40)]
    cases = []
    for kv_dtype in dtypes:
        for batch, context in shapes:
            name = (
                f"decode_{batch}x{context // 1024}k"
                if context >= 1024
                else f"decode_{batch}x{context}"
            )
            cases.append((name, [(1, context)] * batch, kv_dtype, True))
    cases.append(("mixed_prefill_decode", mixed, jnp.bfloat16, False))
    if not args.tiny:
        cases.append(("mixed_long_decode_row", MIXED_LONG_STEP, jnp.bfloat16, False))
    if args.large_pool_only:
        cases = []

    for name, seqs, kv_dtype, decode in cases:
        with_peers = kv_dtype == jnp.bfloat16
        result = run_case(
            name, seqs, kv_dtype, decode=decode, iters=args.iters, ceilings=ceilings,
            with_peers=with_peers, repeats=1 if args.tiny else REPEATS,  # tiny: the path only
        )  # fmt: skip
        report["cases"].append(result)
        print_result(result)
        (args.out / "kernels.json").write_text(json.dumps(report, indent=2))
    for name, kv_dtype, gib in LARGE_POOL_CASES if args.large_pool or args.large_pool_only else []:
        result = run_large_pool_case(
            name, kv_dtype, gib, iters=args.iters, ceilings=ceilings,
            **(dict(seqs=[(1, 60), (1, 37)], tiny=True) if args.tiny else {}),
        )  # fmt: skip
        report["cases"].append(result)
        print_result(result)
        (args.out / "kernels.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'kernels.json'}")


def print_result(result: dict) -> None:
    """One line per timing of a case (and its error against the reference, if checked)."""
    name, kv_dtype = result["case"], result["kv_dtype"]
    if "skipped" in result:
        print(f"{name:24s} {kv_dtype:14s} skipped: {result['skipped']}", flush=True)
    for label, timing in result["timings"].items():
        if "error" in timing:
            print(f"{name:24s} {kv_dtype:14s} {label:28s} ERROR {timing['error']}")
            continue
        checked = ""
        if "max_abs_error_vs_reference" in timing:
            checked = f" finite={timing['finite']} err={timing['max_abs_error_vs_reference']:.3g}"
        print(
            f"{name:24s} {kv_dtype:14s} {label:28s} {timing['us']:9.1f} us "
            f"{timing['kv_gb_per_s']:7.0f} GB/s {timing['fraction_of_copy_bw']:6.1%} of copy "
            f"{timing['fraction_of_read_bw']:6.1%} of read{checked}",
            flush=True,
        )


if __name__ == "__main__":
    main()
