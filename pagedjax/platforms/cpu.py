"""The CPU: the C++ kernels of `pagedjax/cpu_native/` where they build, XLA where they do not.

Blocks are 64 tokens: a page is one KV head's block_size x head_dim tile, and a running
request's pages lie wherever the free list put them, so larger pages make its scattered reads
faster (numbers in benchmarks/README.md); prefix caching shares only whole blocks, which is
what larger blocks cost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from models.llama import Params
from pagedjax.cpu_native import build
from pagedjax.platforms import Platform
from pagedjax.sampler import XLA_SAMPLING

if TYPE_CHECKING:
    from kernels_pallas.backend import AttentionBackend
    from models.training import DenseKernels


@dataclass(frozen=True)
class CpuPlatform(Platform):
    native: bool = False  # the C++ kernels are built and registered
    int8_activations: bool = False  # EngineConfig.int8_activations

    def with_int8_activations(self) -> CpuPlatform:
        if not self.native:
            raise ValueError(
                "int8_activations=True needs the CPU's C++ kernels, which did not build here "
                "(see the warning above): drop it"
            )
        return replace(self, int8_activations=True)

    def _packs(self, dtype: jax.typing.DTypeLike) -> bool:
        """Whether weights are packed for the C++ matmul, which multiplies float32."""
        return self.native and jnp.dtype(dtype) == jnp.float32

    def keeps_quantized_weights(self, dtype: jax.typing.DTypeLike) -> bool:
        # Without the kernel XLA would widen every quantized weight on every step.
        return self._packs(dtype)

    def batch_invariant_backend(
        self, backend: AttentionBackend, dtype: jax.typing.DTypeLike
    ) -> AttentionBackend:
        # The matmul kernel sums each output over k in order (invariant by construction);
        # XLA's dot and the XLA attention loops pick their sums by shape.
        if not self._packs(dtype):
            raise ValueError(
                "batch_invariant=True needs the CPU's C++ kernels and dtype float32"
                + ("" if self.native else " (the kernels did not build here)")
            )
        if backend.name != "cpu_native":
            raise ValueError(
                f"batch_invariant=True runs on the C++ attention, not {backend.name!r}: "
                "leave attention_backend at 'auto' or choose 'cpu_native'"
            )
        from pagedjax.cpu_native.attention import CPU_NATIVE_INVARIANT

        return CPU_NATIVE_INVARIANT

    def dense_kernels(self, block_size: int) -> DenseKernels:
        if not self.native:
            return super().dense_kernels(block_size)
        from pagedjax.cpu_native.dense import dense_kernels

        return dense_kernels(block_size)

    def prepare_params(self, params: Params, dtype: jax.typing.DTypeLike) -> Params:
        if not self._packs(dtype):
            return params
        from pagedjax.cpu_native.matmul import pack_params

        return pack_params(params, self.int8_activations)


def cpu_platform(native: bool | None = None) -> CpuPlatform:
    """The CPU platform; `native` None: the C++ kernels if they build here."""
    if native is None:
        native = build.available()
    if native:
        from pagedjax.cpu_native.sampling import CPU_SAMPLING

        return CpuPlatform("cpu", 64, ("cpu_native", "xla"), CPU_SAMPLING, native=True)
    return CpuPlatform("cpu", 64, ("xla",), XLA_SAMPLING, native=False)
