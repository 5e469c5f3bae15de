"""Ragged paged attention on CPU: the C++ kernel of `cpu_attention.py` for a float32 pool,
otherwise XLA loops over a work list.

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

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_attention
from kernels_pallas.kv_cache import NULL_BLOCK, KVCache
from kernels_pallas.metadata import AttentionMetadata

_MASKED = -1e30  # finite: a row without a visible key stays finite instead of NaN


def _pages(cache: KVCache, layer: jax.Array | int, pages: jax.Array) -> tuple[jax.Array, ...]:
    """Gathers the pages [..., B] of every KV head: k, v [..., Hkv, B * block_size, D] float32.

    The pool is viewed as rows of one page each, so the gather copies whole contiguous pages and
    lands them in the [..., head, key, D] order the matmuls want (no transpose afterwards).
    Rows are clipped into range first, which lets the gather skip its bounds handling (2.4x
    faster on XLA:CPU, measured); block tables are checked where they are built.
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


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    cache: KVCache,  # k, v: [L, num_kv_heads, num_blocks, block_size, head_dim]
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    decode_tile: int = 16,
    query_tile: int = 64,
    key_chunk: int = 256,
    cpu_kernel: bool = True,
) -> jax.Array:  # [T, num_q_heads, head_dim], in q's dtype
    """Same contract and result as `reference.ragged_paged_attention`. `cpu_kernel`: the C++
    kernel (`cpu_attention.py`) takes the whole call where it supports it."""
    if cpu_kernel and cpu_attention.supports(q, cache):
        out = cpu_attention.paged_attention_cpu(
            q.astype(jnp.float32),
            cache,
            layer,
            metadata,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
        return out.astype(q.dtype)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.k.shape[1], cache.k.shape[3]
    group = num_q_heads // num_kv_heads
    num_seqs, width = metadata.block_tables.shape
    chunk_blocks = max(1, min(key_chunk // block_size, width))
    chunk = chunk_blocks * block_size
    tables = jnp.pad(
        metadata.block_tables, ((0, 0), (0, -width % chunk_blocks)), constant_values=NULL_BLOCK
    )
    qsl, seq_lens = metadata.query_start_loc, metadata.seq_lens
    q_lens = qsl[1:] - qsl[:-1]  # [S]; 0 for padding sequences
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    drop_row = num_tokens  # scatter index past the end: dropped
    chunk_pos = jnp.arange(chunk)

    def scaled(scores: jax.Array) -> jax.Array:
        scores = scores * scale
        return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)

    def visible(q_pos: jax.Array, seq_len: jax.Array, j: jax.Array) -> jax.Array:
        """[R, chunk] bool: which keys of chunk j each query (at q_pos [R]) sees."""
        key_pos = j * chunk + chunk_pos[None, :]
        seen = (key_pos <= q_pos[:, None]) & (key_pos < jnp.reshape(seq_len, (-1, 1)))
        if sliding_window is not None:
            window = jnp.asarray(sliding_window)
            seen &= (window <= 0) | (key_pos > q_pos[:, None] - window)
        return seen

    def online_softmax_step(state, scores, seen, axis):
        """One chunk of flash attention's running max m, sum total and (unnormalised) output."""
        m, total, acc = state
        scores = jnp.where(seen, scores, _MASKED)
        m_new = jnp.maximum(m, jnp.max(scores, axis=axis, keepdims=True))
        p = jnp.where(seen, jnp.exp(scores - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        return m_new, alpha * total + jnp.sum(p, axis=axis, keepdims=True), alpha, p

    def finish(total, acc):
        return jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0), 0.0)

    out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)

    # Decode tiles: sequences whose only new token is their last, longest first.
    is_decode = q_lens == 1
    num_decode = jnp.sum(is_decode, dtype=jnp.int32)
    decode_tile = min(decode_tile, num_seqs)
    decode_order = jnp.argsort(jnp.where(is_decode, -seq_lens, 1), stable=True)
    decode_order = jnp.pad(decode_order.astype(jnp.int32), (0, decode_tile))

    def decode_body(i, out):
        slot = i * decode_tile + jnp.arange(decode_tile)
        seq = jax.lax.dynamic_slice(decode_order, (i * decode_tile,), (decode_tile,))
        seq_len = jnp.where(slot < num_decode, seq_lens[seq], 0)  # [Gd]
        row, table = qsl[seq], tables[seq]
        q_tile = qg[row]  # [Gd, Hkv, g, D]

        def key_chunk_body(j, state):
            pages = jax.lax.dynamic_slice_in_dim(table, j * chunk_blocks, chunk_blocks, axis=1)
            k, v = _pages(cache, layer, pages)  # [Gd, Hkv, chunk, D]
            # Matmul forms here and below are the ones XLA:CPU runs fastest (measured): plain
            # batched matmuls, with only the small operand (q) transposed.
            scores = scaled(k @ jnp.swapaxes(q_tile, -1, -2))  # [Gd, Hkv, chunk, g]
            seen = visible(seq_len - 1, seq_len, j)[:, None, :, None]
            m, total, alpha, p = online_softmax_step(state, scores, seen, axis=2)
            pv = jnp.swapaxes(p, -1, -2) @ v  # [Gd, Hkv, g, D]
            return m, total, alpha.transpose(0, 1, 3, 2) * state[2] + pv

        state = (
            jnp.full((decode_tile, num_kv_heads, 1, group), _MASKED),
            jnp.zeros((decode_tile, num_kv_heads, 1, group)),
            jnp.zeros((decode_tile, num_kv_heads, group, head_dim)),
        )
        num_chunks = (jnp.max(seq_len) + chunk - 1) // chunk
        _, total, acc = jax.lax.fori_loop(0, num_chunks, key_chunk_body, state)
        tile_out = finish(total.transpose(0, 1, 3, 2), acc)
        return out.at[jnp.where(slot < num_decode, row, drop_row)].set(tile_out, mode="drop")

    num_decode_tiles = (num_decode + decode_tile - 1) // decode_tile
    out = jax.lax.fori_loop(0, num_decode_tiles, decode_body, out)

    # Prefill tiles: up to `query_tile` consecutive new tokens of one sequence.
    query_tile = min(query_tile, num_tokens)
    is_prefill = q_lens > 1
    prefill_order = jnp.argsort(~is_prefill, stable=True).astype(jnp.int32)
    tiles_per_seq = jnp.where(is_prefill, (q_lens + query_tile - 1) // query_tile, 0)
    tile_end = jnp.cumsum(tiles_per_seq[prefill_order])  # [S]
    offsets = jnp.arange(query_tile)

    def prefill_body(i, out):
        p = jnp.searchsorted(tile_end, i, side="right")
        seq = prefill_order[p]
        first = (i - (tile_end[p] - tiles_per_seq[seq])) * query_tile  # within the sequence
        q_len, seq_len, table = q_lens[seq], seq_lens[seq], tables[seq]
        row = qsl[seq] + first + offsets  # [Tq]
        valid = first + offsets < q_len
        q_pos = seq_len - q_len + first + offsets
        q_tile = qg[jnp.minimum(row, num_tokens - 1)].transpose(1, 2, 0, 3)  # [Hkv, g, Tq, D]
        q_rows = q_tile.reshape(num_kv_heads, group * query_tile, head_dim)

        def key_chunk_body(j, state):
            pages = jax.lax.dynamic_slice_in_dim(table, j * chunk_blocks, chunk_blocks)
            k, v = _pages(cache, layer, pages)  # [Hkv, chunk, D]
            scores = q_rows @ jnp.swapaxes(k, -1, -2)  # [Hkv, g * Tq, chunk]
            scores = scaled(scores.reshape(num_kv_heads, group, query_tile, chunk))
            m, total, alpha, p = online_softmax_step(state, scores, visible(q_pos, seq_len, j), -1)
            pv = p.reshape(num_kv_heads, group * query_tile, chunk) @ v
            return m, total, alpha * state[2] + pv.reshape(state[2].shape)

        state = (
            jnp.full((num_kv_heads, group, query_tile, 1), _MASKED),
            jnp.zeros((num_kv_heads, group, query_tile, 1)),
            jnp.zeros((num_kv_heads, group, query_tile, head_dim)),
        )
        last_key = seq_len - q_len + jnp.minimum(first + query_tile, q_len)  # exclusive
        _, total, acc = jax.lax.fori_loop(0, (last_key + chunk - 1) // chunk, key_chunk_body, state)
        tile_out = finish(total, acc).transpose(2, 0, 1, 3)
        return out.at[jnp.where(valid, row, drop_row)].set(tile_out, mode="drop")

    if num_tokens > 1:  # a one-token bucket has no prefill tile
        out = jax.lax.fori_loop(0, tile_end[-1], prefill_body, out)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
