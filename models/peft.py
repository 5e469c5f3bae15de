"""LoRA adapters as PEFT saves them, read and packed for the model's fused matmuls (numpy
only: a front end checks an adapter without JAX).

An adapter changes a projection W [K, N] to W + scale * A^T B^T (PEFT stores A [r, K] and
B [N, r]). The model's projections are fused (q/k/v in `wqkv`, gate/up in `w_gate_up`), so an
adapter's A and B are packed per fused matmul: A [K, n R] with each sub-projection's A in its
own R columns, B [n R, N] block-diagonal (a sub-projection's B in its rows and its output
columns), the scale folded into B, ranks below R padded with zeros. `models/lora.py` stacks
packed adapters in device slots and applies them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.config import ModelConfig
from models.errors import ModelLoadError

# Each fused matmul's sub-projections, as PEFT names the modules, in the fused output order.
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w_gate_up": ("gate_proj", "up_proj"),
    "w_down": ("down_proj",),
}
MODULES = tuple(module for modules in LORA_TARGETS.values() for module in modules)
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
# adapter_config.json fields that would change what the adapter computes, refused by name.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 style Conv1D weights)",
    "layer_replication": "layer_replication",
}


class LoRAError(ModelLoadError):
    """An adapter that cannot be loaded: the message names the field or tensor."""


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights as PEFT saved them (float32) and its scale."""

    rank: int
    scale: float  # lora_alpha / rank, or / sqrt(rank) for rsLoRA
    # (layer, module) -> (A [rank, K], B [N, rank])
    weights: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}


def _module_of(name: str) -> tuple[int, str, str]:
    """A PEFT tensor name -> (layer, module, "lora_A" or "lora_B"); LoRAError otherwise."""
    parts = name.split(".")
    try:
        at = parts.index("layers")
        layer, module, which = int(parts[at + 1]), parts[at + 3], parts[at + 4]
    except (ValueError, IndexError):
        raise LoRAError(
            f"adapter tensor {name!r} is not a decoder layer's projection: adapters on the "
            "embeddings or the LM head are not supported"
        ) from None
    if module not in MODULES or which not in ("lora_A", "lora_B"):
        raise LoRAError(
            f"adapter tensor {name!r}: only lora_A/lora_B of {', '.join(MODULES)} are supported"
        )
    return layer, module, which


