"""Seeded prompt and workload generators shared by the benchmark scripts (token-id prompts)."""

from __future__ import annotations

import random

TOPICS = [
    "the history of the printing press",
    "how vaccines work",
    "the rules of chess",
    "why leaves change color",
    "the water cycle",
    "how a bicycle stays upright",
    "the life of honeybees",
    "how compilers work",
    "the causes of tides",
    "the invention of the telephone",
    "how to bake bread",
    "black holes",
]


def kv_blocks(requests: int, tokens_each: int, block_size: int | None = None) -> int:
    """num_kv_blocks that holds `requests` requests of up to `tokens_each` tokens at once, plus
    the null block. block_size None: the engine's default on this platform."""
    from pagedjax.platforms import current_platform

    block_size = block_size or current_platform().default_block_size
    return 1 + requests * -(-tokens_each // block_size)


def chat_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of one chat-templated user turn (optionally after a system turn)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(templated, add_special_tokens=False)


def make_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """W1: chat prompts whose token counts are spread over 25-200 by repeating context sentences."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        target = rng.randint(25, 200)
        text = f"Explain {rng.choice(TOPICS)} to a curious student."
        while True:
            ids = chat_ids(tokenizer, text)
            if len(ids) >= target:
                break
            text += f" Please also mention something surprising about {rng.choice(TOPICS)}."
        prompts.append(ids[-target:] if len(ids) > target else ids)
    return prompts


def sized_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """One chat prompt of exactly each length in `lengths` (the last `length` tokens are kept, so
    every prompt ends with the assistant header)."""
    rng = random.Random(seed)
    prompts = []
    for target in lengths:
        sentences = [f"Explain {rng.choice(TOPICS)} to a curious student."]
        while True:
            ids = chat_ids(tokenizer, " ".join(sentences))
            if len(ids) >= target:
                break
            for _ in range(max(1, (target - len(ids)) // 10)):  # about 12 tokens a sentence
                sentences.append(f"Please also mention something about {rng.choice(TOPICS)}.")
        prompts.append(ids[-target:])
    return prompts


def w2(tokenizer, count: int = 256, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """W2: prompt lengths uniform in 32-512 tokens, output lengths (max_tokens, with ignore_eos)
    uniform in 16-512. Returns (prompts, max_tokens per request)."""
    rng = random.Random(seed)
    lengths = [rng.randint(32, 512) for _ in range(count)]
    outputs = [rng.randint(16, 512) for _ in range(count)]
    return sized_prompts(tokenizer, lengths, seed), outputs


def poisson_arrivals(rate: float, count: int, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `count` requests arrives, at `rate` per second."""
    rng = random.Random(seed)
    now, times = 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def system_prompt(tokenizer, num_tokens: int = 1024) -> str:
    """A deterministic system prompt of about `num_tokens` tokens."""
    rules = [
        f"Rule {i}: when asked about {TOPICS[i % len(TOPICS)]}, be accurate and brief."
        for i in range(1, 400)
    ]
    text = "You are a helpful assistant. Follow these rules."
    for rule in rules:
        if len(tokenizer.encode(text + " " + rule, add_special_tokens=False)) > num_tokens:
            break
        text += " " + rule
    return text
