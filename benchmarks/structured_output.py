"""The cost of structured outputs: the host's token-mask time per step at batch 1 and 64, and
tokens/s with a JSON schema against the same requests unconstrained, in the same run.

    python benchmarks/structured_output.py [--batches 1,64] [--max-tokens 64]
        [--smoke (batches 1 and 2, 8 tokens, on the default model's first layer)]

The masks are built on the host by llguidance, every constrained row of a step at once on its
threads, after the step's forward is dispatched (while it runs on the device); this times
every such call. A
constrained sequence needs its previous token on the host, so it samples every other step
when others share the batch. Writes results/structured_output.json.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def first_layer_of_default_model() -> dict:
    """LLM arguments for the default model cut to its first layer: a step of a fraction of the
    cost, with the default model's tokenizer (the tiny random model's word tokens cannot spell
    JSON)."""
    from dataclasses import replace

    from models.loader import load_model, load_tokenizer
    from pagedjax.worker.draft_model import first_layers

    config, params = load_model(None)
    config = replace(config, num_layers=1, sliding_windows=config.sliding_windows[:1])
    return {"model": config, "params": first_layers(params, 1), "tokenizer": load_tokenizer()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(batches="1,2", max_tokens=8)
    args = parser.parse_args()

    from pagedjax import constraints
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams, StructuredOutputsParams

    mask_seconds: list[float] = []
    mask_rows: list[int] = []
    original = constraints.MaskFiller.fill

    def timed_fill(self, rows, num_rows):
        start = time.perf_counter()
        out = original(self, rows, num_rows)
        if out is not None:
            mask_seconds.append(time.perf_counter() - start)
            mask_rows.append(sum(1 for c in rows if c is not None))
        return out

    constraints.MaskFiller.fill = timed_fill
    if args.smoke:  # few step shapes for warmup to compile, and a small pool
        small = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16)
        llm = LLM(**first_layer_of_default_model(), **small, num_kv_blocks=kv_blocks(2, 128))
    else:
        llm = LLM(max_model_len=512, max_num_seqs=64)
    engine = llm.llm_engine
    engine.engine_core.warmup()
    result: dict = {"schema": "name, age, city (JSON)", "max_tokens": args.max_tokens}
    for batch in (int(b) for b in args.batches.split(",")):
        conversations = [
            [{"role": "user", "content": f"Invent person {i}: name, age and city, as JSON."}]
            for i in range(batch)
        ]
        structured = StructuredOutputsParams(json=SCHEMA)
        for name, constraint in (("free", None), ("json", structured)):
            params = [
                SamplingParams(
                    temperature=0.8,
                    seed=i,
                    max_tokens=args.max_tokens,
                    structured_outputs=constraint,
                )
                for i in range(batch)
            ]
            llm.chat(conversations[:1], params[:1], use_tqdm=False)  # compiles the mask pass
            mask_seconds.clear()
            mask_rows.clear()
            steps = engine.engine_core.num_steps
            start = time.perf_counter()
            outputs = llm.chat(conversations, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            steps = engine.engine_core.num_steps - steps
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            key = f"batch{batch}_{name}"
            result[f"{key}_output_tokens_per_s"] = tokens / elapsed
            result[f"{key}_steps"] = steps
            if constraint is not None:
                result[f"{key}_mask_us_per_row"] = 1e6 * sum(mask_seconds) / sum(mask_rows)
                result[f"{key}_mask_ms_per_step"] = 1e3 * sum(mask_seconds) / steps
                result[f"{key}_step_ms"] = 1e3 * elapsed / steps
        result[f"batch{batch}_json_vs_free"] = (
            result[f"batch{batch}_json_output_tokens_per_s"]
            / result[f"batch{batch}_free_output_tokens_per_s"]
        )
    report("structured_output", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
