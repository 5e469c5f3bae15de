"""End to end on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): the engine's greedy
tokens, for 16 chat prompts submitted together, equal transformers' greedy `generate` from the
same file."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three prime numbers.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    from pagedjax.llm import LLM
    from pagedjax.platforms import current_platform

    pool_tokens = 8192
    return LLM(
        None,
        max_model_len=512,
        max_num_batched_tokens=256,
        num_kv_blocks=pool_tokens // current_platform().default_block_size,
    )


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_default_model_config(llm):
    config = llm.llm_engine.model_config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.head_dim == 64 and config.vocab_size == 49152 and config.tie_word_embeddings
    # Tied embeddings are held once: on the CPU as the packed LM head, which serves lookups too.
    params = llm.llm_engine.engine_core.worker.runner.params
    assert ("lm_head" in params) != ("embed" in params)
    # The file's Q4_1 layers and Q8_0 embeddings are run as stored (exactly; tested below).
    from pagedjax.cpu_native.matmul import QuantizedWeight

    assert isinstance(params["lm_head"], QuantizedWeight) and params["lm_head"].bits == 8
    assert all(w.bits == 4 for w in params["layers"]["w_gate_up"].layers)


def test_greedy_tokens_equal_transformers(llm, hf_default_model):
    import torch

    from pagedjax.sampling_params import SamplingParams

    tokenizer = llm.get_tokenizer()
    prompt_ids = [chat_ids(tokenizer, p) for p in PROMPTS]
    # The first request also scores its prompt (which must not change its tokens).
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=1 if i == 0 else None)
        for i in range(len(PROMPTS))
    ]
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outputs]

    hf = hf_default_model
    for prompt, ids, tokens in zip(PROMPTS, prompt_ids, ours, strict=True):
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
    assert sum(len(t) for t in ours) > 4 * MAX_TOKENS  # real answers, not immediate EOS
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids[0]])).logits[0]
    want = torch.log_softmax(logits.double(), -1).numpy()
    scored = outputs[0].prompt_logprobs
    assert scored[0] is None and len(scored) == len(prompt_ids[0])
    for position, entry in enumerate(scored[1:]):
        token = prompt_ids[0][position + 1]
        assert entry[token].logprob == pytest.approx(want[position, token], abs=1e-3)
    assert outputs[0].outputs[0].text.strip() == "The capital of France is Paris."


def test_int8_activations_answer_and_stay_batch_invariant(llm):
    """int8_activations=True (llama.cpp's numerics on the file's Q4_1 and Q8_0 weights):
    every block-quantized matmul is an Int8Weight; with batch_invariant=True a prompt's greedy
    tokens are the same alone and among the others (each row quantized on its own; without it,
    a prompt chunked differently among others runs other attention tiles, and on an AVX2
    machine that flips a near-tie of this prompt's); it answers a plain question, and its
    prompt logprobs stay near the float32 engine's. (Not the chat answer: like llama.cpp's on
    this file, its greedy reply to the first prompt is "L'Étoile, la ...", not Paris.)"""
    from pagedjax.cpu_native.matmul import Int8Weight
    from pagedjax.llm import LLM
    from pagedjax.sampling_params import SamplingParams

    int8 = LLM(
        None,
        max_model_len=512,
        max_num_batched_tokens=256,
        int8_activations=True,
        batch_invariant=True,
    )
    params = int8.llm_engine.engine_core.worker.runner.params
    assert isinstance(params["lm_head"], Int8Weight)
    assert all(isinstance(w, Int8Weight) for w in params["layers"]["w_down"].layers)
    tokenizer = int8.get_tokenizer()
    prompt_ids = [chat_ids(tokenizer, p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    together = int8.generate(prompt_ids, greedy, use_tqdm=False)
    alone = int8.generate(prompt_ids[3:4], greedy, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == together[3].outputs[0].token_ids
    question = tokenizer.encode("The capital of Germany is Berlin. The capital of Italy is")
    answer = int8.generate([question], greedy, use_tqdm=False)[0].outputs[0].text
    assert answer.startswith(" Rome"), answer
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ours, exact = (
        engine.generate(prompt_ids[:1], scoring, use_tqdm=False)[0].prompt_logprobs
        for engine in (int8, llm)
    )
    gaps = [
        abs(a[t].logprob - b[t].logprob)
        for a, b, t in zip(ours[1:], exact[1:], prompt_ids[0][1:], strict=True)
    ]
    assert max(gaps) < 1.0 and sum(gaps) / len(gaps) < 0.15, gaps
