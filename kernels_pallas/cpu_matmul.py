"""Matmuls against weights packed once at load time, for XLA:CPU.

XLA:CPU repacks a dot's weight operand on every call, which at decode's few rows costs as much
as the arithmetic. `pack` lays a weight out once as panels of 24 output columns, and
`packed_matmul` runs the C++ kernel of `cpu/packed_matmul.cc` on them (built by `cpu_kernels`):
1.5x XLA's speed at 32 rows on the default model, and at least XLA's from 1 to 512 rows. Where
the kernel is not built, XLA runs the same product on the same panels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_kernels

TARGET = "pagedjax_packed_matmul"
PANEL = 24  # output columns per panel (the kernel's register tile is 4 rows x 24 columns)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [K, N] weight as panels [P, K, 24]: panels[p, k, c] = w[k, p * 24 + c], zero past N."""

    panels: jax.Array
    columns: int = dataclasses.field(metadata=dict(static=True))


def pack(weight: jax.Array | np.ndarray) -> PackedWeight:
    """[K, N] -> PackedWeight. Laid out with numpy on the host: at load time, eager jnp ops
    per weight would cost a dispatch (and a cached executable) each."""
    w = np.asarray(weight)
    k, n = w.shape
    num_panels, full = -(-n // PANEL), n // PANEL
    panels = np.zeros((num_panels, k, PANEL), w.dtype)
    panels[:full] = w[:, : full * PANEL].reshape(k, full, PANEL).transpose(1, 0, 2)
    if full < num_panels:
        panels[full, :, : n - full * PANEL] = w[:, full * PANEL :]
    return PackedWeight(jnp.asarray(panels), n)


def packed_matmul(x: jax.Array, weight: PackedWeight) -> jax.Array:
    """x [M, K] @ weight -> [M, N], in x's dtype."""
    if x.dtype == weight.panels.dtype == jnp.float32 and cpu_kernels.usable():
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], weight.columns), x.dtype))
        return call(x, weight.panels, columns=np.int64(weight.columns))
    out = jax.lax.dot_general(x, weight.panels, (((1,), (1,)), ((), ())))  # [M, P, 24]
    return out.reshape(x.shape[0], -1)[:, : weight.columns].astype(x.dtype)


def packed_columns(weight: PackedWeight, index: jax.Array) -> jax.Array:
    """weight[:, index].T -> [len(index), K]: with tied embeddings the packed LM head doubles as
    the embedding table, so the [V, H] table is not held twice."""
    return weight.panels[index // PANEL, :, index % PANEL]
