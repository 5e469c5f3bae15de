"""Block pool rules: null block, O(1) free queue, LRU eviction, lazy eviction, ref counts."""

from __future__ import annotations

import pytest

from pagedjax.core import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVCacheBlock


def _queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue]


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _cache(pool: BlockPool, blocks: list[KVCacheBlock], keys: list[int]) -> None:
    pool.cache_full_blocks(blocks, [_hash(key) for key in keys], 0, len(blocks))


def test_null_block_is_reserved_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == NULL_BLOCK_ID == 0
    assert pool.num_free_blocks == pool.num_usable_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert NULL_BLOCK_ID not in _queue_ids(pool)


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError, match="reserved"):
        BlockPool(1)


def test_free_queue_pop_append_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks[:4])
    assert [b.block_id for b in queue] == [0, 1, 2, 3] and len(queue) == 4
    queue.remove(blocks[2])  # from the middle
    assert [b.block_id for b in queue] == [0, 1, 3]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.append(blocks[4])
    queue.appendleft(blocks[5])
    assert [b.block_id for b in queue] == [5, 0, 1, 3, 4]
    assert queue.popleft() is blocks[5]
    assert [b.block_id for b in queue.popleft_n(3)] == [0, 1, 3]
    assert [b.block_id for b in queue] == [4] and len(queue) == 1
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[2])
    with pytest.raises(IndexError):
        queue.popleft_n(2)
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_block_repr_does_not_follow_links():
    queue = FreeBlockQueue([KVCacheBlock(1), KVCacheBlock(2)])
    assert repr(next(iter(queue))) == "KVCacheBlock(id=1, ref_cnt=0, hash=None)"


def test_lru_reuses_blocks_freed_longest_ago_first():
    pool = BlockPool(7)
    blocks = pool.get_new_blocks(6)
    _cache(pool, blocks, list(range(6)))
    assert [b.block_hash for b in blocks] == [_hash(i) for i in range(6)]
    # Free in an arbitrary order: that order is the eviction order.
    order = [blocks[3], blocks[0], blocks[5], blocks[1], blocks[4], blocks[2]]
    for block in order:
        pool.free_blocks([block])
    reused = pool.get_new_blocks(6)
    assert [b.block_id for b in reused] == [b.block_id for b in order]


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(5)
    a, b, c, d = pool.get_new_blocks(4)
    _cache(pool, [a, c], [1, 3])
    pool.free_blocks([a, b, c, d])  # a, c cached; b, d not
    assert pool.num_free_cached_blocks == 2
    assert {x.block_id for x in pool.get_new_blocks(2)} == {b.block_id, d.block_id}
    # The cached ones survive until nothing else is left.
    assert pool.get_cached_block(_hash(1)) is a and pool.get_cached_block(_hash(3)) is c
    assert [x.block_id for x in pool.get_new_blocks(2)] == [a.block_id, c.block_id]


def test_eviction_is_lazy_hash_kept_until_reuse():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    _cache(pool, [a], [7])
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and a.block_hash == _hash(7)
    assert pool.get_cached_block(_hash(7)) is a
    assert pool.num_cached_blocks == 1 and pool.num_free_cached_blocks == 1
    (reused,) = pool.get_new_blocks(1)  # the only free block: evicted now
    assert reused is a and a.block_hash is None and a.ref_cnt == 1
    assert pool.get_cached_block(_hash(7)) is None
    assert pool.num_cached_blocks == 0 and pool.num_free_cached_blocks == 0


def test_touch_takes_free_block_out_of_the_queue_or_adds_a_holder():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    _cache(pool, blocks, list(range(4)))
    pool.free_blocks(blocks[:3])
    assert _queue_ids(pool) == [1, 2, 3]
    pool.touch([blocks[1]])  # out of the middle, 0 -> 1
    assert blocks[1].ref_cnt == 1 and _queue_ids(pool) == [1, 3]
    assert pool.num_free_cached_blocks == 2
    pool.touch([blocks[3]])  # in use: 1 -> 2, queue untouched
    assert blocks[3].ref_cnt == 2 and _queue_ids(pool) == [1, 3]
    pool.free_blocks([blocks[3]])
    assert blocks[3].ref_cnt == 1 and _queue_ids(pool) == [1, 3]


def test_over_free_raises():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a])


def test_duplicate_key_is_not_indexed_twice():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    _cache(pool, [a, b], [1, 1])
    assert b.block_hash is None and pool.get_cached_block(_hash(1)) is a
    _cache(pool, [a], [2])  # a block has one key for life
    assert a.block_hash == _hash(1) and pool.get_cached_block(_hash(2)) is None
    assert pool.num_cached_blocks == 1


def test_reset_prefix_cache_clears_keys():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    _cache(pool, blocks, list(range(3)))
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.num_free_cached_blocks == 0
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.num_free_blocks == 3


def test_block_operations_touch_only_the_blocks_involved():
    # A large pool: popping/freeing a handful of blocks must not walk the queue.
    pool = BlockPool(200_001)
    blocks = pool.get_new_blocks(8)
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 200_000
    assert sorted(b.block_id for b in pool.get_new_blocks(8)) == list(range(1, 9))
