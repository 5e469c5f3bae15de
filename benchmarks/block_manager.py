"""Host-side cost of the KV cache manager, as a scheduler would drive it.

1. Scheduler-like steps: 256 running requests decoding one token each per step, contexts up
   to 2048 tokens, block_size 16. A request that reaches 2048 tokens is freed and replaced by
   a new one whose prompt shares a 512-token system prefix (admission: prefix lookup plus a
   whole-prompt allocation). A step's time covers every manager call and the token appends.
2. Single block operations (allocate, free, cache hit out of the middle of the free queue)
   at pool sizes from 10k to 1M blocks: their cost must not grow with the pool.

Run: python benchmarks/block_manager.py [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

from pagedjax.core import KVCacheManager, Request

BLOCK_SIZE = 16
MAX_CONTEXT = 2048
NUM_RUNNING = 256
SYSTEM_PREFIX = 512


def _new_request(rng: random.Random, request_id: int, system_prefix: list[int]) -> Request:
    prompt_len = rng.randint(SYSTEM_PREFIX + 1, MAX_CONTEXT - 64)
    prompt = system_prefix + [rng.randrange(32000) for _ in range(prompt_len - SYSTEM_PREFIX)]
    return Request(request_id, prompt)


def _admit(manager: KVCacheManager, request: Request) -> None:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    if manager.allocate_slots(request, num_new, hits, num_hit_tokens) is None:
        raise RuntimeError("pool too small for the benchmark workload")
    request.num_computed_tokens = request.num_tokens
    request.append_token_ids(1)


def bench_steps(num_blocks: int, num_steps: int, seed: int = 0) -> dict:
    """Microseconds per scheduler-like step with NUM_RUNNING requests."""
    rng = random.Random(seed)
    system_prefix = [rng.randrange(32000) for _ in range(SYSTEM_PREFIX)]
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    running: list[Request] = []
    next_id = 0
    for _ in range(NUM_RUNNING):
        request = _new_request(rng, next_id, system_prefix)
        next_id += 1
        _admit(manager, request)
        # Stagger progress so that requests finish at a steady rate, not all at once.
        for _ in range(rng.randrange(MAX_CONTEXT - request.num_tokens)):
            request.append_token_ids(1)
        request.num_computed_tokens = request.num_tokens - 1
        manager.free(request)
        request.num_computed_tokens = 0
        _admit_resumed(manager, request)
        running.append(request)

    step_times = []
    admissions = 0
    gc.collect()
    gc.disable()
    try:
        for _ in range(num_steps):
            start = time.perf_counter()
            for index, request in enumerate(running):
                if request.num_tokens >= MAX_CONTEXT:
                    manager.free(request)
                    request = running[index] = _new_request(rng, next_id, system_prefix)
                    next_id += 1
                    _admit(manager, request)
                    admissions += 1
                    continue
                if manager.allocate_slots(request, 1) is None:
                    raise RuntimeError("pool too small for the benchmark workload")
                request.num_computed_tokens += 1
                request.append_token_ids(7)
            manager.pop_block_copies()
            step_times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    step_us = [t * 1e6 for t in step_times]
    return {
        "num_blocks": num_blocks,
        "steps": num_steps,
        "admissions": admissions,
        "mean_us_per_step": statistics.fmean(step_us),
        "median_us_per_step": statistics.median(step_us),
        "p99_us_per_step": sorted(step_us)[int(0.99 * len(step_us))],
        "hit_rate": manager.prefix_cache_stats.hit_rate,
        "usage": manager.usage,
    }


def _admit_resumed(manager: KVCacheManager, request: Request) -> None:
    """Re-admit a request whose tokens are all known (setup only): computes all but the last."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = request.num_tokens - 1 - num_hit_tokens
    if manager.allocate_slots(request, num_new, hits, num_hit_tokens) is None:
        raise RuntimeError("pool too small for the benchmark workload")
    request.num_computed_tokens = request.num_tokens - 1


def bench_block_ops(num_blocks: int, rounds: int = 2000, seed: int = 0) -> dict:
    """Per-block cost of allocate / free / cache-hit with the pool about half full of cache."""
    rng = random.Random(seed)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    pool = manager.block_pool
    # Fill the pool with cached content, then free it: every later allocation evicts.
    filler_tokens = 0
    while pool.num_free_blocks > BLOCK_SIZE * 64:
        request = Request(("fill", filler_tokens), [rng.randrange(32000) for _ in range(4096)])
        filler_tokens += 1
        manager.get_computed_blocks(request)
        manager.allocate_slots(request, request.num_tokens)
        manager.free(request)
    # A cached chain that later requests hit while it sits in the free queue's middle.
    shared = Request("shared", [rng.randrange(32000) for _ in range(16 * BLOCK_SIZE + 1)])
    manager.get_computed_blocks(shared)
    manager.allocate_slots(shared, shared.num_tokens)
    manager.free(shared)

    alloc_s = free_s = hit_s = 0.0
    num_alloc = num_free = num_hit = 0
    gc.collect()
    gc.disable()
    try:
        for round_index in range(rounds):
            start = time.perf_counter()
            blocks = pool.get_new_blocks(16)
            alloc_s += time.perf_counter() - start
            num_alloc += 16
            start = time.perf_counter()
            pool.free_blocks(reversed(blocks))
            free_s += time.perf_counter() - start
            num_free += 16
            request = Request(("hit", round_index), shared.all_token_ids)
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            start = time.perf_counter()
            pool.touch(hits)
            hit_s += time.perf_counter() - start
            num_hit += len(hits)
            pool.free_blocks(reversed(hits))
            manager.free(request)
    finally:
        gc.enable()
    return {
        "num_blocks": num_blocks,
        "alloc_us_per_block": alloc_s / num_alloc * 1e6,
        "free_us_per_block": free_s / num_free * 1e6,
        "hit_touch_us_per_block": hit_s / max(num_hit, 1) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/block_manager.json"))
    args = parser.parse_args()

    results: dict = {"steps": [], "block_ops": []}
    print(f"scheduler-like steps: {NUM_RUNNING} running, contexts <= {MAX_CONTEXT}, "
          f"block_size {BLOCK_SIZE}")
    # 256 x 2048 tokens need 32768 blocks: 40k is nearly full (eviction on every admission).
    for num_blocks in (40_000, 1_000_000):
        row = bench_steps(num_blocks, args.steps)
        results["steps"].append(row)
        print(
            f"  {num_blocks:>9,} blocks: {row['mean_us_per_step']:7.1f} us/step mean, "
            f"{row['median_us_per_step']:7.1f} median, {row['p99_us_per_step']:7.1f} p99 "
            f"({row['admissions']} admissions, hit rate {row['hit_rate']:.0%}, "
            f"usage {row['usage']:.0%})"
        )
    print("single block operations (us per block):")
    for num_blocks in (10_000, 100_000, 1_000_000):
        row = bench_block_ops(num_blocks)
        results["block_ops"].append(row)
        print(
            f"  {num_blocks:>9,} blocks: allocate {row['alloc_us_per_block']:.3f}, "
            f"free {row['free_us_per_block']:.3f}, hit {row['hit_touch_us_per_block']:.3f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
