"""The engine's jitted device functions: one step's forward, and several decode steps in one
compiled loop (`decode_steps`, vLLM V0's multi-step scheduling, tpu-inference's
continue_decode).

Module-level, so engines over the same model and shapes share their compilations. The KV pool
is donated: each call updates it in place.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from kernels_pallas.kv_cache import PAD_SLOT, copy_blocks
from models.llama import forward_logits
from models.tensor_parallel import TensorParallel
from pagedjax.sampler import (
    SamplerOutput,
    SamplingKernels,
    TokenLogprobs,
    sample,
)
from pagedjax.worker.step_inputs import PackedSampling, StepLayout, unpack


def model_step(
    params,
    kv_cache,
    token_ids,
    positions,
    metadata,
    rows,
    copies,
    *,
    config,
    axis_name,
    attention_fn,
):
    """Copy-on-write copies, then the forward: per shard under tensor parallelism. With LoRA,
    params["lora"] holds the adapters' slots and each token's slot (`ModelRunner`)."""
    if copies.shape[0]:
        kv_cache = copy_blocks(kv_cache, copies)
    lora_slots = None
    if "lora" in params:
        lora_slots = params["lora"]["slots"]
        params = {**params, "lora": params["lora"]["weights"]}
    return forward_logits(
        params,
        config,
        token_ids,
        positions,
        kv_cache,
        metadata,
        rows,
        attention_fn,
        axis_name,
        lora_slots,
    )


def _run_model(params, kv_cache, inputs, config, attention_fn, decode_only, tp):
    """(logits [R, V], kv_cache) of `model_step` on one device or over the tp group."""
    if decode_only is not None:
        attention_fn = partial(attention_fn, decode_only=decode_only)
    step = partial(model_step, attention_fn=attention_fn)
    if tp is None:
        return step(params, kv_cache, *inputs, config=config, axis_name=None)
    return tp.run(step, params, kv_cache, *inputs)


def _with_previous(token_ids: jax.Array, sources: jax.Array, previous: jax.Array) -> jax.Array:
    """The step's tokens, placeholders replaced by the previous step's samples they name."""
    return jnp.where(sources >= 0, previous[jnp.maximum(sources, 0)], token_ids)


@partial(
    jax.jit,
    static_argnames=("layout", "config", "attention_fn", "decode_only", "tp"),
    donate_argnames=("kv_cache",),
)
def forward_step(
    params,
    # int32, the step's one host-to-device copy: step_inputs.pack of (token_ids [T], sources
    # [T] (-1, or the index in `previous` of the sample a token is), positions [T], metadata
    # (AttentionMetadata), logits rows [R], copy-on-write pairs [C, 2], the sample rows' draw
    # counters [R] (SamplingMetadata.steps, handed back for the sampler))
    packed,
    previous,  # [P] int32: the previous step's sampled tokens (async scheduling)
    kv_cache,
    layout: StepLayout,
    config,
    attention_fn,
    decode_only=None,  # None: not passed (a backend without a decode kernel); else its flag
    tp: TensorParallel | None = None,  # the tensor-parallel group, None for one device
):
    """(logits [R, V], kv_cache, the draw counters [R] on the device)."""
    token_ids, sources, positions, metadata, rows, copies, steps = unpack(packed, layout)
    token_ids = _with_previous(token_ids, sources, previous)
    inputs = (token_ids, positions, metadata, rows, copies)
    logits, kv_cache = _run_model(params, kv_cache, inputs, config, attention_fn, decode_only, tp)
    return logits, kv_cache, steps


@partial(
    jax.jit,
    static_argnames=(
        "layout",
        "config",
        "attention_fn",
        "decode_only",
        "tp",
        "num_steps",
        "block_size",
        "kernels",
        "use_truncation",
        "all_greedy",
        "num_logprobs",
        "use_penalties",
        "stride",
        "size",
    ),
    donate_argnames=("kv_cache",),
)
def decode_steps(
    params,
    # int32, one host-to-device copy: step_inputs.pack of (token_ids [T] (sequence t's last
    # token), sources [T] (as forward_step's), positions [T] (the last tokens'), metadata (the
    # first step's), rows [R] (row r is sequence r), copies [C, 2], limits [T] (the steps each
    # sequence takes; 0 for padding), draw counters [R] (SamplingMetadata.steps, first step's))
    packed,
    previous,  # [P] int32
    kv_cache,
    meta: PackedSampling,  # [R] rows; its steps are not read (None): packed has them
    *,
    layout: StepLayout,
    config,
    attention_fn,
    decode_only,
    tp: TensorParallel | None,
    num_steps: int,
    block_size: int,
    kernels: SamplingKernels,
    use_truncation: bool,
    all_greedy: bool,
    num_logprobs: int | None = None,
    use_penalties: bool = False,
    stride: int,
    size: int,
):
    """num_steps decode steps: each runs the forward on every sequence's newest token, writes
    its KV into the sequence's reserved slots and samples the next token on the device.
    Returns (tokens [num_steps, R], finite [num_steps, R], TokenLogprobs of [num_steps, R]
    (None unless num_logprobs is given, as `sample`'s), kv_cache, the tokens as the next
    step's placeholders read them: `fixed_rows(tokens, stride, size)`).

    A sequence past its limit repeats its last step (reading only its own context) and
    writes nothing: its tokens there are junk the host drops, as it drops those after a stop.
    Every draw is the one a single step would make (its key counts the row's tokens); with
    penalties, each step's token joins the row's output history on the device."""
    token_ids, sources, positions, metadata, rows, copies, limits, steps = unpack(packed, layout)
    meta = dataclasses.replace(meta.unpacked(), steps=steps)
    token_ids = _with_previous(token_ids, sources, previous)
    if copies.shape[0]:
        kv_cache = copy_blocks(kv_cache, copies)
    num_tokens, num_rows = token_ids.shape[0], rows.shape[0]
    num_seqs = metadata.seq_lens.shape[0]
    seq = jnp.minimum(jnp.arange(num_tokens), num_seqs - 1)
    tables = metadata.block_tables[..., seq, :]  # [(G,) T, W]: each token's sequence's
    seq_limits = jnp.zeros(num_seqs, jnp.int32).at[seq].max(limits)
    no_copies = jnp.zeros((0, 2), jnp.int32)

    def step(i, carry):
        token_ids, kv_cache, out_tokens, out_finite, out_logprobs, history = carry
        offset = jnp.minimum(i, jnp.maximum(limits - 1, 0))  # [T]: stays at the last step
        pos = positions + offset
        slots = _token_slots(tables, pos, block_size)
        slots = jnp.where(i < limits, slots, PAD_SLOT)
        seq_offset = jnp.minimum(i, jnp.maximum(seq_limits - 1, 0))
        seq_lens = jnp.where(metadata.seq_lens > 0, metadata.seq_lens + seq_offset, 0)
        step_metadata = dataclasses.replace(metadata, slot_mapping=slots, seq_lens=seq_lens)
        inputs = (token_ids, pos, step_metadata, rows, no_copies)
        run = (config, attention_fn, decode_only, tp)
        logits, kv_cache = _run_model(params, kv_cache, inputs, *run)
        step_meta = dataclasses.replace(meta, steps=meta.steps + i, output_token_ids=history)
        out = sample(
            logits,
            step_meta,
            kernels,
            use_penalties=use_penalties,
            use_truncation=use_truncation,
            all_greedy=all_greedy,
            num_logprobs=num_logprobs,
        )
        count = min(num_tokens, num_rows)
        next_tokens = jnp.zeros(num_tokens, jnp.int32).at[:count].set(out.token_ids[:count])
        out_tokens = out_tokens.at[i].set(out.token_ids)
        out_finite = out_finite.at[i].set(out.finite)
        if num_logprobs is not None:
            out_logprobs = jax.tree.map(lambda a, x: a.at[i].set(x), out_logprobs, out.logprobs)
        if use_penalties:  # the token is the row's output number steps + i
            where = (jnp.arange(num_rows), step_meta.steps)
            history = history.at[where].set(out.token_ids, mode="drop")
        return next_tokens, kv_cache, out_tokens, out_finite, out_logprobs, history

    logprobs = None
    if num_logprobs is not None:
        each, top = (num_steps, num_rows), (num_steps, num_rows, num_logprobs)
        logprobs = TokenLogprobs(
            jnp.zeros(each, jnp.float32),
            jnp.zeros(each, jnp.int32),
            jnp.zeros(top, jnp.int32),
            jnp.zeros(top, jnp.float32),
        )
    init = (
        token_ids,
        kv_cache,
        jnp.zeros((num_steps, num_rows), jnp.int32),
        jnp.zeros((num_steps, num_rows), bool),
        logprobs,
        meta.output_token_ids,
    )
    _, kv_cache, tokens, finite, logprobs, _ = jax.lax.fori_loop(0, num_steps, step, init)
    return tokens, finite, logprobs, kv_cache, fixed_rows(tokens, stride, size)


def _token_slots(
    tables: jax.Array,  # [T, W] each token's sequence's table, or [G, T, W] with groups
    pos: jax.Array,  # [T] each token's position
    block_size: int,
) -> jax.Array:
    """[T] (or [G, T]) each token's pool slot, from its sequence's table (each group's)."""
    index = jnp.minimum(pos // block_size, tables.shape[-1] - 1)
    block = jnp.take_along_axis(
        tables, jnp.broadcast_to(index[:, None], (*tables.shape[:-1], 1)), -1
    )
    return block[..., 0] * block_size + pos % block_size


@partial(
    jax.jit,
    static_argnames=(
        "kernels",
        "num_logprobs",
        "use_penalties",
        "use_truncation",
        "all_greedy",
        "stride",
        "size",
    ),
)
def sample_step(
    logits: jax.Array,  # [R, V] f32
    meta: PackedSampling,  # [R] rows
    kernels: SamplingKernels,
    *,
    num_logprobs: int | None,
    use_penalties: bool,
    use_truncation: bool,
    all_greedy: bool,
    stride: int,
    size: int,
) -> tuple[SamplerOutput, jax.Array]:
    """`sample`, and its tokens as the next step's placeholders read them (`fixed_rows`): one
    dispatch for both."""
    out = sample(
        logits,
        meta.unpacked(),
        kernels,
        num_logprobs=num_logprobs,
        use_penalties=use_penalties,
        use_truncation=use_truncation,
        all_greedy=all_greedy,
    )
    return out, fixed_rows(out.token_ids, stride, size)


@partial(jax.jit, static_argnames=("stride", "size"))
def fixed_rows(token_ids: jax.Array, stride: int, size: int) -> jax.Array:
    """A step's sampled tokens ([rows], or [steps, rows] from `decode_steps`; rows padded per
    step) at a fixed length [size]: iteration i's row r at i * stride + r, where the next
    step's placeholders name it. The next forward's shape then does not depend on the
    previous step's row bucket or step count."""
    tokens = token_ids.reshape(-1, token_ids.shape[-1])
    rows = min(stride, tokens.shape[1])
    out = jnp.zeros((size // stride, stride), jnp.int32)
    return out.at[: tokens.shape[0], :rows].set(tokens[:, :rows]).reshape(-1)


@partial(jax.jit, static_argnames=("count",))
def set_rows(logits: jax.Array, index: jax.Array, values: jax.Array, count: int) -> jax.Array:
    """logits with rows index[:count] replaced by values[:count] (the rest is padding)."""
    return logits.at[index[:count]].set(values[:count])
