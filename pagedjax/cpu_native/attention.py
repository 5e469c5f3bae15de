"""Ragged paged attention as a C++ kernel for XLA:CPU (`csrc/paged_attention.cc`): the
attention of every row of a step (decode rows and prefill chunks), as the "cpu_native"
attention backend.

XLA:CPU cannot fuse a page gather into a dot, so the XLA loops (`kernels_pallas/
xla_attention.py`) copy every page of a tile and run small batched matmuls over the copy. The
kernel reads each K/V row in place, once for all query heads of its group. A decode row walks
its pages twice (scores with an exact max, then probabilities times V); a prefill tile of up
to 32 queries runs flash attention page by page, with both products as register-blocked
matmuls. Work items (sequence, KV head, query tile) are shared among XLA's intra-op threads.

The pool may be float32, bfloat16, float16 or float8_e4m3fn (times its per-layer, per-KV-head
scales). The kernel widens each K/V value to float32 exactly as it reads it and computes in
float32, so its result is that of a float32 pool holding the same values; the narrower pools
read a half or a quarter of the bytes. The backend also writes the step's K/V into those
narrower pools itself (`write_kv_cpu`, `csrc/kv_write.cc`): XLA:CPU's own write of one token
into a bf16 or fp8 pool passes over the whole pool.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.backend import AttentionSpec, FunctionBackend
from kernels_pallas.kv_cache import KVCache, quantize, write_kv
from kernels_pallas.metadata import AttentionMetadata
from pagedjax.cpu_native import build

TARGET = "pagedjax_paged_attention"
WRITE_TARGET = "pagedjax_kv_write"
MAX_GROUP = 8  # query heads per KV head the kernel handles
KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")  # the pools it reads


def paged_attention_cpu(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    cache: KVCache,  # k, v: [L, num_kv_heads, num_blocks, block_size, head_dim], KV_DTYPES
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    invariant: bool = False,
) -> jax.Array:  # [T, num_q_heads, head_dim] in q's dtype; padding rows are zero
    """Attention of every new token of the step (the contract of `kernels_pallas/backend.py`);
    call when `CPU_NATIVE.supports` the model. `invariant`: every query runs the decode path
    over the keys up to its position, prefill chunks' too, so a token's result does not depend
    on its batch."""
    dtype = q.dtype
    window = 0 if sliding_window is None else sliding_window
    if cache.k_scale is None:  # the kernel reads scales for fp8 pools only; others pass ones
        ones = jnp.ones(cache.k.shape[:2], jnp.float32)
        k_scale, v_scale = ones, ones
    else:
        k_scale, v_scale = cache.k_scale, cache.v_scale
    call = build.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32),
        cache.k,
        cache.v,
        k_scale.astype(jnp.float32),
        v_scale.astype(jnp.float32),
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
        jnp.reshape(jnp.asarray(window, jnp.int32), (1,)),
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale=np.float32(scale),
        soft_cap=np.float32(soft_cap or 0.0),
        invariant=np.int64(invariant),
    )
    return out.astype(dtype)


def write_kv_cpu(
    cache: KVCache,
    layer: jax.Array | int,
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32; negative for padding
) -> KVCache:
    """`kv_cache.write_kv`, the same values in the same slots, with a 16- or 8-bit pool written
    in place by the C++ kernel (a float32 pool XLA writes in place itself)."""
    dtype = cache.k.dtype
    if dtype == jnp.float32:
        return write_kv(cache, layer, k, v, slot_mapping)
    if cache.k_scale is not None:  # rounded as write_kv rounds them
        k = quantize(k, cache.k_scale[layer][None, :, None], dtype)
        v = quantize(v, cache.v_scale[layer][None, :, None], dtype)
    pools = (jax.ShapeDtypeStruct(cache.k.shape, dtype), jax.ShapeDtypeStruct(cache.v.shape, dtype))
    call = build.ffi_call(WRITE_TARGET, pools, input_output_aliases={0: 0, 1: 1})
    new_k, new_v = call(
        cache.k,
        cache.v,
        k.astype(dtype),
        v.astype(dtype),
        slot_mapping.astype(jnp.int32),
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
    )
    return KVCache(new_k, new_v, cache.k_scale, cache.v_scale)


def _supports(spec: AttentionSpec) -> str | None:
    if spec.kv_dtype not in KV_DTYPES:
        return f"it reads {', '.join(KV_DTYPES)} pools, not {spec.kv_dtype}"
    if spec.num_q_heads // spec.num_kv_heads > MAX_GROUP:
        return f"it handles at most {MAX_GROUP} query heads per KV head"
    if spec.head_dim % 8:
        return f"head_dim must be a multiple of 8, not {spec.head_dim}"
    if jax.default_backend() != "cpu" or not build.available():
        return "the C++ kernels are not built on this host"
    return None


# Its loops stop at each sequence's context, so the block-table width costs nothing.
CPU_NATIVE = FunctionBackend(
    "cpu_native",
    paged_attention_cpu,
    cost_follows_context=True,
    check=_supports,
    write_kv=write_kv_cpu,
)
# The engine's batch_invariant=True (`docs/batch_invariance.md`).
CPU_NATIVE_INVARIANT = dataclasses.replace(
    CPU_NATIVE,
    name="cpu_native_invariant",
    fn=functools.partial(paged_attention_cpu, invariant=True),
)
