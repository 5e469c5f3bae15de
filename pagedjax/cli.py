"""Command line: `pagedjax generate PROMPT...`."""

from __future__ import annotations

import argparse
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from models.loader import load_model, load_tokenizer
    from pagedjax.greedy_loop import GreedyLoop

    start = time.perf_counter()
    config, params = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    loaded = time.perf_counter()
    loop = GreedyLoop(config, params, max_model_len=args.max_model_len)
    stop_ids = tuple(config.eos_token_ids) + (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    for prompt in args.prompts:
        if args.no_chat_template or not tokenizer.chat_template:
            text = prompt
        else:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
        prompt_ids = tokenizer.encode(text, add_special_tokens=args.no_chat_template)
        tokens = []
        for token in loop.generate(prompt_ids, args.max_tokens, stop_ids):
            tokens.append(token)
            if args.stream:
                print(tokenizer.decode([token], skip_special_tokens=True), end="", flush=True)
        if args.stream:
            print()
        else:
            print(tokenizer.decode(tokens, skip_special_tokens=True).strip())
    if args.verbose:
        decode = sorted(loop.step_times[2:]) or [float("nan")]
        print(
            f"[pagedjax] load {loaded - start:.2f}s, first step {loop.step_times[0]:.2f}s, "
            f"decode median {1000 * decode[len(decode) // 2]:.1f} ms/token",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedjax", description="Paged-KV LLM inference in JAX")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="greedy completion of each prompt")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--model", default=None, help="HF model directory or .gguf file")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--no-chat-template", action="store_true", help="send the raw prompt")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("-v", "--verbose", action="store_true", help="print timings to stderr")
    gen.set_defaults(run=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
