"""Weights that know how to multiply: what `models.llama` accepts in place of a plain array.

The model uses a weight in four ways, and any pytree type with the matching methods can stand
for one (a platform packs weights into its own types at load time, see `pagedjax/platforms/`):

- `matmul(x [M, K]) -> [M, N]`: the LM head;
- `layer_matmul(x [M, K], layer) -> [M, N]`: a weight stacked over layers, multiplied inside
  the layer scan (`layer` is traced);
- `take_columns(ids [R]) -> [R, K]`: a tied LM head serving the token lookup, so the
  embedding table is not held twice;
- `grouped_matmul(x [P, K], layer, tiles) -> [P, N]`: a mixture of experts' weights, each
  tile of rows times its expert's (`models/moe.py`, `kernels_pallas/grouped_matmul.py`).

`QuantizedLinear` keeps GGUF's block-quantized weights (Q4_0, Q4_1, Q8_0) as the file stores
them and widens them in XLA for each product. code x scale + offset is exact in float32, so
the widened weight is the dequantized float32 weight, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from kernels_pallas.grouped_matmul import ExpertTiles

BLOCK = 32  # inputs per scale and offset in GGUF's Q4_0, Q4_1 and Q8_0


@runtime_checkable
class LinearWeight(Protocol):
    """A [K, N] weight that multiplies by itself (the LM head)."""

    def matmul(self, x: jax.Array) -> jax.Array: ...  # [M, K] -> [M, N] in x's dtype

    def take_columns(self, ids: jax.Array) -> jax.Array: ...  # [R] -> [R, K]


@runtime_checkable
class StackedLinearWeight(Protocol):
    """L weights [K, N] stacked over layers, multiplied one layer at a time."""

    def layer_matmul(self, x: jax.Array, layer: jax.Array) -> jax.Array: ...  # [M, K] -> [M, N]


@runtime_checkable
class GroupedLinearWeight(Protocol):
    """Experts' weights [M, E, K, N] stacked over the expert layers: rows sorted by expert in
    tiles (`kernels_pallas/grouped_matmul.py`) times their tile's expert of layer `layer`."""

    @property
    def shape(self) -> tuple[int, ...]: ...  # [M, E, K, N]

    def grouped_matmul(
        self, x: jax.Array, layer: jax.Array, tiles: ExpertTiles
    ) -> jax.Array: ...  # [P, K] -> [P, N]


def layer_matmul(
    x: jax.Array, weight: jax.Array | StackedLinearWeight, layer: jax.Array
) -> jax.Array:
    """x @ weight[layer], for a stacked array or a weight type that multiplies by itself."""
    if isinstance(weight, StackedLinearWeight):
        return weight.layer_matmul(x, layer)
    return x @ weight[layer]


def widen_blocks(codes: jax.Array, scales: jax.Array, offsets: jax.Array, bits: int) -> jax.Array:
    """Codes [..., K * bits / 8] with scales and offsets [..., K / 32] -> float32 [..., K].

    4-bit codes are in GGUF's order: byte 16 b + j holds input 32 b + j in its low nibble and
    32 b + j + 16 in its high one. 8-bit codes are int8 bytes."""
    if bits == 4:
        codes = codes.reshape(*codes.shape[:-1], -1, BLOCK // 2)  # [..., K / 32, 16]
        codes = jnp.stack([codes & 0x0F, codes >> 4], axis=-2).reshape(*codes.shape[:-2], -1)
    else:
        codes = jax.lax.bitcast_convert_type(codes, jnp.int8)
    # The product is exact, so a fused multiply-add or not gives the same float32.
    scales, offsets = jnp.repeat(scales, BLOCK, axis=-1), jnp.repeat(offsets, BLOCK, axis=-1)
    return codes.astype(jnp.float32) * scales + offsets


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedLinear:
    """A [K, N] weight w with w[k, n] = code x scale + offset, one scale and offset per 32 k,
    held in the file's [N, K] orientation; with a leading layer axis L when stacked:

    codes    [(L,) N, K * bits / 8] uint8
    scales   [(L,) N, K / 32] float32
    offsets  [(L,) N, K / 32] float32
    """

    codes: jax.Array
    scales: jax.Array
    offsets: jax.Array
    bits: int = field(metadata=dict(static=True))

    def _product(self, x: jax.Array, codes, scales, offsets) -> jax.Array:
        weight = widen_blocks(codes, scales, offsets, self.bits)  # [N, K]
        out = jax.lax.dot_general(x.astype(jnp.float32), weight, (((1,), (1,)), ((), ())))
        return out.astype(x.dtype)

    def matmul(self, x: jax.Array) -> jax.Array:
        return self._product(x, self.codes, self.scales, self.offsets)

    def layer_matmul(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        return self._product(x, self.codes[layer], self.scales[layer], self.offsets[layer])

    def take_columns(self, ids: jax.Array) -> jax.Array:
        return widen_blocks(self.codes[ids], self.scales[ids], self.offsets[ids], self.bits)
