"""Physical KV blocks, their ref counts, the LRU free queue and the prefix-cache index.

Every operation here is O(blocks touched): popping, freeing, touching and caching a block
never scans the pool, so the per-step cost does not grow with the pool size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from pagedjax.core.hashing import BlockHash

NULL_BLOCK_ID = 0
"""Block 0 is never handed out; padded block-table entries may point at it."""


@dataclass(slots=True, eq=False, repr=False)
class KVCacheBlock:
    """One physical block of `block_size` token slots (its KV lives on device)."""

    block_id: int
    ref_cnt: int = 0
    # Key of the block's content while it is in the prefix cache. Kept after the block is
    # freed (lazy eviction) and cleared only when the block is handed out again.
    block_hash: BlockHash | None = None
    # Links of the free queue; both None iff the block is not in it.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:  # the links would make the dataclass repr recurse
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) pop, append and middle removal.

    The front is the next block to reuse. Sentinel head and tail nodes remove all edge cases
    from the link updates.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("pop from an empty free block queue")
        self.remove(block)
        return block

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the front, relinking the list once."""
        if num_blocks > self.num_free_blocks:
            raise IndexError(f"pop of {num_blocks} blocks from a queue of {self.num_free_blocks}")
        popped = []
        block = self._head.next_free
        for _ in range(num_blocks):
            popped.append(block)
            next_block = block.next_free
            block.prev_free = block.next_free = None
            block = next_block
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= num_blocks
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the back: it is reused after every block already queued."""
        last = self._tail.prev_free
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the front: it is the next one reused."""
        first = self._head.next_free
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self._head.next_free = block
        self.num_free_blocks += 1


class BlockPool:
    """Owns all blocks: hands out free ones, takes freed ones back, indexes cached ones.

    Free blocks are reused in this order: blocks that hold no cached content first, then
    cached blocks least recently freed first (LRU). A cached block stays findable by its key
    until it is actually reused.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self._num_free_cached = 0  # free blocks that still hold a key (evictable cache)
        # (block id, key) of each cached block evicted for reuse, when a host tier keeps
        # them (the KV cache manager drains it); None: not recorded.
        self.evicted: list[tuple[int, BlockHash]] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a prefix-cache key, in use or free."""
        return len(self.cached_blocks)

    @property
    def num_free_cached_blocks(self) -> int:
        """Free blocks whose cached content is still reusable until they are evicted."""
        return self._num_free_cached

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front of the free queue (ref count 0 -> 1)."""
        try:
            new_blocks = self.free_block_queue.popleft_n(num_blocks)
        except IndexError:
            raise ValueError(
                f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free; "
                "check num_free_blocks first (allocate_slots does)"
            ) from None
        cached_blocks = self.cached_blocks
        for block in new_blocks:
            block_hash = block.block_hash
            if block_hash is not None:  # lazy eviction happens here, on reuse
                del cached_blocks[block_hash]
                block.block_hash = None
                self._num_free_cached -= 1
                if self.evicted is not None:
                    self.evicted.append((block.block_id, block_hash))
            block.ref_cnt = 1
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a holder to each block; a free (cached) block leaves the free queue. The null
        block (a sliding window's skipped entries) is nobody's: it is passed over."""
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self._num_free_cached -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a holder from each block; blocks reaching 0 join the free queue in order.

        Cached blocks go to the back (evicted last, oldest first). Blocks without cached
        content go to the front: reusing them first keeps cached content alive longer. The
        null block is passed over.
        """
        queue = self.free_block_queue
        head, tail = queue._head, queue._tail
        num_freed = num_freed_cached = 0
        try:
            for block in ordered_blocks:
                if block.block_id == NULL_BLOCK_ID:
                    continue
                ref_cnt = block.ref_cnt - 1
                block.ref_cnt = ref_cnt
                if ref_cnt == 0:
                    num_freed += 1
                    if block.block_hash is not None:  # `queue.append(block)`, inlined
                        last = tail.prev_free
                        block.prev_free = last
                        block.next_free = tail
                        last.next_free = block
                        tail.prev_free = block
                        num_freed_cached += 1
                    else:  # `queue.appendleft(block)`, inlined
                        first = head.next_free
                        block.prev_free = head
                        block.next_free = first
                        first.prev_free = block
                        head.next_free = block
                elif ref_cnt < 0:
                    raise ValueError(f"{block} freed more often than it was allocated")
        finally:  # keep the counts true to the links even if a bad free raised midway
            queue.num_free_blocks += num_freed
            self._num_free_cached += num_freed_cached

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
    ) -> None:
        """Index the full, in-use blocks[start:end] under block_hashes[start:end].

        A block keeps its first key for life. A block whose key another block already holds
        stays un-indexed (its content is still valid for its holders) and, once freed, is
        among the first blocks reused.
        """
        cached_blocks = self.cached_blocks
        for index in range(start, end):
            block = blocks[index]
            if block.block_hash is None:
                block_hash = block_hashes[index]
                if block_hash not in cached_blocks:
                    block.block_hash = block_hash
                    cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached key. Only valid when no block is in use (the caller checks)."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self._num_free_cached = 0
