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

from kernels_pallas.kv_cache import NULL_BLOCK

# Finite (not -inf) so that exp(m_prev - m_new) never sees inf - inf.
MASK_VALUE = -1e30

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Static tiling of the ragged kernel (hashable: it is a jit static argument). A field left
    None takes its value from `default_tiling` for the pool's dtype and head_dim."""

    rows_per_program: int | None = None  # M = BQ * Gp query rows per program (power of two)
    kv_tile_tokens: int | None = None  # KT, rounded up to whole pages (power of two, >= 16)
    num_warps: int | None = None
    num_stages: int = 2


# (rows_per_program, kv_tile_tokens, num_warps) by head_dim: the largest tiles that compile
# without spilling registers for sm_80 and sm_90 with Triton 3.6 to 3.9 (checked by
# tests/test_triton_compile.py).
# Tensor-core dots (16-bit and fp8 pools) keep their operands in shared memory; float32 pools
# run IEEE float32 dots as FMAs on operands held in registers, where 64 x 64 tiles spill
# (0.5 KB per thread at head_dim 64, 7-10 KB at 128 and 256); the integer fp8 upcast of GPUs
# before sm_89 needs registers of its own (64-token tiles spill 0.1 KB at head_dim 64).
TENSOR_CORE_TILING = {64: (64, 64, 4), 128: (64, 64, 4), 256: (64, 32, 8)}
FLOAT32_TILING = {64: (64, 32, 8), 128: (32, 16, 4), 256: (32, 16, 8)}
SOFTWARE_FP8_TILING = {64: (64, 32, 4), 128: (64, 32, 8), 256: (64, 32, 8)}


