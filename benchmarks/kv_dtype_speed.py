"""Batch-1 decode speed of the default model with each KV-cache dtype, at several context lengths.

One engine per dtype (float32, bfloat16, float16, fp8), all built first; the default model as the
engine loads it (its GGUF's quantized weights). The contexts are prefixes of one long chat
prompt (`workloads.sized_prompts`), so prefix caching makes each engine prefill the longest
once. Each context is first run untimed (prefill, compiles); then every timed repeat submits
it again (all but its last block cached) and times the decode steps: ms/token is their time
over the tokens they produced. Repeats take turns across dtypes, so a busy host slows all of
them alike. Reports the median over repeats and its ratio to float32 at the same context.

    python benchmarks/kv_dtype_speed.py [--contexts 64,4096,8192] [--tokens 16] [--repeats 3]
        [--dtypes float32,bfloat16,float16,fp8] [--attention-backend auto] [--model DIR]
        [--smoke (a tiny random model unless --model, contexts 16,48, 2 tokens, 1 repeat)]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, save_random_llama, sized_prompts  # noqa: E402


def decode_ms_per_token(engine, prompt: list[int], tokens: int, request_id: str) -> float:
    """Runs one greedy request of `tokens` + 1 new tokens; the decode steps' ms per token
    (steps once the first token is out: the prompt, cached or not, is not in it)."""
    from pagedjax.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    generated = first = 0
    decode_s = 0.0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if generated:
            decode_s += elapsed
        else:
            first = len(outputs[0].outputs[0].token_ids) if outputs else 0
        for output in outputs:
            generated = len(output.outputs[0].token_ids)
    return 1000 * decode_s / max(generated - first, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--contexts", default=None, help="prompt tokens, ascending (default 64,4096,8192)"
    )
    parser.add_argument(
        "--tokens", type=int, default=None, help="decode steps timed per repeat (default 16)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="default 3")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16,fp8")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    args.contexts = args.contexts or ("16,48" if args.smoke else "64,4096,8192")
    args.tokens = args.tokens or (2 if args.smoke else 16)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())
    contexts = sorted(int(c) for c in args.contexts.split(","))
    dtypes = args.dtypes.split(",")

    from pagedjax.config import EngineConfig
    from pagedjax.engine import LLMEngine

    max_model_len = contexts[-1] + args.tokens + 64
    engines = {}
    for dtype in dtypes:
        config = EngineConfig(
            model=args.model,
            max_model_len=max_model_len,
            # Two requests' worth: a repeat's new blocks never evict the cached prompt.
            num_kv_blocks=kv_blocks(2, max_model_len),
            kv_cache_dtype=dtype,
            attention_backend=args.attention_backend,
        )
        engines[dtype] = LLMEngine(config)
    tokenizer = engines[dtypes[0]].tokenizer
    longest = sized_prompts(tokenizer, [contexts[-1]])[0]
    prompts = {n: longest[:n] for n in contexts}

    result = {
        "workload": f"batch 1, contexts {contexts} prompt tokens, {args.tokens} decode "
        f"tokens x {args.repeats} repeats",
        "attention": {d: e.engine_core.worker.attention.name for d, e in engines.items()},
    }
    start = time.perf_counter()
    for n in contexts:  # untimed: prefill (the longer ones mostly from the cache) and compiles
        for dtype, engine in engines.items():
            decode_ms_per_token(engine, prompts[n], args.tokens, f"warm-{dtype}-{n}")
    result["untimed_first_runs_s"] = time.perf_counter() - start
    runs = {(d, n): [] for d in dtypes for n in contexts}
    for repeat in range(args.repeats):
        for n in contexts:
            for dtype, engine in engines.items():
                ms = decode_ms_per_token(engine, prompts[n], args.tokens, f"{dtype}-{n}-{repeat}")
                runs[dtype, n].append(ms)
    for n in contexts:
        base = statistics.median(runs[dtypes[0], n])
        for dtype in dtypes:
            ms = statistics.median(runs[dtype, n])
            result[f"ctx{n}_{dtype}_ms_per_token"] = ms
            result[f"ctx{n}_{dtype}_runs_ms"] = [round(x, 1) for x in runs[dtype, n]]
            if dtype != dtypes[0]:
                result[f"ctx{n}_{dtype}_vs_{dtypes[0]}"] = ms / base
    report("kv_dtype_speed", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
