"""Faults inside a step: a failing model runner and NaN logits fail only the requests they
touch; blocks are freed and the engine keeps serving."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pagedjax.sampling_params import SamplingParams
from tests.test_engine import GREEDY, make_engine, make_prompts, run, tokens_of


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    from models.loader import load_model

    path, hf_model = tiny_model_dir("llama")
    config, params = load_model(path)
    return lambda name: (path, hf_model, config, params)


def drain(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("donated_pool_lost", [False, True])
def test_a_failing_step_fails_only_its_requests(tiny_loaded, donated_pool_lost):
    engine = make_engine(tiny_loaded, max_num_batched_tokens=16)
    prompts = make_prompts(3, seed=20, lo=5, hi=12)
    params = SamplingParams(max_tokens=6, **GREEDY)
    expected = tokens_of(run(make_engine(tiny_loaded), prompts, params))

    real_dispatch = engine.engine_core.worker.runner.dispatch

    def failing_dispatch(*args, **kwargs):
        if donated_pool_lost:
            for leaf in (
                engine.engine_core.worker.runner.kv_cache.k,
                engine.engine_core.worker.runner.kv_cache.v,
            ):
                leaf.delete()  # what a failure inside the donating jitted call leaves behind
        raise RuntimeError("injected device failure")

    engine.add_request("a", prompts[0], params)
    engine.step()
    engine.engine_core.worker.runner.dispatch = failing_dispatch
    outputs = engine.step()
    engine.engine_core.worker.runner.dispatch = real_dispatch
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("a", "error")]
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0

    for i, prompt in enumerate(prompts):
        engine.add_request(f"later{i}", prompt, params)
    done = drain(engine)
    assert [done[f"later{i}"].outputs[0].token_ids for i in range(3)] == expected
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_nan_logits_finish_that_request_with_an_error(tiny_loaded):
    engine = make_engine(tiny_loaded)
    real_forward = engine.engine_core.worker.runner._forward

    poisoned_steps = []

    def forward_with_nan_row(*args, **kwargs):
        logits, cache, steps = real_forward(*args, **kwargs)
        poisoned_steps.append(len(poisoned_steps))
        return logits.at[0].set(jnp.nan), cache, steps  # the first sampled row of every step

    engine.engine_core.worker.runner._forward = forward_with_nan_row
    prompts = make_prompts(2, seed=21)
    engine.add_request("poisoned", prompts[0], SamplingParams(max_tokens=4, **GREEDY))
    done = drain(engine)
    engine.engine_core.worker.runner._forward = real_forward
    engine.add_request("healthy", prompts[1], SamplingParams(max_tokens=4, **GREEDY))
    done.update(drain(engine))
    poisoned = done["poisoned"].outputs[0]
    assert poisoned_steps  # the forward ran, and its logits were poisoned
    assert poisoned.finish_reason == "error" and poisoned.token_ids == []
    assert len(done["healthy"].outputs[0].token_ids) == 4
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_parallel_sampling_group_fails_as_a_whole(tiny_loaded):
    engine = make_engine(tiny_loaded, max_num_batched_tokens=8)
    engine.add_request("g", make_prompts(1, seed=22, lo=20, hi=21)[0], SamplingParams(n=3))
    engine.step()  # a first prefill chunk: no siblings yet

    def failing_dispatch(*args, **kwargs):
        raise RuntimeError("injected")

    real_dispatch, engine.engine_core.worker.runner.dispatch = (
        engine.engine_core.worker.runner.dispatch,
        failing_dispatch,
    )
    outputs = engine.step()
    engine.engine_core.worker.runner.dispatch = real_dispatch
    assert outputs[0].finished and outputs[0].outputs[0].finish_reason == "error"
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_oversubscribed_pool_completes_everything_exactly(tiny_loaded):
    """Demand 4x the pool: all requests finish, greedy tokens equal an unconstrained run, and
    preemptions stay bounded per request (progress, no livelock)."""
    prompts = make_prompts(8, seed=23, lo=20, hi=30)
    params = SamplingParams(max_tokens=16, **GREEDY)
    expected = tokens_of(run(make_engine(tiny_loaded, num_kv_blocks=128), prompts, params))
    demand_blocks = sum(-(-(len(p) + 16) // 8) for p in prompts)
    engine = make_engine(
        tiny_loaded, block_size=8, num_kv_blocks=1 + demand_blocks // 4, max_model_len=48
    )
    outputs = run(engine, prompts, params)
    assert tokens_of(outputs) == expected
    preemptions = engine.engine_core.scheduler.num_preemptions
    print(f"4x oversubscribed: {preemptions} preemptions for {len(prompts)} requests")
    assert 0 < preemptions <= 4 * len(prompts)
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_abort_in_every_state_frees_exactly_once(tiny_loaded):
    engine = make_engine(
        tiny_loaded, block_size=8, num_kv_blocks=7, max_model_len=48, max_num_batched_tokens=8
    )
    params = SamplingParams(max_tokens=20, **GREEDY)
    prompts = make_prompts(6, seed=24, lo=10, hi=12)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    states_seen = set()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        for seq in engine.engine_core.scheduler.running + engine.engine_core.scheduler.waiting:
            if seq.status.value == "waiting" or seq.status.value == "preempted":
                state = seq.status.value
            elif seq.num_computed_tokens < seq.num_prompt_tokens:
                state = "prefilling"
            else:
                state = "decoding"
            if state not in states_seen:
                states_seen.add(state)
                used = engine.engine_core.kv_cache_manager.block_pool.num_used_blocks
                held = (
                    len(engine.engine_core.kv_cache_manager.get_block_ids(seq))
                    if engine.engine_core.kv_cache_manager.has_request(seq.request_id)
                    else 0
                )
                engine.abort_request(seq.request_id)
                engine.abort_request(seq.request_id)  # twice: the second does nothing
                assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks <= used
                assert (
                    not engine.engine_core.kv_cache_manager.has_request(seq.request_id) or held == 0
                )
                break
    assert states_seen >= {"waiting", "prefilling", "decoding", "preempted"}, states_seen
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0
