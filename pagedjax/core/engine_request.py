"""A sequence as the scheduler sees it: tokens, sampling params, limits, status."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

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


def request_finished(n: int, statuses: Sequence[RequestStatus | None]) -> bool:
    """Whether a user request with n completions is over, given its sequences' statuses, the
    parent's first (None: running). The children exist once the parent has forked them, so
    before that only an error or an abort of the parent ends the request."""
    complete = len(statuses) == n or statuses[0] in (
        RequestStatus.FINISHED_ERROR,
        RequestStatus.FINISHED_ABORTED,
    )
    return complete and all(s is not None and s.finished for s in statuses)


class EngineRequest(Request):
    """One sequence being generated. For n > 1 the scheduler forks the parent's n - 1
    siblings when it samples its first token (`make_child`); they share its blocks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        seed: int,
        priority: int = 0,
        arrival_time: float | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        min_tokens_banned: frozenset[int] = frozenset(),
        parent: EngineRequest | None = None,
        sample_index: int = 0,
        constraints: Any = None,
    ):
        super().__init__(request_id, prompt_token_ids)
        self.params = params
        # Read for every running request every step: taken once (params are not changed
        # once the request is added).
        self.needs_output_on_host = params.needs_output_on_host
        self.max_tokens = max_tokens
        self.seed = seed
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.stop_token_ids = stop_token_ids  # eos (unless ignore_eos) + params.stop_token_ids
        # Tokens whose logits are -inf until min_tokens are out: stop tokens and EOS.
        self.min_tokens_banned = min_tokens_banned
        self.parent = parent
        # Host-side constraints on its tokens (allowed tokens, bad words, a grammar, logits
        # processors: `pagedjax/constraints.py`), None for none; each sequence has its own.
        self.constraints = constraints
        self.children: list[EngineRequest] = []  # the n - 1 siblings, once forked
        # Set: each sample holds the sequence (it is not scheduled) until `held` is cleared,
        # so its last token can be changed first (beam search puts the beam's choice there).
        self.hold_samples = False
        self.held = False
        # Speculative decoding: draft tokens in the step in flight (the sequence waits for
        # their verdict), and the n-gram index its proposals come from.
        self.num_drafts_in_flight = 0
        self.ngram_index: Any = None
        self.group_id = request_id if parent is None else parent.group_id  # the user's id
        self.sample_index = sample_index
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        # Prompt tokens the prefix cache served at the first admission (vLLM's
        # num_cached_tokens); None until admitted.
        self.num_cached_tokens: int | None = None
        # Prompt positions whose logprobs are computed (the first token has none to compute);
        # the parent computes them for the whole request.
        asked = params.prompt_logprobs is not None and parent is None
        self.num_prompt_logprobs = 1 if asked else 0
        # Its LoRA adapter (`pagedjax/lora/`): the id, a key of its prefix-cache blocks, and
        # the request naming it; None for the base model.
        self.lora_id: int | None = None
        self.lora_version: int | None = None  # its weights' version, once replaced in place
        self.lora_request: Any = None
        self.lora_adapter: Any = None  # read by the front end, until the engine registers it

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def skip_prefix_cache(self) -> bool:
        """Admit without prefix-cache hits: cached prompt tokens are not computed, so their
        prompt logprobs would be missing (as in vLLM)."""
        return 0 < self.num_prompt_logprobs < self.num_prompt_tokens

    @property
    def group(self) -> list[EngineRequest]:
        """The user request's sequences: the parent, then its children."""
        root = self.parent or self
        return [root, *root.children]

    def make_child(self, index: int) -> EngineRequest:
        """Sibling `index` of this parent: its prompt, limits, cache salt and adapter, a seed
        of its own."""
        child = EngineRequest(
            f"{self.request_id}#{index}",
            self.prompt_token_ids,
            self.params,
            max_tokens=self.max_tokens,
            seed=self.seed + index,
            priority=self.priority,
            stop_token_ids=self.stop_token_ids,
            min_tokens_banned=self.min_tokens_banned,
            parent=self,
            sample_index=index,
            constraints=None if self.constraints is None else self.constraints.fork(),
        )
        child.cache_salt = self.cache_salt  # the same prefix-cache keys: it shares blocks
        child.lora_id, child.lora_request = self.lora_id, self.lora_request
        child.lora_version = self.lora_version
        return child
