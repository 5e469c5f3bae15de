"""The KV pool write: tokens land in their slots; padding writes nothing anywhere."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_cache import PAD_SLOT, allocate_kv_cache, write_kv


def test_write_lands_in_slots_and_padding_writes_nothing():
    layers, heads, blocks, block_size, dim = 2, 3, 4, 4, 8
    cache = allocate_kv_cache(layers, heads, blocks, block_size, dim)
    k = jnp.arange(3 * heads * dim, dtype=jnp.float32).reshape(3, heads, dim) + 1
    v = -k
    slots = jnp.array([PAD_SLOT, 6, -7], jnp.int32)  # block 1 offset 2; two padding tokens
    cache = write_kv(cache, 1, k, v, slots)
    expected_k = np.zeros((layers, heads, blocks, block_size, dim), np.float32)
    expected_k[1, :, 1, 2] = np.asarray(k[1])
    np.testing.assert_array_equal(np.asarray(cache.k), expected_k)
    np.testing.assert_array_equal(np.asarray(cache.v), -expected_k)
