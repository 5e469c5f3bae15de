"""Accuracy of low-precision KV pools on the default model, against a float32 pool.

Teacher-forced: each prompt plus its float32 greedy continuation runs through the paged forward
with each KV dtype (weights and activations stay float32); we compare every position's logits
with the float32 pool's (max and mean absolute error, top-1 agreement) and the free-running
greedy tokens (how many of the first N match).

    python benchmarks/kv_dtype_accuracy.py [--prompts 8] [--tokens 48] [--model DIR]
        [--smoke (a tiny random model unless --model, 2 prompts x 4 tokens)]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, save_random_llama  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is.",
    "Why is the sky blue?",
    "Give three tips for learning a language.",
    "Describe how a bicycle works.",
    "What is photosynthesis?",
    "Summarize the plot of Romeo and Juliet.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=None, help="default 8 (--smoke: 2)")
    parser.add_argument("--tokens", type=int, default=None, help="default 48 (--smoke: 4)")
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())
    args.prompts = args.prompts or (2 if args.smoke else 8)
    args.tokens = args.tokens or (4 if args.smoke else 48)

    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.kv_cache import allocate_kv_cache
    from kernels_pallas.metadata import build_metadata, token_positions
    from models.llama import forward_logits_jit
    from models.loader import load_model, load_tokenizer
    from pagedjax.config import EngineConfig
    from pagedjax.core.memory import KVCacheSpec
    from pagedjax.engine import LLMEngine
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    config, params = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for p in PROMPTS[: args.prompts]
    ]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def generate(kv_cache_dtype: str) -> list[list[int]]:
        llm = LLM.__new__(LLM)  # reuse the loaded weights: build the engine directly
        llm.llm_engine = LLMEngine(
            EngineConfig(
                max_model_len=512, num_kv_blocks=kv_blocks(1, 8192), kv_cache_dtype=kv_cache_dtype
            ),
            config,
            params,
            tokenizer,
        )
        llm._counter = 0
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    reference_tokens = generate("float32")
    sequences = [p + t for p, t in zip(prompts, reference_tokens, strict=True)]

    def teacher_forced_logits(dtype) -> list[np.ndarray]:
        out = []
        for seq in sequences:
            n = len(seq)
            blocks = -(-n // 16)
            spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
            cache = allocate_kv_cache(spec, blocks + 1, 16)
            meta = build_metadata([n], [n], [list(range(1, blocks + 1))], 16)
            logits, _ = forward_logits_jit(
                params,
                config,
                np.asarray(seq, np.int32),
                token_positions([n], [n], n),
                cache,
                meta,
                np.arange(n, dtype=np.int32),
            )
            out.append(np.asarray(logits))
        return out

    reference_logits = teacher_forced_logits(jnp.float32)
    result = {"prompts": len(prompts), "tokens_per_prompt": args.tokens}
    for name, dtype in (("bfloat16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        logits = teacher_forced_logits(dtype)
        errors = [np.abs(a - b) for a, b in zip(logits, reference_logits, strict=True)]
        top1 = np.mean(
            np.concatenate(
                [
                    a.argmax(-1) == b.argmax(-1)
                    for a, b in zip(logits, reference_logits, strict=True)
                ]
            )
        )
        tokens = generate(name)
        matching = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(tokens, reference_tokens, strict=True)
        ]
        result[f"{name}_max_abs_logit_error"] = float(max(e.max() for e in errors))
        result[f"{name}_mean_abs_logit_error"] = float(np.mean([e.mean() for e in errors]))
        result[f"{name}_top1_agreement"] = float(top1)
        result[f"{name}_greedy_tokens_before_divergence_mean"] = float(np.mean(matching))
        result[f"{name}_sequences_identical"] = sum(m == args.tokens for m in matching)
    report("kv_dtype_accuracy", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
