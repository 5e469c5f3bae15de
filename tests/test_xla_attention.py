"""The XLA work-list attention (the CPU path) against the per-token oracle.

Tiny tiles and key chunks make every case span several decode tiles, query tiles and key
chunks of the XLA loops; the defaults send float32 pools to the C++ kernel.
"""

from __future__ import annotations

import dataclasses
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

from kernels_pallas import cpu_attention, cpu_kernels
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.xla_attention import ragged_paged_attention_xla

SMALL_TILES = dict(decode_tile=2, query_tile=8, key_chunk=16, cpu_kernel=False)


def test_cpu_attention_kernel_builds():
    """The C++ kernels build here, so the default-tile cases below exercise the kernel."""
    assert cpu_kernels.available()


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


@pytest.mark.parametrize("cpu_kernel", [False, True])
def test_random_steps_in_one_bucket_compile_once(cpu_kernel):
    """Random ragged steps of one shape: every mix of prefill, chunked prefill and decode, and
    contexts from one token to many pages, through one compilation."""
    traces = []
    tiles = {**SMALL_TILES, "cpu_kernel": cpu_kernel}

    @jax.jit
    def attention(q, cache, metadata):
        traces.append(1)
        return ragged_paged_attention_xla(q, cache, 1, metadata, scale=0.125, **tiles)

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


@pytest.mark.parametrize("group", range(1, cpu_attention.MAX_GROUP + 1))
def test_kernel_every_group_size(group):
    """Every group size the kernel specialises, with block sizes whose pages end mid-vector
    (5, 12), head_dims with a tail vector (80 = 10 x 8 floats, 40), sliding windows, decode
    contexts of 1 key up to many pages, and prefill chunks that start at 0 or mid-context,
    span several 32-query tiles, and end mid-tile."""
    seqs = [(1, 1), (5, 9), (1, 61), (70, 130), (1, 17), (33, 33), (2, 50)]
    for block_size, head_dim, window in [(5, 80, None), (12, 64, 23), (16, 40, None), (8, 32, 5)]:
        q, cache, metadata = make_case(
            group, seqs, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim,
            num_tokens_padded=120, num_seqs_padded=9,
        )  # fmt: skip
        kwargs = dict(scale=head_dim**-0.5, sliding_window=window)
        assert cpu_attention.supports(q, cache)
        out = cpu_attention.paged_attention_cpu(q, cache, 1, metadata, **kwargs)
        assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


def test_kernel_soft_cap_and_long_prefill():
    """A logit soft cap, and a 300-token prefill over a 400-token context (ten query tiles,
    keys from earlier chunks) next to decode rows."""
    q, cache, metadata = make_case(
        11, [(300, 400), (1, 200), (1, 3)], block_size=64, num_kv_heads=3, group=3, head_dim=64
    )
    kwargs = dict(scale=0.125, soft_cap=5.0)
    out = cpu_attention.paged_attention_cpu(q, cache, 1, metadata, **kwargs)
    assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


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


def test_failed_kernel_build_falls_back_to_xla_loops(monkeypatch):
    def no_compiler():
        raise RuntimeError("no C++ compiler found")

    q, cache, metadata = make_case(
        4, MIXED, block_size=16, num_kv_heads=2, group=2, head_dim=64, max_blocks_per_seq=5
    )
    monkeypatch.setattr(cpu_kernels, "_build", no_compiler)
    cpu_kernels.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
            assert not cpu_attention.supports(q, cache)
        out = ragged_paged_attention_xla(q, cache, 1, metadata, scale=0.125)
    finally:
        cpu_kernels.available.cache_clear()
    assert_matches(out, expected(q, cache, 1, metadata, scale=0.125), metadata, jnp.float32)


def test_kernel_clips_a_bad_block_table_into_the_pool():
    """Tables are checked where they are built; if one slips through, the C++ kernel clips page
    ids, lengths and the layer into range (as the XLA loops clip their gathers) instead of
    reading outside the pool."""
    q, cache, metadata = make_case(
        5, [(1, 40), (1, 7), (6, 30)], block_size=8, num_kv_heads=2, group=3, head_dim=32
    )
    bad = dataclasses.replace(
        metadata,
        block_tables=jnp.full_like(metadata.block_tables, 10**6).at[1].set(-5),
        seq_lens=metadata.seq_lens.at[0].set(10**6),
    )
    out = cpu_attention.paged_attention_cpu(q, cache, 10**3, bad, scale=0.125)
    assert np.isfinite(np.asarray(out)).all()
