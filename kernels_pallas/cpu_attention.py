"""Ragged paged attention as a C++ kernel for XLA:CPU (`cpu/paged_attention.cc`), built by
`cpu_kernels`: the attention of every row of a step (decode rows and prefill chunks) on a
float32 pool.

XLA:CPU cannot fuse a page gather into a dot, so the XLA loops (`xla_attention.py`) copy every
page of a tile and run small batched matmuls over the copy: about 3 GB/s of K/V for decode
rows and 15-20 GFLOP/s for prefill tiles. The kernel reads each K/V row in place, once for all
query heads of its group. A decode row walks its pages twice (scores with an exact max, then
probabilities times V); a prefill tile of up to 32 queries runs flash attention page by page,
with both products as register-blocked matmuls. Work items (sequence, KV head, query tile) are
shared among XLA's intra-op threads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_kernels
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata

TARGET = "pagedjax_paged_attention"
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


def paged_attention_cpu(
    q: jax.Array,  # [T, num_q_heads, head_dim] float32
    cache: KVCache,  # k, v: [L, num_kv_heads, num_blocks, block_size, head_dim] float32
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim] float32; padding rows are zero
    """Attention of every new token of the step (same contract as
    `reference.ragged_paged_attention`); call when `supports`."""
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
