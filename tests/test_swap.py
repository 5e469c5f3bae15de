"""The KV cache's host tier: preemption by swap (pagedjax/core/host_pool.py,
pagedjax/worker/host_kv.py, pagedjax/core/swap_policy.py)."""

from __future__ import annotations

import pytest

from pagedjax.core.swap_policy import SwapCostModel, preemption_policy
from pagedjax.sampling_params import SamplingParams
from tests.test_engine import make_engine, run, tokens_of

PROMPTS = [[(7 * i + 3 * j) % 120 + 3 for j in range(10 + 5 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Six requests of up to 59 tokens in 10 blocks of 8: preempted again and again.
TIGHT = dict(block_size=8, num_kv_blocks=11, max_num_batched_tokens=32, max_model_len=64)


def count_computed_tokens(engine) -> list[int]:
    """[tokens the engine's steps computed so far], kept up to date from now on."""
    computed = [0]
    schedule = engine.engine_core.scheduler.schedule

    def counting():
        out = schedule()
        computed[0] += sum(n for _, n in out.scheduled)
        return out

    engine.engine_core.scheduler.schedule = counting
    return computed


@pytest.fixture(scope="module")
def expected(tiny):
    return tokens_of(run(make_engine(tiny, block_size=8), PROMPTS, GREEDY))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_swapped_requests_give_the_unconstrained_tokens(tiny, expected, async_scheduling):
    """Under heavy oversubscription, victims swap out and back in, no token recomputed for
    them: greedy tokens equal an unconstrained pool's and recompute's; nothing leaks."""
    engine = make_engine(tiny, preemption_mode="swap", async_scheduling=async_scheduling, **TIGHT)
    computed = count_computed_tokens(engine)
    assert tokens_of(run(engine, PROMPTS, GREEDY)) == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 3
    assert stats["num_swapped_preemptions"] == stats["num_preemptions"]
    # Every token computed once (the prefix cache may even serve some): none recomputed.
    assert computed[0] <= sum(len(p) for p in PROMPTS) + len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert stats["kv_blocks_used"] == 0 and stats["host_kv_blocks_used"] == 0

    recompute = make_engine(tiny, preemption_mode="recompute", **TIGHT)
    assert tokens_of(run(recompute, PROMPTS, GREEDY)) == expected
    assert recompute.stats()["num_swapped_preemptions"] == 0


def test_a_host_tier_too_small_falls_back_to_recompute(tiny, expected):
    config = tiny("llama")[2]
    block_bytes = 8 * 2 * config.num_layers * config.kv_size * 4  # float32 K and V
    # Room for three blocks on the host: the victims holding more recompute.
    engine = make_engine(tiny, preemption_mode="swap", swap_space=3 * block_bytes / 2**30, **TIGHT)
    assert engine.engine_core.kv_cache_manager.host_pool.num_blocks == 3
    assert tokens_of(run(engine, PROMPTS, GREEDY)) == expected
    stats = engine.stats()
    assert 0 < stats["num_swapped_preemptions"] < stats["num_preemptions"]
    assert stats["host_kv_blocks_used"] == 0


def test_aborts_and_forks_while_swapped_out_leak_nothing(tiny, expected):
    engine = make_engine(tiny, preemption_mode="swap", **TIGHT)
    pair = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, pair if i == 2 else GREEDY)
    kv = engine.engine_core.kv_cache_manager
    done, aborted = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        swapped = [r for r in engine.engine_core.scheduler.waiting if kv.is_swapped(r.request_id)]
        if aborted is None and swapped:
            aborted = swapped[0].group_id
            engine.abort_request(aborted)
    assert aborted is not None
    for i in range(len(PROMPTS)):
        if str(i) != aborted:
            for completion in done[str(i)].outputs:
                assert completion.token_ids == expected[i]
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["host_kv_blocks_used"] == 0


def test_the_policy_swaps_when_copying_costs_less_than_recomputing():
    # A 135M model's KV on a GPU: short contexts recompute, long ones swap.
    gpu = SwapCostModel(23_040, 2 * 1.1e8, 4 * 30 * 576, 2.5e10, 3e14)
    assert not gpu.prefer_swap(64) and gpu.prefer_swap(16384)
    cpu = SwapCostModel(46_080, 2 * 1.1e8, 4 * 30 * 576, 4e9, 1e11)
    assert cpu.prefer_swap(16)
    assert preemption_policy("recompute", cpu) is None
    assert preemption_policy("swap", gpu)(1)
    with pytest.raises(ValueError, match="preemption_mode"):
        preemption_policy("sometimes", cpu)


def test_a_swap_space_larger_than_the_machine_is_refused(tiny):
    with pytest.raises(ValueError, match="swap_space=100000 GiB is more than this machine"):
        make_engine(tiny, swap_space=100_000)


def test_prefix_blocks_evicted_from_the_pool_come_back_from_the_host(tiny):
    """A returning prompt whose cached blocks the pool evicted meanwhile: they are copied
    back from the host tier, not recomputed, and the tokens are unchanged."""
    engine = make_engine(tiny, block_size=8, num_kv_blocks=9, max_model_len=64)
    returning = [PROMPTS[5]]  # 35 tokens: four full blocks
    first = tokens_of(run(engine, returning, GREEDY))
    others = [[(11 * i + 5 * j) % 120 + 3 for j in range(40)] for i in range(3)]
    run(engine, others, GREEDY)  # turns the pool over: the returning blocks are evicted
    kv = engine.engine_core.kv_cache_manager
    assert kv.host_pool.num_cached_blocks > 0
    before = kv.prefix_cache_stats.host_hits
    computed = count_computed_tokens(engine)
    assert tokens_of(run(engine, returning, GREEDY)) == first
    assert kv.prefix_cache_stats.host_hits - before == 32  # its four full blocks
    assert computed[0] == len(returning[0]) - 32 + GREEDY.max_tokens - 1
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["host_kv_blocks_used"] == 0
