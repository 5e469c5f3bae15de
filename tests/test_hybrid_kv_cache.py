"""KV cache groups: the layout of layers into groups and slabs, a sliding window's manager
giving back the blocks its window passed (and hitting the prefix cache with only its last
window), and the hybrid manager keeping its groups in step over one pool."""

from __future__ import annotations

import pytest

from kernels_pallas.kv_groups import kv_cache_groups
from pagedjax.core import KVCacheManager, Request
from pagedjax.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedjax.core.memory import blocks_held

BS = 4


def _step(manager, request: Request, num_new: int | None = None):
    """Admit (if new) and schedule `num_new` tokens (default: all uncomputed), then 'run'."""
    hits, num_hits = [], 0
    if not manager.has_request(request.request_id):
        hits, num_hits = manager.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - request.num_computed_tokens - num_hits
    new = manager.allocate_slots(request, num_new, hits or None, num_hits)
    if new is not None:
        request.num_computed_tokens += num_hits + num_new
    return new


def _decode(manager, request: Request, num_tokens: int) -> None:
    for token in range(num_tokens):
        request.append_token_ids(1000 + token)
        assert _step(manager, request, 1) is not None


def test_groups_of_gemma3_gemma2_and_uniform_models():
    # Gemma 3's 5 sliding layers to 1 global, 18 layers: 3 slabs, 1 full group, 5 sliding.
    windows = ([512] * 5 + [0]) * 3
    groups = kv_cache_groups(windows, 18)
    assert groups.num_slabs == 3 and groups.windows == (0,) + (512,) * 5
    assert [groups.layer_groups[layer] for layer in (5, 11, 17)] == [0, 0, 0]
    places = set(zip(groups.layer_groups, groups.layer_slabs, strict=True))
    assert len(places) == 18  # each layer its own slab of its group's blocks
    assert all(windows[layer] == groups.windows[groups.layer_groups[layer]] for layer in range(18))
    # Gemma 2 alternates: two groups of half the layers.
    gemma2 = kv_cache_groups([4096, 0] * 4, 8)
    assert gemma2.windows == (0, 4096) and gemma2.num_slabs == 4
    # All alike: one table, which frees when the layers slide; hybrid=False frees nothing.
    assert kv_cache_groups([7] * 4, 4).windows == (7,)
    assert kv_cache_groups((), 4).windows == (0,) and not kv_cache_groups((), 4).frees_blocks
    assert kv_cache_groups(windows, 18, hybrid=False).windows == (0,)
    assert kv_cache_groups(windows, 18, hybrid=False).num_slabs == 18
    # An uneven split pads the last sliding group: 26 layers, 4 global, 22 sliding.
    gemma3_1b = kv_cache_groups(([512] * 5 + [0]) * 4 + [512] * 2, 26)
    assert gemma3_1b.num_slabs == 4 and len(gemma3_1b.windows) == 1 + 6


