"""Iteration-level scheduler: one token budget per step, chunked prefill, preemption; and the
update of each step's requests from what the model produced.

There are no prefill and decode phases. Each request has computed tokens (KV in the pool) and
known tokens (prompt + sampled); a step gives running requests their next tokens first (one
for decode, a chunk for a prompt still prefilling), then admits waiting requests in order
while budget, sequence slots and blocks last. When blocks run out, a running request is
preempted by recompute: its blocks are freed (their cached hashes survive, so its re-prefill
hits its own prefix cache) and it goes back to the front of the waiting queue. The
`SchedulingPolicy` orders both queues and picks the victim (by default: lower priority value
first, then earlier arrival; the lowest-priority, latest-arrived request is preempted).

n > 1: a parent reserves sequence slots for its n - 1 siblings until it samples its first
token; in that step each sibling samples from the parent's logits too, and then shares the
parent's blocks (copy-on-write) instead of prefilling the prompt again.

Speculative decoding (`speculative`): a decoding request gets draft tokens from the proposer,
scheduled after its last token with slots of their own (not cached: they are guesses); the
step's verdict keeps the accepted ones and the target's own next token, and gives the slots
of the rest back. With n-gram proposals such a request waits for its last token rather than
run a step ahead of it (async scheduling), since its drafts follow that token; a draft model
proposes on the device, from the token the device already has.

Beam search: a request that holds its samples is not scheduled from each sample until the
caller releases it (having perhaps replaced the sampled token, and forked the request with
`fork_request`); a waiting request short of slots or blocks preempts held ones first.
"""

from __future__ import annotations

import bisect
import logging
import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, islice, repeat

