"""Where a batch-1 decode step's time goes, on the default model: the engine step split into its
host parts and the device wait, and the device's forward split into its matmuls (per weight,
times the layers), attention, the LM head, the sampler and the rest (norms, rope, the layer
loop's own cost), each timed alone at the step's shapes (a layer's op over every layer in one
call, as the step's layer loop runs it).

    python benchmarks/decode_profile.py [--context 64] [--steps 64] [--repeats 200] [--smoke]

Medians over `--repeats` calls (device parts) or decode steps (engine parts).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import sized_prompts  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds of fn() (which blocks until its result is ready)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


class Timed:
    """Wraps obj.name to add each call's seconds to a list."""

    def __init__(self, obj, name: str):
        self.times: list[float] = []
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            self.times.append(time.perf_counter() - start)
            return out

        setattr(obj, name, timed)

    def median_ms(self, skip: int = 2) -> float:
        return 1e3 * statistics.median(self.times[skip:]) if len(self.times) > skip else 0.0


def engine_parts(engine, prompt: list[int], steps: int) -> dict:
    """Medians of an engine's decode steps and of their host parts."""
    from pagedjax.sampling_params import SamplingParams
    from pagedjax.worker import model_runner

    core = engine.engine_core
    parts = {
        "schedule": Timed(core.scheduler, "schedule"),
        "dispatch (inputs, sampling metadata, launch)": Timed(core.worker, "execute_model"),
        "update": Timed(core.scheduler, "update_from_output"),
        "outputs (detokenize)": Timed(engine.output_processor, "process_outputs"),
    }
    wait = Timed(model_runner.StepHandle, "result")
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    engine.add_request("profile", prompt, params)
    step_times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    result = {"engine_step_ms": 1e3 * statistics.median(step_times[2:])}
    for name, timed in parts.items():
        result[f"host_{name}_ms"] = timed.median_ms()
    result["wait_for_device_ms"] = wait.median_ms()
    return result


def device_parts(engine, context: int, repeats: int) -> dict:
    """The forward of a one-token step at `context` tokens, and its parts alone."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.metadata import AttentionMetadata
    from models.llama import compute_logits, layer_matmul
    from pagedjax.sampler import build_sampling_metadata, sample
    from pagedjax.sampling_params import SamplingParams

    runner = engine.engine_core.worker.runner
    config, params = runner.model_config, runner.params
    bs = runner.block_size
    blocks = -(-(context + 1) // bs)
    table = np.zeros((1, runner.width_buckets[-1]), np.int32)
    table[0, :blocks] = np.arange(1, blocks + 1)
    metadata = AttentionMetadata(
        slot_mapping=np.array([table[0, context // bs] * bs + context % bs], np.int32),
        block_tables=table,
        seq_lens=np.array([context + 1], np.int32),
        query_start_loc=np.array([0, 1], np.int32),
        num_seqs=np.int32(1),
        num_tokens=np.int32(1),
    )
    tokens = np.array([42], np.int32)
    positions = np.array([context], np.int32)
    rows = np.zeros(1, np.int32)
    no_copies = np.zeros((0, 2), np.int32)
    sources = np.full(1, -1, np.int32)

    def forward():
        logits, runner.kv_cache, _ = runner._forward(
            params,
            tokens,
            positions,
            runner.kv_cache,
            metadata,
            rows,
            no_copies,
            sources,
            runner._no_previous,
            decode_only=runner._decode_only([_Seq()]),
        )
        logits.block_until_ready()

    result = {"context_tokens": context, "forward_ms": median_ms(forward, repeats)}
    x = jnp.ones((1, config.hidden_size), jnp.float32)
    layers, num_layers = params["layers"], config.num_layers

    def over_layers(op):
        """op(layer) for every layer in one call (one dispatch, as in the step's layer loop)."""
        body = lambda i, acc: acc + op(i).sum()  # noqa: E731  (the sum keeps op's work)
        return jax.lax.fori_loop(0, num_layers, body, jnp.float32(0))

    total = 0.0
    for name, width in (
        ("wqkv", config.hidden_size),
        ("wo", config.q_size),
        ("w_gate_up", config.hidden_size),
        ("w_down", config.intermediate_size),
    ):
        xin = jnp.ones((1, width), jnp.float32)
        fn = jax.jit(lambda x, w: over_layers(lambda i: layer_matmul(x, w, i)))
        w = layers[name]
        ms = median_ms(lambda fn=fn, xin=xin, w=w: fn(xin, w).block_until_ready(), repeats)
        result[f"matmul_{name}_x{num_layers}_ms"] = ms
        total += ms
    head = jax.jit(compute_logits)
    result["lm_head_ms"] = median_ms(lambda: head(params, x).block_until_ready(), repeats)
    total += result["lm_head_ms"]

    attention = runner.attention
    q = jnp.ones((1, config.num_heads, config.head_dim), jnp.float32)
    attend = jax.jit(
        lambda q, cache: over_layers(
            lambda i: attention(q, cache, i, metadata, scale=config.attention_scale)
        )
    )
    ms = median_ms(lambda: attend(q, runner.kv_cache).block_until_ready(), repeats)
    result[f"attention_x{num_layers}_ms"] = ms
    total += ms

    logits = jnp.zeros((1, config.vocab_size), jnp.float32)
    meta = build_sampling_metadata([SamplingParams(temperature=0)], [[]], [0], [0], num_rows=1)
    greedy = lambda: sample(  # noqa: E731
        logits, meta, runner.sampling, use_penalties=False, use_truncation=False, all_greedy=True
    ).token_ids.block_until_ready()
    result["sampler_greedy_ms"] = median_ms(greedy, repeats)
    result["rest_of_forward_ms (norms, rope, KV write, layer loop)"] = result["forward_ms"] - total
    return result


class _Seq:
    token_ids = (0,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=None, help="default 64")
    parser.add_argument("--steps", type=int, default=None, help="default 64")
    parser.add_argument("--repeats", type=int, default=None, help="default 200")
    parser.add_argument("--max-model-len", type=int, default=None, help="default 2048")
    add_smoke_flag(parser)
    args = parser.parse_args()
    smoke = args.smoke
    args.context = args.context or (16 if smoke else 64)
    # Smoke: few steps, still more than the two each median skips as warm-up (`Timed`).
    args.steps = args.steps or (4 if smoke else 64)
    args.repeats = args.repeats or (3 if smoke else 200)
    args.max_model_len = args.max_model_len or (256 if smoke else 2048)

    from pagedjax.config import EngineConfig
    from pagedjax.engine import LLMEngine

    engine = LLMEngine(EngineConfig(max_model_len=args.max_model_len))
    (prompt,) = sized_prompts(engine.tokenizer, [args.context])
    result = {"steps": args.steps}
    for sync in (False, True):
        if sync:
            core = engine.engine_core
            core.config = dataclasses.replace(core.config, async_scheduling=False)
        parts = engine_parts(engine, prompt, args.steps)
        tag = "sync" if sync else "async"
        result.update({f"{tag}_{k}": v for k, v in parts.items()})
    result.update(device_parts(engine, args.context, args.repeats))
    report("decode_profile", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
