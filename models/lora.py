"""LoRA adapters in device slots, and each token's adapter applied beside the base matmuls
(punica's BGMV idea, as XLA ops). Adapters are read and packed by `models/peft.py`.

Slots stack packed adapters per fused matmul:

    lora[name]["a"]  [L, S, K, n R]     S = max_loras + 1; slot 0 is zeros (the base rows)
    lora[name]["b"]  [L, S, n R, N]

A step's tokens each name a slot; `lora_delta` adds x A[slot] B[slot] to the base product.
Shapes never depend on which adapters are loaded, so loading one compiles nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.errors import ModelLoadError
from models.peft import LORA_TARGETS, lora_shapes, module_shapes


def empty_lora(config: ModelConfig, max_loras: int, max_rank: int, dtype) -> dict:
    """Zeroed slots for `max_loras` adapters and the base (slot 0), in the model's dtype."""
    slots = max_loras + 1
    return {
        name: {
            "a": jnp.zeros((config.num_layers, slots, k, width), dtype),
            "b": jnp.zeros((config.num_layers, slots, width, n), dtype),
        }
        for name, (k, width, n) in lora_shapes(config, max_rank).items()
    }


def set_slot(lora: dict, slot: jax.Array, packed: dict) -> dict:
    """The slots with `slot` holding `packed` (pack_adapter's, or zeros to clear it)."""
    return jax.tree.map(
        lambda slots, new: slots.at[:, slot].set(new.astype(slots.dtype)), lora, packed
    )


set_slot_jit = jax.jit(set_slot, donate_argnums=0)


def lora_delta(
    x: jax.Array,  # [T, K]
    lora: dict,  # one fused matmul's {"a": [L, S, K, n R], "b": [L, S, n R, N]}
    layer: jax.Array,
    slots: jax.Array,  # [T] int32: each token's slot (0: none)
) -> jax.Array:
    """[T, N]: each token's x A[slot] B[slot] (zeros for slot 0).

    Every slot's shrink is computed and the others' zeroed, so one matmul expands them all:
    S x T x K x n R multiply-adds, small beside the base T x K x N while S n R << N."""
    a, b = lora["a"][layer], lora["b"][layer]  # [S, K, nR], [S, nR, N]
    num_slots, _, width = a.shape
    shrink = jnp.einsum("tk,skr->tsr", x, a.astype(x.dtype))
    mine = slots[:, None] == jnp.arange(num_slots)[None, :]  # [T, S]
    shrink = jnp.where(mine[:, :, None], shrink, 0).reshape(x.shape[0], num_slots * width)
    return shrink @ b.reshape(num_slots * width, -1).astype(x.dtype)


def merge_lora(params: dict, config: ModelConfig, arrays: dict, scale: float = 1.0) -> dict:
    """The params with an adapter held as arrays (`models.peft.adapter_from_arrays`' format)
    merged into their weights: W + scale * A^T B^T, differentiable in the arrays, so a training
    loop runs the adapted model with `models.training`. Plain-array weights only."""
    shapes = module_shapes(config)
    places = {}  # module -> (its fused matmul, its first output column there)
    for name, modules in LORA_TARGETS.items():
        column = 0
        for module in modules:
            places[module] = (name, column)
            column += shapes[module][1]
    layers = dict(params["layers"])
    for module, pair in arrays.items():
        name, column = places[module]
        weight = layers[name]
        if not isinstance(weight, jax.Array):
            raise ModelLoadError(
                f"{name} is a {type(weight).__name__}: merging an adapter needs plain weights"
            )
        delta = scale * jnp.einsum("lrk,lnr->lkn", pair["lora_A"], pair["lora_B"])
        end = column + shapes[module][1]
        layers[name] = weight.at[:, :, column:end].add(delta.astype(weight.dtype))
    return {**params, "layers": layers}
