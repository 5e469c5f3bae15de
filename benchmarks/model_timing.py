"""Load time, first-step compile time and batch-1 decode latency of the default model, with
transformers running the same greedy decode in the same process for the ratio.

    python benchmarks/model_timing.py [--tokens 64] [--skip-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

PROMPT = "Explain in a few sentences why the sky is blue."
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip-peer", action="store_true", help="do not run transformers")
    args = parser.parse_args()

    start = time.perf_counter()
    from models.loader import load_model, load_tokenizer, resolve_model_path
    from pagedjax.greedy_loop import GreedyLoop

    imported = time.perf_counter()
    config, params = load_model(None)
    loaded = time.perf_counter()
    tokenizer = load_tokenizer(None)
    tokenizer_loaded = time.perf_counter()

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    loop = GreedyLoop(config, params, max_model_len=1024)
    tokens = list(loop.generate(prompt_ids, args.tokens))
    # Steps 0 and 1 compile (prefill bucket, decode); later ones may compile once more when the
    # block-table width bucket doubles, so take the median.
    decode = loop.step_times[2:]
    result = {
        "import_s": imported - start,
        "load_model_s": loaded - imported,
        "load_tokenizer_s": tokenizer_loaded - loaded,
        "first_step_s": loop.step_times[0],
        "first_decode_step_s": loop.step_times[1],
        "decode_ms_per_token_median": 1000 * statistics.median(decode),
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": len(tokens),
    }

    if not args.skip_peer:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        path = resolve_model_path(None).path
        t0 = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        result["peer_load_s"] = time.perf_counter() - t0
        ids = torch.tensor([prompt_ids])
        per_token = []
        for _ in range(3):
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

    width = max(len(k) for k in result)
    for key, value in result.items():
        print(
            f"{key:<{width}}  {value:.3f}"
            if isinstance(value, float)
            else f"{key:<{width}}  {value}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "model_timing.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
