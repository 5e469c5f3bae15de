"""Iteration-level scheduler: one token budget per step, chunked prefill, preemption.

There are no prefill and decode phases. Each request has computed tokens (KV in the pool) and
known tokens (prompt + sampled); a step gives running requests their next tokens first (one
for decode, a chunk for a prompt still prefilling), then admits waiting requests in order
while budget, sequence slots and blocks last. When blocks run out, a running request is
preempted by recompute: its blocks are freed (their cached hashes survive, so its re-prefill
hits its own prefix cache) and it goes back to the front of the waiting queue. The
`SchedulingPolicy` orders both queues and picks the victim (by default: lower priority value
first, then earlier arrival; the lowest-priority, latest-arrived request is preempted).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.sched_policy import PriorityPolicy, SchedulingPolicy
from pagedjax.errors import InvalidRequestError, RequestTooLongError


def _sequence_slots(request: EngineRequest) -> int:
    """Sequence slots a request holds: a parent that has not sampled yet reserves one for each
    of the n - 1 siblings it will fork (see LLMEngine.step)."""
    if request.sample_index == 0 and request.num_output_tokens == 0:
        return request.params.n
    return 1


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[EngineRequest, int]] = field(default_factory=list)  # batch order
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # CoW, before the step
    preempted: list[EngineRequest] = field(default_factory=list)


DEFAULT_POLICY = PriorityPolicy()


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
        policy: SchedulingPolicy = DEFAULT_POLICY,
    ) -> None:
        self.kv = kv_cache_manager
        self.policy = policy
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # In policy order, except that preempted requests re-enter at the front.
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []  # in policy order from each step's start
        self.num_preemptions = 0

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raises when such a request could never run (so it would wait forever)."""
        if n > self.max_num_seqs:
            raise InvalidRequestError(
                f"n={n} parallel samples need {n} sequence slots but max_num_seqs is "
                f"{self.max_num_seqs}: lower n or raise max_num_seqs"
            )
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds max_model_len {self.max_model_len}: shorten the prompt (or set "
                "truncate_prompt_tokens), lower max_tokens, or raise max_model_len"
            )
        blocks = -(-total // self.kv.block_size)
        usable = self.kv.block_pool.num_usable_blocks
        if blocks > usable:
            raise RequestTooLongError(
                f"{total} tokens need {blocks} KV blocks but the pool has {usable}: lower "
                "max_tokens or give the engine more KV memory"
            )

    def add_request(self, request: EngineRequest) -> None:
        self.check_fits(request.num_prompt_tokens, request.max_tokens, request.params.n)
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def _enqueue(self, request: EngineRequest) -> None:
        sort_key = self.policy.sort_key
        index = bisect.bisect_right(self.waiting, sort_key(request), key=sort_key)
        self.waiting.insert(index, request)

    def add_running(self, request: EngineRequest) -> None:
        """A fork (n > 1 child) that already shares its parent's computed blocks."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, request: EngineRequest, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if self.long_prefill_token_threshold and num_new > 1:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return min(num_new, budget)

    def _preempt(self, out: SchedulerOutput, candidates: list[EngineRequest]) -> EngineRequest:
        """Frees the running request the policy picks among `candidates`.

        Callers pass only running requests not yet scheduled this step (in policy order), so
        no victim ever holds slots allocated (and blocks cached) for a step that will not
        run, and no budget needs refunding.
        """
        victim = self.policy.select_victim(candidates)
        if not any(victim is candidate for candidate in candidates):
            raise ValueError(
                f"{type(self.policy).__name__}.select_victim returned {victim.request_id!r}, "
                "which is not one of its candidates; return one of them"
            )
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        self.waiting.insert(0, victim)  # front of the queue, whatever its sort key
        return victim

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # Running requests first, in policy order (arrival order among equals: sort is stable).
        self.running.sort(key=self.policy.sort_key)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(request, budget)
            if num_new <= 0:  # nothing to compute until it gets a sampled token
                index += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                # running[:index] are scheduled this step: never preempted.
                if self._preempt(out, self.running[index:]) is request:
                    break
            if request.status is RequestStatus.RUNNING:
                out.scheduled.append((request, num_new))
                budget -= num_new
                index += 1

        # Then admissions, unless this step preempted (the pool is tight).
        slots_used = sum(_sequence_slots(r) for r in self.running)
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and slots_used + _sequence_slots(self.waiting[0]) <= self.max_num_seqs
        ):
            request = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if request.skip_prefix_cache:
                hits, num_hit_tokens = [], 0
            request.num_computed_tokens = 0
            remaining = request.num_tokens - num_hit_tokens
            if self.long_prefill_token_threshold:
                remaining = min(remaining, self.long_prefill_token_threshold)
            num_new = min(remaining, budget)
            if self.kv.allocate_slots(request, num_new, hits, num_hit_tokens) is None:
                break
            self.waiting.pop(0)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
            slots_used += _sequence_slots(request)

        out.block_copies = self.kv.pop_block_copies()
        return out

    def preempt_all(self) -> list[EngineRequest]:
        """Preempts every running request (e.g. after the device pool was lost)."""
        out = SchedulerOutput()
        self.running.sort(key=self.policy.sort_key)
        while self.running:
            self._preempt(out, self.running)
        return out.preempted

    def finish(self, request: EngineRequest, status: RequestStatus) -> None:
        """Removes a request wherever it is and frees its blocks, exactly once."""
        if request.status.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.kv.has_request(request.request_id):
            self.kv.free(request)
        request.status = status
