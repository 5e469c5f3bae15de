"""Matmuls against weights packed once at load time, by the C++ kernel `csrc/packed_matmul.cc`.

XLA:CPU repacks a dot's weight operand on every call, which at decode's few rows costs about
as much as the arithmetic, and copies a stacked weight's layer slice before using it. So the
CPU platform packs every matmul weight once (`pack_params`): each layer's weight becomes
panels of 24 output columns (`PackedWeight`), or, for a GGUF's block-quantized weight, the
same panels of its code bytes with a scale and offset per 32 inputs (`QuantizedWeight`, widened
exactly in the kernel). A stacked weight becomes `PackedLayers`, whose layer is chosen by a
`lax.switch`, so each layer's panels are read in place. A mixture's expert weights become
`PackedExperts`, every layer's experts' panels in one array that the grouped kernel indexes.
All of them implement the weight methods of `models/weights.py`, so the model runs them as it
runs plain arrays.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.grouped_matmul import ExpertTiles
from models.llama import MATMUL_WEIGHTS, Params
from models.moe import EXPERT_MATMULS, ROUTER_MATMULS
from models.weights import QuantizedLinear, widen_blocks
from pagedjax.cpu_native import build

TARGET = "pagedjax_packed_matmul"
QUANTIZED_TARGET = "pagedjax_quantized_matmul"
INT8_TARGET = "pagedjax_int8_matmul"
GROUPED_TARGET = "pagedjax_grouped_packed_matmul"
PANEL = 24  # output columns per panel (the kernel's register tile is 4 rows x 24 columns)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A float32 [K, N] weight as panels [P, K, 24]: panels[p, k, c] = w[k, p * 24 + c], zero
    past N."""

    panels: jax.Array
    columns: int = dataclasses.field(metadata=dict(static=True))

    def matmul(self, x: jax.Array) -> jax.Array:  # [M, K] float32 -> [M, N]
        out_shape = jax.ShapeDtypeStruct((x.shape[0], self.columns), jnp.float32)
        call = build.ffi_call(TARGET, out_shape)
        return call(x.astype(jnp.float32), self.panels, columns=np.int64(self.columns))

    def take_columns(self, ids: jax.Array) -> jax.Array:  # [R] -> [R, K]
        return self.panels[ids // PANEL, :, ids % PANEL]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A [K, N] weight w[k, n] = code * scale + offset, as panels of 24 columns like
    PackedWeight:

    codes    [P, K / 2, 24] uint8 (4-bit, in GGUF's nibble order) or [P, K, 24] (8-bit: int8)
    scales   [P, K / 32, 24] float16, one per 32 k and column (a GGUF's are float16 values)
    offsets  [P, K / 32, 24] float16
    """

    TARGET: ClassVar[str] = QUANTIZED_TARGET  # the kernel that multiplies them

    codes: jax.Array
    scales: jax.Array
    offsets: jax.Array
    columns: int = dataclasses.field(metadata=dict(static=True))
    bits: int = dataclasses.field(metadata=dict(static=True))

    def matmul(self, x: jax.Array) -> jax.Array:  # [M, K] float32 -> [M, N]
        out_shape = jax.ShapeDtypeStruct((x.shape[0], self.columns), jnp.float32)
        call = build.ffi_call(self.TARGET, out_shape)
        return call(
            x.astype(jnp.float32),
            self.codes,
            self.scales,
            self.offsets,
            columns=np.int64(self.columns),
            bits=np.int64(self.bits),
        )

    def take_columns(self, ids: jax.Array) -> jax.Array:  # [R] -> [R, K]
        panel, column = ids // PANEL, ids % PANEL
        codes, scales, offsets = (
            a[panel, :, column] for a in (self.codes, self.scales, self.offsets)
        )
        return widen_blocks(
            codes, scales.astype(jnp.float32), offsets.astype(jnp.float32), self.bits
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight(QuantizedWeight):
    """A block-quantized [K, N] weight (w = code * scale + offset, per 32 k and column)
    multiplied with each row's activations quantized to int8 per 32 inputs, as llama.cpp does
    (`EngineConfig.int8_activations`; `csrc/int8_matmul.cc`). Codes in "dot panels", four
    consecutive k of a column per 32-bit word, as the integer dot instructions take them:

    codes    [P, K / 32, Q, 24, 4] uint8: 8-bit (Q = 8): byte (b, j, c, i) is the int8 code of
             k = 32 b + 4 j + i; 4-bit (Q = 4): k = 32 b + 4 j + i in its low nibble and
             32 b + 4 (j + 4) + i in its high one
    scales   [P, K / 32, 24] float16
    offsets  [P, K / 32, 24] float16
    """

    TARGET: ClassVar[str] = INT8_TARGET

    def take_columns(self, ids: jax.Array) -> jax.Array:  # [R] -> [R, K], exact
        panel, column = ids // PANEL, ids % PANEL
        picked = self.codes[panel, :, :, column]  # [R, K / 32, Q, 4]
        if self.bits == 4:  # each byte's nibbles: quads j and j + 4
            picked = jnp.concatenate([picked & 0x0F, picked >> 4], axis=-2)
            values = picked.reshape(ids.shape[0], -1).astype(jnp.float32)
        else:
            values = jax.lax.bitcast_convert_type(picked, jnp.int8).reshape(ids.shape[0], -1)
        scale, offset = (
            jnp.repeat(a[panel, :, column], 32, -1) for a in (self.scales, self.offsets)
        )
        return values.astype(jnp.float32) * scale + offset


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLayers:
    """One packed weight per layer: multiplied through a `lax.switch` on the traced layer
    index, which reads the chosen layer's panels in place."""

    layers: tuple[PackedWeight | QuantizedWeight | Int8Weight, ...]

    def layer_matmul(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        branches = [lambda x, w=w: w.matmul(x) for w in self.layers]
        return jax.lax.switch(layer, branches, x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """A mixture's expert weights [M, E, K, N] (stacked over its M expert layers) as panels
    [M x E, P, K, 24]: each tile of rows sorted by expert times its expert's panels, read in
    place by the kernel (`models.weights.GroupedLinearWeight`)."""

    panels: jax.Array
    experts: int = dataclasses.field(metadata=dict(static=True))
    columns: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        groups, _, k, _ = self.panels.shape
        return (groups // self.experts, self.experts, k, self.columns)

    def grouped_matmul(self, x: jax.Array, layer: jax.Array, tiles: ExpertTiles) -> jax.Array:
        groups = tiles.groups(layer, self.experts)
        return grouped_packed_matmul(x, self.panels, groups, tiles.tile_counts, self.columns)


def grouped_packed_matmul(
    x: jax.Array,  # [P, K]
    panels: jax.Array,  # [G, Pn, K, 24]
    groups: jax.Array,  # [NT] int32: each tile's group
    counts: jax.Array,  # [NT] int32: each tile's rows in use
    columns: int,
) -> jax.Array:  # [P, N] in x's dtype; a tile's rows past its count: zeros
    """Each tile of x's rows times its group's panels, by the C++ grouped kernel."""
    out_shape = jax.ShapeDtypeStruct((x.shape[0], columns), jnp.float32)
    call = build.ffi_call(GROUPED_TARGET, out_shape)
    out = call(
        x.astype(jnp.float32),
        panels,
        groups.astype(jnp.int32),
        counts.astype(jnp.int32),
        columns=np.int64(columns),
    )
    return out.astype(x.dtype)


def expert_panels(w, xp=np):
    """[G, K, N] -> [G, P, K, 24]: each group's `panels` (xp as there)."""
    groups, k, n = w.shape
    padded = -(-n // PANEL) * PANEL
    w = xp.pad(w, ((0, 0), (0, 0), (0, padded - n)))
    return w.reshape(groups, k, padded // PANEL, PANEL).transpose(0, 2, 1, 3)


def pack_experts(weight: jax.Array | np.ndarray) -> PackedExperts:
    """[M, E, K, N] float32 -> PackedExperts (laid out with numpy, as `pack`)."""
    w = np.asarray(weight, np.float32)
    layers, experts, k, n = w.shape
    grouped = np.ascontiguousarray(expert_panels(w.reshape(layers * experts, k, n)))
    return PackedExperts(jax.device_put(grouped), experts, n)


def panels(w, xp=np):
    """[K, N] -> [P, K, 24] with panels[p, k, c] = w[k, p * 24 + c], zero past N. `xp`: numpy
    at load time, jax.numpy where the weights are traced (the training forward trains them)."""
    k, n = w.shape
    padded = -(-n // PANEL) * PANEL
    w = xp.pad(w, ((0, 0), (0, padded - n)))
    return w.reshape(k, padded // PANEL, PANEL).transpose(1, 0, 2)


def pack(weight: jax.Array | np.ndarray) -> PackedWeight:
    """[K, N] float32 -> PackedWeight. Laid out with numpy on the host: at load time, eager
    jnp ops per weight would cost a dispatch (and a cached executable) each."""
    w = np.asarray(weight, np.float32)
    return PackedWeight(jax.device_put(panels(w)), w.shape[1])


def check_blocks(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, bits: int) -> None:
    k, n = scales.shape[0] * 32, scales.shape[1]
    if bits not in (4, 8) or codes.shape != (k * bits // 8, n) or offsets.shape != scales.shape:
        raise ValueError(f"pack_blocks: codes {codes.shape}, scales {scales.shape}, bits {bits}")


def half_panels(values: np.ndarray) -> jax.Array:
    """Scales or offsets [K / 32, N] -> float16 panels [P, K / 32, 24], which must hold them
    exactly (a GGUF's Q4_0, Q4_1 and Q8_0 blocks store float16s; Q4_0's -8 x scale is one)."""
    values = np.asarray(values, np.float32)
    half = values.astype(np.float16)
    if not np.array_equal(half.astype(np.float32).view(np.uint32), values.view(np.uint32)):
        raise ValueError(
            "pack_blocks: scales and offsets must be float16 values (as a GGUF's Q4_0, Q4_1 "
            "and Q8_0 blocks store them); pack the widened float32 weight instead"
        )
    return jax.device_put(panels(half))


def pack_blocks(
    codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, bits: int
) -> QuantizedWeight:
    """codes [K * bits / 8, N] bytes (in QuantizedWeight's order), scales and offsets
    [K / 32, N] float32 -> QuantizedWeight. Past N all are zero: a zero weight."""
    check_blocks(codes, scales, offsets, bits)
    n = scales.shape[1]
    return QuantizedWeight(
        jax.device_put(panels(np.asarray(codes).view(np.uint8))),
        half_panels(scales),
        half_panels(offsets),
        n,
        bits,
    )


def block_values(codes: np.ndarray, bits: int) -> np.ndarray:
    """Code bytes [K * bits / 8, N] (QuantizedWeight's order) -> each k's code [K, N] (int8 for
    8-bit, 0..15 for 4-bit)."""
    if bits == 8:
        return np.asarray(codes).view(np.int8)
    halves = np.asarray(codes).reshape(-1, 16, codes.shape[-1])  # [K / 32, 16, N]
    return np.stack([halves & 0x0F, halves >> 4], axis=1).reshape(-1, codes.shape[-1])


def pack_int8(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, bits: int) -> Int8Weight:
    """pack_blocks's arguments -> Int8Weight (dot panels; zero codes past N)."""
    check_blocks(codes, scales, offsets, bits)
    values = panels(block_values(codes, bits))  # [P, K, 24]
    p, k, _ = values.shape
    if bits == 4:  # k = 32 b + 16 h + 4 j + i: h = 0 in the low nibble, 1 in the high one
        quads = values.astype(np.uint8).reshape(p, k // 32, 2, 4, 4, PANEL)
        words = quads[:, :, 0] | quads[:, :, 1] << 4  # [P, K / 32, 4, 4, 24]
    else:
        words = values.view(np.uint8).reshape(p, k // 32, 8, 4, PANEL)
    dot = np.ascontiguousarray(words.transpose(0, 1, 2, 4, 3))  # [P, K / 32, Q, 24, 4]
    return Int8Weight(
        jax.device_put(dot),
        half_panels(scales),
        half_panels(offsets),
        scales.shape[1],
        bits,
    )


def _pack_one(
    w: jax.Array | QuantizedLinear, int8_activations: bool = False
) -> PackedWeight | QuantizedWeight | Int8Weight:
    """A [K, N] float weight, or a [N, K]-oriented QuantizedLinear, packed (`int8_activations`:
    a quantized one as an Int8Weight)."""
    if isinstance(w, QuantizedLinear):
        codes, scales, offsets = (np.asarray(a).T for a in (w.codes, w.scales, w.offsets))
        return (pack_int8 if int8_activations else pack_blocks)(codes, scales, offsets, w.bits)
    return pack(w)


def _pack_stacked(weight: jax.Array | QuantizedLinear, int8_activations: bool) -> PackedLayers:
    # Sliced as numpy arrays: an eager jnp slice per layer would dispatch (and compile) each.
    if isinstance(weight, QuantizedLinear):
        codes, scales, offsets = (
            np.asarray(a) for a in (weight.codes, weight.scales, weight.offsets)
        )
        layers = [
            QuantizedLinear(codes[i], scales[i], offsets[i], weight.bits)
            for i in range(codes.shape[0])
        ]
    else:
        layers = list(np.asarray(weight))
    return PackedLayers(tuple(_pack_one(w, int8_activations) for w in layers))


def pack_params(params: Params, int8_activations: bool = False) -> Params:
    """Float32 params with every matmul weight packed for the kernel: the four layer weights
    as `PackedLayers`, the LM head as one packed weight. With tied embeddings the packed head
    is the embeddings' transpose and replaces them (its `take_columns` serves the lookup).
    `int8_activations`: block-quantized weights multiply int8 activations (`Int8Weight`)."""
    layers = dict(params["layers"])
    # A mixture's router and shared expert too, so every row's product is the kernel's sum
    # in order (batch-invariant), as its experts' are.
    for name in MATMUL_WEIGHTS + ROUTER_MATMULS:
        if name in layers:  # a mixture of experts may have no dense MLP
            layers[name] = _pack_stacked(layers[name], int8_activations)
    for name in EXPERT_MATMULS:
        if name in layers:
            layers[name] = pack_experts(layers[name])
    if "lm_head" in params:
        rest, head = params, params["lm_head"]
    else:
        rest = {k: v for k, v in params.items() if k != "embed"}
        head = np.asarray(params["embed"]).T
    return {**rest, "layers": layers, "lm_head": _pack_one(head, int8_activations)}
