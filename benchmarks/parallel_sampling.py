"""Parallel sampling (n > 1): the same prompts with n = 1, 4, 8 (temperature 0.8, seeded). The n
samples of a request share its prompt blocks (fork, copy-on-write of the last partial block), so
n = 8 should hold far fewer KV blocks than 8x the n = 1 run. Prefix caching is off so that only
the fork shares blocks.

    python benchmarks/parallel_sampling.py [--prompts 4] [--prompt-tokens 256] [--tokens 64]
        [--ns 1,4,8] [--max-num-seqs 64] [--model DIR]
        [--smoke (a tiny random model unless --model, 2 prompts x 80 tokens, n = 1 and 4)]

Reports per n: peak KV blocks in use (sampled after every step), output tokens/s over all
samples, and peak blocks / (n x peak blocks at n = 1). Writes results/parallel_sampling.json.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, save_random_llama, sized_prompts  # noqa: E402


def run(engine, prompts: list[list[int]], n: int, tokens: int, tag: str) -> tuple[int, int, float]:
    """(peak used blocks, output tokens, seconds) of the prompts with n samples each."""
    from pagedjax.sampling_params import SamplingParams

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(n=n, temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params)
    peak = generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += sum(len(c.token_ids) for c in output.outputs)
        peak = max(peak, engine.engine_core.kv_cache_manager.block_pool.num_used_blocks)
    return peak, generated, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per sample")
    parser.add_argument("--ns", default="1,4,8")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at a few tokens; flags still win
        parser.set_defaults(
            prompts=2, prompt_tokens=80, tokens=4, ns="1,4", max_num_batched_tokens=64,
            max_num_seqs=8,
        )  # fmt: skip
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    from pagedjax.llm import LLM

    ns = [int(n) for n in args.ns.split(",")]
    llm = LLM(
        args.model,
        max_model_len=args.prompt_tokens + args.tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        # room even without sharing
        num_kv_blocks=kv_blocks(args.prompts * max(ns), args.prompt_tokens + args.tokens),
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    prompts = sized_prompts(llm.get_tokenizer(), [args.prompt_tokens] * args.prompts)
    result = {
        "workload": f"{args.prompts} prompts x {args.prompt_tokens} tokens, {args.tokens} new "
        "tokens per sample, temperature 0.8",
        "warmup_s": engine.engine_core.worker.runner.warmup(),
    }
    for n in ns:  # untimed: compiles the sampler for this many rows
        run(engine, [p[:16] for p in prompts], n, 3, f"warm{n}")
    compiled = engine.engine_core.worker.runner.num_compilations
    peaks = {}
    for n in ns:
        peak, generated, seconds = run(engine, prompts, n, args.tokens, f"n{n}")
        peaks[n] = peak
        result[f"n{n}_peak_kv_blocks"] = peak
        result[f"n{n}_output_tokens_per_s"] = generated / seconds
        result[f"n{n}_seconds"] = seconds
        if ns[0] == 1:
            result[f"n{n}_blocks_vs_n_x_n1"] = peak / (n * peaks[1])
    result["compilations_after_warmup"] = (
        engine.engine_core.worker.runner.num_compilations - compiled
    )
    result["preemptions"] = engine.engine_core.scheduler.num_preemptions
    report("parallel_sampling", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
