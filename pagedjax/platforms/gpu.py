"""A CUDA GPU: the Pallas kernels (XLA's attention as the fallback), XLA's sampler, the
checkpoint's dtype, and a KV budget from the card's memory.

Blocks are 16 tokens, vLLM's default: a decode page of 16 x 128 bf16 is one 4 KiB burst.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax

from kernels_pallas.metadata import next_power_of_2
from pagedjax.config import EngineConfig
from pagedjax.platforms import DEFAULT_KV_BYTES, Platform
from pagedjax.platforms.memory import allocator_fraction, gpu_kv_budget, sampler_reserve_bytes
from pagedjax.sampler import XLA_SAMPLING, SamplingKernels

if TYPE_CHECKING:
    from kernels_pallas.backend import AttentionBackend
    from models.llama import Params

logger = logging.getLogger(__name__)

# The dtypes "auto" keeps when the checkpoint names one; anything else (a GGUF's mixed or
# block-quantized weights, an unknown name) runs in bfloat16, the GPU's fast 16-bit type.
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")
GPU_AUTO_DTYPE = "bfloat16"


def device_memory_stats(device: jax.Device | None = None) -> Mapping[str, int] | None:
    """A device's allocator statistics (None where the allocator keeps none); the first
    device's by default."""
    return (device or jax.devices()[0]).memory_stats()


@dataclass(frozen=True)
class GpuPlatform(Platform):
    name: str = "gpu"
    default_block_size: int = 16
    auto_attention: tuple[str, ...] = ("pallas", "xla")
    sampling: SamplingKernels = XLA_SAMPLING
    probes_attention: bool = True
    prefetches_results: bool = True
    host_transfer_bytes_per_s: float = 2.5e10  # PCIe, as achieved
    flops_per_s: float = 3e14  # 16-bit matmuls, as a prefill achieves on a data-center card
    # Where the allocator's numbers come from (tests inject fakes).
    memory_stats: Callable[[jax.Device | None], Mapping[str, int] | None] = device_memory_stats

    def resolve_dtype(self, requested: str, checkpoint_dtype: str | None) -> str:
        """For "auto" the checkpoint's dtype (bfloat16 for most Hugging Face checkpoints),
        else bfloat16 (a GGUF's weights); an explicit dtype as given."""
        if requested != "auto":
            return requested
        return checkpoint_dtype if checkpoint_dtype in CHECKPOINT_DTYPES else GPU_AUTO_DTYPE

    def batch_invariant_backend(
        self, backend: AttentionBackend, dtype: jax.typing.DTypeLike
    ) -> AttentionBackend:
        raise ValueError(
            "batch_invariant=True is not available on a GPU yet: the Pallas attention has an "
            "invariant mode (paged_attention(invariant=True)), but XLA's GPU matmuls choose "
            "their reduction order by shape; drop batch_invariant, or run on the CPU"
        )

    def prepare_params(self, params: Params, dtype: jax.typing.DTypeLike) -> Params:
        """A mixture's expert weights multiply by the Pallas grouped matmul where their widths
        tile in blocks of 16 (else XLA's gathered tiles, as on the CPU)."""
        from kernels_pallas.grouped_matmul import PallasExperts
        from models.moe import EXPERT_MATMULS

        layers = dict(params["layers"])
        for name in EXPERT_MATMULS:
            weight = layers.get(name)
            if isinstance(weight, jax.Array) and all(d % 16 == 0 for d in weight.shape[2:]):
                layers[name] = PallasExperts(weight)
        return {**params, "layers": layers}

    def prepare_split_params(self, params: Params, dtype: jax.typing.DTypeLike) -> Params:
        # A wrapper only: each shard's view is its own experts, which the kernel runs.
        return self.prepare_params(params, dtype)

    def prepare_lora(self, slots: dict) -> dict:
        """LoRA slots multiply by the Pallas grouped matmul (tokens sorted by slot, the base
        model's skipped) where their widths tile in blocks of 16; a wrapper, each step."""
        from kernels_pallas.grouped_matmul import PallasExperts

        if not all(d % 16 == 0 for f in slots.values() for w in f.values() for d in w.shape[2:]):
            return slots
        return jax.tree.map(PallasExperts, slots)

    def kv_budget_bytes(
        self,
        config: EngineConfig,
        activation_peak: Callable[[], int],
        vocab_size: int,
        device: jax.Device | None = None,
    ) -> int:
        """gpu_memory_utilization of the card's memory (capped by what JAX's allocator may
        hand out), less what is in use (the weights), the forward's activation peak and the
        sampler's working memory."""
        stats = self.memory_stats(device)
        if not stats or "bytes_limit" not in stats:
            return DEFAULT_KV_BYTES
        budget = gpu_kv_budget(
            stats,
            config.gpu_memory_utilization,
            allocator_fraction(os.environ),
            activation_peak(),
            sampler_reserve_bytes(next_power_of_2(config.max_num_seqs), vocab_size),
        )
        logger.info("%s", budget.describe())
        return budget.kv_bytes
