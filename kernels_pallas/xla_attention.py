"""Ragged paged attention as XLA loops over a work list: the "xla" backend, for any pool dtype
and any host (the CPU's default when its C++ kernel does not apply).

The reference (`reference.py`) gathers each token's whole block table, which for a 512-token
prefill chunk is 512 copies of the same pages. Here the work is split the way the Pallas
kernels split their grid, as two `while_loop`s whose trip counts are the step's real work:

- decode tiles: `decode_tile` sequences with one new token each, longest first, so a tile's
  sequences have similar lengths; every token reads its own pages (a decode token reads its
  context once, which is the cost of attention itself);
- prefill tiles: `query_tile` consecutive new tokens of one sequence, which read the
  sequence's pages once for all of them, as matmuls.

Inside a tile, keys are visited `key_chunk` tokens at a time with an online softmax (float32
running max, sum and accumulator, as in flash attention), and only up to the tile's last
visible key: the cost follows the real context lengths, not the block-table width, and causal
prefill skips the chunks after its last query. Padding sequences and tokens cost nothing, and
tiles of one kind do not pay for the other. Results are scattered into their rows of the flat
output; padding rows are zero.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.backend import FunctionBackend
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata, pad_block_tables
from kernels_pallas.reference import MASK_VALUE


def _pages(cache: KVCache, layer: jax.Array | int, pages: jax.Array) -> tuple[jax.Array, ...]:
    """Gathers the pages [..., B] of every KV head: k, v [..., Hkv, B * block_size, D] float32.

    The pool is viewed as rows of one page each, so the gather copies whole contiguous pages and
    lands them in the [..., head, key, D] order the matmuls want (no transpose afterwards).
    Rows are clipped into range first, which lets the gather skip its bounds handling (much
    faster on XLA:CPU); block tables are valid by construction.
    """
    _, num_kv_heads, num_blocks, block_size, head_dim = cache.k.shape
    heads = jnp.arange(num_kv_heads, dtype=pages.dtype)
    rows = (layer * num_kv_heads + heads)[:, None] * num_blocks + pages[..., None, :]
    rows = jnp.clip(rows, 0, cache.k.shape[0] * num_kv_heads * num_blocks - 1)
    shape = (*pages.shape[:-1], num_kv_heads, pages.shape[-1] * block_size, head_dim)

    def gather(pool: jax.Array) -> jax.Array:
        pages = pool.reshape(-1, block_size * head_dim).at[rows].get(mode="promise_in_bounds")
        return pages.reshape(shape).astype(jnp.float32)

    k, v = gather(cache.k), gather(cache.v)
    if cache.k_scale is not None:  # an fp8 pool: dequantize per KV head
        k = k * cache.k_scale[layer][:, None, None]
        v = v * cache.v_scale[layer][:, None, None]
    return k, v


class _Step(NamedTuple):
    """What both kinds of tiles read: the step's queries by KV head, its layout, the pool."""

    qg: jax.Array  # [T, Hkv, G, D] float32
    cache: KVCache
    layer: jax.Array | int
    tables: jax.Array  # [S, B'] block tables padded to whole key chunks
    qsl: jax.Array  # [S + 1] query_start_loc
    seq_lens: jax.Array  # [S]
    q_lens: jax.Array  # [S], 0 for padding sequences
    chunk_blocks: int  # pages per key chunk
    scale: float
    sliding_window: jax.Array | int | None
    soft_cap: float | None
    sinks: jax.Array | None  # [Hkv, G] float32 sink logits (gpt-oss), or None

    @property
    def chunk(self) -> int:
        return self.chunk_blocks * self.cache.k.shape[3]

    def scores(self, raw: jax.Array) -> jax.Array:
        raw = raw * self.scale
        return raw if self.soft_cap is None else self.soft_cap * jnp.tanh(raw / self.soft_cap)

    def visible(self, q_pos: jax.Array, seq_len: jax.Array, j: jax.Array) -> jax.Array:
        """[R, chunk] bool: which keys of chunk j each query (at q_pos [R]) sees."""
        key_pos = j * self.chunk + jnp.arange(self.chunk)[None, :]
        seen = (key_pos <= q_pos[:, None]) & (key_pos < jnp.reshape(seq_len, (-1, 1)))
        if self.sliding_window is not None:
            window = jnp.asarray(self.sliding_window)
            seen &= (window <= 0) | (key_pos > q_pos[:, None] - window)
        return seen

    def chunk_pages(self, table: jax.Array, j: jax.Array) -> tuple[jax.Array, jax.Array]:
        """k, v of key chunk j of the sequences whose block-table rows are `table` [..., B']."""
        pages = jax.lax.dynamic_slice_in_dim(table, j * self.chunk_blocks, self.chunk_blocks, -1)
        return _pages(self.cache, self.layer, pages)


