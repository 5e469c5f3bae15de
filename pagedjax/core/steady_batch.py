"""The steady decode batch: vLLM V1's persistent batch, on the scheduler's side.

Most steps of a busy engine are alike: the same running requests, in the same order, each
computing the token sampled one step before and sampling the next. While that holds, a step
is worked out from the batch instead of request by request: the rows that reach the end of
their KV slots (only they go through the KV cache manager, whose O(1) path the others would
take; each is filed under the step that needs it), the rows that reach their length limit
(they leave the batch, as the general way leaves them out), and the positions. The model
runner keeps the rest of the rows' inputs from the step that formed the batch (`DecodeStep`).

The requests stay the truth: each step still advances their computed tokens and appends
their placeholders, so any step may be scheduled the general way. A request that finishes
leaves its row. Requests admitted while the batch lasts are `pending`: the general way
schedules them beside the batch's rows (their prefill), in the same step, and each joins the
batch as a new last row once it decodes plainly. The batch lasts until the running requests
change otherwise (a preemption, a fork, an admission out of order): the scheduler drops it
then, and a later general step forms a new one.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

from pagedjax.core.engine_request import EngineRequest
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.sched_output import (
    DecodeStep,
    SampleRow,
    SteadyRows,
    placeholder_token,
    placeholder_tokens,
)


def limit_of(request: EngineRequest, max_model_len: int) -> int:
    """The most tokens the request's sequence may hold."""
    return min(request.num_prompt_tokens + request.max_tokens, max_model_len)


def steps_per_dispatch(max_steps: int, longest: int) -> int:
    """The decode steps a dispatch runs when its longest-running row may take `longest`:
    a power of two (few shapes compile), at most `max_steps` (num_scheduler_steps)."""
    return min(max_steps, 1 << (longest - 1).bit_length())


def plain_request(request: EngineRequest) -> bool:
    """Whether the request samples with nothing that needs the host between its steps: no
    constraints, penalties, held samples or adapter."""
    return (
        request.constraints is None
        and not request.needs_output_on_host
        and not request.hold_samples
        and not request.lora_id
    )


def plain_rows(requests: Sequence[EngineRequest], rows: Sequence[SampleRow], bias: dict) -> bool:
    """Whether each request samples exactly row i (in order) with nothing that changes from
    step to step or needs the host between them: no bias (min_tokens), constraints, drafts,
    held samples, penalties or adapter."""
    return len(rows) == len(requests) and all(
        row.seq_index == i
        and row.extra_bias is bias
        and row.constraints is None
        and row.draft_token < 0
        and plain_request(request)
        for i, (request, row) in enumerate(zip(requests, rows, strict=True))
    )


