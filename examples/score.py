"""Perplexity of a text: every token's logprob given the tokens before it, from the engine.

`SamplingParams(prompt_logprobs=0, max_tokens=1)` returns, for each prompt token after the
first, its logprob under the model (vLLM's API). A text longer than the context is cut into
windows of at most max_model_len - 1 tokens (room for the one sampled token); each window
starts on the previous one's last token, so every token after the text's first is scored
exactly once, though each window starts from a fresh context.

    python examples/score.py my_text.txt                  # SmolLM2-135M-Instruct
    python examples/score.py --small                      # a tiny random Llama, built-in text
    python examples/score.py my_text.txt --max-model-len 512
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from _tiny import add_model_args, model_path

from pagedjax import LLM, SamplingParams

# One paragraph of prose, as a text file would hold it (no line breaks inside).
TEXT = (
    "The key idea of paged attention is to store the keys and values of each sequence in "
    "fixed-size blocks that need not be contiguous in memory, much as an operating system maps "
    "virtual pages to physical frames. A block table records where each block of a sequence "
    "lives, so memory is allocated one block at a time as tokens are generated, sequences that "
    "share a prefix can share its blocks, and almost no memory is lost to fragmentation. This "
    "lets a server batch many more requests at once, which raises its throughput.\n"
)


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Windows of at most `size` tokens, each starting on the previous window's last token."""
    if len(ids) < 2:
        raise ValueError("a text needs at least two tokens to score one")
    return [ids[start : start + size] for start in range(0, len(ids) - 1, size - 1)]


def token_nlls(llm: LLM, chunks: list[list[int]]) -> list[float]:
    """The negative log-likelihood of every token after each window's first."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": chunk} for chunk in chunks]  # all windows in one batch
    outputs = llm.generate(prompts, params, use_tqdm=False)
    nlls = []
    for chunk, output in zip(chunks, outputs, strict=True):
        # Entry i maps token i (and, with prompt_logprobs=k, the k likeliest) to its Logprob
        # given tokens < i; entry 0 is None, as the first token has no context.
        pairs = zip(chunk[1:], output.prompt_logprobs[1:], strict=True)
        nlls += [-entry[token].logprob for token, entry in pairs]
    return nlls


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", nargs="?", help="a text file (default: a built-in paragraph)")
    add_model_args(parser)
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="the context, and so the window (default 2048; 128 "
        "with --small, so that the built-in text spans several windows)",
    )
    args = parser.parse_args(argv)

    text = Path(args.file).read_text() if args.file else TEXT
    max_model_len = args.max_model_len or (128 if args.small else 2048)
    with model_path(args) as model:
        llm = LLM(model, max_model_len=max_model_len)
        ids = llm.get_tokenizer().encode(text)
        chunks = windows(ids, max_model_len - 1)
        nlls = token_nlls(llm, chunks)
    mean = sum(nlls) / len(nlls)
    print(f"{len(ids)} tokens, windows of at most {max_model_len - 1}: {len(chunks)}")
    print(f"scored tokens {len(nlls)}, mean NLL {mean:.4f} nats, perplexity {math.exp(mean):.3f}")
    return {"tokens": len(ids), "scored": len(nlls), "mean_nll": mean, "perplexity": math.exp(mean)}


if __name__ == "__main__":
    main()
