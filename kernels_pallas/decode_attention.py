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
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.ragged_paged_attention import (
    MASK_VALUE,
    fold_kv_tiles,
    kv_tile_tokens,
    layer_scales,
    load_kv_tile,
    matmul_dtype,
    next_power_of_2,
    online_softmax_step,
    pad_block_tables,
    tile_pages,
)

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
    # whose FMA dots hold their operands in registers (64 spills at head_dim 128 on sm_90).
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
    into pieces shorter than MIN_TOKENS_PER_SPLIT.

    H200 (132 SMs), Hkv 8: 1 x 32k -> 33, 16 x 4k -> 3, 64 x 2k -> 1, 256 x 1k -> 1."""
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
    kv_tile: int,
    num_splits: int,
    soft_cap: float | None,
    use_window: bool,
    software_fp8: bool,
    prefetch_pages: bool,
):
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, head_dim = q_ref.shape
    block_size = k_ref.shape[2]
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

    q = q_ref[...]
    scale = scales_ref[0, layer, head]
    tile_iota = lax.broadcasted_iota(jnp.int32, (kv_tile,), 0)

    pages_of = functools.partial(
        tile_pages, block_tables_ref, seq, kv_tile=kv_tile, block_size=block_size
    )

    def step(tile, pages, softmax_state):
        key_pos = tile * kv_tile + tile_iota  # [KT]
        offsets = lax.rem(key_pos, block_size)
        k = load_kv_tile(k_ref, layer, pages, offsets, q.dtype, software_fp8)
        v = load_kv_tile(v_ref, layer, pages, offsets, q.dtype, software_fp8)
        key_visible = key_pos < seq_len
        if use_window:
            key_visible &= (window <= 0) | (key_pos > query_pos - window)
        visible = jnp.broadcast_to(key_visible[None, :], (rows, kv_tile))
        return online_softmax_step(q, k, v, visible, softmax_state, scale=scale, soft_cap=soft_cap)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    # Zero-trip for padding sequences (seq_len 0) and for splits past a short sequence's tiles.
    acc, m, denom = fold_kv_tiles(start, stop, step, init, pages_of, prefetch_pages=prefetch_pages)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = denom


def merge_splits(
    acc: jax.Array,  # [..., splits, M, D] float32
    m: jax.Array,  # [..., splits, M]
    denom: jax.Array,  # [..., splits, M]
) -> jax.Array:  # [..., M, D] float32, 0 where no split saw a key
    m_max = jnp.max(m, axis=-2, keepdims=True)
    weight = jnp.exp(m - m_max)  # empty splits: m = MASK_VALUE, weight 0 (or 1 with l = 0)
    total = jnp.sum(denom * weight, axis=-2)
    out = jnp.sum(acc * weight[..., None], axis=-3)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


@functools.partial(
    jax.jit,
    static_argnames=("scale", "soft_cap", "use_window", "interpret", "software_fp8", "config"),
)
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
    num_seqs, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_blocks, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    rows = max(next_power_of_2(group), 16)
    matmul = matmul_dtype(k_pool.dtype)
    kv_tile = kv_tile_tokens(
        config.kv_tile_tokens or (32 if matmul == jnp.float32 else 64), block_size
    )
    num_splits = config.num_splits or choose_num_splits(
        num_seqs, num_kv_heads, block_tables.shape[1] * block_size
    )

    q_rows = q.reshape(num_seqs, num_kv_heads, group, head_dim).astype(matmul)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    tables = pad_block_tables(block_tables.astype(jnp.int32), kv_tile // block_size)
    scales = layer_scales(scale, k_scale, v_scale, num_layers, num_kv_heads)

    kernel = functools.partial(
        _decode_kernel,
        kv_tile=kv_tile,
        num_splits=num_splits,
        soft_cap=soft_cap,
        use_window=use_window,
        software_fp8=software_fp8,
        prefetch_pages=config.num_stages >= 3,
    )
    whole = pl.no_block_spec
    head_pool = pl.BlockSpec(
        (num_layers, None, num_blocks, block_size, head_dim), lambda s, h, p: (0, h, 0, 0, 0)
    )
    partial_shape = (num_seqs, num_kv_heads, num_splits, rows)
    num_warps = config.num_warps or (8 if head_dim >= 256 else 4)
    acc, m, denom = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[whole] * 5
        + [
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, p: (s, h, 0, 0)),
            head_pool,
            head_pool,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, p: (s, h, p, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, p: (s, h, p, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, p: (s, h, p, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="decode_attention_split_k",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        jnp.reshape(window, (1,)).astype(jnp.int32),
        scales,
        seq_lens.astype(jnp.int32),
        tables,
        q_rows,
        k_pool,
        v_pool,
    )
    out = merge_splits(acc, m, denom)  # [S, Hkv, M, D]
    v_scales = scales[1][layer]  # [Hkv]
    out = out[:, :, :group] * v_scales[None, :, None, None]
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
