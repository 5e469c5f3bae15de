"""The mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss): route, run the chosen
experts as one grouped matmul, add their outputs by routing weight.

Its weights, stacked over the M expert layers (a layer's index among them: `layer` below):

    router           [M, H, E]
    experts_gate_up  [M, E, H, 2 I]    each expert's gate and up projections, fused
    experts_down     [M, E, I, H]
    shared_gate_up   [M, H, 2 Is]      Qwen2-MoE's shared expert only
    shared_down      [M, Is, H]
    shared_gate      [M, H, 1]
    router_bias      [M, E]            gpt-oss only
    experts_gate_up_bias [M, E, 2 I]   gpt-oss only
    experts_down_bias    [M, E, H]     gpt-oss only

The experts run on tokens sorted by expert in tiles (`kernels_pallas/grouped_matmul.py`): the
work is T x k rows, not T x E. An expert weight may be a type of the platform's with a
`grouped_matmul` method (the GPU's Pallas kernel), else XLA gathers each tile's weight.
`moe_mlp_dense` computes every expert for every token instead: the benchmark's peer and the
tests' second opinion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.grouped_matmul import (
    ExpertTiles,
    expert_tiles,
    grouped_matmul_xla,
    tile_rows,
)
from models.config import ModelConfig, MoeConfig
from models.weights import GroupedLinearWeight, layer_matmul

Weights = dict  # name -> a weight stacked over the expert layers (see the module docstring)

# The experts' weights, multiplied by `expert_matmul` (a platform may give them a type of its
# own); the router's and the shared expert's, stacked like the dense MLP's (`layer_matmul`).
EXPERT_MATMULS = ("experts_gate_up", "experts_down")
ROUTER_MATMULS = ("router", "shared_gate_up", "shared_down", "shared_gate")
MOE_WEIGHTS = (
    *EXPERT_MATMULS,
    *ROUTER_MATMULS,
    "router_bias",
    "experts_gate_up_bias",
    "experts_down_bias",
)


def route(moe: MoeConfig, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights [T, k] float32, experts [T, k] int32): the top-k of
    the softmax over all experts in float32 (as transformers computes it), renormalized to
    sum to 1 where the config says so; gpt-oss's softmax over the top-k logits alone. Ties go
    to the lower expert, as torch.topk's."""
    logits = logits.astype(jnp.float32)
    if moe.softmax_after_top_k:
        top, experts = jax.lax.top_k(logits, moe.top_k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), moe.top_k)
    if moe.normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def router_logits(moe: MoeConfig, weights: Weights, h: jax.Array, layer: jax.Array) -> jax.Array:
    """[T, H] -> [T, E]."""
    logits = layer_matmul(h, weights["router"], layer)
    return logits + weights["router_bias"][layer] if moe.router_bias else logits


def expert_glu(moe: MoeConfig, gate_up: jax.Array, activation) -> jax.Array:
    """An expert's [..., 2 I] gate and up -> [..., I]: SwiGLU, or gpt-oss's clamped one."""
    if moe.swiglu_limit is None:
        return swiglu(gate_up, activation)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    gate = jnp.minimum(gate, moe.swiglu_limit)
    up = jnp.clip(up, -moe.swiglu_limit, moe.swiglu_limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * moe.swiglu_alpha))


def expert_matmul(
    x: jax.Array,  # [P, K] rows sorted by expert, in tiles
    weight: jax.Array | GroupedLinearWeight,  # [M, E, K, N]
    layer: jax.Array,  # [] int32, among the expert layers
    tiles: ExpertTiles,
) -> jax.Array:  # [P, N]
    """Each tile's rows times its expert's weight, the platform's way."""
    if isinstance(weight, GroupedLinearWeight):
        return weight.grouped_matmul(x, layer, tiles)
    groups = weight.reshape(-1, *weight.shape[2:])  # the layers' experts: [M x E, K, N]
    return grouped_matmul_xla(x, groups, tiles.groups(layer, weight.shape[1]))


