"""The KV budget on a GPU, from the allocator's numbers: pure functions, so tests feed fakes.

JAX's `memory_stats()["bytes_limit"]` is its allocator's limit, `XLA_CLIENT_MEM_FRACTION`
(or the older `XLA_PYTHON_CLIENT_MEM_FRACTION`; default 0.75) of the card's memory, not the
card's memory itself, and no JAX version reports the card's total directly. The card's total
is the limit over that fraction, so gpu_memory_utilization means a fraction of the card, as in
vLLM, and the allocator's limit caps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# XLA's GPU allocator takes this fraction of the card when no variable sets one.
DEFAULT_ALLOCATOR_FRACTION = 0.75
# The XLA sampler's memory with penalties, truncation and logprobs, in [rows, vocab] float32
# arrays: 8 of temporaries measured from its compiled memory analysis, the logits themselves,
# and one spare for the per-row arrays and another compiler's fusion choices.
SAMPLER_LOGITS_COPIES = 10
GIB = 2**30


def allocator_fraction(environ: Mapping[str, str]) -> float:
    """The fraction of the card JAX's GPU allocator may take, as jaxlib reads it."""
    value = environ.get("XLA_CLIENT_MEM_FRACTION") or environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    return float(value) if value else DEFAULT_ALLOCATOR_FRACTION


def fraction_to_set(environ: Mapping[str, str], utilization: float) -> str | None:
    """The `XLA_CLIENT_MEM_FRACTION` that lets JAX's GPU allocator take gpu_memory_utilization
    of the card, as vLLM's option means, rather than its default 0.75; None where the user
    set a fraction (theirs stands, and caps the budget)."""
    if environ.get("XLA_CLIENT_MEM_FRACTION") or environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
        return None
    return f"{utilization:g}"


def sampler_reserve_bytes(num_rows: int, vocab_size: int) -> int:
    """Device memory the sampler needs for a step of `num_rows` sampled rows."""
    return SAMPLER_LOGITS_COPIES * num_rows * vocab_size * 4


@dataclass(frozen=True)
class KVBudget:
    """How the KV pool's bytes were found; every field but `utilization` in bytes."""

    card: int  # the device's memory
    utilization: float  # gpu_memory_utilization: the engine's share of the card
    allocator_limit: int  # what JAX's allocator hands out at most
    in_use: int  # allocated before the pool: the weights
    activation_peak: int  # the forward's temporaries at the largest step
    sampler_reserve: int

    @property
    def usable(self) -> int:
        return int(min(self.utilization * self.card, self.allocator_limit))

    @property
    def kv_bytes(self) -> int:
        others = self.in_use + self.activation_peak + self.sampler_reserve
        return max(self.usable - others, 0)

    def describe(self) -> str:
        """The split in one log line."""
        cap = ""
        if self.allocator_limit < self.utilization * self.card:
            cap = (
                f", capped by the allocator's limit {self.allocator_limit / GIB:.2f} GiB "
                "(raise XLA_CLIENT_MEM_FRACTION to use more)"
            )
        return (
            f"KV budget {self.kv_bytes / GIB:.2f} GiB = {100 * self.utilization:.0f}% of the "
            f"card's {self.card / GIB:.2f} GiB{cap} - {self.in_use / GIB:.2f} GiB in use "
            f"(weights) - {self.activation_peak / GIB:.2f} GiB activation peak - "
            f"{self.sampler_reserve / GIB:.2f} GiB sampler reserve"
        )


def gpu_kv_budget(
    stats: Mapping[str, int],
    utilization: float,
    fraction: float,
    activation_peak: int,
    sampler_reserve: int,
) -> KVBudget:
    """The budget from a device's `memory_stats()` and the allocator's fraction of the card."""
    limit = int(stats["bytes_limit"])
    return KVBudget(
        card=round(limit / fraction),
        utilization=utilization,
        allocator_limit=limit,
        in_use=int(stats.get("bytes_in_use", 0)),
        activation_peak=activation_peak,
        sampler_reserve=sampler_reserve,
    )