from pagedjax.core.engine_request import EngineRequest, RequestStatus, request_finished
from pagedjax.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.memory import blocks_held
from pagedjax.core.ngram_proposer import NgramProposer
from pagedjax.core.sched_output import (
    CoreOutput,
    DecodeOutputs,
    EngineCoreOutput,
    ModelRunnerOutput,
    SampleRow,
    ScheduledSequence,
    SchedulerOutput,
    is_placeholder,
    placeholder_token,
    placeholder_tokens,
)
from pagedjax.core.sched_policy import PriorityPolicy, SchedulingPolicy
from pagedjax.core.spec_decode import DraftModelSlots, SpecDecodeStats, SpeculativeConfig
from pagedjax.core.steady_batch import (
    SteadyBatch,
    plain_request,
    plain_rows,
    steps_per_dispatch,
)
from pagedjax.errors import InvalidRequestError, RequestTooLongError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    """What any request must fit in: sequence slots, length, and the whole KV pool (plain
    numbers, so a front end in another process checks requests before sending them)."""

    max_num_seqs: int
    max_model_len: int
    block_size: int
    usable_blocks: int
    # Each KV cache group's sliding window (0: full attention) and the most tokens a
    # request's step allocates: a sliding group holds only its window's blocks.
    group_windows: tuple[int, ...] = (0,)
    max_step_tokens: int = 0

    def check(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
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
        blocks = blocks_held(total, self.block_size, self.group_windows, self.max_step_tokens)
        usable = self.usable_blocks
        if blocks > usable:
            raise RequestTooLongError(
                f"{total} tokens need {blocks} KV blocks but the pool has {usable}: lower "
                "max_tokens or give the engine more KV memory"
            )


def _sequence_slots(request: EngineRequest) -> int:
    """Sequence slots a request holds: a parent that has not sampled yet reserves one for each
    of the n - 1 siblings it will fork."""
    if request.sample_index == 0 and request.num_output_tokens == 0:
        return request.params.n
    return 1


_NO_BIAS: dict[int, float] = {}  # shared by the rows without one: never changed


def _min_tokens_bias(request: EngineRequest, num_output_tokens: int) -> dict[int, float]:
    """The bias of a sample after `num_output_tokens` outputs (not to be changed): stop
    tokens and EOS are -inf until min_tokens are out."""
    if num_output_tokens < request.params.min_tokens:
        return dict.fromkeys(request.min_tokens_banned, float("-inf"))
    return _NO_BIAS


DEFAULT_POLICY = PriorityPolicy()


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager | HybridKVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
        policy: SchedulingPolicy = DEFAULT_POLICY,
        prefer_swap: Callable[[int], bool] | None = None,
        speculative: SpeculativeConfig | None = None,
        num_scheduler_steps: int = 1,
        placeholder_stride: int = 0,
        max_loras: int = 0,
        steady_decode: bool = False,
    ) -> None:
        """prefer_swap(num_computed_tokens): whether a victim with that much KV is swapped to
        the KV cache manager's host tier (if it has room) rather than recomputed; None:
        always recompute. speculative: propose draft tokens (None: no speculation).
        num_scheduler_steps: decode steps a step of only decodes may run; placeholder_stride:
        the runner's row stride between a step's iterations (the padded max_num_seqs);
        max_loras: LoRA adapters the running requests may use at once (0: LoRA is off);
        steady_decode: schedule steady decode steps from their batch (`core/steady_batch.py`;
        the model runner must keep their inputs: `ModelRunner.supports_steady_decode`)."""
        self.kv = kv_cache_manager
        self.max_loras = max_loras
        self.prefer_swap = prefer_swap
        self.policy = policy
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # In policy order, except that preempted requests re-enter at the front.
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []  # in policy order from each step's start
        # Whether `running` is in policy order: only an append can break it (keys never change).
        self._running_sorted = True
        self.requests: dict[str, EngineRequest] = {}  # unfinished user requests' parents
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions by swap (the others recompute)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0  # of the requests added
        self.speculative = speculative
        self.proposer = None
        if speculative is not None and speculative.method == "draft_model":
            self.proposer = DraftModelSlots(speculative.num_speculative_tokens)
        elif speculative is not None:
            self.proposer = NgramProposer(
                speculative.num_speculative_tokens,
                speculative.prompt_lookup_min,
                speculative.prompt_lookup_max,
            )
        self._drafts_on_device = getattr(self.proposer, "on_device", False)
        self.spec_stats = SpecDecodeStats()
        self._speculating = False  # this step proposes drafts (set per schedule)
        self.num_scheduler_steps = num_scheduler_steps
        self.placeholder_stride = placeholder_stride
        self._steady: SteadyBatch | None = None  # dropped whenever `running` changes
        self.num_finished = 0  # sequences finished (a steady step's update checks it)
        # The latest of them, newest last: a steady step's update finds its rows finished
        # since it was scheduled among these (`_gone_rows`), not by a walk over its rows.
        self._recently_finished: deque[EngineRequest] = deque(maxlen=max_num_seqs)
        self._num_batches = 0  # steady batches formed (their ids)
        self.steady_decode = steady_decode

    @property
    def steady_decode(self) -> bool:
        """Whether steady decode steps are scheduled from their batch (`core/steady_batch.py`)."""
        return self._steady_decode

    @steady_decode.setter
    def steady_decode(self, on: bool) -> None:
        # Speculative steps plan each row's drafts on the host: never steady.
        self._steady_decode = on and self.speculative is None
        self._steady = None  # the next step is a general one either way

    def limits(self) -> RequestLimits:
        return RequestLimits(
            self.max_num_seqs,
            self.max_model_len,
            self.kv.block_size,
            self.kv.block_pool.num_usable_blocks,
            self.kv.windows,
            # Lookahead slots: a step's further decode steps, or its drafts.
            self.max_num_batched_tokens
            + self.num_scheduler_steps
            + (self.speculative.num_speculative_tokens if self.speculative else 0),
        )

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raises when such a request could never run (so it would wait forever)."""
        self.limits().check(num_prompt_tokens, max_tokens, n)

    def add_request(self, request: EngineRequest) -> None:
        self.check_fits(request.num_prompt_tokens, request.max_tokens, request.params.n)
        request.status = RequestStatus.WAITING
        self.num_prompt_tokens += request.num_prompt_tokens
        self.requests[request.group_id] = request
        self._enqueue(request)

    def _enqueue(self, request: EngineRequest) -> None:
        sort_key = self.policy.sort_key
        index = bisect.bisect_right(self.waiting, sort_key(request), key=sort_key)
        self.waiting.insert(index, request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _must_wait(self, request: EngineRequest) -> bool:
        """Whether a request whose last token is still being sampled (the step in flight) waits
        for it instead of computing it now: penalties need the token's value on the host, and
        a request that reaches its length limit with it will not sample again."""
        num_tokens = len(request.all_token_ids)
        return (
            request.needs_output_on_host
            or num_tokens - request.num_prompt_tokens >= request.max_tokens
            or num_tokens >= self.max_model_len
        )

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
        if self._steady is not None:  # a step beside the batch walks its pending requests
            self._steady.remove(victim)
            self._steady = None
        if (
            self.prefer_swap is not None
            and self.kv.can_swap_out(victim)
            and self.prefer_swap(victim.num_computed_tokens)
        ):
            self.kv.swap_out(victim)  # its computed tokens come back on readmission
            self.num_swaps += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        self.waiting.insert(0, victim)  # front of the queue, whatever its sort key
        return victim

    def _speculates(self, request: EngineRequest) -> bool:
        """Whether a request may get drafts: one that samples with neither host-side history
        (penalties, constraints) nor held samples (beams)."""
        return (
            self._speculating
            and request.constraints is None
            and not request.hold_samples
            and not request.needs_output_on_host
        )

    def _propose(self, request: EngineRequest, budget: int) -> list[int]:
        """Drafts for a decoding request, within its length limits and the step's budget."""
        if request.num_tokens - request.num_computed_tokens != 1:
            return []  # still prefilling
        limit = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return self.proposer.propose(request, limit)

    def schedule(self) -> SchedulerOutput:
        if self._steady is not None:
            out = self._schedule_steady(self._steady)
            if out is not None:
                return out
            self._steady = None
        out = SchedulerOutput()
        spec = self.speculative
        self._speculating = spec is not None and (
            spec.disable_by_batch_size is None
            or len(self.running) + len(self.waiting) <= spec.disable_by_batch_size
        )
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # a step that preempted admits nothing: the pool is tight
            self._admit_waiting(out, budget)
        if self.num_scheduler_steps > 1:
            self._plan_steps(out)
        out.block_copies = self.kv.pop_block_copies()
        out.swaps_out, out.swaps_in = self.kv.pop_swaps()
        for index, (request, num_new) in enumerate(out.scheduled):
            self._add_model_input(out, index, request, num_new)
        if out.scheduled or out.swaps_out or out.swaps_in:  # a step that runs
            out.freed_request_ids = self.kv.pop_freed()
        if out.row_steps:  # several decode steps: one row per request, in the same order
            self._advance_steps(out)
        else:
            self._advance(out)
        if self.steady_decode and self._running_sorted and self._forms_steady(out):
            self._num_batches += 1
            self._steady = SteadyBatch.form(
                self._num_batches,
                self.running,
                self.kv,
                self.max_model_len,
                self.num_scheduler_steps,
                self.placeholder_stride,
            )
            out.batch_id = self._num_batches
        return out

    def _advance(self, out: SchedulerOutput, first: int = 0, first_row: int = 0) -> None:
        """The step's effects on the host, from scheduled request `first` and sample row
        `first_row` on (a steady step's rows have theirs): the next schedule (async
        scheduling runs it while this step is on the device) sees the tokens as computed,
        each sample as a placeholder token, and the forked siblings as running."""
        for request, num_new in out.scheduled[first:]:
            request.num_computed_tokens += num_new
        for parent, child in out.forks:
            parent.children.append(child)
            self._share_blocks(parent, child)
        positions, rows = out.row_positions, out.row_requests
        for row in range(first_row, len(rows)):
            sampler = rows[row]
            tokens = sampler.all_token_ids
            positions.append(len(tokens))
            if sampler.num_drafts_in_flight:
                continue  # how many tokens it gets is known only from the step's verdict
            tokens.append(placeholder_token(row))
            sampler.held = sampler.hold_samples

    def _forms_steady(self, out: SchedulerOutput) -> bool:
        """Whether the step's requests are the running ones, in order, each computing one
        token and sampling one plain row: the next steps may be steady."""
        running = self.running
        return (
            bool(out.scheduled)
            and not (out.preempted or out.forks or out.drafts or out.prompt_logprob_requests)
            and len(out.scheduled) == len(running)
            and all(num_new == 1 for _, num_new in out.scheduled)
            and all(map(operator.is_, (r for r, _ in out.scheduled), running))
            and all(map(operator.is_, out.row_requests, running))
            and plain_rows(running, out.rows, _NO_BIAS)
        )

    def _schedule_steady(self, batch: SteadyBatch) -> SchedulerOutput | None:
        """The steady batch's next step, or None when it is not steady (nothing changed but
        slots taken and pending requests joined, as the general way would take and keep
        them). The requests admitted since the batch formed, and those waiting while a
        sequence slot is free, are scheduled beside its rows the general way; where none
        is, the rows may run several decode steps, as the general way would run them."""
        if len(self.running) != batch.num_running:
            return None
        several = self.num_scheduler_steps > 1
        if several and any(map(self._plans_own_steps, batch.pending)):
            return None  # the general way's steps would be several with it
        if batch.pending:
            self._join_pending(batch)
        grown = batch.start_step(self.kv, self.max_num_batched_tokens)
        if grown is None:
            return None
        out = SchedulerOutput(row_requests=list(batch.requests))
        out.scheduled = list(zip(batch.requests, repeat(1)))
        positions = batch.positions()
        out.row_positions = list(map(operator.add, positions, repeat(1)))
        n = len(out.scheduled)
        if batch.pending or (self.waiting and len(self.running) < self.max_num_seqs):
            self._schedule_beside(out, batch)
        alone = len(out.scheduled) == n and not out.preempted
        max_steps = self.num_scheduler_steps if several and alone else 1
        out.decode = step = batch.take_step(self.kv, grown, positions, max_steps)
        out.num_steps, out.row_steps = step.num_steps, step.row_steps
        out.steady = batch.steady_rows(self.num_finished)
        out.block_copies = self.kv.pop_block_copies()
        out.swaps_out, out.swaps_in = self.kv.pop_swaps()
        out.freed_request_ids = self.kv.pop_freed()
        return out

    def _plans_own_steps(self, request: EngineRequest) -> bool:
        """Whether a pending request that never joins the batch (not a plain one, or its
        stop tokens masked) decodes: the general way would plan several steps with it."""
        return (
            not plain_request(request)
            or _min_tokens_bias(request, request.num_output_tokens) is not _NO_BIAS
        ) and len(request.all_token_ids) - request.num_computed_tokens == 1

    def _join_pending(self, batch: SteadyBatch) -> None:
        """Makes rows of the pending requests, first to last, while each one's next token is
        a plain decode (the general way would schedule it as the batch's rows are)."""
        pending = batch.pending
        while pending:
            request = pending[0]
            tokens = request.all_token_ids
            if (
                len(tokens) - request.num_computed_tokens != 1
                or request.num_output_tokens == 0  # its first sample is a prefill's
                or request.held
                or not plain_request(request)
                or self._must_wait(request)
                or _min_tokens_bias(request, request.num_output_tokens) is not _NO_BIAS
            ):
                return
            seed, num_prompt = request.seed, request.num_prompt_tokens
            index = len(batch.requests)
            row = SampleRow(index, request.params, tokens, num_prompt, seed, _NO_BIAS, len(tokens))
            pending.pop(0)
            batch.join(request, row, self.kv)

    def _schedule_beside(self, out: SchedulerOutput, batch: SteadyBatch) -> None:
        """The general way's share of a steady step, after the batch's rows: the pending
        requests (their prefill chunks), then waiting requests admitted, each a sequence
        of the step's own after the batch's (`out.seqs`, `out.rows`), its sample rows after
        the batch's. Drops the batch after the step where the running requests no longer
        stay its rows and pending requests, in order."""
        n = len(out.scheduled)
        budget = self._schedule_running(out, self.max_num_batched_tokens - n, batch.pending)
        if self.waiting and not out.preempted:
            num_running = len(self.running)
            slots = len(batch.requests) + len(batch.retired)  # a row holds one slot
            slots += sum(_sequence_slots(r) for r in batch.pending)
            self._admit_waiting(out, budget, slots, batch.pending)
            if self._steady is batch:  # no held request was preempted
                admitted = self.running[num_running - 1 :]  # after the last running one
                keys = [self.policy.sort_key(r) for r in admitted]
                batch.pending += admitted[1:]
                if any(map(operator.gt, keys, keys[1:])):
                    self._steady = None  # one admitted out of order: the general way sorts
        for index, (request, num_new) in enumerate(out.scheduled[n:]):
            self._add_model_input(out, index, request, num_new)
        self._advance(out, n, n)

    def _steps_left(self, request: EngineRequest, num_new: int) -> int:
        """How many decode steps in a row the request may take without the host: up to its
        length limit, and while min_tokens masks its stop tokens, up to min_tokens (the mask is
        the step's); one for a row whose token mask changes with each token; 0 when the whole
        step must be a single one (not decoding, a first sample, beams, logits processors).
        Penalties need no host: the loop keeps the output history on the device."""
        num_output = request.num_output_tokens
        constraints = request.constraints
        if (
            num_new != 1
            or request.num_computed_tokens + 1 != request.num_tokens
            or num_output == 0  # its first sample (forks, prompt logprobs)
            or request.hold_samples
            or (constraints is not None and constraints.processors)  # Python on the logits
        ):
            return 0
        if constraints is not None:
            return 1  # its mask (a grammar's, bad words') follows each token: the first step
        left = min(request.max_tokens - num_output, self.max_model_len - request.num_tokens)
        min_tokens = request.params.min_tokens
        if num_output < min_tokens:  # its stop tokens are masked: only while that holds
            left = min(left, min_tokens - num_output)
        return left

    def _plan_steps(self, out: SchedulerOutput) -> None:
        """Makes the step several decode steps when every scheduled request decodes and none
        needs the host between its tokens: as many as the longest-running one can use (a
        power of two, so few shapes compile), each row capped at its own length limit, and
        their slots reserved now. A step whose slots do not fit stays a single one."""
        if out.preempted or not out.scheduled:
            return
        left = [self._steps_left(request, num_new) for request, num_new in out.scheduled]
        longest = max(left)
        if min(left) == 0 or longest < 2:
            return  # a single step serves them all as well
        num_steps = steps_per_dispatch(self.num_scheduler_steps, longest)
        row_steps = [min(num_steps, n) for n in left]
        for index, ((request, _), steps) in enumerate(zip(out.scheduled, row_steps, strict=True)):
            # Its token's slot is held (`_schedule_running`): a block that slot filled is
            # cached now, and must not look shared to a second write into it (a copy).
            if self.kv.allocate_slots(request, 0, num_lookahead_tokens=steps) is None:
                for reserved, _ in out.scheduled[:index]:
                    self.kv.free_tail(reserved)  # the pool is tight: give the reserve back
                return
        out.num_steps, out.row_steps = num_steps, row_steps

    def _advance_steps(self, out: SchedulerOutput) -> None:
        """The host's view after a step of several decode steps: each request has computed
        as many tokens as it takes steps, and holds a placeholder for each sample."""
        stride = self.placeholder_stride
        for row, ((request, _), steps) in enumerate(zip(out.scheduled, out.row_steps, strict=True)):
            request.num_computed_tokens += steps
            tokens = request.all_token_ids
            out.row_positions.append(len(tokens))
            tokens += placeholder_tokens(row, steps, stride)

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, running: list[EngineRequest] | None = None
    ) -> int:
        """Running requests first, in policy order (arrival order among equals: sort is
        stable); returns the budget left. `running`: those of them to walk (a steady
        batch's pending requests), in that order; the preemption victims are among them."""
        if running is None:
            running = self.running
            if not self._running_sorted:
                running.sort(key=self.policy.sort_key)
                self._running_sorted = True
        threshold, speculating = self.long_prefill_token_threshold, self._speculating
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            tokens = request.all_token_ids
            num_new = len(tokens) - request.num_computed_tokens  # a chunk, or one decode token
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            speculates = speculating and self._speculates(request)
            if (
                num_new <= 0
                or request.held
                or request.num_drafts_in_flight
                or (
                    is_placeholder(tokens[-1])
                    and ((speculates and not self._drafts_on_device) or self._must_wait(request))
                )
            ):
                index += 1  # nothing to compute until its sampled token is known
                continue
            drafts = self._propose(request, budget) if speculates else []
            if drafts and (
                self.kv.allocate_slots(request, num_new, num_lookahead_tokens=len(drafts)) is None
            ):
                drafts = []  # no room for guesses: no one is preempted for them
            while not drafts and self.kv.allocate_slots(request, num_new) is None:
                # running[:index] are scheduled this step: never preempted.
                if self._preempt(out, running[index:]) is request:
                    break
            if request.status is RequestStatus.RUNNING:
                if drafts:
                    out.drafts[len(out.scheduled)] = drafts
                out.scheduled.append((request, num_new))
                budget -= num_new + len(drafts)
                index += 1
        return budget

    def _admit_waiting(
        self,
        out: SchedulerOutput,
        budget: int,
        slots_used: int | None = None,
        running: list[EngineRequest] | None = None,
    ) -> None:
        """Waiting requests in order while budget, sequence slots and blocks last; held
        requests are passed over. `slots_used`: the running requests' sequence slots, and
        `running`: those of them that may be held or use adapters (a steady batch's rows
        do neither), when known."""
        if not self.waiting:  # the steady state: no walk over the running requests
            return
        running = self.running if running is None else running
        if slots_used is None:
            slots_used = sum(_sequence_slots(r) for r in running)
        # LoRA: at most max_loras adapters among the running requests (one slot each).
        loras = {r.lora_id for r in running if r.lora_id} if self.max_loras else set()
        index = 0
        while index < len(self.waiting) and budget > 0:
            request = self.waiting[index]
            lora = request.lora_id
            if request.held or (lora and lora not in loras and len(loras) >= self.max_loras):
                index += 1  # an adapter past the slots waits for one to be free
                continue
            room = slots_used + _sequence_slots(request) <= self.max_num_seqs
            num_new = self._allocate_admission(request, budget) if room else None
            if num_new is None:
                if not self._preempt_held(out, running):
                    break
                slots_used -= 1
                index += 1  # the held request went in front of it
                continue
            self.waiting.pop(index)
            if request.num_cached_tokens is None:  # the prefix cache's share, first time
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._running_sorted = False
            out.scheduled.append((request, num_new))
            budget -= num_new
            slots_used += _sequence_slots(request)
            if lora:
                loras.add(lora)

    def _allocate_admission(self, request: EngineRequest, budget: int) -> int | None:
        """Blocks for a waiting request's first chunk, from the prefix cache where it hits, or
        from the host tier for one swapped out; sets its computed tokens and returns the
        chunk's size, or None (nothing changed) when the pool cannot hold it."""
        swapped = self.kv.is_swapped(request.request_id)
        if swapped:
            hits, num_computed = [], self.kv.num_swapped_tokens(request.request_id)
        else:
            hits, num_computed = self.kv.get_computed_blocks(request)
            num_host = 0
            if request.skip_prefix_cache:
                hits, num_computed = [], 0
            else:  # the prefix continues in the host tier: copied in, not recomputed
                num_host = self.kv.host_prefix_hits(request, len(hits))
                num_computed += num_host * self.kv.block_size
        remaining = request.num_tokens - num_computed
        if self.long_prefill_token_threshold:
            remaining = min(remaining, self.long_prefill_token_threshold)
        num_new = min(remaining, budget)
        if swapped:
            if not self.kv.swap_in(request, num_new):
                return None
            request.num_computed_tokens = num_computed
            self.kv.allocate_slots(request, num_new)  # swap_in made room for it
            return num_new
        request.num_computed_tokens = 0
        if self.kv.allocate_slots(request, num_new, hits, num_computed, num_host) is None:
            return None
        request.num_computed_tokens = num_computed
        return num_new

    def _preempt_held(self, out: SchedulerOutput, running: list[EngineRequest]) -> bool:
        """Preempts a held running request (of `running`) for a waiting one, if there is
        any: it computes nothing until released, and the waiting request may be what it
        waits for (a beam whose siblings are held until it has sampled)."""
        held = [request for request in running if request.held]
        if held:
            self._preempt(out, held)
        return bool(held)

    def _add_model_input(
        self, out: SchedulerOutput, index: int, request: EngineRequest, num_new: int
    ) -> None:
        """The request's share of the step, its prompt-logprob targets, and its sample rows
        (a parent about to sample its first token forks its siblings here)."""
        start = request.num_computed_tokens
        all_tokens = request.all_token_ids
        tokens = all_tokens[start : start + num_new]
        drafts = out.drafts.get(index) if out.drafts else None
        if drafts:
            self._add_draft_rows(out, index, request, tokens, drafts)
            return
        table = self.kv.table_update(request)
        seq = ScheduledSequence(
            tokens, start, request.request_id, *table, lora_id=request.lora_id or 0
        )
        out.seqs.append(seq)
        if request.num_prompt_logprobs and request.skip_prefix_cache:
            self._ask_prompt_logprobs(out, request, seq)
        if start + num_new < len(all_tokens):
            return  # a prefill chunk that does not reach the end: nothing to sample
        params = request.params
        if params.min_tokens or request.constraints is not None or params.n > 1:
            samplers = [request]
            if request.sample_index == 0 and len(all_tokens) == request.num_prompt_tokens:
                for i in range(1, params.n):  # its first sample: the siblings fork
                    child = request.make_child(i)
                    out.forks.append((request, child))
                    samplers.append(child)
            for sampler in samplers:
                self._add_sample_row(out, index, sampler)
            return
        # The common row, built inline: 256 times a step.
        seed = request.seed
        num_prompt = request.num_prompt_tokens
        row = SampleRow(index, params, all_tokens, num_prompt, seed, _NO_BIAS, len(all_tokens))
        out.rows.append(row)
        out.row_requests.append(request)

    @staticmethod
    def _add_sample_row(out: SchedulerOutput, index: int, sampler: EngineRequest) -> None:
        bias = _NO_BIAS
        if sampler.params.min_tokens:
            bias = _min_tokens_bias(sampler, sampler.num_output_tokens)
        constraints = sampler.constraints
        if constraints is not None:
            bias = {**bias, **constraints.banned(sampler.output_token_ids)}
        out.rows.append(
            SampleRow(
                index,
                sampler.params,
                sampler.all_token_ids,
                sampler.num_prompt_tokens,
                sampler.seed,
                bias,
                num_tokens=len(sampler.all_token_ids),
                constraints=constraints,
            )
        )
        out.row_requests.append(sampler)

    def _add_draft_rows(
        self,
        out: SchedulerOutput,
        index: int,
        request: EngineRequest,
        tokens: list[int],
        drafts: list[int],
    ) -> None:
        """A decoding request's last token and its drafts, with a sample row after each: row j
        verifies draft j, the last row samples the token after them all."""
        start = request.num_computed_tokens
        k = len(drafts)
        on_device = self._drafts_on_device
        table = self.kv.table_update(request)
        seq = ScheduledSequence(
            tokens + drafts, start, request.request_id, *table, lora_id=request.lora_id or 0
        )
        seq.num_model_drafts = k if on_device else 0
        out.seqs.append(seq)
        request.num_drafts_in_flight = k
        out.spec_rows[len(out.rows)] = k
        num_tokens = len(request.all_token_ids)
        for j in range(k + 1):
            out.rows.append(
                SampleRow(
                    index,
                    request.params,
                    request.all_token_ids,
                    request.num_prompt_tokens,
                    request.seed,
                    _min_tokens_bias(request, request.num_output_tokens + j),
                    num_tokens=num_tokens + j,
                    offset=k - j,
                    draft_token=drafts[j] if j < k and not on_device else -1,
                )
            )
            out.row_requests.append(request)

    @staticmethod
    def _ask_prompt_logprobs(
        out: SchedulerOutput, request: EngineRequest, seq: ScheduledSequence
    ) -> None:
        """Names the prompt tokens this chunk predicts whose logprobs are still missing (a
        chunk recomputed after a preemption asks for none twice)."""
        prompt = request.prompt_token_ids
        start = seq.num_computed_tokens
        first = max(start, request.num_prompt_logprobs - 1)
        stop = min(start + len(seq.token_ids), len(prompt) - 1)
        if first < stop:
            seq.prompt_logprob_targets = prompt[first + 1 : stop + 1]
            seq.prompt_logprobs_offset = first - start
            out.prompt_logprob_requests.append((request, stop - first))

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[CoreOutput]:
        """Puts each sampled token in place of its placeholder and finishes the sequences a
        stop token, max_tokens or max_model_len ends (stop strings are the output
        processor's); reports prompt logprobs. Rows of sequences that finished since the step
        was scheduled (with async scheduling, one step earlier) are dropped."""
        outputs = []
        first = 0
        for request, count in out.prompt_logprob_requests:
            request.num_prompt_logprobs += count
            outputs.append(
                EngineCoreOutput(
                    request.group_id,
                    0,
                    prompt_logprobs=result.prompt_logprobs,
                    prompt_logprobs_rows=(first, count),
                )
            )
            first += count
        row, rows = 0, out.row_requests
        if out.steady is not None:
            outputs += self._update_steady(out, result)
            row = len(out.decode.positions)  # the general way's rows beside the batch's
            if row == len(rows):
                return outputs
        positions, spec_rows = out.row_positions, out.spec_rows
        if out.row_steps:
            # Python lists: a row's tokens read from them cost a fraction of numpy's per-row
            # slicing; its flags are read alone only where a row is not plainly finite.
            tokens = result.token_ids.tolist()
            all_finite = result.finite.all(axis=1).tolist()  # each row's, past its steps too
            num_steps, num_plain = out.num_steps, 0
            for row, (request, steps) in enumerate(zip(rows, out.row_steps, strict=True)):
                if request.status.finished:
                    continue
                position, row_tokens = positions[row], tokens[row]
                del row_tokens[steps:]  # a fresh list: the row's steps alone
                end = position + steps
                if (  # nothing can end it: the common row
                    all_finite[row]
                    and request.constraints is None
                    and request.stop_token_ids.isdisjoint(row_tokens)
                    and self._check_stop(request, row_tokens[-1], end) is None  # its limit
                ):
                    request.all_token_ids[position:end] = row_tokens
                    num_plain += steps
                    outputs.append(self._output(request, row_tokens, result, row * num_steps, None))
                else:
                    at = (row, position, steps, num_steps, row_tokens, result.finite[row].tolist())
                    outputs.append(self._append_tokens(request, *at, result))
            self.num_generated_tokens += num_plain
            return outputs
        # Python lists: a row's token and flag read from them cost a fraction of numpy's
        # scalar indexing, 256 times a step.
        if not rows:
            return outputs
        tokens, finite = result.token_ids.tolist(), result.finite.tolist()
        logprobs = result.logprobs
        num_plain = 0
        while row < len(rows):
            request = rows[row]
            k = spec_rows.get(row) if spec_rows else None
            if k is not None:
                request.num_drafts_in_flight = 0
                if not request.status.finished:
                    outputs.append(self._append_verified(request, row, k, result))
                row += k + 1
                continue
            if not request.status.finished:
                token, position = tokens[row], positions[row]
                if (  # nothing can end it: the common row, 256 times a step
                    finite[row]
                    and request.constraints is None
                    and self._check_stop(request, token, position + 1) is None
                ):
                    request.all_token_ids[position] = token
                    num_plain += 1
                    outputs.append(
                        EngineCoreOutput(
                            request.group_id,
                            request.sample_index,
                            [token],
                            logprobs,
                            row,
                            num_cached_tokens=request.num_cached_tokens,
                        )
                    )
                else:
                    at = (row, position, token, finite[row])
                    outputs.append(self._append_token(request, *at, result))
            row += 1
        self.num_generated_tokens += num_plain
        return outputs

    def _update_steady(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[CoreOutput]:
        """`update_from_output` for a steady decode step: the rows that run on (most, and
        only they when nothing ended) in one `DecodeOutputs`, each token put in place with
        no Python loop; the rows a stop token, the length limit or NaN logits end, one by
        one. Rows finished since the step was scheduled are dropped."""
        if out.num_steps > 1:
            return self._update_steady_steps(out, result)
        rows, positions, steady = out.row_requests, out.row_positions, out.steady
        num_rows = len(out.decode.positions)
        rows = rows[:num_rows] if len(rows) > num_rows else rows
        tokens = result.token_ids.tolist()[:num_rows]
        ended = set(steady.ending)
        hits = steady.stop_token_ids.intersection(tokens)
        if hits:  # a row's token is some row's stop token: `_check_stop` decides
            ended.update(row for row, token in enumerate(tokens) if token in hits)
        finite = result.finite[:num_rows].tolist()
        nan = set() if all(finite) else {row for row, ok in enumerate(finite) if not ok}
        ended |= nan
        gone = self._gone_rows(rows, steady.num_finished)
        ended -= gone
        # Each token in place of its placeholder; those of rows gone or NaN go nowhere.
        targets, where = list(map(operator.attrgetter("all_token_ids"), rows)), positions
        if gone or nan:
            scratch, where = [0], list(positions)
            for row in gone | nan:
                targets[row], where[row] = scratch, -1
        any(map(list.__setitem__, targets, where, tokens))
        self.num_generated_tokens += num_rows - len(ended) - len(gone)
        outputs: list[CoreOutput] = [
            DecodeOutputs(steady.group_ids, steady.indices, tokens, result.logprobs, ended | gone)
        ]
        for row in sorted(ended):
            at = (row, positions[row], tokens[row], finite[row])
            outputs.append(self._append_token(rows[row], *at, result))
        return outputs

    def _update_steady_steps(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[CoreOutput]:
        """`_update_steady` for a steady step of several decode steps (only the batch's
        rows): each row's tokens in place of its placeholders with no Python loop; the rows
        a stop token, the length limit or NaN logits end, one by one (`_append_tokens`)."""
        rows, positions, steady, k = out.row_requests, out.row_positions, out.steady, out.num_steps
        tokens = result.token_ids.tolist()  # [rows][k]
        ended = set(steady.ending)
        hits = steady.stop_token_ids.intersection(chain.from_iterable(tokens))
        if hits:  # a row's token is some row's stop token: `_append_tokens` decides
            ended.update(row for row, ts in enumerate(tokens) if not hits.isdisjoint(ts))
        finite = result.finite
        if not finite.all():
            ended.update(row for row, ok in enumerate(finite.all(axis=1).tolist()) if not ok)
        gone = self._gone_rows(rows, steady.num_finished)
        ended -= gone
        # Each row's tokens in place of its placeholders; those of rows that end or are
        # gone go nowhere here.
        targets = list(map(operator.attrgetter("all_token_ids"), rows))
        slices = list(map(slice, positions, map(operator.add, positions, repeat(k))))
        if ended or gone:
            scratch = []
            for row in ended | gone:
                targets[row], slices[row] = scratch, slice(0, 0)
        any(map(list.__setitem__, targets, slices, tokens))
        self.num_generated_tokens += (len(rows) - len(ended) - len(gone)) * k
        outputs: list[CoreOutput] = [
            DecodeOutputs(
                steady.group_ids, steady.indices, tokens, result.logprobs, ended | gone, k
            )
        ]
        row_steps = out.row_steps
        for row in sorted(ended):
            at = (row, positions[row], row_steps[row], k, tokens[row], finite[row].tolist())
            outputs.append(self._append_tokens(rows[row], *at, result))
        return outputs

    def _gone_rows(self, rows: list[EngineRequest], num_finished: int) -> set[int]:
        """The rows of a step's `rows` that finished since it was scheduled, when
        `num_finished` sequences had."""
        count = self.num_finished - num_finished
        if count > len(self._recently_finished):  # more than kept: walk the rows
            return {row for row, request in enumerate(rows) if request.status.finished}
        since = islice(reversed(self._recently_finished), count)
        return {rows.index(request) for request in since if request in rows}

    def _append_verified(
        self, request: EngineRequest, first_row: int, k: int, result: ModelRunnerOutput
    ) -> EngineCoreOutput:
        """Appends the accepted drafts of rows first_row.. and the token after them (the
        target's own, at the first rejection or after the last draft), up to a stop; keeps
        the accepted drafts' KV and gives back the slots past the request's tokens."""
        tokens = []
        status = None
        accepted = result.accepted
        for row in range(first_row, first_row + k + 1):
            if not result.finite[row]:
                status = self._non_finite(request)
                break
            token = int(result.token_ids[row])
            request.all_token_ids.append(token)
            tokens.append(token)
            status = self._check_stop(request, token, len(request.all_token_ids))
            if status is not None or row == first_row + k or not accepted[row]:
                break
        num_accepted = int(accepted[first_row : first_row + len(tokens)].sum())
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += k
        stats.num_accepted_tokens += num_accepted
        self.num_generated_tokens += len(tokens)
        if status is not None:
            self.finish(request, status)
        elif request.status is RequestStatus.RUNNING:  # not preempted since it was scheduled
            request.num_computed_tokens += len(tokens) - 1  # the accepted drafts' KV
            self.kv.free_tail(request)
        return self._output(request, tokens, result, first_row, status)

    @staticmethod
    def _non_finite(request: EngineRequest) -> RequestStatus:
        """Logs a row whose logits held NaN or inf; its sequence finishes with an error."""
        logger.error("request %s: NaN/inf logits; it finishes with an error", request.request_id)
        return RequestStatus.FINISHED_ERROR

    @staticmethod
    def _output(
        request: EngineRequest,
        tokens: list[int],
        result: ModelRunnerOutput,
        first_row: int,
        status: RequestStatus | None,
    ) -> EngineCoreOutput:
        """A sequence's new tokens (their logprobs from `first_row` on) and its status."""
        return EngineCoreOutput(
            request.group_id,
            request.sample_index,
            tokens,
            result.logprobs,
            first_row,
            status,
            request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _append_token(
        self,
        request: EngineRequest,
        row: int,
        position: int,
        token: int,
        finite: bool,
        result: ModelRunnerOutput,
    ) -> EngineCoreOutput:
        """Row `row`'s sampled `token` in place of its placeholder at `position`."""
        if not finite:
            self.finish(request, self._non_finite(request))
            return EngineCoreOutput(request.group_id, request.sample_index, status=request.status)
        request.all_token_ids[position] = token
        self.num_generated_tokens += 1
        status = self._check_stop(request, token, position + 1)
        if request.constraints is not None and request.constraints.accept(token):
            status = status or RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if status is not None:
            self.finish(request, status)
        return self._output(request, [token], result, row, status)

    def _append_tokens(
        self,
        request: EngineRequest,
        row: int,
        position: int,
        steps: int,
        num_steps: int,
        row_tokens: list[int],
        row_finite: list[bool],
        result: ModelRunnerOutput,
    ) -> EngineCoreOutput:
        """A row's tokens from a step of several decode steps (`steps` of the step's
        `num_steps`; `row_tokens`, `row_finite`: the row's tokens and flags), in place of its
        placeholders, up to the first that ends the request (the loop ran on past it: those
        are dropped); their logprobs from row * num_steps on."""
        row_finite = row_finite[:steps]
        count = steps if all(row_finite) else row_finite.index(False)  # up to a NaN row
        tokens = row_tokens[:count]
        status = None
        stop_ids = request.stop_token_ids
        for i, token in enumerate(tokens):
            # A row's steps end at its length limit: only its last token can reach it.
            if i == steps - 1 or token in stop_ids:
                status = self._check_stop(request, token, position + i + 1)
                if request.constraints is not None and request.constraints.accept(token):
                    status = status or RequestStatus.FINISHED_STOPPED  # the grammar is complete
                if status is not None:
                    del tokens[i + 1 :]
                    break
        if status is None and count < steps:
            status = self._non_finite(request)
        all_tokens = request.all_token_ids
        all_tokens[position : position + len(tokens)] = tokens
        self.num_generated_tokens += len(tokens)
        if status is not None:
            del all_tokens[position + len(tokens) :]
            self.finish(request, status)
        return self._output(request, tokens, result, row * num_steps, status)

    def _check_stop(
        self, request: EngineRequest, token: int, num_tokens: int
    ) -> RequestStatus | None:
        """The status `token`, the request's `num_tokens`-th, ends it with (None: runs on)."""
        num_output_tokens = num_tokens - request.num_prompt_tokens
        if num_output_tokens >= request.params.min_tokens and token in request.stop_token_ids:
            # vLLM reports the id of a user stop token, and None for plain EOS.
            if token in request.params.stop_token_ids:
                request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= request.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _share_blocks(self, parent: EngineRequest, child: EngineRequest) -> None:
        """Runs `child` from `parent`'s computed tokens, sharing their blocks (copy-on-write)."""
        self._steady = None
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self._running_sorted = False

    def fork_request(self, parent: EngineRequest, child: EngineRequest) -> None:
        """Adds `child`, a user request of its own holding `parent`'s tokens but a different
        last one (a beam of beam search): it shares the parent's computed blocks, or, if the
        parent was preempted (holds none), waits beside it to recompute them."""
        if child.all_token_ids[:-1] != parent.all_token_ids[:-1]:
            raise ValueError(
                f"{child.request_id!r} must hold {parent.request_id!r}'s tokens but the last"
            )
        self.requests[child.group_id] = child
        if self.kv.has_request(parent.request_id):
            self._share_blocks(parent, child)
        else:
            child.status = RequestStatus.PREEMPTED
            self.waiting.insert(0, child)

    def preempt_all(self) -> list[EngineRequest]:
        """Preempts every running request to recompute (after the device pool was lost, or
        new weights): no KV of theirs is kept, swapped out or not."""
        out = SchedulerOutput()
        self.running.sort(key=self.policy.sort_key)
        prefer_swap, self.prefer_swap = self.prefer_swap, None
        try:
            while self.running:
                self._preempt(out, self.running)
        finally:
            self.prefer_swap = prefer_swap
        for request in self.waiting:
            if self.kv.is_swapped(request.request_id):
                self.kv.free(request)
                request.num_computed_tokens = 0
        return out.preempted

    def finish(self, request: EngineRequest, status: RequestStatus) -> None:
        """Removes a sequence wherever it is and frees its blocks, exactly once."""
        if request.status.finished:
            return
        if request in self.running:
            if self._steady is not None:  # every running request is in it
                self._steady.remove(request)
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.kv.has_request(request.request_id) or self.kv.is_swapped(request.request_id):
            self.kv.free(request)
        request.status = status
        self.num_finished += 1
        self._recently_finished.append(request)
        group = request.group
        if request_finished(group[0].params.n, [s.status for s in group]):
            self.requests.pop(group[0].group_id, None)

    def finish_group(self, group_id: str, status: RequestStatus) -> list[EngineRequest]:
        """Finishes every sequence of a user request (abort, a failed step); returns them."""
        root = self.requests.get(group_id)
        if root is None:
            return []
        group = root.group
        for request in group:
            self.finish(request, status)
        self.requests.pop(group_id, None)
        return group
