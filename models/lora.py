"""LoRA adapters in device slots, and each token's adapter applied beside the base matmuls
(punica's BGMV idea). Adapters are read and packed by `models/peft.py`.

Slots stack packed adapters per fused matmul (slot s in 1..max_loras at index s - 1; slot 0,
the base model, holds nothing):

    lora[name]["a"]  [L, max_loras, K, n R]     R: max_lora_rank rounded up to 16 (`slot_rank`)
    lora[name]["b"]  [L, max_loras, n R, N]

A step's tokens each name a slot; `lora_delta` adds x A[slot] B[slot] to the base product, in
one of two ways of one meaning: every slot's shrink with the others' zeroed (XLA: plain
arrays), or the tokens sorted by slot into tiles and two grouped matmuls (`lora_tiles`; the
weights a `GroupedLinearWeight`, such as the GPU platform's Pallas kernel), where the base
model's tokens cost nothing. Shapes never depend on which adapters are loaded, so loading one
compiles nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.grouped_matmul import ExpertTiles, expert_tiles, tile_rows
from models.config import ModelConfig
from models.errors import ModelLoadError
from models.peft import lora_shapes, module_columns


def slot_rank(max_rank: int) -> int:
    """A slot's rank columns per sub-projection: max_lora_rank rounded up to 16, the least
    width the Pallas grouped matmul tiles."""
    return -(-max_rank // 16) * 16


def empty_lora(config: ModelConfig, max_loras: int, max_rank: int, dtype) -> dict:
    """Zeroed slots for `max_loras` adapters of rank up to max_rank, in the model's dtype."""
    return {
        name: {
            "a": jnp.zeros((config.num_layers, max_loras, k, width), dtype),
            "b": jnp.zeros((config.num_layers, max_loras, width, n), dtype),
        }
        for name, (k, width, n) in lora_shapes(config, slot_rank(max_rank)).items()
    }


def set_slot(lora: dict, slot: jax.Array, packed: dict) -> dict:
    """The slots with slot `slot` (1..max_loras) holding `packed` (pack_adapter's at
    slot_rank)."""
    return jax.tree.map(
        lambda slots, new: slots.at[:, slot - 1].set(new.astype(slots.dtype)), lora, packed
    )


set_slot_jit = jax.jit(set_slot, donate_argnums=0)


def lora_tiles(slots: jax.Array, max_loras: int) -> ExpertTiles:
    """A step's adapter tokens sorted by slot into tiles (the base model's tokens dropped:
    no tile computes them), for `lora_delta`'s grouped matmuls; once per step."""
    adapter = jnp.where(slots > 0, slots - 1, max_loras)[:, None]  # [T, 1]; base: dropped
    tile = tile_rows(slots.shape[0], max_loras)
    return expert_tiles(adapter, max_loras, tile, dropped=True)


def lora_delta(
    x: jax.Array,  # [T, K]
    lora: dict,  # one fused matmul's {"a": [L, max_loras, K, nR], "b": [L, max_loras, nR, N]}
    layer: jax.Array,
    slots: jax.Array,  # [T] int32: each token's slot (0: none)
    tiles: ExpertTiles | None = None,  # lora_tiles(slots): the grouped matmuls' path
) -> jax.Array:
    """[T, N]: each token's x A[slot] B[slot] (zeros for slot 0)."""
    a, b = lora["a"], lora["b"]
    if tiles is not None:  # grouped: each tile of one adapter's rows times its A, then B
        shrink = a.grouped_matmul(x[tiles.rows], layer, tiles)  # [P, nR]
        expand = b.grouped_matmul(shrink, layer, tiles)  # [P, N]
        delta = expand[tiles.positions[:, 0]]
        return jnp.where((slots > 0)[:, None], delta, 0).astype(x.dtype)
    # Every slot's shrink, the others' zeroed, so one matmul expands them all: S x T x K x nR
    # multiply-adds, small beside the base T x K x N while S nR << N.
    a, b = a[layer], b[layer]  # [S, K, nR], [S, nR, N]
    num_slots, _, width = a.shape
    shrink = jnp.einsum("tk,skr->tsr", x, a.astype(x.dtype))
    mine = slots[:, None] == jnp.arange(1, num_slots + 1)[None, :]  # [T, S]
    shrink = jnp.where(mine[:, :, None], shrink, 0).reshape(x.shape[0], num_slots * width)
    return shrink @ b.reshape(num_slots * width, -1).astype(x.dtype)


def merge_lora(params: dict, config: ModelConfig, arrays: dict, scale: float = 1.0) -> dict:
    """The params with an adapter held as arrays (`models.peft.adapter_from_arrays`' format)
    merged into their weights: W + scale * A^T B^T, differentiable in the arrays, so a training
    loop runs the adapted model with `models.training`. Plain-array weights only."""
    columns = module_columns(config)
    layers = dict(params["layers"])
    for module, pair in arrays.items():
        name, start, end = columns[module]
        weight = layers[name]
        if not isinstance(weight, jax.Array):
            raise ModelLoadError(
                f"{name} is a {type(weight).__name__}: merging an adapter needs plain weights"
            )
        delta = scale * jnp.einsum("lrk,lnr->lkn", pair["lora_A"], pair["lora_B"])
        layers[name] = weight.at[:, :, start:end].add(delta.astype(weight.dtype))
    return {**params, "layers": layers}
