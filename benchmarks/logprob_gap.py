"""Can a trainer trust the engine's logprobs? The default model samples completions
(temperature 1, logprobs=0: each sampled token's logprob under the raw model distribution),
then the dense forward of `models/training.py` recomputes every sampled token's logprob over
prompt + completion, and we report the absolute gaps.

Two recomputations: over the engine's own params (on the CPU the GGUF's Q4_1 blocks packed for
the C++ matmul: the same products, other kernels), and over the plain float32 weights
`load_model(None)` gives a trainer to differentiate (the blocks dequantized, which is exact).

    python benchmarks/logprob_gap.py [--prompts 8] [--tokens 64]

Writes results/logprob_gap.json.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import TOPICS, chat_ids  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--attention-backend", default="auto", help="the engine's: auto, xla, ...")
    args = parser.parse_args()

    import numpy as np

    from models.loader import load_model
    from models.training import token_logprobs_jit
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    llm = LLM(max_model_len=512, attention_backend=args.attention_backend)
    tokenizer = llm.get_tokenizer()
    prompts = [chat_ids(tokenizer, f"Explain {t} briefly.") for t in TOPICS[: args.prompts]]
    sampling = [
        SamplingParams(temperature=1.0, seed=i, logprobs=0, max_tokens=args.tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
    width = max(len(s) for s in sequences)
    token_ids = np.asarray([s + [0] * (width - len(s)) for s in sequences], np.int32)
    completions = [o.outputs[0] for o in outputs]
    engine = [
        np.asarray([e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)])
        for c in completions
    ]

    def gaps(params) -> np.ndarray:
        """Every sampled token's |engine logprob - recomputed logprob|, all prompts together."""
        recomputed = np.asarray(token_logprobs_jit(params, llm.llm_engine.model_config, token_ids))
        # Row t predicts token t + 1: a completion's predictions start at its prompt's last token.
        return np.concatenate(
            [
                np.abs(row[len(o.prompt_token_ids) - 1 :][: len(e)] - e)
                for row, o, e in zip(recomputed, outputs, engine, strict=True)
            ]
        )

    result: dict = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "prompts": len(outputs),
        "sampled_tokens": int(sum(len(e) for e in engine)),
        "temperature": 1.0,
        "attention_backend": llm.llm_engine.workers[0].attention.name,
        "engine_mean_logprob": float(np.mean(np.concatenate(engine))),
    }
    _, float32_params = load_model(None)
    for name, params in (
        ("engine_params", llm.llm_engine.workers[0].params),
        ("float32_params", float32_params),
    ):
        gap = gaps(params)
        result[f"{name}_max_abs_gap"] = float(gap.max())
        result[f"{name}_median_abs_gap"] = float(np.median(gap))
        result[f"{name}_mean_abs_gap"] = float(gap.mean())
    report("logprob_gap", result)
    for key in (k for k in result if k.endswith("_gap")):  # the table's 3 decimals show 0.000
        print(f"{key}  {result[key]:.2e}")


if __name__ == "__main__":
    main()
