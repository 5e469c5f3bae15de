"""The host tier of the KV cache: block ids of a pool in host memory (the data itself lives
with the worker, `pagedjax/worker/host_kv.py`).

Two uses share it. A preempted request can swap its blocks out here instead of dropping them,
and swap them back in on readmission with no token recomputed. And a full, hashed block that
the device pool evicts for reuse is kept here under its hash (the host prefix-cache tier, LRU):
a later prefix hit on it is copied back instead of recomputed. Swapped blocks are owned until
swapped in; cached ones are evicted, least recently used first, when space is needed. Pure
bookkeeping.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagedjax.core.hashing import BlockHash


class HostBlockPool:
    """`num_blocks` host blocks, ids 0 .. num_blocks - 1 (no null block: nothing reads
    padding from the host)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._freed: list[int] = []  # ids given back, reused first
        self._next = 0  # ids from here up were never used: a large tier costs nothing upfront
        # Blocks holding a prefix block the device evicted, least recently used first.
        self._cached: OrderedDict[BlockHash, int] = OrderedDict()
        # Cached blocks a copy in reads this step: not evictable until `unpin`.
        self._pinned: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be taken: free, or holding cached content (evicted on demand)."""
        return self.num_blocks - self._next + len(self._freed) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by swapped-out requests (or read this step)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached) + len(self._pinned)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` block ids, or None (nothing taken) if fewer can be taken; cached
        blocks are evicted, least recently used first, once no free block is left."""
        if num_blocks > self.num_free_blocks:
            return None
        reused = min(num_blocks, len(self._freed))
        ids = [self._freed.pop() for _ in range(reused)]
        fresh = min(num_blocks - reused, self.num_blocks - self._next)
        ids += range(self._next, self._next + fresh)
        self._next += fresh
        while len(ids) < num_blocks:
            ids.append(self._cached.popitem(last=False)[1])
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        self._freed.extend(block_ids)

    # ------------------------------------------------------------ prefix tier

    def cache(self, block_hash: BlockHash) -> int | None:
        """A block to receive a block the device evicted, kept under its hash; None when the
        hash is held already (it becomes the most recent) or no block can be taken."""
        if block_hash in self._cached:
            self._cached.move_to_end(block_hash)
            return None
        if block_hash in self._pinned:
            return None
        ids = self.allocate(1)
        if ids is None:
            return None
        self._cached[block_hash] = ids[0]
        return ids[0]

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def lookup(self, block_hash: BlockHash) -> int:
        """The block holding `block_hash` (see `contains`), pinned until `unpin`."""
        block_id = self._pinned[block_hash] = self._cached.pop(block_hash)
        return block_id

    def unpin(self) -> None:
        """The blocks read this step are evictable again, as the most recently used."""
        self._cached.update(self._pinned)
        self._pinned.clear()

    def clear_cache(self) -> None:
        """Forgets every cached block (the prefix cache was reset)."""
        self.unpin()
        self._freed.extend(self._cached.values())
        self._cached.clear()