def _initial_state(step: _Step, max_shape, sink_shape, acc_shape) -> tuple[jax.Array, ...]:
    """The online softmax before any key: max MASK_VALUE and sum 0, or with sinks each head's
    sink as a key already seen (max: the sink, sum: exp(0) = 1) that adds no value."""
    if step.sinks is None:
        m, total = jnp.full(max_shape, MASK_VALUE), jnp.zeros(max_shape)
    else:
        m = jnp.broadcast_to(step.sinks.reshape(sink_shape), max_shape)
        total = jnp.ones(max_shape)
    return m, total, jnp.zeros(acc_shape)


def _online_softmax_step(state, scores, seen, axis):
    """One key chunk of flash attention: the new running max and sum, the rescaling of the old
    accumulator (alpha) and the chunk's unnormalised probabilities p."""
    m, total, _ = state
    scores = jnp.where(seen, scores, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=axis, keepdims=True))
    p = jnp.where(seen, jnp.exp(scores - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * total + jnp.sum(p, axis=axis, keepdims=True), alpha, p


def _seen_rows(v: jax.Array, seen: jax.Array) -> jax.Array:
    """v [..., chunk, D] with the rows of keys no query sees zeroed: their probabilities are
    0, but a stale page may hold NaN, and 0 x NaN = NaN in p @ v."""
    return jnp.where(seen, v, 0.0)


def _normalized(total: jax.Array, acc: jax.Array) -> jax.Array:
    return jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0), 0.0)


def _decode_tiles(step: _Step, out: jax.Array, decode_tile: int) -> jax.Array:
    """Attention of the sequences whose only new token is their last, `decode_tile` at a
    time, longest first (so a tile's sequences have similar lengths)."""
    num_seqs = step.seq_lens.shape[0]
    _, num_kv_heads, group, head_dim = step.qg.shape
    is_decode = step.q_lens == 1
    num_decode = jnp.sum(is_decode, dtype=jnp.int32)
    decode_tile = min(decode_tile, num_seqs)
    order = jnp.argsort(jnp.where(is_decode, -step.seq_lens, 1), stable=True)
    order = jnp.pad(order.astype(jnp.int32), (0, decode_tile))

    def tile_body(i, out):
        slot = i * decode_tile + jnp.arange(decode_tile)
        seq = jax.lax.dynamic_slice(order, (i * decode_tile,), (decode_tile,))
        seq_len = jnp.where(slot < num_decode, step.seq_lens[seq], 0)  # [Gd]
        row, table = step.qsl[seq], step.tables[seq]
        q_tile = step.qg[row]  # [Gd, Hkv, g, D]

        def key_chunk_body(j, state):
            k, v = step.chunk_pages(table, j)  # [Gd, Hkv, chunk, D]
            # Plain batched matmuls with only the small operand (q) transposed: the forms
            # XLA:CPU runs fastest.
            scores = step.scores(k @ jnp.swapaxes(q_tile, -1, -2))  # [Gd, Hkv, chunk, g]
            seen = step.visible(seq_len - 1, seq_len, j)[:, None, :, None]
            m, total, alpha, p = _online_softmax_step(state, scores, seen, axis=2)
            pv = jnp.swapaxes(p, -1, -2) @ _seen_rows(v, seen)  # [Gd, Hkv, g, D]
            return m, total, alpha.transpose(0, 1, 3, 2) * state[2] + pv

        state = _initial_state(
            step,
            (decode_tile, num_kv_heads, 1, group),
            (1, num_kv_heads, 1, group),
            (decode_tile, num_kv_heads, group, head_dim),
        )
        num_chunks = (jnp.max(seq_len) + step.chunk - 1) // step.chunk
        _, total, acc = jax.lax.fori_loop(0, num_chunks, key_chunk_body, state)
        tile_out = _normalized(total.transpose(0, 1, 3, 2), acc)
        target = jnp.where(slot < num_decode, row, out.shape[0])  # past the end: dropped
        return out.at[target].set(tile_out, mode="drop")

    num_tiles = (num_decode + decode_tile - 1) // decode_tile
    return jax.lax.fori_loop(0, num_tiles, tile_body, out)


