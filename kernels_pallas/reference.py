"""Pure-jnp ragged paged attention: the CPU path, and the oracle for the Pallas kernels.

Each token gathers only the pages of its own sequence's block table, so memory scales with
tokens x the block-table width of the step (the runner sizes that width to the longest context
in the step), never with the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.backend import FunctionBackend
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata

# The score of a masked key in every attention implementation. Finite, so a row with no
# visible key (a padding token) stays finite instead of NaN, and exp(m_prev - m_new) in an
# online softmax never sees inf - inf.
MASK_VALUE = -1e30


def token_sequence_ids(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """[T] index of the sequence that owns each flat token (padding maps past the last real one)."""
    t = jnp.arange(num_tokens, dtype=query_start_loc.dtype)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right")
    return jnp.minimum(seq, query_start_loc.shape[0] - 2)


def softmax_with_sinks(
    scores: jax.Array,  # [N, Hkv, G, ..., keys] float32
    sinks: jax.Array | None,  # [Hkv * G] logits, or None
    num_kv_heads: int,
) -> jax.Array:
    """Softmax over the last axis with each query head's sink logit as one more key, which
    takes its share of the probability and adds no value (gpt-oss); plain without sinks."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    heads = sinks.astype(jnp.float32).reshape(1, num_kv_heads, -1, *([1] * (scores.ndim - 3)))
    sink = jnp.broadcast_to(heads, (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    cache: KVCache,  # k, v: [L, num_kv_heads, num_blocks, block_size, head_dim]
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim], in q's dtype
    """Causal attention of each new token over its own sequence's context in the paged pool.

    `sliding_window` (a traced or static int; 0 or None means unlimited) lets a query see keys
    at distance < window only, matching transformers. `sinks` [num_q_heads]: a logit per
    head in every softmax that no value goes with (gpt-oss).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.k.shape[1], cache.k.shape[3]
    group = num_q_heads // num_kv_heads
    width = metadata.block_tables.shape[1] * block_size

    seq = token_sequence_ids(metadata.query_start_loc, num_tokens)
    q_start = metadata.query_start_loc[seq]
    q_len = metadata.query_start_loc[seq + 1] - q_start
    seq_len = metadata.seq_lens[seq]
    q_pos = seq_len - q_len + (jnp.arange(num_tokens) - q_start)  # [T]

    pages = metadata.block_tables[seq]  # [T, B]
    # The advanced indices (layer, pages) put [T, B] first: k, v are [T, B, Hkv, block_size, D].
    k = cache.k[layer, :, pages].astype(jnp.float32)
    v = cache.v[layer, :, pages].astype(jnp.float32)
    if cache.k_scale is not None:  # an fp8 pool: dequantize per KV head
        k = k * cache.k_scale[layer][None, None, :, None, None]
        v = v * cache.v_scale[layer][None, None, :, None, None]

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("tkgd,tbkcd->tkgbc", qg, k).reshape(num_tokens, num_kv_heads, group, width)
    scores = scores * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)

    key_pos = jnp.arange(width)[None, :]  # [1, C]
    visible = (key_pos <= q_pos[:, None]) & (key_pos < seq_len[:, None])
    if sliding_window is not None:
        window = jnp.asarray(sliding_window)
        visible &= (window <= 0) | (key_pos > q_pos[:, None] - window)
    scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
    # Masked keys' probabilities are 0, but a stale page may hold NaN and 0 x NaN = NaN.
    v = jnp.where(visible.reshape(num_tokens, -1, 1, block_size, 1), v, 0.0)

    probs = softmax_with_sinks(scores, sinks, num_kv_heads)
    probs = probs.reshape(num_tokens, num_kv_heads, group, -1, block_size)
    out = jnp.einsum("tkgbc,tbkcd->tkgd", probs, v)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


# The oracle as a backend (tests): its cost grows with the block-table width.
REFERENCE = FunctionBackend(
    "reference", ragged_paged_attention, cost_follows_context=False, takes_sinks=True
)
