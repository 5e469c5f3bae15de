"""Roofline: the engine's achieved model FLOP/s on W2 against this machine's measured float32
matmul FLOP/s for the model's own shapes, in the same run.

    python benchmarks/roofline.py [--requests 32] [--max-num-seqs 64]

Peak: median time of x @ W for each of the model's weight shapes at the step's token counts
(the MLP, QKV, output projections and the LM head), as XLA's dot and as the engine's packed
CPU matmul kernel (`kernels_pallas/cpu_matmul.py`); the best of them is the ceiling.
Model FLOPs of the engine run: 2 x (layer parameters) per computed token, 2 x H x V per
sampled row (the LM head runs only on those), and attention 4 x context x heads x head_dim
per token per layer (causal: a query at position p attends to p + 1 keys). Achieved FLOP/s is
their sum over the run's wall time, so it includes everything the engine does in between.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, w2  # noqa: E402


def matmul_peak(config, tokens: tuple[int, ...]) -> dict:
    """GFLOP/s of x[T, K] @ W[K, N] for the model's weight shapes, median of repeats."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = {
        "wqkv": (h, q + 2 * kv),
        "wo": (q, h),
        "w_gate_up": (h, 2 * inter),
        "w_down": (inter, h),
        "lm_head": (h, config.vocab_size),
    }
    from kernels_pallas.cpu_matmul import pack, packed_matmul

    kinds = {"xla": (jax.jit(lambda x, w: x @ w), lambda w: w), "packed": (packed_matmul, pack)}
    result = {}
    for t in tokens:
        for name, (k, n) in shapes.items():
            x = jnp.asarray(np.random.default_rng(0).normal(size=(t, k)), jnp.float32)
            w = jnp.asarray(np.random.default_rng(1).normal(size=(k, n)), jnp.float32)
            for kind, (matmul, prepare) in kinds.items():
                weight = prepare(w)
                matmul(x, weight).block_until_ready()
                times = []
                for _ in range(7):
                    start = time.perf_counter()
                    matmul(x, weight).block_until_ready()
                    times.append(time.perf_counter() - start)
                gflops = 2 * t * k * n / statistics.median(times) / 1e9
                result[f"matmul_gflops_T{t}_{name}_{kind}"] = gflops
    return result


def model_flops(config, prompt_lens: list[int], output_lens: list[int]) -> float:
    """FLOPs of computing every prompt and output token once, plus one LM head row per output."""
    layer_params = config.num_layer_params()
    attention_per_key = 4 * config.num_layers * config.num_heads * config.head_dim
    total = 0.0
    for prompt, output in zip(prompt_lens, output_lens, strict=True):
        # The last output token is sampled but never fed back, so prompt + output - 1 are computed.
        computed = prompt + output - 1
        total += 2 * layer_params * computed
        total += attention_per_key * computed * (computed + 1) / 2
        total += 2 * config.hidden_size * config.vocab_size * output
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32, help="first N of W2's 256 requests")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=None, help="default: the engine's")
    args = parser.parse_args()

    from pagedjax.config import default_block_size
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    max_model_len = 1024
    block_size = args.block_size or default_block_size()
    llm = LLM(
        None,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=block_size,
        num_kv_blocks=kv_blocks(args.requests, max_model_len, block_size),
    )
    config = llm.llm_engine.model_config
    peak = matmul_peak(config, (args.max_num_seqs, args.max_num_batched_tokens))
    prompts, max_tokens = w2(llm.get_tokenizer(), 256)
    prompts, max_tokens = prompts[: args.requests], max_tokens[: args.requests]
    llm.llm_engine.runner.warmup()
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    outputs_lens = [len(o.outputs[0].token_ids) for o in outputs]
    flops = model_flops(config, [len(p) for p in prompts], outputs_lens)
    best = max(peak.values())
    result = {
        "workload": f"W2: first {args.requests} requests, max_num_seqs {args.max_num_seqs}, "
        f"block_size {block_size}",
        "seconds": elapsed,
        "model_gflop": flops / 1e9,
        "achieved_gflops": flops / elapsed / 1e9,
        "peak_matmul_gflops (best model shape)": best,
        "fraction_of_peak": flops / elapsed / 1e9 / best,
        **peak,
    }
    report("roofline", result)


if __name__ == "__main__":
    main()
