"""The dense training forward (`models/training.py`) on the engine's own C++ kernels, so that
its logprobs are the batch-invariant engine's bit for bit (`docs/batch_invariance.md`).

A float32 model of many layers magnifies a last-bit difference anywhere into logprob
differences far above rounding, so agreeing "to rounding" means agreeing exactly. The
engine's matmul kernel sums each output over k in order whatever the rows, and its attention
with `invariant` runs every query by its decode path; here the same two kernels run the
dense forward, the attention over a pool of the same block size built from the dense keys.
Gradients are XLA's: each kernel is a `jax.custom_vjp` whose backward is the VJP of the XLA
computation it replaces (the same function, rounded otherwise).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.grouped_matmul import ExpertTiles, grouped_matmul_xla
from kernels_pallas.kv_cache import KVCache, write_kv
from kernels_pallas.metadata import AttentionMetadata
from models.config import ModelConfig
from models.llama import MATMUL_WEIGHTS, Params
from models.moe import EXPERT_MATMULS, ROUTER_MATMULS
from models.training import DenseKernels, dense_causal_attention
from pagedjax.cpu_native.attention import paged_attention_cpu
from pagedjax.cpu_native.matmul import (
    PackedWeight,
    expert_panels,
    grouped_packed_matmul,
    panels,
)


@jax.custom_vjp
def kernel_matmul(x: jax.Array, w: jax.Array) -> jax.Array:  # [M, K] @ [K, N] -> [M, N]
    """x @ w by the C++ packed matmul: the engine's product of the same float32 values."""
    packed = PackedWeight(panels(w.astype(jnp.float32), jnp), w.shape[1])
    return packed.matmul(x).astype(x.dtype)


def _matmul_fwd(x, w):
    return kernel_matmul(x, w), (x, w)


def _matmul_bwd(residuals, g):
    x, w = residuals
    return (g @ w.T).astype(x.dtype), (x.T @ g).astype(w.dtype)


kernel_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelLayers:
    """A plain float32 [L, K, N] stacked weight, multiplied by the kernel (differentiably)."""

    weight: jax.Array

    def layer_matmul(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        return kernel_matmul(x, self.weight[layer])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelHead:
    """A plain float32 [H, V] LM head (or the tied embeddings' transpose), multiplied by the
    kernel; lookups read the embeddings, which are the same values."""

    weight: jax.Array

    def matmul(self, x: jax.Array) -> jax.Array:
        return kernel_matmul(x, self.weight)

    def take_columns(self, ids: jax.Array) -> jax.Array:
        return self.weight.T[ids]


@jax.custom_vjp
def kernel_grouped_matmul(
    x: jax.Array, w: jax.Array, groups: jax.Array, counts: jax.Array
) -> jax.Array:  # [P, K], [G, K, N], [NT], [NT] -> [P, N]
    """Each tile of x's rows times its group's weight by the C++ grouped kernel: the engine's
    products of the same float32 values (`matmul.PackedExperts`)."""
    grouped = expert_panels(w.astype(jnp.float32), jnp)
    return grouped_packed_matmul(x, grouped, groups, counts, w.shape[2])


def _grouped_fwd(x, w, groups, counts):
    return kernel_grouped_matmul(x, w, groups, counts), (x, w, groups, counts)


def _grouped_bwd(residuals, g):
    x, w, groups, counts = residuals
    _, vjp = jax.vjp(lambda x, w: grouped_matmul_xla(x, w, groups), x, w)
    zeros = np.zeros(groups.shape, jax.dtypes.float0)
    return (*vjp(g), zeros, zeros)


kernel_grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelExperts:
    """A mixture's plain float32 [M, E, K, N] expert weights, multiplied by the grouped
    kernel (differentiably)."""

    weight: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def grouped_matmul(self, x: jax.Array, layer: jax.Array, tiles: ExpertTiles) -> jax.Array:
        weight = self.weight.reshape(-1, *self.weight.shape[2:])
        groups = tiles.groups(layer, self.weight.shape[1])
        return kernel_grouped_matmul(x, weight, groups, tiles.tile_counts)


def prepare(params: Params) -> Params:
    """Plain float32 params with each matmul weight multiplied by the kernel, in the engine's
    structure (`matmul.pack_params`); weights a platform already packed stay as they are."""
    layers = dict(params["layers"])
    for name in MATMUL_WEIGHTS + ROUTER_MATMULS:
        if isinstance(layers.get(name), jax.Array):
            layers[name] = KernelLayers(layers[name])
    for name in EXPERT_MATMULS:
        if isinstance(layers.get(name), jax.Array):
            layers[name] = KernelExperts(layers[name])
    head = params.get("lm_head")
    if head is None:  # tied: the engine multiplies the embeddings' transpose
        head = KernelHead(params["embed"].T)
    elif isinstance(head, jax.Array):
        head = KernelHead(head)
    return {**params, "layers": layers, "lm_head": head}


def _pool(
    k: jax.Array, v: jax.Array, batch: int, length: int, block_size: int
) -> KVCache:  # [B * T, Hkv, D] each -> a one-layer pool of B * T' / bs blocks
    """The keys and values written as the engine writes a step's (`write_kv`'s scatter), row
    b's tokens into blocks b * T' / bs onwards (T' = T rounded up to whole blocks).

    Written, not reshaped: XLA:CPU fuses each product into the add that consumes it when both
    land in one fusion, so the rotary embedding rounds otherwise when fused into a transpose
    than into the engine's scatter."""
    heads, dim = k.shape[1:]
    blocks = -(-length // block_size)
    shape = (1, heads, batch * blocks, block_size, dim)
    pool = KVCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    positions = jnp.arange(length, dtype=jnp.int32)
    slots = (jnp.arange(batch, dtype=jnp.int32)[:, None] * blocks * block_size + positions).ravel()
    return write_kv(pool, 0, k, v, slots)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5, 7))
