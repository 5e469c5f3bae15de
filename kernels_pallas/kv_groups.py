"""KV cache groups: how a model whose layers attend differently shares one paged pool.

A model that mixes full-attention layers with sliding-window ones (Gemma 2 and 3) wastes most
of a one-table pool on its sliding layers: a long conversation keeps every block of every
layer, though a sliding layer reads only its last `window` tokens. As in vLLM's hybrid KV
cache manager, the layers are split into groups of `num_slabs` layers that attend alike; each
group has a block table of its own per request, so the sliding groups free the blocks that
fell out of every window while the full-attention group keeps all of its.

All groups draw their blocks from one pool of `num_slabs` layer slabs: a block holds one
group's `num_slabs` layers (layer l in slab `layer_slabs[l]`), so a block id means the same
bytes in every group and the block manager needs one free list. With 5 sliding layers to 1
global (Gemma 3), a block is a sixth of a whole-model block, and a long context costs about a
sixth of what one table over all layers would.

Group 0 is the full-attention group when there is one: its prefix-cache keys are the plain
ones, which a data-parallel router computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int, ...]  # [G] each group's sliding window, 0 for full attention
    layer_groups: tuple[int, ...]  # [L] the group whose block table each layer reads
    layer_slabs: tuple[int, ...]  # [L] the slab of a block that holds each layer's KV
    num_slabs: int  # layers a block holds (the pool's leading dimension)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def metadata_dims(self) -> tuple[int, ...]:
        """The leading dimension of a step's slots and tables: (G,) with several groups, none
        with one (the metadata every backend reads)."""
        return (self.num_groups,) if self.num_groups > 1 else ()

    @property
    def frees_blocks(self) -> bool:
        """Whether some group gives back blocks that fell out of its window."""
        return any(self.windows)


def single_group(num_layers: int, window: int = 0) -> KVCacheGroups:
    """One table for every layer (each in a slab of its own): the layout without groups."""
    return KVCacheGroups((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def kv_cache_groups(
    layer_windows: Sequence[int], num_layers: int, hybrid: bool = True
) -> KVCacheGroups:
    """The groups of a model whose layer l slides over `layer_windows[l]` tokens (0 or an
    empty sequence: full attention). hybrid=False: one table for all layers, which frees
    nothing (the layout before groups)."""
    windows = tuple(layer_windows) or (0,) * num_layers
    kinds = sorted(set(windows))  # full attention (0) first: group 0
    if not hybrid:
        return single_group(num_layers)
    if len(kinds) == 1:  # every layer alike: one table, which frees if the layers slide
        return single_group(num_layers, kinds[0])
    by_kind = [[layer for layer in range(num_layers) if windows[layer] == w] for w in kinds]
    # Groups as large as the rarest kind, so the full-attention group pads no slab.
    num_slabs = min(len(layers) for layers in by_kind)
    group_windows, layer_groups, layer_slabs = [], [0] * num_layers, [0] * num_layers
    for window, layers in zip(kinds, by_kind, strict=True):
        for start in range(0, len(layers), num_slabs):
            for slab, layer in enumerate(layers[start : start + num_slabs]):
                layer_groups[layer], layer_slabs[layer] = len(group_windows), slab
            group_windows.append(window)
    return KVCacheGroups(tuple(group_windows), tuple(layer_groups), tuple(layer_slabs), num_slabs)
