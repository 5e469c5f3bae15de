"""The CPU platform's packed-weight matmuls (the C++ kernel) against numpy; block-quantized
weights, packed for the kernel and as `models.weights.QuantizedLinear` in XLA, against their
float32 values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.weights import QuantizedLinear
from pagedjax.cpu_native import build, matmul
from pagedjax.cpu_native.matmul import pack, pack_blocks

# Rows below, at and past the kernel's 4-row tile; columns inside one panel, filling panels,
# and ending mid-panel; odd inner sizes.
SHAPES = [(1, 64, 100), (3, 33, 24), (4, 7, 49), (9, 128, 96), (32, 576, 1000), (130, 40, 30)]


def test_the_kernels_build_here():
    assert build.available()


@pytest.mark.parametrize("rows,inner,columns", SHAPES)
def test_matches_numpy(rows, inner, columns):
    rng = np.random.default_rng(rows * 1000 + columns)
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    w = rng.normal(size=(inner, columns)).astype(np.float32)
    packed = pack(jnp.asarray(w))
    assert packed.panels.shape == (-(-columns // matmul.PANEL), inner, matmul.PANEL)
    out = jax.jit(type(packed).matmul)(packed, jnp.asarray(x))
    assert out.shape == (rows, columns) and out.dtype == jnp.float32
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4)


def random_blocks(rng, inner: int, columns: int, bits: int):
    """Code bytes [K * bits / 8, N] (GGUF's nibble order), float16-valued scales and offsets
    [K / 32, N], and the float32 weight [K, N] they stand for."""
    if bits == 4:
        values = rng.integers(0, 16, (inner, columns))
        halves = values.reshape(inner // 32, 2, 16, columns)  # k = 32 b + 16 half + j
        codes = (halves[:, 0] | halves[:, 1] << 4).reshape(inner // 2, columns).astype(np.uint8)
    else:
        values = rng.integers(-128, 128, (inner, columns))
        codes = values.astype(np.int8).view(np.uint8)
    scales, offsets = (
        (rng.normal(size=(inner // 32, columns)) * 0.02).astype(np.float16).astype(np.float32)
        for _ in range(2)
    )
    weight = values.astype(np.float32) * np.repeat(scales, 32, 0) + np.repeat(offsets, 32, 0)
    return codes, scales, offsets, weight


BLOCK_SHAPES = [(1, 64, 100), (3, 32, 24), (4, 96, 49), (9, 128, 96), (130, 64, 30)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,inner,columns", BLOCK_SHAPES)
def test_block_quantized_weight_computes_its_float32_products(rows, inner, columns, bits):
    """Same sums as the float32 panels of the same weight, bit for bit: the kernel widens each
    code exactly and runs the float32 tile."""
    rng = np.random.default_rng(rows * 100 + bits)
    codes, scales, offsets, weight = random_blocks(rng, inner, columns, bits)
    quantized = pack_blocks(codes, scales, offsets, bits)
    assert quantized.codes.shape == (-(-columns // 24), inner * bits // 8, 24)
    x = jnp.asarray(rng.normal(size=(rows, inner)).astype(np.float32))
    got = np.asarray(jax.jit(type(quantized).matmul)(quantized, x))
    float32 = pack(weight)
    assert np.array_equal(got, np.asarray(jax.jit(type(float32).matmul)(float32, x)))
    ids = jnp.asarray([0, columns - 1, columns // 2])
    assert np.array_equal(np.asarray(quantized.take_columns(ids)), weight[:, ids].T)
    assert np.array_equal(np.asarray(float32.take_columns(ids)), weight[:, ids].T)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("inner,columns", [(64, 100), (576, 1000)])
def test_decode_rows_widened_in_registers_are_the_scratch_panels_sums(inner, columns, bits):
    """Up to 3 rows the kernel widens each k's codes in registers and multiplies at once
    (FusedTile), from 4 rows it widens a panel into float32 scratch first: the same sums bit
    for bit. Each row count's rows are those of 17 rows, and the float32 panels' product."""
    rng = np.random.default_rng(inner + bits)
    codes, scales, offsets, weight = random_blocks(rng, inner, columns, bits)
    quantized, float32 = pack_blocks(codes, scales, offsets, bits), pack(weight)
    multiply = jax.jit(type(quantized).matmul)
    x = jnp.asarray(rng.normal(size=(17, inner)).astype(np.float32))
    all_rows = np.asarray(multiply(quantized, x))
    for rows in (1, 2, 3, 4, 5, 17):
        got = np.asarray(multiply(quantized, x[:rows]))
        assert np.array_equal(got, all_rows[:rows]), rows
        assert np.array_equal(got, np.asarray(float32.matmul(x[:rows]))), rows


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linear_widens_exactly_in_xla(bits):
    """The platform-free QuantizedLinear (the file's [N, K] codes): its weight is the float32
    weight bit for bit, so are its columns, and its products are the float32 products."""
    rng = np.random.default_rng(bits)
    codes, scales, offsets, weight = random_blocks(rng, 96, 50, bits)
    linear = QuantizedLinear(*(jnp.asarray(a.T) for a in (codes, scales, offsets)), bits)
    ids = jnp.asarray([0, 49, 7])
    assert np.array_equal(np.asarray(linear.take_columns(ids)), weight[:, ids].T)
    x = rng.normal(size=(5, 96)).astype(np.float32)
    out = jax.jit(QuantizedLinear.matmul)(linear, jnp.asarray(x))
    want = x.astype(np.float64) @ weight.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    stacked = QuantizedLinear(
        *(jnp.stack([a, a]) for a in (linear.codes, linear.scales, linear.offsets)), bits
    )
    layer_out = jax.jit(QuantizedLinear.layer_matmul)(stacked, jnp.asarray(x), jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(layer_out), np.asarray(out))


def test_pack_blocks_rejects_inconsistent_shapes():
    codes, scales, offsets, _ = random_blocks(np.random.default_rng(0), 64, 10, 4)
    with pytest.raises(ValueError, match="pack_blocks"):
        pack_blocks(codes[:24], scales, offsets, 4)  # codes for 48 of the 64 inputs
    with pytest.raises(ValueError, match="pack_blocks"):
        pack_blocks(codes, scales[:, :5], offsets, 4)
    with pytest.raises(ValueError, match="pack_blocks"):
        pack_blocks(codes, scales, offsets, 2)


@pytest.mark.parametrize(
    "tokens,top_k,experts,inner,columns", [(1, 2, 8, 64, 100), (37, 3, 6, 33, 48)]
)
def test_grouped_kernel_is_each_experts_matmul_on_its_rows(tokens, top_k, experts, inner, columns):
    """A mixture's experts packed for the grouped kernel: each assignment's row is its token
    times its expert's weight (layer 1 of 2, so the groups are offset by a layer), the packed
    matmul's sums bit for bit; rows no assignment holds are zeros."""
    from kernels_pallas.grouped_matmul import expert_tiles, tile_rows
    from pagedjax.cpu_native.matmul import pack_experts

    rng = np.random.default_rng(tokens)
    w = rng.normal(size=(2, experts, inner, columns)).astype(np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    x = rng.normal(size=(tokens, inner)).astype(np.float32)
    tiles = expert_tiles(jnp.asarray(ids, jnp.int32), experts, tile_rows(ids.size, experts))
    packed = pack_experts(w)
    assert packed.shape == w.shape
    out = jax.jit(lambda r: packed.grouped_matmul(r, jnp.int32(1), tiles))(
        jnp.asarray(x)[tiles.rows]
    )
    out, positions = np.asarray(out), np.asarray(tiles.positions)
    for t in range(tokens):
        for j in range(top_k):
            want = pack(jnp.asarray(w[1, ids[t, j]])).matmul(jnp.asarray(x[t : t + 1]))
            np.testing.assert_array_equal(out[positions[t, j]], np.asarray(want)[0])
    padding = np.setdiff1d(np.arange(out.shape[0]), positions.ravel())
    assert not out[padding].any()


def _at_level(target: str, level: str, columns: int, *args, **attrs) -> np.ndarray:
    x = args[0]
    out_shape = jax.ShapeDtypeStruct((x.shape[0], columns), jnp.float32)
    call = build.ffi_call(target, out_shape, level=level)
    return np.asarray(call(*args, columns=np.int64(columns), **attrs))


@pytest.mark.parametrize("bits", [4, 8, 32])
def test_every_instruction_set_level_gives_the_same_bits(bits):
    """Each level this machine runs (AVX-512, AVX2, the portable loops; `build.levels()`)
    computes every output as the same float32 sum in the same order: the packed and quantized
    matmuls agree bit for bit at each row count, the register tiles' sizes and the fused decode
    tiles' panel groups included (5 panels: a group of 4 and one left over)."""
    rng = np.random.default_rng(bits)
    inner, columns = 96, 5 * 24 - 7
    if bits == 32:
        weight = rng.normal(size=(inner, columns)).astype(np.float32)
        packed, target = pack(weight), matmul.TARGET
        operands, attrs = (packed.panels,), {}
    else:
        codes, scales, offsets, weight = random_blocks(rng, inner, columns, bits)
        packed, target = pack_blocks(codes, scales, offsets, bits), matmul.QUANTIZED_TARGET
        operands, attrs = (packed.codes, packed.scales, packed.offsets), {"bits": np.int64(bits)}
    x = jnp.asarray(rng.normal(size=(19, inner)).astype(np.float32))
    for rows in (1, 2, 4, 5, 9, 19):  # each level's tiles: fused 1-8 rows, then widened
        outs = {
            level: _at_level(target, level, columns, x[:rows], *operands, **attrs)
            for level in build.levels()
        }
        first = outs[build.levels()[-1]]
        for level, out in outs.items():
            assert np.array_equal(out, first), (rows, level)
    want = np.asarray(x, np.float64) @ weight.astype(np.float64)
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-4)


def int8_reference(x: np.ndarray, values: np.ndarray, scales, offsets) -> np.ndarray:
    """llama.cpp's numerics in numpy: each row's 32 inputs quantized to int8 by their max,
    integer sums per block, folded block by block (int8_matmul.cc's order)."""
    rows, inner = x.shape
    xb = x.reshape(rows, inner // 32, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inverse[..., None]), -127, 127).astype(np.int64)
    s = (d * q.sum(-1).astype(np.float32)).astype(np.float32)
    isum = np.einsum("mbk,bkn->mbn", q, values.reshape(inner // 32, 32, -1).astype(np.int64))
    y = np.zeros((rows, values.shape[1]), np.float32)
    for b in range(inner // 32):
        step = (d[:, b : b + 1] * scales[b]).astype(np.float32)
        y = (isum[:, b].astype(np.float64) * step + y).astype(np.float32)
        y = (offsets[b].astype(np.float64) * s[:, b : b + 1] + y).astype(np.float32)
    return y


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_are_llamacpps_numerics_on_every_level(bits):
    """Int8Weight (EngineConfig.int8_activations): the same bits on every instruction-set
    level and at every row count (each row's own function: batch invariant), llama.cpp's
    quantize-then-integer-dot numerics (a numpy model of them), within int8's error of the
    float32 product; its columns are the exact weights."""
    rng = np.random.default_rng(bits + 40)
    inner, columns = 128, 5 * 24 - 7
    codes, scales, offsets, weight = random_blocks(rng, inner, columns, bits)
    packed = matmul.pack_int8(codes, scales, offsets, bits)
    assert packed.codes.shape == (5, inner // 32, bits, 24, 4)
    x = rng.normal(size=(11, inner)).astype(np.float32)
    x[3, 32:64] = 0  # a block of zeros: d = 0
    operands = (packed.codes, packed.scales, packed.offsets)
    full = None
    for rows in (11, 1, 2, 3, 5):
        rows_x, int8_bits = jnp.asarray(x[:rows]), np.int64(bits)
        outs = [
            _at_level(matmul.INT8_TARGET, level, columns, rows_x, *operands, bits=int8_bits)
            for level in build.levels()
        ]
        assert all(np.array_equal(outs[0], out) for out in outs), rows
        full = outs[0] if full is None else full
        assert np.array_equal(outs[0], full[:rows]), rows
    values = matmul.block_values(codes, bits)
    np.testing.assert_allclose(
        full, int8_reference(x, values, scales, offsets), rtol=1e-5, atol=1e-6
    )
    exact = x.astype(np.float64) @ weight.astype(np.float64)
    assert np.abs(full - exact).max() < 0.02 * np.abs(exact).max()
    ids = jnp.asarray([0, columns - 1, columns // 2, 30])
    assert np.array_equal(np.asarray(packed.take_columns(ids)), weight[:, ids].T)
