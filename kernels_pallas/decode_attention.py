"""Decode attention with split-K (flash-decoding) as a Pallas kernel (Triton lowering).

For a batch where every sequence has at most one new token, the ragged kernel's parallelism is
(sequences x KV heads) programs, each streaming its whole context: with few long sequences most
SMs idle. Here each sequence's KV tiles are split across `num_splits` programs; each writes an
unnormalised partial (acc [M, D], running max m [M], running sum l [M]) in float32 and a small
jnp epilogue merges the splits. The split of a sequence is balanced over ITS OWN visible tiles
(dynamic), so short sequences in the batch do not get empty splits and long ones full ones.

Grid: (S, Hkv, num_splits). A program's M rows are the G query heads of its KV head padded to
max(16, Gp) (16 is Triton's minimum dot size; decode is bound by KV bandwidth, so the padded
rows cost tensor-core cycles that are free anyway).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import pallas_common
from kernels_pallas.metadata import next_power_of_2, pad_block_tables

# SMs per device kind, for when the device object does not report core_count.
_SM_COUNTS = {"H200": 132, "H100": 132, "H800": 132, "GH200": 132, "A100": 108, "L40S": 142}
DEFAULT_SM_COUNT = 132
# A split below this many KV positions spends more on its partial write + merge than it saves.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static tiling of the split-K decode kernel (hashable: a jit static argument)."""

    # KT, rounded up to whole pages, power of two, >= 16. None: 64, or 32 for float32 pools,
    # whose FMA dots hold their operands in registers, where 64-token tiles spill.
    kv_tile_tokens: int | None = None
    num_splits: int | None = None  # None: choose_num_splits
    num_warps: int | None = None  # None: 4, or 8 for head_dim 256
    num_stages: int = 2


