"""The sampler's passes as C++ kernels for XLA:CPU (`csrc/greedy_sample.cc`,
`csrc/random_sample.cc`, `csrc/token_logprobs.cc`): the CPU platform's `SamplingKernels`.

XLA:CPU runs `argmax` as a variadic (value, index) reduction that it does not vectorize, and
the finite check is a second pass over the [S, V] logits; the greedy kernel does both in one
vectorized pass per row, and applies the sparse logit bias without writing the row. XLA:CPU's
truncation bisects in 32 masked passes per rule, draws a threefry noise value per token, and
runs exp as a scalar loop on one thread; the other two kernels run each row once, vectorized,
on XLA's intra-op threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pagedjax.cpu_native import build
from pagedjax.sampler import SamplingMetadata, TokenLogprobs, row_key

TARGET = "pagedjax_greedy_sample"
LOGPROBS_TARGET = "pagedjax_token_logprobs"
RANDOM_TARGET = "pagedjax_random_sample"


def greedy_sample(
    logits: jax.Array,  # [S, V] float32, raw
    bias_token_ids: jax.Array,  # [S, B] int32, -1 padded; repeated ids add up
    bias_values: jax.Array,  # [S, B] float32
) -> tuple[jax.Array, jax.Array]:  # tokens [S] int32, finite [S] bool
    """argmax(logits + bias) per row (the first index of the largest, as jnp.argmax), and
    whether each raw row is free of NaN and inf."""
    rows = logits.shape[0]
    call = build.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.bool_)),
    )
    return call(logits, bias_token_ids.astype(jnp.int32), bias_values.astype(jnp.float32))


def token_logprobs(
    logits: jax.Array,  # [R, V] float32, raw
    tokens: jax.Array,  # [R] int32
    num_logprobs: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(logprobs [R], ranks [R], top ids [R, k], top logprobs [R, k]) of the log-softmax of
    each row, ranks counted on the logits (as `pagedjax.sampler.XlaSampling`)."""
    rows = logits.shape[0]
    call = build.ffi_call(
        LOGPROBS_TARGET,
        (
            jax.ShapeDtypeStruct((rows,), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.int32),
            jax.ShapeDtypeStruct((rows, num_logprobs), jnp.int32),
            jax.ShapeDtypeStruct((rows, num_logprobs), jnp.float32),
        ),
    )
    return call(logits, tokens.astype(jnp.int32))


def random_sample(
    logits: jax.Array,  # [S, V] float32, penalties and bias applied
    temperature: jax.Array,  # [S] float32, 0 for greedy rows
    top_k: jax.Array,  # [S] int32, 0: off
    top_p: jax.Array,  # [S] float32, 1: off
    min_p: jax.Array,  # [S] float32, 0: off
    bits: jax.Array,  # [S, 2] uint32, the row's random bits
) -> tuple[jax.Array, jax.Array]:  # tokens [S] int32, thresholds [S] float32
    """One token per row from the temperature-scaled, truncated distribution (as
    `pagedjax.sampler.truncate`), drawn by inverse CDF from 53 of the bits; greedy rows take
    the argmax. Also each row's smallest kept scaled logit."""
    rows = logits.shape[0]
    call = build.ffi_call(
        RANDOM_TARGET,
        (
            jax.ShapeDtypeStruct((rows,), jnp.int32),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
        ),
    )
    return call(
        logits,
        temperature.astype(jnp.float32),
        top_k.astype(jnp.int32),
        top_p.astype(jnp.float32),
        min_p.astype(jnp.float32),
        bits.astype(jnp.uint32),
    )


@dataclass(frozen=True)
class CpuSampling:
    """SamplingKernels by the C++ passes; rows without truncation carry no-op values (top_k
    0, top_p 1, min_p 0), so one pass serves every batch."""

    def greedy(
        self, logits: jax.Array, bias_token_ids: jax.Array, bias_values: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        return greedy_sample(logits, bias_token_ids, bias_values)

    def draw(
        self, logits: jax.Array, meta: SamplingMetadata, use_truncation: bool, all_greedy: bool
    ) -> jax.Array:
        bits = jax.vmap(lambda seed, step: jax.random.bits(row_key(seed, step), (2,)))(
            meta.seeds, meta.steps
        )
        tokens, _ = random_sample(
            logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p, bits
        )
        return tokens

    def token_logprobs(
        self, logits: jax.Array, tokens: jax.Array, num_logprobs: int
    ) -> TokenLogprobs:
        return TokenLogprobs(*token_logprobs(logits, tokens, num_logprobs))


CPU_SAMPLING = CpuSampling()
