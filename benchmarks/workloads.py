"""Seeded prompt and workload generators shared by the benchmark scripts (token-id prompts)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

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


def save_random_llama(
    path: Path | None = None,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 1,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    dtype: str = "float32",
    chat_template: bool = True,
    max_shard_size: str | None = None,
) -> Path:
    """A random-weight Llama saved at `path` with the tests' word-level tokenizer (text "w5 w9"
    is ids [5, 9]): the defaults are a model whose device work is negligible, for host-cost
    measurements and smoke runs. chat_template: a plain one, so chat workloads run too.
    path None: a folder in the system's temporary directory named by the arguments, saved once
    and reused (importing torch and transformers to build it costs more than most smoke runs)."""
    shape = {k: v for k, v in locals().items() if k != "path"}  # the arguments, before any other
    if path is None:
        import hashlib
        import os
        import tempfile

        key = hashlib.sha256(repr(sorted(shape.items())).encode()).hexdigest()[:16]
        cached = Path(tempfile.gettempdir()) / f"pagedjax-random-llama-{key}"
        if not cached.is_dir():
            building = Path(tempfile.mkdtemp(dir=cached.parent))
            save_random_llama(building, **shape)
            try:  # atomic: a concurrent run that got there first wins
                os.rename(building, cached)
            except OSError:
                import shutil

                shutil.rmtree(building, ignore_errors=True)
        return cached
    import torch
    import transformers

    if str(ROOT) not in sys.path:  # the tokenizer is the tests' (run as a script, not a package)
        sys.path.insert(0, str(ROOT))
    from tests.conftest import build_tiny_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    shards = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **shards)
    tokenizer = build_tiny_tokenizer(vocab_size)
    if chat_template:  # words the tokenizer does not know become one id each
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    return Path(path)


def load_peer(model: str | None = None, dtype: str = "float32"):
    """The transformers model the engine's `model` names (a GGUF file, dequantized, or a
    Hugging Face folder; None: the default model), in eval mode: the benchmarks' peer."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.loader import resolve_model_path

    files = resolve_model_path(model)
    gguf = {"gguf_file": files.path.name} if files.is_gguf else {}
    folder = files.path.parent if files.is_gguf else files.path
    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=getattr(torch, dtype), **gguf
    ).eval()
