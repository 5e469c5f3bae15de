"""Tensor and data parallelism on forced CPU devices: W1's tokens/s per split, the tokens
against one device's, and the collectives each compiled step holds.

    python benchmarks/parallel.py [--configs 1x1,3x1,1x2] [--requests 32] [--tokens 128]
        [--model DIR] [--smoke (a tiny random model unless --model, 1x1,2x1,1x2, 2 x 4 tokens)]

Each config is TxD (tensor_parallel_size x data_parallel_size); the CPU gets as many devices
as the largest needs (XLA_FLAGS=--xla_force_host_platform_device_count, set before JAX
starts), all of them sharing this machine's cores, so no speedup is expected: the point is
that the tokens do not change and what the split communicates. The default model's 9 query
heads split over 3 devices, not 2. Writes results/parallel.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from report import add_smoke_flag, report  # (benchmarks/ is the script directory)


def parse_configs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="1x1,3x1,1x2", help="TxD splits, the base first")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at a few tokens; flags still win
        # The tiny model's 4 query and 2 KV heads split over 2 devices.
        parser.set_defaults(configs="1x1,2x1,1x2", requests=2, tokens=4)
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    devices = max(t * d for t, d in configs)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    os.environ["XLA_FLAGS"] = flags.strip()  # the caller's own flags kept
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    from workloads import kv_blocks, make_prompts, save_random_llama

    from models.tensor_parallel import count_collectives
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    if args.smoke and args.model is None:
        args.model = str(save_random_llama())
    result: dict = {"workload": f"W1: {args.requests} prompts x {args.tokens} tokens, greedy"}
    result["devices"] = devices
    base_tokens = None
    base_rate = None
    # A smoke run's few prompts need only a small step budget: fewer step shapes to compile.
    budget = {"max_num_batched_tokens": 64} if args.smoke else {}
    for t, d in configs:
        llm = LLM(
            args.model,
            max_model_len=512,
            num_kv_blocks=kv_blocks(args.requests, 200 + args.tokens, 64),
            block_size=64,
            tensor_parallel_size=t,
            data_parallel_size=d,
            **budget,
        )
        engine = llm.llm_engine
        prompts = make_prompts(llm.get_tokenizer(), args.requests)
        warmup_s = engine.engine_core.warmup()
        compiled = engine.stats()["num_compilations"]
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outputs]
        rate = sum(map(len, tokens)) / elapsed
        base_tokens = base_tokens or tokens
        base_rate = base_rate or rate
        key = f"{t}x{d}"
        result[f"{key}_output_tokens_per_s"] = rate
        result[f"{key}_vs_{configs[0][0]}x{configs[0][1]}"] = rate / base_rate
        result[f"{key}_same_tokens"] = tokens == base_tokens
        result[f"{key}_warmup_s"] = warmup_s
        result[f"{key}_compilations_after_warmup"] = engine.stats()["num_compilations"] - compiled
        if t > 1:
            runner = engine.workers[0].runner
            for bucket in (1, runner.token_buckets[-1]):
                text = runner.lower_step(bucket).compile().as_text()
                counts = {k: v for k, v in count_collectives(text).items() if v}
                result[f"{key}_collectives_step_{bucket}_tokens"] = counts
        del llm, engine
    report("parallel", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
