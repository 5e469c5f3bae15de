"""The KV pool write: tokens land in their slots; padding writes nothing anywhere."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_cache import PAD_SLOT, KVCache, allocate_kv_cache, write_kv
from pagedjax.core.memory import KVCacheSpec


def test_write_lands_in_slots_and_padding_writes_nothing():
    layers, heads, blocks, block_size, dim = 2, 3, 4, 4, 8
    cache = allocate_kv_cache(KVCacheSpec(layers, heads, dim, jnp.float32), blocks, block_size)
    k = jnp.arange(3 * heads * dim, dtype=jnp.float32).reshape(3, heads, dim) + 1
    v = -k
    slots = jnp.array([PAD_SLOT, 6, -7], jnp.int32)  # block 1 offset 2; two padding tokens
    cache = write_kv(cache, 1, k, v, slots)
    expected_k = np.zeros((layers, heads, blocks, block_size, dim), np.float32)
    expected_k[1, :, 1, 2] = np.asarray(k[1])
    np.testing.assert_array_equal(np.asarray(cache.k), expected_k)
    np.testing.assert_array_equal(np.asarray(cache.v), -expected_k)


def test_fp8_pool_quantizes_with_its_scales_on_write():
    cache = allocate_kv_cache(KVCacheSpec(2, 2, 8, jnp.float8_e4m3fn), 3, 4)
    assert cache.k.dtype == jnp.float8_e4m3fn and cache.k_scale.shape == (2, 2)
    cache = KVCache(cache.k, cache.v, cache.k_scale.at[1, 1].set(0.5), cache.v_scale * 2)
    k = jnp.linspace(-3, 3, 2 * 2 * 8, dtype=jnp.float32).reshape(2, 2, 8)
    cache = write_kv(cache, 1, k, k, jnp.array([5, PAD_SLOT], jnp.int32))
    stored_k = np.asarray(cache.k[1, :, 1, 1].astype(jnp.float32))  # [heads, D]
    stored_v = np.asarray(cache.v[1, :, 1, 1].astype(jnp.float32))
    np.testing.assert_allclose(stored_k[0], np.asarray(k[0, 0]), rtol=0.07)  # scale 1
    np.testing.assert_allclose(stored_k[1], np.asarray(k[0, 1]) / 0.5, rtol=0.07)
    np.testing.assert_allclose(stored_v, np.asarray(k[0]) / 2, rtol=0.07)
