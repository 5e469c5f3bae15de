"""Params in memory, in either naming: Hugging Face's flat state dict (what a JAX trainer that
loaded an HF checkpoint holds: "model.layers.0.self_attn.q_proj.weight" -> [out, in]) and
pagedjax's fused, stacked layout (`models/llama.py`).

The conversions use jax.numpy, so weights on a device stay there (a trainer's weights reach
the engine without a host round trip); the loader reads files with numpy instead
(`models/loader.py`), filling preallocated host buffers.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.errors import ModelLoadError
from models.llama import Params
from models.loader import (
    FUSED_MATMULS,
    deinterleave,
    interleave,
    layer_norms,
    layer_vectors,
    matmul_layers,
    moe_matmuls,
    moe_shapes,
    stacked_experts,
)

# transformers v5 holds a mixture's experts fused in memory ([E, 2 I, H] gate and up, [E, H, I]
# down; Mixtral's router as "mlp.gate" too), though checkpoints keep one tensor per expert.
IN_MEMORY_EXPERTS = {
    "experts_gate_up": "mlp.experts.gate_up_proj",
    "experts_down": "mlp.experts.down_proj",
}


def is_hf_state(params: Mapping) -> bool:
    """Whether `params` is a flat HF state dict rather than pagedjax's layout."""
    return "layers" not in params and any(
        isinstance(k, str) and k.startswith("model.") for k in params
    )


