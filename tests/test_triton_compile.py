"""The Pallas kernels compiled to cubins for Hopper (sm_90) and Ampere (sm_80) on this CPU-only
host, by the `triton` package's own pipeline (benchmarks/triton_compile.py): what XLA's GPU
backend does with them on a GPU. Each kernel, with its default tiling, for each pool dtype and
head_dim must compile, spill no registers, fit its shared memory, keep float32 off the tensor
cores (IEEE float32, not TF32) and 16-bit/fp8 on them, and pipeline its KV loads."""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from kernels_pallas.decode_attention import DecodeConfig
from kernels_pallas.ragged_paged_attention import RaggedConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from triton_compile import MAX_SHARED_BYTES, compile_kernel  # noqa: E402  (a developer tool)

pytest.importorskip("triton", reason="Triton has wheels for Linux x86-64 only")

KV_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


@pytest.mark.parametrize("capability", [90, 80], ids=["sm90", "sm80"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES), ids=list(KV_DTYPES))
@pytest.mark.parametrize("kernel", ["ragged", "decode"])
def test_kernel_compiles_without_spilling(kernel, kv_dtype, head_dim, capability):
    compiled = compile_kernel(
        kernel, capability, kv_dtype=KV_DTYPES[kv_dtype], head_dim=head_dim, group=4
    )
    assert compiled.stack_bytes == 0, f"{compiled}: registers spill to local memory"
    assert compiled.shared_bytes <= MAX_SHARED_BYTES[capability], compiled
    assert compiled.cp_async > 0, f"{compiled}: KV loads are not pipelined"
    if kv_dtype == "f32":
        assert compiled.tensor_core_ops == 0, f"{compiled}: float32 dots run as TF32"
    else:
        assert compiled.tensor_core_ops > 0, compiled
    if kernel == "ragged" and kv_dtype != "f32" and capability == 90:
        assert compiled.wgmma > 0, f"{compiled}: no Hopper warpgroup MMA"


@pytest.mark.parametrize("kernel", ["ragged", "decode"])
def test_three_stages_stream_the_next_tile_during_the_dots(kernel):
    """With num_stages 3 the kernels carry the next tile's page ids (fold_kv_tiles), and
    Triton double-buffers the KV tiles: a second K and V tile of shared memory (bf16,
    head_dim 128, 64-token tiles: 32 KiB), loads in flight while a tile is consumed."""

    def compiled(num_stages):
        config = (RaggedConfig if kernel == "ragged" else DecodeConfig)(num_stages=num_stages)
        return compile_kernel(kernel, kv_dtype=jnp.bfloat16, head_dim=128, group=4, config=config)

    two, three = compiled(2), compiled(3)
    assert three.stack_bytes == 0, three
    assert three.shared_bytes >= two.shared_bytes + 2 * 64 * 128 * 2, (two, three)
    assert three.cp_async > two.cp_async, (two, three)
