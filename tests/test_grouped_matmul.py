"""The experts' grouped matmul: the routing tiles, the kernel (Pallas interpret mode on the CPU)
against the reference and XLA, the MoE MLP against computing every expert, and the kernel's
CUDA lowering."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import (
    GroupedMatmulConfig,
    PallasExperts,
    expert_tiles,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_matmul_xla,
    num_tiles_bound,
    tile_rows,
)
from kernels_pallas.paged_attention import resolve_interpret
from models.config import ModelConfig, MoeConfig
from models.moe import moe_mlp, moe_mlp_dense

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from triton_compile import cuda_target, triton_call_targets, triton_ir_text, triton_kernels  # noqa: E402

INTERPRET = resolve_interpret()


def random_assignments(rng, num_tokens: int, top_k: int, num_experts: int, skew: bool):
    """[T, k] distinct experts per token; skew: most tokens pick from the first few experts."""
    p = None
    if skew:
        p = np.r_[np.full(2, 8.0), np.ones(num_experts - 2)]
        p /= p.sum()
    rows = [rng.choice(num_experts, top_k, replace=False, p=p) for _ in range(num_tokens)]
    return np.asarray(rows, np.int32).reshape(num_tokens, top_k)


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,skew",
    [(1, 2, 8, False), (5, 1, 4, False), (37, 2, 6, True), (200, 3, 16, True), (64, 8, 8, False)],
)
def test_tiles_hold_each_assignment_once_in_a_tile_of_its_expert(
    num_tokens, top_k, num_experts, skew
):
    ids = random_assignments(np.random.default_rng(num_tokens), num_tokens, top_k, num_experts,
                             skew)  # fmt: skip
    tile = tile_rows(ids.size, num_experts)
    tiles = jax.jit(expert_tiles, static_argnums=(1, 2))(jnp.asarray(ids), num_experts, tile)
    rows, experts = np.asarray(tiles.rows), np.asarray(tiles.tile_experts)
    positions, used = np.asarray(tiles.positions), int(tiles.num_tiles)
    assert experts.shape == (num_tiles_bound(ids.size, num_experts, tile),)
    assert rows.shape == (experts.size * tile,)
    assert len(set(positions.ravel())) == ids.size  # one row each
    assert (rows[positions] == np.arange(num_tokens)[:, None]).all()
    assert (experts[positions // tile] == ids).all()
    assert (positions < used * tile).all()
    need = sum(-(-int((ids == e).sum()) // tile) for e in range(num_experts))
    assert used == need  # no tile wasted between experts
    counts = np.asarray(tiles.tile_counts)
    assert counts.sum() == ids.size and not counts[used:].any()
    for row in positions.ravel():  # an assignment's row is among its tile's counted rows
        assert row % tile < counts[row // tile]
    assert (np.diff(experts) >= 0).all()
    for e in range(num_experts):  # token order within an expert: the stable sort
        token_rows = positions[ids == e]
        assert (np.diff(token_rows) > 0).all()


def test_assignments_to_other_shards_experts_sort_last_and_are_skipped():
    """Expert parallelism: ids E (experts held elsewhere) form a group after every real one,
    past `num_tiles`, with zero counts, so no kernel computes them; the real assignments
    tile as they would alone."""
    rng = np.random.default_rng(7)
    ids = random_assignments(rng, 23, 2, 8, skew=False)
    local = np.where(ids < 4, ids, 4).astype(np.int32)  # this shard holds experts 0-3
    tile = tile_rows(local.size, 4)
    tiles = expert_tiles(jnp.asarray(local), 4, tile, dropped=True)
    used, counts = int(tiles.num_tiles), np.asarray(tiles.tile_counts)
    positions, experts = np.asarray(tiles.positions), np.asarray(tiles.tile_experts)
    mine = local < 4
    assert (positions[mine] < used * tile).all() and (positions[~mine] >= used * tile).all()
    assert (experts[positions[mine] // tile] == local[mine]).all()
    assert counts[:used].sum() == mine.sum() and not counts[used:].any()
    assert experts.shape[0] == num_tiles_bound(local.size, 5, tile)


def _case(rng, num_tiles, tile, k, n, groups, dtype):
    x = jnp.asarray(rng.standard_normal((num_tiles * tile, k)), dtype)
    w = jnp.asarray(rng.standard_normal((groups, k, n)) / np.sqrt(k), dtype)
    tile_groups = jnp.asarray(np.sort(rng.integers(0, groups, num_tiles)), jnp.int32)
    return x, w, tile_groups


@pytest.mark.parametrize(
    "tile,k,n,dtype,used",
    [
        (16, 64, 96, jnp.float32, 5),  # N = 96 runs in blocks of 32
        (32, 160, 64, jnp.bfloat16, 3),  # K = 160 in blocks of 32
        (16, 48, 16, jnp.float32, 7),  # every tile used
    ],
)
def test_kernel_matches_reference_and_xla(tile, k, n, dtype, used):
    rng = np.random.default_rng(tile + k)
    x, w, tile_groups = _case(rng, 7, tile, k, n, 5, dtype)
    config = GroupedMatmulConfig(block_n=64, block_k=64)
    out = grouped_matmul(x, w, tile_groups, jnp.int32(used), config=config, interpret=INTERPRET)
    want = grouped_matmul_reference(x, w, tile_groups)
    rows = used * tile
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    got = np.asarray(out[:rows], np.float32)
    np.testing.assert_allclose(got, np.asarray(want[:rows]), **tol)
    assert not np.asarray(out[rows:], np.float32).any()  # the skipped tiles' rows are zeros
    xla = np.asarray(grouped_matmul_xla(x, w, tile_groups), np.float32)
    np.testing.assert_allclose(xla, np.asarray(want), **tol)


def test_kernel_refuses_widths_it_cannot_tile():
    x, w, groups = _case(np.random.default_rng(0), 2, 16, 40, 32, 2, jnp.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        grouped_matmul(x, w, groups, jnp.int32(2), interpret=True)


def moe_case(shared: int = 0, num_tokens: int = 29):
    rng = np.random.default_rng(3)
    moe = MoeConfig(num_experts=6, top_k=2, intermediate_size=32, normalize_top_k=False,
                    sparse_layers=(True, True), shared_intermediate_size=shared)  # fmt: skip
    config = ModelConfig("Qwen2MoeForCausalLM", 64, 48, 0, 2, 4, 2, 12, 1e-6, 1e4, 128, False,
                         moe=moe)  # fmt: skip
    H, E, I = 48, 6, 32  # noqa: N806, E741

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32)

    weights = {"router": w(2, H, E), "experts_gate_up": w(2, E, H, 2 * I),
               "experts_down": w(2, E, I, H)}  # fmt: skip
    if shared:
        weights.update(shared_gate_up=w(2, H, 2 * shared), shared_down=w(2, shared, H),
                       shared_gate=w(2, H, 1))  # fmt: skip
    return config, weights, w(num_tokens, H)


@pytest.mark.parametrize("shared", [0, 24])
def test_moe_mlp_matches_every_expert_computed(shared):
    config, weights, h = moe_case(shared)
    for layer in (0, 1):
        grouped = moe_mlp(config, weights, h, jnp.int32(layer), jax.nn.silu)
        dense = moe_mlp_dense(config, weights, h, jnp.int32(layer), jax.nn.silu)
        np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), rtol=1e-5, atol=1e-5)


def test_moe_mlp_through_the_kernel_matches_xla():
    config, weights, h = moe_case(num_tokens=11)
    kernel = {**weights}
    for name in ("experts_gate_up", "experts_down"):
        kernel[name] = PallasExperts(weights[name], interpret=INTERPRET)
    got = moe_mlp(config, kernel, h, jnp.int32(1), jax.nn.silu)
    want = moe_mlp(config, weights, h, jnp.int32(1), jax.nn.silu)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_lowers_for_cuda(dtype):
    """Traced for a CUDA target without a GPU: one Triton kernel with its one dot."""
    tile, k, n = 64, 1024, 768
    x = jax.ShapeDtypeStruct((8 * tile, k), dtype)
    w = jax.ShapeDtypeStruct((64, k, n), dtype)
    groups = jax.ShapeDtypeStruct((8,), jnp.int32)
    used = jax.ShapeDtypeStruct((), jnp.int32)
    with cuda_target(90):
        lowered = grouped_matmul.trace(x, w, groups, used).lower(lowering_platforms=("cuda",))
    assert len(triton_call_targets(lowered)) == 1
    for kernel_ir in triton_kernels(lowered):
        assert triton_ir_text(kernel_ir).count("tt.dot") == 1


# ------------------------------------------------------------- LoRA: the same kernel, per slot


def lora_case(num_tokens: int = 37, max_loras: int = 3, k: int = 64, width: int = 32, n: int = 96):
    """Two layers of slots {"a": [2, S, K, nR], "b": [2, S, nR, N]}, tokens of every slot and
    of the base model (slot 0)."""
    rng = np.random.default_rng(5)
    slots = {
        "a": jnp.asarray(rng.normal(0, 0.3, (2, max_loras, k, width)), jnp.float32),
        "b": jnp.asarray(rng.normal(0, 0.3, (2, max_loras, width, n)), jnp.float32),
    }
    token_slots = jnp.asarray(rng.integers(0, max_loras + 1, num_tokens), jnp.int32)
    x = jnp.asarray(rng.normal(0, 1, (num_tokens, k)), jnp.float32)
    return slots, token_slots, x


def test_lora_delta_by_slot_and_by_the_grouped_kernel_match_each_token_s_own_product():
    from models.lora import lora_delta, lora_tiles

    slots, token_slots, x = lora_case()
    for layer in (0, 1):
        a, b = np.asarray(slots["a"][layer]), np.asarray(slots["b"][layer])
        want = np.stack([
            np.asarray(x[t]) @ a[s - 1] @ b[s - 1] if s else np.zeros(b.shape[-1])
            for t, s in enumerate(np.asarray(token_slots))
        ])  # fmt: skip
        one_hot = lora_delta(x, slots, jnp.int32(layer), token_slots)
        kernel = {key: PallasExperts(w, interpret=INTERPRET) for key, w in slots.items()}
        tiles = lora_tiles(token_slots, slots["a"].shape[1])
        grouped = lora_delta(x, kernel, jnp.int32(layer), token_slots, tiles)
        np.testing.assert_allclose(np.asarray(one_hot), want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(grouped), want, rtol=1e-4, atol=1e-4)
        assert not np.asarray(grouped)[np.asarray(token_slots) == 0].any()


def test_lora_delta_through_the_kernel_lowers_for_cuda():
    """The shrink and the expand: two Triton kernels of one dot each, in one step."""
    from models.lora import lora_delta, lora_tiles

    def delta(x, a, b, token_slots):
        kernel = {"a": PallasExperts(a), "b": PallasExperts(b)}
        tiles = lora_tiles(token_slots, a.shape[1])
        return lora_delta(x, kernel, jnp.int32(1), token_slots, tiles)

    args = (
        jax.ShapeDtypeStruct((256, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((30, 4, 576, 48), jnp.bfloat16),
        jax.ShapeDtypeStruct((30, 4, 48, 1728), jnp.bfloat16),
        jax.ShapeDtypeStruct((256,), jnp.int32),
    )
    with cuda_target(90):
        lowered = jax.jit(delta).trace(*args).lower(lowering_platforms=("cuda",))
    assert len(triton_call_targets(lowered)) == 2
    for kernel_ir in triton_kernels(lowered):
        assert triton_ir_text(kernel_ir).count("tt.dot") == 1
