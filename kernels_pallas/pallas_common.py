"""What the two Pallas kernels (ragged and split-K decode) share.

Both read the stacked paged pool of `kv_cache` in KV tiles of KT consecutive positions of one
sequence (whole pages, found through the block table), fold them into an online (flash)
softmax kept in float32, and are launched on the Triton lowering with their metadata passed
as plain arrays. This module holds those pieces: the dot dtype of a pool, the tile size, the
tile loop, the fp8 upcast, the per-layer scales and the launch.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.metadata import next_power_of_2
from kernels_pallas.reference import MASK_VALUE

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)

# The static arguments of both kernels' jitted wrappers.
KERNEL_STATIC_ARGS = ("scale", "soft_cap", "use_window", "interpret", "software_fp8", "config")

SoftmaxState = tuple[jax.Array, jax.Array, jax.Array]  # acc [M, D], max m [M], sum l [M]


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
    if block_size != next_power_of_2(block_size):
        raise ValueError(f"block_size must be a power of two for the Pallas kernels: {block_size}")
    return max(next_power_of_2(requested), block_size, 16)


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


def int32_scalars(*values: jax.Array | int) -> tuple[jax.Array, ...]:
    """Each (traced or static) scalar as a [1] int32 array: a kernel reads its element 0."""
    return tuple(jnp.reshape(value, (1,)).astype(jnp.int32) for value in values)


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


def clamp_index(index: jax.Array, size: int) -> jax.Array:
    """`index` clamped into [0, size - 1]: a compiled kernel faults on an out-of-range load
    (interpret mode clamps silently, so only this makes the two agree)."""
    return jnp.minimum(jnp.maximum(index, 0), size - 1)


def tile_pages(
    block_tables_ref: jax.Ref,  # [S, B'] int32, B' a whole number of tiles
    seq: jax.Array,  # [] int32
    tile: jax.Array,  # [] int32, a tile of the table
    *,
    kv_tile: int,
    block_size: int,
    num_blocks: int,  # N, the pool's pages
) -> jax.Array:  # [KT] int32, each in [0, N)
    """The physical page of each position of KV tile `tile` of sequence `seq`.

    The page ids read are clamped: padding or garbage entries (at masked positions) then
    read some page of the pool, never foreign memory. The table read itself stays in its
    row because the callers' tiles end at the sequence's length, which fits the table."""
    key_pos = tile * kv_tile + lax.broadcasted_iota(jnp.int32, (kv_tile,), 0)
    return clamp_index(block_tables_ref[seq, lax.div(key_pos, block_size)], num_blocks)


def fold_kv_tiles(
    start: jax.Array,  # [] int32
    stop: jax.Array,  # [] int32
    step: Callable[[jax.Array, jax.Array, Any], Any],
    init: Any,
    pages_of: Callable[[jax.Array], jax.Array],  # tile -> its pages [KT]
    *,
    prefetch_pages: bool,
) -> Any:
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
    pool_ref: jax.Ref,  # [L, N, block_size, D] (this program's KV head)
    layer: jax.Array,  # [] int32, in [0, L)
    pages: jax.Array,  # [KT] int32 in [0, N), physical page of each position in the tile
    offsets: jax.Array,  # [KT] int32, offset of each position inside its page
    out_dtype: jnp.dtype,
    software_fp8: bool = False,
    valid: jax.Array | None = None,  # [KT] bool: positions to read; None: all
) -> jax.Array:  # [KT, D], exactly 0 in the rows of positions not `valid`
    """Gathers one KV tile through the block table; all-array indices keep it one gather in
    both the Triton lowering and interpret mode (which cannot mix gathers with slices).

    With `valid` the load is masked: other positions are not read and come back 0."""
    head_dim = pool_ref.shape[-1]
    d = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    index = (layer, pages[:, None], offsets[:, None], d)
    if valid is None:
        tile = pool_ref[index]
    else:
        mask = jnp.broadcast_to(valid[:, None], (valid.shape[0], head_dim))
        zero = jnp.zeros((), pool_ref.dtype)
        tile = plgpu.load(pool_ref.at[index], mask=mask, other=zero)
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
    carry: SoftmaxState,  # float32
    *,
    scale: jax.Array | float,
    soft_cap: float | None,
) -> SoftmaxState:
    """One KV tile folded into the running (acc, max, sum) of each query row."""
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


@dataclasses.dataclass(frozen=True)
class TileLoop:
    """The static options of a kernel's loop over KV tiles (hashable, like the kernels')."""

    kv_tile: int  # KT positions per tile: whole pages, a power of two, >= 16
    soft_cap: float | None
    software_fp8: bool  # fp8 pools: upcast with integer ops (GPUs before sm_89)
    num_stages: int  # Triton's software-pipelining depth

    @property
    def prefetch_pages(self) -> bool:
        """Carry the next tile's page ids (see fold_kv_tiles) where it pays: 3 stages or more."""
        return self.num_stages >= 3


