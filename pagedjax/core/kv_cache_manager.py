"""The scheduler's view of KV memory: per-request block tables over a shared block pool.

A request's block table maps its token positions to physical blocks (position p lives in
slot p % block_size of block table[p // block_size]). The manager grows tables as tokens
are scheduled, shares full blocks between requests through the prefix cache, shares all
blocks between forks, and copies a shared partial block only when someone writes into it.

Call protocol (one scheduler step):
1. On admission: `get_computed_blocks(req)` -> (cached blocks, num cached tokens), then at
   once `allocate_slots(req, n, new_computed_blocks=..., num_new_computed_tokens=...)`.
2. For running requests: `allocate_slots(req, n)`; None means "not enough free blocks,
   nothing changed": preempt someone (`free`) and retry, or skip the request this step.
3. Before running the model: `pop_block_copies()` and perform those (src, dst) copies on
   device in list order; read block tables with `get_block_ids(req)`.
4. After the step: advance `req.num_computed_tokens`, append sampled tokens to
   `req.all_token_ids`. The next `allocate_slots` hashes and caches newly full blocks.
5. At finish or preemption: `free(req)` (and set `req.num_computed_tokens = 0` on preemption).

Blocks are cached as soon as their content is scheduled, so a request admitted in the same
step may hit a block whose KV is written by the same forward pass. That is safe as long as
the model writes each layer's new KV into the cache before attention reads it (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from pagedjax.core.block_pool import BlockPool, KVCacheBlock
from pagedjax.core.errors import (
    DuplicateRequestError,
    InvalidAllocationError,
    PrefixCacheInUseError,
    UnknownRequestError,
)
from pagedjax.core.hashing import (
    ROOT_HASH,
    BlockHash,
    extend_block_hashes,
    make_block_hasher,
    request_extra_keys,
)
from pagedjax.core.memory import KVCacheSpec, MemoryLedger
from pagedjax.core.request import KVCacheRequest


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups of successful admissions since creation or the last `reset()`;
    tokens, not blocks."""

    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = 0


@dataclass(slots=True)
class _RequestBlocks:
    """What the manager keeps per request."""

    extra_keys: bytes
    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Keys of the request's full blocks, extended incrementally as blocks fill.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Leading blocks whose content is scheduled and that were offered to the prefix cache.
    num_cached_blocks: int = 0
    # Largest scheduled end that needs nothing allocated, cached or copied (the O(1) decode
    # path); -1 forces the full check, e.g. after a fork may have shared the written block.
    fast_path_end: int = -1


