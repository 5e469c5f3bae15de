"""Shared attention test cases: random paged pools with ragged metadata, and the oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata, build_metadata
from kernels_pallas.reference import ragged_paged_attention as reference

TOLERANCE = {  # atol, rtol per KV pool dtype
    jnp.float32: (2e-5, 2e-5),
    jnp.bfloat16: (3e-2, 3e-2),
    jnp.float16: (4e-3, 4e-3),
    jnp.float8_e4m3fn: (3e-2, 3e-2),
}


def make_case(
    seed: int,
    seqs: list[tuple[int, int]],  # (q_len, context length incl. the new tokens)
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_layers: int = 2,
    kv_dtype=jnp.float32,
    q_dtype=None,
    num_tokens_padded: int | None = None,
    num_seqs_padded: int | None = None,
    max_blocks_per_seq: int | None = None,
    spare_blocks: int = 3,
) -> tuple[jax.Array, KVCache, AttentionMetadata]:
    """A random pool whose pages are handed out in shuffled order, and ragged metadata."""
    rng = np.random.default_rng(seed)
    pages_needed = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = 1 + sum(pages_needed) + spare_blocks
    shuffled = rng.permutation(np.arange(1, num_blocks))
    tables, used = [], 0
    for n in pages_needed:
        tables.append([int(b) for b in shuffled[used : used + n]])
        used += n
    metadata = build_metadata(
        [q for q, _ in seqs],
        [c for _, c in seqs],
        tables,
        block_size,
        num_tokens_padded=num_tokens_padded,
        num_seqs_padded=num_seqs_padded,
        max_blocks_per_seq=max_blocks_per_seq,
    )
    metadata = jax.tree.map(jnp.asarray, metadata)
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    k = jnp.asarray(rng.normal(size=shape), jnp.float32).astype(kv_dtype)
    v = jnp.asarray(rng.normal(size=shape), jnp.float32).astype(kv_dtype)
    num_tokens = metadata.slot_mapping.shape[0]
    q_dtype = q_dtype or (jnp.float32 if kv_dtype == jnp.float32 else jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads * group, head_dim)), q_dtype)
    return q, KVCache(k, v), metadata


def expected(q, cache, layer, metadata, *, k_scale=None, v_scale=None, **kwargs) -> np.ndarray:
    """The oracle in float32 (dequantising an fp8 pool first), IEEE matmuls on any backend."""
    k = cache.k.astype(jnp.float32)
    v = cache.v.astype(jnp.float32)
    if k_scale is not None:
        k = k * jnp.asarray(k_scale, jnp.float32).reshape(1, -1, 1, 1, 1)
    if v_scale is not None:
        v = v * jnp.asarray(v_scale, jnp.float32).reshape(1, -1, 1, 1, 1)
    with jax.default_matmul_precision("highest"):
        out = reference(q.astype(jnp.float32), KVCache(k, v), layer, metadata, **kwargs)
    return np.asarray(out)


def assert_matches(out, want, metadata, kv_dtype) -> None:
    real = int(metadata.query_start_loc[-1])
    atol, rtol = TOLERANCE[kv_dtype]
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(out[:real], want[:real], atol=atol, rtol=rtol)
    np.testing.assert_array_equal(out[real:], 0)  # padding tokens: zeros, never NaN


# Mixed steps: prefill chunks (some longer than a query block), decode tokens, a chunk that
# continues a cached context, and a context spanning many pages.
MIXED = [(7, 7), (1, 40), (20, 45), (1, 1), (3, 70), (1, 9)]

RAGGED_CASES = [
    # id, block_size, kv heads, group, head_dim, kv dtype, window, soft cap, layer
    ("bs8-mha-f32-layer1", 8, 2, 1, 64, jnp.float32, None, None, 1),
    ("bs16-gqa3-window", 16, 1, 3, 64, jnp.float32, 6, None, 0),
    ("bs32-gqa4-d128-softcap", 32, 2, 4, 128, jnp.float32, None, 5.0, 2),
    ("bs16-gqa8-bf16", 16, 1, 8, 64, jnp.bfloat16, None, None, 1),
    ("bs8-gqa4-f16-window-softcap", 8, 1, 4, 64, jnp.float16, 13, 3.0, 1),
    ("bs16-gqa2-d256", 16, 1, 2, 256, jnp.float32, None, None, 1),
]


def ragged_case(block_size, num_kv_heads, group, head_dim, kv_dtype, window, soft_cap, layer):
    """One RAGGED_CASES row over MIXED, with padding tokens and sequences: (q, cache, metadata,
    the attention keyword arguments)."""
    q, cache, metadata = make_case(
        0,
        MIXED,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        num_layers=3 if layer == 2 else 2,
        kv_dtype=kv_dtype,
        num_tokens_padded=40,  # padding tokens
        num_seqs_padded=8,  # padding sequences
        max_blocks_per_seq=10,
    )
    window_arg = None if window is None else jnp.int32(window)
    kwargs = dict(scale=head_dim**-0.5, sliding_window=window_arg, soft_cap=soft_cap)
    return q, cache, metadata, kwargs


def quantize_fp8(cache: KVCache, k_scale: jax.Array, v_scale: jax.Array) -> KVCache:
    """The pool as an fp8 pool holds it: x / scale per KV head ([Hkv] scales), no scales
    attached; the oracle sees these dequantised fp8 values."""
    return KVCache(
        (cache.k / k_scale.reshape(1, -1, 1, 1, 1)).astype(jnp.float8_e4m3fn),
        (cache.v / v_scale.reshape(1, -1, 1, 1, 1)).astype(jnp.float8_e4m3fn),
    )
