"""Hypothesis drives the manager like a scheduler and a model runner would, on tiny pools.

A shadow device (block id -> token in each slot) plays the model runner: queued block
copies are applied, then every scheduled token is written through the block table. After
each executed step every live request must read back exactly its own tokens from its
computed positions: this is what catches a wrong prefix hit, a missed copy-on-write, or a
block reused while still held. Structural invariants are checked after every rule.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_kv_cache_manager import fork_request

from pagedjax.core import (
    NULL_BLOCK_ID,
    KVCacheManager,
    PrefixCacheInUseError,
    Request,
    UnknownRequestError,
)
from pagedjax.worker.block_table import BlockTables

TOKENS = st.integers(0, 2)  # a tiny vocabulary makes prefix hits and collisions frequent
SALTS = st.sampled_from([None, None, None, "salt"])


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 20),
        block_size=st.sampled_from([1, 2, 3, 4]),
        enable_caching=st.sampled_from([True, True, True, False]),
        num_host_blocks=st.sampled_from([0, 2, 32]),
    )
    def setup(
        self, num_blocks: int, block_size: int, enable_caching: bool, num_host_blocks: int
    ) -> None:
        self.manager = KVCacheManager(
            num_blocks, block_size, enable_caching=enable_caching, num_host_blocks=num_host_blocks
        )
        self.block_size = block_size
        self.device: dict[int, list[int | None]] = {}  # block id -> token per slot
        self.host: dict[int, list[int | None]] = {}  # the host tier, likewise
        self.swapped: dict[int, Request] = {}  # swapped out, keeping their computed tokens
        self.prompts: list[tuple[list[int], str | None]] = []  # every prompt admitted
        self.running: dict[int, Request] = {}
        self.waiting: list[Request] = []  # preempted, to be re-admitted with their tokens
        self.batch: dict[int, int] = {}  # request id -> tokens scheduled this step
        self.drafts: dict[int, list[int]] = {}  # speculative tokens in lookahead slots
        self.next_id = 0
        self.tables = BlockTables(num_rows=2, width=2)  # small: they grow

    # ------------------------------------------------------------------ helpers

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _snapshot(self):
        manager, pool = self.manager, self.manager.block_pool
        return (
            [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue],
            {rid: manager.get_block_ids(r) for rid, r in self.running.items()},
            list(manager._pending_copies),
        )

    def _idle(self) -> list[int]:
        return sorted(rid for rid in self.running if rid not in self.batch)

    # -------------------------------------------------------------------- rules

    @rule(
        data=st.data(),
        prompt=st.lists(TOKENS, min_size=1, max_size=14),
        salt=SALTS,
        chunk=st.integers(1, 8),
        readmit=st.booleans(),
        again=st.booleans(),
    )
    def admit(self, data, prompt, salt, chunk, readmit, again) -> None:
        if readmit and self.waiting:
            request = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        else:
            if again and self.prompts:  # a returning prompt: cached, maybe evicted to host
                prompt, salt = data.draw(st.sampled_from(self.prompts))
            self.prompts.append((prompt, salt))
            request = Request(self._new_id(), prompt, cache_salt=salt)
        manager = self.manager
        hits, num_hits = manager.get_computed_blocks(request)
        assert num_hits == len(hits) * self.block_size
        assert num_hits <= request.num_tokens - 1  # the last token is always computed
        assert all(not b.is_null and b.block_hash is not None for b in hits)
        # The prefix may go on in the host tier (blocks the device evicted): copied in.
        num_host = manager.host_prefix_hits(request, len(hits))
        num_hits += num_host * self.block_size
        assert num_hits <= request.num_tokens - 1
        num_new = min(chunk, request.num_tokens - num_hits)
        before = self._snapshot()
        if manager.allocate_slots(request, num_new, hits, num_hits, num_host) is None:
            assert self._snapshot() == before
            manager.free(request)  # unregister; it holds nothing
            self.waiting.append(request)
            return
        request.num_computed_tokens = num_hits
        self.running[request.request_id] = request
        self.batch[request.request_id] = num_new

    @precondition(lambda self: any(rid not in self.batch for rid in self.running))
    @rule(data=st.data(), chunk=st.integers(1, 8), drafts=st.lists(TOKENS, max_size=3))
    def schedule(self, data, chunk, drafts) -> None:
        request = self.running[data.draw(st.sampled_from(self._idle()))]
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        before = self._snapshot()
        if drafts and request.num_computed_tokens + num_new == request.num_tokens:
            # Speculative decoding: draft tokens in lookahead slots after the last token.
            lookahead = len(drafts)
            if (
                self.manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                is not None
            ):
                self.batch[request.request_id] = num_new
                self.drafts[request.request_id] = drafts
                return
            assert self._snapshot() == before
        new = self.manager.allocate_slots(request, num_new)
        if new is None:
            assert self._snapshot() == before
        else:
            self.batch[request.request_id] = num_new

    @rule(data=st.data())
    def execute(self, data) -> None:
        """The model runner: copies first, then KV writes, then sample for caught-up requests."""
        bs = self.block_size
        swaps_out, swaps_in = self.manager.pop_swaps()
        for device_block, host_block in swaps_out:  # out first, as the worker does
            self.host[host_block] = list(self.device.get(device_block, [None] * bs))
        for host_block, device_block in swaps_in:
            self.device[device_block] = list(self.host[host_block])
        for src, dst in self.manager.pop_block_copies():
            assert NULL_BLOCK_ID not in (src, dst)
            self.device[dst] = list(self.device.get(src, [None] * bs))
        # The model runner's persistent tables, kept from the manager's diffs, equal each
        # scheduled request's block table.
        self.tables.forget(self.manager.pop_freed())
        for rid in self.batch:
            request = self.running[rid]
            row = self.tables.update(rid, *self.manager.table_update(request))
            ids = self.manager.get_block_ids(request)
            table = self.tables.rows[row]
            assert table[: len(ids)].tolist() == ids and not table[len(ids) :].any()
        for rid, num_new in self.batch.items():
            request = self.running[rid]
            table = self.manager.get_block_ids(request)
            start = request.num_computed_tokens
            written = request.all_token_ids[start : start + num_new] + self.drafts.get(rid, [])
            for pos, token in enumerate(written, start=start):
                slots = self.device.setdefault(table[pos // bs], [None] * bs)
                slots[pos % bs] = token
        for rid, num_new in self.batch.items():
            request = self.running[rid]
            request.num_computed_tokens += num_new
            drafts = self.drafts.pop(rid, [])
            if drafts:  # the verdict: a prefix accepted, the rest's slots given back
                accepted = data.draw(st.integers(0, len(drafts)))
                request.append_token_ids(drafts[:accepted])
                request.num_computed_tokens += accepted
            if request.num_computed_tokens == request.num_tokens:
                request.append_token_ids(data.draw(TOKENS))
            if drafts:
                self.manager.free_tail(request)
                assert len(self.manager.get_block_ids(request)) <= -(-request.num_tokens // bs)
        self.batch.clear()
        # Every live request reads back its own tokens: hits, forks and copies were right.
        for request in self.running.values():
            table = self.manager.get_block_ids(request)
            for pos in range(request.num_computed_tokens):
                assert self.device[table[pos // bs]][pos % bs] == request.all_token_ids[pos], (
                    f"request {request.request_id} position {pos} reads a foreign token"
                )

    @precondition(lambda self: any(rid not in self.batch for rid in self.running))
    @rule(data=st.data(), token=TOKENS, earlier=st.booleans())
    def fork(self, data, token, earlier) -> None:
        parent = self.running[data.draw(st.sampled_from(self._idle()))]
        if earlier and parent.num_computed_tokens > 0:  # beam-style branch from the past
            shared = data.draw(st.integers(0, parent.num_computed_tokens))
            child = Request(self._new_id(), parent.all_token_ids[:shared] + [token])
            child.cache_salt = parent.cache_salt
            child.num_computed_tokens = shared
        else:  # parallel sampling: same computed tokens, own sampled token
            child = fork_request(parent, self._new_id())
            if child.num_tokens == child.num_computed_tokens:
                child.append_token_ids(token)
        self.manager.fork(parent, child)
        self.running[child.request_id] = child

    @precondition(lambda self: any(rid not in self.batch for rid in self.running))
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt) -> None:
        request = self.running.pop(data.draw(st.sampled_from(self._idle())))
        self.manager.free(request)
        if preempt:
            request.num_computed_tokens = 0
            self.waiting.append(request)

    @precondition(lambda self: any(rid not in self.batch for rid in self.running))
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        request = self.running[data.draw(st.sampled_from(self._idle()))]
        if not self.manager.can_swap_out(request):
            return
        self.manager.swap_out(request)
        del self.running[request.request_id]
        self.swapped[request.request_id] = request

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), chunk=st.integers(0, 8), abort=st.booleans())
    def swap_in(self, data, chunk, abort) -> None:
        """Readmission of a swapped request (or its abort, freeing its host blocks)."""
        request = self.swapped[data.draw(st.sampled_from(sorted(self.swapped)))]
        manager = self.manager
        if abort:
            manager.free(request)
            del self.swapped[request.request_id]
            return
        num_tokens = manager.num_swapped_tokens(request.request_id)
        assert num_tokens == request.num_computed_tokens
        num_new = min(chunk, request.num_tokens - num_tokens)
        before = self._snapshot()
        if not manager.swap_in(request, num_new):
            assert self._snapshot() == before
            return
        assert manager.allocate_slots(request, num_new) is not None
        del self.swapped[request.request_id]
        self.running[request.request_id] = request
        self.batch[request.request_id] = num_new

    @precondition(lambda self: any(rid not in self.batch for rid in self.running))
    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=1, max_size=3))
    def append_tokens(self, data, tokens) -> None:
        self.running[data.draw(st.sampled_from(self._idle()))].append_token_ids(tokens)

    @rule()
    def reset_prefix_cache(self) -> None:
        if self.manager.block_pool.num_used_blocks:
            with pytest.raises(PrefixCacheInUseError):
                self.manager.reset_prefix_cache()
        else:
            self.manager.reset_prefix_cache()
            assert self.manager.block_pool.num_cached_blocks == 0

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=4))
    def unknown_request_is_rejected(self, prompt) -> None:
        with pytest.raises(UnknownRequestError):
            self.manager.allocate_slots(Request("stranger", prompt), 1)

    # --------------------------------------------------------------- invariants

    @invariant()
    def ref_counts_equal_holders_and_queue_holds_exactly_the_free_blocks(self) -> None:
        manager, pool = self.manager, self.manager.block_pool
        holders = Counter()
        for request in self.running.values():
            holders.update(manager.get_block_ids(request))
        # A pending copy's source its holders left: kept until the copies run.
        holders.update(block.block_id for block in manager._held_copy_sources)
        assert NULL_BLOCK_ID not in holders
        assert pool.null_block.ref_cnt == 0
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], block
        queue = [b.block_id for b in pool.free_block_queue]
        assert len(queue) == len(set(queue)) == pool.num_free_blocks
        assert set(queue) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_usable_blocks
        # The prefix-cache index agrees with the blocks, and only full blocks are indexed.
        assert all(b.block_hash == h for h, b in pool.cached_blocks.items())
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == pool.num_cached_blocks
        assert pool.num_free_cached_blocks == sum(1 for b in hashed if b.ref_cnt == 0)
        ledger = manager.memory_ledger()
        assert ledger.free_blocks + ledger.used_blocks == ledger.total_blocks
        # The host tier: each swapped request holds the blocks of its computed tokens.
        host = manager.host_pool
        held = sum(-(-r.num_computed_tokens // self.block_size) for r in self.swapped.values())
        held += len(manager._swaps_in)  # copied in this step, free once it is popped
        assert host.num_used_blocks == held
        assert host.num_free_blocks + host.num_used_blocks == host.num_blocks

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for request in [*self.running.values(), *self.swapped.values()]:
            self.manager.free(request)
        self.manager.pop_block_copies()  # as the scheduler does every step
        self.manager.pop_swaps()
        assert self.manager.host_pool.num_used_blocks == 0
        pool = self.manager.block_pool
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)


KVCacheMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_manager_stateful = KVCacheMachine.TestCase
