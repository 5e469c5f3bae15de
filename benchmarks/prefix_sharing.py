"""Prefix caching on a shared system prompt: N requests share a ~1,024-token system prompt and
differ in a short question; the same workload runs on an engine with prefix caching on and one
with it off (same weights, same process).

    python benchmarks/prefix_sharing.py [--requests 8] [--tokens 16] [--system-tokens 1024]
        [--max-num-batched-tokens 512] [--max-num-seqs 64] [--model DIR]
        [--smoke (3 requests sharing ~128 tokens, 4 new tokens each, on a tiny random model)]

Reports per mode: seconds, output and total tokens/s, prompt tokens, prefill tokens actually
computed (counted from the scheduler's output: scheduled tokens below each prompt's length),
prompt tokens minus prefix-cache hits (from PrefixCacheStats), hit rate. Writes
results/prefix_sharing.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import TOPICS, chat_ids, kv_blocks, save_random_llama, system_prompt  # noqa: E402


def run(engine, prompts: list[list[int]], tokens: int) -> dict:
    """Runs all prompts at once; counts the prompt tokens the scheduler actually sends."""
    from pagedjax.sampling_params import SamplingParams

    schedule = engine.engine_core.scheduler.schedule
    computed = 0

    def counting_schedule():
        nonlocal computed
        out = schedule()
        # The requests' counts already include this step's tokens; out.chunks() has them
        # before it.
        for (request, num_new), (start, _) in zip(out.scheduled, out.chunks(), strict=True):
            computed += max(0, min(num_new, request.num_prompt_tokens - start))
        return out

    engine.engine_core.scheduler.schedule = counting_schedule
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    stats = engine.engine_core.kv_cache_manager.prefix_cache_stats
    return {
        "seconds": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + prompt_tokens) / elapsed,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": computed,
        "prompt_tokens_minus_cache_hits": prompt_tokens - stats.hits,
        "prefix_cache_hit_rate": stats.hit_rate,
        "steps": engine.engine_core.num_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per request")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(
            requests=3, tokens=4, system_tokens=128, max_num_batched_tokens=16, max_num_seqs=4
        )
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    from models.loader import load_model, load_tokenizer
    from pagedjax.config import EngineConfig
    from pagedjax.engine import LLMEngine
    from pagedjax.platforms import current_platform

    # As the engine loads the model itself: the GGUF's quantized weights where they run.
    platform = current_platform()
    keep_blocks = platform.keeps_quantized_weights("float32")
    model_config, params = load_model(args.model, keep_blocks=keep_blocks)
    tokenizer = load_tokenizer(args.model)
    system = system_prompt(tokenizer, args.system_tokens)
    prompts = [
        chat_ids(tokenizer, f"Question {i}: in one sentence, what is {TOPICS[i % 12]}?", system)
        for i in range(args.requests)
    ]
    longest = max(len(p) for p in prompts) + args.tokens
    block_size = platform.default_block_size
    result = {
        "workload": f"{args.requests} requests, shared system prompt, {args.tokens} new tokens",
        "prompt_tokens_each": f"{min(map(len, prompts))}-{max(map(len, prompts))}",
    }
    for mode, caching in (("caching_on", True), ("caching_off", False)):
        config = EngineConfig(
            max_model_len=-(-longest // block_size) * block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            num_kv_blocks=kv_blocks(args.requests, longest, block_size),
            enable_prefix_caching=caching,
        )
        engine = LLMEngine(config, model_config, params, tokenizer)
        if caching:  # the jit cache is shared: the second engine needs no warmup
            result["warmup_s"] = engine.engine_core.worker.runner.warmup()
        result.update({f"{mode}_{k}": v for k, v in run(engine, prompts, args.tokens).items()})
        result[f"{mode}_compilations"] = engine.engine_core.worker.runner.num_compilations
        del engine
        gc.collect()
    result["speedup_caching_on_vs_off"] = (
        result["caching_off_seconds"] / result["caching_on_seconds"]
    )
    report("prefix_sharing", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
