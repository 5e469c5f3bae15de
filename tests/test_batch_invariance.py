"""Batch invariance (`docs/batch_invariance.md`): with batch_invariant=True a token's numbers do
not depend on how it was scheduled, and the dense training forward on `LLM.dense_kernels()`
reproduces the engine's logprobs, with XLA's gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import build_metadata
from models.llama import rms_norm
from models.training import XLA_KERNELS, token_logprobs, token_logprobs_jit
from pagedjax.cpu_native import build
from pagedjax.llm import LLM
from pagedjax.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not build.available(), reason="needs the C++ CPU kernels")


def padded_batch(sequences: list[list[int]]) -> np.ndarray:
    width = max(len(s) for s in sequences)
    return np.asarray([s + [0] * (width - len(s)) for s in sequences], np.int32)


@pytest.mark.parametrize("block_size, group", [(8, 1), (16, 3), (64, 2)])
def test_kernel_decode_row_is_its_prefill_row(block_size, group):
    """The same query over the same keys: alone (decode), last of a chunk, inside a prefill."""
    from pagedjax.cpu_native.attention import paged_attention_cpu

    rng = np.random.default_rng(block_size)
    heads, dim, blocks, length = 2, 32, 12, 5 * block_size - 3
    pool = KVCache(
        *(
            jnp.asarray(rng.standard_normal((1, heads, blocks, block_size, dim)), jnp.float32)
            for _ in "kv"
        )
    )
    q = jnp.asarray(rng.standard_normal((length, heads * group, dim)), jnp.float32)
    table = [[3, 1, 7, 2, 9]]

    def attend(q_len: int, invariant: bool = True) -> np.ndarray:
        metadata = build_metadata([q_len], [length], table, block_size)
        out = paged_attention_cpu(q[-q_len:], pool, 0, metadata, scale=0.2, invariant=invariant)
        return np.asarray(out)

    whole = attend(length)
    for q_len in (1, 2, 17):
        np.testing.assert_array_equal(attend(q_len), whole[-q_len:])
    # A decode row is the decode path either way; without the flag a prefill chunk runs
    # flash attention tiles instead, the same to rounding only.
    np.testing.assert_array_equal(attend(1, invariant=False), whole[-1:])
    np.testing.assert_allclose(attend(length, invariant=False), whole, atol=1e-5)


def test_rms_norm_of_a_row_does_not_depend_on_the_rows_beside_it():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 576)) * 3, jnp.float32)
    weight = jnp.linspace(0.5, 1.5, 576, dtype=jnp.float32)
    norm = jax.jit(lambda x: rms_norm(x, weight, 1e-5))
    whole = np.asarray(norm(x))
    for rows in (1, 2, 3, 4, 5, 8, 13):  # XLA's own reduction changes order below 8 rows
        np.testing.assert_array_equal(np.asarray(norm(x[:rows])), whole[:rows])


def logprobs_of(outputs) -> list[np.ndarray]:
    """Each output's sampled-token logprobs."""
    return [
        np.asarray([entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)])
        for c in (o.outputs[0] for o in outputs)
    ]


def sampled_logprobs(llm: LLM, prompts, sampling) -> list[np.ndarray]:
    return logprobs_of(llm.generate(prompts, sampling, use_tqdm=False))


