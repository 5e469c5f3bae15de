"""Roofline: the engine's achieved model FLOP/s on W2 against this machine's measured float32
matmul FLOP/s for the model's own shapes, in the same run.

    python benchmarks/roofline.py [--requests 256] [--max-num-seqs 128] [--model DIR]
        [--smoke (3 requests cut to 40-token prompts and 6 tokens, 2 at once, on a tiny random
        model)]

Peak: median time of x @ W for each of the model's weight shapes at the step's token counts
(the MLP, QKV, output projections and the LM head), as XLA's dot and as the engine's packed
CPU matmul kernels (`pagedjax/cpu_native/matmul.py`: float32 panels, and the 4-bit block codes
the engine runs a GGUF's weights as); the best of them is the ceiling.
Model FLOPs of a step: 2 x (layer parameters) per computed token, 2 x H x V per sampled row
(the LM head runs only on those), and attention 4 x context x heads x head_dim per token per
layer (causal: a query at position p attends to p + 1 keys), counted from the scheduler's
decision of every step. Achieved FLOP/s is their sum over wall time, so it includes
everything the engine does in between.

Two figures: the whole run, and the steady state (the issue's target): from the step after
the first request finishes to the last step that left requests waiting, while finished
requests are replaced by new ones and the batch stays full. The whole run also holds the
ramp-up and the drain, when the last few requests decode alone at batch sizes of 1-10.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import kv_blocks, save_random_llama, w2  # noqa: E402


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
    from models.weights import BLOCK
    from pagedjax.cpu_native.matmul import pack, pack_blocks

    def packed_matmul(x, weight):
        return weight.matmul(x)

    def blocks(w):  # random 4-bit codes with float16 scales and offsets, as in Q4_1
        rng = np.random.default_rng(2)
        k, n = w.shape
        codes = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)
        scales = rng.random((k // BLOCK, n)).astype(np.float16).astype(np.float32)
        return pack_blocks(codes, scales, -8 * scales, 4)

    kinds = {
        "xla": (jax.jit(lambda x, w: x @ w), lambda w: w),
        "packed": (packed_matmul, pack),
        "blocks": (packed_matmul, blocks),
    }
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


def chunk_flops(config, start: int, num_new: int, sampled: int) -> float:
    """FLOPs of computing tokens start .. start + num_new - 1 of one sequence and sampling
    `sampled` rows from its last one."""
    attention_per_key = 4 * config.num_layers * config.num_heads * config.head_dim
    keys = num_new * start + num_new * (num_new + 1) // 2  # query p attends to p + 1 keys
    return (
        2 * config.num_layer_params() * num_new
        + attention_per_key * keys
        + 2 * config.hidden_size * config.vocab_size * sampled
    )


class StepLog:
    """Wraps the scheduler's `schedule` to record, per step, the FLOPs of what it scheduled
    and whether requests were left waiting."""

    def __init__(self, scheduler, config) -> None:
        self.scheduler, self.config = scheduler, config
        self.schedule = scheduler.schedule
        scheduler.schedule = self
        self.flops: list[float] = []
        self.waiting: list[bool] = []

    def __call__(self):
        out = self.schedule()
        # The requests' counts already include this step: out.chunks() has them from before.
        computed = sum(
            chunk_flops(self.config, start, num_new, 0) for start, num_new in out.chunks()
        )
        self.flops.append(computed + chunk_flops(self.config, 0, 0, len(out.row_requests)))
        self.waiting.append(bool(self.scheduler.waiting))
        return out


def run(llm, prompts: list, params: list) -> dict:
    """Drives the engine step by step; FLOP/s of the whole run and of the steady state."""
    engine = llm.llm_engine
    log = StepLog(engine.engine_core.scheduler, engine.model_config)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    ends, first_finish, finished = [], None, []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        ends.append(time.perf_counter())
        finished += [o for o in outputs if o.finished]
        if first_finish is None and finished:
            first_finish = len(ends) - 1
    engine.engine_core.scheduler.schedule = log.schedule
    total = sum(log.flops)
    # Each request's tokens computed once (the last output is sampled, never fed back): the
    # step log must add up to this, unless preemption made the engine recompute some.
    useful = sum(
        chunk_flops(engine.model_config, 0, len(o.prompt_token_ids) + n - 1, n)
        for o in finished
        for n in [len(o.outputs[0].token_ids)]
    )
    result = {
        "steps": len(ends),
        "step_flops_over_request_flops": total / useful,
        "seconds": ends[-1] - start,
        "model_gflop": total / 1e9,
        "achieved_gflops": total / (ends[-1] - start) / 1e9,
    }
    last_waiting = max((i for i, w in enumerate(log.waiting) if w), default=-1)
    if first_finish is not None and last_waiting > first_finish:
        # Steps first_finish + 1 .. last_waiting: from the end of step first_finish on.
        window = slice(first_finish + 1, last_waiting + 1)
        seconds = ends[last_waiting] - ends[first_finish]
        result["steady_steps"] = last_waiting - first_finish
        result["steady_seconds"] = seconds
        result["steady_gflops"] = sum(log.flops[window]) / seconds / 1e9
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256, help="first N of W2's 256 requests")
    parser.add_argument(
        "--max-num-seqs", type=int, default=128, help="running requests at once (engine default)"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=None, help="default: the engine's")
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(requests=3, max_num_seqs=2, max_num_batched_tokens=16)
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    from pagedjax.llm import LLM
    from pagedjax.platforms import current_platform
    from pagedjax.sampling_params import SamplingParams

    max_model_len = 1024
    block_size = args.block_size or current_platform().default_block_size
    llm = LLM(
        args.model,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=block_size,
        num_kv_blocks=kv_blocks(min(args.requests, args.max_num_seqs), max_model_len, block_size),
    )
    config = llm.llm_engine.model_config
    peak = matmul_peak(config, (args.max_num_seqs, args.max_num_batched_tokens))
    prompts, max_tokens = w2(llm.get_tokenizer(), args.requests if args.smoke else 256)
    prompts, max_tokens = prompts[: args.requests], max_tokens[: args.requests]
    if args.smoke:
        prompts, max_tokens = [p[-40:] for p in prompts], [6] * len(prompts)
    llm.llm_engine.engine_core.worker.runner.warmup()
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    result = run(llm, prompts, params)
    best = max(peak.values())
    result = {
        "workload": f"W2: first {args.requests} requests, max_num_seqs {args.max_num_seqs}, "
        f"block_size {block_size}",
        **result,
        "peak_matmul_gflops (best model shape)": best,
        "fraction_of_peak": result["achieved_gflops"] / best,
    }
    if "steady_gflops" in result:
        result["steady_fraction_of_peak"] = result["steady_gflops"] / best
    result.update(peak)
    report("roofline", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
