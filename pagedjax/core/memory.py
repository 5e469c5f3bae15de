"""KV memory accounting: bytes per block for a model shape, and the pool's ledger."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype given as a name, a numpy/jax dtype, or an int."""
    if isinstance(dtype, int):
        return dtype
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    try:
        return _ITEMSIZE[name]
    except KeyError:
        raise ValueError(
            f"unknown KV dtype {dtype!r}; pass one of {sorted(_ITEMSIZE)} or a byte count"
        ) from None


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV cache of one model: K and V per layer per kv head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = "bfloat16"

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_itemsize(self.dtype)

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        """Physical blocks (null block included) that fit in `budget_bytes` of KV memory."""
        return budget_bytes // self.bytes_per_block(block_size)


@dataclass(frozen=True)
class MemoryLedger:
    """A snapshot of where the KV blocks are. The null block is not counted anywhere.

    `free_blocks` includes `cached_free_blocks` (free but still holding reusable prefix
    content); `cached_blocks` counts every block holding a cache key, in use or free.
    """

    block_size: int
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    cached_free_blocks: int
    bytes_per_block: int | None = None
    # The host tier (swapping, evicted prefix blocks): blocks owned by swapped-out requests,
    # and blocks holding prefix content (evictable), of host_total_blocks.
    host_total_blocks: int = 0
    host_used_blocks: int = 0
    host_cached_blocks: int = 0

    @property
    def token_capacity(self) -> int:
        return self.total_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks

    @property
    def total_bytes(self) -> int | None:
        return None if self.bytes_per_block is None else self.total_blocks * self.bytes_per_block

    @property
    def used_bytes(self) -> int | None:
        return None if self.bytes_per_block is None else self.used_blocks * self.bytes_per_block

    def __str__(self) -> str:
        text = (
            f"KV blocks: {self.used_blocks} used, {self.free_blocks} free "
            f"({self.cached_free_blocks} still cached), {self.total_blocks} total; "
            f"{self.cached_blocks} cached; {self.token_capacity} token slots, "
            f"usage {self.usage:.1%}"
        )
        if self.bytes_per_block is not None:
            text += f", {self.bytes_per_block} B/block, {self.total_bytes / 2**30:.2f} GiB"
        if self.host_total_blocks:
            text += (
                f"; host tier: {self.host_used_blocks} swapped, {self.host_cached_blocks} "
                f"cached, {self.host_total_blocks} total"
            )
        return text


def blocks_held(
    num_tokens: int, block_size: int, windows: tuple[int, ...] = (0,), max_step_tokens: int = 0
) -> int:
    """The most blocks a request of `num_tokens` tokens holds at once over KV cache groups
    with these sliding windows (0: full attention), allocating at most `max_step_tokens` a
    step: a sliding group holds its window's blocks, a step's past it, and partial ones at
    both ends."""
    blocks = -(-num_tokens // block_size)
    return sum(
        min(blocks, (window + max_step_tokens) // block_size + 2) if window else blocks
        for window in windows
    )
