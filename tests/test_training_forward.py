"""The dense, differentiable forward (`models/training.py`): transformers' logits, the engine's
sampled-token logprobs, and finite gradients for every parameter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.training import dense_logits_jit, token_logprobs, token_logprobs_jit
from pagedjax.llm import LLM
from pagedjax.sampling_params import SamplingParams

LENGTHS = (23, 14)  # a batch of two, the shorter right-padded


def padded_batch(sequences: list[list[int]], pad_id: int = 0) -> np.ndarray:
    """[B, T] int32, each sequence followed by pad_id up to the longest."""
    width = max(len(s) for s in sequences)
    return np.asarray([s + [pad_id] * (width - len(s)) for s in sequences], np.int32)


# Plain Llama (GQA), sliding windows shorter than the sequences, Qwen3's qk-norm and tied head,
# Gemma 2's soft caps and post-norms, a mixture of experts (Qwen2-MoE: routed and shared).
@pytest.mark.parametrize(
    "name", ["llama", "mistral_window", "qwen3", "gemma2", "gemma3", "qwen2_moe", "gpt_oss"]
)
def test_dense_logits_match_transformers(name, tiny):
    _, hf_model, config, params = tiny(name)
    rng = np.random.default_rng(3)
    sequences = [rng.integers(0, config.vocab_size, n).tolist() for n in LENGTHS]
    logits = np.asarray(dense_logits_jit(params, config, padded_batch(sequences, pad_id=7)))
    assert logits.shape == (2, max(LENGTHS), config.vocab_size) and logits.dtype == np.float32
    for row, sequence in zip(logits, sequences, strict=True):
        with torch.no_grad():
            expected = hf_model(torch.tensor([sequence])).logits[0].numpy()
        error = float(np.max(np.abs(row[: len(sequence)] - expected)))
        print(f"{name}: length {len(sequence)}, max abs logit error {error:.2e}")
        assert error < 1e-4


def test_engine_sampled_logprobs_match_token_logprobs(tiny):
    """A trainer can take the engine's logprobs (raw model distribution, temperature 1 draws)
    as those of the function it differentiates."""
    path, _, config, params = tiny("llama")
    llm = LLM(str(path), max_model_len=64, num_kv_blocks=48, max_num_batched_tokens=32)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 11, 17)]
    sampling = SamplingParams(temperature=1.0, seed=0, logprobs=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
    recomputed = np.asarray(token_logprobs_jit(params, config, padded_batch(sequences)))
    gaps = []
    for row, prompt, output in zip(recomputed, prompts, outputs, strict=True):
        completion = output.outputs[0]
        engine = [
            entry[t].logprob
            for t, entry in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
        # Row t predicts token t + 1: the outputs' predictions start at the prompt's last token.
        ours = row[len(prompt) - 1 : len(prompt) - 1 + len(engine)]
        gaps.append(np.abs(ours - np.asarray(engine)))
    gap = float(np.max(np.concatenate(gaps)))
    print(f"engine vs token_logprobs: max abs logprob gap {gap:.2e} over {sum(map(len, gaps))}")
    assert all(len(g) == 8 for g in gaps)
    assert gap < 1e-5


# Qwen2: the q/k/v biases too; Qwen2-MoE: the router and experts, through the grouped matmul.
@pytest.mark.parametrize("name", ["qwen2", "qwen2_moe"])
def test_gradients_are_finite_and_nonzero_for_every_parameter(tiny, name):
    _, _, config, params = tiny(name)
    rng = np.random.default_rng(5)
    sequences = [rng.integers(0, config.vocab_size, n).tolist() for n in LENGTHS]
    token_ids = padded_batch(sequences)
    # Only real next tokens count: a trainer masks the padding out of the loss.
    mask = np.arange(1, token_ids.shape[1])[None, :] < np.asarray(LENGTHS)[:, None]

    def loss(params):
        return -jnp.sum(token_logprobs(params, config, token_ids) * mask) / mask.sum()

    grads = jax.jit(jax.grad(loss))(params)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert len(leaves) == len(jax.tree_util.tree_leaves(params))
    for path, grad in leaves:
        name = jax.tree_util.keystr(path)
        assert bool(jnp.all(jnp.isfinite(grad))), name
        assert float(jnp.max(jnp.abs(grad))) > 0, name
