"""The CPU decode attention kernel (`pagedjax/cpu_native/csrc/paged_attention.cc`) at decode
steps of the default model's shape (SmolLM2-135M: 9 query and 3 KV heads of 64, 30 layers,
pages of 64 keys scattered over the pool), per KV-cache dtype: µs per layer and the KV bytes it
reads per second; optionally beside the same kernel at a git revision, in one process.

    python benchmarks/cpu_attention.py [--steps 32x300 1x4096] [--dtypes float32 float16]
        [--baseline-rev REV] [--repeats 9] [--smoke (one small step, float32, 2 repeats)]

A step `SxC` is S decode rows of about C keys each (C - 60 to C). Each timed call runs the 30
layers in turn, so the pool (every layer's pages) streams from memory as in a decode step. The
kernels take turns within each repeat; outputs are checked equal first. Medians are printed.
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

from pagedjax.cpu_native import attention, build  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 64  # SmolLM2-135M, the CPU's pages
BASELINE_TARGET = "pagedjax_paged_attention_baseline"


def attend(target: str, q, k, v, ones, layer, tables, lens, starts) -> jax.Array:
    """The kernel's FFI call (`attention.paged_attention_cpu`'s arguments) on a decode step."""
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q, k, v, ones, ones, jnp.reshape(layer, (1,)), jnp.zeros(1, jnp.int32), tables, lens,
        starts, scale=np.float32(HEAD_DIM**-0.5), soft_cap=np.float32(0), invariant=np.int64(0),
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames="target")
def all_layers(q, k, v, tables, lens, starts, target: str) -> jax.Array:
    """Every layer's attention in turn, each call's query depending on the last output."""
    ones = jnp.ones((LAYERS, KV_HEADS), jnp.float32)

    def layer(i, q):
        return q + 1e-30 * attend(target, q, k, v, ones, i, tables, lens, starts)

    return jax.lax.fori_loop(0, LAYERS, layer, q)


def step_arrays(rng, rows: int, context: int, dtype: str) -> tuple[tuple, int]:
    """A step's (q, k, v, tables, lens, starts) and the visible KV bytes of one layer."""
    pages = -(-context // BLOCK)
    num_blocks = rows * pages + 8
    shape = (LAYERS, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    k, v = (jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype) for _ in "kv")
    tables = rng.permutation(num_blocks)[: rows * pages].reshape(rows, pages).astype(np.int32)
    lens = rng.integers(max(1, context - 60), context + 1, rows).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((rows, Q_HEADS, HEAD_DIM), np.float32))
    starts = np.arange(rows + 1, dtype=np.int32)
    arrays = (q, k, v, jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(starts))
    return arrays, int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * jnp.dtype(dtype).itemsize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", nargs="+", default=["32x300", "32x1000", "1x4096"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--baseline-rev", default=None, help="git revision of an old kernel")
    parser.add_argument("--repeats", type=int, default=9)
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(steps=["2x100"], dtypes=["float32"], repeats=2)
    args = parser.parse_args()
    assert build.available()
    targets = {"today": f"{attention.TARGET}_{build.isa()}"}
    if args.baseline_rev:
        register_baseline(
            args.baseline_rev, "paged_attention.cc", "PagedAttention", BASELINE_TARGET
        )
        targets[args.baseline_rev] = BASELINE_TARGET
    rng = np.random.default_rng(0)
    result: dict = {"cpu_isa": build.isa(), "baseline_rev": args.baseline_rev}
    for step in args.steps:
        rows, context = map(int, step.split("x"))
        for dtype in args.dtypes:
            arrays, layer_bytes = step_arrays(rng, rows, context, dtype)
            outs = {name: np.asarray(all_layers(*arrays, target=t)) for name, t in targets.items()}
            assert all(np.array_equal(outs["today"], o) for o in outs.values()), step
            times: dict[str, list[float]] = {name: [] for name in targets}
            for _ in range(args.repeats):
                for name, target in targets.items():
                    start = time.perf_counter()
                    all_layers(*arrays, target=target).block_until_ready()
                    times[name].append((time.perf_counter() - start) / LAYERS * 1e6)
            medians = {name: statistics.median(runs) for name, runs in times.items()}
            for name, us in medians.items():
                result[f"{step}_{dtype}_{name}_us_per_layer"] = us
                result[f"{step}_{dtype}_{name}_GB_per_s"] = layer_bytes / us / 1e3
                if name != "today":  # the revision's time over today's
                    result[f"{step}_{dtype}_{name}/today"] = us / medians["today"]
            del arrays
    report("cpu_attention", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
