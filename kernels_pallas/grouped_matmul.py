"""The experts' grouped matmul: rows sorted by expert, each run of rows times its expert's weight.

A mixture-of-experts layer sends each of T tokens to k of E experts. Computing every expert
for every token costs E / k times the useful work; here the T x k (token, expert) assignments
are sorted by expert and each expert's run padded to whole tiles of `tile` rows (`ExpertTiles`),
so that every tile belongs to one expert and the product is one small matmul per tile, as
megablox does on TPU. The tile count has a static bound (`num_tiles_bound`), so a step's shapes
are fixed; the tiles past the step's own (`num_tiles`) hold no assignment and are skipped by
the kernel (the XLA path computes them and nobody reads them).

Three implementations of `rows x its tile's weight`, one meaning:

- `grouped_matmul_reference`: each row times its own expert's weight, gathered per row (the
  oracle; memory E-fold of the rows', tests only);
- `grouped_matmul_xla`: the tiles' weights gathered, one batched matmul (CPU, and any
  platform without the kernel);
- `grouped_matmul`: a Pallas kernel (Triton lowering): a program per (tile, N block) loads its
  expert's weight blocks straight from the stacked weights; unused tiles exit at once.

The weights are a stack of G groups [G, K, N]: the experts of every layer flattened, with the
caller offsetting its layer's expert ids, so that no layer's experts are ever copied out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.metadata import next_power_of_2
from kernels_pallas.pallas_common import clamp_index, dot_nn, int32_scalars


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """Where each (token, expert) assignment of a step runs, with P = NT x tile rows:

    rows         [P] int32      the token whose activations each row holds (padding: 0)
    tile_experts [NT] int32     each tile's expert (tiles past num_tiles: the last expert)
    tile_counts  [NT] int32     each tile's rows that hold an assignment (the first ones)
    positions    [T, k] int32   the row of each assignment
    num_tiles    [] int32       tiles holding any assignment (a prefix of the NT)
    """

    rows: jax.Array
    tile_experts: jax.Array
    tile_counts: jax.Array
    positions: jax.Array
    num_tiles: jax.Array

    @property
    def tile(self) -> int:
        return self.rows.shape[0] // self.tile_experts.shape[0]

    def groups(self, layer: jax.Array, num_experts: int) -> jax.Array:
        """[NT] int32: each tile's expert of expert layer `layer`, as an index into every
        layer's experts flattened ([M x E, K, N]), so no layer's experts are sliced out."""
        return (layer * num_experts + self.tile_experts).astype(jnp.int32)


def tile_rows(num_assignments: int, num_experts: int, minimum: int = 16, maximum: int = 128) -> int:
    """The rows per tile for T x k assignments over E experts (static: from the bucket's shape):
    about an expert's average share, so a batch pads at most about as many rows as it holds
    and gathers each expert's weight a few times, not once per few rows; a power of two in
    [minimum, maximum] (16: the least the Pallas kernel's dots take)."""
    share = -(-num_assignments // num_experts)
    return min(max(next_power_of_2(share), minimum), maximum)


def num_tiles_bound(num_assignments: int, num_groups: int, tile: int) -> int:
    """The most tiles A assignments can fill: sum over groups of ceil(g_e / tile) is at most
    floor(A / tile) plus one per group that holds any (at most min(groups, A))."""
    return num_assignments // tile + min(num_groups, num_assignments)


def expert_tiles(
    expert_ids: jax.Array, num_experts: int, tile: int, dropped: bool = False
) -> ExpertTiles:
    """expert_ids [T, k] int32 in [0, E) -> the assignments sorted by expert in tiles.

    dropped: ids may also be E, for assignments to experts held elsewhere (expert
    parallelism); they sort last, after `num_tiles`, so the kernel skips them and XLA's
    products of them go unread. The sort is stable, so an expert's rows keep token order."""
    num_tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1).astype(jnp.int32)  # [A], assignment a = token * k + j
    num_assignments = flat.shape[0]
    groups = num_experts + dropped
    num_tiles = num_tiles_bound(num_assignments, groups, tile)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [A] assignments by expert
    sizes = jnp.zeros((groups,), jnp.int32).at[flat].add(1)  # [E (+ 1)]
    padded = -(-sizes // tile) * tile
    ends = jnp.cumsum(padded)
    padded_starts = ends - padded
    starts = jnp.cumsum(sizes) - sizes
    sorted_experts = flat[order]
    rank = jnp.arange(num_assignments, dtype=jnp.int32) - starts[sorted_experts]
    row_of_sorted = padded_starts[sorted_experts] + rank  # [A]
    positions = jnp.zeros((num_assignments,), jnp.int32).at[order].set(row_of_sorted)
    rows = jnp.zeros((num_tiles * tile,), jnp.int32).at[row_of_sorted].set(order // top_k)
    tile_starts = jnp.arange(num_tiles, dtype=jnp.int32) * tile
    tile_groups = jnp.minimum(jnp.searchsorted(ends, tile_starts, side="right"), groups - 1)
    used = (ends[num_experts - 1] // tile).astype(jnp.int32)
    counts = sizes[tile_groups] - (tile_starts - padded_starts[tile_groups])
    counts = jnp.where(jnp.arange(num_tiles) < used, jnp.clip(counts, 0, tile), 0)
    return ExpertTiles(
        rows=rows,
        tile_experts=jnp.minimum(tile_groups, num_experts - 1).astype(jnp.int32),
        tile_counts=counts.astype(jnp.int32),
        positions=positions.reshape(num_tokens, top_k),
        num_tiles=used,
    )


def grouped_matmul_reference(
    x: jax.Array,  # [P, K]
    w: jax.Array,  # [G, K, N]
    tile_groups: jax.Array,  # [NT] int32
) -> jax.Array:  # [P, N] float32
    """Each row times its tile's weight, gathered per row: obviously right, E-fold memory."""
    tile = x.shape[0] // tile_groups.shape[0]
    per_row = w[jnp.repeat(tile_groups, tile)]  # [P, K, N]
    return jnp.einsum(
        "pk,pkn->pn",
        x,
        per_row,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def grouped_matmul_xla(
    x: jax.Array,  # [P, K]
    w: jax.Array,  # [G, K, N]
    tile_groups: jax.Array,  # [NT] int32
) -> jax.Array:  # [P, N] in x's dtype
    """The tiles' weights gathered ([NT, K, N]) and one batched matmul over the tiles."""
    num_tiles = tile_groups.shape[0]
    tiles = x.reshape(num_tiles, -1, x.shape[1])  # [NT, tile, K]
    out = jnp.einsum("tmk,tkn->tmn", tiles, w[tile_groups])
    return out.reshape(x.shape[0], w.shape[2])


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Static tiling of the Pallas kernel (hashable: a jit static argument)."""

    block_n: int = 64  # output columns per program
    block_k: int = 64  # inputs per step of the loop over K
    num_warps: int = 4
    num_stages: int = 3


def _block(size: int, preferred: int, name: str) -> int:
    """The largest power of two <= preferred that divides size, at least 16 (Triton's dots)."""
    block = preferred
    while block >= 16 and size % block:
        block //= 2
    if block < 16:
        raise ValueError(
            f"the grouped matmul kernel tiles {name} in blocks of 16 or more: {size} is not a "
            "multiple of 16"
        )
    return block


def _kernel(num_tiles_ref, groups_ref, x_ref, w_ref, o_ref, *, block_k: int):
    # x_ref [tile, K] this tile's rows; w_ref [G, K, N] every group; o_ref [tile, BN].
    t, n = pl.program_id(0), pl.program_id(1)
    num_groups, size_k, _ = w_ref.shape
    block_n = o_ref.shape[1]

    @pl.when(t < num_tiles_ref[0])
    def _():
        group = clamp_index(groups_ref[t], num_groups)

        def step(k, acc):
            xs = x_ref[:, pl.ds(k * block_k, block_k)]  # [tile, BK]
            ws = w_ref[group, pl.ds(k * block_k, block_k), pl.ds(n * block_n, block_n)]
            return acc + dot_nn(xs, ws.astype(xs.dtype))

        acc = jnp.zeros(o_ref.shape, jnp.float32)
        acc = lax.fori_loop(0, size_k // block_k, step, acc)
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(t >= num_tiles_ref[0])
    def _():  # rows nobody reads, but zeros rather than whatever the buffer held
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def grouped_matmul(
    x: jax.Array,  # [P, K], P = NT x tile
    w: jax.Array,  # [G, K, N]
    tile_groups: jax.Array,  # [NT] int32, each in [0, G)
    num_tiles: jax.Array,  # [] int32: tiles [num_tiles, NT) are skipped (their rows: 0)
    *,
    config: GroupedMatmulConfig = GroupedMatmulConfig(),
    interpret: bool = False,
) -> jax.Array:  # [P, N] in x's dtype
    """`grouped_matmul_xla` as a Pallas kernel: grid (NT, N / BN); a program multiplies its
    tile's rows by its group's weight columns, K in blocks of BK, accumulating in float32.
    The weights are read where they lie (no block spec: a pointer offset per group)."""
    num_rows, size_k = x.shape
    size_n = w.shape[2]
    num_tile_slots = tile_groups.shape[0]
    tile = num_rows // num_tile_slots
    if tile < 16 or tile != next_power_of_2(tile):
        raise ValueError(f"the kernel's tiles are a power of two >= 16 rows, not {tile}")
    block_n = _block(size_n, config.block_n, "N")
    block_k = _block(size_k, config.block_k, "K")
    (num_tiles,) = int32_scalars(num_tiles)
    return pl.pallas_call(
        functools.partial(_kernel, block_k=block_k),
        grid=(num_tile_slots, size_n // block_n),
        in_specs=[
            pl.no_block_spec,
            pl.no_block_spec,
            pl.BlockSpec((tile, size_k), lambda t, n: (t, 0)),
            pl.no_block_spec,
        ],
        out_specs=pl.BlockSpec((tile, block_n), lambda t, n: (t, n)),
        out_shape=jax.ShapeDtypeStruct((num_rows, size_n), x.dtype),
        # Triton explicitly: in jax 0.10 a GPU pallas_call without params goes to Mosaic GPU.
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="grouped_matmul",
    )(num_tiles, tile_groups.astype(jnp.int32), x, w)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PallasExperts:
    """Experts' weights [M, E, K, N] (stacked over the M expert layers) that multiply by the
    Pallas kernel: the GPU platform's type for them (`models.weights.GroupedLinearWeight`)."""

    weight: jax.Array
    config: GroupedMatmulConfig = dataclasses.field(
        default=GroupedMatmulConfig(), metadata=dict(static=True)
    )
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def grouped_matmul(self, x: jax.Array, layer: jax.Array, tiles: ExpertTiles) -> jax.Array:
        groups = self.weight.reshape(-1, *self.weight.shape[2:])  # a bitcast: nothing copied
        return grouped_matmul(
            x,
            groups,
            tiles.groups(layer, self.weight.shape[1]),
            tiles.num_tiles,
            config=self.config,
            interpret=self.interpret,
        )
