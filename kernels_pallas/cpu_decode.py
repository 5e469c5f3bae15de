"""Paged decode attention as a C++ kernel for XLA:CPU (`cpu/paged_decode.cc`), built by
`cpu_kernels`.

XLA:CPU cannot fuse a page gather into a dot, so the XLA path copies every page of a decode tile
and runs batched matmuls of a few columns over the copy (about 3 GB/s of K/V). The kernel reads
each K/V row once, in place, for all query heads of its group, and shares (sequence, KV head)
pairs among XLA's intra-op threads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_kernels
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata

TARGET = "pagedjax_paged_decode"
MAX_GROUP = 8  # query heads per KV head the kernel handles


def supports(q: jax.Array, cache: KVCache) -> bool:
    """Whether the kernel handles this call: a float32 pool, at most 8 query heads per KV head,
    a head_dim that is a multiple of 8, on the CPU, and the kernel built."""
    return (
        cache.k.dtype == jnp.float32
        and cache.k_scale is None
        and q.shape[1] // cache.k.shape[1] <= MAX_GROUP
        and q.shape[2] % 8 == 0
        and cpu_kernels.usable()
    )


def paged_decode_cpu(
    q: jax.Array,  # [T, num_q_heads, head_dim] float32
    cache: KVCache,  # k, v: [L, num_kv_heads, num_blocks, block_size, head_dim] float32
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim] float32; rows of non-decode sequences are zero
    """Attention of every decode row (a sequence whose q_len is 1); call when `supports`."""
    window = 0 if sliding_window is None else sliding_window
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q,
        cache.k,
        cache.v,
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
        jnp.reshape(jnp.asarray(window, jnp.int32), (1,)),
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale=np.float32(scale),
        soft_cap=np.float32(soft_cap or 0.0),
    )