def device_sm_count(device: jax.Device | None = None) -> int:
    """Streaming multiprocessors of `device` (default: the first device); a table by device
    kind when the runtime does not report it, and H100/H200's 132 when the kind is unknown
    (or when tracing on a CPU-only host for a GPU target)."""
    device = device or jax.devices()[0]
    count = getattr(device, "core_count", None)
    if device.platform == "gpu" and isinstance(count, int) and count > 0:
        return count
    kind = getattr(device, "device_kind", "")
    for name, sms in _SM_COUNTS.items():
        if name in kind:
            return sms
    return DEFAULT_SM_COUNT


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int | None = None
) -> int:
    """Splits per sequence so that programs = S x Hkv x splits fill about two waves of SMs,
    never splitting the longest possible context (max_context = block-table width x page size)
    into pieces shorter than MIN_TOKENS_PER_SPLIT."""
    num_sms = num_sms or device_sm_count()
    base_programs = max(num_seqs * num_kv_heads, 1)
    wanted = -(-2 * num_sms // base_programs)
    by_length = max(max_context // MIN_TOKENS_PER_SPLIT, 1)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def _decode_kernel(
    layer_ref,  # [1] int32
    window_ref,  # [1] int32, 0 = unlimited
    scales_ref,  # [2, L, Hkv] float32
    seq_lens_ref,  # [S] int32, 0 for sequences without a new token
    block_tables_ref,  # [S, B'] int32
    q_ref,  # [M, D] this (sequence, KV head)'s query rows
    k_ref,  # [L, N, block_size, D]
    v_ref,  # [L, N, block_size, D]
    acc_ref,  # [M, D] float32 partial output
    m_ref,  # [M] float32 partial max
    l_ref,  # [M] float32 partial sum
    *,
    loop: pallas_common.TileLoop,
    num_splits: int,
    use_window: bool,
):
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, kv_tile = q_ref.shape[0], loop.kv_tile
    layer = layer_ref[0]
    seq_len = seq_lens_ref[seq]
    query_pos = seq_len - 1
    window = window_ref[0]

    tile_lo = jnp.int32(0)
    if use_window:
        tile_lo = lax.div(jnp.where(window > 0, jnp.maximum(seq_len - window, 0), 0), kv_tile)
    tile_hi = lax.div(seq_len + kv_tile - 1, kv_tile)
    per_split = lax.div(tile_hi - tile_lo + num_splits - 1, num_splits)
    start = tile_lo + split * per_split
    stop = jnp.minimum(start + per_split, tile_hi)

    def visible(key_pos):  # [KT] -> [M, KT]: every row is the same query
        key_visible = key_pos < seq_len
        if use_window:
            key_visible &= (window <= 0) | (key_pos > query_pos - window)
        return jnp.broadcast_to(key_visible[None, :], (rows, kv_tile))

    # Zero-trip for padding sequences (seq_len 0) and for splits past a short sequence's tiles.
    q, scale = q_ref[...], scales_ref[0, layer, head]
    acc, m, denom = pallas_common.attend_kv_tiles(
        loop, q, k_ref, v_ref, block_tables_ref, seq, layer, (start, stop), visible, scale
    )
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = denom


def merge_splits(
    acc: jax.Array,  # [..., splits, M, D] float32
    m: jax.Array,  # [..., splits, M]
    denom: jax.Array,  # [..., splits, M]
) -> jax.Array:  # [..., M, D] float32, 0 where no split saw a key
    """The splits' unnormalised partials of each row merged into its normalised output."""
    m_max = jnp.max(m, axis=-2, keepdims=True)
    weight = jnp.exp(m - m_max)  # empty splits: m = MASK_VALUE, weight 0 (or 1 with l = 0)
    total = jnp.sum(denom * weight, axis=-2)
    out = jnp.sum(acc * weight[..., None], axis=-3)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def decode_tiling(
    kv_dtype: jnp.dtype, head_dim: int, block_size: int, config: DecodeConfig
) -> tuple[int, int]:
    """(KV tile tokens KT, num_warps): `config` over the defaults."""
    default_kv_tile = 32 if pallas_common.matmul_dtype(kv_dtype) == jnp.float32 else 64
    kv_tile = pallas_common.kv_tile_tokens(config.kv_tile_tokens or default_kv_tile, block_size)
    return kv_tile, config.num_warps or (8 if head_dim >= 256 else 4)


@functools.partial(jax.jit, static_argnames=pallas_common.KERNEL_STATIC_ARGS)
def decode_attention_kernel(
    q: jax.Array,  # [S, Hq, D], one query per sequence
    k_pool: jax.Array,  # [L, Hkv, N, block_size, D]
    v_pool: jax.Array,  # [L, Hkv, N, block_size, D]
    layer: jax.Array,  # [] int32
    seq_lens: jax.Array,  # [S] int32, 0 = no query (padding)
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
    config: DecodeConfig = DecodeConfig(),
) -> jax.Array:  # [S, Hq, D] in q's dtype; 0 for seq_len 0
    """Attention of each sequence's one new token (its last position) over its paged context."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    rows = max(next_power_of_2(group), 16)
    kv_tile, num_warps = decode_tiling(k_pool.dtype, head_dim, block_size, config)
    num_splits = config.num_splits or choose_num_splits(
        num_seqs, num_kv_heads, block_tables.shape[1] * block_size
    )

    matmul = pallas_common.matmul_dtype(k_pool.dtype)
    q_rows = q.reshape(num_seqs, num_kv_heads, group, head_dim).astype(matmul)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    scales = pallas_common.layer_scales(scale, k_scale, v_scale, num_layers, num_kv_heads)
    metadata = (
        *pallas_common.int32_scalars(layer, window),
        scales,
        seq_lens.astype(jnp.int32),
        pad_block_tables(block_tables.astype(jnp.int32), kv_tile // block_size),
    )
    kernel = functools.partial(
        _decode_kernel,
        loop=pallas_common.TileLoop(kv_tile, soft_cap, software_fp8, config.num_stages),
        num_splits=num_splits,
        use_window=use_window,
    )
    partial_shape = (num_seqs, num_kv_heads, num_splits, rows)
    partial_stats = pl.BlockSpec((None, None, None, rows), lambda s, h, p: (s, h, p, 0))
    acc, m, denom = pallas_common.launch(
        kernel,
        metadata,
        q_rows,
        pl.BlockSpec((None, None, rows, head_dim), lambda s, h, p: (s, h, 0, 0)),
        k_pool,
        v_pool,
        grid=(num_seqs, num_kv_heads, num_splits),
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, p: (s, h, p, 0, 0)),
            partial_stats,
            partial_stats,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        num_warps=num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        name="decode_attention_split_k",
    )
    out = merge_splits(acc, m, denom)  # [S, Hkv, M, D]
    v_scales = scales[1][layer]  # [Hkv]
    out = out[:, :, :group] * v_scales[None, :, None, None]
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