def attend_kv_tiles(
    loop: TileLoop,
    q: jax.Array,  # [M, D] matmul dtype: this program's query rows
    k_ref: jax.Ref,  # [L, N, block_size, D] this program's KV head
    v_ref: jax.Ref,  # [L, N, block_size, D]
    block_tables_ref: jax.Ref,  # [S, B'] int32
    seq: jax.Array,  # [] int32
    layer: jax.Array,  # [] int32
    tiles: tuple[jax.Array, jax.Array],  # [start, stop) KV tiles of the sequence
    visible: Callable[[jax.Array], jax.Array],  # key positions [KT] -> [M, KT] bool
    key_valid: Callable[[jax.Array], jax.Array],  # [KT] -> [KT] bool: seen by some row
    scale: jax.Array | float,  # softmax scale x K dequant scale
) -> SoftmaxState:  # float32, unnormalised; MASK_VALUE maxima where no key was visible
    """Online softmax of q's rows over KV tiles [start, stop) of sequence `seq`, inside a
    kernel: each tile's pages come from the block table (clamped into the pool), K and V are
    gathered (positions outside `key_valid` as exact zeros) and upcast to q's dtype, and
    scores outside `visible` are masked. `key_valid` must cover every key `visible` shows."""
    rows, head_dim = q.shape
    num_layers, num_blocks, block_size, _ = k_ref.shape
    kv_tile = loop.kv_tile
    tile_iota = lax.broadcasted_iota(jnp.int32, (kv_tile,), 0)
    # A pool `launch` cut down to the step's layer has one layer: the clamp reads it at 0.
    layer = clamp_index(layer, num_layers)

    def pages_of(tile):
        return tile_pages(
            block_tables_ref,
            seq,
            tile,
            kv_tile=kv_tile,
            block_size=block_size,
            num_blocks=num_blocks,
        )

    def step(tile, pages, softmax_state):
        key_pos = tile * kv_tile + tile_iota  # [KT]
        offsets = lax.rem(key_pos, block_size)
        # Scores of masked keys are replaced whatever K holds there; V's rows are zeroed.
        k = load_kv_tile(k_ref, layer, pages, offsets, q.dtype, loop.software_fp8)
        v = load_kv_tile(
            v_ref, layer, pages, offsets, q.dtype, loop.software_fp8, key_valid(key_pos)
        )
        return online_softmax_step(
            q, k, v, visible(key_pos), softmax_state, scale=scale, soft_cap=loop.soft_cap
        )

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    start, stop = tiles
    return fold_kv_tiles(start, stop, step, init, pages_of, prefetch_pages=loop.prefetch_pages)


# jax's Triton lowering addresses an array with 64-bit element offsets only above this
# many bytes (`_compute_offsets_from_indices`), with 32-bit ones below.
TRITON_INT64_OFFSETS_ABOVE_BYTES = 2**32


def int32_offsets_overflow(shape: Sequence[int], dtype: jnp.dtype) -> bool:
    """Whether the Triton lowering would address an array of `shape` and `dtype` with 32-bit
    element offsets that overflow: it picks the width from the bytes (64-bit above 4 GiB),
    but a GEP sign-extends 32-bit offsets, so elements past 2**31 - 1 need 64 bits. Only
    1-byte dtypes (fp8) of 2-4 GiB fall in between."""
    size = math.prod(shape)
    nbytes = size * jnp.dtype(dtype).itemsize
    return nbytes <= TRITON_INT64_OFFSETS_ABOVE_BYTES and size > 2**31


