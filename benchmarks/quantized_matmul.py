"""The block-code matmul kernel (`pagedjax/cpu_native/csrc/packed_matmul.cc`, QuantizedMatmul)
at each instruction-set level this machine runs (`build.levels()`: AVX-512, AVX2, portable),
and optionally the same kernel at a git revision, in one process, at the default model's
(SmolLM2-135M) decode shapes.

    python benchmarks/quantized_matmul.py [--rows 1] [--levels avx512 avx2] [--baseline-rev REV]
        [--repeats 15] [--shapes wqkv wo w_gate_up w_down lm_head]
        [--smoke (the wo shape only, 2 weights, one timed chain, the best level and int8)]

The baseline is the revision's `packed_matmul.cc` (with its headers), compiled like the
engine's kernels at this machine's best level and registered under another FFI target. Each
layer shape runs as a chain of `--layers` distinct random 4-bit weights (x feeds the next call),
so the weights stream from memory as in a decode step; the 8-bit LM head is one weight (35 MB,
past the L3). The kernels take turns, `--iters` chains each per repeat; the table holds the
median microseconds per matmul and each one's time over the first level's. Every kernel's
outputs are checked equal bit for bit first.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from kernel_baseline import register_baseline  # noqa: E402  (benchmarks/ is the script directory)
from report import add_smoke_flag, report  # noqa: E402

from pagedjax.cpu_native import build, matmul  # noqa: E402

BASELINE_TARGET = "pagedjax_quantized_matmul_baseline"
H, Q, KV, INTER, VOCAB = 576, 576, 192, 1536, 49152  # SmolLM2-135M
SHAPES = {  # name: (K, N, bits)
    "wqkv": (H, Q + 2 * KV, 4),
    "wo": (Q, H, 4),
    "w_gate_up": (H, 2 * INTER, 4),
    "w_down": (INTER, H, 4),
    "lm_head": (H, VOCAB, 8),
}


def random_weight(rng, k: int, n: int, bits: int) -> tuple[np.ndarray, ...]:
    """pack_blocks's arguments for a random [K, N] weight."""
    codes = rng.integers(0, 256, (k * bits // 8, n), dtype=np.uint8)
    scales = (rng.random((k // 32, n)) * 0.02).astype(np.float16).astype(np.float32)
    offsets = -(2 ** (bits - 1)) * scales if bits == 4 else np.zeros_like(scales)
    return codes, scales, offsets


def chain(target: str, x: jax.Array, weights: list) -> jax.Array:
    """x through every weight in turn (each call's input depends on the previous output)."""
    for w in weights:
        out_shape = jax.ShapeDtypeStruct((x.shape[0], w.columns), jnp.float32)
        y = jax.ffi.ffi_call(target, out_shape)(
            x, w.codes, w.scales, w.offsets, columns=np.int64(w.columns), bits=np.int64(w.bits)
        )
        x = x + 1e-30 * y[:, :1]
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="M of x [M, K]")
    parser.add_argument("--levels", nargs="+", default=None, help="default: every level here")
    parser.add_argument("--baseline-rev", default=None, help="git revision of an old kernel")
    parser.add_argument(
        "--int8", action="store_true", help="also the int8-activation kernel at each level"
    )
    parser.add_argument("--layers", type=int, default=30, help="weights per layer shape")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--iters", type=int, default=10, help="chains per timed repeat")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the smallest shape, one level and int8: that it runs
        parser.set_defaults(
            layers=2, repeats=1, iters=1, shapes=["wo"], levels=build.levels()[:1], int8=True
        )
    args = parser.parse_args()
    assert build.available()
    levels = args.levels or build.levels()
    targets = {level: f"{matmul.QUANTIZED_TARGET}_{level}" for level in levels}
    for level in levels:
        assert build.load(level), level
    if args.baseline_rev:
        register_baseline(args.baseline_rev, "packed_matmul.cc", "QuantizedMatmul", BASELINE_TARGET)
        targets[args.baseline_rev] = BASELINE_TARGET
    if args.int8:  # llama.cpp's numerics: compared with each other, not with the float32 sums
        targets |= {f"int8_{level}": f"{matmul.INT8_TARGET}_{level}" for level in levels}
    if args.smoke:
        print(
            f"smoke: the kernel at {list(targets)}, shapes {' '.join(args.shapes)}, "
            f"rows {args.rows}, {args.layers} weights, {args.repeats}x{args.iters} chains"
        )

    rng = np.random.default_rng(0)
    result: dict = {"levels": levels, "baseline_rev": args.baseline_rev}
    for name in args.shapes:
        k, n, bits = SHAPES[name]
        blocks = [
            random_weight(rng, k, n, bits) for _ in range(1 if name == "lm_head" else args.layers)
        ]
        packed = [matmul.pack_blocks(*b, bits) for b in blocks]
        dot = [matmul.pack_int8(*b, bits) for b in blocks] if args.int8 else []
        for rows in args.rows:
            x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
            runs = {
                kind: functools.partial(
                    jax.jit(lambda x, ws, t=target: chain(t, x, ws)),
                    ws=dot if kind.startswith("int8_") else packed,
                )
                for kind, target in targets.items()
            }
            outs = {kind: np.asarray(run(x)) for kind, run in runs.items()}
            for family in ({k for k in outs if k.startswith("int8_")}, set(levels)):
                same = [outs[kind] for kind in family]
                assert all(np.array_equal(same[0], o) for o in same), f"{name} M={rows}: differ"
            times: dict[str, list[float]] = {kind: [] for kind in runs}
            for _ in range(args.repeats):
                for kind, run in runs.items():
                    start = time.perf_counter()
                    for _ in range(args.iters):
                        out = run(x)
                    out.block_until_ready()
                    per_call = (time.perf_counter() - start) / (args.iters * len(blocks))
                    times[kind].append(1e6 * per_call)
            key = f"M{rows}_{name}_{k}x{n}_q{bits}"
            first = statistics.median(times[levels[0]])
            for kind, runs_us in times.items():
                result[f"{key}_{kind}_us"] = statistics.median(runs_us)
                if kind != levels[0]:
                    result[f"{key}_{kind}/{levels[0]}"] = statistics.median(runs_us) / first
    report("quantized_matmul", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