def param_shapes(config: ModelConfig) -> Params:
    """The pagedjax layout's shapes for `config` (float weights), as a params tree of tuples."""
    L, H, I = config.num_layers, config.hidden_size, config.intermediate_size  # noqa: E741
    Q, KV, V = config.q_size, config.kv_size, config.vocab_size
    D = config.num_dense_layers  # noqa: N806
    layers = {"wqkv": (L, H, Q + 2 * KV), "wo": (L, Q, H)}
    if D:
        layers.update(w_gate_up=(D, H, 2 * I), w_down=(D, I, H))
    if config.moe is not None:
        M = config.moe.num_sparse_layers  # noqa: N806
        layers.update({name: (M, *shape) for name, shape in moe_shapes(config).items()})
    vectors = {**layer_norms(config), **layer_vectors(config)}
    layers.update({name: (L, width) for name, (_, width) in vectors.items()})
    if config.attention_bias:
        layers["bqkv"] = (L, Q + 2 * KV)
    shapes: Params = {"embed": (V, H), "layers": layers, "final_norm": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (H, V)
    return shapes


def check_params(config: ModelConfig, params: Params) -> None:
    """Raises ModelLoadError naming the first weight missing, extra or of the wrong shape."""
    expected = param_shapes(config)
    for group, want, have in (("", expected, params), ("layers.", expected["layers"], None)):
        have = params.get("layers", {}) if have is None else have
        if not isinstance(have, Mapping):
            raise ModelLoadError(f"params[{group!r}] must be a dict of arrays")
        for name in sorted(set(want) | set(have)):
            if name == "layers" and not group:
                continue
            if name not in have:
                raise ModelLoadError(f"params has no {group}{name} (shape {want[name]})")
            if name not in want:
                raise ModelLoadError(f"params has an unexpected {group}{name} for this model")
            shape = tuple(getattr(have[name], "shape", ()))
            if shape != want[name]:
                raise ModelLoadError(
                    f"params {group}{name} has shape {shape}; this model's is {want[name]}"
                )


def params_from_hf_state(
    config: ModelConfig, state: Mapping[str, jax.Array], dtype: jnp.dtype | None = None
) -> Params:
    """HF-named weights ([out, in] matrices) -> pagedjax's layout (fused [in, out], stacked)."""

    def get(name: str) -> jax.Array:
        if name not in state:
            raise ModelLoadError(f"the HF state dict has no {name!r}: it does not match the model")
        return jnp.asarray(state[name], dtype)

    def stacked(fn, indices: tuple[int, ...] = tuple(range(config.num_layers))) -> jax.Array:
        return jnp.stack([fn(f"model.layers.{i}.") for i in indices])

    expert_layers = config.mlp_layers(experts=True)

    def fused(parts: tuple[str, ...]):
        return lambda p: jnp.concatenate([get(f"{p}{part}.weight").T for part in parts], axis=1)

    offset = config.norm_offset  # Gemma's norms multiply by 1 + w (models/loader.py)

    def norm(hf_name: str):
        return lambda p: get(f"{p}{hf_name}.weight") + offset

    layers = {name: stacked(norm(hf)) for name, (hf, _) in layer_norms(config).items()}
    for name, (hf, _) in layer_vectors(config).items():
        layers[name] = stacked(lambda p, hf=hf: get(f"{p}{hf}"))
    for name, parts in FUSED_MATMULS.items():
        if matmul_layers(config, name):
            layers[name] = stacked(fused(parts), matmul_layers(config, name))
    if config.moe is not None:
        names = moe_matmuls(config)
        first = f"model.layers.{expert_layers[0]}."
        in_memory = f"{first}{IN_MEMORY_EXPERTS['experts_gate_up']}" in state
        if in_memory and not stacked_experts(config):  # transformers v5's (not gpt-oss's)
            names.update({k: (v,) for k, v in IN_MEMORY_EXPERTS.items()}, router=("mlp.gate",))
        for name, parts in names.items():
            if parts[0] in IN_MEMORY_EXPERTS.values():  # [E, out, in] -> [E, in, out]
                layers[name] = stacked(
                    lambda p, n=parts[0]: get(f"{p}{n}").swapaxes(1, 2), expert_layers
                )
                continue
            each = [fused(tuple(p.format(e=e) for p in parts)) for e in _experts(parts, config)]
            if "{e}" in parts[0]:
                layers[name] = stacked(lambda p, each=each: jnp.stack([f(p) for f in each]),
                                       expert_layers)  # fmt: skip
            else:
                layers[name] = stacked(each[0], expert_layers)
        for name, (hf, interleaved) in stacked_experts(config).items():

            def tensor(p: str, hf=hf, interleaved=interleaved) -> jax.Array:
                return deinterleave(get(f"{p}{hf}"), jnp) if interleaved else get(f"{p}{hf}")

            layers[name] = stacked(tensor, expert_layers)
    if config.attention_bias:
        qkv = FUSED_MATMULS["wqkv"]
        layers["bqkv"] = stacked(lambda p: jnp.concatenate([get(f"{p}{q}.bias") for q in qkv]))
    params: Params = {
        "embed": get("model.embed_tokens.weight"),
        "layers": layers,
        "final_norm": get("model.norm.weight") + offset,
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    check_params(config, params)
    return params


def hf_state_from_params(config: ModelConfig, params: Params) -> dict[str, jax.Array]:
    """pagedjax's layout (float weights) -> HF-named weights, the inverse of
    `params_from_hf_state`."""
    check_params(config, params)
    Q, KV, I = config.q_size, config.kv_size, config.intermediate_size  # noqa: E741
    widths = {"wqkv": (Q, KV, KV), "w_gate_up": (I, I)}
    layers = params["layers"]
    offset = config.norm_offset
    state = {
        "model.embed_tokens.weight": params["embed"],
        "model.norm.weight": params["final_norm"] - offset,
    }
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = params["lm_head"].T
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name, (hf_name, _) in layer_norms(config).items():
            state[f"{p}{hf_name}.weight"] = layers[name][i] - offset
        for name, (hf_name, _) in layer_vectors(config).items():
            state[f"{p}{hf_name}"] = layers[name][i]
        for name, parts in FUSED_MATMULS.items():
            if i in matmul_layers(config, name):
                w = layers[name][matmul_layers(config, name).index(i)]
                _unfuse(state, p, parts, w, widths.get(name, ()))
        if i in config.mlp_layers(experts=True):
            j = config.mlp_layers(experts=True).index(i)
            for name, parts in moe_matmuls(config).items():
                for e in _experts(parts, config):
                    w = layers[name][j] if "{e}" not in parts[0] else layers[name][j, e]
                    named = tuple(part.format(e=e) for part in parts)
                    _unfuse(state, p, named, w, _moe_widths(config, name))
            for name, (hf_name, interleaved) in stacked_experts(config).items():
                w = layers[name][j]
                state[f"{p}{hf_name}"] = interleave(w, jnp) if interleaved else w
        if config.attention_bias:
            for part, (start, stop) in zip(
                FUSED_MATMULS["wqkv"], _bounds((Q, KV, KV)), strict=True
            ):
                state[f"{p}{part}.bias"] = layers["bqkv"][i, start:stop]
    return state


def _experts(parts: tuple[str, ...], config: ModelConfig) -> range:
    """The experts a weight's HF names range over: all, or one where they name none."""
    return range(config.moe.num_experts) if "{e}" in parts[0] else range(1)


def _moe_widths(config: ModelConfig, name: str) -> tuple[int, ...]:
    m = config.moe
    return {
        "experts_gate_up": (m.intermediate_size,) * 2,
        "shared_gate_up": (m.shared_intermediate_size,) * 2,
    }.get(name, ())


def _unfuse(state: dict, prefix: str, parts: tuple[str, ...], w: jax.Array, widths) -> None:
    """A fused [in, out] weight back to its HF parts ([out, in] each, of `widths` columns;
    () for one part) in `state`."""
    for part, (start, stop) in zip(parts, _bounds(widths or (w.shape[1],)), strict=True):
        state[f"{prefix}{part}.weight"] = w[:, start:stop].T


def _bounds(widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """[(start, stop)] of consecutive column blocks of the given widths."""
    out, start = [], 0
    for width in widths:
        out.append((start, start + width))
        start += width
    return out