def _prefill_tiles(step: _Step, out: jax.Array, query_tile: int) -> jax.Array:
    """Attention of the sequences with several new tokens, `query_tile` consecutive queries
    of one sequence at a time, which read the sequence's pages once for all of them."""
    num_tokens, num_kv_heads, group, head_dim = step.qg.shape
    query_tile = min(query_tile, num_tokens)
    is_prefill = step.q_lens > 1
    order = jnp.argsort(~is_prefill, stable=True).astype(jnp.int32)
    tiles_per_seq = jnp.where(is_prefill, (step.q_lens + query_tile - 1) // query_tile, 0)
    tile_end = jnp.cumsum(tiles_per_seq[order])  # [S]
    offsets = jnp.arange(query_tile)

    def tile_body(i, out):
        p = jnp.searchsorted(tile_end, i, side="right")
        seq = order[p]
        first = (i - (tile_end[p] - tiles_per_seq[seq])) * query_tile  # within the sequence
        q_len, seq_len, table = step.q_lens[seq], step.seq_lens[seq], step.tables[seq]
        row = step.qsl[seq] + first + offsets  # [Tq]
        q_pos = seq_len - q_len + first + offsets
        q_tile = step.qg[jnp.minimum(row, num_tokens - 1)].transpose(1, 2, 0, 3)
        q_rows = q_tile.reshape(num_kv_heads, group * query_tile, head_dim)

        def key_chunk_body(j, state):
            k, v = step.chunk_pages(table, j)  # [Hkv, chunk, D]
            scores = q_rows @ jnp.swapaxes(k, -1, -2)  # [Hkv, g * Tq, chunk]
            scores = step.scores(scores.reshape(num_kv_heads, group, query_tile, step.chunk))
            seen = step.visible(q_pos, seq_len, j)  # [Tq, chunk]
            m, total, alpha, p = _online_softmax_step(state, scores, seen, -1)
            v = _seen_rows(v, jnp.any(seen, axis=0)[None, :, None])  # keys some query sees
            pv = p.reshape(num_kv_heads, group * query_tile, step.chunk) @ v
            return m, total, alpha * state[2] + pv.reshape(state[2].shape)

        state = _initial_state(
            step,
            (num_kv_heads, group, query_tile, 1),
            (num_kv_heads, group, 1, 1),
            (num_kv_heads, group, query_tile, head_dim),
        )
        last_key = seq_len - q_len + jnp.minimum(first + query_tile, q_len)  # exclusive
        num_chunks = (last_key + step.chunk - 1) // step.chunk
        _, total, acc = jax.lax.fori_loop(0, num_chunks, key_chunk_body, state)
        tile_out = _normalized(total, acc).transpose(2, 0, 1, 3)
        target = jnp.where(first + offsets < q_len, row, num_tokens)  # past the end: dropped
        return out.at[target].set(tile_out, mode="drop")

    if num_tokens == 1:  # a one-token bucket has no prefill tile
        return out
    return jax.lax.fori_loop(0, tile_end[-1], tile_body, out)


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    cache: KVCache,  # k, v: [L, num_kv_heads, num_blocks, block_size, head_dim]
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [num_q_heads] float32
    decode_tile: int = 16,
    query_tile: int = 64,
    key_chunk: int = 256,
) -> jax.Array:  # [T, num_q_heads, head_dim], in q's dtype
    """Same contract and result as `reference.ragged_paged_attention`; the tile sizes change
    only the work split."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.k.shape[1], cache.k.shape[3]
    width = metadata.block_tables.shape[1]
    chunk_blocks = max(1, min(key_chunk // block_size, width))
    tables = pad_block_tables(metadata.block_tables, chunk_blocks)
    qsl = metadata.query_start_loc
    step = _Step(
        qg=q.reshape(num_tokens, num_kv_heads, -1, head_dim).astype(jnp.float32),
        cache=cache,
        layer=layer,
        tables=tables,
        qsl=qsl,
        seq_lens=metadata.seq_lens,
        q_lens=qsl[1:] - qsl[:-1],
        chunk_blocks=chunk_blocks,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, -1),
    )
    out = jnp.zeros(step.qg.shape, jnp.float32)
    out = _decode_tiles(step, out, decode_tile)
    out = _prefill_tiles(step, out, query_tile)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


# Its trip counts follow each sequence's context, so the block-table width costs nothing.
XLA = FunctionBackend(
    "xla", ragged_paged_attention_xla, cost_follows_context=True, takes_sinks=True
)
