"""Soak: many short requests through one engine. Reports RSS at start and end (after a
warm-up batch, so compilation is excluded), the growth, and blocks in use after the drain.
Target: zero blocks in use, RSS growth under 5%.

    python benchmarks/soak.py [--requests 10000] [--batch 256]
        [--smoke (the tiny random model, 32 requests in waves of 16)]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, save_random_llama  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--batch", type=int, default=256, help="requests added per wave")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(requests=32, batch=16)
    args = parser.parse_args()

    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    model = str(save_random_llama()) if args.smoke else None
    llm = LLM(model, max_model_len=256, num_kv_blocks=kv_blocks(1, 16384), max_num_seqs=64)
    engine = llm.llm_engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def wave(count: int, start: int) -> None:
        for i in range(count):
            prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(4, 24))]
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                max_tokens=rng.randint(1, 8),
                seed=i,
                stop=["\n"] if rng.random() < 0.3 else None,
            )
            engine.add_request(f"r{start + i}", prompt, params)
            if rng.random() < 0.02:
                engine.abort_request(f"r{start + i}")
        while engine.has_unfinished_requests():
            engine.step()

    wave(args.batch, -args.batch)  # warm-up: compiles the shapes the waves use
    start_rss, start = rss_mib(), time.perf_counter()
    done = 0
    while done < args.requests:
        count = min(args.batch, args.requests - done)
        wave(count, done)
        done += count
    end_rss = rss_mib()
    core = engine.engine_core
    report(
        "soak",
        {
            "requests": args.requests,
            "seconds": time.perf_counter() - start,
            "rss_start_mib": start_rss,
            "rss_end_mib": end_rss,
            "rss_growth_pct": 100 * (end_rss - start_rss) / start_rss,
            "blocks_in_use_after_drain": core.kv_cache_manager.block_pool.num_used_blocks,
            "compilations": core.worker.runner.num_compilations,
        },
        smoke=args.smoke,
    )


if __name__ == "__main__":
    main()