def _kernel_attention(config, q, k, v, batch, length, sliding_window, block_size):
    blocks = -(-length // block_size)
    rows = jnp.arange(batch, dtype=jnp.int32)
    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros((0,), jnp.int32),  # the kernel does not write
        block_tables=rows[:, None] * blocks + jnp.arange(blocks, dtype=jnp.int32)[None, :],
        seq_lens=jnp.full((batch,), length, jnp.int32),
        query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32) * length,
        num_seqs=jnp.asarray(batch, jnp.int32),
        num_tokens=jnp.asarray(batch * length, jnp.int32),
    )
    return paged_attention_cpu(
        q,
        _pool(k, v, batch, length, block_size),
        0,
        metadata,
        scale=config.attention_scale,
        sliding_window=sliding_window,
        soft_cap=config.attn_logit_softcap,
        invariant=True,
    )


def _attention_fwd(config, q, k, v, batch, length, sliding_window, block_size):
    out = _kernel_attention(config, q, k, v, batch, length, sliding_window, block_size)
    return out, (q, k, v, sliding_window)


def _attention_bwd(config, batch, length, block_size, residuals, g):
    q, k, v, sliding_window = residuals

    def xla(q, k, v):
        return dense_causal_attention(config, q, k, v, batch, length, sliding_window)

    _, vjp = jax.vjp(xla, q, k, v)
    return (*vjp(g), np.zeros(sliding_window.shape, jax.dtypes.float0))


_kernel_attention.defvjp(_attention_fwd, _attention_bwd)


def kernel_attention(
    block_size: int,
    config: ModelConfig,
    q: jax.Array,  # [B * T, heads, D]
    k: jax.Array,  # [B * T, kv_heads, D]
    v: jax.Array,
    batch: int,
    length: int,
    sliding_window: jax.Array,
) -> jax.Array:  # [B * T, heads, D]
    """`models.training.dense_causal_attention` by the engine's batch-invariant C++ attention
    over pages of `block_size` tokens (a sliding window's slices of 8 keys start at its first
    page's boundary, so the engine's block size)."""
    window = jnp.asarray(sliding_window, jnp.int32)
    return _kernel_attention(config, q, k, v, batch, length, window, block_size)


@functools.cache
def dense_kernels(block_size: int) -> DenseKernels:
    """The dense forward's kernels for an engine of `block_size`-token blocks (one object per
    size: the jitted forward takes it as a static argument)."""
    return DenseKernels(functools.partial(kernel_attention, block_size), prepare)
