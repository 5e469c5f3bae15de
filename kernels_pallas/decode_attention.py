"""Decode attention with split-K (flash-decoding) as a Pallas kernel (Triton lowering).

For a batch where every sequence has at most one new token, the ragged kernel's parallelism is
(sequences x KV heads) programs, each streaming its whole context: with few long sequences most
SMs idle. Here each sequence's KV tiles are split across `num_splits` programs; each writes an
unnormalised partial (acc [M, D], running max m [M], running sum l [M]) in float32 and a small
jnp epilogue merges the splits. `num_splits` (static, from occupancy) only bounds the grid:
each sequence's OWN visible tiles are cut at run time into at most that many whole-tile pieces
of at least `min_tokens_per_split` positions, so a short sequence uses fewer splits (its other
programs exit at once with a neutral partial) and a long one all of them.

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
    num_splits: int | None = None  # None: choose_num_splits (the grid's bound; see the kernel)
    # A sequence's context is split into pieces of at least this many positions (whole tiles).
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT
    num_warps: int | None = None  # None: 4, or 8 for head_dim 256 (float32: 128)
    num_stages: int = 2
    # In a mixed (prefill + decode) step, the first this many decode rows long enough to split
    # (2 x min_tokens_per_split) run here instead of in the ragged kernel, which streams a
    # row's whole context in one program; 0: none. Static: the grid's rows.
    mixed_long_rows: int = 8


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
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    num_sms: int | None = None,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
) -> int:
    """The grid's static split dimension: programs = S x Hkv x splits fill about two waves of
    SMs, and the longest possible context (max_context = block-table width x page size) is
    not cut into pieces shorter than min_tokens_per_split. An upper bound: the kernel splits
    each sequence's actual length into at most this many pieces (`split_tiles`)."""
    num_sms = num_sms or device_sm_count()
    base_programs = max(num_seqs * num_kv_heads, 1)
    wanted = -(-2 * num_sms // base_programs)
    by_length = max(max_context // min_tokens_per_split, 1)
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
    min_split_tiles: int,
    use_window: bool,
):
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, kv_tile = q_ref.shape[0], loop.kv_tile
    layer = layer_ref[0]
    seq_len = seq_lens_ref[seq]
    query_pos = seq_len - 1
    window = window_ref[0]

    start, stop = query_split(
        seq_len, window if use_window else None, split, kv_tile, num_splits, min_split_tiles
    )

    def key_visible(key_pos):  # [KT] -> [KT]: the keys of the one query
        seen = key_pos < seq_len
        if use_window:
            seen &= (window <= 0) | (key_pos > query_pos - window)
        return seen

    def visible(key_pos):  # [KT] -> [M, KT]: every row is the same query
        return jnp.broadcast_to(key_visible(key_pos)[None, :], (rows, kv_tile))

    @pl.when(start >= stop)  # a padding sequence, or a split past this sequence's pieces
    def _neutral_partial():  # m = -inf, l = 0: the merge gives it weight 0
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    @pl.when(start < stop)
    def _attend():
        q, scale = q_ref[...], scales_ref[0, layer, head]
        tiles = (start, stop)
        acc, m, denom = pallas_common.attend_kv_tiles(
            loop, q, k_ref, v_ref, block_tables_ref, seq, layer, tiles, visible, key_visible, scale
        )
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = denom


def query_split(
    seq_len: jax.Array,  # [] int32: the one query sits at seq_len - 1
    window: jax.Array | None,  # [] int32, 0 = unlimited; None: no window
    split: jax.Array,  # [] int32: this program's split
    kv_tile: int,
    num_splits: int,
    min_split_tiles: int,
) -> tuple[jax.Array, jax.Array]:  # [start, stop) tiles; start >= stop: nothing to do
    """The KV tiles program `split` reads of a decode row: the tiles its query sees (from its
    window's first), cut by `split_tiles`."""
    tile_lo = jnp.int32(0)
    if window is not None:
        tile_lo = lax.div(jnp.where(window > 0, jnp.maximum(seq_len - window, 0), 0), kv_tile)
    tile_hi = lax.div(seq_len + kv_tile - 1, kv_tile)
    return split_tiles(tile_lo, tile_hi, split, num_splits, min_split_tiles)


def split_tiles(
    tile_lo: jax.Array,  # [] int32: the first tile the query sees
    tile_hi: jax.Array,  # [] int32: one past its last
    split: jax.Array,  # [] int32: this program's split, 0 <= split < num_splits
    num_splits: int,
    min_split_tiles: int,
) -> tuple[jax.Array, jax.Array]:  # [start, stop) tiles; start >= stop: nothing to do
    """The KV tiles program `split` reads of one sequence: its visible tiles cut into
    used = clip(tiles // min_split_tiles, 1, num_splits) pieces balanced to within a tile, so
    each piece has at least min_split_tiles tiles (or is the whole context), and splits >= used
    are empty. A short sequence uses fewer splits than the grid has."""
    num_tiles = tile_hi - tile_lo
    used = jnp.clip(lax.div(num_tiles, min_split_tiles), 1, num_splits)
    start = tile_lo + lax.div(split * num_tiles, used)
    stop = jnp.minimum(tile_lo + lax.div((split + 1) * num_tiles, used), tile_hi)
    return start, stop


def merge_splits(
    acc: jax.Array,  # [..., splits, M, D] float32
    m: jax.Array,  # [..., splits, M]
    denom: jax.Array,  # [..., splits, M]
    sinks: jax.Array | None = None,  # [..., 1, M] each row's sink logit (gpt-oss)
) -> jax.Array:  # [..., M, D] float32, 0 where no split saw a key
    """The splits' unnormalised partials of each row merged into its normalised output; a
    sink joins as one more split that saw one key of its logit and no value."""
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks, (*m.shape[:-2], 1, m.shape[-1]))
        m = jnp.concatenate([m, sinks], axis=-2)
        denom = jnp.concatenate([denom, jnp.ones_like(sinks)], axis=-2)
        acc = jnp.concatenate([acc, jnp.zeros_like(acc[..., :1, :, :])], axis=-3)
    m_max = jnp.max(m, axis=-2, keepdims=True)
    # Empty splits have m = -inf, l = 0, acc = 0; where every split is empty (a padding
    # sequence) a finite m_max keeps exp(m - m_max) at 0 instead of NaN.
    m_max = jnp.where(m_max > -jnp.inf, m_max, 0.0)
    weight = jnp.exp(m - m_max)
    total = jnp.sum(denom * weight, axis=-2)
    out = jnp.sum(acc * weight[..., None], axis=-3)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def decode_tiling(
    kv_dtype: jnp.dtype, head_dim: int, block_size: int, config: DecodeConfig
) -> tuple[int, int]:
    """(KV tile tokens KT, num_warps): `config` over the defaults."""
    default_kv_tile = 32 if pallas_common.matmul_dtype(kv_dtype) == jnp.float32 else 64
    kv_tile = pallas_common.kv_tile_tokens(config.kv_tile_tokens or default_kv_tile, block_size)
    # float32 tiles at head_dim 128 spill registers on 4 warps (benchmarks/README.md).
    wide = head_dim >= 256 or (head_dim >= 128 and default_kv_tile == 32)
    return kv_tile, config.num_warps or (8 if wide else 4)


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
    sinks: jax.Array | None = None,  # [Hq] float32 sink logits (gpt-oss)
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
    max_context = block_tables.shape[1] * block_size
    num_splits = config.num_splits or choose_num_splits(
        num_seqs, num_kv_heads, max_context, min_tokens_per_split=config.min_tokens_per_split
    )
    min_split_tiles = max(-(-config.min_tokens_per_split // kv_tile), 1)

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
        min_split_tiles=min_split_tiles,
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
        layer=layer,
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
    return finish_splits(acc, m, denom, sinks, scales[1][layer], q)


def finish_splits(
    acc: jax.Array,  # [S, Hkv, splits, M, D] float32: each split's unnormalised partial
    m: jax.Array,  # [S, Hkv, splits, M]
    denom: jax.Array,  # [S, Hkv, splits, M]
    sinks: jax.Array | None,  # [Hq] float32 sink logits (gpt-oss)
    v_scales: jax.Array,  # [Hkv] the V pool's dequantisation scale
    q: jax.Array,  # [S, Hq, D]: the result's shape and dtype
) -> jax.Array:  # [S, Hq, D]
    """A split-K kernel's partials merged into each query head's output: the M rows of a KV
    head are its G query heads, then padding."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, rows = m.shape[1], m.shape[3]
    group = num_q_heads // num_kv_heads
    if sinks is not None:  # [Hq] -> [1, Hkv, 1, M], the padded rows' 0 unread
        sinks = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, group),
                        ((0, 0), (0, rows - group)))[None, :, None, :]  # fmt: skip
    out = merge_splits(acc, m, denom, sinks)  # [S, Hkv, M, D]
    out = out[:, :, :group] * v_scales[None, :, None, None]
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
