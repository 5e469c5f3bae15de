"""Host-side share of engine steps with many running requests: scheduling, block management,
input preparation, sampling metadata, detokenization and stop checks, against the time spent
waiting for the device.

    python benchmarks/host_overhead.py [--running 256] [--steps 30]

The waiting is the time blocked on the step's device results (the only host sync of a step),
timed around a block_until_ready on the sampler's outputs right after dispatch; host time is
the rest of each engine.step(). (cProfile, used before, adds about 1 µs per Python call and
so overstates host time at 256 rows.)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, make_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help="decode steps measured")
    args = parser.parse_args()

    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    llm = LLM(
        None,
        max_model_len=512,
        max_num_batched_tokens=max(512, args.running),
        max_num_seqs=args.running,
        num_kv_blocks=kv_blocks(args.running, 384),
    )
    engine = llm.llm_engine
    engine.runner.warmup()
    prompts = make_prompts(llm.get_tokenizer(), args.running)
    for i, prompt in enumerate(prompts):
        # Seeded top-p sampling with a stop string: a per-row host path, not greedy only.
        params = SamplingParams(
            temperature=0.8,
            top_p=0.9,
            stop=["\n\n\n"],
            seed=i,
            max_tokens=10_000 // args.running + args.steps + 64,
            ignore_eos=True,
        )
        engine.add_request(str(i), prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()  # admit and prefill everyone
    for _ in range(3):  # compiles the sampler's variant for these rows
        engine.step()
    import jax

    from pagedjax.worker import model_runner

    waits = []
    dispatch_sample = model_runner.sample

    def sample_and_wait(*args, **kwargs):
        out = dispatch_sample(*args, **kwargs)
        start = time.perf_counter()
        jax.block_until_ready(out)  # the forward and the sampler, dispatched before this
        waits.append(time.perf_counter() - start)
        return out

    model_runner.sample = sample_and_wait
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - start
    model_runner.sample = dispatch_sample
    waiting = sum(waits)
    running = len(engine.scheduler.running)
    report(
        "host_overhead",
        {
            "running_requests": running,
            "steps": args.steps,
            "step_ms_mean": 1000 * total / args.steps,
            "device_wait_ms_per_step": 1000 * waiting / args.steps,
            "host_ms_per_step": 1000 * (total - waiting) / args.steps,
            "host_share": (total - waiting) / total,
        },
    )


if __name__ == "__main__":
    main()
