"""What block size should I pick? KV memory lost inside blocks, and speed, per block size.

A sequence holds whole blocks, so its last block is partly empty: on average (block_size - 1)
/ 2 slots per running sequence hold no token (internal fragmentation). Small blocks waste less
but give the attention more, smaller pages to gather. This runs one workload (prompts and
max_tokens of varied lengths) at each block size and reports, over the run's steps, the share
of allocated KV slots that held no token (read from the engine's stats and its KV cache
manager after every step) and the output tokens/s of a second, warm run (with --small, the
tiny model's steps are all overhead, so that column means little).

    python examples/block_size_sweep.py                 # SmolLM2-135M-Instruct
    python examples/block_size_sweep.py --small --plot /tmp/sweep.png
"""

from __future__ import annotations

import argparse
import random
import time

from _tiny import add_model_args, model_path

from models.loader import load_tokenizer
from pagedjax import LLM, SamplingParams

BLOCK_SIZES = (8, 16, 32, 64, 128)


def make_workload(num_requests: int, max_prompt: int, max_new: int, vocab: int, seed: int = 0):
    """Random token prompts of varied lengths, each with its own max_tokens."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(4, max_prompt))]
        for _ in range(num_requests)
    ]
    # ignore_eos: every request runs to its max_tokens, so every block size sees equal work.
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(1, max_new), ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


def measure_waste(llm: LLM, prompts, params) -> dict:
    """Steps the engine by hand through the workload; over its steps: the peak blocks in use,
    the share of allocated slots that held no token, and the mean MiB they took."""
    engine = llm.llm_engine
    core = engine.engine_core  # the scheduler and the KV cache manager behind the engine
    manager = core.kv_cache_manager
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"sweep-{i}", {"prompt_token_ids": prompt}, p)
    allocated = held = peak = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        blocks = engine.stats()["kv_blocks_used"]
        peak = max(peak, blocks)
        allocated += blocks * manager.block_size
        # A running request's computed count includes the tokens scheduled in the step now
        # in flight: exactly the slots its blocks were allocated for.
        held += sum(request.num_computed_tokens for request in core.scheduler.running)
    ledger = manager.memory_ledger()
    bytes_per_slot = ledger.bytes_per_block / ledger.block_size
    wasted = allocated - held
    mib = wasted / steps * bytes_per_slot / 2**20
    return {"peak_blocks": peak, "wasted_share": wasted / allocated, "wasted_mib": mib}


def sweep(model, block_sizes, prompts, params, **engine_options) -> list[dict]:
    rows = []
    for block_size in block_sizes:
        # Blocks for every request at once, so no block size preempts and all run the same
        # schedule; no prefix caching, so a block is never shared and waste is per sequence.
        needed = sum(
            -(-(len(t) + p.max_tokens) // block_size) for t, p in zip(prompts, params, strict=True)
        )
        llm = LLM(
            model,
            block_size=block_size,
            num_kv_blocks=needed + 1,  # + the null block
            enable_prefix_caching=False,
            **engine_options,
        )
        row = {"block_size": block_size, **measure_waste(llm, prompts, params)}
        # Timed on a second run: the first compiled every step shape this workload takes.
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        row["tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
        rows.append(row)
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    sizes = [r["block_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(sizes, [100 * r["wasted_share"] for r in rows], "o-")
    left.set(xlabel="block size", ylabel="allocated KV slots holding no token (%)")
    right.plot(sizes, [r["tokens_per_s"] for r in rows], "o-")
    right.set(xlabel="block size", ylabel="output tokens/s")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_ylim(bottom=0)  # from zero, so that small differences look small
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    parser.add_argument("--plot", default="block_size_sweep.png", help="where to save the plot")
    args = parser.parse_args(argv)

    # Requests, the longest prompt and the largest max_tokens. --small also takes a 16-token
    # step budget: each block size (a new pool shape) then compiles three step shapes, not 4+.
    num, max_prompt, max_new = (12, 96, 24) if args.small else (16, 256, 48)
    options = dict(max_model_len=max_prompt + max_new)
    if args.small:
        options["max_num_batched_tokens"] = 16
    with model_path(args) as model:
        vocab = len(load_tokenizer(model))
        prompts, params = make_workload(num, max_prompt, max_new, vocab)
        rows = sweep(model, args.block_sizes, prompts, params, **options)
    print(f"{num} requests, prompts of 4..{max_prompt} tokens, max_tokens 1..{max_new}")
    print("block size | peak blocks | KV slots holding no token | mean wasted KV | output tok/s")
    for r in rows:
        print(
            f"{r['block_size']:>10} | {r['peak_blocks']:>11} | {r['wasted_share']:>25.1%} | "
            f"{r['wasted_mib']:>10.3g} MiB | {r['tokens_per_s']:>12.1f}"
        )
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
