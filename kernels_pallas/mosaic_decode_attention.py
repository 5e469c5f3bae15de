"""Split-K decode attention on Mosaic GPU (Hopper): the Triton split-K kernel's successor.

The Pallas Triton lowering is deprecated in jax 0.11; this is the decode kernel of the move
`docs/kernels.md` plans. It keeps `decode_attention.py`'s contract and its split-K plan (the
grid's static split bound from occupancy, each sequence's own visible tiles cut at run time
by `split_tiles`, the partials merged by `merge_splits`), and differs in how a program moves
and multiplies its data:

- KV pages reach shared memory by TMA, one copy per page of the tile, or per 64-token part of
  a larger page (the block table read as scalars from global memory), into `num_stages`
  rotating buffers: the next tiles' copies are in flight while this one is multiplied.
- The dots are warpgroup MMAs (`wgmma`): a program's query rows (the G query heads of its KV
  head) are padded to wgmma's 64 rows, Q @ K^T accumulates [64, KT] in registers, and
  P @ V reads P from shared memory (written there as the pool's dtype).
- One warpgroup per program; the partial (acc, max, sum) is stored from registers.

Grid: (S, Hkv, num_splits). Pools of bfloat16 or float16 only (`supports_mosaic_decode`):
float32 would need tf32 dots (not the exact float32 of the Triton kernel's FMA dots) and fp8
a quantized query. The kernel is compiled on a GPU; elsewhere it runs in Mosaic GPU's
interpret mode (jax >= 0.11), which simulates its shared memory, barriers and TMA copies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import pallas_common
from kernels_pallas.backend import AttentionSpec, FunctionBackend
from kernels_pallas.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    finish_splits,
    query_split,
)
from kernels_pallas.metadata import next_power_of_2, pad_block_tables
from kernels_pallas.paged_attention import DEFAULT_DECODE_CONFIG, PALLAS, paged_attention
from kernels_pallas.pallas_common import in_place_num_blocks

ROWS = 64  # a warpgroup MMA's rows: the query heads of one KV head, padded
KV_DTYPES = ("bfloat16", "float16")
# The shared-memory layout wgmma reads fastest: a 128-byte swizzle, rows of 64 2-byte elements
# (Q, K, V and P all have minor dimensions that are multiples of 64).
SWIZZLED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# Bytes of shared memory a program may take: Hopper's 227 KiB per block, less the barriers'.
SMEM_BUDGET = 224 * 1024


def has_interpret_mode() -> bool:
    """Whether this jax runs Mosaic GPU kernels in interpret mode (jax >= 0.11)."""
    return hasattr(plgpu, "InterpretGPUParams")


def supports_mosaic_decode(
    num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str, block_size: int
) -> str | None:
    """None if the kernel runs these shapes, else why not."""
    if kv_dtype not in KV_DTYPES:
        return f"the Mosaic GPU decode kernel reads {' or '.join(KV_DTYPES)} pools, not {kv_dtype}"
    if num_q_heads // num_kv_heads > ROWS:
        return f"more than {ROWS} query heads per KV head"
    if head_dim % 64:  # rows of whole swizzle groups (SWIZZLED)
        return f"head_dim {head_dim} is not a multiple of 64"
    if head_dim > 256:  # a warpgroup MMA's widest N (P @ V's columns)
        return f"head_dim {head_dim} is over 256"
    if block_size % 8 or (block_size < 64 and 64 % block_size):
        return f"block_size {block_size}: pages must tile 64-token tiles in rows of 8"
    return None


def _smem_bytes(head_dim: int, kv_tile: int, num_stages: int) -> int:
    """Shared memory of one program: Q, the K and V buffers, and P (2-byte elements)."""
    return 2 * (ROWS * head_dim + 2 * num_stages * kv_tile * head_dim + ROWS * kv_tile)


def mosaic_tiling(head_dim: int, config: DecodeConfig) -> tuple[int, int]:
    """(KV tile tokens KT, buffers): `config`'s (KT a power of two >= 64, at least two
    buffers), made smaller until a program fits in shared memory: KT first, then buffers."""
    kv_tile = max(next_power_of_2(config.kv_tile_tokens or 64), 64)
    num_stages = max(config.num_stages, 2)
    while _smem_bytes(head_dim, kv_tile, num_stages) > SMEM_BUDGET and kv_tile > 64:
        kv_tile //= 2
    while _smem_bytes(head_dim, kv_tile, num_stages) > SMEM_BUDGET and num_stages > 2:
        num_stages -= 1
    return kv_tile, num_stages


def _mma(a_smem, b_smem, shape: tuple[int, int]) -> jax.Array:
    """a @ b [M, N] float32 by a warpgroup MMA from shared memory, read into registers."""

    def multiply(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem)
        return acc_ref[...]

    return pl.run_scoped(multiply, plgpu.ACC(shape, jnp.float32))


def _visible(
    first_key: jax.Array,  # [] int32: the tile's first position
    shape: tuple[int, int],  # [ROWS, KT]
    seq_len: jax.Array,  # [] int32: the query sits at seq_len - 1
    window: jax.Array | None,  # [] int32, 0 = unlimited; None: no window
) -> jax.Array:  # [ROWS, KT] bool, every row the same query's
    key_pos = first_key + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    visible = key_pos < seq_len
    if window is not None:
        visible &= (window <= 0) | (key_pos > seq_len - 1 - window)
    return visible


def _online_softmax(
    s: jax.Array,  # [ROWS, KT] float32 scaled scores
    visible: jax.Array,  # [ROWS, KT] bool
    m_prev: jax.Array,  # [ROWS] running max
    l_prev: jax.Array,  # [ROWS] running sum
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # p, m, l, the old acc's correction
    """One tile folded into each row's running max and sum (pallas_common's step, in the
    WGMMA register layout); masked keys' probabilities are exactly 0."""
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, pallas_common.MASK_VALUE)
    m_new = jnp.maximum(m_prev, s.max(axis=1))
    correction = jnp.exp(m_prev - m_new)
    p = jnp.where(visible, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
    return p, m_new, l_prev * correction + p.sum(axis=1), correction


def _decode_kernel(
    layer_ref,  # [1] int32
    window_ref,  # [1] int32, 0 = unlimited
    scales_ref,  # [2, L, Hkv] float32
    seq_lens_ref,  # [S] int32, 0 for sequences without a new token
    block_tables_ref,  # [S, B'] int32
    q_ref,  # [S, Hkv, ROWS, D]
    k_ref,  # [L, Hkv, N, block_size, D]
    v_ref,  # [L, Hkv, N, block_size, D]
    acc_ref,  # [S, Hkv, splits, ROWS, D] float32 partial outputs
    m_ref,  # [S, Hkv, splits, ROWS] float32 partial maxima
    l_ref,  # [S, Hkv, splits, ROWS] float32 partial sums
    q_smem,  # [ROWS, D]
    k_smem,  # [stages, KT, D]
    v_smem,  # [stages, KT, D]
    p_smem,  # [ROWS, KT] the softmax numerators, as the pool's dtype
    q_barrier,
    k_barriers,  # [stages], one arrival per copy
    v_barriers,
    *,
    kv_tile: int,
    num_stages: int,
    num_splits: int,
    min_split_tiles: int,
    soft_cap: float | None,
    use_window: bool,
):
    seq, head, split = lax.axis_index("seq"), lax.axis_index("head"), lax.axis_index("split")
    head_dim, block_size = q_smem.shape[1], k_ref.shape[3]
    chunk = min(block_size, kv_tile)  # positions per TMA copy
    copies = kv_tile // chunk
    layer = layer_ref[0]
    window = window_ref[0] if use_window else None  # None: no window to mask
    seq_len = seq_lens_ref[seq]
    scale = scales_ref[0, layer, head]

    start, stop = query_split(seq_len, window, split, kv_tile, num_splits, min_split_tiles)

    plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_barrier)

    def fetch(tile, slot):  # the tile's pages (or its part of one page), by TMA, into `slot`
        for copy in range(copies):
            position = tile * kv_tile + copy * chunk
            page = block_tables_ref[seq, lax.div(position, block_size)]
            source = (layer, head, page, pl.ds(lax.rem(position, block_size), chunk))
            rows = pl.ds(copy * chunk, chunk)
            plgpu.copy_gmem_to_smem(k_ref.at[source], k_smem.at[slot, rows], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[source], v_smem.at[slot, rows], v_barriers.at[slot])

    for ahead in range(num_stages - 1):  # the first tiles' copies, before Q is waited on
        pl.when(start + ahead < stop)(functools.partial(fetch, start + ahead, ahead))

    plgpu.barrier_wait(q_barrier)

    def step(tile, carry):
        acc, m_prev, l_prev = carry
        slot = lax.rem(tile - start, num_stages)

        # The buffer the last step read is free again: fill it with the tile num_stages-1 on.
        @pl.when(tile + num_stages - 1 < stop)
        def _fetch_ahead():
            fetch(tile + num_stages - 1, lax.rem(slot + num_stages - 1, num_stages))

        plgpu.barrier_wait(k_barriers.at[slot])
        s = _mma(q_smem, k_smem.at[slot].T, (ROWS, kv_tile)) * scale
        visible = _visible(tile * kv_tile, s.shape, seq_len, window)
        p, m_new, l_new, correction = _online_softmax(s, visible, m_prev, l_prev, soft_cap)
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()  # the stores are seen by the MMA's shared-memory reads
        plgpu.barrier_wait(v_barriers.at[slot])
        pv_tile = _mma(p_smem, v_smem.at[slot], (ROWS, head_dim))
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv_tile
        return acc, m_new, l_new

    stats = plgpu.Layout.WGMMA.reduce(1)
    init = (
        plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), stats),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), stats),
    )
    # No tiles (a padding sequence, a split past the sequence's pieces): the neutral partial.
    acc, m, denom = lax.fori_loop(start, stop, step, init)
    acc_ref[seq, head, split] = acc
    m_ref[seq, head, split] = m
    l_ref[seq, head, split] = denom


