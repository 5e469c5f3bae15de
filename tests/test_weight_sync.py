"""Weights in and out of a running engine (pagedjax/weight_sync.py): LLM(params=...),
update_weights / load_weights, sleep / wake_up."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.errors import ModelLoadError
from models.hf_params import hf_state_from_params, params_from_hf_state
from models.loader import load_model
from pagedjax import LLM, SamplingParams
from pagedjax.errors import EngineSleepingError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 17, 33, 40, 41, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
OPTIONS = dict(max_model_len=64, num_kv_blocks=24, block_size=16)


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def perturbed(params, scale: float, seed: int = 1):
    """Other weights of the same shapes (a training step's worth of change)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(tree, noisy)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    path, hf_model = tiny_model_dir("llama")
    config, params = load_model(path)
    return path, hf_model, config, params


@pytest.fixture(scope="module")
def llm(model):
    path, *_ = model
    return LLM(str(path), **OPTIONS)


def test_an_engine_from_weights_in_memory(model, llm):
    """From an HF state dict and a transformers config, or pagedjax's layout and a path:
    no weight file is read, and greedy tokens are the file-loaded engine's."""
    path, hf_model, config, params = model
    from transformers import AutoTokenizer

    expected = tokens(llm)
    state = {k: jnp.asarray(v.numpy()) for k, v in hf_model.state_dict().items()}
    tokenizer = AutoTokenizer.from_pretrained(path)
    in_memory = LLM(hf_model.config, params=state, tokenizer=tokenizer, **OPTIONS)
    assert tokens(in_memory) == expected
    assert tokens(LLM(str(path), params=params, **OPTIONS)) == expected
    with pytest.raises(ValueError, match="pass tokenizer="):
        LLM(hf_model.config, params=state)


def test_update_weights_changes_the_model_without_compiling(model, llm):
    path, _, config, params = model
    before = tokens(llm)
    other = perturbed(params, 0.5)
    reference = tokens(LLM(str(path), params=other, **OPTIONS))
    assert reference != before
    compilations = llm.llm_engine.stats()["num_compilations"]
    llm.update_weights(other)
    assert tokens(llm) == reference
    llm.load_weights(hf_state_from_params(config, params).items())  # vLLM's form, HF names
    assert tokens(llm) == before
    assert llm.llm_engine.stats()["num_compilations"] == compilations
    assert llm.llm_engine.stats()["prefix_cache_hit_rate"] >= 0  # reset, still reported


def test_bad_weights_say_what_and_change_nothing(model, llm):
    _, _, config, params = model
    before = tokens(llm)
    wrong = dict(params, final_norm=jnp.ones(3))
    with pytest.raises(ModelLoadError, match="final_norm has shape"):
        llm.update_weights(wrong)
    partial = list(hf_state_from_params(config, params).items())[:-3]
    with pytest.raises(ModelLoadError, match="has no"):
        llm.load_weights(partial)
    assert tokens(llm) == before


def test_requests_in_flight_are_recomputed_on_the_new_weights(model, llm):
    """A request running when the weights change keeps its tokens so far and continues as
    the new weights continue them (its KV recomputed), with and without a step in flight."""
    path, _, _, params = model
    other = perturbed(params, 0.5)
    prompt = PROMPTS[1]
    engine = llm.llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": prompt}, long)
    start = engine.engine_core.num_generated_tokens  # the module's engine ran before
    while engine.engine_core.num_generated_tokens < start + 4:
        engine.step()
    assert engine.engine_core.has_step_in_flight()  # async scheduling: its 5th token
    outputs = engine.update_weights(other)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5]  # the step in flight's
    assert engine.stats()["kv_blocks_used"] == 0  # preempted: its KV was the old weights'
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.finished), None)
    out = list(final.outputs[0].token_ids)
    assert len(out) == 10
    head = out[:5]  # four tokens, and the one the step in flight sampled
    new = LLM(str(path), params=other, **OPTIONS)
    continued = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert out[5:] == tokens(new, [prompt + head], continued)[0]
    llm.update_weights(params)


