"""Load time, first-step compile time and batch-1 decode latency of the default model on the
engine, with transformers running the same greedy decode in the same process for the ratio.

    python benchmarks/model_timing.py [--tokens 64] [--repeats 3] [--skip-peer] [--model PATH]
        [--smoke (a tiny random model unless --model, 4 tokens, one repeat)]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, load_peer, save_random_llama  # noqa: E402

PROMPT = "Explain in a few sentences why the sky is blue."


def engine_decode(engine, prompt_ids: list[int], tokens: int) -> list[float]:
    """Seconds of each engine step for one request: the prefill step, then decode steps."""
    from pagedjax.sampling_params import SamplingParams

    request_id = str(time.monotonic())
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(request_id, prompt_ids, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-peer", action="store_true", help="do not run transformers")
    parser.add_argument("--model", default=None, help="a model directory or .gguf file")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at a few tokens; flags still win
        parser.set_defaults(tokens=4, repeats=1)
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    start = time.perf_counter()
    from pagedjax.config import EngineConfig
    from pagedjax.engine import LLMEngine

    imported = time.perf_counter()
    # The engine loads the model itself: only then does it keep a GGUF's quantized weights.
    engine = LLMEngine(
        EngineConfig(args.model, max_model_len=1024, num_kv_blocks=kv_blocks(1, 4096))
    )
    built = time.perf_counter()
    tokenizer = engine.tokenizer

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    first = engine_decode(engine, prompt_ids, args.tokens)  # compiles prefill and decode shapes
    decode = [
        t for _ in range(args.repeats) for t in engine_decode(engine, prompt_ids, args.tokens)[1:]
    ]
    result = {
        "import_s": imported - start,
        "engine_build_s (model, tokenizer, packing)": built - imported,
        "first_step_s (prefill, compiles)": first[0],
        "first_decode_step_s (compiles)": first[1],
        "compilations": engine.engine_core.worker.runner.num_compilations,
        "decode_ms_per_token_median": 1000 * statistics.median(decode),
        "prompt_tokens": len(prompt_ids),
    }

    if not args.skip_peer:
        import torch

        t0 = time.perf_counter()
        hf = load_peer(args.model)
        result["peer_load_s"] = time.perf_counter() - t0
        ids = torch.tensor([prompt_ids])
        per_token = []
        for _ in range(args.repeats):
            with torch.no_grad():
                t0 = time.perf_counter()
                hf.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=2)
                t1 = time.perf_counter()
                out = hf.generate(
                    ids,
                    max_new_tokens=args.tokens,
                    min_new_tokens=args.tokens,
                    do_sample=False,
                    pad_token_id=2,
                )
                t2 = time.perf_counter()
            new = out.shape[1] - len(prompt_ids)
            per_token.append(((t2 - t1) - (t1 - t0)) / max(new - 1, 1))
        result["peer_decode_ms_per_token_median"] = 1000 * statistics.median(per_token)
        result["decode_speedup_vs_peer"] = (
            result["peer_decode_ms_per_token_median"] / result["decode_ms_per_token_median"]
        )

    report("model_timing", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
