"""Matmuls against weights packed once at load time, for XLA:CPU.

XLA:CPU repacks a dot's weight operand on every call, which at decode's few rows costs as much
as the arithmetic. `pack` lays a weight out once as panels of 24 output columns, and
`packed_matmul` runs the C++ kernel of `cpu/packed_matmul.cc` on them (built by `cpu_kernels`):
1.5x XLA's speed at 32 rows on the default model, and at least XLA's from 1 to 512 rows. Where
the kernel is not built, XLA runs the same product on the same panels.

`pack_blocks` keeps a GGUF block-quantized weight (Q4_0, Q4_1, Q8_0) in its file's form instead,
as the same panels of codes with a scale and offset per 32 k: the C++ kernel widens each panel
to float32 as it goes, exactly (see `cpu/packed_matmul.cc`), so the products equal those of the
dequantized weight bit for bit while reading 5.3x (8-bit: 3.2x) fewer bytes of weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_kernels

TARGET = "pagedjax_packed_matmul"
QUANTIZED_TARGET = "pagedjax_quantized_matmul"
PANEL = 24  # output columns per panel (the kernel's register tile is 4 rows x 24 columns)
BLOCK = 32  # k per scale and offset in a block-quantized weight (GGUF's Q4_0, Q4_1, Q8_0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [K, N] weight as panels [P, K, 24]: panels[p, k, c] = w[k, p * 24 + c], zero past N."""

    panels: jax.Array
    columns: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A [K, N] weight w[k, n] = code * scale + offset, as panels of 24 columns like PackedWeight:

    codes    [P, K / 2, 24] uint8 (4-bit, in GGUF's order: byte 16 b + j holds k = 32 b + j in
             its low nibble and k = 32 b + j + 16 in its high one) or [P, K, 24] (8-bit: int8)
    scales   [P, K / 32, 24] float32, one per 32 k and column
    offsets  [P, K / 32, 24] float32
    """

    codes: jax.Array
    scales: jax.Array
    offsets: jax.Array
    columns: int = dataclasses.field(metadata=dict(static=True))
    bits: int = dataclasses.field(metadata=dict(static=True))


def _panels(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [P, K, 24] with panels[p, k, c] = w[k, p * 24 + c], zero past N."""
    k, n = w.shape
    num_panels, full = -(-n // PANEL), n // PANEL
    panels = np.zeros((num_panels, k, PANEL), w.dtype)
    panels[:full] = w[:, : full * PANEL].reshape(k, full, PANEL).transpose(1, 0, 2)
    if full < num_panels:
        panels[full, :, : n - full * PANEL] = w[:, full * PANEL :]
    return panels


def pack(weight: jax.Array | np.ndarray) -> PackedWeight:
    """[K, N] -> PackedWeight. Laid out with numpy on the host: at load time, eager jnp ops
    per weight would cost a dispatch (and a cached executable) each."""
    w = np.asarray(weight)
    return PackedWeight(jax.device_put(_panels(w)), w.shape[1])


def pack_blocks(
    codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, bits: int
) -> QuantizedWeight:
    """codes [K * bits / 8, N] bytes (in QuantizedWeight's order), scales and offsets
    [K / 32, N] float32 -> QuantizedWeight. Past N all are zero: a zero weight."""
    k, n = scales.shape[0] * BLOCK, scales.shape[1]
    if bits not in (4, 8) or codes.shape != (k * bits // 8, n) or offsets.shape != scales.shape:
        raise ValueError(f"pack_blocks: codes {codes.shape}, scales {scales.shape}, bits {bits}")
    return QuantizedWeight(
        jax.device_put(_panels(np.asarray(codes).view(np.uint8))),
        jax.device_put(_panels(np.asarray(scales, np.float32))),
        jax.device_put(_panels(np.asarray(offsets, np.float32))),
        n,
        bits,
    )


def widen_blocks(codes: jax.Array, scales: jax.Array, offsets: jax.Array, bits: int) -> jax.Array:
    """Codes [..., K * bits / 8] with scales and offsets [..., K / 32] -> weights [..., K]."""
    if bits == 4:
        codes = codes.reshape(*codes.shape[:-1], -1, BLOCK // 2)  # [..., K / 32, 16]
        codes = jnp.stack([codes & 0x0F, codes >> 4], axis=-2).reshape(*codes.shape[:-2], -1)
    else:
        codes = jax.lax.bitcast_convert_type(codes, jnp.int8)
    # The product is exact, so a fused multiply-add or not gives the same float32.
    return codes.astype(jnp.float32) * jnp.repeat(scales, BLOCK, axis=-1) + jnp.repeat(
        offsets, BLOCK, axis=-1
    )


def packed_matmul(x: jax.Array, weight: PackedWeight | QuantizedWeight) -> jax.Array:
    """x [M, K] @ weight -> [M, N], in x's dtype."""
    out_shape = jax.ShapeDtypeStruct((x.shape[0], weight.columns), x.dtype)
    if isinstance(weight, QuantizedWeight):
        if x.dtype == jnp.float32 and cpu_kernels.usable():
            call = jax.ffi.ffi_call(QUANTIZED_TARGET, out_shape)
            return call(
                x,
                weight.codes,
                weight.scales,
                weight.offsets,
                columns=np.int64(weight.columns),
                bits=np.int64(weight.bits),
            )
        # [P, 24, K]: k last for widen_blocks, then the same product as below.
        panels = widen_blocks(
            *(a.transpose(0, 2, 1) for a in (weight.codes, weight.scales, weight.offsets)),
            weight.bits,
        )
        out = jax.lax.dot_general(x.astype(jnp.float32), panels, (((1,), (2,)), ((), ())))
    elif x.dtype == weight.panels.dtype == jnp.float32 and cpu_kernels.usable():
        call = jax.ffi.ffi_call(TARGET, out_shape)
        return call(x, weight.panels, columns=np.int64(weight.columns))
    else:
        out = jax.lax.dot_general(x, weight.panels, (((1,), (1,)), ((), ())))  # [M, P, 24]
    return out.reshape(x.shape[0], -1)[:, : weight.columns].astype(x.dtype)


def packed_columns(weight: PackedWeight | QuantizedWeight, index: jax.Array) -> jax.Array:
    """weight[:, index].T -> [len(index), K]: with tied embeddings the packed LM head doubles as
    the embedding table, so the [V, H] table is not held twice."""
    panel, column = index // PANEL, index % PANEL
    if isinstance(weight, QuantizedWeight):
        picked = (a[panel, :, column] for a in (weight.codes, weight.scales, weight.offsets))
        return widen_blocks(*picked, weight.bits)
    return weight.panels[panel, :, column]
