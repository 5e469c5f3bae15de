"""Ragged paged attention as a Pallas kernel (Triton lowering): one kernel for a step's flat batch
of prefill chunks and decode tokens mixed, reading K/V straight from the stacked paged pool.

Work decomposition. A *work item* is (sequence, query block): BQ consecutive new tokens of one
sequence (a query block never spans two sequences). The list of work items is computed with jnp
from the metadata inside the jitted step (no host round trip) and passed to the kernel as plain
int32 arrays: the Triton lowering has no scalar prefetch, so the kernel loads its work item's
scalars from global memory itself. The grid is (W, num_kv_heads) with the static bound

    W = T // BQ + min(S, T)  >=  sum_s cdiv(q_len_s, BQ),

and programs past the real work list exit at once; so do padding sequences (q_len 0 has no
blocks). One program serves all G query heads of its KV head: its M = BQ * Gp rows are
(token, head) pairs, token-major (Gp = G rounded up to a power of two, as Triton needs), so each
KV tile is read once per group and feeds an [M, D] x [D, KT] tensor-core dot.

KV tiles. A tile is KT = pages_per_tile * block_size consecutive positions of the sequence. The
kernel gathers each position's page through the block table and loads the tile as one [KT, D]
gather (rows are contiguous D-vectors of the page, so loads stay coalesced). Only tiles that
some row of the block can see are visited: causal upper bound, sliding-window lower bound.

Numerics: the online (flash) softmax keeps max, sum and the output accumulator in float32.
Scores and P @ V run on the tensor cores in the pool's dtype for 16-bit pools (products of
16-bit values are exact in float32, accumulation is float32), in IEEE float32 for float32
pools, and in bfloat16 for fp8 pools after the dequantising upcast (the per-tensor / per-head
K scale is folded into the softmax scale, the V scale into the final normalisation).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import pallas_common
from kernels_pallas.metadata import next_power_of_2, pad_block_tables
from kernels_pallas.reference import MASK_VALUE


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Static tiling of the ragged kernel (hashable: it is a jit static argument). A field left
    None takes its value from `default_tiling` for the pool's dtype and head_dim."""

    rows_per_program: int | None = None  # M = BQ * Gp query rows per program (power of two)
    kv_tile_tokens: int | None = None  # KT, rounded up to whole pages (power of two, >= 16)
    num_warps: int | None = None
    num_stages: int = 2


# (rows_per_program, kv_tile_tokens, num_warps) by head_dim: the largest tiles that compile
# without spilling registers for sm_80 and sm_90 (checked by tests/test_triton_compile.py).
# Tensor-core dots (16-bit and fp8 pools) keep their operands in shared memory; float32 pools
# run IEEE float32 dots as FMAs on operands held in registers, where 64 x 64 tiles spill; the
# integer fp8 upcast of GPUs before sm_89 needs registers of its own.
TENSOR_CORE_TILING = {64: (64, 64, 4), 128: (64, 64, 4), 256: (64, 32, 8)}
FLOAT32_TILING = {64: (64, 32, 8), 128: (32, 16, 4), 256: (32, 16, 8)}
SOFTWARE_FP8_TILING = {64: (64, 32, 4), 128: (64, 32, 8), 256: (64, 32, 8)}


def default_tiling(
    kv_dtype: jnp.dtype, head_dim: int, software_fp8: bool = False
) -> tuple[int, int, int]:
    """(rows_per_program, kv_tile_tokens, num_warps) for a pool of `kv_dtype`."""
    if pallas_common.matmul_dtype(kv_dtype) == jnp.float32:
        table = FLOAT32_TILING
    elif software_fp8 and jnp.dtype(kv_dtype).itemsize == 1:
        table = SOFTWARE_FP8_TILING
    else:
        table = TENSOR_CORE_TILING
    return table[min(max(head_dim, 64), 256)]


def ragged_tiling(
    kv_dtype: jnp.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    config: RaggedConfig,
    software_fp8: bool = False,
) -> tuple[int, int, int, int]:
    """(Gp, rows per program M, KV tile tokens KT, num_warps): `config` over `default_tiling`,
    with M a power of two holding at least one token's padded group and Triton's 16 rows."""
    group_padded = next_power_of_2(group)
    default_rows, default_kv_tile, default_warps = default_tiling(kv_dtype, head_dim, software_fp8)
    rows = max(next_power_of_2(config.rows_per_program or default_rows), group_padded, 16)
    kv_tile = pallas_common.kv_tile_tokens(config.kv_tile_tokens or default_kv_tile, block_size)
    return group_padded, rows, kv_tile, config.num_warps or default_warps