def load_peft_adapter(path: str | Path) -> LoRAAdapter:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) as
    float32 arrays; LoRAError naming what is unsupported or missing."""
    from safetensors.numpy import load_file

    folder = Path(path)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for file in (config_path, weights_path):
        if not file.is_file():
            raise LoRAError(f"{file} does not exist: a PEFT adapter directory holds both files")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"peft_type {config['peft_type']!r}: only LORA adapters are supported")
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise LoRAError(f"{what} are not supported (adapter_config.json {field!r})")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"bias={config['bias']!r}: only adapters without biases are supported")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pieces: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, tensor in load_file(str(weights_path)).items():
        layer, module, which = _module_of(name)
        pieces.setdefault((layer, module), {})[which] = np.asarray(tensor, np.float32)
    weights = {}
    for (layer, module), pair in pieces.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAError(f"layer {layer} {module}: the adapter has lora_A or lora_B only")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(
                f"layer {layer} {module}: A {a.shape} and B {b.shape} do not have the rank "
                f"r={rank} of adapter_config.json"
            )
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoRAError(f"{weights_path} holds no lora_A/lora_B tensors")
    return LoRAAdapter(rank, scale, weights)


def adapter_from_arrays(
    arrays: Mapping[str, Mapping[str, np.ndarray]], scale: float = 1.0
) -> LoRAAdapter:
    """An adapter held in memory (what a LoRA training loop holds): module -> {"lora_A":
    [L, r, K], "lora_B": [L, N, r]}, stacked over the layers in PEFT's orientation; LoRAError
    for unknown modules or ranks that differ."""
    weights, ranks = {}, set()
    for module, pair in arrays.items():
        if module not in MODULES or set(pair) != {"lora_A", "lora_B"}:
            raise LoRAError(
                f"{module!r}: an adapter from memory maps modules of {', '.join(MODULES)} to "
                "{'lora_A': [L, r, K], 'lora_B': [L, N, r]}"
            )
        a, b = (np.asarray(pair[key], np.float32) for key in ("lora_A", "lora_B"))
        if a.ndim != 3 or b.ndim != 3 or a.shape[:2] != (b.shape[0], b.shape[2]):
            raise LoRAError(f"{module}: lora_A {a.shape} and lora_B {b.shape} do not pair")
        ranks.add(a.shape[1])
        for layer in range(a.shape[0]):
            weights[(layer, module)] = (a[layer], b[layer])
    if len(ranks) != 1:
        raise LoRAError(f"an adapter has one rank: got {sorted(ranks) or 'no modules'}")
    return LoRAAdapter(ranks.pop(), float(scale), weights)


def save_peft_adapter(path: str | Path, adapter: LoRAAdapter) -> Path:
    """Writes an adapter as PEFT does (adapter_config.json + adapter_model.safetensors, a
    Llama's module names), e.g. one trained in memory; `load_peft_adapter` reads it back.
    The scale is kept as lora_alpha = scale * rank."""
    from safetensors.numpy import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, module), (a, b) in adapter.weights.items():
        block = "self_attn" if module in _ATTENTION else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": adapter.rank,
        "lora_alpha": adapter.scale * adapter.rank,
        "target_modules": sorted(adapter.modules),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each module's (K, N) in the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, config.q_size),
        "k_proj": (hidden, config.kv_size),
        "v_proj": (hidden, config.kv_size),
        "o_proj": (config.q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def module_columns(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Each module's fused matmul and its output columns there: module -> (name, start, end)."""
    shapes = module_shapes(config)
    columns = {}
    for name, modules in LORA_TARGETS.items():
        start = 0
        for module in modules:
            columns[module] = (name, start, start + shapes[module][1])
            start += shapes[module][1]
    return columns


def lora_shapes(config: ModelConfig, max_rank: int) -> dict[str, tuple[int, int, int]]:
    """Each fused matmul's (K, n R, N) in a slot."""
    shapes = module_shapes(config)
    return {
        name: (
            shapes[modules[0]][0],
            len(modules) * max_rank,
            sum(shapes[module][1] for module in modules),
        )
        for name, modules in LORA_TARGETS.items()
    }


def check_adapter(adapter: LoRAAdapter, config: ModelConfig, max_rank: int) -> None:
    """LoRAError unless the adapter fits the model and the engine's max_lora_rank."""
    if adapter.rank > max_rank:
        raise LoRAError(
            f"the adapter's rank r={adapter.rank} exceeds max_lora_rank={max_rank}: raise "
            "max_lora_rank"
        )
    if config.moe is not None and adapter.modules - _ATTENTION:
        raise LoRAError(
            "adapters on a mixture-of-experts model's MLP are not supported: target the "
            "attention projections only"
        )
    shapes = module_shapes(config)
    for (layer, module), (a, b) in adapter.weights.items():
        k, n = shapes[module]
        if not 0 <= layer < config.num_layers or a.shape[1] != k or b.shape[0] != n:
            raise LoRAError(
                f"layer {layer} {module}: A {a.shape} and B {b.shape} do not fit the model "
                f"({config.num_layers} layers, {module} of {k} -> {n})"
            )


def pack_adapter(
    adapter: LoRAAdapter, config: ModelConfig, max_rank: int
) -> dict[str, dict[str, np.ndarray]]:
    """The adapter in one slot's layout: name -> {"a": [L, K, n R], "b": [L, n R, N]},
    float32, the scale folded into B (check_adapter first)."""
    columns = module_columns(config)
    packed = {}
    for name, (k, width, n) in lora_shapes(config, max_rank).items():
        a = np.zeros((config.num_layers, k, width), np.float32)
        b = np.zeros((config.num_layers, width, n), np.float32)
        for index, module in enumerate(LORA_TARGETS[name]):
            _, start, end = columns[module]
            rows = slice(index * max_rank, index * max_rank + adapter.rank)
            for layer in range(config.num_layers):
                pair = adapter.weights.get((layer, module))
                if pair is not None:
                    a[layer, :, rows] = pair[0].T
                    b[layer, rows, start:end] = pair[1].T * adapter.scale
        packed[name] = {"a": a, "b": b}
    return packed
