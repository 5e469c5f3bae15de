"""A CUDA GPU: the Pallas kernels, XLA's sampler, and a KV budget from the device's memory.

Blocks are 16 tokens, vLLM's default: a decode page of 16 x 128 bf16 is one 4 KiB burst.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax

from pagedjax.config import EngineConfig
from pagedjax.platforms import DEFAULT_KV_BYTES, Platform
from pagedjax.sampler import XLA_SAMPLING, SamplingKernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuPlatform(Platform):
    name: str = "gpu"
    default_block_size: int = 16
    auto_attention: tuple[str, ...] = ("pallas", "xla")
    sampling: SamplingKernels = XLA_SAMPLING

    def kv_budget_bytes(self, config: EngineConfig, activation_peak: Callable[[], int]) -> int:
        """gpu_memory_utilization of the device's memory, less what is in use (the weights)
        and the forward's activation peak."""
        stats = jax.devices()[0].memory_stats()
        if not stats:
            return DEFAULT_KV_BYTES
        peak = activation_peak()
        usable = config.gpu_memory_utilization * stats["bytes_limit"]
        budget = int(usable - stats["bytes_in_use"] - peak)
        logger.info(
            "KV budget %.2f GiB = %.0f%% of %.2f GiB - %.2f GiB in use - %.2f GiB activations",
            budget / 2**30,
            100 * config.gpu_memory_utilization,
            stats["bytes_limit"] / 2**30,
            stats["bytes_in_use"] / 2**30,
            peak / 2**30,
        )
        return max(budget, 0)
