"""The worker: loads the model, sizes the KV pool from the memory left, allocates it.

As vLLM's worker does: load the weights (in the layout the platform's kernels want), profile
what a step needs besides the pool, then give the pool the rest; the model runner it builds
runs the steps.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp

from kernels_pallas.backend import AttentionSpec
from kernels_pallas.kv_cache import KV_CACHE_DTYPES
from models.config import ModelConfig
from models.llama import Params
from models.loader import load_model
from pagedjax.config import EngineConfig
from pagedjax.core.memory import KVCacheSpec
from pagedjax.core.sched_output import SchedulerOutput
from pagedjax.platforms import Platform
from pagedjax.worker.model_runner import ModelRunner, StepHandle, activation_bytes

logger = logging.getLogger(__name__)


class Worker:
    """One device's model, KV pool and step runner. `config.block_size` must be set."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        model_config: ModelConfig | None = None,
        params: Params | None = None,
    ):
        self.config, self.platform = config, platform
        dtype = jnp.dtype(config.dtype)
        if model_config is None or params is None:
            keep_blocks = platform.keeps_quantized_weights(dtype)
            model_config, params = load_model(config.model, dtype, keep_blocks=keep_blocks)
        self.model_config = model_config
        self.params = platform.prepare_params(params, dtype)
        kv_name = config.kv_cache_dtype
        kv_dtype = dtype if kv_name == "auto" else jnp.dtype(KV_CACHE_DTYPES[kv_name])
        self.kv_spec = KVCacheSpec(
            model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, kv_dtype
        )
        self.attention = platform.attention_backend(
            config.attention_backend,
            AttentionSpec(
                model_config.num_heads,
                model_config.num_kv_heads,
                model_config.head_dim,
                kv_dtype.name,
                config.block_size,
            ),
        )
        self.num_blocks = self.determine_num_blocks()
        self.runner = ModelRunner(
            config,
            model_config,
            self.params,
            self.kv_spec,
            self.num_blocks,
            self.attention,
            platform.sampling,
        )

    def determine_num_blocks(self) -> int:
        """`num_kv_blocks`, else the blocks of `kv_cache_memory_bytes`, else of the platform's
        budget; raises ValueError if one request of max_model_len would not fit."""
        config = self.config
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            budget = config.kv_cache_memory_bytes
            if budget is None:
                budget = self.platform.kv_budget_bytes(config, self._activation_peak)
            num_blocks = self.kv_spec.num_blocks_for_budget(budget, config.block_size)
        usable, block_size = num_blocks - 1, config.block_size  # block 0 is the null block
        tokens = usable * block_size
        logger.info(
            "KV cache: %d blocks, %d tokens, max concurrency %.1f at max_model_len %d",
            usable,
            tokens,
            tokens / config.max_model_len,
            config.max_model_len,
        )
        if usable < -(-config.max_model_len // block_size):
            raise ValueError(
                f"the KV pool holds {tokens} tokens ({usable} blocks of {block_size}), "
                f"less than one request of max_model_len {config.max_model_len}: set "
                f"max_model_len <= {tokens} or give more KV memory (num_kv_blocks or "
                "kv_cache_memory_bytes)"
            )
        return num_blocks

    def _activation_peak(self) -> int:
        config = self.config
        return activation_bytes(
            self.model_config,
            self.params,
            config.max_num_batched_tokens,
            -(-config.max_model_len // config.block_size),
            self.attention,
            self.kv_spec,
        )

    def execute_model(self, out: SchedulerOutput, previous: StepHandle | None = None) -> StepHandle:
        """Dispatches the step; the handle's `result()` waits for it. Placeholder tokens are
        `previous`'s samples."""
        return self.runner.dispatch(
            out.seqs, out.rows, out.block_copies, out.num_prompt_logprobs, previous
        )

    def kv_cache_lost(self) -> bool:
        """Whether a failed step consumed the donated pool (every request's KV with it)."""
        return self.runner.kv_cache_lost()

    def reset_kv_cache(self) -> None:
        self.runner.reset_kv_cache()
