"""One user's latency against llama.cpp, in the same run on the same GGUF file (the default
model): batch-1 decode ms/token after a short prompt and at a long context, and the prefill
rate of that long prompt. llama.cpp runs through llama-cpp-python (a benchmark dependency,
never CI's: `pip install llama-cpp-python` builds it from source, about 10 minutes on 2 cores)
with as many threads as JAX's CPU client uses here.

    python benchmarks/latency_vs_llamacpp.py [--long 7900] [--tokens 64] [--threads 2]
        [--repeats 2] [--kv-cache-dtypes auto,float16] [--int8-activations]
        [--smoke (one engine, prompts of 16 and 64 tokens, 4 decoded, one run; llama.cpp if
        installed)]

Both read the same prompt token ids; decode is greedy (argmax) for both; runs take turns and
medians are quoted. llama.cpp keeps an f16 KV cache; pagedjax runs with each KV dtype asked
for (auto: float32 on the CPU). Speculative decoding's numbers are `spec_decode.py`'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import sized_prompts  # noqa: E402


def pagedjax_latency(engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(prefill seconds, median decode seconds per token) of one request alone."""
    from pagedjax.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(str(time.monotonic()), prompt, params)
    stamps = [time.perf_counter()]
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
        stamps.append(time.perf_counter())
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    # The last steps (after the prompt's chunks) each add one token.
    decode = steps[-(tokens - 1) :]
    return first - stamps[0], statistics.median(decode)


def llamacpp_latency(llm, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(prefill seconds, median decode seconds per token), greedy on the last logits."""
    import llama_cpp
    import numpy as np

    def last_logits() -> np.ndarray:  # `scores` keeps only a batch's rows
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), (llm.n_vocab(),))

    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - start
    times = []
    for _ in range(tokens - 1):
        token = int(np.argmax(last_logits()))
        start = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - start)
    return prefill, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=40, help="short prompt tokens")
    parser.add_argument("--long", type=int, default=7900, help="long prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per run")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs (median)")
    parser.add_argument(
        "--kv-cache-dtypes", default="auto,float16", help="pagedjax engines (llama.cpp: f16)"
    )
    parser.add_argument(
        "--int8-activations", action="store_true", help="also each dtype's int8_activations engine"
    )
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at a few tokens; flags still win
        parser.set_defaults(short=16, long=64, tokens=4, repeats=1, kv_cache_dtypes="auto")
    args = parser.parse_args()

    from models.loader import resolve_model_path
    from pagedjax.config import EngineConfig
    from pagedjax.cpu_native.build import isa
    from pagedjax.engine import LLMEngine

    max_len = args.long + args.tokens + 64
    engines = {}
    for dtype in args.kv_cache_dtypes.split(","):
        for int8 in (False, True) if args.int8_activations else (False,):
            # No prefix caching: every run prefills its whole prompt, as llama.cpp's eval does.
            config = EngineConfig(
                max_model_len=max_len,
                # A smoke run's short contexts fit a small pool, quicker to allocate and fill.
                kv_cache_memory_bytes=(64 << 20) if args.smoke else 2 << 30,
                kv_cache_dtype=dtype,
                enable_prefix_caching=False,
                int8_activations=int8,
            )
            engines[f"pagedjax_{dtype}" + ("_int8" if int8 else "")] = LLMEngine(config)
    tokenizer = next(iter(engines.values())).tokenizer
    short, long = sized_prompts(tokenizer, [args.short, args.long])
    prompts = {"short": short, "long": long}
    runs = {
        name: (lambda p, n, e=engine: pagedjax_latency(e, p, n)) for name, engine in engines.items()
    }
    try:
        from llama_cpp import Llama

        llm = Llama(
            model_path=str(resolve_model_path(None).path),
            n_ctx=max_len,
            n_threads=args.threads,
            n_batch=512,
            verbose=False,
        )
        runs["llamacpp"] = lambda p, n: llamacpp_latency(llm, p, n)
    except ImportError:
        print("llama-cpp-python is not installed: pip install llama-cpp-python (builds it)")
    for run in runs.values():
        run(prompts["short"], 8)  # compiles the step shapes
    timings = {(name, kind): [] for name in runs for kind in prompts}
    for _ in range(args.repeats):  # taking turns: the same machine state for each
        for kind, prompt in prompts.items():
            for name, run in runs.items():
                timings[name, kind].append(run(prompt, args.tokens))
    result: dict = {"threads": args.threads, "repeats": args.repeats, "tokens": args.tokens}
    result["cpu_isa"] = isa()
    for (name, kind), values in timings.items():
        prefill = statistics.median(v[0] for v in values)
        result[f"{name}_{kind}_decode_ms_per_token"] = 1e3 * statistics.median(v[1] for v in values)
        result[f"{name}_{kind}_prefill_tok_per_s"] = len(prompts[kind]) / prefill
    if "llamacpp" in runs:
        for name in engines:
            for kind in prompts:
                theirs = result[f"llamacpp_{kind}_decode_ms_per_token"]
                ours = result[f"{name}_{kind}_decode_ms_per_token"]
                result[f"{name}_{kind}_decode_speedup"] = theirs / ours
                result[f"{name}_{kind}_prefill_speedup"] = (
                    result[f"{name}_{kind}_prefill_tok_per_s"]
                    / result[f"llamacpp_{kind}_prefill_tok_per_s"]
                )
    report("latency_vs_llamacpp", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
