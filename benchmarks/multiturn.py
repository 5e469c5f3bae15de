"""Multi-turn chat with a KV pool too small for every conversation: the host tier of the
prefix cache on against off, in one run (the same weights, the same process).

C conversations share a system prompt and open with a long text of their own; each turn
sends the conversation so far (system prompt, text, earlier questions and the model's
answers) and a new question, all conversations' turns at once. The device pool holds about
a quarter of the conversations, so by a conversation's next turn its cached blocks were
evicted: without the host tier it prefills
its whole history again; with it, the evicted blocks come back from host memory.

    python benchmarks/multiturn.py [--conversations 16] [--turns 3] [--tokens 16]
        [--system-tokens 64] [--history-tokens 384] [--pool-conversations 4]

Reports per mode: time to first token p50/p99 of returning turns (turn >= 2) and of first
turns, output tokens/s, prefix-cache hit rates per tier; the TTFT ratio off/on. Writes
results/multiturn.json.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from report import report  # noqa: E402  (benchmarks/ is the script directory)
from workloads import TOPICS, kv_blocks, system_prompt  # noqa: E402


def notes(tokenizer, index: int, num_tokens: int) -> str:
    """About `num_tokens` tokens of text that only conversation `index` holds."""
    sentences = [f"These are the notes of student {index}."]
    while len(tokenizer.encode(" ".join(sentences), add_special_tokens=False)) < num_tokens:
        topic = TOPICS[(index * 7 + len(sentences)) % len(TOPICS)]
        sentences.append(f"Student {index} wrote page {len(sentences)} about {topic}.")
    return " ".join(sentences)


def conversation_turns(llm, args, swap_space: float) -> dict:
    from pagedjax.llm import chat_prompt_ids
    from pagedjax.sampling_params import SamplingParams

    tokenizer = llm.get_tokenizer()
    system = system_prompt(tokenizer, args.system_tokens)
    histories = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ttft = {"first": [], "returning": []}
    generated, seconds = 0, 0.0
    for turn in range(args.turns):
        for c, history in enumerate(histories):
            topic = TOPICS[(c * args.turns + turn) % len(TOPICS)]
            question = f"Now tell me about {topic}."
            if turn == 0:  # each conversation opens with a long text of its own
                question = notes(tokenizer, c, args.history_tokens) + "\n\n" + question
            history.append({"role": "user", "content": question})
        prompts = [chat_prompt_ids(tokenizer, h) for h in histories]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        for history, output in zip(histories, outputs, strict=True):
            metrics = output.metrics
            ttft["returning" if turn else "first"].append(
                metrics.first_token_time - metrics.arrival_time
            )
            history.append({"role": "assistant", "content": output.outputs[0].text})
            generated += len(output.outputs[0].token_ids)
    stats = llm.llm_engine.stats()
    name = "on" if swap_space else "off"
    result = {f"{name}_output_tokens_per_s": generated / seconds}
    for kind, values in ttft.items():
        result[f"{name}_{kind}_ttft_p50_s"] = float(np.percentile(values, 50))
        result[f"{name}_{kind}_ttft_p99_s"] = float(np.percentile(values, 99))
    result[f"{name}_device_hit_rate"] = stats["prefix_cache_hit_rate"]
    result[f"{name}_host_hit_rate"] = stats["prefix_cache_host_hit_rate"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--history-tokens", type=int, default=384, help="each one's own text")
    parser.add_argument("--pool-conversations", type=int, default=4)
    args = parser.parse_args()

    from pagedjax import LLM

    # A conversation's longest context: the system prompt and every turn's question and answer.
    longest = args.system_tokens + args.history_tokens + args.turns * (args.tokens + 40) + 64
    result: dict = {"conversations": args.conversations, "turns": args.turns}
    for swap_space in (0.0, 4.0):
        llm = LLM(
            max_model_len=longest,
            num_kv_blocks=kv_blocks(args.pool_conversations, longest),
            swap_space=swap_space,
        )
        llm.llm_engine.engine_core.warmup()  # every step shape compiled before the clock
        result.update(conversation_turns(llm, args, swap_space))
    result["returning_ttft_p50_off_over_on"] = (
        result["off_returning_ttft_p50_s"] / result["on_returning_ttft_p50_s"]
    )
    report("multiturn", result)


if __name__ == "__main__":
    main()
