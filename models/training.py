"""The engine's model as a dense, differentiable float32 forward over [B, T] batches, for a JAX
trainer: the same layer code and layer scan as the paged forward (`models/llama.py`), with
causal attention computed directly from each layer's keys and values instead of the KV pool.

A trainer that samples with the engine and learns from the samples (RL, distillation) needs the
engine's logprobs to be those of the function it differentiates: `token_logprobs` over prompt
+ output gives the engine's sampled-token logprobs (SamplingParams(logprobs=0)) to float32
rounding on XLA's ops, and to the log-softmax's last rounding with a batch-invariant engine's
`LLM.dense_kernels()` (`docs/batch_invariance.md`, benchmarks/logprob_gap.py).

Both functions take `config` and `kernels` as static arguments under `jax.jit` (ModelConfig
and DenseKernels are hashable).
Gradients need plain float arrays (`models.loader.load_model`'s params); a platform's packed
or block-quantized weights run forward only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas.reference import MASK_VALUE, softmax_with_sinks
from models.config import ModelConfig
from models.llama import Params, compute_logits, decoder_layers, embed_tokens


def dense_causal_attention(
    config: ModelConfig,
    q: jax.Array,  # [B * T, heads, D]
    k: jax.Array,  # [B * T, kv_heads, D]
    v: jax.Array,  # [B * T, kv_heads, D]
    batch: int,
    length: int,
    sliding_window: jax.Array,  # [] int32, 0: full attention
    sinks: jax.Array | None = None,  # [heads] float32: gpt-oss's sink logits
) -> jax.Array:  # [B * T, heads, D] in q's dtype
    """Causal attention over B rows of T tokens flattened to B x T, in XLA: each query sees the
    keys of its own row at positions <= its own (and within the layer's window)."""
    group = config.num_heads // config.num_kv_heads
    positions = jnp.arange(length)
    causal = positions[None, :] <= positions[:, None]  # [T queries, T keys]
    distance = positions[:, None] - positions[None, :]
    qg = q.reshape(batch, length, config.num_kv_heads, group, config.head_dim)
    k = k.reshape(batch, length, config.num_kv_heads, config.head_dim)
    v = v.reshape(batch, length, config.num_kv_heads, config.head_dim)
    scores = jnp.einsum(
        "bqkgd,bskd->bkgqs", qg.astype(jnp.float32), k.astype(jnp.float32)
    )  # [B, KV, G, T, T]
    # A traced window per layer, as in the paged forward: 0 is full attention.
    visible = causal & ((sliding_window <= 0) | (distance < sliding_window))
    scores = scores * config.attention_scale
    cap = config.attn_logit_softcap
    if cap is not None:  # Gemma 2
        scores = cap * jnp.tanh(scores / cap)
    scores = jnp.where(visible, scores, MASK_VALUE)
    probs = softmax_with_sinks(scores, sinks, config.num_kv_heads)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v.astype(jnp.float32))
    return out.reshape(q.shape).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class DenseKernels:
    """What the dense forward computes with instead of XLA's ops, to reproduce an engine's
    arithmetic (`LLM.dense_kernels()`: on the CPU, its C++ kernels with XLA's gradients).

    attention: `dense_causal_attention`'s signature and result.
    prepare: params -> params that multiply as the engine's do, applied inside the traced
    function (so gradients reach the params a trainer holds)."""

    attention: Callable[..., jax.Array] = dense_causal_attention
    prepare: Callable[[Params], Params] | None = None


XLA_KERNELS = DenseKernels()


def dense_logits(
    params: Params,
    config: ModelConfig,
    token_ids: jax.Array,  # [B, T] int32, right padding allowed
    kernels: DenseKernels = XLA_KERNELS,
) -> jax.Array:  # [B, T, V] float32
    """Each position's next-token logits, causal within each row: what a row's padding holds
    after its sequence never changes the sequence's logits."""
    batch, length = token_ids.shape
    if kernels.prepare is not None:
        params = kernels.prepare(params)
    # The layers run on B x T flat tokens, the shape the matmul weight types multiply.
    x = embed_tokens(params, token_ids.reshape(-1))
    positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)

    def attend(q, k, v, layer, sliding_window, sinks, state):
        extra = {} if sinks is None else {"sinks": sinks}  # gpt-oss
        return kernels.attention(config, q, k, v, batch, length, sliding_window, **extra), state

    hidden, _ = decoder_layers(params, config, x, positions, attend)
    logits = compute_logits(params, hidden, soft_cap=config.final_logit_softcap)
    return logits.reshape(batch, length, -1)


def token_logprobs(
    params: Params,
    config: ModelConfig,
    token_ids: jax.Array,  # [B, T] int32
    kernels: DenseKernels = XLA_KERNELS,
) -> jax.Array:  # [B, T - 1] float32
    """log p(token_ids[:, t + 1] | token_ids[:, : t + 1]): each next token's logprob under the
    raw (temperature 1) model distribution, as the engine reports sampled tokens'."""
    logits = dense_logits(params, config, token_ids, kernels)[:, :-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logprobs, token_ids[:, 1:, None], axis=-1)[..., 0]


dense_logits_jit = jax.jit(dense_logits, static_argnames=("config", "kernels"))
token_logprobs_jit = jax.jit(token_logprobs, static_argnames=("config", "kernels"))
