"""The small view of a request that the KV cache manager reads.

The manager never owns requests; it reads four attributes (`KVCacheRequest`) and keeps its
own per-request block state keyed by `request_id`. `Request` is a minimal concrete class
that satisfies the protocol, for tests, benchmarks and standalone use; the scheduler's
fuller request type can subclass it or simply carry the same attributes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Protocol


class KVCacheRequest(Protocol):
    """What the manager reads from a request.

    - `all_token_ids` is append-only: prompt tokens, then sampled tokens as they arrive.
    - `num_computed_tokens` counts tokens whose KV is already in the request's blocks. The
      caller (the scheduler) owns it: advance it after each executed step, set it to 0 when
      the request is preempted and freed.
    - Optional attributes named in `hashing.EXTRA_KEY_FIELDS` (`cache_salt`, later
      `lora_id`) enter the prefix-cache keys when not None.
    """

    request_id: Hashable
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int


@dataclass(eq=False)
class Request:
    """Minimal request: token ids, computed-token count and a cache salt."""

    request_id: Hashable
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    all_token_ids: list[int] = field(init=False, repr=False)
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def append_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Record sampled token(s); their KV is computed by a later step."""
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
