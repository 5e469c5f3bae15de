"""Swap or recompute: the preemption policy's cost model (the engine option
`preemption_mode`).

A victim with n computed tokens either swaps (its KV copied to the host tier and back:
2 n bytes_per_token over the host link) or recomputes (a prefill of n tokens: the layers'
matmuls, linear in n, and attention, quadratic in n). "auto" swaps when that is the cheaper
of the two on this platform's speeds; long contexts tip towards swapping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(frozen=True)
class SwapCostModel:
    bytes_per_token: int  # KV bytes of one token, all layers
    matmul_flops_per_token: float  # 2 x the decoder layers' matmul parameters
    attention_flops_per_token_pair: float  # 4 x layers x q width (QK and PV) per key
    transfer_bytes_per_s: float  # device <-> host
    flops_per_s: float  # the device's prefill throughput

    def swap_seconds(self, num_tokens: int) -> float:
        return 2 * num_tokens * self.bytes_per_token / self.transfer_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        pairs = num_tokens * (num_tokens + 1) / 2  # causal: token i attends to i + 1 keys
        matmuls = num_tokens * self.matmul_flops_per_token
        return (matmuls + pairs * self.attention_flops_per_token_pair) / self.flops_per_s

    def prefer_swap(self, num_tokens: int) -> bool:
        return self.swap_seconds(num_tokens) < self.recompute_seconds(num_tokens)


def preemption_policy(mode: str, cost: SwapCostModel) -> Callable[[int], bool] | None:
    """The scheduler's `prefer_swap` for a preemption mode: None (never swap), always, or
    by the cost model."""
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
    if mode == "recompute":
        return None
    if mode == "swap":
        return lambda num_tokens: True
    return cost.prefer_swap
