"""The KV cache manager of a model whose layers attend differently (vLLM's hybrid allocator).

Each KV cache group (`kernels_pallas/kv_groups.py`) is a `KVCacheManager` of its own: its
own block table per request, its own window, its prefix-cache keys salted apart. They share
one `BlockPool`, so blocks a sliding group gives back serve any group. This class fans the
scheduler's calls out to the groups and keeps them in step: an allocation takes blocks in
every group or in none, and a prefix hit is the longest prefix every group holds (the full
groups all of it, the sliding groups only its last window).

The host tier is not used (a sliding group's table holds null entries where its blocks were
given back, which a swap could not restore): preemption recomputes, as in vLLM V1.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedjax.core.block_pool import BlockPool, KVCacheBlock
from pagedjax.core.hashing import BlockHash
from pagedjax.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedjax.core.memory import KVCacheSpec, MemoryLedger
from pagedjax.core.request import KVCacheRequest

GroupHits = list[list[KVCacheBlock]]  # a prefix hit: each group's blocks, all of one length


class HybridKVCacheManager:
    """`KVCacheManager`'s interface over several KV cache groups sharing one pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: Sequence[int],
        *,
        enable_caching: bool = True,
        kv_spec: KVCacheSpec | None = None,
    ) -> None:
        """windows: each group's sliding window (0: full attention); group 0's keys are the
        plain ones."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_spec = kv_spec
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.windows = tuple(windows)
        self.groups = [
            KVCacheManager(
                num_blocks,
                block_size,
                enable_caching=enable_caching,
                kv_spec=kv_spec,
                sliding_window=window,
                block_pool=self.block_pool,
                hash_salt=b"" if index == 0 else f"kv-group-{index}".encode(),
            )
            for index, window in enumerate(self.windows)
        ]
        self.prefix_cache_stats: PrefixCacheStats = self.groups[0].prefix_cache_stats

    # ----------------------------------------------------------------- admission

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[GroupHits, int]:
        """The longest prefix every group holds: (each group's hit blocks, tokens)."""
        hits = [group.get_computed_blocks(request)[0] for group in self.groups]
        num_blocks = min(len(group_hits) for group_hits in hits)
        # A sliding group's hit is not a prefix of its longer hit: look again at the
        # shorter length until every group holds it (the length only shrinks).
        while any(len(group_hits) != num_blocks for group_hits in hits):
            hits = [group.cache_hit(request, num_blocks) for group in self.groups]
            num_blocks = min(len(group_hits) for group_hits in hits)
        return (hits if num_blocks else []), num_blocks * self.block_size

    def host_prefix_hits(self, request: KVCacheRequest, num_hit_blocks: int) -> int:
        return 0  # no host tier

    def num_cached_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """Group 0's cached run under these (plain) keys: what a data-parallel router asks."""
        return self.groups[0].num_cached_prefix_blocks(block_hashes)

    # ---------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: GroupHits | None = None,
        num_new_computed_tokens: int = 0,
        num_host_hit_blocks: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """`KVCacheManager.allocate_slots` in every group, or None, changing nothing, when
        the free pool cannot cover them all."""
        hits = new_computed_blocks or [None] * len(self.groups)
        needed = sum(
            group.blocks_needed(
                request, num_new_tokens, group_hits, num_new_computed_tokens, num_lookahead_tokens
            )
            for group, group_hits in zip(self.groups, hits, strict=True)
        )
        if needed > self.block_pool.num_free_blocks:
            return None
        # Every group's hits are held first: a group's new blocks must not evict another's.
        held = [block for group_hits in new_computed_blocks or () for block in group_hits]
        self.block_pool.touch(held)
        new_blocks: list[KVCacheBlock] = []
        for group, group_hits in zip(self.groups, hits, strict=True):
            allocated = group.allocate_slots(
                request,
                num_new_tokens,
                group_hits,
                num_new_computed_tokens,
                num_lookahead_tokens=num_lookahead_tokens,
            )
            if allocated is None:  # blocks_needed counted them: a bug, not a full pool
                raise RuntimeError(f"group allocation failed after {needed} blocks were free")
            new_blocks += allocated
        self.block_pool.free_blocks(held)  # each group holds its own now
        return new_blocks

    def free_tail(self, request: KVCacheRequest) -> None:
        for group in self.groups:
            group.free_tail(request)

    def fork(self, parent: KVCacheRequest, child: KVCacheRequest) -> None:
        for group in self.groups:
            group.fork(parent, child)

    def free(self, request: KVCacheRequest) -> None:
        for group in self.groups:
            group.free(request)

    # --------------------------------------------------------- no host tier

    def can_swap_out(self, request: KVCacheRequest) -> bool:
        return False

    def is_swapped(self, request_id: Hashable) -> bool:
        return False

    def pop_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return [], []

    # ----------------------------------------------------------------- queries

    def has_request(self, request_id: Hashable) -> bool:
        return self.groups[0].has_request(request_id)

    def table_update(
        self, request: KVCacheRequest
    ) -> tuple[int, Sequence[int], tuple[tuple[int, Sequence[int]], ...]]:
        """Group 0's (start, block ids), then the other groups' (`ScheduledSequence`)."""
        first, *others = (group.table_update(request) for group in self.groups)
        return (*first, tuple(others))

    def get_block_ids(self, request: KVCacheRequest) -> list[list[int]]:
        """Each group's block table."""
        return [group.get_block_ids(request) for group in self.groups]

    def pop_freed(self) -> list[Hashable]:
        freed = self.groups[0].pop_freed()
        for group in self.groups[1:]:
            group.pop_freed()  # the same requests
        return freed

    def pop_block_copies(self) -> list[tuple[int, int]]:
        """Every group's copies: their blocks differ, and a copy moves a block's every slab."""
        return [copy for group in self.groups for copy in group.pop_block_copies()]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.groups[0].usage

    def memory_ledger(self) -> MemoryLedger:
        return self.groups[0].memory_ledger()

    def reset_prefix_cache(self) -> None:
        for group in self.groups:
            group.reset_prefix_cache()
