"""The attention backend contract: what the model calls, and what the runner must know of it.

A backend computes causal ragged paged attention for a step's flat batch of new tokens over
the pool laid out by `kv_cache` (K and V each [L, Hkv, num_blocks, block_size, D], pages
reached through `AttentionMetadata.block_tables`), with the result of
`reference.ragged_paged_attention`, the oracle. Backends are frozen dataclasses (hashable: the
jitted step takes one as a static argument); the engine's are registered in
`pagedjax/attention.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import jax

from kernels_pallas.kv_cache import KV_LAYOUT, KVCache, write_kv
from kernels_pallas.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend is asked to run: the model's heads and the pool's dtype and pages."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str  # a jnp dtype name: "float32", "bfloat16", "float8_e4m3fn", ...
    block_size: int
    sinks: bool = False  # the model's softmax has a sink logit per head (gpt-oss)


@runtime_checkable
class AttentionBackend(Protocol):
    """One attention implementation, as the model and the model runner see it."""

    name: str
    # The pool layout it reads: `kv_cache.KV_LAYOUT` ([L, Hkv, num_blocks, block_size, D]).
    kv_layout: str
    # True when the cost follows each sequence's real context, whatever the block-table
    # width: the runner then gives it one width (max_model_len's) and buckets only tokens.
    # False: the runner buckets the width to the step's longest context (powers of two).
    cost_follows_context: bool
    # True when decode-only steps (every sequence one new token) have a kernel of their own:
    # the runner then passes `decode_only=True/False` per step, statically (one compiled
    # variant each). False: the runner never passes it, and the flag is no compile key.
    has_decode_kernel: bool

    def supports(self, spec: AttentionSpec) -> str | None:
        """None if this backend runs `spec` on this machine, else the reason it cannot."""
        ...

    def __call__(
        self,
        q: jax.Array,  # [T, Hq, D]
        cache: KVCache,
        layer: jax.Array | int,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: jax.Array | int | None = None,  # 0 or None: unlimited
        soft_cap: float | None = None,
        decode_only: bool | None = None,  # True: every q_len <= 1; None: unknown; else ignored
        sinks: jax.Array | None = None,  # [Hq] float32 sink logits: only where spec.sinks
    ) -> jax.Array:  # [T, Hq, D] in q's dtype; rows of padding tokens stay finite
        ...


def _runs_anything(spec: AttentionSpec) -> str | None:
    return None


@dataclass(frozen=True)
class FunctionBackend:
    """An attention backend made of a function with the contract's call signature."""

    name: str
    fn: Callable[..., jax.Array]  # fn(q, cache, layer, metadata, *, scale, sliding_window, ...)
    cost_follows_context: bool
    check: Callable[[AttentionSpec], str | None] = _runs_anything  # supports(spec)
    kv_layout: str = KV_LAYOUT
    has_decode_kernel: bool = False  # True: fn takes a `decode_only` keyword
    takes_sinks: bool = False  # True: fn takes `sinks` (else it refuses specs with sinks)
    # How the model writes a step's new K/V into the pool before calling the backend (an
    # optional attribute of any backend; `kv_cache.write_kv`'s arguments and result).
    write_kv: Callable[..., KVCache] = write_kv
    # The most blocks (up to the first argument) of a pool with this many elements per block
    # and this dtype that the backend reads at full speed; the engine sizes a pool it derives
    # from memory with it (an optional attribute of any backend; None: any number).
    fit_num_blocks: Callable[[int, int, Any], int] | None = None

    def supports(self, spec: AttentionSpec) -> str | None:
        if spec.sinks and not self.takes_sinks:
            return "it has no attention sinks (gpt-oss)"
        return self.check(spec)

    def __call__(
        self,
        q: jax.Array,
        cache: KVCache,
        layer: jax.Array | int,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: jax.Array | int | None = None,
        soft_cap: float | None = None,
        decode_only: bool | None = None,
        sinks: jax.Array | None = None,
    ) -> jax.Array:
        # Functions without a decode kernel do not take the flag; it changes nothing for them.
        extra = {"decode_only": decode_only} if self.has_decode_kernel else {}
        if sinks is not None:
            extra["sinks"] = sinks
        return self.fn(
            q,
            cache,
            layer,
            metadata,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            **extra,
        )
