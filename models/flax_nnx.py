"""A Flax NNX Llama-family causal LM for training, and its params in pagedjax's layout.

`LlamaForCausalLM` is the module a JAX user ports from Hugging Face's: the same attribute
names (`model.layers[i].self_attn.q_proj`, ...; nnx.Linear kernels are [in, out]), a dense
causal forward `token_ids [B, T] -> logits [B, T, V]` in float32. `nnx_to_params` and
`params_to_nnx` convert its Params to and from pagedjax's fused, stacked layout
(`models/llama.py`) through HF names (`models/hf_params.py`), in jax.numpy: weights on a device
stay there. A trainer trains with flax and optax, then generates in the same process:

    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))  # or params_to_nnx(params, model)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    optimizer.update(model, nnx.grad(loss_fn)(model))  # each step, under nnx.jit
    llm = LLM(model=config, params=nnx_to_params(model), tokenizer=tokenizer_dir)
    llm.update_weights(nnx_to_params(model))  # after more steps: no reload, no recompile

The module supports what `ModelConfig` expresses: GQA, RoPE scaling, sliding windows, Qwen2's
q/k/v biases, Qwen3's q/k norms, tied embeddings.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.errors import ModelLoadError
from models.hf_params import hf_state_from_params, params_from_hf_state
from models.llama import Params, apply_rope, matmul_precision, rms_norm, rope_cos_sin

# flax 0.12 holds a list of submodules in an nnx.List; flax 0.11 has none and takes a list.
_ModuleList = getattr(nnx, "List", list)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, window: int, *, rngs: nnx.Rngs, dtype: jnp.dtype):
        linear = partial(nnx.Linear, rngs=rngs, dtype=dtype, param_dtype=dtype)
        H, Q, KV, bias = config.hidden_size, config.q_size, config.kv_size, config.attention_bias
        self.q_proj = linear(H, Q, use_bias=bias)
        self.k_proj = linear(H, KV, use_bias=bias)
        self.v_proj = linear(H, KV, use_bias=bias)
        self.o_proj = linear(Q, H, use_bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        self.config, self.window = config, window

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        c, (B, T, _) = self.config, x.shape
        q = self.q_proj(x).reshape(B, T, c.num_heads, c.head_dim)
        k = self.k_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).reshape(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Keys at distance < window: the window's left edge is window - 1 tokens back.
        local = (self.window - 1, 0) if self.window else None
        out = jax.nn.dot_product_attention(
            q, k, v, scale=c.attention_scale, is_causal=True, local_window_size=local
        )
        return self.o_proj(out.reshape(B, T, c.q_size))


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype):
        linear = partial(nnx.Linear, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=dtype)
        H, I = config.hidden_size, config.intermediate_size  # noqa: E741
        self.gate_proj, self.up_proj, self.down_proj = linear(H, I), linear(H, I), linear(I, H)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, window: int, *, rngs: nnx.Rngs, dtype: jnp.dtype):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, window, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype):
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        windows = config.sliding_windows or (0,) * config.num_layers
        self.layers = _ModuleList(
            [DecoderLayer(config, int(w), rngs=rngs, dtype=dtype) for w in windows]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.config = config

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        cos, sin = rope_cos_sin(self.config, jnp.arange(token_ids.shape[1]))
        x = self.embed_tokens(token_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nnx.Module):
    """Hugging Face's Llama / Mistral / Qwen2 / Qwen3 causal LM in Flax NNX (dense, no cache)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        gemma = config.post_norms or config.scale_embeddings or config.hidden_act != "silu"
        if gemma or config.moe is not None:
            raise ValueError(
                f"the Flax NNX module is the Llama family's; {config.architecture} is not: "
                "train on models.training's functional forward instead"
            )
        self.config, self.dtype = config, dtype
        self.model = LlamaModel(config, rngs=rngs, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=dtype,
                rngs=rngs,
            )

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        """token_ids [B, T] -> float32 logits [B, T, V], each position over its prefix."""
        with matmul_precision(self.dtype):
            h = self.model(token_ids)
            if self.config.tie_word_embeddings:
                return self.model.embed_tokens.attend(h).astype(jnp.float32)
            return self.lm_head(h).astype(jnp.float32)


def _hf_name(path: tuple) -> str:
    """An NNX state path -> its HF name: ("model", "layers", 0, ..., "kernel") ->
    "model.layers.0....weight" (kernels are HF's weights transposed)."""
    *prefix, leaf = (str(part) for part in path)
    return ".".join([*prefix, "weight" if leaf in ("kernel", "embedding") else leaf])


def nnx_to_params(model: LlamaForCausalLM | nnx.State, config: ModelConfig | None = None) -> Params:
    """The module's (or its Param state's) weights in pagedjax's layout, on their device."""
    if isinstance(model, nnx.Module):
        config = config or model.config
        model = nnx.state(model, nnx.Param)
    if config is None:
        raise ValueError("nnx_to_params needs the ModelConfig when given an nnx.State")
    state = {}
    for path, var in nnx.to_flat_state(model):
        if isinstance(var, nnx.Variable) and not isinstance(var, nnx.Param):
            continue  # RNG or other non-Param state of a whole-module nnx.state(model)
        value = var[...] if isinstance(var, nnx.Variable) else var
        state[_hf_name(path)] = value.T if path[-1] == "kernel" else value
    return params_from_hf_state(config, state)


def params_to_nnx_state(params: Params, model: LlamaForCausalLM) -> nnx.State:
    """pagedjax-layout params as the module's Param state (in the module's dtypes), for
    `nnx.update(model, state)`; raises ModelLoadError if they do not match the module."""
    state = hf_state_from_params(model.config, params)
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = _hf_name(path)
        if name not in state:
            raise ModelLoadError(f"params have no weight for the module's {name!r}")
        value = state.pop(name)
        value = jnp.asarray(value.T if path[-1] == "kernel" else value, var.dtype)
        if value.shape != var.shape:
            raise ModelLoadError(f"{name}: params' shape {value.shape}, module's {var.shape}")
        flat.append((path, var.replace(value)))
    if state:
        raise ModelLoadError(f"the module has no weights for {sorted(state)[:3]} ...")
    return nnx.from_flat_state(flat)


def params_to_nnx(params: Params, model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Sets the module's weights, in place, to pagedjax-layout `params`; returns the module."""
    nnx.update(model, params_to_nnx_state(params, model))
    return model