def test_sliding_window_gives_back_passed_blocks_and_resends_the_table():
    manager = KVCacheManager(64, BS, sliding_window=6)
    request = Request("a", list(range(10)))
    _step(manager, request)
    start, ids = manager.table_update(request)
    assert (start, len(ids)) == (0, 3)
    _decode(manager, request, 30)  # 40 tokens: 10 blocks long
    table = manager.get_block_ids(request)
    assert len(table) == 10
    # Queries from position 40 on see keys from 35: blocks 8 and 9 (and no earlier one).
    held = [block for block in table if block]
    assert len(held) <= -(-6 // BS) + 1 and table[-1] and not table[0]
    assert manager.block_pool.num_used_blocks == len(held)
    # The runner's copy of the table is brought up to date, null entries included.
    start, ids = manager.table_update(request)
    assert list(ids) == table[start:] and start < 10
    manager.free(request)
    assert manager.block_pool.num_used_blocks == 0


def test_sliding_window_hit_needs_only_the_last_window_and_skips_the_rest():
    manager = KVCacheManager(64, BS, sliding_window=6)
    pool = manager.block_pool
    prompt = list(range(30))
    first = Request("a", prompt)
    _step(manager, first)
    first_ids = manager.get_block_ids(first)
    manager.free(first)
    # Evict the chain's first two blocks: a full-attention hit would end at once, the
    # window's hit does not need them.
    for block_id in first_ids[:2]:
        block = pool.blocks[block_id]
        del pool.cached_blocks[block.block_hash]
        block.block_hash = None
    second = Request("b", prompt)
    hits, num_hits = manager.get_computed_blocks(second)
    assert num_hits == 28  # 7 blocks: the last token is always computed
    num_skipped = (28 - 6 + 1) // BS  # queries from 28 on see keys from 23: block 5 on
    assert [block.is_null for block in hits] == [True] * num_skipped + [False] * 2
    assert [block.block_id for block in hits[num_skipped:]] == first_ids[5:7]
    (new,) = manager.allocate_slots(second, 2, hits, num_hits)  # the partial last block
    assert manager.get_block_ids(second) == [0] * num_skipped + first_ids[5:7] + [new.block_id]
    manager.free(second)
    assert pool.num_used_blocks == 0
    # Without a window a miss at the start ends the hit.
    full = KVCacheManager(64, BS)
    _step(full, Request("a", prompt))
    full.free(Request("a", prompt))
    third = Request("c", [99] + prompt[1:])
    assert full.get_computed_blocks(third)[1] == 0


def test_hybrid_allocates_in_every_group_or_none():
    manager = HybridKVCacheManager(13, BS, (0, 6, 6))
    a = Request("a", list(range(16)))
    assert _step(manager, a) is not None  # 4 blocks in each of 3 groups: the whole pool
    assert manager.num_free_blocks == 0
    b = Request("b", list(range(100, 104)))
    assert _step(manager, b) is None  # a block in each group, none free: nothing taken
    assert not any(group.get_blocks(b) for group in manager.groups)
    assert manager.block_pool.num_used_blocks == 12
    manager.free(a)
    assert _step(manager, b) is not None
    assert manager.block_pool.num_used_blocks == 3


def test_hybrid_long_request_holds_its_window_in_sliding_groups_and_shares_prefixes():
    manager = HybridKVCacheManager(200, BS, (0, 6, 6))
    a = Request("a", list(range(20)))
    _step(manager, a)
    _decode(manager, a, 44)  # 64 tokens: 16 blocks in the full group
    full, *sliding = manager.get_block_ids(a)
    assert all(full) and len(full) == 16
    for table in sliding:
        assert len(table) == 16 and sum(1 for block in table if block) <= 3
    used = manager.block_pool.num_used_blocks
    assert used <= 16 + 2 * 3 < 3 * 16  # vs one table over every layer
    assert used <= blocks_held(64, BS, (0, 6, 6), 1)
    # A second request with the same prompt hits in every group at one length; its
    # sliding tables start with null entries.
    b = Request("b", list(range(20)))
    hits, num_hits = manager.get_computed_blocks(b)
    assert num_hits == 16 and all(len(group_hits) == 4 for group_hits in hits)
    assert manager.allocate_slots(b, 4, hits, num_hits) is not None
    b.num_computed_tokens = 20
    assert manager.prefix_cache_stats.hits == 16
    # Forks share every group's blocks; freeing all gives every block back.
    child = Request("b#1", b.prompt_token_ids)
    child.num_computed_tokens = b.num_computed_tokens
    manager.fork(b, child)
    assert manager.get_block_ids(child) == manager.get_block_ids(b)
    for request in (a, b, child):
        manager.free(request)
    assert manager.block_pool.num_used_blocks == 0
    assert manager.pop_freed() == ["a", "b", "b#1"]


def test_sliding_window_refuses_a_host_tier():
    with pytest.raises(ValueError, match="no host tier"):
        KVCacheManager(16, BS, sliding_window=8, num_host_blocks=4)
