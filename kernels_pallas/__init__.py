"""Paged attention for JAX: the KV pool, a step's metadata, and the attention over them.

- `kv_cache.py`: the pool's layout (K and V each [L, Hkv, num_blocks, block_size, D]), the
  write of a step's new K/V into it, block copies.
- `metadata.py`: `AttentionMetadata`, the step's flat ragged batch of new tokens mapped onto
  the pool's pages; `next_power_of_2`, the bucket of a padded dimension; `pad_block_tables`,
  a table widened to whole tiles of pages.
- `backend.py`: the contract, `AttentionBackend` and `AttentionSpec`.
- `reference.py`: the pure-jnp oracle every implementation must match; `MASK_VALUE`.
- `xla_attention.py`: the same attention as XLA loops, for hosts without the Pallas kernels.
- `pallas_common.py`: what the two Pallas kernels share (tile loop, online softmax, fp8
  upcast, scales, launch).
- `ragged_paged_attention.py`: the Pallas kernel for any mix of prefill chunks and decode
  tokens.
- `decode_attention.py`: the split-K Pallas kernel for decode-only batches.
- `paged_attention.py`: the Pallas entry point `paged_attention`, which picks a kernel, and
  `PALLAS`, the same as an `AttentionBackend`.

The CPU-native C++ kernels are not part of this package: they live in `pagedjax/cpu_native/`.
Import from the submodules; importing the package imports nothing else (the engine imports
`kv_cache` on every start, without Pallas).
"""
