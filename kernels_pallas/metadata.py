"""Attention metadata: how a step's flat, ragged batch of new tokens maps onto the paged pool.

The new tokens of all sequences in a step are concatenated (prefill chunks and single decode
tokens mixed), as in vLLM v1. Sequence s owns tokens query_start_loc[s] : query_start_loc[s+1];
its query i sits at position seq_lens[s] - q_len + i, where q_len is its number of new tokens.
Shapes are fixed per compiled bucket: T tokens, S sequences, B block-table columns. Padding
tokens have slot PAD_SLOT; padding sequences have q_len 0, seq_len 0 and a table of NULL_BLOCK.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_cache import NULL_BLOCK, PAD_SLOT


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # [T] int32, pool slot (block * block_size + offset) of each new token
    block_tables: jax.Array  # [S, B] int32, logical -> physical block of each sequence
    seq_lens: jax.Array  # [S] int32, context length including this step's new tokens
    query_start_loc: jax.Array  # [S + 1] int32, cumulative q_len; padding rows repeat the total
    num_seqs: jax.Array  # [] int32, real sequences (the rest are padding)
    num_tokens: jax.Array  # [] int32, real tokens (the rest are padding)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the bucket of a padded dimension."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pad_block_tables(block_tables: jax.Array, tile_pages: int) -> jax.Array:
    """[S, B] -> [S, B'] with B' a multiple of `tile_pages`, padded with NULL_BLOCK, so a
    kernel's last tile of pages never reads past the table (a GPU load would fault)."""
    width = block_tables.shape[1]
    padded = -(-width // tile_pages) * tile_pages
    if padded == width:
        return block_tables
    return jnp.pad(block_tables, ((0, 0), (0, padded - width)), constant_values=NULL_BLOCK)


def build_metadata(
    q_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    *,
    num_tokens_padded: int | None = None,
    num_seqs_padded: int | None = None,
    max_blocks_per_seq: int | None = None,
) -> AttentionMetadata:
    """Host-side helper that lays out metadata for sequences given as plain lists.

    Each sequence's new tokens are the last q_lens[s] of its seq_lens[s] tokens. Used by tests
    and simple loops; the engine's model runner fills preallocated buffers itself.
    """
    num_seqs, num_tokens = len(q_lens), sum(q_lens)
    t_pad = num_tokens_padded or num_tokens
    s_pad = num_seqs_padded or num_seqs
    b_pad = max_blocks_per_seq or max((len(t) for t in block_tables), default=1)
    if t_pad < num_tokens or s_pad < num_seqs:
        raise ValueError("padded sizes must cover the real tokens and sequences")

    slots = np.full(t_pad, PAD_SLOT, np.int32)
    tables = np.full((s_pad, b_pad), NULL_BLOCK, np.int32)
    lens = np.zeros(s_pad, np.int32)
    qsl = np.full(s_pad + 1, num_tokens, np.int32)
    qsl[0] = 0
    start = 0
    for s, (q_len, seq_len, table) in enumerate(zip(q_lens, seq_lens, block_tables, strict=True)):
        if seq_len > len(table) * block_size:
            raise ValueError(f"sequence {s}: {seq_len} tokens need more than {len(table)} blocks")
        positions = np.arange(seq_len - q_len, seq_len)
        slots[start : start + q_len] = np.asarray(table)[positions // block_size] * block_size + (
            positions % block_size
        )
        tables[s, : len(table)] = table
        lens[s] = seq_len
        start += q_len
        qsl[s + 1] = start
    return AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=qsl,
        num_seqs=np.int32(num_seqs),
        num_tokens=np.int32(num_tokens),
    )


def token_positions(q_lens: list[int], seq_lens: list[int], num_tokens_padded: int) -> np.ndarray:
    """Positions of the flat new tokens described by (q_lens, seq_lens); padding gets 0."""
    positions = np.zeros(num_tokens_padded, np.int32)
    start = 0
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        positions[start : start + q_len] = np.arange(seq_len - q_len, seq_len)
        start += q_len
    return positions
