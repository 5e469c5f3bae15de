"""Speculative decoding at batch 1: one user's tokens/s with and without it (n-gram prompt
lookup, and a draft model made of the default model's first layers), on a workload that copies
from its prompt and on W1 chat, in one run. Greedy: the tokens must be identical, and the
script checks it.

    python benchmarks/spec_decode.py [--requests 4] [--tokens 128] [--k 4] [--repeats 2]
        [--draft-layers 8 15] [--float32-target]
        [--smoke (the tiny random model drafting for itself, 1 request x 8 tokens, once)]

Reports, per workload and method, the median ms per output token of each request, its ratio to
no speculation, the acceptance rate and the tokens a drafted step emits.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import TOPICS, chat_ids, make_prompts, save_random_llama  # noqa: E402

PASSAGE = (
    "The printing press, developed by Johannes Gutenberg around 1440, changed how knowledge "
    "spread across Europe. Before it, books were copied by hand, which made them rare and "
    "expensive. With movable metal type, a workshop could print hundreds of pages a day. "
    "Within fifty years, millions of books had been printed, literacy rose, and new ideas "
    "in science and religion travelled faster than ever before."
)


def copy_prompts(tokenizer, count: int) -> list[list[int]]:
    """Requests that rewrite a passage given in the prompt (most output copies it)."""
    asks = [
        "Repeat the following text exactly, word for word:",
        "Fix any spelling mistakes in this text and return the whole text:",
        "Rewrite this text, keeping every sentence, and make the first word of each sentence "
        "uppercase:",
        f"Copy this paragraph, then add one sentence about {TOPICS[1]} at the end:",
    ]
    return [chat_ids(tokenizer, f"{asks[i % len(asks)]}\n\n{PASSAGE}") for i in range(count)]


def time_requests(llm, prompts, params) -> tuple[list[list[int]], list[float]]:
    """Each prompt alone (batch 1): its output tokens and its ms per output token."""
    tokens, ms = [], []
    for prompt in prompts:
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        ids = out.outputs[0].token_ids
        tokens.append(ids)
        ms.append(1e3 * elapsed / len(ids))
    return tokens, ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes (median)")
    parser.add_argument(
        "--draft-layers",
        type=int,
        nargs="*",
        default=[8],
        help="draft models: the default model's first N layers (none: n-gram only)",
    )
    parser.add_argument(
        "--float32-target",
        action="store_true",
        help="every target runs the default model's float32 weights (not its Q4_1 codes), "
        "and a draft of the Q4_1 model itself is added: a draft 3-4x cheaper than its target",
    )
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(requests=1, tokens=8, repeats=1, draft_layers=[1])
    args = parser.parse_args()
    if args.float32_target and args.smoke:
        parser.error("--float32-target needs the default model, which --smoke replaces")

    from models.gguf_loader import default_model_path
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    # Smoke: a small pool (not one sized from the machine's memory) and few step shapes.
    small = dict(num_kv_blocks=64, max_model_len=256, max_num_seqs=1, max_num_batched_tokens=16)
    shape = {"max_model_len": 1024, **(small if args.smoke else {})}
    # Smoke: a random model whose loads and steps cost little; its one layer is the draft.
    model = str(save_random_llama()) if args.smoke else None
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    engines = {
        "off": LLM(model, **shape),
        "ngram": LLM(model, speculative_config=spec, **shape),
    }
    for layers in args.draft_layers:
        draft = {
            "model": model or str(default_model_path()),
            "num_speculative_tokens": args.k,
            "num_hidden_layers": layers,
        }
        engines[f"draft{layers}"] = LLM(model, speculative_config=draft, **shape)
    if args.float32_target:
        import jax.numpy as jnp

        from models.loader import load_model

        # A copy of the file: a draft of the target's own checkpoint would take its new weights.
        copy = Path(tempfile.mkdtemp()) / "draft.gguf"
        shutil.copyfile(default_model_path(), copy)
        draft = {"model": str(copy), "num_speculative_tokens": args.k}
        engines["q4draft"] = LLM(max_model_len=1024, speculative_config=draft)
        weights = load_model(None, jnp.float32)[1]
        for llm in engines.values():
            llm.update_weights(weights)
    tokenizer = engines["off"].get_tokenizer()
    workloads = {
        "copy": (copy_prompts(tokenizer, args.requests), False),
        "w1": (make_prompts(tokenizer, args.requests), True),
    }
    result: dict = {"k": args.k, "lookup": f"{args.lookup_min}-{args.lookup_max}"}
    for name, (prompts, ignore_eos) in workloads.items():
        greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=ignore_eos)
        for llm in engines.values():
            time_requests(llm, prompts[:1], greedy)  # compiles the sampler's variants
        ms = {key: [] for key in engines}
        outputs = {}
        before = {key: llm.llm_engine.stats() for key, llm in engines.items()}
        for _ in range(args.repeats):
            for key, llm in engines.items():  # interleaved: the same machine state for all
                outputs[key], times = time_requests(llm, prompts, greedy)
                ms[key] += times
        off = statistics.median(ms["off"])
        result[f"{name}_ms_per_token_off"] = off
        result[f"{name}_output_tokens"] = sum(len(t) for t in outputs["off"])
        for key in list(engines)[1:]:
            after, start = engines[key].llm_engine.stats(), before[key]
            drafts, proposed, accepted = (
                after[f"spec_decode_num_{s}"] - start[f"spec_decode_num_{s}"]
                for s in ("drafts", "draft_tokens", "accepted_tokens")
            )
            on = statistics.median(ms[key])
            result[f"{name}_{key}_identical_tokens"] = outputs["off"] == outputs[key]
            result[f"{name}_{key}_ms_per_token"] = on
            result[f"{name}_{key}_speedup"] = off / on
            result[f"{name}_{key}_acceptance_rate"] = accepted / max(proposed, 1)
            result[f"{name}_{key}_tokens_per_drafted_step"] = 1 + accepted / max(drafts, 1)
    report("spec_decode", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