class KVCacheManager:
    """Allocates, shares, caches and frees KV blocks for requests (host side, no device)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        kv_spec: KVCacheSpec | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_spec = kv_spec
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._requests: dict[Hashable, _RequestBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._hash_full_block = make_block_hasher(block_size)

    # ----------------------------------------------------------------- admission

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: (blocks, number of tokens they hold).

        Registers the request (hashing its full prompt blocks) if it is new. Never covers
        the last token, whose logits the next step must produce. Takes no reference: pass
        the result to `allocate_slots` before allocating for anyone else.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._register(request)
        elif state.blocks:
            raise InvalidAllocationError(
                f"request {request.request_id!r} already holds blocks; get_computed_blocks is "
                "for admission only (free() it first when preempting)"
            )
        if not self.enable_caching:
            return [], 0
        token_ids = request.all_token_ids
        extend_block_hashes(state.block_hashes, token_ids, self.block_size, state.extra_keys)
        # Cap so that at least the last token is computed: its logits are needed.
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        cached_blocks = self.block_pool.cached_blocks
        hits = []
        for block_hash in state.block_hashes[:max_hit_blocks]:
            block = cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _register(self, request: KVCacheRequest) -> _RequestBlocks:
        extra_keys = request_extra_keys(request) if self.enable_caching else b""
        state = self._requests[request.request_id] = _RequestBlocks(extra_keys)
        return state

    # ---------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request` after its computed ones.

        `new_computed_blocks` / `num_new_computed_tokens` are the prefix hit from
        `get_computed_blocks` (admission only). `num_lookahead_tokens` reserves extra slots
        (e.g. speculative drafts) without caching them. Returns the freshly allocated blocks
        (possibly empty), or None, changing nothing, if the free pool cannot cover them.

        If the first written block is shared with a fork (ref count > 1), the request gets
        a private copy: the block table changes at that index and a (src, dst) copy is
        queued for `pop_block_copies()`.
        """
        if new_computed_blocks is None and not (num_new_computed_tokens or num_lookahead_tokens):
            try:  # a dict subscript under a zero-cost try: cheaper than .get() in 3.11
                state = self._requests[request.request_id]
            except KeyError:
                state = None
            else:
                num_scheduled_end = request.num_computed_tokens + num_new_tokens
                if (
                    num_scheduled_end <= state.fast_path_end
                    and num_new_tokens >= 0
                    and num_scheduled_end <= len(request.all_token_ids)
                ):
                    return []  # most decode steps: the token fits in a private, unfilled block
                if num_new_tokens == 1 and num_scheduled_end <= len(request.all_token_ids):
                    # The two per-block events of decoding, without the general machinery
                    # below (same effects and result): the token needs exactly one new
                    # block, or it fills the last held block, which then gets cached. Any
                    # other case (copy-on-write, blocks left to cache, reserved lookahead
                    # blocks, block_size 1) falls through, nothing changed, to the general path.
                    block_size = self.block_size
                    blocks = state.blocks
                    num_blocks = len(blocks)
                    num_cached = state.num_cached_blocks
                    if num_scheduled_end == num_blocks * block_size + 1:
                        if num_cached == num_blocks and block_size > 1:  # nothing to cache
                            block = self.block_pool.get_new_block()
                            if block is None:
                                return None
                            blocks.append(block)
                            state.block_ids.append(block.block_id)
                            # Up to one token short of filling the new (private) block.
                            state.fast_path_end = num_scheduled_end + block_size - 2
                            return [block]
                    elif (
                        num_scheduled_end == (num_cached + 1) * block_size
                        and num_cached < num_blocks
                        and blocks[num_cached].ref_cnt == 1  # private: no copy-on-write
                    ):
                        if self.enable_caching:
                            self._cache_next_full_block(request, state, num_scheduled_end)
                        state.num_cached_blocks = num_cached + 1
                        num_slots = num_blocks * block_size
                        next_end = num_scheduled_end + block_size - 1
                        state.fast_path_end = next_end if next_end < num_slots else num_slots
                        return []
        else:
            state = self._requests.get(request.request_id)
        if state is None:
            raise UnknownRequestError(
                f"request {request.request_id!r} is unknown to the KV cache manager; call "
                "get_computed_blocks(request) on admission (or fork(parent, request)) first"
            )
        block_size = self.block_size
        blocks = state.blocks
        num_computed = request.num_computed_tokens
        if new_computed_blocks or num_new_computed_tokens:
            hits = new_computed_blocks or ()
            self._check_prefix_hit(request, state, hits, num_new_computed_tokens)
            num_computed += num_new_computed_tokens
        else:
            hits = ()
        num_scheduled_end = num_computed + num_new_tokens
        slot_end = num_scheduled_end + num_lookahead_tokens
        num_slots = len(blocks) * block_size
        if not (
            num_new_tokens >= 0
            and num_lookahead_tokens >= 0
            and num_scheduled_end <= len(request.all_token_ids)
            and request.num_computed_tokens <= num_slots
        ):
            raise InvalidAllocationError(
                f"request {request.request_id!r}: {num_computed} computed + {num_new_tokens} new "
                f"tokens (+{num_lookahead_tokens} lookahead), but it has "
                f"{len(request.all_token_ids)} tokens and slots for {num_slots}; schedule only "
                "existing tokens (num_lookahead_tokens reserves extra slots), counts >= 0, and "
                "keep num_computed_tokens in step with executed steps"
            )
        # Blocks whose content is fully scheduled (final once this step runs) get cached.
        num_full = num_scheduled_end // block_size
        # Copy-on-write: the first block written this step is shared with a fork only if it
        # is partially filled; full shared blocks are never written, hence never copied.
        needs_cow = (
            num_computed % block_size != 0
            and slot_end > num_computed
            and blocks[num_computed // block_size].ref_cnt > 1
        )
        num_needed = -(-slot_end // block_size) - len(blocks) - len(hits)
        if num_needed < 0:
            num_needed = 0
        num_needed += needs_cow
        pool = self.block_pool
        if num_needed or hits:
            num_free = pool.free_block_queue.num_free_blocks
            if hits:
                # Hits sitting in the free queue stop being free once touched.
                num_free -= sum(1 for block in hits if block.ref_cnt == 0)
            if num_needed > num_free:
                return None
        if not blocks and self.enable_caching:
            # An admission that succeeds (the first allocation after get_computed_blocks):
            # counted here, not at the lookup, so a request that waits for blocks and looks
            # up again each step is counted once.
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += len(request.all_token_ids)
            stats.hits += num_new_computed_tokens
        if hits:
            pool.touch(hits)
            blocks.extend(hits)
            state.block_ids.extend([block.block_id for block in hits])
            state.num_cached_blocks = len(blocks)
        if num_needed:
            new_blocks = pool.get_new_blocks(num_needed)
            if needs_cow:
                index = num_computed // block_size
                shared, private = blocks[index], new_blocks[-1]
                blocks[index] = private
                state.block_ids[index] = private.block_id
                self._pending_copies.append((shared.block_id, private.block_id))
                pool.free_blocks((shared,))
                tail = new_blocks[:-1]
            else:
                tail = new_blocks
            blocks.extend(tail)
            state.block_ids.extend([block.block_id for block in tail])
        else:
            new_blocks = []

        num_cached = state.num_cached_blocks
        if num_full > num_cached:
            if self.enable_caching:
                block_hashes = state.block_hashes
                if len(block_hashes) < num_full:
                    extend_block_hashes(
                        block_hashes, request.all_token_ids, block_size, state.extra_keys, num_full
                    )
                pool.cache_full_blocks(blocks, block_hashes, num_cached, num_full)
            state.num_cached_blocks = num_cached = num_full

        # Where the O(1) path holds next: up to the end of the held slots, short of filling
        # the next block, and only if the next written block is private.
        index = num_scheduled_end // block_size
        if num_scheduled_end % block_size and blocks[index].ref_cnt > 1:
            state.fast_path_end = -1
        else:
            state.fast_path_end = min(len(blocks) * block_size, (num_cached + 1) * block_size - 1)
        return new_blocks

    def _cache_next_full_block(
        self, request: KVCacheRequest, state: _RequestBlocks, num_scheduled_end: int
    ) -> None:
        """Cache block `state.num_cached_blocks`, which the tokens up to
        `num_scheduled_end` fill (the effect of `allocate_slots` for that one block)."""
        block_size = self.block_size
        index = state.num_cached_blocks
        block_hashes = state.block_hashes
        num_hashes = len(block_hashes)
        if num_hashes == index:  # the usual case: hash just this block
            block_hash = self._hash_full_block(
                block_hashes[-1] if num_hashes else ROOT_HASH,
                request.all_token_ids[num_scheduled_end - block_size : num_scheduled_end],
                state.extra_keys,
            )
            block_hashes.append(block_hash)
        else:
            if num_hashes < index:
                extend_block_hashes(
                    block_hashes, request.all_token_ids, block_size, state.extra_keys, index + 1
                )
            block_hash = block_hashes[index]
        block = state.blocks[index]
        if block.block_hash is None:
            cached_blocks = self.block_pool.cached_blocks
            if block_hash not in cached_blocks:
                block.block_hash = block_hash
                cached_blocks[block_hash] = block

    def _check_prefix_hit(
        self,
        request: KVCacheRequest,
        state: _RequestBlocks,
        hits: Sequence[KVCacheBlock],
        num_new_computed_tokens: int,
    ) -> None:
        if state.blocks or request.num_computed_tokens:
            raise InvalidAllocationError(
                f"request {request.request_id!r} already has computed tokens; a prefix hit "
                "can only be applied on admission"
            )
        if num_new_computed_tokens != len(hits) * self.block_size:
            raise InvalidAllocationError(
                f"num_new_computed_tokens={num_new_computed_tokens} but {len(hits)} hit blocks "
                f"hold {len(hits) * self.block_size} tokens; pass both from get_computed_blocks"
            )
        block_hashes = state.block_hashes
        if (
            len(hits) > len(block_hashes)
            or [block.block_hash for block in hits] != block_hashes[: len(hits)]
        ):
            block = next(
                block
                for index, block in enumerate(hits)
                if index >= len(block_hashes) or block.block_hash != block_hashes[index]
            )
            raise InvalidAllocationError(
                f"prefix hit {block} for request {request.request_id!r} is stale (evicted "
                "since the lookup); call allocate_slots right after get_computed_blocks"
            )

    # -------------------------------------------------------------- fork and free

    def fork(self, parent: KVCacheRequest, child: KVCacheRequest) -> None:
        """Register `child` sharing the blocks that hold its computed tokens with `parent`.

        The child must carry the parent's tokens up to `child.num_computed_tokens` (at most
        the parent's) and the same extra keys; tokens after that (e.g. its own sampled
        token) may differ. No block is copied now; see `allocate_slots` for copy-on-write.
        """
        parent_state = self._requests.get(parent.request_id)
        if parent_state is None:
            raise UnknownRequestError(
                f"cannot fork unknown request {parent.request_id!r}; fork a running request"
            )
        if child.request_id in self._requests:
            raise DuplicateRequestError(
                f"request {child.request_id!r} is already registered; give the child a new id"
            )
        num_shared_tokens = child.num_computed_tokens
        if num_shared_tokens > parent.num_computed_tokens or (
            child.all_token_ids[:num_shared_tokens] != parent.all_token_ids[:num_shared_tokens]
        ):
            raise InvalidAllocationError(
                f"child {child.request_id!r} must start from a computed prefix of "
                f"{parent.request_id!r}: copy its first num_computed_tokens tokens and count"
            )
        extra_keys = request_extra_keys(child) if self.enable_caching else b""
        if extra_keys != parent_state.extra_keys:
            raise InvalidAllocationError(
                f"child {child.request_id!r} has different extra cache keys (cache_salt, ...) "
                f"than {parent.request_id!r}, so it cannot share its KV blocks"
            )
        num_shared_blocks = -(-num_shared_tokens // self.block_size)
        num_full = num_shared_tokens // self.block_size
        shared = parent_state.blocks[:num_shared_blocks]
        self.block_pool.touch(shared)
        parent_state.fast_path_end = -1  # its partial block may now be shared
        self._requests[child.request_id] = _RequestBlocks(
            extra_keys,
            blocks=shared,
            block_ids=parent_state.block_ids[:num_shared_blocks],
            block_hashes=parent_state.block_hashes[:num_full],
            num_cached_blocks=min(parent_state.num_cached_blocks, num_full),
        )

    def free(self, request: KVCacheRequest) -> None:
        """Release the request's blocks, last block first, and forget the request.

        Freed blocks keep their cached content until reused; freeing tail-first makes a
        chain's last blocks the first to be evicted.
        """
        state = self._requests.pop(request.request_id, None)
        if state is None:
            raise UnknownRequestError(
                f"request {request.request_id!r} is not registered (already freed, or never "
                "passed to get_computed_blocks/fork); check has_request() first"
            )
        self.block_pool.free_blocks(reversed(state.blocks))
        if self._pending_copies:
            # A copy into a block nobody holds any more is moot (and the block may be reused).
            blocks = self.block_pool.blocks
            self._pending_copies = [
                (src, dst) for src, dst in self._pending_copies if blocks[dst].ref_cnt > 0
            ]

    # ----------------------------------------------------------------- queries

    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def get_blocks(self, request: KVCacheRequest) -> list[KVCacheBlock]:
        """The request's block objects (a copy of the list; do not mutate the blocks)."""
        return list(self._get_state(request).blocks)

    def get_block_ids(self, request: KVCacheRequest) -> list[int]:
        """The request's block table as block ids (a fresh list)."""
        return list(self._get_state(request).block_ids)

    def pop_block_copies(self) -> list[tuple[int, int]]:
        """Take the (src, dst) block copies queued since the last call; apply them in order."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def _get_state(self, request: KVCacheRequest) -> _RequestBlocks:
        state = self._requests.get(request.request_id)
        if state is None:
            raise UnknownRequestError(f"request {request.request_id!r} is not registered")
        return state

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.num_used_blocks / self.block_pool.num_usable_blocks

    def memory_ledger(self) -> MemoryLedger:
        pool = self.block_pool
        return MemoryLedger(
            block_size=self.block_size,
            total_blocks=pool.num_usable_blocks,
            free_blocks=pool.num_free_blocks,
            used_blocks=pool.num_used_blocks,
            cached_blocks=pool.num_cached_blocks,
            cached_free_blocks=pool.num_free_cached_blocks,
            bytes_per_block=(
                None if self.kv_spec is None else self.kv_spec.bytes_per_block(self.block_size)
            ),
        )

    # ------------------------------------------------------------ prefix cache

    def reset_prefix_cache(self) -> None:
        """Drop every cached key, e.g. after new weights are loaded.

        Raises PrefixCacheInUseError if any block is held by a request: cached blocks in use
        would keep serving the old content. Free (or preempt) all requests first.
        """
        num_used = self.block_pool.num_used_blocks
        if num_used:
            raise PrefixCacheInUseError(
                f"cannot reset the prefix cache: {num_used} blocks are held by "
                f"{len(self._requests)} requests; free all requests first"
            )
        self.block_pool.reset_prefix_cache()
        self.prefix_cache_stats.reset()
