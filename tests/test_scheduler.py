"""Scheduler decisions without a model: budgets, chunking, admission order, preemption."""

from __future__ import annotations

import pytest

from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.scheduler import Scheduler
from pagedjax.errors import RequestTooLongError
from pagedjax.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=64, threshold=0):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(
        kv,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_len,
        long_prefill_token_threshold=threshold,
    )


def request(rid, prompt_len, priority=0, arrival=0.0, max_tokens=8, first_token=0):
    return EngineRequest(
        rid,
        list(range(first_token + 10, first_token + 10 + prompt_len)),
        SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        seed=0,
        priority=priority,
        arrival_time=arrival,
    )


def execute(scheduler: Scheduler, out, sampled_token=7) -> None:
    """What the engine does after running the step: advance, append a sampled token."""
    for req, num_new in out.scheduled:
        req.num_computed_tokens += num_new
        if req.num_computed_tokens == req.num_tokens:
            req.append_token_ids(sampled_token)


def test_budget_splits_a_long_prompt_across_steps_with_decodes_first():
    s = make(budget=10)
    a, b = request("a", 3, arrival=0), request("b", 25, arrival=1)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 3), ("b", 7)]
    execute(s, out)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]
    execute(s, out)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]


def test_long_prefill_threshold_caps_chunks():
    s = make(budget=32, threshold=5)
    s.add_request(request("a", 12))
    assert [n for _, n in s.schedule().scheduled] == [5]


def test_admission_follows_priority_then_arrival_and_max_num_seqs():
    s = make(max_seqs=2)
    for rid, priority, arrival in (("late", 0, 2.0), ("urgent", -1, 3.0), ("early", 0, 1.0)):
        s.add_request(request(rid, 2, priority, arrival))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["urgent", "early"]
    assert [r.request_id for r in s.waiting] == ["late"]


def test_preemption_picks_the_lowest_priority_and_admits_nothing_that_step():
    s = make(num_blocks=9, block_size=4, budget=64)  # 8 usable blocks
    low = request("low", 16, priority=5)
    high = request("high", 16, priority=0, arrival=1, first_token=100)
    s.add_request(low)
    s.add_request(high)
    out = s.schedule()  # 4 blocks each: the pool is full
    assert [r.request_id for r, _ in out.scheduled] == ["high", "low"]
    execute(s, out)
    s.add_request(request("new", 2, arrival=9))
    out = s.schedule()  # both need a fifth block
    assert [r.request_id for r in out.preempted] == ["low"]
    assert [r.request_id for r, _ in out.scheduled] == ["high"]
    assert [r.request_id for r in s.waiting] == ["low", "new"]
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert s.num_preemptions == 1


def test_the_lowest_request_preempts_itself_when_it_cannot_grow():
    s = make(num_blocks=9, block_size=4, budget=64)  # 8 usable blocks
    first = request("first", 16, arrival=0)
    second = request("second", 12, arrival=1, first_token=100)
    s.add_request(first)
    s.add_request(second)
    execute(s, s.schedule())  # 4 + 3 blocks
    out = s.schedule()  # first takes the last free block; second needs one more
    assert [r.request_id for r, _ in out.scheduled] == ["first"]
    assert out.preempted == [second]


def test_requests_that_can_never_fit_are_rejected_up_front():
    s = make(num_blocks=9, block_size=4, max_len=64)
    with pytest.raises(RequestTooLongError, match="max_model_len"):
        s.add_request(request("x", 60, max_tokens=8))
    with pytest.raises(RequestTooLongError, match="KV blocks"):
        s.add_request(request("y", 30, max_tokens=8))
    assert not s.has_unfinished_requests()


def test_finish_frees_exactly_once_wherever_the_request_is():
    s = make()
    running, waiting = request("r", 5), request("w", 5, arrival=1)
    s.add_request(running)
    execute(s, s.schedule())
    s.add_request(waiting)
    for req in (running, waiting, running):
        s.finish(req, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.block_pool.num_used_blocks == 0
