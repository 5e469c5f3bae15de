"""What batch_invariant=True costs (`docs/batch_invariance.md`): the default model with and
without it, in one run, the two engines taking turns, medians of --repeats:

- batch-1 decode: ms per token of one chat prompt's greedy 128 tokens (a one-token step
  pads to 2);
- W1 throughput: 32 chat prompts of 25-200 tokens, 64 new tokens each, output tokens/s;
- long prefill: one prompt of --prefill-tokens tokens, prompt tokens/s (each query by the
  decode path: no page read once for a tile of queries);
- long decode: ms per token of 32 greedy tokens after that prompt (first token to last).

    python benchmarks/batch_invariance.py [--repeats 3] [--prefill-tokens 4000] [--model DIR]
        [--smoke (a tiny random model unless --model, a few tokens of each case)]

Writes results/batch_invariance.json.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import chat_ids, make_prompts, save_random_llama, sized_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--smoke: 1)")
    parser.add_argument(
        "--prefill-tokens", type=int, default=None, help="default 4000 (--smoke: 200)"
    )
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.smoke else 3)
    # Smoke: the fewest for which max_model_len (prefill + 64) holds W1's longest prompt.
    args.prefill_tokens = args.prefill_tokens or (200 if args.smoke else 4000)
    # New tokens of batch-1 decode, W1 prompts, W1's new tokens each, long decode's tokens.
    decode_n, w1_n, batch_n, long_n = (4, 4, 4, 4) if args.smoke else (128, 32, 64, 32)
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    max_len = args.prefill_tokens + 64
    engines = {
        # No prefix caching: every repeat computes its prompts again.
        mode: LLM(
            args.model,
            max_model_len=max_len,
            enable_prefix_caching=False,
            batch_invariant=mode == "batch_invariant",
        )
        for mode in ("default", "batch_invariant")
    }
    tokenizer = engines["default"].get_tokenizer()
    one = [chat_ids(tokenizer, "Tell me a long story about a lighthouse keeper.")]
    w1 = make_prompts(tokenizer, w1_n)
    long_prompt = sized_prompts(tokenizer, [args.prefill_tokens])

    def timed(llm, prompts, sampling) -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        if sampling is long_decode:  # the decode after the prompt's prefill
            metrics = outputs[0].metrics
            return metrics.finished_time - metrics.first_token_time
        return time.perf_counter() - start

    decode = SamplingParams(temperature=0, max_tokens=decode_n, ignore_eos=True)
    batch = SamplingParams(temperature=0, max_tokens=batch_n, ignore_eos=True)
    prefill = SamplingParams(temperature=0, max_tokens=1)
    long_decode = SamplingParams(temperature=0, max_tokens=long_n + 1, ignore_eos=True)
    cases = {
        "batch1_decode_ms_per_token": (one, decode, lambda s: 1000 * s / decode_n),
        "w1_output_tokens_per_s": (w1, batch, lambda s: w1_n * batch_n / s),
        "prefill_tokens_per_s": (long_prompt, prefill, lambda s: args.prefill_tokens / s),
        "long_decode_ms_per_token": (long_prompt, long_decode, lambda s: 1000 * s / long_n),
    }
    for llm in engines.values():  # compile every shape first
        for prompts, sampling, _ in cases.values():
            timed(llm, prompts, sampling)
    samples: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            for case, (prompts, sampling, measure) in cases.items():
                samples.setdefault(f"{mode}_{case}", []).append(
                    measure(timed(llm, prompts, sampling))
                )
    result: dict = {
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "repeats": args.repeats,
    }
    result.update({key: float(np.median(values)) for key, values in samples.items()})
    for case in cases:
        ratio = result[f"batch_invariant_{case}"] / result[f"default_{case}"]
        result[f"ratio_{case}"] = ratio  # batch_invariant / default
    report("batch_invariance", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
