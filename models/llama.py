"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2 and 3) as pure
functions.

Params are a pytree with the layers stacked on a leading axis:

    embed        [V, H]             absent when a tied LM head weight type serves lookups
    layers:
      attn_norm  [L, H]
      wqkv       [L, H, Q + 2 KV]   q, k and v projections fused at load time
      bqkv       [L, Q + 2 KV]      Qwen2 and gpt-oss only
      sinks      [L, heads]         gpt-oss only: each head's attention-sink logit
      bo         [L, H]             gpt-oss only: the attention output's bias
      q_norm     [L, D]             Qwen3 and Gemma 3 only (per-head RMSNorm weights)
      k_norm     [L, D]             Qwen3 and Gemma 3 only
      wo         [L, Q, H]
      post_attn_norm [L, H]         Gemma only: after the attention, before the residual add
      mlp_norm   [L, H]
      post_mlp_norm  [L, H]         Gemma only: after the MLP
      w_gate_up  [L, H, 2 I]        gate and up projections fused at load time
      w_down     [L, I, H]
      router, experts_gate_up, ...  mixture-of-experts layers' MLP (`models/moe.py`)
    final_norm   [H]
    lm_head      [H, V]             absent when the embeddings are tied and kept as a table

with Q = num_heads * head_dim and KV = num_kv_heads * head_dim. A mixture of experts stacks
its expert layers' weights over those layers only, and the dense MLP's (`w_gate_up`,
`w_down`) over the rest (none where every layer has experts). Gemma's differences are
config fields (`ModelConfig`: scaled embeddings, post-norms, GeGLU, the attention's scale and
soft caps, Gemma 3's local RoPE base); its norms' 1 + w is folded into the weights at load.
The forward scans over layers
(one compiled layer body, whatever the depth) with the paged KV pool in the scan carry. The
layer body takes its attention as a function, so the same layers also run densely, and
differentiably, for training (`models/training.py`).

The four matmul weights and the LM head may also be weight types that know how to multiply
(`models/weights.py`): GGUF block codes widened in XLA, or a platform's packed layout. The
model code calls their methods and never asks which platform it runs on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas.kv_cache import KVCache, write_kv
from kernels_pallas.kv_groups import kv_cache_groups
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.reference import ragged_paged_attention
from models.config import ModelConfig
from models.lora import lora_delta, lora_tiles
from models.moe import MOE_WEIGHTS, moe_mlp, swiglu
from models.weights import LinearWeight, layer_matmul

Params = dict
AttentionFn = Callable[..., jax.Array]
# Whatever a layer's attention carries from layer to layer (the paged forward: the KV pool).
AttendState = Any
# (each token's adapter slot [T], params["lora"], its tiles or None, whether any token has an
# adapter): see `models/lora.py`.
LoRAInputs = tuple[jax.Array, dict, Any, jax.Array]
# (q, k, v, layer, sliding_window, sinks, state) -> (out, state): see `decoder_layers`.
Attend = Callable[
    [jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None, AttendState],
    tuple[jax.Array, AttendState],
]


MATMUL_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")


def matmul_precision(dtype: jnp.dtype) -> AbstractContextManager:
    """The precision for the matmuls of a model in `dtype`, as a context to trace them in.

    A float32 model gets true float32 products: JAX's default lets a GPU round float32 operands
    to TF32 (a 10-bit mantissa), enough to change greedy tokens against transformers' float32.
    16-bit models keep the default. The context is read when tracing, so every dot traced in
    it, attention included, carries the precision explicitly; the CPU computes in float32 either
    way."""
    return jax.default_matmul_precision("highest" if dtype == jnp.float32 else None)


def all_reduce(x: jax.Array, axis_name: str | None) -> jax.Array:
    """The sum of x over the tensor-parallel shards (x itself without tensor parallelism)."""
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def embed_tokens(params: Params, token_ids: jax.Array, axis_name: str | None = None) -> jax.Array:
    """[T] ids -> [T, H] embeddings, from the table or, when tied without one, the LM head.

    Tensor parallel: each shard holds a contiguous slice of the vocabulary's rows, looks up
    the ids in its slice (zeros elsewhere), and the sum over shards is the embedding."""
    if "embed" not in params:
        return params["lm_head"].take_columns(token_ids)
    table = params["embed"]
    if axis_name is None:
        return table[token_ids]
    local = token_ids - jax.lax.axis_index(axis_name) * table.shape[0]
    inside = (local >= 0) & (local < table.shape[0])
    rows = table[jnp.clip(local, 0, table.shape[0] - 1)]
    return all_reduce(jnp.where(inside[:, None], rows, jnp.zeros_like(rows)), axis_name)


def ordered_sum(x: jax.Array) -> jax.Array:
    """x [..., N] summed over its last axis in one fixed order, as elementwise adds: halves
    added pairwise while the width is even, then the rest in order. XLA picks a reduction's
    order by shape (a decode step's few rows sum otherwise than a prefill's), which would make
    a token's result depend on its batch (`docs/batch_invariance.md`)."""
    while x.shape[-1] > 1 and x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    total = x[..., 0]
    for i in range(1, x.shape[-1]):
        total = total + x[..., i]
    return total[..., None]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean_square = ordered_sum(x32 * x32) / x.shape[-1]
    x32 = x32 * jax.lax.rsqrt(mean_square + eps)
    return weight * x32.astype(x.dtype)


def rope_cos_sin(
    config: ModelConfig, positions: jax.Array, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """[T, head_dim] cos and sin tables, in float32, for the half-split (rotate_half) layout
    (local: of the sliding-window layers' own base, `ModelConfig.local_rope_theta`)."""
    inv_freq = jnp.asarray(config.inv_freq(local))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    factor = 1.0 if local else config.rope_attention_factor  # YaRN scales both
    if factor != 1.0:
        return jnp.cos(angles) * factor, jnp.sin(angles) * factor
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def _attention_block(
    config: ModelConfig,
    layer_params: Params,
    weights: Params,
    x: jax.Array,  # [T, H]
    cos: jax.Array,
    sin: jax.Array,
    layer: jax.Array,
    sliding_window: jax.Array,
    attend: Attend,
    state: AttendState,
    axis_name: str | None,
    lora: LoRAInputs | None = None,
) -> tuple[jax.Array, AttendState]:
    num_tokens = x.shape[0]
    h = rms_norm(x, layer_params["attn_norm"], config.rms_norm_eps)
    qkv = _matmul(h, weights, "wqkv", layer, lora)
    if config.attention_bias:
        qkv = qkv + layer_params["bqkv"]
    q, k, v = jnp.split(qkv, [config.q_size, config.q_size + config.kv_size], axis=-1)
    q = q.reshape(num_tokens, config.num_heads, config.head_dim)
    k = k.reshape(num_tokens, config.num_kv_heads, config.head_dim)
    v = v.reshape(num_tokens, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = rms_norm(q, layer_params["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, layer_params["k_norm"], config.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    sinks = layer_params["sinks"] if config.attention_sinks else None
    out, state = attend(q, k, v, layer, sliding_window, sinks, state)
    # Tensor parallel: o_proj's rows are sharded by head, so each shard holds a partial sum.
    out = _matmul(out.reshape(num_tokens, config.q_size), weights, "wo", layer, lora)
    out = all_reduce(out, axis_name)
    if config.attention_out_bias:  # after the sum: every shard holds it whole
        out = out + layer_params["bo"]
    if config.post_norms:
        out = rms_norm(out, layer_params["post_attn_norm"], config.rms_norm_eps)
    return x + out, state


def _matmul(
    x: jax.Array, weights: Params, name: str, layer: jax.Array, lora: LoRAInputs | None
) -> jax.Array:
    """x @ weights[name][layer], plus each token's adapter's product where LoRA is on."""
    out = layer_matmul(x, weights[name], layer)
    if lora is None:
        return out
    slots, adapters, tiles, active = lora

    def delta() -> jax.Array:
        return lora_delta(x, adapters[name], layer, slots, tiles).astype(out.dtype)

    # A step of the base model's tokens only skips the adapters' work at run time.
    return out + jax.lax.cond(active, delta, lambda: jnp.zeros_like(out))


def _lora_inputs(adapters: dict, slots: jax.Array) -> LoRAInputs:
    """The layers' LoRA inputs: with the slots as a platform's grouped weights (the GPU's
    kernel), the step's tokens sorted by slot once for every layer."""
    a = adapters["wqkv"]["a"]
    active = jnp.any(slots > 0)
    if isinstance(a, jax.Array):
        return slots, adapters, None, active
    return slots, adapters, lora_tiles(slots, a.shape[1]), active


def _activation(config: ModelConfig) -> Callable[[jax.Array], jax.Array]:
    if config.hidden_act == "gelu_pytorch_tanh":  # GeGLU (Gemma)
        return lambda gate: jax.nn.gelu(gate, approximate=True)
    return jax.nn.silu


def _mlp_block(
    config: ModelConfig,
    layer_params: Params,
    weights: Params,
    x: jax.Array,
    mlp_layer: jax.Array,  # [] int32: the layer's index among the dense or the expert layers
    sparse: jax.Array,  # [] bool: an expert layer
    axis_name: str | None,
    lora: LoRAInputs | None = None,  # dense models only (adapters on experts are refused)
) -> jax.Array:
    h = rms_norm(x, layer_params["mlp_norm"], config.rms_norm_eps)
    activation = _activation(config)

    def dense() -> jax.Array:
        hidden = swiglu(_matmul(h, weights, "w_gate_up", mlp_layer, lora), activation)
        return _matmul(hidden, weights, "w_down", mlp_layer, lora)

    def experts() -> jax.Array:
        return moe_mlp(config, weights, h, mlp_layer, activation, axis_name)

    if config.moe is None:
        out = dense()
    elif config.num_dense_layers == 0:
        out = experts()
    else:  # both kinds in one scan: the layer runs one branch
        out = jax.lax.cond(sparse, experts, dense)
    out = all_reduce(out, axis_name)
    if config.post_norms:
        out = rms_norm(out, layer_params["post_mlp_norm"], config.rms_norm_eps)
    return x + out


def decoder_layers(
    params: Params,
    config: ModelConfig,
    x: jax.Array,  # [T, H] embeddings
    positions: jax.Array,  # [T] int32
    attend: Attend,
    state: AttendState = None,
    axis_name: str | None = None,
    lora_slots: jax.Array | None = None,
) -> tuple[jax.Array, AttendState]:
    """The decoder layers over flat tokens, as one scan; returns final-normed hidden states
    [T, H] and `attend`'s state as the last layer left it. lora_slots [T]: each token's
    adapter slot in params["lora"] (`models/lora.py`), 0 for none.

    `attend(q [T, heads, D], k, v [T, kv_heads, D], layer, sliding_window, sinks, state)` ->
    (out [T, heads, D], state) is each layer's attention of q over k and v (sinks: [heads]
    logits in every softmax, or None), and whatever the keys live in: the paged forward
    writes them into the KV pool it carries as `state`."""
    cos, sin = rope_cos_sin(config, positions)
    # Gemma 3: sliding-window layers rotate by a base of their own.
    local = rope_cos_sin(config, positions, local=True) if config.local_rope_theta else None
    if config.scale_embeddings:  # Gemma: by sqrt(hidden), rounded to the activations' dtype
        x = x * jnp.asarray(config.hidden_size**0.5, x.dtype)
    # Matmul weights are indexed inside the body (the MLP's by its index among the dense or
    # the expert layers, which are stacked apart); the rest is scanned over.
    indexed = MATMUL_WEIGHTS + MOE_WEIGHTS
    weights = {k: v for k, v in params["layers"].items() if k in indexed}
    scanned = {k: v for k, v in params["layers"].items() if k not in indexed}
    lora = None if lora_slots is None else _lora_inputs(params["lora"], lora_slots)

    def layer_step(carry, per_layer):
        x, state = carry
        layer_params, layer, window, mlp_layer, sparse = per_layer
        c, s = cos, sin
        if local is not None:  # this layer's table: the local one where it slides
            c, s = jnp.where(window > 0, local[0], cos), jnp.where(window > 0, local[1], sin)
        x, state = _attention_block(
            config, layer_params, weights, x, c, s, layer, window, attend, state, axis_name, lora
        )
        mlp_lora = lora if config.moe is None else None
        x = _mlp_block(config, layer_params, weights, x, mlp_layer, sparse, axis_name, mlp_lora)
        return (x, state), None

    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    windows = jnp.asarray(config.sliding_windows or (0,) * config.num_layers, jnp.int32)
    moe = config.moe
    mlp_ids = jnp.asarray(moe.mlp_index(), jnp.int32) if moe else layer_ids
    sparse = jnp.asarray(moe.sparse_layers if moe else (False,) * config.num_layers)
    per_layer = (scanned, layer_ids, windows, mlp_ids, sparse)
    with matmul_precision(x.dtype):
        (x, state), _ = jax.lax.scan(layer_step, (x, state), per_layer)
    return rms_norm(x, params["final_norm"], config.rms_norm_eps), state


def forward(
    params: Params,
    config: ModelConfig,
    token_ids: jax.Array,  # [T] int32
    positions: jax.Array,  # [T] int32
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    attention_fn: AttentionFn = ragged_paged_attention,
    axis_name: str | None = None,
    lora_slots: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Runs the decoder over a step's flat tokens; returns final-normed hidden states [T, H]
    and the pool with this step's K/V written into it. lora_slots [T]: each token's adapter
    slot (`models/lora.py`), None without adapters.

    axis_name: run as one shard of a tensor-parallel group under `shard_map` (Megatron-style,
    see `models/tensor_parallel.py`): `config` and the params are the shard's (its heads, its
    slice of the MLP and the vocabulary), and the two row-parallel products of each layer are
    summed over the group."""

    # K/V go into the pool before attention, so each new token also sees the step's own keys;
    # a backend may write them its own way (the CPU's C++ kernels write 16- and 8-bit pools).
    backend = getattr(attention_fn, "func", attention_fn)  # through a partial (a step's flags)
    write = getattr(backend, "write_kv", write_kv)
    # KV cache groups (slot_mapping [G, T], block_tables [G, S, B]): each layer reads its
    # group's table and lives in its slab of the pool (`kernels_pallas/kv_groups.py`).
    grouped = metadata.block_tables.ndim == 3
    if grouped:
        groups = kv_cache_groups(config.sliding_windows, config.num_layers)
        layer_groups = jnp.asarray(groups.layer_groups, jnp.int32)
        layer_slabs = jnp.asarray(groups.layer_slabs, jnp.int32)

    def attend(q, k, v, layer, sliding_window, sinks, cache):
        layer_metadata, slab, pool = metadata, layer, cache
        if grouped:
            group, slab = layer_groups[layer], layer_slabs[layer]
            layer_metadata = dataclasses.replace(
                metadata,
                slot_mapping=metadata.slot_mapping[group],
                block_tables=metadata.block_tables[group],
            )
            pool = _slab_scales(cache, layer, groups.num_slabs)
        pool = write(pool, slab, k, v, layer_metadata.slot_mapping)
        extra = {} if sinks is None else {"sinks": sinks}  # only gpt-oss's backends take it
        out = attention_fn(
            q,
            pool,
            slab,
            layer_metadata,
            scale=config.attention_scale,
            sliding_window=sliding_window if any(config.sliding_windows) else None,
            soft_cap=config.attn_logit_softcap,
            **extra,
        )
        if grouped and cache.k_scale is not None:  # the layer's view of the scales: undone
            pool = dataclasses.replace(pool, k_scale=cache.k_scale, v_scale=cache.v_scale)
        return out, pool

    x = embed_tokens(params, token_ids, axis_name)
    return decoder_layers(params, config, x, positions, attend, kv_cache, axis_name, lora_slots)


def _slab_scales(cache: KVCache, layer: jax.Array, num_slabs: int) -> KVCache:
    """The pool as a layer's kernels see it in its slab: an fp8 pool's scales, which are per
    layer, become that layer's at every slab index."""
    if cache.k_scale is None:
        return cache
    k_scale, v_scale = (
        jnp.broadcast_to(scale[layer], (num_slabs, scale.shape[1]))
        for scale in (cache.k_scale, cache.v_scale)
    )
    return dataclasses.replace(cache, k_scale=k_scale, v_scale=v_scale)


def compute_logits(
    params: Params,
    hidden: jax.Array,
    axis_name: str | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """[R, H] hidden rows -> [R, V] float32 logits; call it only on the rows to be sampled.
    Tensor parallel: each shard's slice of the vocabulary, gathered into every shard.
    soft_cap: the config's final_logit_softcap (cap * tanh(logits / cap))."""
    head = params.get("lm_head")
    with matmul_precision(hidden.dtype):
        if isinstance(head, LinearWeight):
            logits = head.matmul(hidden)
        elif head is not None:
            logits = hidden @ head
        else:
            logits = jnp.einsum("rh,vh->rv", hidden, params["embed"])
    logits = logits.astype(jnp.float32)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    if axis_name is None:
        return logits
    return jax.lax.all_gather(logits, axis_name, axis=1, tiled=True)


def forward_logits(
    params: Params,
    config: ModelConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    logits_indices: jax.Array,  # [R] int32 rows of the flat batch to compute logits for
    attention_fn: AttentionFn = ragged_paged_attention,
    axis_name: str | None = None,
    lora_slots: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """forward, then logits [R, V] for the selected rows only (usually each sequence's last)."""
    hidden, kv_cache = forward(
        params,
        config,
        token_ids,
        positions,
        kv_cache,
        metadata,
        attention_fn,
        axis_name,
        lora_slots,
    )
    logits = compute_logits(params, hidden[logits_indices], axis_name, config.final_logit_softcap)
    return logits, kv_cache


forward_logits_jit = jax.jit(
    forward_logits, static_argnames=("config", "attention_fn"), donate_argnames=("kv_cache",)
)
