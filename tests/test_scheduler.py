"""Scheduler decisions without a model: budgets, chunking, admission order, preemption."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.sched_output import ModelRunnerOutput
from pagedjax.core.sched_policy import POLICIES, FCFSPolicy, PriorityPolicy
from pagedjax.core.scheduler import Scheduler
from pagedjax.errors import RequestTooLongError
from pagedjax.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=64, threshold=0, **kw):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(
        kv,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_len,
        long_prefill_token_threshold=threshold,
        **kw,
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
    """What the engine does after running the step: every row samples `sampled_token`."""
    rows = len(out.rows)
    result = ModelRunnerOutput(np.full(rows, sampled_token, np.int32), np.ones(rows, bool))
    scheduler.update_from_output(out, result)


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


class LongestContextVictim(PriorityPolicy):
    """A custom policy: preempt the request with the most computed tokens (frees most blocks)."""

    def select_victim(self, candidates):
        return max(candidates, key=lambda r: r.num_computed_tokens)


@pytest.mark.parametrize("policy", [PriorityPolicy(), FCFSPolicy(), LongestContextVictim()])
def test_the_lowest_request_preempts_itself_when_it_cannot_grow(policy):
    # Whatever the policy, "first" is scheduled before "second" fails, so it is no candidate
    # (even though its context is the longest) and "second" must preempt itself.
    s = make(num_blocks=9, block_size=4, budget=64, policy=policy)  # 8 usable blocks
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


def test_fcfs_policy_ignores_priority_for_admission_and_preemption():
    assert isinstance(POLICIES["fcfs"](), FCFSPolicy)
    assert isinstance(POLICIES["priority"](), PriorityPolicy)
    s = make(max_seqs=2, policy=FCFSPolicy())
    for rid, priority, arrival in (("late", 0, 2.0), ("urgent", -1, 3.0), ("early", 0, 1.0)):
        s.add_request(request(rid, 2, priority, arrival))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["early", "late"]
    assert [r.request_id for r in s.waiting] == ["urgent"]

    s = make(num_blocks=9, block_size=4, budget=64, policy=FCFSPolicy())  # 8 usable blocks
    low = request("low", 16, priority=5, arrival=0)
    high = request("high", 16, priority=0, arrival=1, first_token=100)
    s.add_request(low)
    s.add_request(high)
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["low", "high"]
    execute(s, out)
    out = s.schedule()  # both need a fifth block: the latest arrival goes, whatever its priority
    assert [r.request_id for r in out.preempted] == ["high"]
    assert [r.request_id for r, _ in out.scheduled] == ["low"]


def test_custom_policy_picks_the_victim():
    s = make(num_blocks=9, block_size=4, budget=64, policy=LongestContextVictim())
    long, short = request("long", 20, arrival=0), request("short", 12, arrival=1, first_token=100)
    s.add_request(long)
    s.add_request(short)
    execute(s, s.schedule())  # 5 + 3 blocks: the pool is full
    out = s.schedule()  # "long" needs a sixth block: it is the longest, so it goes
    assert [r.request_id for r in out.preempted] == ["long"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 1)]
    assert [r.request_id for r in s.waiting] == ["long"]


def test_a_victim_outside_the_candidates_is_rejected():
    class Bad(PriorityPolicy):
        def select_victim(self, candidates):
            return request("stranger", 1)

    s = make(num_blocks=9, block_size=4, budget=64, policy=Bad())
    s.add_request(request("a", 16))
    s.add_request(request("b", 16, arrival=1, first_token=100))
    execute(s, s.schedule())
    with pytest.raises(ValueError, match="not one of its candidates"):
        s.schedule()


def test_a_held_request_waits_gives_way_and_forks():
    """Beam search's hooks: a request holding its samples is not scheduled until released,
    yields its slot to a waiting request, and forks a sibling sharing its computed blocks."""
    s = make(max_seqs=1, block_size=4)
    a, b = request("a", 6), request("b", 5, arrival=1)
    a.hold_samples = True
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a"] and a.held
    execute(s, out, sampled_token=7)
    out = s.schedule()  # a is held: b takes its slot, a waits (preempted)
    assert [r.request_id for r, _ in out.scheduled] == ["b"]
    assert out.preempted == [a] and a.status is RequestStatus.PREEMPTED
    execute(s, out)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    a.all_token_ids[-1] = 9  # the caller's choice replaces the sampled token
    a.held = False
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 3)]  # 4 from the cache
    assert list(out.seqs[0].token_ids) == [14, 15, 9]
    execute(s, out)
    a.held = False
    child = request("a2", 6)
    child.all_token_ids = a.all_token_ids[:-1] + [11]
    s.fork_request(a, child)
    assert child.num_computed_tokens == a.num_computed_tokens == 7
    assert s.kv.get_block_ids(child) == s.kv.get_block_ids(a)  # shared until written
    with pytest.raises(ValueError, match="must hold"):
        s.fork_request(a, request("x", 6, first_token=1))


@pytest.mark.parametrize("steady", [False, True])
def test_steps_of_several_do_not_copy_the_block_their_first_token_fills(steady):
    """A decode step whose token fills a block caches that block as it schedules the token;
    reserving the further steps must not then take the block for a shared one and copy it
    (the cached block would keep an unwritten slot, the copy the token's KV)."""
    s = make(num_scheduler_steps=4, placeholder_stride=8, steady_decode=steady)
    r = request("a", 7, max_tokens=12)
    s.add_request(r)
    execute(s, s.schedule())  # the prompt; its first sample is the block's last token
    table = s.kv.get_block_ids(r)
    out = s.schedule()
    assert out.num_steps == 4 and out.block_copies == []
    assert s.kv.get_block_ids(r)[:2] == table[:2]
