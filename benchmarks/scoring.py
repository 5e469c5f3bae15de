"""Scoring texts (every token's logprob given the ones before it, e.g. for perplexity) with
`SamplingParams(prompt_logprobs=0, max_tokens=1)` on the default model, against transformers'
forward + log-softmax on the same texts in the same process.

    python benchmarks/scoring.py [--texts 16] [--length 256] [--repeats 3] [--skip-peer]
        [--model PATH]
        [--smoke (2 texts of 32 tokens, once, on a tiny random model; the peer too, unless
        --skip-peer)]

Reports scored tokens/s of each (medians of the repeats), their ratio, and the largest
difference between the two sets of logprobs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, load_peer, save_random_llama, sized_prompts  # noqa: E402


def engine_scores(llm, texts: list[list[int]]) -> list[np.ndarray]:
    """Each text's logprobs of its tokens after the first."""
    from pagedjax.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(texts, params, use_tqdm=False)
    scores = []
    for text, out in zip(texts, outputs, strict=True):
        pairs = zip(text[1:], out.prompt_logprobs[1:], strict=True)
        scores.append(np.array([entry[token].logprob for token, entry in pairs]))
    return scores


def peer_scores(hf, texts: list[list[int]], batch: int) -> list[np.ndarray]:
    import torch

    scores = []
    with torch.no_grad():
        for first in range(0, len(texts), batch):
            ids = torch.tensor(texts[first : first + batch])  # equal lengths: no padding
            logprobs = torch.log_softmax(hf(ids).logits[:, :-1].float(), dim=-1)
            picked = logprobs.gather(-1, ids[:, 1:, None])[..., 0]
            scores += list(picked.numpy())
    return scores


def timed(fn, repeats: int) -> tuple[float, object]:
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--texts", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer-batch", type=int, default=8)
    parser.add_argument("--skip-peer", action="store_true", help="do not run transformers")
    parser.add_argument(
        "--model", default=None, help="a model directory or .gguf (default: the default)"
    )
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(texts=2, length=32, repeats=1, peer_batch=2)
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    from pagedjax.llm import LLM

    llm = LLM(
        args.model,
        max_model_len=args.length + 1,
        max_num_batched_tokens=512,
        num_kv_blocks=kv_blocks(512 // args.length + 1, args.length + 1),
    )
    texts = sized_prompts(llm.get_tokenizer(), [args.length] * args.texts)
    engine_scores(llm, texts[:2])  # compiles
    scored_tokens = args.texts * (args.length - 1)
    seconds, ours = timed(lambda: engine_scores(llm, texts), args.repeats)
    result = {
        "texts": args.texts,
        "tokens_per_text": args.length,
        "engine_s_median": seconds,
        "engine_scored_tokens_per_s": scored_tokens / seconds,
        "perplexity": float(np.exp(-np.mean(np.concatenate(ours)))),
    }
    if not args.skip_peer:
        hf = load_peer(args.model)
        peer_scores(hf, texts[:2], 2)  # warm up
        peer_seconds, theirs = timed(lambda: peer_scores(hf, texts, args.peer_batch), args.repeats)
        result["peer_s_median"] = peer_seconds
        result["peer_scored_tokens_per_s"] = scored_tokens / peer_seconds
        result["speedup_vs_peer"] = peer_seconds / seconds
        result["max_abs_logprob_difference"] = float(
            max(np.abs(a - b).max() for a, b in zip(ours, theirs, strict=True))
        )
    report("scoring", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