def default_tiling(
    kv_dtype: jnp.dtype, head_dim: int, software_fp8: bool = False
) -> tuple[int, int, int]:
    """(rows_per_program, kv_tile_tokens, num_warps) for a pool of `kv_dtype`."""
    if matmul_dtype(kv_dtype) == jnp.float32:
        table = FLOAT32_TILING
    elif software_fp8 and jnp.dtype(kv_dtype).itemsize == 1:
        table = SOFTWARE_FP8_TILING
    else:
        table = TENSOR_CORE_TILING
    return table[min(max(head_dim, 64), 256)]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def matmul_dtype(kv_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype the tensor-core dots run in for a pool of `kv_dtype`."""
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype == jnp.float32:
        return jnp.dtype(jnp.float32)
    if kv_dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return kv_dtype
    if kv_dtype in tuple(jnp.dtype(d) for d in FP8_DTYPES):
        return jnp.dtype(jnp.bfloat16)
    raise ValueError(f"unsupported KV pool dtype {kv_dtype}")


def kv_tile_tokens(requested: int, block_size: int) -> int:
    """Tokens per KV tile: whole pages, a power of two, >= 16 (Triton's minimum dot size)."""
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for the Pallas kernels: {block_size}")
    return max(next_power_of_2(requested), block_size, 16)


def pad_block_tables(block_tables: jax.Array, tile_pages: int) -> jax.Array:
    """[S, B] -> [S, B'] with B' a multiple of `tile_pages`, padded with NULL_BLOCK, so a
    kernel's last tile never reads past the table (a GPU load would fault; interpret clamps)."""
    width = block_tables.shape[1]
    padded = -(-width // tile_pages) * tile_pages
    if padded == width:
        return block_tables
    return jnp.pad(block_tables, ((0, 0), (0, padded - width)), constant_values=NULL_BLOCK)


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b[N, K].T -> [M, N] float32; IEEE float32 when the operands are float32."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] -> [M, N] float32."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def tile_pages(
    block_tables_ref,  # [S, B'] int32, B' a whole number of tiles
    seq: jax.Array,  # [] int32
    tile: jax.Array,  # [] int32, a tile of the table
    *,
    kv_tile: int,
    block_size: int,
) -> jax.Array:  # [KT] int32
    """The physical page of each position of KV tile `tile` of sequence `seq`."""
    key_pos = tile * kv_tile + lax.broadcasted_iota(jnp.int32, (kv_tile,), 0)
    return block_tables_ref[seq, lax.div(key_pos, block_size)]


def fold_kv_tiles(start, stop, step, init, pages_of, *, prefetch_pages: bool):
    """`lax.fori_loop` over KV tiles [start, stop): state = step(tile, pages [KT], state).

    prefetch_pages: load tile t + 1's page ids while tile t is consumed and carry them, so the
    KV loads' addresses come from the previous iteration. Only then can Triton's pipeliner
    issue the loads num_stages - 1 tiles ahead (with the table read in the same iteration it
    keeps one buffer and nothing is in flight during the dots). It costs a [KT] int32 vector
    of registers, so it is on only where it pays: num_stages >= 3. `stop` must not pass the
    table's last tile; reads ahead are clamped to [0, stop)."""
    if not prefetch_pages:
        return lax.fori_loop(start, stop, lambda t, state: step(t, pages_of(t), state), init)

    def prefetch(tile):
        return pages_of(jnp.maximum(jnp.minimum(tile, stop - 1), 0))

    def body(tile, carry):
        pages, state = carry
        return prefetch(tile + 1), step(tile, pages, state)

    return lax.fori_loop(start, stop, body, (prefetch(start), init))[1]


def load_kv_tile(
    pool_ref,  # [L, N, block_size, D] (this program's KV head)
    layer: jax.Array,  # [] int32
    pages: jax.Array,  # [KT] int32, physical page of each position in the tile
    offsets: jax.Array,  # [KT] int32, offset of each position inside its page
    out_dtype: jnp.dtype,
    software_fp8: bool = False,
) -> jax.Array:  # [KT, D]
    """Gathers one KV tile through the block table; all-array indices keep it one gather in
    both the Triton lowering and interpret mode (which cannot mix gathers with slices)."""
    head_dim = pool_ref.shape[-1]
    d = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    tile = pool_ref[layer, pages[:, None], offsets[:, None], d]
    if software_fp8 and tile.dtype in FP8_DTYPES:
        tile = fp8_to_float32(tile)
    return tile.astype(out_dtype)


def fp8_to_float32(x: jax.Array) -> jax.Array:
    """Exact fp8 (e4m3fn or e5m2) -> float32 with integer ops only: for GPUs without fp8
    conversion instructions (compute capability < 8.9), where Triton cannot compile the cast."""
    info = jnp.finfo(x.dtype)
    mantissa_bits, exponent_bits = info.nmant, info.nexp
    bias = (1 << (exponent_bits - 1)) - 1
    bits = lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    sign = (bits >> 7) << 31
    exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = bits & ((1 << mantissa_bits) - 1)
    normal = ((exponent + (127 - bias)) << 23) | (mantissa << (23 - mantissa_bits))
    # Subnormals (and zero) are mantissa * 2^(1 - bias - mantissa_bits), exact in float32.
    tiny = mantissa.astype(jnp.float32) * (2.0 ** (1 - bias - mantissa_bits))
    magnitude = jnp.where(exponent == 0, lax.bitcast_convert_type(tiny, jnp.uint32), normal)
    if x.dtype == jnp.float8_e4m3fn:  # no infinities; S.1111.111 is NaN
        special = (bits & 0x7F) == 0x7F
        magnitude = jnp.where(special, jnp.uint32(0x7FC00000), magnitude)
    else:  # IEEE-like: the top exponent is inf (mantissa 0) or NaN
        top = exponent == (1 << exponent_bits) - 1
        magnitude = jnp.where(top, jnp.uint32(0x7F800000) | (mantissa << 21), magnitude)
    return lax.bitcast_convert_type(sign | magnitude, jnp.float32)


def online_softmax_step(
    q: jax.Array,  # [M, D] matmul dtype
    k: jax.Array,  # [KT, D] matmul dtype
    v: jax.Array,  # [KT, D] matmul dtype
    visible: jax.Array,  # [M, KT] bool
    carry: tuple[jax.Array, jax.Array, jax.Array],  # acc [M, D], m [M], l [M], float32
    *,
    scale: jax.Array | float,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    acc, m_prev, l_prev = carry
    s = dot_nt(q, k) * scale  # [M, KT] float32
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    correction = jnp.exp(m_prev - m_new)
    # Masked scores contribute exactly 0, even in a tile where a row sees nothing yet.
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = l_prev * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + dot_nn(p.astype(v.dtype), v)
    return acc, m_new, l_new


def _ragged_kernel(
    layer_ref,  # [1] int32
    window_ref,  # [1] int32, 0 = unlimited
    scales_ref,  # [2, L, Hkv] float32: softmax scale x K dequant scale; V dequant scale
    work_seq_ref,  # [W] int32, sequence of each work item, -1 = no work
    work_qblock_ref,  # [W] int32, query block of the item within its sequence
    query_start_ref,  # [S + 1] int32
    seq_lens_ref,  # [S] int32
    block_tables_ref,  # [S, B'] int32
    q_ref,  # [R, D] rows (token, head) of this KV head's group, R = T * Gp + M
    k_ref,  # [L, N, block_size, D] this KV head's pool
    v_ref,  # [L, N, block_size, D]
    o_ref,  # [R, D]
    *,
    group_padded: int,
    tokens_per_block: int,
    kv_tile: int,
    soft_cap: float | None,
    use_window: bool,
    software_fp8: bool,
    prefetch_pages: bool,
):
    work, head = pl.program_id(0), pl.program_id(1)
    seq = work_seq_ref[work]

    @pl.when(seq >= 0)
    def _():
        rows, head_dim = tokens_per_block * group_padded, q_ref.shape[-1]
        block_size = k_ref.shape[2]
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
        tile_start = jnp.int32(0)
        window = window_ref[0]
        if use_window:
            kv_start = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
            tile_start = lax.div(kv_start, kv_tile)
        num_tiles = lax.div(kv_end + kv_tile - 1, kv_tile)

        matmul = q_ref.dtype
        q = q_ref[pl.ds(first_token * group_padded, rows), :]  # [M, D]
        scale = scales_ref[0, layer, head]
        tile_iota = lax.broadcasted_iota(jnp.int32, (kv_tile,), 0)
        pages_of = functools.partial(
            tile_pages, block_tables_ref, seq, kv_tile=kv_tile, block_size=block_size
        )

        def step(tile, pages, softmax_state):
            key_pos = tile * kv_tile + tile_iota  # [KT]
            offsets = lax.rem(key_pos, block_size)
            k = load_kv_tile(k_ref, layer, pages, offsets, matmul, software_fp8)
            v = load_kv_tile(v_ref, layer, pages, offsets, matmul, software_fp8)
            visible = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < seq_len)
            if use_window:
                visible &= (window <= 0) | (key_pos[None, :] > row_pos[:, None] - window)
            return online_softmax_step(
                q, k, v, visible, softmax_state, scale=scale, soft_cap=soft_cap
            )

        init = (
            jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )
        acc, _, denom = fold_kv_tiles(
            tile_start, num_tiles, step, init, pages_of, prefetch_pages=prefetch_pages
        )
        v_scale = scales_ref[1, layer, head]
        out = acc * (v_scale / jnp.where(denom > 0, denom, 1.0))[:, None]
        row_valid = jnp.broadcast_to((row_token < block_tokens)[:, None], (rows, head_dim))
        plgpu.store(
            o_ref.at[pl.ds(first_token * group_padded, rows), :],
            out.astype(o_ref.dtype),
            mask=row_valid,
        )


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


def layer_scales(
    scale: float,
    k_scale: jax.Array | float | None,
    v_scale: jax.Array | float | None,
    num_layers: int,
    num_kv_heads: int,
) -> jax.Array:  # [2, L, Hkv] float32
    """Softmax scale x K dequant scale, and V dequant scale, per (layer, KV head).

    A scale may be None (1), a scalar (per tensor), [Hkv] (per head) or [L, Hkv]."""

    def expand(s):
        s = jnp.ones((), jnp.float32) if s is None else jnp.asarray(s, jnp.float32)
        if s.ndim == 1:
            s = s[None, :]
        return jnp.broadcast_to(s, (num_layers, num_kv_heads))

    return jnp.stack([expand(k_scale) * scale, expand(v_scale)])


def group_rows(q: jax.Array, num_kv_heads: int, group_padded: int, dtype) -> jax.Array:
    """q [T, Hq, D] -> [Hkv, T * Gp, D]: each KV head's query rows, (token, head) token-major,
    with the group zero-padded to Gp heads."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(dtype)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_padded - group), (0, 0)))
    return qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_tokens * group_padded, head_dim)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "soft_cap", "use_window", "interpret", "software_fp8", "config"),
)
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
    *,
    scale: float,
    soft_cap: float | None,
    use_window: bool,
    interpret: bool,
    software_fp8: bool = False,  # fp8 pools: upcast with integer ops (GPUs before sm_89)
    config: RaggedConfig = RaggedConfig(),
) -> jax.Array:  # [T, Hq, D] in q's dtype; rows of padding tokens are 0
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_blocks, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    group_padded = next_power_of_2(group)
    default_rows, default_kv_tile, default_warps = default_tiling(
        k_pool.dtype, head_dim, software_fp8
    )
    rows = max(next_power_of_2(config.rows_per_program or default_rows), group_padded, 16)
    tokens_per_block = rows // group_padded
    kv_tile = kv_tile_tokens(config.kv_tile_tokens or default_kv_tile, block_size)
    matmul = matmul_dtype(k_pool.dtype)

    work_seq, work_qblock = work_items(query_start_loc, num_tokens, tokens_per_block)
    num_work = work_seq.shape[0]
    # Rows are padded by one block so a block's load/store window never leaves the array.
    q_rows = group_rows(q, num_kv_heads, group_padded, matmul)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, rows), (0, 0)))
    total_rows = q_rows.shape[1]
    tables = pad_block_tables(block_tables.astype(jnp.int32), kv_tile // block_size)
    scales = layer_scales(scale, k_scale, v_scale, num_layers, num_kv_heads)

    kernel = functools.partial(
        _ragged_kernel,
        group_padded=group_padded,
        tokens_per_block=tokens_per_block,
        kv_tile=kv_tile,
        soft_cap=soft_cap,
        use_window=use_window,
        software_fp8=software_fp8,
        prefetch_pages=config.num_stages >= 3,
    )
    whole = pl.no_block_spec
    head_rows = pl.BlockSpec((None, total_rows, head_dim), lambda w, h: (h, 0, 0))
    head_pool = pl.BlockSpec(
        (num_layers, None, num_blocks, block_size, head_dim), lambda w, h: (0, h, 0, 0, 0)
    )
    num_warps = config.num_warps or default_warps
    out_rows = pl.pallas_call(
        kernel,
        grid=(num_work, num_kv_heads),
        in_specs=[whole] * 8 + [head_rows, head_pool, head_pool],
        out_specs=head_rows,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        # Triton explicitly: in jax 0.10 a GPU pallas_call without params goes to Mosaic GPU.
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        jnp.reshape(window, (1,)).astype(jnp.int32),
        scales,
        work_seq,
        work_qblock,
        query_start_loc.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        tables,
        q_rows,
        k_pool,
        v_pool,
    )
    out = out_rows[:, : num_tokens * group_padded].reshape(
        num_kv_heads, num_tokens, group_padded, head_dim
    )
    out = out[:, :, :group].transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    # Rows no work item wrote (padding tokens) are uninitialised memory: zero them.
    real = jnp.arange(num_tokens) < query_start_loc[-1]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)


__all__ = [
    "MASK_VALUE",
    "RaggedConfig",
    "default_tiling",
    "fold_kv_tiles",
    "fp8_to_float32",
    "group_rows",
    "kv_tile_tokens",
    "layer_scales",
    "matmul_dtype",
    "next_power_of_2",
    "pad_block_tables",
    "ragged_paged_attention_kernel",
    "tile_pages",
    "work_items",
]
