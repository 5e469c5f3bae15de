"""Everything that differs between the CPU and a GPU, decided once per engine.

`current_platform()` looks at JAX's default backend once; the engine hands the `Platform` it
returns to the worker, the model runner and the sampler, and nothing else asks which machine it
runs on. A platform names the default block size, the dtype that "auto" means, the attention
backends that "auto" tries, how weights are prepared (the CPU packs them for its C++ kernels),
the KV budget, the sampler's kernels, and the batch-invariant kernels (the engine's and the
dense training forward's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax

from kernels_pallas.kv_cache import KV_LAYOUT
from models.training import XLA_KERNELS, DenseKernels
from pagedjax.attention import get_backend
from pagedjax.platforms.memory import fraction_to_set

if TYPE_CHECKING:
    from kernels_pallas.backend import AttentionBackend, AttentionSpec
    from models.llama import Params
    from pagedjax.config import EngineConfig
    from pagedjax.sampler import SamplingKernels

logger = logging.getLogger(__name__)

# KV budget where the device reports no memory statistics (the CPU's RAM is shared with
# everything else, so the default stays modest; set kv_cache_memory_bytes for more).
DEFAULT_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class Platform:
    """The defaults and kernels of one kind of device; subclasses fill them in."""

    name: str
    default_block_size: int
    auto_attention: tuple[str, ...]  # backends "auto" tries, in order
    sampling: SamplingKernels
    # Whether the worker runs a first step at start-up to check that the attention backend
    # compiles and runs: a GPU's Pallas kernels can fail to for a device or a JAX version.
    probes_attention: bool = False
    # Rough speeds for the preemption policy's swap-or-recompute choice
    # (`pagedjax/core/swap_policy.py`): device <-> host bytes/s and prefill FLOP/s.
    host_transfer_bytes_per_s: float = 4e9  # the CPU: both tiers are RAM, copied by XLA
    flops_per_s: float = 1e11  # a few CPU cores
    # Whether a step's sampled ids start their device-to-host copy as soon as it is
    # dispatched, so that the host, reading them a step later, does not wait for the copy. On
    # the CPU the array is host memory already, and the request would only add host work.
    prefetches_results: bool = False

    def resolve_dtype(self, requested: str, checkpoint_dtype: str | None) -> str:
        """The weights' and activations' dtype name for `requested` ("auto": float32, which
        the CPU's kernels multiply fastest and the tests compare exactly)."""
        return "float32" if requested == "auto" else requested

    def attention_backend(
        self, requested: str | AttentionBackend, spec: AttentionSpec
    ) -> AttentionBackend:
        """The backend for `requested` ("auto": the first of `auto_attention` that runs
        `spec`); raises ValueError saying why when the requested one cannot."""
        return self.attention_backends(requested, spec)[0]

    def attention_backends(
        self, requested: str | AttentionBackend, spec: AttentionSpec
    ) -> tuple[AttentionBackend, ...]:
        """The backends that can run `spec`, in the order to try them: `requested` alone (a
        name, or a user's backend object), or for "auto" those of `auto_attention` that can;
        raises ValueError saying why if none."""
        if not isinstance(requested, str):
            candidates = [requested]
        elif requested == "auto":
            candidates = [get_backend(name) for name in self.auto_attention]
        else:
            candidates = [get_backend(requested)]
        backends, reasons = [], []
        for backend in candidates:
            name = backend.name
            reason = backend.supports(spec)
            if reason is None and backend.kv_layout != KV_LAYOUT:
                reason = f"it reads a {backend.kv_layout} pool; the engine allocates {KV_LAYOUT}"
            if reason is None:
                backends.append(backend)
            else:
                reasons.append(f"{name}: {reason}")
        if backends:
            return tuple(backends)
        raise ValueError(
            f"attention_backend={requested!r} cannot run this model on {self.name} "
            f"({'; '.join(reasons)}); choose another attention_backend"
        )

    def batch_invariant_backend(
        self, backend: AttentionBackend, dtype: jax.typing.DTypeLike
    ) -> AttentionBackend:
        """The variant of `backend` whose every result is independent of how the step was
        batched (EngineConfig.batch_invariant); ValueError saying why where there is none."""
        raise ValueError(
            f"batch_invariant=True runs on the CPU's C++ kernels only; {self.name} has no "
            "batch-invariant kernels yet: drop batch_invariant"
        )

    def dense_kernels(self, block_size: int) -> DenseKernels:
        """The kernels with which `models.training`'s dense forward reproduces this
        platform's batch-invariant engine of `block_size`-token blocks."""
        return XLA_KERNELS

    def keeps_quantized_weights(self, dtype: jax.typing.DTypeLike) -> bool:
        """Whether a GGUF's block-quantized weights stay quantized (else: widened at load)."""
        return False

    def with_int8_activations(self) -> Platform:
        """This platform with block-quantized weights multiplying int8 activations
        (EngineConfig.int8_activations)."""
        raise ValueError(
            f"int8_activations=True runs on the CPU's C++ kernels, not on {self.name}: drop it"
        )

    def prepare_params(self, params: Params, dtype: jax.typing.DTypeLike) -> Params:
        """The params in the layout this platform's kernels run fastest."""
        return params

    def prepare_split_params(self, params: Params, dtype: jax.typing.DTypeLike) -> Params:
        """Params split over a tensor-parallel group (global arrays) in this platform's
        layout, where that moves no data (the CPU's packing is one device's: none)."""
        return params

    def prepare_lora(self, slots: dict) -> dict:
        """A step's LoRA slots (`models/lora.py`) as this platform's kernels take them: plain
        arrays (each slot's shrink, the others' zeroed) unless a platform has a kernel."""
        return slots

    def kv_budget_bytes(
        self,
        config: EngineConfig,
        activation_peak: Callable[[], int],
        vocab_size: int,
        device: jax.Device | None = None,
    ) -> int:
        """One device's bytes for the KV pool when the config gives neither blocks nor bytes
        (`device`: the engine's first; every device of a tensor-parallel group holds the same)."""
        return DEFAULT_KV_BYTES


def reserve_device_memory(utilization: float) -> None:
    """Lets JAX's GPU allocator take `utilization` of the card (gpu_memory_utilization) by
    setting its fraction before JAX starts its backends, unless the user set one. Once they
    have started the allocator's limit is fixed: it then caps the KV budget, which says so."""
    from jax._src import xla_bridge  # the one way to ask whether the backends have started

    started = getattr(xla_bridge, "backends_are_initialized", lambda: True)
    value = None if started() else fraction_to_set(os.environ, utilization)
    if value is not None:
        os.environ["XLA_CLIENT_MEM_FRACTION"] = value
        logger.info("XLA_CLIENT_MEM_FRACTION=%s (gpu_memory_utilization)", value)


def current_platform() -> Platform:
    """The platform of JAX's default backend."""
    if jax.default_backend() == "gpu":
        from pagedjax.platforms.gpu import GpuPlatform

        return GpuPlatform()
    from pagedjax.platforms.cpu import cpu_platform

    return cpu_platform()
