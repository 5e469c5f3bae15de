"""A single-request greedy loop over the paged model: the CLI's path until the engine lands.

The request owns blocks 1..n of a private pool (block 0 is the null block). The prefill is
padded to a power-of-two token bucket and the block-table width to a power-of-two number of
blocks, so a conversation compiles a handful of shapes, not one per length.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_cache import allocate_kv_cache
from kernels_pallas.metadata import build_metadata, token_positions
from models.config import ModelConfig
from models.llama import Params, forward_logits


@partial(jax.jit, static_argnames=("config",), donate_argnames=("kv_cache",))
def _greedy_step(params, config, token_ids, positions, kv_cache, metadata, logits_indices):
    logits, kv_cache = forward_logits(
        params, config, token_ids, positions, kv_cache, metadata, logits_indices
    )
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv_cache


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


class GreedyLoop:
    def __init__(
        self, config: ModelConfig, params: Params, max_model_len: int = 2048, block_size: int = 16
    ):
        self.config, self.params = config, params
        self.max_model_len, self.block_size = max_model_len, block_size
        self.num_blocks = -(-max_model_len // block_size) + 1
        self.kv_cache = allocate_kv_cache(
            config.num_layers, config.num_kv_heads, self.num_blocks, block_size, config.head_dim
        )
        self.step_times: list[float] = []  # seconds per step, first (compiling) ones included

    def _step(self, token_ids: list[int], seq_len: int) -> int:
        q_len = len(token_ids)
        num_blocks = -(-seq_len // self.block_size)
        table = list(range(1, num_blocks + 1))
        t_pad = _bucket(q_len, 1 if q_len == 1 else 16)
        meta = build_metadata(
            [q_len],
            [seq_len],
            [table],
            self.block_size,
            num_tokens_padded=t_pad,
            max_blocks_per_seq=_bucket(num_blocks, 4),
        )
        tokens = np.zeros(t_pad, np.int32)
        tokens[:q_len] = token_ids
        start = time.perf_counter()
        next_token, self.kv_cache = _greedy_step(
            self.params,
            self.config,
            tokens,
            token_positions([q_len], [seq_len], t_pad),
            self.kv_cache,
            meta,
            np.array([q_len - 1], np.int32),
        )
        token = int(next_token[0])
        self.step_times.append(time.perf_counter() - start)
        return token

    def generate(
        self, prompt_ids: list[int], max_tokens: int, stop_ids: tuple[int, ...] = ()
    ) -> Iterator[int]:
        """Yields greedy tokens one by one; stops after a stop id (yielded) or max_tokens."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}: shorten the prompt or lower max_tokens"
            )
        token = self._step(list(prompt_ids), len(prompt_ids))
        seq_len = len(prompt_ids)
        for generated in range(1, max_tokens + 1):
            yield token
            if token in stop_ids or generated == max_tokens:
                return
            seq_len += 1
            token = self._step([token], seq_len)
