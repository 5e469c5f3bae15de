"""The CPU's C++ attention kernel (the "cpu_native" backend) against the per-token oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import MIXED, RAGGED_CASES, assert_matches, expected, make_case, ragged_case

from kernels_pallas.backend import AttentionSpec
from pagedjax.cpu_native import build
from pagedjax.cpu_native.attention import CPU_NATIVE, MAX_GROUP, paged_attention_cpu
from pagedjax.platforms.cpu import cpu_platform


def test_the_kernel_builds_and_serves_float32_pools():
    assert build.available()
    assert CPU_NATIVE.supports(AttentionSpec(8, 2, 64, "float32", 16)) is None
    assert "float32" in CPU_NATIVE.supports(AttentionSpec(8, 2, 64, "bfloat16", 16))
    assert "at most 8" in CPU_NATIVE.supports(AttentionSpec(18, 1, 64, "float32", 16))


FLOAT32_CASES = [c for c in RAGGED_CASES if c[5] == jnp.float32]


@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim,kv_dtype,window,soft_cap,layer",
    [c[1:] for c in FLOAT32_CASES],
    ids=[c[0] for c in FLOAT32_CASES],
)
def test_matches_reference(
    block_size, num_kv_heads, group, head_dim, kv_dtype, window, soft_cap, layer
):
    q, cache, metadata, kwargs = ragged_case(
        block_size, num_kv_heads, group, head_dim, kv_dtype, window, soft_cap, layer
    )
    out = jax.jit(CPU_NATIVE, static_argnames=("scale", "soft_cap"))(
        q, cache, jnp.int32(layer), metadata, **kwargs
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, expected(q, cache, layer, metadata, **kwargs), metadata, kv_dtype)


@pytest.mark.parametrize("group", range(1, MAX_GROUP + 1))
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
        out = paged_attention_cpu(q, cache, 1, metadata, **kwargs)
        assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


def test_kernel_soft_cap_and_long_prefill():
    """A logit soft cap, and a 300-token prefill over a 400-token context (ten query tiles,
    keys from earlier chunks) next to decode rows."""
    q, cache, metadata = make_case(
        11, [(300, 400), (1, 200), (1, 3)], block_size=64, num_kv_heads=3, group=3, head_dim=64
    )
    kwargs = dict(scale=0.125, soft_cap=5.0)
    out = paged_attention_cpu(q, cache, 1, metadata, **kwargs)
    assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


def test_failed_kernel_build_leaves_the_cpu_on_xla(monkeypatch):
    """Without a compiler the build warns once, the platform's "auto" attention is XLA's
    loops, and asking for the kernel by name says why it cannot run."""

    def no_compiler():
        raise RuntimeError("no C++ compiler found")

    q, cache, metadata = make_case(
        4, MIXED, block_size=16, num_kv_heads=2, group=2, head_dim=64, max_blocks_per_seq=5
    )
    spec = AttentionSpec(4, 2, 64, "float32", 16)
    monkeypatch.setattr(build, "_build", no_compiler)
    build.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
            platform = cpu_platform()
        assert not platform.native
        backend = platform.attention_backend("auto", spec)
        assert backend.name == "xla"
        with pytest.raises(ValueError, match="cpu_native: the C\\+\\+ kernels are not built"):
            platform.attention_backend("cpu_native", spec)
        out = backend(q, cache, 1, metadata, scale=0.125)
    finally:
        build.available.cache_clear()
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
    out = paged_attention_cpu(q, cache, 10**3, bad, scale=0.125)
    assert np.isfinite(np.asarray(out)).all()
