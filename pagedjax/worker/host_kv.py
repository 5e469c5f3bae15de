"""The host tier's data: K and V of the swapped-out blocks in host memory, and the copies
between it and the device pool (the block ids are the KV cache manager's,
`pagedjax/core/host_pool.py`).

Copies out are gathered on the device in one transfer per step and land on the host
asynchronously; they are written into the host arrays only when a copy in needs them (or
the next step's copies out come), so a step that swaps never waits for its own transfer. A
copy in is one host gather and one transfer, scattered into the donated pool. Transfers are
padded to a power of two of blocks: a few compiled shapes, whatever the count.

Over several processes (`pagedjax/distributed.py`) each process makes the same calls and
keeps the heads of its own devices' shards: the host arrays have every head's shape, but a
process writes and reads only its own (the others' pages are never touched, so never mapped).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_cache import NULL_BLOCK, KVCache, read_blocks, write_blocks
from pagedjax.core.memory import KVCacheSpec

_read_blocks = jax.jit(read_blocks)
_write_blocks = jax.jit(write_blocks, donate_argnames=("cache",))


def _padded(ids: Sequence[int]) -> np.ndarray:
    """Block ids padded with NULL_BLOCK to a power of two."""
    size = 1 << max(len(ids) - 1, 0).bit_length()
    out = np.full(size, NULL_BLOCK, np.int32)
    out[: len(ids)] = ids
    return out


class HostKV:
    """`num_blocks` blocks of K and V in host memory, in the pool's layout
    ([num_layers, num_kv_heads, num_blocks, block_size, head_dim] each)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        sharding: jax.sharding.Sharding | None = None,
    ) -> None:
        """sharding: where blocks copied in go before the scatter (the pool's K sharding
        under tensor parallelism); None: the default device."""
        shape = (spec.num_layers, spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
        # np.zeros maps pages lazily: host memory is used only by blocks swapped out.
        self.k = np.zeros(shape, jnp.dtype(spec.dtype))
        self.v = np.zeros(shape, jnp.dtype(spec.dtype))
        self.sharding = sharding
        self._pending: list[tuple[list[int], jax.Array, jax.Array]] = []

    def copy_out(self, cache: KVCache, pairs: Sequence[tuple[int, int]]) -> None:
        """Starts copying device blocks to host blocks: (device id, host id) pairs."""
        if not pairs:
            return
        self.resolve(wait=False)  # keeps the device buffers of finished copies from piling up
        device_ids, host_ids = zip(*pairs, strict=True)
        k, v = _read_blocks(cache, _padded(device_ids))
        for array in (k, v):
            for shard in array.addressable_shards:
                shard.data.copy_to_host_async()
        self._pending.append((list(host_ids), k, v))

    def resolve(self, wait: bool = True) -> None:
        """Writes the copies out that are in flight into the host arrays, in their order (a
        host block may be written twice); wait=False: only those that have landed."""
        done = 0
        for host_ids, k, v in self._pending:
            if not wait and not (k.is_ready() and v.is_ready()):
                break
            n = len(host_ids)
            for host, array in ((self.k, k), (self.v, v)):
                for shard in array.addressable_shards:  # this process's heads
                    layers, heads = shard.index[:2]
                    host[layers, heads][:, :, host_ids] = np.asarray(shard.data)[:, :, :n]
            done += 1
        del self._pending[:done]

    def copy_in(self, cache: KVCache, pairs: Sequence[tuple[int, int]]) -> KVCache:
        """The pool with host blocks copied into device blocks: (host id, device id) pairs;
        the pool is donated."""
        if not pairs:
            return cache
        self.resolve()
        host_ids, device_ids = zip(*pairs, strict=True)
        rows = _padded(host_ids)
        rows[len(host_ids) :] = host_ids[0]  # any real block: the padding lands in NULL_BLOCK
        k, v = self.k[:, :, rows], self.v[:, :, rows]  # numpy copies, made now
        if self.sharding is not None:  # each device gets its heads from its own process
            k, v = (
                jax.make_array_from_callback(x.shape, self.sharding, lambda index, x=x: x[index])
                for x in (k, v)
            )
        return _write_blocks(cache, _padded(device_ids), k, v)