def _ragged_kernel(
    layer_ref,  # [1] int32
    window_ref,  # [1] int32, 0 = unlimited
    scales_ref,  # [2, L, Hkv] float32: softmax scale x K dequant scale; V dequant scale
    work_seq_ref,  # [W] int32, sequence of each work item, -1 = no work
    work_qblock_ref,  # [W] int32, query block of the item within its sequence
    query_start_ref,  # [S + 1] int32
    seq_lens_ref,  # [S] int32
    block_tables_ref,  # [S, B'] int32
    sinks_ref,  # [Hkv, Gp] float32 sink logits (read only if use_sinks)
    q_ref,  # [R, D] rows (token, head) of this KV head's group, R = T * Gp + M
    k_ref,  # [L, N, block_size, D] this KV head's pool
    v_ref,  # [L, N, block_size, D]
    o_ref,  # [R, D]
    *,
    group_padded: int,
    tokens_per_block: int,
    loop: pallas_common.TileLoop,
    use_window: bool,
    use_sinks: bool,
):
    work, head = pl.program_id(0), pl.program_id(1)
    seq = work_seq_ref[work]

    @pl.when(seq >= 0)
    def _():
        rows, head_dim = tokens_per_block * group_padded, q_ref.shape[-1]
        q_block = work_qblock_ref[work]
        layer = layer_ref[0]
        seq_q_start = query_start_ref[seq]
        q_len = query_start_ref[seq + 1] - seq_q_start
        seq_len = seq_lens_ref[seq]
        first_token = seq_q_start + q_block * tokens_per_block
        block_tokens = jnp.minimum(tokens_per_block, q_len - q_block * tokens_per_block)
        first_pos = seq_len - q_len + q_block * tokens_per_block

        row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
        row_token = lax.div(row, group_padded)
        row_pos = first_pos + row_token  # [M] position of each row's query

        kv_end = jnp.minimum(first_pos + block_tokens, seq_len)  # causal bound of the block
        kv_tile = loop.kv_tile
        tile_start = jnp.int32(0)
        window = window_ref[0]
        if use_window:
            kv_start = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
            tile_start = lax.div(kv_start, kv_tile)
        num_tiles = lax.div(kv_end + kv_tile - 1, kv_tile)

        def visible(key_pos):  # [KT] -> [M, KT]
            seen = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < seq_len)
            if use_window:
                seen &= (window <= 0) | (key_pos[None, :] > row_pos[:, None] - window)
            return seen

        def key_valid(key_pos):  # [KT] -> [KT]: the union of the block's rows' windows
            seen = key_pos < kv_end
            if use_window:
                seen &= (window <= 0) | (key_pos > first_pos - window)
            return seen

        q = q_ref[pl.ds(first_token * group_padded, rows), :]  # [M, D]
        tiles, scale = (tile_start, num_tiles), scales_ref[0, layer, head]
        acc, m, denom = pallas_common.attend_kv_tiles(
            loop, q, k_ref, v_ref, block_tables_ref, seq, layer, tiles, visible, key_valid, scale
        )
        if use_sinks:  # one more key of the sink's logit, with no value (gpt-oss)
            sink = sinks_ref[head, lax.rem(row, group_padded)]  # [M]
            denom = denom + jnp.exp(sink - m)
        v_scale = scales_ref[1, layer, head]
        out = acc * (v_scale / jnp.where(denom > 0, denom, 1.0))[:, None]
        row_valid = jnp.broadcast_to((row_token < block_tokens)[:, None], (rows, head_dim))
        plgpu.store(
            o_ref.at[pl.ds(first_token * group_padded, rows), :],
            out.astype(o_ref.dtype),
            mask=row_valid,
        )


def _sink_rows(sinks: jax.Array | None, num_kv_heads: int, group: int, group_padded: int):
    """[Hq] sink logits -> [Hkv, Gp] float32 (the padded heads' MASK_VALUE adds exp(-inf) = 0);
    without sinks a [1, 1] placeholder the kernel does not read."""
    if sinks is None:
        return jnp.zeros((1, 1), jnp.float32)
    rows = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    return jnp.pad(rows, ((0, 0), (0, group_padded - group)), constant_values=MASK_VALUE)


def work_items(
    query_start_loc: jax.Array,  # [S + 1]
    num_tokens: int,
    tokens_per_block: int,
) -> tuple[jax.Array, jax.Array]:  # work_seq [W], work_qblock [W]
    """(sequence, query block) of each work item, -1 past the real list. Jittable."""
    num_seqs = query_start_loc.shape[0] - 1
    num_work = num_tokens // tokens_per_block + min(num_seqs, num_tokens)
    q_lens = jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0)
    blocks = (q_lens + tokens_per_block - 1) // tokens_per_block
    blocks_end = jnp.cumsum(blocks)
    w = jnp.arange(num_work, dtype=jnp.int32)
    seq = jnp.searchsorted(blocks_end, w, side="right").astype(jnp.int32)
    in_list = seq < num_seqs
    seq_clamped = jnp.minimum(seq, num_seqs - 1)
    q_block = w - (blocks_end[seq_clamped] - blocks[seq_clamped])
    return jnp.where(in_list, seq, -1), jnp.where(in_list, q_block, 0).astype(jnp.int32)


