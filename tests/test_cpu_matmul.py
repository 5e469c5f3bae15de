"""The packed-weight matmul (the CPU runner's matmuls) against numpy, through the C++ kernel and
through the XLA fallback on the same panels; block-quantized weights against their float32
values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import cpu_kernels, cpu_matmul
from kernels_pallas.cpu_matmul import pack, pack_blocks, packed_columns, packed_matmul

# Rows below, at and past the kernel's 4-row tile; columns inside one panel, filling panels,
# and ending mid-panel; odd inner sizes.
SHAPES = [(1, 64, 100), (3, 33, 24), (4, 7, 49), (9, 128, 96), (32, 576, 1000), (130, 40, 30)]


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("rows,inner,columns", SHAPES)
def test_matches_numpy(rows, inner, columns, kernel, monkeypatch):
    if kernel:
        assert cpu_kernels.usable()  # the kernel builds here, so these cases run it
    else:
        monkeypatch.setattr(cpu_kernels, "usable", lambda: False)
    rng = np.random.default_rng(rows * 1000 + columns)
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    w = rng.normal(size=(inner, columns)).astype(np.float32)
    packed = pack(jnp.asarray(w))
    assert packed.panels.shape == (-(-columns // cpu_matmul.PANEL), inner, cpu_matmul.PANEL)
    out = jax.jit(packed_matmul)(jnp.asarray(x), packed)
    assert out.shape == (rows, columns) and out.dtype == jnp.float32
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4)


def test_other_dtypes_take_the_xla_path():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(5, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(16, 30)), jnp.bfloat16)
    out = packed_matmul(x, pack(w))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(x @ w, np.float32), rtol=2e-2, atol=2e-2
    )


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
    assert cpu_kernels.usable()
    rng = np.random.default_rng(rows * 100 + bits)
    codes, scales, offsets, weight = random_blocks(rng, inner, columns, bits)
    quantized = pack_blocks(codes, scales, offsets, bits)
    assert quantized.codes.shape == (-(-columns // 24), inner * bits // 8, 24)
    x = jnp.asarray(rng.normal(size=(rows, inner)).astype(np.float32))
    got = np.asarray(jax.jit(packed_matmul)(x, quantized))
    assert np.array_equal(got, np.asarray(jax.jit(packed_matmul)(x, pack(weight))))
    ids = jnp.asarray([0, columns - 1, columns // 2])
    assert np.array_equal(np.asarray(packed_columns(quantized, ids)), weight[:, ids].T)


@pytest.mark.parametrize("bits", [4, 8])
def test_block_quantized_xla_fallback(bits, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "usable", lambda: False)
    rng = np.random.default_rng(bits)
    codes, scales, offsets, weight = random_blocks(rng, 96, 50, bits)
    x = rng.normal(size=(5, 96)).astype(np.float32)
    out = packed_matmul(jnp.asarray(x), pack_blocks(codes, scales, offsets, bits))
    want = x.astype(np.float64) @ weight.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_pack_blocks_rejects_inconsistent_shapes():
    codes, scales, offsets, _ = random_blocks(np.random.default_rng(0), 64, 10, 4)
    with pytest.raises(ValueError, match="pack_blocks"):
        pack_blocks(codes[:24], scales, offsets, 4)  # codes for 48 of the 64 inputs
    with pytest.raises(ValueError, match="pack_blocks"):
        pack_blocks(codes, scales[:, :5], offsets, 4)
    with pytest.raises(ValueError, match="pack_blocks"):
        pack_blocks(codes, scales, offsets, 2)
