"""Scheduling policies: the order of the scheduler's queues and the choice of whom to preempt.

A policy is the one place a scheduler's notion of "who goes first" lives. `sort_key` orders
both the waiting queue (admission order) and the running queue (the order running requests
get their next tokens); `select_victim` picks the running request to preempt when blocks run
out. Pass an instance as `Scheduler(..., policy=...)`; `POLICIES` names the built-in ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagedjax.core.engine_request import EngineRequest


class SchedulingPolicy(Protocol):
    def sort_key(self, request: EngineRequest) -> tuple[Any, ...]:
        """Queue position of a request: smaller keys are admitted and served first (ties keep
        insertion order)."""
        ...

    def select_victim(self, candidates: Sequence[EngineRequest]) -> EngineRequest:
        """The request to preempt, one of `candidates`: the running requests not yet
        scheduled this step (never empty), in `sort_key` order."""
        ...


class PriorityPolicy:
    """Lower priority value first, then earlier arrival; preempts the last of them."""

    def sort_key(self, request: EngineRequest) -> tuple[Any, ...]:
        return (request.priority, request.arrival_time)

    def select_victim(self, candidates: Sequence[EngineRequest]) -> EngineRequest:
        return candidates[-1]


class FCFSPolicy:
    """First come, first served: arrival order only, priority ignored (vLLM's "fcfs");
    preempts the latest arrival."""

    def sort_key(self, request: EngineRequest) -> tuple[Any, ...]:
        return (request.arrival_time,)

    def select_victim(self, candidates: Sequence[EngineRequest]) -> EngineRequest:
        return candidates[-1]


POLICIES: dict[str, type[SchedulingPolicy]] = {"priority": PriorityPolicy, "fcfs": FCFSPolicy}
"""The built-in policies by name (as a config would spell them); call one to get a policy."""
