"""GPU benchmark of the Pallas attention kernels against JAX's bundled Pallas paged attention and
the XLA (pure jnp) reference, in one run, on one device.

    python benchmarks/kernels.py --out DIR [--iters 20] [--quick]

Decode batches (batch x context) 1x32k, 16x4k, 64x2k, 256x1k with 32 query heads, 8 KV heads,
head_dim 128, bf16 (and fp8 for our kernel), page size 16; plus a mixed step of prefill chunks
and decode tokens. For each: median time per call, achieved KV bandwidth (unique KV bytes of
the visible context / time) and its fraction of a measured device copy bandwidth. Prints a
table and writes DIR/kernels.json. Needs a GPU; each measurement is guarded so one failure
(e.g. a peer that rejects a shape) is recorded and the rest still run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas.decode_attention import (  # noqa: E402
    DecodeConfig,
    choose_num_splits,
    device_sm_count,
)
from kernels_pallas.kv_cache import KVCache  # noqa: E402
from kernels_pallas.metadata import AttentionMetadata, build_metadata  # noqa: E402
from kernels_pallas.paged_attention import paged_attention  # noqa: E402
from kernels_pallas.ragged_paged_attention import RaggedConfig  # noqa: E402
from kernels_pallas.reference import ragged_paged_attention  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 32, 8, 128, 16, 2
LAYER = 1  # not layer 0: the kernels must index the stacked pool
DECODE_SHAPES = [(1, 32768), (16, 4096), (64, 2048), (256, 1024)]
# Mixed step: (q_len, context) per sequence: prefill chunks and decode tokens.
MIXED_STEP = [(512, 2048), (512, 1024), (256, 256)] + [(1, 2048)] * 61
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


def timed(fn: Callable[..., Any], *args: Any, iters: int, repeats: int = 5) -> float:
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


def copy_bandwidth(iters: int, elements: int = 1 << 30) -> float:
    """Device memory bandwidth in bytes/s of an elementwise pass (read + write) over 2 GiB."""
    x = jnp.ones((elements,), jnp.bfloat16)
    seconds = timed(jax.jit(lambda x: x + 1), x, iters=iters)
    return 2 * x.nbytes / seconds


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
    fn = jax.jit(lambda q, k, v, t, n: peer.paged_attention(q, k, v, t, n, k_splits=k_splits))
    return fn, (q, k_pages, v_pages, tables, lengths)


def run_case(
    name: str,
    seqs: list[tuple[int, int]],
    kv_dtype: jnp.dtype | type,
    *,
    decode: bool,
    iters: int,
    copy_bw: float,
    with_peers: bool,
) -> dict:
    q, cache, metadata, kv_bytes = make_step(seqs, kv_dtype)
    scale = HEAD_DIM**-0.5
    result = {
        "case": name,
        "kv_dtype": jnp.dtype(kv_dtype).name,
        "num_seqs": len(seqs),
        "num_tokens": int(q.shape[0]),
        "kv_bytes": kv_bytes,
        "pool_bytes": 2 * cache.k.nbytes,
        "timings": {},
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
    if with_peers:  # tuning candidates: num_stages 3 double-buffers the KV tiles
        for label, config in TUNING_VARIANTS["decode" if decode else "ragged"].items():
            configs = {"decode_config" if decode else "ragged_config": config}
            candidates[label] = jax.jit(
                lambda q, c, m, configs=configs: paged_attention(
                    q, c, LAYER, m, scale=scale, decode_only=decode, k_scale=k_scale,
                    v_scale=k_scale, **configs,
                )
            )  # fmt: skip
    gather_bytes = q.shape[0] * metadata.block_tables.shape[1] * BLOCK_SIZE * NUM_KV_HEADS
    gather_bytes *= HEAD_DIM * 4 * 2
    if with_peers and gather_bytes <= REFERENCE_GATHER_LIMIT:
        candidates["xla_reference"] = jax.jit(
            lambda q, c, m: ragged_paged_attention(q, c, LAYER, m, scale=scale)
        )
    for label, fn in candidates.items():
        result["timings"][label] = measure(fn, (q, cache, metadata), kv_bytes, iters, copy_bw)
    if with_peers and decode:
        try:
            fn, args = bundled_peer(q, cache, metadata)
            result["timings"]["jax_bundled_paged_attention"] = measure(
                fn, args, kv_bytes, iters, copy_bw
            )
        except Exception as error:  # the peer has its own shape rules; record, go on
            result["timings"]["jax_bundled_paged_attention"] = {"error": repr(error)[:500]}
    if "xla_reference" in candidates and "pallas_ragged" in result["timings"]:
        result["max_abs_error_vs_reference"] = max_error(candidates, q, cache, metadata)
    return result


def measure(
    fn: Callable[..., jax.Array], args: tuple, kv_bytes: int, iters: int, copy_bw: float
) -> dict:
    try:
        seconds = timed(fn, *args, iters=iters)
    except Exception as error:
        traceback.print_exc()
        return {"error": repr(error)[:500]}
    bandwidth = kv_bytes / seconds
    return {
        "us": seconds * 1e6,
        "kv_gb_per_s": bandwidth / 1e9,
        "fraction_of_copy_bw": bandwidth / copy_bw,
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
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="two decode shapes, no fp8")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run of the script itself")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    device = jax.devices()[0]
    copy_bw = copy_bandwidth(args.iters, 1 << 20 if args.tiny else 1 << 30)
    report = {
        "device": device.device_kind,
        "backend": jax.default_backend(),
        "sm_count": device_sm_count(device),
        "jax": jax.__version__,
        "copy_bandwidth_gb_per_s": copy_bw / 1e9,
        "config": dict(
            q_heads=NUM_Q_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block=BLOCK_SIZE
        ),
        "cases": [],
    }
    print(f"{device.device_kind}: copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
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

    for name, seqs, kv_dtype, decode in cases:
        with_peers = kv_dtype == jnp.bfloat16
        result = run_case(
            name, seqs, kv_dtype, decode=decode, iters=args.iters, copy_bw=copy_bw,
            with_peers=with_peers,
        )  # fmt: skip
        report["cases"].append(result)
        for label, timing in result["timings"].items():
            if "error" in timing:
                print(f"{name:24s} {result['kv_dtype']:14s} {label:28s} ERROR {timing['error']}")
            else:
                print(
                    f"{name:24s} {result['kv_dtype']:14s} {label:28s} {timing['us']:9.1f} us "
                    f"{timing['kv_gb_per_s']:7.0f} GB/s {timing['fraction_of_copy_bw']:6.1%}",
                    flush=True,
                )
        (args.out / "kernels.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'kernels.json'}")


if __name__ == "__main__":
    main()
