"""Ragged paged attention as a C++ kernel for XLA:CPU (`csrc/paged_attention.cc`): the
attention of every row of a step (decode rows and prefill chunks) on a float32 pool, as the
"cpu_native" attention backend.

XLA:CPU cannot fuse a page gather into a dot, so the XLA loops (`kernels_pallas/
xla_attention.py`) copy every page of a tile and run small batched matmuls over the copy. The
kernel reads each K/V row in place, once for all query heads of its group. A decode row walks
its pages twice (scores with an exact max, then probabilities times V); a prefill tile of up
to 32 queries runs flash attention page by page, with both products as register-blocked
matmuls. Work items (sequence, KV head, query tile) are shared among XLA's intra-op threads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.backend import AttentionSpec, FunctionBackend
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata
from pagedjax.cpu_native import build

TARGET = "pagedjax_paged_attention"
MAX_GROUP = 8  # query heads per KV head the kernel handles


def paged_attention_cpu(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    cache: KVCache,  # k, v: [L, num_kv_heads, num_blocks, block_size, head_dim] float32
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim] in q's dtype; padding rows are zero
    """Attention of every new token of the step (the contract of `kernels_pallas/backend.py`);
    call when `CPU_NATIVE.supports` the model."""
    dtype = q.dtype
    window = 0 if sliding_window is None else sliding_window
    call = build.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32),
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
    return out.astype(dtype)


def _supports(spec: AttentionSpec) -> str | None:
    if spec.kv_dtype != "float32":
        return f"it reads float32 pools only, not {spec.kv_dtype}"
    if spec.num_q_heads // spec.num_kv_heads > MAX_GROUP:
        return f"it handles at most {MAX_GROUP} query heads per KV head"
    if spec.head_dim % 8:
        return f"head_dim must be a multiple of 8, not {spec.head_dim}"
    if jax.default_backend() != "cpu" or not build.available():
        return "the C++ kernels are not built on this host"
    return None


# Its loops stop at each sequence's context, so the block-table width costs nothing.
CPU_NATIVE = FunctionBackend(
    "cpu_native", paged_attention_cpu, cost_follows_context=True, check=_supports
)