def group_rows(q: jax.Array, num_kv_heads: int, group_padded: int, dtype: jnp.dtype) -> jax.Array:
    """q [T, Hq, D] -> [Hkv, T * Gp, D]: each KV head's query rows, (token, head) token-major,
    with the group zero-padded to Gp heads."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(dtype)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_padded - group), (0, 0)))
    return qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_tokens * group_padded, head_dim)


def ungroup_rows(rows: jax.Array, num_tokens: int, group: int, group_padded: int) -> jax.Array:
    """The inverse of `group_rows`: [Hkv, >= T * Gp, D] -> [T, Hkv * group, D]."""
    num_kv_heads, _, head_dim = rows.shape
    out = rows[:, : num_tokens * group_padded].reshape(
        num_kv_heads, num_tokens, group_padded, head_dim
    )
    out = out[:, :, :group].transpose(1, 0, 2, 3)
    return out.reshape(num_tokens, num_kv_heads * group, head_dim)


@functools.partial(jax.jit, static_argnames=pallas_common.KERNEL_STATIC_ARGS)
def ragged_paged_attention_kernel(
    q: jax.Array,  # [T, Hq, D]
    k_pool: jax.Array,  # [L, Hkv, N, block_size, D]
    v_pool: jax.Array,  # [L, Hkv, N, block_size, D]
    layer: jax.Array,  # [] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    seq_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, B] int32
    window: jax.Array,  # [] int32, 0 = unlimited (read only if use_window)
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    sinks: jax.Array | None = None,  # [Hq] float32 sink logits (gpt-oss)
    *,
    scale: float,
    soft_cap: float | None,
    use_window: bool,
    interpret: bool,
    software_fp8: bool = False,  # fp8 pools: upcast with integer ops (GPUs before sm_89)
    config: RaggedConfig = RaggedConfig(),
) -> jax.Array:  # [T, Hq, D] in q's dtype; rows of padding tokens are 0
    """Causal attention of each of the T new tokens over its sequence's paged context."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    group_padded, rows, kv_tile, num_warps = ragged_tiling(
        k_pool.dtype, head_dim, block_size, group, config, software_fp8
    )
    tokens_per_block = rows // group_padded
    work_seq, work_qblock = work_items(query_start_loc, num_tokens, tokens_per_block)
    # Rows are padded by one block so a block's load/store window never leaves the array.
    q_rows = group_rows(q, num_kv_heads, group_padded, pallas_common.matmul_dtype(k_pool.dtype))
    q_rows = jnp.pad(q_rows, ((0, 0), (0, rows), (0, 0)))
    head_rows = pl.BlockSpec((None, q_rows.shape[1], head_dim), lambda w, h: (h, 0, 0))
    metadata = (
        *pallas_common.int32_scalars(layer, window),
        pallas_common.layer_scales(scale, k_scale, v_scale, num_layers, num_kv_heads),
        work_seq,
        work_qblock,
        query_start_loc.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        pad_block_tables(block_tables.astype(jnp.int32), kv_tile // block_size),
        _sink_rows(sinks, num_kv_heads, group, group_padded),
    )
    kernel = functools.partial(
        _ragged_kernel,
        group_padded=group_padded,
        tokens_per_block=tokens_per_block,
        loop=pallas_common.TileLoop(kv_tile, soft_cap, software_fp8, config.num_stages),
        use_window=use_window,
        use_sinks=sinks is not None,
    )
    out_rows = pallas_common.launch(
        kernel,
        metadata,
        q_rows,
        head_rows,
        k_pool,
        v_pool,
        layer=layer,
        grid=(work_seq.shape[0], num_kv_heads),
        out_specs=head_rows,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        num_warps=num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        name="ragged_paged_attention",
    )
    out = ungroup_rows(out_rows, num_tokens, group, group_padded)
    # Rows no work item wrote (padding tokens) are uninitialised memory: zero them.
    real = jnp.arange(num_tokens) < query_start_loc[-1]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)


__all__ = [
    "RaggedConfig",
    "default_tiling",
    "group_rows",
    "ragged_paged_attention_kernel",
    "ragged_tiling",
    "ungroup_rows",
    "work_items",
]
