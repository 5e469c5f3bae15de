"""The CPU's C++ attention kernel (the "cpu_native" backend) against the per-token oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import MIXED, RAGGED_CASES, assert_matches, expected, make_case, ragged_case

from kernels_pallas.backend import AttentionSpec
from kernels_pallas.kv_cache import KVCache, quantize, write_kv
from pagedjax.cpu_native import build
from pagedjax.cpu_native.attention import (
    CPU_NATIVE,
    MAX_GROUP,
    paged_attention_cpu,
    write_kv_cpu,
)
from pagedjax.platforms.cpu import cpu_platform

NARROW_DTYPES = ["bfloat16", "float16", "float8_e4m3fn"]  # pools widened as they are read


def test_the_kernel_builds_and_serves_its_pool_dtypes():
    assert build.available()
    for kv_dtype in ["float32", *NARROW_DTYPES]:
        assert CPU_NATIVE.supports(AttentionSpec(8, 2, 64, kv_dtype, 16)) is None
    assert "not float8_e5m2" in CPU_NATIVE.supports(AttentionSpec(8, 2, 64, "float8_e5m2", 16))
    assert "at most 8" in CPU_NATIVE.supports(AttentionSpec(18, 1, 64, "float32", 16))
    # The CPU's "auto" takes the kernel for a bf16 pool too (the default model's heads).
    auto = cpu_platform().attention_backend("auto", AttentionSpec(9, 3, 64, "bfloat16", 64))
    assert auto.name == "cpu_native"


@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim,kv_dtype,window,soft_cap,layer",
    [c[1:] for c in RAGGED_CASES],
    ids=[c[0] for c in RAGGED_CASES],
)
def test_matches_reference(
    block_size, num_kv_heads, group, head_dim, kv_dtype, window, soft_cap, layer
):
    """Every shared case, bf16 and fp16 pools included (their queries and output are bf16, so
    the tolerance is bf16's; the next test compares in float32)."""
    q, cache, metadata, kwargs = ragged_case(
        block_size, num_kv_heads, group, head_dim, kv_dtype, window, soft_cap, layer
    )
    out = jax.jit(CPU_NATIVE, static_argnames=("scale", "soft_cap"))(
        q, cache, jnp.int32(layer), metadata, **kwargs
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, expected(q, cache, layer, metadata, **kwargs), metadata, kv_dtype)


def narrow_pool(cache: KVCache, kv_dtype: str, seed: int) -> tuple[KVCache, KVCache]:
    """The case's float32 pool stored as `kv_dtype`, a tenth of its values near 1e-6 (fp16
    subnormals), fp8 quantized with scales that differ per layer and KV head; and the same
    values widened to a float32 pool, scales applied."""
    rng = np.random.default_rng(seed)
    num_layers, num_kv_heads = cache.k.shape[:2]
    narrow, wide, scales = [], [], []
    for pool in (cache.k, cache.v):
        pool = jnp.where(rng.random(pool.shape) < 0.1, pool * 1e-6, pool)
        if kv_dtype == "float8_e4m3fn":
            scale = jnp.asarray(rng.uniform(0.05, 3.0, (num_layers, num_kv_heads)), jnp.float32)
            per_page = scale[:, :, None, None, None]
            stored = quantize(pool, per_page, jnp.float8_e4m3fn).astype(jnp.float8_e4m3fn)
            wide.append(stored.astype(jnp.float32) * per_page)
            scales.append(scale)
        else:
            stored = pool.astype(kv_dtype)
            wide.append(stored.astype(jnp.float32))
        narrow.append(stored)
    return KVCache(*narrow, *scales), KVCache(*wide)


@pytest.mark.parametrize("kv_dtype", NARROW_DTYPES)
def test_narrow_pools_give_the_float32_result_of_their_values(kv_dtype):
    """A bf16, fp16 or fp8 pool is widened to float32 exactly as it is read: the result is the
    kernel's on the same values in a float32 pool, bit for bit, and the oracle's within float32
    rounding. Decode rows next to prefill chunks (one spanning three query tiles), a GQA group
    of 3, pages ending mid-vector, a head_dim with a tail vector, layer 1 of 2 (fp8 scales
    differ per layer), with and without a sliding window and a soft cap."""
    q, cache, metadata = make_case(
        21, [*MIXED, (40, 90)], block_size=12, num_kv_heads=2, group=3, head_dim=40,
        q_dtype=jnp.float32, num_tokens_padded=120,
    )  # fmt: skip
    narrow, wide = narrow_pool(cache, kv_dtype, seed=22)
    assert narrow.k.dtype == kv_dtype and (narrow.k_scale is None) == (kv_dtype != "float8_e4m3fn")
    for window, soft_cap in [(None, None), (23, 5.0)]:
        kwargs = dict(scale=40**-0.5, sliding_window=window, soft_cap=soft_cap)
        out = paged_attention_cpu(q, narrow, 1, metadata, **kwargs)
        np.testing.assert_array_equal(out, paged_attention_cpu(q, wide, 1, metadata, **kwargs))
        assert_matches(out, expected(q, wide, 1, metadata, **kwargs), metadata, jnp.float32)


@pytest.mark.parametrize("invariant", [False, True], ids=["tiles", "invariant"])
@pytest.mark.parametrize("group", range(1, MAX_GROUP + 1))
def test_kernel_every_group_size(group, invariant):
    """Every group size the kernel specialises, with block sizes whose pages end mid-vector
    (5, 12), head_dims with a tail vector (80 = 10 x 8 floats, 40), sliding windows, decode
    contexts of 1 key up to many pages, and prefill chunks that start at 0 or mid-context,
    span several 32-query tiles, and end mid-tile; by prefill tiles and, batch invariant, by
    the decode path for every query."""
    seqs = [(1, 1), (5, 9), (1, 61), (70, 130), (1, 17), (33, 33), (2, 50)]
    for block_size, head_dim, window in [(5, 80, None), (12, 64, 23), (16, 40, None), (8, 32, 5)]:
        q, cache, metadata = make_case(
            group, seqs, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim,
            num_tokens_padded=120, num_seqs_padded=9,
        )  # fmt: skip
        kwargs = dict(scale=head_dim**-0.5, sliding_window=window)
        out = paged_attention_cpu(q, cache, 1, metadata, **kwargs, invariant=invariant)
        assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


def test_kernel_soft_cap_and_long_prefill():
    """A logit soft cap, and a 300-token prefill over a 400-token context (ten query tiles,
    keys from earlier chunks) next to decode rows."""
    q, cache, metadata = make_case(
        11, [(300, 400), (1, 200), (1, 3)], block_size=64, num_kv_heads=3, group=3, head_dim=64
    )
    kwargs = dict(scale=0.125, soft_cap=5.0)
    want = expected(q, cache, 1, metadata, **kwargs)
    for invariant in (False, True):
        out = paged_attention_cpu(q, cache, 1, metadata, **kwargs, invariant=invariant)
        assert_matches(out, want, metadata, jnp.float32)


def test_failed_kernel_build_leaves_the_cpu_on_xla(monkeypatch):
    """Without a compiler the build warns once, the platform's "auto" attention is XLA's
    loops, and asking for the kernel by name says why it cannot run."""

    def no_compiler(level):
        raise RuntimeError("no C++ compiler found")

    q, cache, metadata = make_case(
        4, MIXED, block_size=16, num_kv_heads=2, group=2, head_dim=64, max_blocks_per_seq=5
    )
    spec = AttentionSpec(4, 2, 64, "float32", 16)
    monkeypatch.setattr(build, "_build", no_compiler)
    build.load.cache_clear()
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
        build.load.cache_clear()
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


@pytest.mark.parametrize("kv_dtype", ["float32", *NARROW_DTYPES])
def test_the_backends_write_stores_what_write_kv_stores(kv_dtype):
    """The backend writes a step's K/V itself (16- and 8-bit pools in place, in C++), leaving
    the pool `write_kv` leaves, bit for bit: the same rounding (fp8: over its layer's scales,
    saturated), padding slots and slots past the pool dropped, other layers untouched; jitted
    with the pool donated, as the engine runs it."""
    rng = np.random.default_rng(5)
    shape = (2, 3, 6, 4, 16)  # layers, KV heads, blocks, block size, head_dim
    k, v = (jnp.asarray(rng.normal(size=shape), kv_dtype) for _ in range(2))
    scales = [jnp.asarray(rng.uniform(0.1, 2.0, shape[:2]), jnp.float32) for _ in range(2)]
    scales = scales if kv_dtype == "float8_e4m3fn" else []
    new_k, new_v = (jnp.asarray(rng.normal(size=(7, 3, 16)), jnp.float32) for _ in range(2))
    new_k = new_k.at[0, 0, :4].set(1e4)  # past fp8's range: saturates
    slots = jnp.array([5, 0, 23, -1, 24, 9, 10**6], jnp.int32)  # 24: one past the pool
    want = write_kv(KVCache(k, v, *scales), 1, new_k, new_v, slots)
    pool = KVCache(*(jnp.array(x, copy=True) for x in (k, v, *scales)))
    got = jax.jit(write_kv_cpu, donate_argnums=0)(pool, jnp.int32(1), new_k, new_v, slots)
    for a, b in ((got.k, want.k), (got.v, want.v)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
