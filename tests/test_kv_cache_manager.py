"""KV cache manager rules: prefix hits, hit capping, tail-first frees, all-or-nothing
allocation, copy-on-write forks, hashing, the memory ledger and error messages."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedjax.core import (
    DuplicateRequestError,
    InvalidAllocationError,
    KVCacheManager,
    KVCacheSpec,
    PrefixCacheInUseError,
    Request,
    UnknownRequestError,
    hash_block_tokens,
    hash_request_tokens,
)
from pagedjax.core.hashing import (
    encode_extra_keys,
    extend_block_hashes,
    request_extra_keys,
)

BS = 4


def _run(manager: KVCacheManager, request: Request, num_new: int | None = None) -> list | None:
    """Admit (if new) and schedule `num_new` tokens (default: all uncomputed), then 'execute'."""
    hits, num_hits = [], 0
    if not manager.has_request(request.request_id) or not manager.get_blocks(request):
        hits, num_hits = manager.get_computed_blocks(request)
    request.num_computed_tokens += num_hits
    if num_new is None:
        num_new = request.num_tokens - request.num_computed_tokens
    request.num_computed_tokens -= num_hits
    new = manager.allocate_slots(request, num_new, hits or None, num_hits)
    if new is not None:
        request.num_computed_tokens += num_hits + num_new
    return new


def fork_request(parent: Request, child_id) -> Request:
    """A child sharing the parent's computed tokens, as n > 1 sampling forks one: it holds the
    computed tokens (at least the whole prompt) and the same computed count; append its own
    sampled token, then call `KVCacheManager.fork(parent, child)`."""
    child = Request(child_id, parent.prompt_token_ids, cache_salt=parent.cache_salt)
    child.all_token_ids = parent.all_token_ids[
        : max(parent.num_computed_tokens, parent.num_prompt_tokens)
    ]
    child.num_computed_tokens = parent.num_computed_tokens
    return child


def _snapshot(manager: KVCacheManager):
    pool = manager.block_pool
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue],
        {h: b.block_id for h, b in pool.cached_blocks.items()},
        {rid: (list(s.block_ids), s.num_cached_blocks) for rid, s in manager._requests.items()},
        list(manager._pending_copies),
    )


# ------------------------------------------------------------------------- hashing


def test_block_hash_is_stable_across_processes():
    code = (
        "from pagedjax.core import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3, 4], b'x').hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == hash_block_tokens(None, [1, 2, 3, 4], b"x").hex()
    assert len(bytes.fromhex(out)) == 32


def test_block_hash_chains_parent_tokens_and_extra_keys():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], b"salt") != first
    assert hash_block_tokens(None, [1, 2, 3, 5]) != first
    assert hash_block_tokens(None, [2**40, -1]) != hash_block_tokens(None, [0, -1])


def test_incremental_hashing_matches_full_hashing():
    tokens = list(range(23))
    full = hash_request_tokens(tokens, BS, b"k")
    assert len(full) == 5
    assert full[1] == hash_block_tokens(full[0], tokens[4:8], b"k")
    grown: list[bytes] = []
    for end in range(len(tokens) + 1):
        extend_block_hashes(grown, tokens[:end], BS, b"k")
        assert grown == full[: end // BS]


def test_extend_block_hashes_matches_hash_block_tokens():
    for block_size in (1, 4, 16):
        tokens = [7, 2**40, -1, 0] * 8
        for extra in (b"", b"salt"):
            parent = None
            for start in range(0, len(tokens) - block_size + 1, block_size):
                parent = hash_block_tokens(parent, tokens[start : start + block_size], extra)
            assert hash_request_tokens(tokens, block_size, extra)[-1] == parent


def test_extra_keys_encoding_is_injective_on_examples():
    encodings = {
        encode_extra_keys(keys)
        for keys in [
            (),
            (None,),
            (0,),
            (False,),
            ("0",),
            (b"0",),
            ((0,),),
            (0, 0),
            ("ab",),
            ("a", "b"),
        ]
    }
    assert len(encodings) == 10
    with pytest.raises(TypeError, match="stable encoding"):
        encode_extra_keys([1.5])
    assert request_extra_keys(Request("r", [1])) == b""
    assert request_extra_keys(Request("r", [1], cache_salt="s")) != b""


# -------------------------------------------------------------------- prefix hits


def test_prefix_hit_returns_longest_cached_run_and_stops_at_first_miss():
    manager = KVCacheManager(32, BS)
    first = Request("a", list(range(13)))  # 3 full blocks + 1 token
    assert manager.get_computed_blocks(first) == ([], 0)
    _run(manager, first)
    cached_ids = manager.get_block_ids(first)[:3]

    same_prefix = Request("b", list(range(8)) + [99] * 6)  # matches blocks 0, 1 only
    hits, num_hits = manager.get_computed_blocks(same_prefix)
    assert [b.block_id for b in hits] == cached_ids[:2] and num_hits == 8

    hole = Request("c", [99] * 4 + list(range(4, 13)))  # block 0 misses: nothing after counts
    assert manager.get_computed_blocks(hole) == ([], 0)


def test_hit_never_covers_the_last_prompt_token():
    manager = KVCacheManager(32, BS)
    _run(manager, Request("a", list(range(12))))  # exactly 3 full blocks, all cached
    exact = Request("b", list(range(12)))
    hits, num_hits = manager.get_computed_blocks(exact)
    assert len(hits) == 2 and num_hits == 8  # (12 - 1) // 4 blocks
    longer = Request("c", list(range(13)))
    assert manager.get_computed_blocks(longer)[1] == 12
    one_token = Request("d", [0])
    assert manager.get_computed_blocks(one_token) == ([], 0)


def test_hit_on_free_block_leaves_queue_and_hit_on_used_block_adds_holder():
    manager = KVCacheManager(32, BS)
    a = Request("a", list(range(9)))
    _run(manager, a)
    block0, block1 = manager.get_blocks(a)[:2]
    b = Request("b", list(range(9)))
    _run(manager, b)  # hits blocks in use
    assert block0.ref_cnt == 2 and block1.ref_cnt == 2
    manager.free(a)
    manager.free(b)
    assert block0.ref_cnt == 0 and block0.prev_free is not None  # free but still cached
    free_before = manager.num_free_blocks
    c = Request("c", list(range(9)))
    hits, num_hits = manager.get_computed_blocks(c)
    assert hits == [block0, block1] and block0.ref_cnt == 0  # lookup takes no reference
    assert manager.allocate_slots(c, 1, hits, num_hits) is not None
    assert block0.ref_cnt == 1 and block0.prev_free is None and block0.next_free is None
    assert manager.num_free_blocks == free_before - 3  # two hits left the queue, one new
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 27, 16)
    assert stats.hit_rate == pytest.approx(16 / 27)


def test_free_is_tail_first_so_a_chains_suffix_is_evicted_before_its_prefix():
    manager = KVCacheManager(5, BS)  # 4 usable blocks
    a = Request("a", list(range(16)))
    _run(manager, a, 16)  # 4 full blocks, all cached
    ids = manager.get_block_ids(a)
    manager.free(a)
    assert [b.block_id for b in manager.block_pool.free_block_queue] == ids[::-1]
    # Needing one block evicts the chain's last block; the prefix stays a hit.
    b = Request("b", [50, 51])
    _run(manager, b)
    assert manager.get_block_ids(b) == [ids[3]]
    hits, num_hits = manager.get_computed_blocks(Request("c", list(range(16))))
    assert [h.block_id for h in hits] == ids[:3] and num_hits == 12


def test_blocks_are_cached_once_fully_scheduled_including_generated_tokens():
    manager = KVCacheManager(32, BS)
    a = Request("a", list(range(6)))
    _run(manager, a, 3)  # chunked prefill: block 0 not full yet
    assert manager.block_pool.num_cached_blocks == 0
    _run(manager, a, 3)  # block 0 full
    assert manager.block_pool.num_cached_blocks == 1
    for token in (6, 7):  # decode fills block 1 with a generated token
        a.append_token_ids(token)
        _run(manager, a, 1)
    assert manager.block_pool.num_cached_blocks == 2
    hits, num_hits = manager.get_computed_blocks(Request("b", list(range(9))))
    assert num_hits == 8 and hits == manager.get_blocks(a)[:2]


def test_cache_salt_separates_otherwise_equal_prompts():
    manager = KVCacheManager(32, BS)
    _run(manager, Request("a", list(range(9)), cache_salt="alice"))
    assert manager.get_computed_blocks(Request("b", list(range(9)), cache_salt="bob"))[1] == 0
    assert manager.get_computed_blocks(Request("c", list(range(9))))[1] == 0
    assert manager.get_computed_blocks(Request("d", list(range(9)), cache_salt="alice"))[1] == 8


def test_caching_can_be_disabled():
    manager = KVCacheManager(32, BS, enable_caching=False)
    _run(manager, Request("a", list(range(9))))
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(Request("b", list(range(9)))) == ([], 0)


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    manager = KVCacheManager(32, BS)
    a = Request("a", list(range(9)))
    _run(manager, a)
    with pytest.raises(PrefixCacheInUseError, match="free all requests first"):
        manager.reset_prefix_cache()
    assert manager.block_pool.num_cached_blocks == 2
    manager.free(a)
    manager.reset_prefix_cache()
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(Request("b", list(range(9)))) == ([], 0)


# --------------------------------------------------------------------- allocation


def test_allocate_returns_none_without_side_effects():
    manager = KVCacheManager(6, BS)  # 5 usable
    a = Request("a", list(range(12)))
    _run(manager, a)  # 3 blocks, all cached
    b = Request("b", list(range(8)) + [70, 71, 72, 73, 74, 75, 76])  # hits 2 blocks, needs 2 more
    hits, num_hits = manager.get_computed_blocks(b)
    assert num_hits == 8
    manager.free(a)  # a's blocks are free, b's hits among them
    c = Request("c", [90] * 7)
    _run(manager, c)  # 2 blocks taken: free = 3, 2 of which are b's hits
    before = _snapshot(manager)
    # b needs 2 new blocks; 3 are free, but touching its 2 hits leaves only 1.
    assert manager.allocate_slots(b, 7, hits, num_hits) is None
    assert _snapshot(manager) == before
    assert all(h.ref_cnt == 0 for h in hits)
    # A running request that cannot grow: also None, also no change.
    c.append_token_ids([91] * 20)
    assert manager.allocate_slots(c, 20) is None
    assert _snapshot(manager) == before


@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize("enable_caching", [True, False])
def test_one_token_decode_path_matches_the_general_path(block_size, enable_caching):
    """`allocate_slots(req, 1)` returns at once while the token fits in a private, unfilled
    block; passing an empty hit list forces the general path. Both must leave identical state
    and return equal results, also around forks (copy-on-write), full pools and frees."""

    rng = random.Random(block_size)
    managers = [KVCacheManager(24, block_size, enable_caching=enable_caching) for _ in range(2)]
    requests: list[dict] = [{}, {}]  # per manager: request id -> Request
    next_id = 0

    def state(manager):
        fast_path_ends = {rid: s.fast_path_end for rid, s in manager._requests.items()}
        return _snapshot(manager), fast_path_ends, manager.pop_block_copies()

    for _ in range(600):
        action = rng.random()
        live = sorted(requests[0])
        if action < 0.1 or not live:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 3 * block_size + 2))]
            salt = rng.choice([None, None, "s"])
            for manager, reqs in zip(managers, requests, strict=True):
                request = Request(next_id, prompt, cache_salt=salt)
                hits, num_hits = manager.get_computed_blocks(request)
                new = manager.allocate_slots(request, len(prompt) - num_hits, hits, num_hits)
                if new is None:
                    manager.free(request)
                else:
                    request.num_computed_tokens = len(prompt)
                    request.append_token_ids(1)
                    reqs[next_id] = request
            next_id += 1
        elif action < 0.15:
            rid = rng.choice(live)
            for manager, reqs in zip(managers, requests, strict=True):
                manager.free(reqs.pop(rid))
        elif action < 0.2:
            rid = rng.choice(live)
            for manager, reqs in zip(managers, requests, strict=True):
                parent = reqs[rid]
                child = fork_request(parent, next_id)
                child.append_token_ids(2)
                manager.fork(parent, child)
                reqs[next_id] = child
            next_id += 1
        else:
            rid = rng.choice(live)
            token = rng.randrange(3)
            results = []
            for index, (manager, reqs) in enumerate(zip(managers, requests, strict=True)):
                request = reqs[rid]
                general = [] if index else None
                new = manager.allocate_slots(request, 1, general)
                results.append(None if new is None else [block.block_id for block in new])
                if new is not None:
                    request.num_computed_tokens += 1
                    request.append_token_ids(token)
            assert results[0] == results[1]
        assert state(managers[0]) == state(managers[1])


def test_allocate_reuses_held_blocks_and_adds_only_missing_ones():
    manager = KVCacheManager(16, BS)
    a = Request("a", list(range(5)))
    new = _run(manager, a)
    assert len(new) == 2
    a.append_token_ids(5)
    assert manager.allocate_slots(a, 1) == []  # fits in block 1
    a.num_computed_tokens += 1
    a.append_token_ids(list(range(6, 13)))
    new = manager.allocate_slots(a, 7)  # tokens up to 13 -> 4 blocks
    assert len(new) == 2 and len(manager.get_block_ids(a)) == 4


def test_fork_shares_blocks_and_copy_on_write_yields_exactly_one_copy():
    manager = KVCacheManager(32, BS)
    parent = Request("p", list(range(10)))  # 2 full blocks + partial block of 2
    _run(manager, parent)
    parent.append_token_ids(100)  # sampled, not computed
    child = fork_request(parent, "c")
    child.append_token_ids(200)
    manager.fork(parent, child)
    ids = manager.get_block_ids(parent)
    assert manager.get_block_ids(child) == ids
    assert [b.ref_cnt for b in manager.get_blocks(parent)] == [2, 2, 2]

    assert manager.allocate_slots(parent, 1) is not None  # writes into the shared partial block
    copies = manager.pop_block_copies()
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == ids[2] and dst not in ids
    assert manager.get_block_ids(parent) == ids[:2] + [dst]
    assert manager.allocate_slots(child, 1) == []  # now sole holder: writes in place
    assert manager.pop_block_copies() == []
    assert manager.get_block_ids(child) == ids
    assert [b.ref_cnt for b in manager.get_blocks(child)] == [2, 2, 1]


def test_full_shared_blocks_are_never_copied():
    manager = KVCacheManager(32, BS)
    parent = Request("p", list(range(8)))  # exactly 2 full blocks
    _run(manager, parent)
    parent.append_token_ids(100)
    children = []
    for i in range(3):
        child = fork_request(parent, f"c{i}")
        child.append_token_ids(200 + i)
        manager.fork(parent, child)
        children.append(child)
    for request in [parent, *children]:
        assert len(manager.allocate_slots(request, 1)) == 1  # a fresh third block each
    assert manager.pop_block_copies() == []
    assert manager.get_blocks(parent)[0].ref_cnt == 4


def test_fork_from_an_earlier_point_copies_the_partial_block_on_write():
    manager = KVCacheManager(32, BS)
    parent = Request("p", list(range(11)))
    _run(manager, parent)
    branch = Request("b", list(range(6)) + [77])  # shares tokens 0..5, then diverges
    branch.num_computed_tokens = 6
    manager.fork(parent, branch)
    assert manager.get_block_ids(branch) == manager.get_block_ids(parent)[:2]
    manager.allocate_slots(branch, 1)
    ((src, dst),) = manager.pop_block_copies()
    assert src == manager.get_block_ids(parent)[1]
    assert manager.get_block_ids(branch)[1] == dst


def test_a_branch_copies_a_cached_block_before_writing_even_as_its_last_holder():
    manager = KVCacheManager(32, BS)
    parent = Request("p", list(range(8)))  # 2 full blocks, both cached
    _run(manager, parent)
    branch = Request("b", list(range(6)) + [77])  # diverges inside the parent's second block
    branch.num_computed_tokens = 6
    manager.fork(parent, branch)
    manager.free(parent)  # the branch now holds the cached block alone
    cached = manager.get_block_ids(branch)[1]
    assert manager.allocate_slots(branch, 1) is not None
    ((src, dst),) = manager.pop_block_copies()
    assert src == cached and manager.get_block_ids(branch)[1] == dst != cached
    hits, num_hits = manager.get_computed_blocks(Request("q", list(range(9))))
    assert num_hits == 8 and hits[1].block_id == cached  # its content is the parent's


def test_free_drops_a_pending_copy_into_the_freed_block():
    manager = KVCacheManager(32, BS)
    parent = Request("p", list(range(6)))
    _run(manager, parent)
    parent.append_token_ids(1)
    child = fork_request(parent, "c")
    child.append_token_ids(2)
    manager.fork(parent, child)
    manager.allocate_slots(child, 1)
    manager.free(child)  # e.g. aborted before the step ran
    assert manager.pop_block_copies() == []


def test_all_blocks_are_free_after_every_request_is_freed():
    manager = KVCacheManager(64, BS)
    requests = [Request(i, list(range(i, i + 3 + 2 * i))) for i in range(6)]
    for request in requests:
        _run(manager, request)
        request.append_token_ids(9)
    kids = []
    for request in requests[:3]:
        kid = fork_request(request, ("kid", request.request_id))
        kid.append_token_ids(8)
        manager.fork(request, kid)
        kids.append(kid)
    for request in requests + kids:
        assert manager.allocate_slots(request, 1) is not None
    for request in requests + kids:
        manager.free(request)
    ledger = manager.memory_ledger()
    assert ledger.free_blocks == ledger.total_blocks == 63 and ledger.used_blocks == 0
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


# ------------------------------------------------------------------- misuse errors


def test_misuse_raises_specific_errors_with_guidance():
    manager = KVCacheManager(16, BS)
    stranger = Request("x", [1, 2, 3])
    with pytest.raises(UnknownRequestError, match="get_computed_blocks"):
        manager.allocate_slots(stranger, 3)
    with pytest.raises(UnknownRequestError, match="has_request"):
        manager.free(stranger)
    a = Request("a", list(range(6)))
    _run(manager, a)
    with pytest.raises(InvalidAllocationError, match="existing tokens"):
        manager.allocate_slots(a, 1)  # token 6 does not exist yet
    with pytest.raises(InvalidAllocationError, match="admission"):
        manager.get_computed_blocks(a)
    a.append_token_ids(6)
    dup = fork_request(a, "a")
    with pytest.raises(DuplicateRequestError, match="new id"):
        manager.fork(a, dup)
    salted = Request("s", list(range(6)), cache_salt="x")
    salted.num_computed_tokens = 6
    with pytest.raises(InvalidAllocationError, match="extra cache keys"):
        manager.fork(a, salted)
    wrong = Request("w", [9] * 6)
    wrong.num_computed_tokens = 6
    with pytest.raises(InvalidAllocationError, match="computed prefix"):
        manager.fork(a, wrong)
    manager.free(a)
    with pytest.raises(UnknownRequestError):
        manager.free(a)


def test_stale_prefix_hit_is_rejected():
    manager = KVCacheManager(3, BS)  # 2 usable blocks
    a = Request("a", list(range(5)))
    _run(manager, a)
    manager.free(a)
    b = Request("b", list(range(5)))
    hits, num_hits = manager.get_computed_blocks(b)
    assert num_hits == 4
    _run(manager, Request("c", [7] * 8))  # evicts both blocks
    with pytest.raises(InvalidAllocationError, match="stale"):
        manager.allocate_slots(b, 1, hits, num_hits)


# -------------------------------------------------------------------------- ledger


def test_memory_ledger_counts_and_bytes():
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert spec.bytes_per_token == 131072  # Llama-3-8B: 128 KiB per token
    manager = KVCacheManager(101, 16, kv_spec=spec)
    ledger = manager.memory_ledger()
    assert ledger.total_blocks == 100 and ledger.token_capacity == 1600
    assert ledger.bytes_per_block == 2 * 2**20 and ledger.total_bytes == 200 * 2**20
    a = Request("a", list(range(40)))
    _run(manager, a)
    ledger = manager.memory_ledger()
    assert (ledger.used_blocks, ledger.free_blocks, ledger.cached_blocks) == (3, 97, 2)
    assert ledger.cached_free_blocks == 0 and ledger.usage == pytest.approx(0.03)
    manager.free(a)
    ledger = manager.memory_ledger()
    assert (ledger.used_blocks, ledger.cached_blocks, ledger.cached_free_blocks) == (0, 2, 2)
    assert "100 total" in str(ledger)
    assert spec.num_blocks_for_budget(10 * 2**30, 16) == 5120
    assert KVCacheSpec(1, 1, 1, dtype=4).bytes_per_token == 8
    with pytest.raises(ValueError, match="unknown KV dtype"):
        _ = KVCacheSpec(1, 1, 1, dtype="float13").bytes_per_token


def test_get_block_ids_returns_a_copy():
    manager = KVCacheManager(16, BS)
    a = Request("a", list(range(5)))
    _run(manager, a)
    ids = manager.get_block_ids(a)
    ids.append(0)
    assert len(manager.get_block_ids(a)) == 2


def test_documented_example_runs(capsys):
    doc = Path(__file__).resolve().parents[1] / "docs" / "kv_cache_manager.md"
    example = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)[-1]
    exec(compile(example, str(doc), "exec"), {})
    out = capsys.readouterr().out
    assert "[1, 2, 3]" in out and "[(3, 5)]" in out


def test_prefix_stats_count_an_admission_once_however_often_it_waits():
    manager = KVCacheManager(4, 4, enable_caching=True)  # 3 usable blocks
    a = Request("a", list(range(12)))
    _run(manager, a)  # holds all 3 blocks
    b = Request("b", list(range(8)) + [50, 51, 52])  # shares a's first two blocks
    for _ in range(3):  # the scheduler retries each step while the pool is full
        hits, num_hits = manager.get_computed_blocks(b)
        assert num_hits == 8 and manager.allocate_slots(b, 3, hits, num_hits) is None
    manager.free(a)
    hits, num_hits = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 3, hits, num_hits) is not None
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 12 + 11, 8)


def test_a_copy_source_its_holders_leave_is_not_swapped_into_before_the_copy():
    """Found by the stateful test: a parent writes into the partial block it shares with its
    fork (a copy is queued from it), the fork swaps out, and another request swaps in in the
    same step. Swaps run before the step's copies, so the swap-in must not land in the copy's
    source; the source is free again once the copies are taken."""
    manager = KVCacheManager(5, 2, num_host_blocks=8)
    parent, other = Request("p", [0]), Request("o", [1])
    for request in (parent, other):
        hits, num_hits = manager.get_computed_blocks(request)
        manager.allocate_slots(request, 1, hits, num_hits)
        request.num_computed_tokens = 1
        request.append_token_ids(0)
    child = fork_request(parent, "c")
    child.append_token_ids(0)
    manager.fork(parent, child)
    manager.swap_out(other)  # swapped out in an earlier step
    manager.pop_swaps()
    shared = manager.get_block_ids(child)[0]
    manager.allocate_slots(parent, 1)  # writes position 1 of the shared block: copy-on-write
    manager.swap_out(child)  # the source's last holder leaves
    assert manager.swap_in(other, 0)
    assert shared not in manager.get_block_ids(other)
    assert manager.pop_block_copies() == [(shared, manager.get_block_ids(parent)[0])]
    manager.free(parent)
    manager.free(other)
    manager.free(child)
    manager.pop_swaps()
    assert manager.block_pool.num_free_blocks == manager.block_pool.num_usable_blocks


def test_block_tables_follow_the_managers_diffs_and_grow():
    from pagedjax.worker.block_table import BlockTables

    tables = BlockTables(num_rows=2, width=2)
    rows = [tables.update(key, 0, [3 + key]) for key in range(3)]  # the third doubles the rows
    assert rows == [0, 1, 2] and tables.rows.shape == (4, 2)
    assert tables.update(0, 1, [5, 6]) == 0  # wider than the rows: they widen
    assert tables.gather([0, 2], 4).tolist() == [[3, 5, 6, 0], [5, 0, 0, 0]]
    tables.update(0, 1, [])  # a tail given back
    assert tables.gather([0], 3).tolist() == [[3, 0, 0]]
    tables.forget([2, "unknown"])
    assert tables.update(7, 0, [9]) == 2 and tables.gather([2], 2).tolist() == [[9, 0]]


@pytest.mark.parametrize("window", [0, 6])
def test_the_offer_of_a_block_waits_for_its_last_token(window):
    """A decode whose O(1) path stops at a block still ending in a placeholder (a token being
    sampled) would change nothing on the full path: `offer_waits` says so, until the token is
    known, the slots run out, or a sliding window has blocks to give back."""
    manager = KVCacheManager(16, BS, sliding_window=window)
    request = Request("r", [1, 2, 3, 4, 5, 6])
    _run(manager, request)  # computes 6 tokens; slots for 8
    request.all_token_ids += [7, -1]  # a sample, then a placeholder at the block's last slot
    assert manager.allocate_slots(request, 1) == []  # token 7 at position 6
    request.num_computed_tokens += 1
    assert manager.fast_path_ends([request]) == [7]  # short of the block's offer
    assert manager.offer_waits(request, 8) == (not window)
    assert not manager.offer_waits(request, 9)  # a new block: the full path takes it
    request.all_token_ids[-1] = 8  # the sample came back
    assert not manager.offer_waits(request, 8)
    assert manager.allocate_slots(request, 1) == []
    assert manager.get_blocks(request)[1].block_hash is not None  # offered now
