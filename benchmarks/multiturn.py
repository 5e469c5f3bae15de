"""Multi-turn chat with a KV pool too small for every conversation: the host tier of the
prefix cache on against off, in one run (the same weights, the same process, the same seeds).

C conversations share a system prompt and open with a long text of their own. Users arrive
as a Poisson process (--arrival-rate conversations per second); each turn sends the
conversation so far (system prompt, text, earlier questions and the model's answers) and a new
question, and the user's next turn comes a think time after the answer (seeded exponential,
mean --think-s), as in a chat service. The device pool holds about a quarter of the
conversations (--pool-conversations), so while a user thinks the others' turns evict their
cached blocks: without the host tier a returning turn prefills its whole history again; with
it, the evicted blocks come back from host memory.

    python benchmarks/multiturn.py [--conversations 64] [--turns 4] [--tokens 16]
        [--system-tokens 64] [--history-tokens 384] [--pool-conversations 16]
        [--arrival-rate 2] [--think-s 20] [--seed 0] [--model DIR]
        [--smoke (a tiny random model unless --model, 3 short conversations of 2 turns)]

Reports per mode: time to first token p50/p99 of returning turns (turn >= 2) and of first
turns, output tokens/s over the run, the run's length, prefix-cache hit rates per tier; the
returning-turn TTFT ratio off/on. Writes results/multiturn.json.
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import (  # noqa: E402
    TOPICS,
    kv_blocks,
    poisson_arrivals,
    save_random_llama,
    system_prompt,
)


def notes(tokenizer, index: int, num_tokens: int) -> str:
    """About `num_tokens` tokens of text that only conversation `index` holds."""
    sentences = [f"These are the notes of student {index}."]
    while len(tokenizer.encode(" ".join(sentences), add_special_tokens=False)) < num_tokens:
        topic = TOPICS[(index * 7 + len(sentences)) % len(TOPICS)]
        sentences.append(f"Student {index} wrote page {len(sentences)} about {topic}.")
    return " ".join(sentences)


def chat_service(llm, args, name: str) -> dict:
    """Runs every conversation to its last turn; returns the mode's summary."""
    from pagedjax.llm import chat_prompt_ids
    from pagedjax.sampling_params import SamplingParams

    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    system = system_prompt(tokenizer, args.system_tokens)
    histories = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rng = random.Random(args.seed)  # the same think times in both modes
    think = [[rng.expovariate(1 / args.think_s) for _ in range(args.turns)] for _ in histories]
    start = time.monotonic()
    due = [
        (start + t, c, 0)
        for c, t in enumerate(poisson_arrivals(args.arrival_rate, len(histories), args.seed))
    ]
    heapq.heapify(due)
    ttft: dict[str, list[float]] = {"first": [], "returning": []}
    generated = 0
    while due or engine.has_unfinished_requests():
        while due and due[0][0] <= time.monotonic():
            arrival, c, turn = heapq.heappop(due)
            topic = TOPICS[(c * args.turns + turn) % len(TOPICS)]
            question = f"Now tell me about {topic}."
            if turn == 0:  # each conversation opens with a long text of its own
                question = notes(tokenizer, c, args.history_tokens) + "\n\n" + question
            histories[c].append({"role": "user", "content": question})
            prompt = {"prompt_token_ids": chat_prompt_ids(tokenizer, histories[c])}
            engine.add_request(f"{name}-{c}-{turn}", prompt, params, arrival_time=arrival)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, due[0][0] - time.monotonic()))
            continue
        for output in engine.step():
            if not output.finished:
                continue
            _, c, turn = output.request_id.rsplit("-", 2)
            c, turn = int(c), int(turn)
            metrics = output.metrics
            ttft["returning" if turn else "first"].append(
                metrics.first_token_time - metrics.arrival_time
            )
            histories[c].append({"role": "assistant", "content": output.outputs[0].text})
            generated += len(output.outputs[0].token_ids)
            if turn + 1 < args.turns:
                heapq.heappush(due, (metrics.finished_time + think[c][turn], c, turn + 1))
    seconds = time.monotonic() - start
    stats = engine.stats()
    result = {f"{name}_output_tokens_per_s": generated / seconds, f"{name}_run_s": seconds}
    for kind, values in ttft.items():
        result[f"{name}_{kind}_ttft_p50_s"] = float(np.percentile(values, 50))
        result[f"{name}_{kind}_ttft_p99_s"] = float(np.percentile(values, 99))
    result[f"{name}_device_hit_rate"] = stats["prefix_cache_hit_rate"]
    result[f"{name}_host_hit_rate"] = stats["prefix_cache_host_hit_rate"]
    result[f"{name}_preemptions"] = stats["num_preemptions"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--history-tokens", type=int, default=384, help="each one's own text")
    parser.add_argument("--pool-conversations", type=int, default=16)
    parser.add_argument("--arrival-rate", type=float, default=2.0, help="conversations/s")
    parser.add_argument("--think-s", type=float, default=20.0, help="mean pause between turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a model directory (default: the default)")
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:  # the same path at a few tokens; flags still win
        parser.set_defaults(
            conversations=3, turns=2, tokens=4, system_tokens=16, history_tokens=48,
            pool_conversations=1, arrival_rate=50.0, think_s=0.05,
        )  # fmt: skip
    args = parser.parse_args()
    if args.smoke and args.model is None:
        args.model = str(save_random_llama())

    from pagedjax import LLM

    # A conversation's longest context: the system prompt and every turn's question and answer.
    longest = args.system_tokens + args.history_tokens + args.turns * (args.tokens + 40) + 64
    result: dict = {
        key: getattr(args, key)
        for key in ("conversations", "turns", "pool_conversations", "arrival_rate", "think_s")
    }
    for name, swap_space in (("off", 0.0), ("on", 4.0)):
        llm = LLM(
            args.model,
            max_model_len=longest,
            num_kv_blocks=kv_blocks(args.pool_conversations, longest),
            swap_space=swap_space,
        )
        llm.llm_engine.engine_core.warmup()  # every step shape compiled before the clock
        result.update(chat_service(llm, args, name))
        del llm
    result["returning_ttft_p50_off_over_on"] = (
        result["off_returning_ttft_p50_s"] / result["on_returning_ttft_p50_s"]
    )
    report("multiturn", result, smoke=args.smoke)


if __name__ == "__main__":
    main()