def in_place_num_blocks(num_blocks: int, elements_per_block: int, dtype: jnp.dtype) -> int:
    """The most blocks, up to `num_blocks`, of a pool the kernels read in place: fewer only
    where `num_blocks` would make an fp8 pool of 2-4 GiB, which `addressable_pool` copies a
    layer of on every call; then the most that keep it under 2**31 elements (2 GiB)."""
    if not int32_offsets_overflow((num_blocks * elements_per_block,), dtype):
        return num_blocks
    return 2**31 // elements_per_block


def addressable_pool(
    pool: jax.Array,  # [L, Hkv, N, block_size, D]
    layer: jax.Array,  # [] int32
) -> jax.Array:  # [L, ...] or [1, ...]: the pool, or its layer `layer`
    """The pool itself, unless the Triton lowering's offsets into it would overflow (an fp8
    pool of 2-4 GiB): then a copy of `layer` alone, which the kernels read as layer 0 (they
    clamp the layer into the pool they see). jax gives the kernel no way to ask for 64-bit
    offsets, and a copy of one layer is correct where the whole pool would read foreign
    memory; it costs a copy per call, so size fp8 pools outside 2-4 GiB."""
    if not int32_offsets_overflow(pool.shape, pool.dtype):
        return pool
    layer_pool = lax.dynamic_index_in_dim(pool, jnp.reshape(layer, ()), 0, keepdims=True)
    if int32_offsets_overflow(layer_pool.shape, layer_pool.dtype):
        raise ValueError(
            f"one layer of the {pool.dtype} pool {pool.shape} is 2-4 GiB, past the 32-bit "
            "element offsets of jax's Triton lowering: use a smaller or a larger pool"
        )
    warnings.warn(
        f"the {pool.dtype} pool {pool.shape} is 2-4 GiB: the Pallas kernels copy the step's "
        "layer on every call to keep Triton's 32-bit offsets in range (num_kv_blocks for a "
        "pool below 2 GiB or above 4 GiB avoids the copy; a pool sized from memory does)",
        stacklevel=2,
    )
    return layer_pool


def launch(
    kernel: Callable[..., None],
    metadata: Sequence[jax.Array],  # whole arrays: each program loads the scalars it needs
    q_rows: jax.Array,
    q_spec: pl.BlockSpec,
    k_pool: jax.Array,  # [L, Hkv, N, block_size, D]
    v_pool: jax.Array,
    *,
    layer: jax.Array,  # [] int32, the layer the kernel reads (see addressable_pool)
    grid: tuple[int, ...],  # axis 1 is the KV head
    out_specs: Any,
    out_shape: Any,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    name: str,
) -> Any:
    """Runs `kernel(*metadata refs, q ref, k ref, v ref, *out refs)` over `grid` as a Pallas
    kernel on the Triton lowering; each program sees its KV head's slice of the pools.

    The Triton lowering has no scalar prefetch, so the metadata goes in as plain arrays. The
    pools' BlockSpec squeezes the KV head: a pointer offset on Triton, no layer is copied
    (unless the pool's offsets need it: `addressable_pool`)."""
    k_pool, v_pool = addressable_pool(k_pool, layer), addressable_pool(v_pool, layer)
    num_layers, _, num_blocks, block_size, head_dim = k_pool.shape
    head_pool = pl.BlockSpec(
        (num_layers, None, num_blocks, block_size, head_dim), lambda *ids: (0, ids[1], 0, 0, 0)
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.no_block_spec] * len(metadata) + [q_spec, head_pool, head_pool],
        out_specs=out_specs,
        out_shape=out_shape,
        # Triton explicitly: in jax 0.10 a GPU pallas_call without params goes to Mosaic GPU.
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*metadata, q_rows, k_pool, v_pool)


__all__ = [
    "FP8_DTYPES",
    "KERNEL_STATIC_ARGS",
    "TileLoop",
    "addressable_pool",
    "attend_kv_tiles",
    "clamp_index",
    "dot_nn",
    "dot_nt",
    "fold_kv_tiles",
    "fp8_to_float32",
    "in_place_num_blocks",
    "int32_offsets_overflow",
    "int32_scalars",
    "kv_tile_tokens",
    "launch",
    "layer_scales",
    "load_kv_tile",
    "matmul_dtype",
    "online_softmax_step",
    "tile_pages",
]
