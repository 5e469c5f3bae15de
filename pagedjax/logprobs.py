"""A token's log probability, as vLLM's `vllm.logprobs.Logprob`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str | None = None
