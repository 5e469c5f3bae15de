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

from pagedjax.core.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from pagedjax.core.errors import (
    DuplicateRequestError,
    InvalidAllocationError,
    PrefixCacheInUseError,
    UnknownRequestError,
)
from pagedjax.core.hashing import (
    BlockHash,
    extend_block_hashes,
    request_extra_keys,
)
from pagedjax.core.host_pool import HostBlockPool
from pagedjax.core.memory import KVCacheSpec, MemoryLedger
from pagedjax.core.request import KVCacheRequest


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups of successful admissions since creation or the last `reset()`;
    tokens, not blocks."""

    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached on the device
    host_hits: int = 0  # tokens found in the host tier (copied in)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = self.host_hits = 0


@dataclass(slots=True)
class _RequestBlocks:
    """What the manager keeps per request."""

    extra_keys: bytes
    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Leading block ids the model runner's copy of the table already holds (`table_update`).
    synced: int = 0
    # Keys of the request's full blocks, extended incrementally as blocks fill.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Leading blocks whose content is scheduled and that were offered to the prefix cache.
    num_cached_blocks: int = 0
    # Largest scheduled end that needs nothing allocated, cached or copied (the O(1) decode
    # path); -1 forces the full check, e.g. after a fork may have shared the written block.
    fast_path_end: int = -1
    # Leading entries given back to the pool (a sliding window passed them): the null block.
    num_skipped: int = 0


@dataclass(slots=True)
class _SwappedBlocks:
    """A request whose blocks were swapped out to the host tier."""

    extra_keys: bytes
    host_ids: list[int]  # holding its first num_tokens tokens' KV, in table order
    block_hashes: list[BlockHash]
    num_tokens: int


def _num_free_hits(hits: Sequence[KVCacheBlock]) -> int:
    """Hits sitting in the free queue: touching them takes them out of it."""
    return sum(1 for block in hits if block.ref_cnt == 0 and not block.is_null) if hits else 0


def _is_shared(block: KVCacheBlock) -> bool:
    """Whether a request must copy the block before writing into it: another request holds
    it (a fork), or it is cached, i.e. full with content that a branch forked from inside it
    does not share."""
    return block.ref_cnt > 1 or block.block_hash is not None


class KVCacheManager:
    """Allocates, shares, caches and frees KV blocks for requests (host side, no device)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        kv_spec: KVCacheSpec | None = None,
        num_host_blocks: int = 0,
        sliding_window: int = 0,
        block_pool: BlockPool | None = None,
        hash_salt: bytes = b"",
    ) -> None:
        """num_host_blocks: the host tier's blocks (0: no swapping); sliding_window: the
        layers' window (0: full attention), whose passed blocks are given back (no host tier
        then); block_pool and hash_salt: a KV cache group's share of another manager's pool,
        its keys salted apart from the other groups' (`HybridKVCacheManager`)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window < 0 or (sliding_window and num_host_blocks):
            raise ValueError(
                f"sliding_window must be >= 0 (got {sliding_window}), and a manager that frees "
                "the blocks a window passed has no host tier (num_host_blocks=0)"
            )
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_spec = kv_spec
        self.sliding_window = sliding_window
        self.hash_salt = hash_salt
        self.block_pool = block_pool or BlockPool(num_blocks, enable_caching=enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._requests: dict[Hashable, _RequestBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._freed: list[Hashable] = []  # requests freed since `pop_freed`
        self._held_copy_sources: list[KVCacheBlock] = []  # see `free`
        self.host_pool = HostBlockPool(num_host_blocks)
        self._swapped: dict[Hashable, _SwappedBlocks] = {}
        # This step's transfers: (device block, host block) out, (host block, device block) in.
        self._swaps_out: list[tuple[int, int]] = []
        self._swaps_in: list[tuple[int, int]] = []
        self._swapped_in_ids: list[int] = []  # host blocks copied in this step, then free
        if num_host_blocks and enable_caching:  # evicted prefix blocks go to the host tier
            self.block_pool.evicted = []

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
        hits = self.cache_hit(request, (len(token_ids) - 1) // self.block_size)
        return hits, len(hits) * self.block_size

    def cache_hit(self, request: KVCacheRequest, max_hit_blocks: int) -> list[KVCacheBlock]:
        """The longest prefix hit of at most `max_hit_blocks` blocks (after
        `get_computed_blocks` registered the request). Full attention needs every block of
        the prefix cached; a sliding window only those its first new query sees, and the
        blocks before them are the null block."""
        state = self._get_state(request)
        cached_blocks = self.block_pool.cached_blocks
        block_hashes = state.block_hashes[:max_hit_blocks]
        if not self.sliding_window:
            hits = []
            for block_hash in block_hashes:
                block = cached_blocks.get(block_hash)
                if block is None:
                    break
                hits.append(block)
            return hits
        # The longest end whose window's blocks are all cached, searched from the right.
        end, index = len(block_hashes), len(block_hashes) - 1
        while end > 0:
            first = self._num_skipped_blocks(end * self.block_size)
            while index >= first and block_hashes[index] in cached_blocks:
                index -= 1
            if index < first:
                window = [cached_blocks[key] for key in block_hashes[first:end]]
                return [self.block_pool.null_block] * first + window
            end, index = index, index - 1  # a miss: the hit ends before it
        return []

    def _num_skipped_blocks(self, num_computed: int) -> int:
        """Leading blocks that no query from position `num_computed` on sees (its window's
        first key is num_computed - window + 1)."""
        return max(0, (num_computed - self.sliding_window + 1) // self.block_size)

    def host_prefix_hits(self, request: KVCacheRequest, num_hit_blocks: int) -> int:
        """How many blocks after the request's `num_hit_blocks` device hits continue its
        prefix in the host tier (call right after `get_computed_blocks`); pass them to
        `allocate_slots` as `num_host_hit_blocks`."""
        if self.block_pool.evicted is None:
            return 0
        state = self._requests[request.request_id]
        max_hit_blocks = (len(request.all_token_ids) - 1) // self.block_size
        count = 0
        for block_hash in state.block_hashes[num_hit_blocks:max_hit_blocks]:
            if not self.host_pool.contains(block_hash):
                break
            count += 1
        return count

    def num_cached_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of the leading blocks under these keys the prefix cache holds; changes
        nothing (a data-parallel router asks every replica before choosing one)."""
        if not self.enable_caching:
            return 0
        cached_blocks = self.block_pool.cached_blocks
        count = 0
        for block_hash in block_hashes:
            if block_hash not in cached_blocks:
                break
            count += 1
        return count

    def _register(self, request: KVCacheRequest) -> _RequestBlocks:
        state = self._requests[request.request_id] = _RequestBlocks(self._extra_keys(request))
        return state

    def _extra_keys(self, request: KVCacheRequest) -> bytes:
        return request_extra_keys(request) + self.hash_salt if self.enable_caching else b""

    # ---------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_host_hit_blocks: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request` after its computed ones,
        and `num_lookahead_tokens` slots after those (speculative decoding's drafts, which are
        not the request's tokens yet: never cached; `free_tail` gives back what is rejected).

        `new_computed_blocks` / `num_new_computed_tokens` are the prefix hit from
        `get_computed_blocks` (admission only), with `num_host_hit_blocks` more from the host
        tier (`host_prefix_hits`; their tokens counted in `num_new_computed_tokens`): new
        blocks for those, their copies in queued (`pop_swaps`). Returns the freshly allocated
        blocks (possibly empty), or None, changing nothing, if the free pool cannot cover
        them.

        If the first written block is shared (held by a fork too, or cached), the request
        gets a private copy: the block table changes at that index and a (src, dst) copy is
        queued for `pop_block_copies()`.
        """
        try:  # a dict subscript under a zero-cost try: cheaper than .get() in 3.11
            state = self._requests[request.request_id]
        except KeyError:
            raise UnknownRequestError(
                f"request {request.request_id!r} is unknown to the KV cache manager; call "
                "get_computed_blocks(request) on admission (or fork(parent, request)) first"
            ) from None
        if new_computed_blocks is None and not num_new_computed_tokens:
            num_scheduled_end = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
            if (
                num_scheduled_end <= state.fast_path_end
                and num_new_tokens >= 0
                and num_scheduled_end <= len(request.all_token_ids) + num_lookahead_tokens
            ):
                return []  # most decode steps: the token fits in a private, unfilled block
        if self.sliding_window:
            self._free_passed_blocks(request, state)
        hits = new_computed_blocks or ()
        num_computed = self._check_allocation(
            request, state, num_new_tokens, hits, num_new_computed_tokens, num_host_hit_blocks
        )
        num_scheduled_end = num_computed + num_new_tokens
        cow_index = self._copy_on_write_index(state, num_computed) if num_new_tokens else -1
        num_slots_end = num_scheduled_end + num_lookahead_tokens
        num_needed = self._num_new_blocks(state, num_slots_end, hits, cow_index)
        if (num_needed or hits) and not self._fits_free_pool(num_needed, hits):
            return None  # nothing changed
        if not state.blocks:
            host_tokens = num_host_hit_blocks * self.block_size
            self._count_admission(request, num_new_computed_tokens - host_tokens, host_tokens)
        if hits:
            self._apply_prefix_hit(state, hits)
        new_blocks = self._take_new_blocks(state, num_needed, cow_index) if num_needed else []
        if num_host_hit_blocks:  # the first new blocks take the host tier's hits
            host_pool, first = self.host_pool, len(hits)
            for index, block in enumerate(new_blocks[:num_host_hit_blocks], start=first):
                host_id = host_pool.lookup(state.block_hashes[index])
                self._swaps_in.append((host_id, block.block_id))
        num_full = num_scheduled_end // self.block_size
        if num_full > state.num_cached_blocks:
            self._cache_full_blocks(request, state, num_full)
        self._update_fast_path_end(state, num_scheduled_end)
        return new_blocks

    def _check_allocation(
        self,
        request: KVCacheRequest,
        state: _RequestBlocks,
        num_new_tokens: int,
        hits: Sequence[KVCacheBlock],
        num_new_computed_tokens: int,
        num_host_hit_blocks: int = 0,
    ) -> int:
        """Raise on arguments that contradict the request's state; return its computed
        tokens once the prefix hit is applied."""
        num_computed = request.num_computed_tokens
        if hits or num_new_computed_tokens:
            self._check_prefix_hit(
                request, state, hits, num_new_computed_tokens, num_host_hit_blocks
            )
            num_computed += num_new_computed_tokens
        num_slots = len(state.blocks) * self.block_size
        if not (
            num_new_tokens >= 0
            and num_computed + num_new_tokens <= len(request.all_token_ids)
            and request.num_computed_tokens <= num_slots
        ):
            raise InvalidAllocationError(
                f"request {request.request_id!r}: {num_computed} computed + {num_new_tokens} new "
                f"tokens, but it has {len(request.all_token_ids)} tokens and slots for "
                f"{num_slots}; schedule only existing tokens, counts >= 0, and keep "
                "num_computed_tokens in step with executed steps"
            )
        return num_computed

    def _check_prefix_hit(
        self,
        request: KVCacheRequest,
        state: _RequestBlocks,
        hits: Sequence[KVCacheBlock],
        num_new_computed_tokens: int,
        num_host_hit_blocks: int = 0,
    ) -> None:
        if state.blocks or request.num_computed_tokens:
            raise InvalidAllocationError(
                f"request {request.request_id!r} already has computed tokens; a prefix hit "
                "can only be applied on admission"
            )
        num_hit_blocks = len(hits) + num_host_hit_blocks
        if num_new_computed_tokens != num_hit_blocks * self.block_size:
            raise InvalidAllocationError(
                f"num_new_computed_tokens={num_new_computed_tokens} but {num_hit_blocks} hit "
                f"blocks hold {num_hit_blocks * self.block_size} tokens; pass both from "
                "get_computed_blocks (and host_prefix_hits)"
            )
        block_hashes = state.block_hashes
        stale = [
            block
            for index, block in enumerate(hits)
            if index >= len(block_hashes)
            or (block.block_hash != block_hashes[index] and not block.is_null)
        ]
        if stale:
            block = stale[0]
            raise InvalidAllocationError(
                f"prefix hit {block} for request {request.request_id!r} is stale (evicted "
                "since the lookup); call allocate_slots right after get_computed_blocks"
            )

    def _apply_prefix_hit(self, state: _RequestBlocks, hits: Sequence[KVCacheBlock]) -> None:
        """Start the block table with the hit blocks, which are cached already."""
        self.block_pool.touch(hits)
        self._append_blocks(state, hits)
        state.num_cached_blocks = len(state.blocks)
        state.num_skipped = sum(1 for block in hits if block.is_null)  # a window's, leading

    def _copy_on_write_index(self, state: _RequestBlocks, num_computed: int) -> int:
        """Index of the block the step starts writing into if it must be copied first, else -1.

        Only a partially computed block can be shared and written, so only such a block is
        copied.
        """
        block_size = self.block_size
        if num_computed % block_size == 0:
            return -1
        index = num_computed // block_size
        return index if _is_shared(state.blocks[index]) else -1

    def _fits_free_pool(self, num_needed: int, hits: Sequence[KVCacheBlock]) -> bool:
        """Whether `num_needed` new blocks are free once the hits are taken."""
        num_free = self.block_pool.free_block_queue.num_free_blocks
        return num_needed + _num_free_hits(hits) <= num_free

    def blocks_needed(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> int:
        """Free blocks `allocate_slots` with these arguments would take (the hits sitting in
        the free queue among them), so that the groups of a hybrid manager allocate all or
        nothing. Gives back the blocks a sliding window passed, as allocating would."""
        state = self._get_state(request)
        hits = new_computed_blocks or ()
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots_end = num_computed + num_new_tokens + num_lookahead_tokens
        if not hits and num_slots_end <= state.fast_path_end:
            return 0  # as allocate_slots' O(1) path: nothing given back, nothing taken
        if self.sliding_window:
            self._free_passed_blocks(request, state)
        cow_index = self._copy_on_write_index(state, num_computed) if num_new_tokens else -1
        return self._num_new_blocks(state, num_slots_end, hits, cow_index) + _num_free_hits(hits)

    def _num_new_blocks(
        self,
        state: _RequestBlocks,
        num_slots_end: int,
        hits: Sequence[KVCacheBlock],
        cow_index: int,
    ) -> int:
        """New blocks: those the slots reach beyond the held and hit ones, plus the private
        copy of a shared block."""
        num_needed = -(-num_slots_end // self.block_size) - len(state.blocks) - len(hits)
        return (num_needed if num_needed > 0 else 0) + (cow_index >= 0)

    def _free_passed_blocks(self, request: KVCacheRequest, state: _RequestBlocks) -> None:
        """Gives back the leading blocks every later query's window has passed (offered to
        the prefix cache already, so they stay hittable until reused); their entries become
        the null block. Runs once a block fills: O(blocks given back)."""
        num_skipped = min(
            self._num_skipped_blocks(request.num_computed_tokens), state.num_cached_blocks
        )
        start = state.num_skipped
        if num_skipped <= start:
            return
        passed = state.blocks[start:num_skipped]
        state.blocks[start:num_skipped] = [self.block_pool.null_block] * len(passed)
        state.block_ids[start:num_skipped] = [NULL_BLOCK_ID] * len(passed)
        state.num_skipped = num_skipped
        state.synced = min(state.synced, start)
        # Oldest first to the back of the queue: the oldest is evicted first.
        self.block_pool.free_blocks(passed)

    def _count_admission(
        self, request: KVCacheRequest, num_hit_tokens: int, num_host_hit_tokens: int = 0
    ) -> None:
        """Count an admission that succeeds (the first allocation after get_computed_blocks)
        here, not at the lookup, so a request that waits and looks up again counts once."""
        if self.enable_caching:
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += len(request.all_token_ids)
            stats.hits += num_hit_tokens
            stats.host_hits += num_host_hit_tokens

    def _take_new_blocks(
        self, state: _RequestBlocks, num_needed: int, cow_index: int
    ) -> list[KVCacheBlock]:
        """Take `num_needed` free blocks: the last replaces the shared block at `cow_index`
        (unless -1), the others extend the table."""
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        if cow_index < 0:
            self._append_blocks(state, new_blocks)
            return new_blocks
        shared, private = state.blocks[cow_index], new_blocks[-1]
        state.blocks[cow_index] = private
        state.block_ids[cow_index] = private.block_id
        state.synced = min(state.synced, cow_index)
        self._pending_copies.append((shared.block_id, private.block_id))
        self.block_pool.free_blocks((shared,))
        self._append_blocks(state, new_blocks[:-1])
        return new_blocks

    @staticmethod
    def _append_blocks(state: _RequestBlocks, blocks: Sequence[KVCacheBlock]) -> None:
        state.blocks += blocks
        block_ids = state.block_ids
        for block in blocks:  # a loop: most calls append one block
            block_ids.append(block.block_id)

    def _cache_full_blocks(
        self, request: KVCacheRequest, state: _RequestBlocks, num_full: int
    ) -> None:
        """Offer the request's first `num_full` blocks, whose content is fully scheduled
        (final once this step runs), to the prefix cache; each block is offered once."""
        num_cached = state.num_cached_blocks
        token_ids = request.all_token_ids
        while num_full > num_cached and token_ids[num_full * self.block_size - 1] < 0:
            # A placeholder (a token still being sampled, async scheduling; several after a
            # step of several decode steps) ends the block: it is offered once the token is
            # known, at a later allocation.
            num_full -= 1
        if num_full <= num_cached:
            return
        if self.enable_caching:
            block_hashes = state.block_hashes
            extend_block_hashes(
                block_hashes, token_ids, self.block_size, state.extra_keys, num_full
            )
            self.block_pool.cache_full_blocks(state.blocks, block_hashes, num_cached, num_full)
        state.num_cached_blocks = num_full

    def _update_fast_path_end(self, state: _RequestBlocks, num_scheduled_end: int) -> None:
        """Where the O(1) path of `allocate_slots` holds next: up to the end of the held
        slots, short of filling the next block, and only if the next written block is not
        shared."""
        block_size = self.block_size
        if num_scheduled_end % block_size and _is_shared(
            state.blocks[num_scheduled_end // block_size]
        ):
            state.fast_path_end = -1
        else:
            num_slots = len(state.blocks) * block_size
            end = (state.num_cached_blocks + 1) * block_size - 1
            state.fast_path_end = end if end < num_slots else num_slots

    def free_tail(self, request: KVCacheRequest) -> None:
        """Gives back the blocks past those that hold the request's tokens: lookahead slots
        whose drafts were rejected (private and never cached)."""
        state = self._get_state(request)
        keep = -(-len(request.all_token_ids) // self.block_size)
        if len(state.blocks) > keep:
            tail = state.blocks[keep:]
            state.synced = min(state.synced, keep)
            del state.blocks[keep:]
            del state.block_ids[keep:]
            self.block_pool.free_blocks(tail)
            state.fast_path_end = -1

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
        extra_keys = self._extra_keys(child)
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
            num_skipped=min(parent_state.num_skipped, num_shared_blocks),
        )

    # ------------------------------------------------------------------ swapping

    def can_swap_out(self, request: KVCacheRequest) -> bool:
        """Whether the host tier has room for the request's computed tokens."""
        num_blocks = -(-request.num_computed_tokens // self.block_size)
        return request.request_id in self._requests and self.host_pool.num_free_blocks >= (
            num_blocks
        )

    def swap_out(self, request: KVCacheRequest) -> None:
        """Preemption by swap: the blocks holding the request's computed tokens are queued
        for copying to host blocks (`pop_swaps`), then freed as by `free`. The caller keeps
        `request.num_computed_tokens`: `swap_in` brings those tokens back."""
        if not self.can_swap_out(request):
            raise InvalidAllocationError(
                f"request {request.request_id!r} cannot swap out (unknown, or the host tier is "
                "full); check can_swap_out() first"
            )
        state = self._requests[request.request_id]
        num_tokens = request.num_computed_tokens
        host_ids = self.host_pool.allocate(-(-num_tokens // self.block_size))
        self._swaps_out += zip(state.block_ids, host_ids, strict=False)
        hashes = list(state.block_hashes)
        self.free(request)
        self._swapped[request.request_id] = _SwappedBlocks(
            state.extra_keys, host_ids, hashes, num_tokens
        )

    def is_swapped(self, request_id: Hashable) -> bool:
        return request_id in self._swapped

    def num_swapped_tokens(self, request_id: Hashable) -> int:
        return self._swapped[request_id].num_tokens

    def swap_in(self, request: KVCacheRequest, num_new_tokens: int) -> bool:
        """Readmission of a swapped-out request: new device blocks for its swapped tokens,
        queued for copying from the host (`pop_swaps`), with room for `num_new_tokens` more;
        False, changing nothing, when the free pool cannot hold them. The caller then sets
        `request.num_computed_tokens` to `num_swapped_tokens` and allocates the new tokens."""
        swapped = self._swapped[request.request_id]
        block_size = self.block_size
        num_needed = -(-(swapped.num_tokens + num_new_tokens) // block_size)
        if num_needed > self.block_pool.free_block_queue.num_free_blocks:
            return False
        del self._swapped[request.request_id]
        state = self._requests[request.request_id] = _RequestBlocks(swapped.extra_keys)
        state.block_hashes = swapped.block_hashes
        blocks = self.block_pool.get_new_blocks(len(swapped.host_ids))
        self._append_blocks(state, blocks)
        self._swaps_in += zip(swapped.host_ids, state.block_ids, strict=True)
        self._swapped_in_ids += swapped.host_ids
        # Its full blocks hold what they held: offered to the prefix cache again.
        num_full = swapped.num_tokens // block_size
        if num_full:
            self._cache_full_blocks(request, state, num_full)
        return True

    def pop_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (device, host) copies out and (host, device) copies in: the worker
        makes the copies out, then in, before the step's block copies and forward."""
        host_pool, evicted = self.host_pool, self.block_pool.evicted
        if evicted:  # prefix blocks the device reuses this step: kept on the host
            for block_id, block_hash in evicted:
                host_id = host_pool.cache(block_hash)
                if host_id is not None:
                    self._swaps_out.append((block_id, host_id))
            evicted.clear()
        out, into = self._swaps_out, self._swaps_in
        self._swaps_out, self._swaps_in = [], []
        # The host blocks copied in are free (or evictable) from the next step on: this
        # step's copies out, which run first, must not land in them.
        host_pool.free(self._swapped_in_ids)
        self._swapped_in_ids = []
        host_pool.unpin()
        return out, into

    def free(self, request: KVCacheRequest) -> None:
        """Release the request's blocks, last block first, and forget the request.

        Freed blocks keep their cached content until reused; freeing tail-first makes a
        chain's last blocks the first to be evicted. A swapped-out request's host blocks
        are released.
        """
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            if self._swaps_out:  # its copy out has not run: it never will
                gone = set(swapped.host_ids)
                self._swaps_out = [pair for pair in self._swaps_out if pair[1] not in gone]
            self.host_pool.free(swapped.host_ids)
            return
        state = self._requests.pop(request.request_id, None)
        if state is None:
            raise UnknownRequestError(
                f"request {request.request_id!r} is not registered (already freed, or never "
                "passed to get_computed_blocks/fork); check has_request() first"
            )
        self.block_pool.free_blocks(reversed(state.blocks))
        self._freed.append(request.request_id)
        if self._pending_copies:
            # A copy into a block nobody holds any more is moot (and the block may be reused).
            blocks = self.block_pool.blocks
            self._pending_copies = [
                (src, dst) for src, dst in self._pending_copies if blocks[dst].ref_cnt > 0
            ]
            # A copy's source whose last holder just left stays out of the free queue until
            # the copies are popped: the step's swaps run before its copies, so a swap-in
            # must not reuse it.
            for src, _ in self._pending_copies:
                block = blocks[src]
                if block.ref_cnt == 0:
                    self.block_pool.touch((block,))
                    self._held_copy_sources.append(block)

    # ----------------------------------------------------------------- queries

    @property
    def windows(self) -> tuple[int, ...]:
        """Each KV cache group's sliding window (0: full attention): this manager's one."""
        return (self.sliding_window,)

    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def get_blocks(self, request: KVCacheRequest) -> list[KVCacheBlock]:
        """The request's block objects (a copy of the list; do not mutate the blocks)."""
        return list(self._get_state(request).blocks)

    def fast_path_ends(self, requests: Sequence[KVCacheRequest]) -> list[int]:
        """Each request's bound of `allocate_slots`' O(1) path: a request whose computed
        tokens plus its new one stay within it needs nothing from the pool this step."""
        states = self._requests
        return [states[request.request_id].fast_path_end for request in requests]

    def offer_waits(self, request: KVCacheRequest, num_slots_end: int) -> bool:
        """Whether `allocate_slots` up to `num_slots_end` would change nothing though its O(1)
        path ends before it: the request holds the slots (`holds_slots`), copies nothing, and
        the block its path stops at (to offer it to the prefix cache) ends in a token still
        being sampled (a placeholder), so nothing is offered yet either."""
        end = self._requests[request.request_id].fast_path_end
        return (
            0 <= end < num_slots_end
            and self.holds_slots(request, num_slots_end)
            and request.all_token_ids[end] < 0
        )

    def holds_slots(self, request: KVCacheRequest, num_slots_end: int) -> bool:
        """Whether a reserve of slots up to `num_slots_end` would take nothing and give
        nothing back: the request's blocks hold them, and no sliding window frees blocks."""
        num_slots = len(self._requests[request.request_id].blocks) * self.block_size
        return num_slots_end <= num_slots and not self.sliding_window

    def table_update(self, request: KVCacheRequest) -> tuple[int, Sequence[int]]:
        """What the model runner's persistent copy of the request's table lacks: (start, the
        block ids from start on); its table is those after its first `start` entries, nothing
        past them. O(blocks changed): most decode steps send nothing."""
        state = self._get_state(request)
        start, block_ids = state.synced, state.block_ids
        if start == len(block_ids):
            return start, ()
        state.synced = len(block_ids)
        return start, block_ids[start:]

    def pop_freed(self) -> list[Hashable]:
        """The requests freed since the last call (their tables are forgotten)."""
        freed, self._freed = self._freed, []
        return freed

    def get_block_ids(self, request: KVCacheRequest) -> list[int]:
        """The request's block table as block ids (a fresh list)."""
        return list(self._get_state(request).block_ids)

    def pop_block_copies(self) -> list[tuple[int, int]]:
        """Take the (src, dst) block copies queued since the last call; apply them in order."""
        copies, self._pending_copies = self._pending_copies, []
        if self._held_copy_sources:  # copied before any later step writes: free again
            self.block_pool.free_blocks(self._held_copy_sources)
            self._held_copy_sources = []
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
            host_total_blocks=self.host_pool.num_blocks,
            host_used_blocks=self.host_pool.num_used_blocks,
            host_cached_blocks=self.host_pool.num_cached_blocks,
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
        self.host_pool.clear_cache()  # the host tier's prefix blocks are as stale
        if self.block_pool.evicted:
            self.block_pool.evicted.clear()
        self.prefix_cache_stats.reset()
