"""The paged KV pool: its layout, defined once, and the write of a step's new K/V into it.

Layout (one array for K, one for V, all layers stacked):

    k, v: [num_layers, num_kv_heads, num_blocks, block_size, head_dim]

A page is the `block_size x head_dim` tile of one KV head in one layer, and it is contiguous
in memory. A GPU decode kernel runs one program per (sequence, KV head) and streams whole
pages: each page is a single contiguous read of block_size * head_dim elements (16 x 128 bf16
= 4 KiB), and all query heads of the group share it. vLLM's [num_blocks, block_size, heads,
head_dim] layout would make each head's slice of a page strided instead.

Layers are stacked so the model can scan over layers with the pool in the scan carry: each
layer writes into and gathers from the stacked array at its layer index, so no step slices
(copies) a layer's pool.

An fp8 pool (float8_e4m3fn, one byte per element: half of bf16) carries per-layer, per-KV-head
float32 scales: stored = value / scale on write, value = stored * scale on read. Other dtypes
have no scales. Scales start at 1 (vLLM's default without calibration); `with_scales` sets
others (`pagedjax/kv_scales.py` loads or calibrates them). A write saturates at the format's
largest finite value times the scale.

Block 0 is the null block: the block manager never hands it out, so padding entries of block
tables may point at it. Padding tokens carry a negative slot and are dropped by the write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

NULL_BLOCK = 0
# The name of the layout above, which `allocate_kv_cache` builds and every backend declares.
KV_LAYOUT = "layer-head-block"
PAD_SLOT = -1


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    v: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    k_scale: jax.Array | None = None  # [num_layers, num_kv_heads] float32, fp8 pools only
    v_scale: jax.Array | None = None  # [num_layers, num_kv_heads] float32, fp8 pools only

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]


class KVCacheLayout(Protocol):
    """The model-side shape of a pool (`pagedjax.core.memory.KVCacheSpec` is one)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any  # a dtype or its name


def allocate_kv_cache(
    spec: KVCacheLayout, num_blocks: int, block_size: int, num_scale_layers: int | None = None
) -> KVCache:
    """A zeroed pool of `num_blocks` blocks of `block_size` tokens (scales of 1 for fp8).

    num_scale_layers: the model's layers, where the pool's `spec.num_layers` are the slabs
    that KV cache groups share (`kv_groups.py`); fp8 scales stay per layer."""
    dtype = jnp.dtype(spec.dtype)
    shape = (spec.num_layers, spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if not is_quantized(dtype):
        return KVCache(k, v)
    # Two arrays, not one twice: the pool is donated, and a buffer cannot be donated twice.
    scale_shape = (num_scale_layers or spec.num_layers, spec.num_kv_heads)
    scales = [jnp.ones(scale_shape, jnp.float32) for _ in range(2)]
    return KVCache(k, v, *scales)


def is_quantized(dtype: jnp.dtype) -> bool:
    """Whether a pool of this dtype stores scaled values (the 8-bit float formats)."""
    return jnp.dtype(dtype).itemsize == 1


KV_CACHE_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp8": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
}


def quantize(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x / scale in float32, clamped to the 8-bit format's finite range (still float32).

    Without the clamp a value past the range casts to NaN (e4m3fn has no inf) or inf (e5m2);
    saturating to +-max keeps an outlier finite, as a GPU's saturating conversion does.
    """
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit)


def with_scales(
    cache: KVCache, k_scale: jax.typing.ArrayLike, v_scale: jax.typing.ArrayLike
) -> KVCache:
    """The pool with new [num_layers, num_kv_heads] scales; raises ValueError on a pool
    without scales or a wrong shape."""
    if cache.k_scale is None:
        raise ValueError(f"a {cache.k.dtype} pool has no scales: only 8-bit pools are scaled")
    # Fresh buffers: the pool is donated, and the caller may still hold (or donate) its own.
    k_scale, v_scale = (jnp.array(s, jnp.float32, copy=True) for s in (k_scale, v_scale))
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale.shape != cache.k_scale.shape:
            raise ValueError(
                f"{name} has shape {scale.shape}; the pool's is {cache.k_scale.shape} "
                "[num_layers, num_kv_heads]"
            )
    return KVCache(cache.k, cache.v, k_scale, v_scale)


def write_kv(
    cache: KVCache,
    layer: jax.Array | int,
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32: block_id * block_size + offset, or negative for padding
) -> KVCache:
    """Scatters the step's new K/V into `layer` of the pool; negative slots write nothing.

    A slot of -1 would wrap to the last slot under JAX indexing, so negative slots are moved
    out of range and dropped.
    """
    num_slots = cache.num_blocks * cache.block_size
    slot = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    block, offset = slot // cache.block_size, slot % cache.block_size
    if cache.k_scale is not None:
        k = quantize(k, cache.k_scale[layer][None, :, None], cache.k.dtype)
        v = quantize(v, cache.v_scale[layer][None, :, None], cache.v.dtype)
    # Advanced indices (block, offset) around the head slice put T first: updates are [T, H, D].
    new_k = cache.k.at[layer, :, block, offset].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[layer, :, block, offset].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(new_k, new_v, cache.k_scale, cache.v_scale)


def copy_blocks(cache: KVCache, copies: jax.Array) -> KVCache:
    """Copies whole blocks (all layers and heads) src -> dst, for copy-on-write.

    copies: [C, 2] int32 (src, dst) pairs; padding pairs are (NULL_BLOCK, NULL_BLOCK).
    """
    src, dst = copies[:, 0], copies[:, 1]
    return KVCache(
        cache.k.at[:, :, dst].set(cache.k[:, :, src]),
        cache.v.at[:, :, dst].set(cache.v[:, :, src]),
        cache.k_scale,
        cache.v_scale,
    )


def read_blocks(cache: KVCache, block_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The K and V of whole blocks, [num_layers, num_kv_heads, len(block_ids), block_size,
    head_dim] each: what a swap to host memory carries."""
    return cache.k[:, :, block_ids], cache.v[:, :, block_ids]


def write_blocks(cache: KVCache, block_ids: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """The pool with whole blocks replaced by k and v (as `read_blocks` returns them);
    padding rows go to NULL_BLOCK, which nothing reads unmasked."""
    return KVCache(
        cache.k.at[:, :, block_ids].set(k.astype(cache.k.dtype)),
        cache.v.at[:, :, block_ids].set(v.astype(cache.v.dtype)),
        cache.k_scale,
        cache.v_scale,
    )
