"""A step's int32 host inputs in one array: one host-to-device transfer per step.

A jitted call copies each host (numpy) argument to the device on its own: a dispatch each, and
on a GPU a staging copy each. The forward's inputs (token ids, placeholder sources, positions,
the attention metadata, logits rows, copy-on-write pairs) are all int32, so the runner packs
them into one flat array on the host and the step unpacks it on the device with static slices.
`StepLayout` (the inputs' tree and shapes) is a static argument: it changes only with the
bucket, so packing adds no compilation. `pack_bits` packs 32-bit arrays of other types (the
sampling arrays) as their bits, which `unpack` casts back: `PackedSampling` carries them to the
sampler's jitted call, which takes them apart itself (no dispatch of their own); `sender` puts
such an array on the device through jit's own argument transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from math import prod
from typing import Any

import jax
import numpy as np

from pagedjax.sampler import SamplingMetadata


@dataclass(frozen=True)
class StepLayout:
    """Where each input lies in the packed array (hashable: a jit static argument)."""

    treedef: Any  # jax.tree_util.PyTreeDef of the inputs
    shapes: tuple[tuple[int, ...], ...]  # each leaf's shape, in tree order
    dtypes: tuple[str, ...] = ()  # each leaf's type (`pack_bits`; empty: all int32)


def pack(inputs: Any) -> tuple[np.ndarray, StepLayout]:
    """A tree of int32 host arrays -> (one flat int32 array, its layout)."""
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    arrays = [np.asarray(leaf, np.int32) for leaf in leaves]
    packed = np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0, np.int32)
    return packed, StepLayout(treedef, tuple(a.shape for a in arrays))


def pack_bits(inputs: Any) -> tuple[np.ndarray, StepLayout]:
    """A tree of 32-bit host arrays of any type -> (one flat int32 array of their bits, its
    layout)."""
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    arrays = [np.ascontiguousarray(leaf) for leaf in leaves]
    if any(a.dtype.itemsize != 4 for a in arrays):
        raise ValueError(f"pack_bits packs 32-bit arrays, not {[a.dtype for a in arrays]}")
    packed = np.concatenate([a.ravel().view(np.int32) for a in arrays])
    layout = StepLayout(treedef, tuple(a.shape for a in arrays), tuple(a.dtype.str for a in arrays))
    return packed, layout


def unpack(packed: jax.Array, layout: StepLayout) -> Any:
    """`pack`'s (or `pack_bits`') inverse, on the device: static slices of the one
    transferred array."""
    leaves, start = [], 0
    for i, shape in enumerate(layout.shapes):
        size = prod(shape)
        leaf = packed[start : start + size].reshape(shape)
        if layout.dtypes and layout.dtypes[i] != leaf.dtype.str:
            leaf = jax.lax.bitcast_convert_type(leaf, np.dtype(layout.dtypes[i]))
        leaves.append(leaf)
        start += size
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


def padded(packed: np.ndarray) -> np.ndarray:
    """A packed array zero-padded to a power of two, so that few sizes compile `sender`."""
    out = np.zeros(1 << max(len(packed) - 1, 0).bit_length(), np.int32)
    out[: len(packed)] = packed
    return out


@cache
def sender(sharding: jax.sharding.Sharding | None) -> Any:
    """A jitted identity that puts its argument, a host array, on `sharding` (None: the
    default device): jit's C++ argument transfer, where `jax.device_put`'s Python path
    costs several times more. The transferred copy is donated, so nothing is copied again."""
    if sharding is None:
        return jax.jit(lambda x: x, donate_argnums=0)
    return jax.jit(lambda x: x, in_shardings=sharding, out_shardings=sharding, donate_argnums=0)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedSampling:
    """The sampler's arrays on the device as one transfer sent them: their bits (`pack_bits`),
    taken apart inside the jitted call that reads them (`unpacked`), so that sending them costs
    no dispatch of its own; the draw counters and the verified drafts, which other calls make
    on the device, beside them (None: the packed ones, if any)."""

    bits: jax.Array  # [N] int32 (`padded`: the layout says what is read)
    layout: StepLayout = field(metadata=dict(static=True))
    steps: jax.Array | None = None  # [S] i32
    draft_token_ids: jax.Array | None = None  # [S] i32

    @property
    def num_rows(self) -> int:
        """The sample rows (the first array's, SamplingMetadata.temperature's, length)."""
        return self.layout.shapes[0][0]

    def unpacked(self) -> SamplingMetadata:
        meta = unpack(self.bits, self.layout)
        if self.steps is not None:
            meta = replace(meta, steps=self.steps)
        if self.draft_token_ids is not None:
            meta = replace(meta, draft_token_ids=self.draft_token_ids)
        return meta