def swiglu(gate_up: jax.Array, activation) -> jax.Array:
    """[..., 2 I] fused gate and up -> act(gate) x up [..., I]."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return activation(gate) * up


def _shared_expert(weights: Weights, h: jax.Array, layer: jax.Array, activation) -> jax.Array:
    """Qwen2-MoE's shared expert, scaled by sigmoid(h @ gate): [T, H] -> [T, H]."""
    hidden = swiglu(layer_matmul(h, weights["shared_gate_up"], layer), activation)
    out = layer_matmul(hidden, weights["shared_down"], layer)
    return jax.nn.sigmoid(layer_matmul(h, weights["shared_gate"], layer)) * out


def moe_mlp(
    config: ModelConfig,
    weights: Weights,
    h: jax.Array,  # [T, H] normed activations
    layer: jax.Array,  # [] int32, among the expert layers
    activation,
    axis_name: str | None = None,
) -> jax.Array:  # [T, H]
    """The experts' sum for each token, from a grouped matmul over its k assignments.

    Expert parallel (under `shard_map` over `axis_name`): the shard holds a contiguous slice
    of the experts and every token (a tensor-parallel group's activations are replicated);
    it routes all of them, computes the assignments to its own experts, and returns its
    partial sum, which the caller's all-reduce completes, as it does the dense MLP's."""
    moe = config.moe
    if moe.dense_experts:
        return moe_mlp_dense(config, weights, h, layer, activation)
    num_tokens = h.shape[0]
    routing, experts = route(moe, router_logits(moe, weights, h, layer))
    here = weights["experts_gate_up"].shape[1]  # a shard's own experts
    if axis_name is not None:  # experts elsewhere go to the dropped group, weighted 0
        local = experts - jax.lax.axis_index(axis_name) * here
        mine = (local >= 0) & (local < here)
        experts, routing = jnp.where(mine, local, here), jnp.where(mine, routing, 0.0)
    tile = tile_rows(num_tokens * moe.top_k, here)
    tiles = expert_tiles(experts, here, tile, dropped=axis_name is not None)
    rows = h[tiles.rows]  # [P, H]

    def project(x: jax.Array, name: str) -> jax.Array:
        out = expert_matmul(x, weights[name], layer, tiles)
        if not moe.expert_bias:
            return out
        return out + weights[f"{name}_bias"][layer][jnp.repeat(tiles.tile_experts, tile)]

    hidden = expert_glu(moe, project(rows, "experts_gate_up"), activation)
    out = project(hidden, "experts_down")  # [P, H]
    picked = out[tiles.positions].astype(jnp.float32)  # [T, k, H]
    if axis_name is not None:  # a dropped row holds zeros or XLA's unread products: select,
        picked = jnp.where(routing[:, :, None] > 0, picked, 0.0)  # so no non-finite leaks
    total = _weighted_sum(picked, routing).astype(h.dtype)
    if moe.shared_intermediate_size:
        total = total + _shared_expert(weights, h, layer, activation)
    return total


def _weighted_sum(picked: jax.Array, routing: jax.Array) -> jax.Array:
    """sum_j routing[t, j] x picked[t, j] in j's order: [T, k, H], [T, k] -> [T, H] float32.
    Elementwise adds, so a token's sum never depends on the step's shape."""
    total = picked[:, 0] * routing[:, 0, None]
    for j in range(1, picked.shape[1]):
        total = total + picked[:, j] * routing[:, j, None]
    return total


def moe_mlp_dense(
    config: ModelConfig,
    weights: Weights,
    h: jax.Array,
    layer: jax.Array,
    activation,
) -> jax.Array:
    """`moe_mlp` with every expert computed for every token ([E, T, ...]) and each token's k
    picked from them: E / k times the work, the same sums."""
    moe = config.moe
    routing, experts = route(moe, router_logits(moe, weights, h, layer))

    def project(x: jax.Array, name: str, spec: str) -> jax.Array:
        out = jnp.einsum(spec, x, weights[name][layer])
        return out + weights[f"{name}_bias"][layer][:, None] if moe.expert_bias else out

    gate_up = project(h, "experts_gate_up", "th,ehn->etn")
    out = project(expert_glu(moe, gate_up, activation), "experts_down", "etn,enh->eth")
    picked = jnp.take_along_axis(jnp.moveaxis(out, 0, 1), experts[:, :, None], axis=1).astype(
        jnp.float32
    )  # [T, k, H]
    total = _weighted_sum(picked, routing).astype(h.dtype)
    if moe.shared_intermediate_size:
        total = total + _shared_expert(weights, h, layer, activation)
    return total
