"""The XLA work-list attention (the "xla" backend) against the per-token oracle.

Tiny tiles and key chunks make every case span several decode tiles, query tiles and key
chunks of the loops; the default tiles run them as the engine does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    MIXED,
    RAGGED_CASES,
    assert_matches,
    expected,
    make_case,
    quantize_fp8,
    ragged_case,
)

from kernels_pallas.kv_cache import KVCache
from kernels_pallas.xla_attention import ragged_paged_attention_xla

SMALL_TILES = dict(decode_tile=2, query_tile=8, key_chunk=16)


@pytest.mark.parametrize("tiles", ["small", "default"])
@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim,kv_dtype,window,soft_cap,layer",
    [c[1:] for c in RAGGED_CASES],
    ids=[c[0] for c in RAGGED_CASES],
)
def test_matches_reference(
    block_size, num_kv_heads, group, head_dim, kv_dtype, window, soft_cap, layer, tiles
):
    q, cache, metadata, kwargs = ragged_case(
        block_size, num_kv_heads, group, head_dim, kv_dtype, window, soft_cap, layer
    )
    attention = functools.partial(
        ragged_paged_attention_xla, **(SMALL_TILES if tiles == "small" else {})
    )
    out = jax.jit(attention, static_argnames=("scale", "soft_cap"))(
        q, cache, jnp.int32(layer), metadata, **kwargs
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, expected(q, cache, layer, metadata, **kwargs), metadata, kv_dtype)


def test_random_steps_in_one_bucket_compile_once():
    """Random ragged steps of one shape: every mix of prefill, chunked prefill and decode, and
    contexts from one token to many pages, through one compilation."""
    traces = []

    @jax.jit
    def attention(q, cache, metadata):
        traces.append(1)
        return ragged_paged_attention_xla(q, cache, 1, metadata, scale=0.125, **SMALL_TILES)

    rng = np.random.default_rng(3)
    for seed in range(12):
        seqs, budget = [], 48
        for _ in range(int(rng.integers(1, 8))):
            q_len = int(rng.choice([1, 1, rng.integers(1, 30)]))
            if q_len > budget:
                break
            budget -= q_len
            seqs.append((q_len, q_len + int(rng.integers(0, 90))))
        q, cache, metadata = make_case(
            seed,
            seqs,
            block_size=8,
            num_kv_heads=2,
            group=3,
            head_dim=32,
            num_tokens_padded=48,
            num_seqs_padded=8,
            max_blocks_per_seq=16,
            spare_blocks=120 - sum(-(-c // 8) for _, c in seqs),
        )
        out = attention(q, cache, metadata)
        assert_matches(out, expected(q, cache, 1, metadata, scale=0.125), metadata, jnp.float32)
    assert len(traces) == 1


def test_fp8_pool_with_per_head_scales():
    q, cache, metadata = make_case(
        2, MIXED, block_size=16, num_kv_heads=2, group=2, head_dim=64, max_blocks_per_seq=5
    )
    k_scale, v_scale = jnp.array([0.5, 2.0]), jnp.array([1.5, 0.25])
    fp8 = quantize_fp8(cache, k_scale, v_scale)
    per_layer = jnp.stack([k_scale] * 2), jnp.stack([v_scale] * 2)  # KVCache's [L, Hkv] scales
    q = q.astype(jnp.bfloat16)
    out = ragged_paged_attention_xla(
        q, KVCache(fp8.k, fp8.v, *per_layer), 1, metadata, scale=0.125, **SMALL_TILES
    )
    want = expected(q, fp8, 1, metadata, k_scale=k_scale, v_scale=v_scale, scale=0.125)
    assert_matches(out, want, metadata, jnp.float8_e4m3fn)
