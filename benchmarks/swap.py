"""Preemption by swap against preemption by recompute, in one run: W2 (prompts of 32-512
tokens, max_tokens 16-512, greedy, ignore_eos) on the default model with a KV pool that holds
about a quarter of the requests at once, so requests are preempted again and again.

    python benchmarks/swap.py [--requests 16] [--pool-requests 4] [--model DIR]
        [--smoke (the tiny random model; 4 requests cut to 30-token prompts and 8 tokens,
        16-token blocks)]

Prints output tokens/s and preemptions (and how many swapped) for each mode, the
swap/recompute throughput ratio, and whether both produced the same tokens; writes
results/swap.json.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, save_random_llama, w2  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--pool-requests", type=int, default=4, help="requests the pool holds")
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(requests=4, pool_requests=2)
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    from models.loader import load_tokenizer
    from pagedjax import LLM, SamplingParams

    prompts, max_tokens = w2(load_tokenizer(args.model), args.requests)
    # Smoke: small blocks, so short requests still outgrow the pool and are preempted.
    small = dict(block_size=16, max_num_batched_tokens=16) if args.smoke else {}
    if args.smoke:
        prompts, max_tokens = [p[-30:] for p in prompts], [8] * len(prompts)
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    result: dict = {"requests": args.requests}
    tokens = {}
    for mode in ("recompute", "swap"):
        llm = LLM(
            args.model,
            max_model_len=longest,
            num_kv_blocks=kv_blocks(args.pool_requests, longest, small.get("block_size")),
            **small,
            preemption_mode=mode,
            enable_prefix_caching=False,  # recompute gets no help from the cache
        )
        llm.llm_engine.engine_core.warmup()  # every step shape compiled before the clock
        before = llm.llm_engine.stats()
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.llm_engine.stats()
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        result[f"{mode}_output_tokens_per_s"] = generated / seconds
        for key in ("num_preemptions", "num_swapped_preemptions", "num_compilations"):
            result[f"{mode}_{key}"] = stats[key] - before[key]
        tokens[mode] = [o.outputs[0].token_ids for o in outputs]
        assert stats["host_kv_blocks_used"] == 0 and stats["kv_blocks_used"] == 0
    result["swap_vs_recompute"] = (
        result["swap_output_tokens_per_s"] / result["recompute_output_tokens_per_s"]
    )
    result["same_tokens"] = tokens["swap"] == tokens["recompute"]
    report("swap", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
