"""The packed-weight matmul (the CPU runner's matmuls) against numpy, through the C++ kernel and
through the XLA fallback on the same panels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import cpu_kernels, cpu_matmul
from kernels_pallas.cpu_matmul import pack, packed_matmul

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