# Qwen2-MoE: its experts on the C++ grouped kernel, its router, shared expert and dense
# layers on the packed matmul, every row's sums in order whatever shares its step.
@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_logprobs_are_the_same_however_the_request_is_scheduled(tiny, name):
    """One request's sampled-token logprobs, bit for bit: alone, beside others (other batch
    buckets), in prefill chunks of 8, behind a cached prefix, and preempted in a small pool."""
    path, _, config, _ = tiny(name)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, config.vocab_size, 29).tolist()
    others = [rng.integers(3, config.vocab_size, n).tolist() for n in (7, 40, 13, 22)]
    sampling = SamplingParams(temperature=1.0, seed=5, logprobs=0, max_tokens=24, ignore_eos=True)
    options = dict(max_model_len=96, block_size=8, batch_invariant=True)

    llm = LLM(str(path), num_kv_blocks=64, **options)
    alone = sampled_logprobs(llm, [prompt], sampling)[0]
    beside = sampled_logprobs(llm, [*others[:2], prompt, *others[2:]], sampling)[2]
    np.testing.assert_array_equal(beside, alone)
    cached = sampled_logprobs(llm, [prompt[:24] + prompt[24:]], sampling)[0]  # a prefix hit
    np.testing.assert_array_equal(cached, alone)

    chunked = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=8, **options)
    np.testing.assert_array_equal(sampled_logprobs(chunked, [prompt], sampling)[0], alone)

    # 14 blocks for five requests of up to 64 tokens: requests are preempted and recomputed.
    small = LLM(str(path), num_kv_blocks=14, swap_space=0, async_scheduling=False, **options)
    crowded = sampled_logprobs(small, [*others, prompt], sampling)[-1]
    assert small.llm_engine.stats()["num_preemptions"] > 0
    np.testing.assert_array_equal(crowded, alone)


# GQA; qk-norm, tied; soft caps; a mixture of experts (the grouped kernel, a shared expert)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "qwen2_moe"])
def test_dense_kernels_reproduce_the_engine_logprobs(tiny, name):
    path, _, config, params = tiny(name)
    llm = LLM(str(path), max_model_len=64, block_size=16, batch_invariant=True)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 19, 33)]
    sampling = SamplingParams(temperature=1.0, seed=0, logprobs=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
    kernels = llm.dense_kernels()
    recomputed = np.asarray(token_logprobs_jit(params, config, padded_batch(sequences), kernels))
    engine = logprobs_of(outputs)
    gaps = [
        np.abs(row[len(p) - 1 :][: len(e)] - e)
        for row, p, e in zip(recomputed, prompts, engine, strict=True)
    ]
    gap = float(np.max(np.concatenate(gaps)))
    print(f"{name}: dense kernels vs engine, max abs logprob gap {gap:.2e}")
    # The logits agree bit for bit; the last difference is the log-softmax's own rounding.
    assert gap < 1e-6


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])  # the experts' grouped kernel too
def test_dense_kernels_gradients_are_xlas(tiny, name):
    path, _, config, params = tiny(name)
    llm = LLM(str(path), max_model_len=64, block_size=16, batch_invariant=True)
    kernels = llm.dense_kernels()
    rng = np.random.default_rng(3)
    token_ids = padded_batch([rng.integers(0, config.vocab_size, n).tolist() for n in (21, 9)])

    def loss(params, kernels):
        return -jnp.mean(token_logprobs(params, config, token_ids, kernels))

    value, grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, kernels)
    xla_value, xla_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, XLA_KERNELS)
    np.testing.assert_allclose(value, xla_value, rtol=1e-5)
    for (where, g), x in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(xla_grads), strict=True
    ):
        scale = float(np.max(np.abs(x))) + 1e-12
        assert np.max(np.abs(np.asarray(g) - np.asarray(x))) / scale < 1e-4, where


def test_batch_invariant_refusals(tiny):
    path, *_ = tiny("llama")
    with pytest.raises(ValueError, match="runs on the C\\+\\+ attention, not 'xla'"):
        LLM(str(path), max_model_len=64, attention_backend="xla", batch_invariant=True)
    llm = LLM(str(path), max_model_len=64)
    with pytest.raises(ValueError, match="batch_invariant=True"):
        llm.dense_kernels()


def test_vllms_environment_variable_turns_it_on(monkeypatch):
    from pagedjax.config import EngineConfig

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig.from_options(None).batch_invariant
    assert not EngineConfig.from_options(None, batch_invariant=False).batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not EngineConfig.from_options(None).batch_invariant
