"""A request as the scheduler and engine see it: tokens, sampling params, status, timings."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable

from pagedjax.core.request import Request
from pagedjax.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    def __init__(self, value: str) -> None:
        # A plain attribute: the engine reads it for every row of every step, and an enum's
        # `value` is a descriptor lookup.
        self.finished = value in ("stop", "length", "abort", "error")


class EngineRequest(Request):
    """One sequence being generated. For n > 1 the engine forks children that share the
    parent's prompt blocks; each child is an EngineRequest of its own with `parent_id` set."""

    def __init__(
        self,
        request_id: Hashable,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        seed: int,
        priority: int = 0,
        arrival_time: float | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        parent_id: Hashable | None = None,
        sample_index: int = 0,
    ):
        super().__init__(request_id, prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.seed = seed
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.stop_token_ids = stop_token_ids  # eos (unless ignore_eos) + params.stop_token_ids
        self.parent_id = parent_id
        self.sample_index = sample_index
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_returned_tokens = 0  # output tokens already in a DELTA output
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []
        self.first_token_time: float | None = None
        # The scheduler admits it without prefix-cache hits (prompt logprobs still to compute).
        self.skip_prefix_cache = False
        self.finish_time: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens
