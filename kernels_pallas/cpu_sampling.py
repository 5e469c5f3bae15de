"""Sampling and token logprobs as C++ kernels for XLA:CPU (`cpu/greedy_sample.cc`,
`cpu/random_sample.cc`, `cpu/token_logprobs.cc`), built by `cpu_kernels`.

XLA:CPU runs `argmax` as a variadic (value, index) reduction that it does not vectorize, and
the finite check is a second pass over the [S, V] logits: 10-15 ms for 64 rows of a 49k
vocabulary. The greedy kernel does both in one vectorized pass per row, and applies the sparse
logit bias without writing the row. XLA:CPU's truncation bisects in 32 masked passes per rule,
draws a threefry noise value per token, and runs exp as a scalar loop on one thread (0.4-0.7 s
to sample, 215 ms for log-softmax logprobs, at 256 and 512 rows of a 49k vocabulary); the
other two kernels take 20-70 and 14 ms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_kernels

TARGET = "pagedjax_greedy_sample"
LOGPROBS_TARGET = "pagedjax_token_logprobs"
RANDOM_TARGET = "pagedjax_random_sample"


def supports(logits: jax.Array) -> bool:
    """Float32 logits on the CPU, with the kernel built."""
    return logits.dtype == jnp.float32 and cpu_kernels.usable()


def greedy_sample(
    logits: jax.Array,  # [S, V] float32, raw
    bias_token_ids: jax.Array,  # [S, B] int32, -1 padded; repeated ids add up
    bias_values: jax.Array,  # [S, B] float32
) -> tuple[jax.Array, jax.Array]:  # tokens [S] int32, finite [S] bool
    """argmax(logits + bias) per row (the first index of the largest, as jnp.argmax), and
    whether each raw row is free of NaN and inf; call when `supports`."""
    rows = logits.shape[0]
    call = jax.ffi.ffi_call(
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
    each row: as `pagedjax.sampler.token_logprobs`, ranks counted on the logits; call when
    `supports`."""
    rows = logits.shape[0]
    call = jax.ffi.ffi_call(
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
    the argmax. Also each row's smallest kept scaled logit. Call when `supports`."""
    rows = logits.shape[0]
    call = jax.ffi.ffi_call(
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
