"""Async scheduling: step N+1 is scheduled and dispatched while step N runs, its tokens from N
read on the device. Every token, greedy or seeded, must equal synchronous stepping."""

from __future__ import annotations

import pytest

from pagedjax.sampling_params import SamplingParams
from tests.test_engine import GREEDY, make_engine, make_prompts, run, tokens_of

MIXED = [
    SamplingParams(max_tokens=12, **GREEDY),
    SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=3),
    SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=5),
    SamplingParams(max_tokens=11, temperature=0.7, min_tokens=4, seed=9),
    SamplingParams(max_tokens=7, temperature=0.0, logprobs=2),
]


def all_tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefill beside decodes
        {"num_kv_blocks": 12, "block_size": 8, "max_model_len": 64},  # preemption
        {"max_num_seqs": 3},
    ],
    ids=["plain", "chunked", "preempting", "few_seqs"],
)
def test_tokens_equal_synchronous_stepping(tiny, options):
    prompts = make_prompts(len(MIXED) * 2, seed=11)
    params = MIXED * 2
    sync = run(make_engine(tiny, async_scheduling=False, **options), prompts, params)
    engine = make_engine(tiny, async_scheduling=True, **options)
    overlapped = run(engine, prompts, params)
    if "num_kv_blocks" in options:
        assert engine.engine_core.scheduler.num_preemptions > 0
    assert all_tokens(overlapped) == all_tokens(sync)
    for got, want in zip(overlapped, sync, strict=True):  # batches differ: float noise only
        for got_entry, want_entry in zip(
            got.outputs[0].logprobs or [], want.outputs[0].logprobs or [], strict=True
        ):
            assert got_entry.keys() == want_entry.keys()
            for token, logprob in got_entry.items():
                assert logprob.logprob == pytest.approx(want_entry[token].logprob, abs=1e-4)
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_stop_strings_end_requests_where_synchronous_stepping_does(tiny):
    """A stop string is found one step late (the next step is already dispatched): the
    request still ends where synchronous stepping ends it, and its blocks are freed."""
    prompts = make_prompts(4, seed=12)
    sync = run(
        make_engine(tiny, async_scheduling=False), prompts, SamplingParams(max_tokens=20, **GREEDY)
    )
    texts = [o.outputs[0].text for o in sync]
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]
    params = [SamplingParams(max_tokens=20, stop=[s], **GREEDY) for s in stops]
    expected = run(make_engine(tiny, async_scheduling=False), prompts, params)
    engine = make_engine(tiny, async_scheduling=True)
    got = run(engine, prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert tokens_of(got) == tokens_of(expected)
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_a_decode_runs_every_step_while_the_previous_one_is_on_the_device(tiny):
    engine = make_engine(tiny, async_scheduling=True)
    engine.add_request("a", make_prompts(1)[0], SamplingParams(max_tokens=10, **GREEDY))
    engine.step()
    assert engine.engine_core._in_flight is not None  # the prefill, not waited for
    while engine.has_unfinished_requests():
        engine.step()
    # One prefill and nine decodes, as synchronous stepping: the decode of each sampled
    # token was scheduled before that token was known.
    assert engine.engine_core.num_steps == 10
