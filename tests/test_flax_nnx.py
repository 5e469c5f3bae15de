"""The Flax NNX module and its params in pagedjax's layout (`models/flax_nnx.py`): the module
matches transformers, the conversions are exact inverses, and a module trained with optax
generates through the engine as it does by itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from models.errors import ModelLoadError
from models.flax_nnx import LlamaForCausalLM, nnx_to_params, params_to_nnx, params_to_nnx_state

PROMPTS = [[5, 9, 11, 40], [17, 3, 60, 61, 62, 90, 7]]
MAX_TOKENS = 8


def nnx_model(tiny, name: str) -> LlamaForCausalLM:
    """A fresh module holding the tiny HF model's weights, through pagedjax's loader (into an
    abstract module: no random initialization to compute and overwrite)."""
    _, _, config, params = tiny(name)
    return params_to_nnx(params, nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0))))


@nnx.jit
def logits_of(model: LlamaForCausalLM, token_ids: jax.Array) -> jax.Array:
    return model(token_ids)


# mistral_window: its sliding window of 7 bites in 12 tokens.
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral_window"])
def test_logits_match_transformers(tiny, name):
    _, hf_model, _, _ = tiny(name)
    ids = np.random.default_rng(0).integers(0, 128, size=(2, 12))
    with torch.no_grad():
        want = hf_model(torch.tensor(ids)).logits.numpy()
    got = logits_of(nnx_model(tiny, name), jnp.asarray(ids, jnp.int32))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_round_trip_is_exact(tiny, name):
    _, _, config, params = tiny(name)
    model = nnx_model(tiny, name)
    for back in (nnx_to_params(model), nnx_to_params(nnx.state(model), config)):
        assert jax.tree.structure(back) == jax.tree.structure(params)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_mismatched_params_are_refused(tiny):
    _, _, _, qwen2_params = tiny("qwen2")  # has q/k/v biases, the llama module does not
    with pytest.raises(ModelLoadError, match="bqkv"):
        params_to_nnx_state(qwen2_params, nnx_model(tiny, "llama"))


def greedy_by_module(model: LlamaForCausalLM, prompt: list[int]) -> list[int]:
    """Greedy decoding by the module's own logits: one compiled length, as the forward is
    causal (the padding after position t never changes t's logits)."""
    ids = np.zeros((1, len(prompt) + MAX_TOKENS), np.int32)
    ids[0, : len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + MAX_TOKENS):
        ids[0, t] = int(jnp.argmax(logits_of(model, jnp.asarray(ids))[0, t - 1]))
    return ids[0, len(prompt) :].tolist()


def test_trained_module_generates_through_the_engine(tiny):
    from pagedjax import LLM, SamplingParams

    path, _, config, loaded = tiny("llama")
    model = nnx_model(tiny, "llama")
    untrained = [greedy_by_module(model, p) for p in PROMPTS]
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    batch = jnp.asarray(np.random.default_rng(1).integers(3, 128, size=(4, 16)), jnp.int32)

    def loss_fn(model: LlamaForCausalLM) -> jax.Array:
        logits = model(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @nnx.jit
    def train_step(model: LlamaForCausalLM, optimizer: nnx.Optimizer) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer)) for _ in range(6)]
    assert losses[-1] < 0.8 * losses[0], losses

    trained = [greedy_by_module(model, p) for p in PROMPTS]
    assert trained != untrained  # else the engine could be running the loaded weights
    # In memory: the config, the trained weights and the tokenizer; no files written.
    llm = LLM(
        model=config,
        params=nnx_to_params(model),
        tokenizer=str(path),
        max_model_len=64,
        num_kv_blocks=16,
        max_num_batched_tokens=32,
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate() -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        return [output.outputs[0].token_ids for output in outputs]

    assert generate() == trained
    llm.update_weights(loaded)  # and back to the weights before training
    assert generate() == untrained


@pytest.mark.parametrize("name,architecture", [("gemma2", "Gemma2"), ("mixtral", "Mixtral")])
def test_other_families_are_refused_saying_what_to_use(tiny, name, architecture):
    config = tiny(name)[2]
    with pytest.raises(ValueError, match=f"Llama family's; {architecture}ForCausalLM is not"):
        LlamaForCausalLM(config, rngs=nnx.Rngs(0))