@dataclass
class SteadyBatch:
    """The running requests of a steady decode batch, in row order. Row i's computed tokens
    are its count when the batch formed plus the steps taken since: so no step looks at
    every row, only at those a step number names (`due`). A request that finishes, or
    reaches its length limit (it waits for its last sample, then finishes: `retired`),
    leaves its row; the rows after it move up, in order, as in `Scheduler.running`."""

    batch_id: int
    requests: list[EngineRequest]
    base: list[int]  # [n] each request's computed tokens when the batch formed
    # [n] the step from which a row is at its length limit (its last sample unknown, it is
    # not scheduled: `Scheduler._must_wait`): it leaves the batch then (`_retire`).
    limits: list[int]
    # Step -> the requests whose token that step leaves the KV cache manager's O(1) path
    # (`fast_path_ends`): they alone go through `allocate_slots`.
    due: dict[int, list[EngineRequest]]
    placeholders: list[int]  # row i's placeholder token
    # Row i's sequence as the outputs name it; replaced, never changed, when a row leaves
    # (a step's `SteadyRows` holds them).
    group_ids: list[str]
    indices: list[int]
    stop_token_ids: frozenset[int]  # those of every row ever (a superset of the rows')
    max_model_len: int
    # Decode steps a dispatch may run (num_scheduler_steps), and the row stride of their
    # placeholders (`placeholder_tokens`).
    max_steps: int = 1
    stride: int = 0
    num_steps: int = 0  # decode steps taken
    # Rows removed since the last step, each numbered after the removals before it.
    removed: list[int] = field(default_factory=list)
    # Running requests out of the batch at their length limit: they finish next.
    retired: set[EngineRequest] = field(default_factory=set)
    # Each request's rank among the rows ever in the batch: the order the general way
    # allocates their blocks in.
    rank: dict[EngineRequest, int] = field(default_factory=dict)
    # Running requests admitted since the batch formed, not rows yet, in running order.
    pending: list[EngineRequest] = field(default_factory=list)
    # Rows joined since the last step: (request id, its sample row), in row order.
    added: list[tuple[object, SampleRow]] = field(default_factory=list)
    runs: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # `_placeholder_runs`

    @staticmethod
    def form(
        batch_id: int,
        requests: Sequence[EngineRequest],
        kv: KVCacheManager,
        max_model_len: int,
        max_steps: int = 1,
        stride: int = 0,
    ) -> SteadyBatch:
        """The batch of `requests`, each holding one token more than it computed."""
        requests = list(requests)
        base = [r.num_computed_tokens for r in requests]
        limits = (limit_of(r, max_model_len) for r in requests)
        batch = SteadyBatch(
            batch_id,
            requests,
            base,
            [limit - 1 - b for limit, b in zip(limits, base, strict=True)],
            {},
            [placeholder_token(row) for row in range(len(requests))],
            [r.group_id for r in requests],
            [r.sample_index for r in requests],
            frozenset().union(*(r.stop_token_ids for r in requests)),
            max_model_len,
            max_steps,
            stride,
            rank={request: row for row, request in enumerate(requests)},
        )
        batch._schedule_slots(requests, kv)
        return batch

    def _schedule_slots(self, requests: list[EngineRequest], kv: KVCacheManager) -> None:
        """Files each request under the next step that needs the KV cache manager's slow
        path for it."""
        due, now = self.due, self.num_steps
        for request, end in zip(requests, kv.fast_path_ends(requests), strict=True):
            base = request.num_computed_tokens - now
            due.setdefault(max(now, end - base), []).append(request)

    @property
    def num_running(self) -> int:
        """The running requests the batch stands for."""
        return len(self.requests) + len(self.retired) + len(self.pending)

    def join(self, request: EngineRequest, row: SampleRow, kv: KVCacheManager):
        """Makes a pending request, whose next token is one plain decode sampling `row`, the
        batch's last row."""
        index, now = len(self.requests), self.num_steps
        base = request.num_computed_tokens - now
        self.requests.append(request)
        self.base.append(base)
        self.limits.append(limit_of(request, self.max_model_len) - 1 - base)
        self.placeholders.append(placeholder_token(index))
        self.group_ids = [*self.group_ids, request.group_id]  # the last step's stay as they are
        self.indices = [*self.indices, request.sample_index]
        self.stop_token_ids |= request.stop_token_ids
        self.rank[request] = len(self.rank)
        self.added.append((request.request_id, row))
        self._schedule_slots([request], kv)

    def remove(self, request: EngineRequest) -> None:
        """Takes a finished request out."""
        if request in self.retired:
            self.retired.remove(request)
        elif self.pending and request in self.pending:
            self.pending.remove(request)
        else:
            self._remove_row(self.requests.index(request))

    def _remove_row(self, row: int) -> None:
        del self.requests[row], self.base[row], self.limits[row], self.placeholders[-1]
        self.group_ids = self.group_ids[:row] + self.group_ids[row + 1 :]
        self.indices = self.indices[:row] + self.indices[row + 1 :]
        self.removed.append(row)

    def _retire(self, step: int) -> None:
        """Takes out the rows at their length limit: as the general way, which does not
        schedule them, the update of their last sample finishes them."""
        limits = self.limits
        for row in reversed([row for row, limit in enumerate(limits) if limit <= step]):
            self.retired.add(self.requests[row])
            self._remove_row(row)

    def start_step(self, kv: KVCacheManager, budget: int) -> list[EngineRequest] | None:
        """The first part of the next step of every row (those at their length limit leave
        first): slots for the rows whose token needs them. Returns those rows, or None
        (nothing advanced; slots taken stay, as the general way would take them) when the
        step is not steady: no row is left, the budget is short, or the pool is out of
        blocks. `take_step` finishes the step."""
        step = self.num_steps
        if self.limits and min(self.limits) <= step:
            self._retire(step)
        requests = self.requests
        if not requests or len(requests) > budget:
            return None
        grown = self._pop_due(step, step + 1)
        for request in grown:
            if kv.offer_waits(request, request.num_computed_tokens + 1):
                continue  # filed again for the next step, when its token may be known
            if kv.allocate_slots(request, 1) is None:
                return None  # the general way preempts (and sees these tables' changes)
        return grown

    def positions(self) -> list[int]:
        """Each row's position in the next step (its computed tokens)."""
        return list(map(operator.add, self.base, repeat(self.num_steps)))

    def take_step(
        self,
        kv: KVCacheManager,
        grown: list[EngineRequest],
        positions: list[int],
        max_steps: int = 1,
    ) -> DecodeStep:
        """The step `start_step` began (`grown`: the rows it gave slots; `positions`: the
        rows' `positions()`, taken before anything was scheduled beside them), or up to
        `max_steps` decode steps of its rows in one dispatch where their reserves fit, as
        the general way plans them (`Scheduler._plan_steps`): each request advanced by its
        computed tokens and placeholders."""
        step = self.num_steps
        num_steps, row_steps = self._window(step, max_steps)
        if num_steps > 1:
            grown = grown + self._pop_due(step + 1, step + num_steps)
            grown.sort(key=self.rank.__getitem__)
            if not self._reserve(grown, kv, num_steps):
                num_steps, row_steps = 1, []
        updates = []
        for request in grown:
            start, block_ids = kv.table_update(request)
            if block_ids:
                updates.append((request.request_id, start, block_ids))
        # The rows' tokens: the last step's samples (placeholders), or sampled tokens when
        # that step's result came back first (async scheduling off).
        requests = self.requests
        token_ids = [r.all_token_ids[-1] for r in requests]
        if num_steps == 1:
            for request, placeholder in zip(requests, self.placeholders, strict=True):
                request.num_computed_tokens += 1
                request.all_token_ids.append(placeholder)
        elif min(row_steps) == num_steps:  # every row takes them all
            token_lists = map(operator.attrgetter("all_token_ids"), requests)
            any(map(list.extend, token_lists, self._placeholder_runs(num_steps)))
            for request in requests:
                request.num_computed_tokens += num_steps
        else:
            rows = zip(requests, range(len(requests)), row_steps, strict=True)
            for request, row, steps in rows:
                request.num_computed_tokens += steps
                request.all_token_ids += placeholder_tokens(row, steps, self.stride)
        self.num_steps = step + num_steps
        self._schedule_slots(grown, kv)
        removed, self.removed = self.removed, []
        added, self.added = self.added, []
        return DecodeStep(
            self.batch_id, token_ids, positions, updates, removed, added, num_steps, row_steps
        )

    def _placeholder_runs(self, num_steps: int) -> list[tuple[int, ...]]:
        """Each row's placeholders for `num_steps` decode steps (`placeholder_tokens`), made
        once per step count and row."""
        runs = self.runs.setdefault(num_steps, [])
        stride = self.stride
        runs += (
            tuple(placeholder_tokens(row, num_steps, stride))
            for row in range(len(runs), len(self.requests))
        )
        return runs

    def _pop_due(self, first: int, end: int) -> list[EngineRequest]:
        """The running rows filed under steps first .. end - 1, in row order."""
        due, retired = self.due, self.retired
        grown = [
            request
            for at in range(first, end)
            for request in due.pop(at, ())
            if not request.status.finished and request not in retired
        ]
        grown.sort(key=self.rank.__getitem__)  # rows filed at different steps: row order
        return grown

    def _window(self, step: int, max_steps: int) -> tuple[int, list[int]]:
        """The decode steps of a dispatch from `step` on, and each row's (empty for one):
        as the general way plans them, each row up to its length limit."""
        limits = self.limits
        if max_steps == 1 or (longest := max(limits) - step) < 2:  # one step: no max to take
            return 1, []
        num_steps = steps_per_dispatch(max_steps, longest)
        if min(limits) - step >= num_steps:
            return num_steps, [num_steps] * len(limits)
        return num_steps, [min(num_steps, limit - step) for limit in limits]

    def _reserve(self, grown: list[EngineRequest], kv: KVCacheManager, num_steps: int) -> bool:
        """Slots for each row's decode steps of the dispatch, in row order (the others have
        theirs); False when the pool is out of blocks, the reserves taken given back: as
        the general way's `_plan_steps`, which then runs one step."""
        max_len = self.max_model_len
        for index, request in enumerate(grown):
            computed = request.num_computed_tokens
            steps = min(num_steps, limit_of(request, max_len) - 1 - computed)
            if kv.holds_slots(request, computed + steps):
                continue  # the call would change nothing
            if kv.allocate_slots(request, 0, num_lookahead_tokens=steps) is None:
                for reserved in grown[:index]:
                    kv.free_tail(reserved)
                return False
        return True

    def steady_rows(self, num_finished: int) -> SteadyRows:
        """The last step's rows as its update reads them; `num_finished`: the sequences
        finished so far."""
        limits, step = self.limits, self.num_steps  # rows at their limit from step on
        if limits and min(limits) <= step:  # reached within the last step's decode steps
            ending = [row for row, limit in enumerate(limits) if limit <= step]
        else:
            ending = []
        return SteadyRows(self.group_ids, self.indices, self.stop_token_ids, ending, num_finished)