def test_sleep_gives_the_memory_back_and_wake_up_restores_it(model):
    path, _, _, params = model
    llm = LLM(str(path), **OPTIONS)
    before = tokens(llm)

    def device_bytes() -> int:
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())

    awake = device_bytes()
    pool = llm.llm_engine.stats()["kv_cache_bytes_total"]
    weights = llm.llm_engine.stats()["weights_bytes_total"]
    llm.sleep(level=1)
    assert awake - device_bytes() >= pool + weights
    with pytest.raises(EngineSleepingError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert device_bytes() >= awake - 1024
    assert tokens(llm) == before

    llm.sleep(level=2)  # the weights are discarded: new ones come from update_weights
    llm.wake_up()
    with pytest.raises(EngineSleepingError, match="update_weights"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.update_weights(params)
    assert tokens(llm) == before
    assert np.isfinite(llm.llm_engine.stats()["kv_usage"])


def test_async_llm_updates_weights_between_steps(model, llm):
    """The server's engine: a request streaming while the weights change finishes, its
    tokens the old weights' up to some point and the new weights' continuation after it;
    sleep refuses while requests run."""
    import asyncio
    import threading

    from pagedjax.async_llm import AsyncLLM

    path, _, _, params = model
    engine = AsyncLLM(str(path), **OPTIONS)
    other = perturbed(params, 0.5)
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # The engine's thread waits, after the step that gives "a" its third token, until the
    # update is queued: however far it could run ahead of this loop reading its outputs (a
    # loaded machine), the update lands before "a" ends.
    queued, seen, step = threading.Event(), [], engine.engine.step

    def gated_step():
        if len(seen) == 3:
            queued.wait(timeout=60)
        outputs = step()
        seen.extend(o for o in outputs if o.request_id == "a")
        return outputs

    engine.engine.step = gated_step

    async def run() -> list[int]:
        # Sleep is asked for right after the add is queued, 12 steps before it can finish.
        running = engine.generate({"prompt_token_ids": PROMPTS[1]}, long, "b")
        first = asyncio.ensure_future(anext(running))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="unfinished"):
            await engine.sleep()
        await first
        async for _ in running:
            pass
        final = None
        async for output in engine.generate({"prompt_token_ids": PROMPTS[0]}, long, "a"):
            if len(output.outputs[0].token_ids) == 3:
                update = asyncio.ensure_future(engine.update_weights(other))
                await asyncio.sleep(0)  # queued
                queued.set()
                await update
            final = output
        return list(final.outputs[0].token_ids)

    try:
        out = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(out) == 12
    old = tokens(llm, [PROMPTS[0]], long)[0]
    differs = next(i for i, (a, b) in enumerate(zip(out, old, strict=True)) if a != b)
    assert differs >= 3
    new = LLM(str(path), params=other, **OPTIONS)

    def continued(k: int) -> list[int]:
        rest = SamplingParams(temperature=0.0, max_tokens=12 - k, ignore_eos=True)
        return tokens(new, [PROMPTS[0] + out[:k]], rest)[0]

    assert any(out[k:] == continued(k) for k in range(3, differs + 1))


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemmas_hf_names_and_norm_offsets_go_both_ways(tiny, name):
    """A trainer's Hugging Face-named Gemma weights (norms as w, used as 1 + w; Gemma 3's
    qk-norms too) become the loader's params and back: post-norms by their names, the offset
    added once."""
    _, hf_model, config, loaded = tiny(name)
    state = {name: jnp.asarray(p.detach().numpy()) for name, p in hf_model.state_dict().items()}
    params = params_from_hf_state(config, state)
    for path, value in jax.tree_util.tree_leaves_with_path(loaded):
        got = functools.reduce(lambda tree, key: tree[key.key], path, params)
        np.testing.assert_allclose(np.asarray(got), np.asarray(value), rtol=1e-6, err_msg=str(path))
    back = hf_state_from_params(config, params)
    for name, value in back.items():
        np.testing.assert_allclose(np.asarray(value), np.asarray(state[name]), atol=1e-6)


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral", "gpt_oss"])
def test_expert_weights_go_both_ways_in_either_naming(tiny, name):
    """A mixture's experts in transformers v5's in-memory names (fused [E, 2I, H] gate_up,
    Mixtral's router as "mlp.gate") and in the checkpoint's (one tensor per expert) become
    the loader's params; back, they take the checkpoint's names. Qwen2-MoE brings its shared
    expert and dense layers between the expert ones; gpt-oss (one naming) its stacked,
    interleaved experts, biases and attention sinks."""
    from safetensors.numpy import load_file

    path, hf_model, config, loaded = tiny(name)
    in_memory = {k: jnp.asarray(p.detach().numpy()) for k, p in hf_model.state_dict().items()}
    on_disk = load_file(str(path / "model.safetensors"))
    assert (set(in_memory) == set(on_disk)) == (name == "gpt_oss")
    for state in (in_memory, on_disk):
        params = params_from_hf_state(config, state)
        for key, value in jax.tree_util.tree_leaves_with_path(loaded):
            got = functools.reduce(lambda tree, k: tree[k.key], key, params)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(value), err_msg=str(key))
    back = hf_state_from_params(config, params)
    assert set(back) == set(on_disk)
    for key, value in back.items():
        np.testing.assert_array_equal(np.asarray(value), on_disk[key], err_msg=key)
