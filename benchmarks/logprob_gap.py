"""Can a trainer trust the engine's logprobs? The default model samples completions
(temperature 1, logprobs=0: each sampled token's logprob under the raw model distribution),
then the dense forward of `models/training.py` recomputes every sampled token's logprob over
prompt + completion, and we report the absolute gaps, for two engines in one run:

- the default engine against the dense forward on XLA's ops;
- a batch_invariant=True engine against the dense forward on `LLM.dense_kernels()`
  (`docs/batch_invariance.md`).

Each over the engine's own params (on the CPU the GGUF's Q4_1 blocks packed for the C++
matmul) and over the plain float32 weights `load_model(None)` gives a trainer to
differentiate (the blocks dequantized, which is exact). Also: the dense forward's and its
gradient's time with each set of kernels.

    python benchmarks/logprob_gap.py [--prompts 8] [--tokens 64] [--model DIR]
        [--smoke (a tiny random model unless --model, 2 prompts of 4 tokens, one timing)]

Writes results/logprob_gap.json.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import TOPICS, chat_ids, save_random_llama  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at a few tokens; flags still win
        parser.set_defaults(prompts=2, tokens=4)
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())
    repeats = 1 if args.smoke else 3  # timings of the dense forward and gradient (median)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.loader import load_model
    from models.training import XLA_KERNELS, token_logprobs, token_logprobs_jit
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    _, float32_params = load_model(args.model)
    result: dict = {
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "temperature": 1.0,
    }
    for mode in ("default", "batch_invariant"):
        invariant = mode == "batch_invariant"
        llm = LLM(args.model, max_model_len=512, batch_invariant=invariant)
        config = llm.llm_engine.model_config
        kernels = llm.dense_kernels() if invariant else XLA_KERNELS
        tokenizer = llm.get_tokenizer()
        prompts = [chat_ids(tokenizer, f"Explain {t} briefly.") for t in TOPICS[: args.prompts]]
        sampling = [
            SamplingParams(
                temperature=1.0, seed=i, logprobs=0, max_tokens=args.tokens, ignore_eos=True
            )
            for i in range(len(prompts))
        ]
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
        width = max(len(s) for s in sequences)
        token_ids = np.asarray([s + [0] * (width - len(s)) for s in sequences], np.int32)
        engine = [
            np.asarray([e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)])
            for c in (o.outputs[0] for o in outputs)
        ]
        result[f"{mode}_sampled_tokens"] = int(sum(len(e) for e in engine))
        result[f"{mode}_attention_backend"] = llm.llm_engine.workers[0].attention.name

        for name, params in (
            ("engine_params", llm.llm_engine.workers[0].params),
            ("float32_params", float32_params),
        ):
            recomputed = np.asarray(token_logprobs_jit(params, config, token_ids, kernels))
            # Row t predicts token t + 1: a completion's predictions start at its prompt's
            # last token.
            gap = np.concatenate(
                [
                    np.abs(row[len(o.prompt_token_ids) - 1 :][: len(e)] - e)
                    for row, o, e in zip(recomputed, outputs, engine, strict=True)
                ]
            )
            result[f"{mode}_{name}_max_abs_gap"] = float(gap.max())
            result[f"{mode}_{name}_median_abs_gap"] = float(np.median(gap))

        # What a trainer pays: the forward and its gradient over the same batch (medians).
        def loss(params, config=config, token_ids=token_ids, kernels=kernels):
            return -jnp.mean(token_logprobs(params, config, token_ids, kernels))

        for what, fn in (
            ("forward", jax.jit(loss)),
            ("gradient", jax.jit(jax.grad(loss))),
        ):
            jax.block_until_ready(fn(float32_params))
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(fn(float32_params))
                times.append(time.perf_counter() - start)
            result[f"{mode}_dense_{what}_s"] = float(np.median(times))
        del llm
    report("logprob_gap", result, smoke=args.smoke)
    for key in (k for k in result if k.endswith("_gap")):  # the table's 3 decimals show 0.000
        print(f"{key}  {result[key]:.2e}")


if __name__ == "__main__":
    main()