@functools.partial(jax.jit, static_argnames=pallas_common.KERNEL_STATIC_ARGS)
def mosaic_decode_attention_kernel(
    q: jax.Array,  # [S, Hq, D], one query per sequence
    k_pool: jax.Array,  # [L, Hkv, N, block_size, D] bfloat16 or float16
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
    software_fp8: bool = False,  # unused: fp8 pools are not read here
    config: DecodeConfig = DEFAULT_DECODE_CONFIG,
) -> jax.Array:  # [S, Hq, D] in q's dtype; 0 for seq_len 0
    """`decode_attention.decode_attention_kernel`'s result, from the Mosaic GPU kernel."""
    del software_fp8
    num_seqs, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    reason = supports_mosaic_decode(
        num_q_heads, num_kv_heads, head_dim, jnp.dtype(k_pool.dtype).name, block_size
    )
    if reason:
        raise ValueError(reason)
    kv_tile, num_stages = mosaic_tiling(head_dim, config)
    max_context = block_tables.shape[1] * block_size
    num_splits = config.num_splits or choose_num_splits(
        num_seqs, num_kv_heads, max_context, min_tokens_per_split=config.min_tokens_per_split
    )
    dtype = k_pool.dtype
    q_rows = q.reshape(num_seqs, num_kv_heads, group, head_dim).astype(dtype)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    scales = pallas_common.layer_scales(scale, k_scale, v_scale, num_layers, num_kv_heads)
    tables = pad_block_tables(block_tables.astype(jnp.int32), max(kv_tile // block_size, 1))
    kernel = functools.partial(
        _decode_kernel,
        kv_tile=kv_tile,
        num_stages=num_stages,
        num_splits=num_splits,
        min_split_tiles=max(-(-config.min_tokens_per_split // kv_tile), 1),
        soft_cap=soft_cap,
        use_window=use_window,
    )
    partial_shape = (num_seqs, num_kv_heads, num_splits, ROWS)
    copies = kv_tile // min(block_size, kv_tile)
    acc, m, denom = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((ROWS, head_dim), dtype, transforms=SWIZZLED),
            plgpu.SMEM((num_stages, kv_tile, head_dim), dtype, transforms=SWIZZLED),
            plgpu.SMEM((num_stages, kv_tile, head_dim), dtype, transforms=SWIZZLED),
            plgpu.SMEM((ROWS, kv_tile), dtype, transforms=SWIZZLED),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        ),  # fmt: skip
        grid=(num_seqs, num_kv_heads, num_splits),
        grid_names=("seq", "head", "split"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="decode_attention_mosaic",
    )(
        *pallas_common.int32_scalars(layer, window),
        scales,
        seq_lens.astype(jnp.int32),
        tables,
        q_rows,
        k_pool,
        v_pool,
    )
    return finish_splits(acc, m, denom, sinks, scales[1][layer], q)


def _runs_here() -> str | None:
    """None if this machine runs the kernel: compiled on Hopper or newer, else interpreted."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        capability = str(getattr(device, "compute_capability", "0.0"))
        if int(capability.split(".")[0]) < 9:
            return f"Mosaic GPU's warpgroup MMAs need Hopper (sm_90); this GPU is sm_{capability}"
        return None
    if not has_interpret_mode():
        return f"jax {jax.__version__} has no Mosaic GPU interpret mode (jax >= 0.11 has)"
    return None


def _supports(spec: AttentionSpec) -> str | None:
    return (
        PALLAS.check(spec)
        or supports_mosaic_decode(
            spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.kv_dtype, spec.block_size
        )
        or _runs_here()
    )


# The Pallas backend with this decode kernel: the ragged kernel (Triton) still runs the steps
# that are not decode-only. "auto" picks it once it beats "pallas" on a device.
PALLAS_MOSAIC = FunctionBackend(
    "pallas_mosaic",
    functools.partial(paged_attention, decode_kernel=mosaic_decode_attention_kernel),
    cost_follows_context=False,
    check=_supports,
    has_decode_kernel=True,
    fit_num_blocks=in_place_num_blocks,
    takes_sinks=True,
)
