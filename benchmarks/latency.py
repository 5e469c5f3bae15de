"""Online latency under a seeded Poisson arrival process, at several request rates: the engine is
driven directly (add the requests whose arrival time has come, then step).

    python benchmarks/latency.py [--rates 0.5,1,2,4] [--requests 8] [--tokens 64]
        [--max-num-batched-tokens 512] [--max-num-seqs 32] [--seed 0] [--model DIR]
        [--smoke (a tiny random model unless --model, 2 requests of 4 tokens at 2 rates)]

Each rate gets its own --requests W1-style chat prompts (25-200 tokens, greedy, exactly --tokens
new tokens). Reports TTFT (arrival to first token) and TPOT (time per output token after the
first) p50/p90/p99 per rate, and the sustained output tokens/s (first arrival to last finish).
Writes results/latency.json and, if matplotlib is importable, results/latency.png.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from report import add_smoke_flag, report, results_dir  # noqa: E402  (the script directory)
from workloads import kv_blocks, make_prompts, poisson_arrivals, save_random_llama  # noqa: E402


def run_rate(engine, prompts, arrivals, tokens: int, tag: str) -> dict:
    """Feeds the requests at their arrival times; returns the latency summary of this rate."""
    from pagedjax.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.monotonic()
    pending = list(enumerate(zip(prompts, arrivals, strict=True)))
    done = []
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and start + pending[0][1][1] <= now:
            i, (prompt, offset) = pending.pop(0)
            engine.add_request(f"{tag}-{i}", prompt, params, arrival_time=start + offset)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0][1][1] - time.monotonic()))
            continue
        done += [o for o in engine.step() if o.finished]
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in done]
    tpot = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in done
        if len(o.outputs[0].token_ids) > 1
    ]
    generated = sum(len(o.outputs[0].token_ids) for o in done)
    span = max(o.metrics.finished_time for o in done) - (start + arrivals[0])
    summary = {}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_s"] = float(np.percentile(values, q))
    summary["output_tokens_per_s"] = generated / span
    return summary


def plot(rates: list[float], per_rate: list[dict], smoke: bool) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
        left.plot(rates, [r[f"ttft_p{q}_s"] for r in per_rate], style, label=f"p{q}")
        right.plot(rates, [1000 * r[f"tpot_p{q}_s"] for r in per_rate], style, label=f"p{q}")
    left.set(xlabel="request rate (req/s)", ylabel="TTFT (s)")
    right.set(xlabel="request rate (req/s)", ylabel="TPOT (ms)")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("pagedjax latency vs Poisson request rate (CPU)")
    fig.tight_layout()
    path = results_dir(smoke) / "latency.png"
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="0.5,1,2,4", help="request rates in requests/s")
    parser.add_argument("--requests", type=int, default=8, help="requests per rate")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at a few tokens; flags still win
        parser.set_defaults(
            rates="20,40", requests=2, tokens=4, max_num_batched_tokens=64, max_num_seqs=4
        )
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    from pagedjax.llm import LLM

    rates = [float(r) for r in args.rates.split(",")]
    llm = LLM(
        args.model,
        max_model_len=512,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=kv_blocks(args.requests, 200 + args.tokens),
    )
    engine = llm.llm_engine
    warmup_s = engine.engine_core.worker.runner.warmup()
    compiled = engine.engine_core.worker.runner.num_compilations
    result = {
        "workload": f"{args.requests} requests per rate, 25-200 prompt tokens x {args.tokens}",
        "warmup_s": warmup_s,
    }
    per_rate = []
    for k, rate in enumerate(rates):
        seed = args.seed + k  # different prompts per rate: no prefix-cache hits across rates
        prompts = make_prompts(llm.get_tokenizer(), args.requests, seed)
        arrivals = poisson_arrivals(rate, args.requests, seed)
        per_rate.append(run_rate(engine, prompts, arrivals, args.tokens, f"r{rate}"))
        result.update({f"rate_{rate:g}_{key}": value for key, value in per_rate[-1].items()})
    result["compilations_after_warmup"] = (
        engine.engine_core.worker.runner.num_compilations - compiled
    )
    result["preemptions"] = engine.engine_core.scheduler.num_preemptions
    report("latency", result, smoke=args.smoke)
    plot(rates, per_rate, args.smoke)


if __name__ == "__main__":
    main()
