"""End to end on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): greedy tokens equal
transformers' greedy tokens from the same file."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three prime numbers.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def default_model():
    from models.loader import load_model, load_tokenizer

    config, params = load_model(None)
    return config, params, load_tokenizer(None)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_default_model_config(default_model):
    config, params, _ = default_model
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.head_dim == 64 and config.vocab_size == 49152 and config.tie_word_embeddings
    assert "lm_head" not in params


def test_greedy_tokens_equal_transformers(default_model):
    import torch
    from transformers import AutoModelForCausalLM

    from models.loader import resolve_model_path
    from pagedjax.greedy_loop import GreedyLoop

    config, params, tokenizer = default_model
    loop = GreedyLoop(config, params, max_model_len=512)
    ours = [list(loop.generate(chat_ids(tokenizer, p), MAX_TOKENS, (2,))) for p in PROMPTS]

    path = resolve_model_path(None).path
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        ids = chat_ids(tokenizer, prompt)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
        expected = out[0, len(ids) :].tolist()
        assert tokens == expected, f"{prompt!r}: {tokenizer.decode(tokens)!r}"
    assert sum(len(t) for t in ours) > 2 * MAX_TOKENS  # real answers, not immediate EOS
