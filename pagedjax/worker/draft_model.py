"""Speculative decoding's draft model: a smaller checkpoint with the target's tokenizer (or
the target's own first layers) that proposes each drafted sequence's next k tokens on the
device, within the step (`speculative_config={"model": ..., "num_speculative_tokens": k}`).

The draft has a KV pool of its own with the target pool's blocks: same block ids, same block
tables, same slots. Every step the draft runs over exactly the tokens the target runs over,
into the same slots, so whatever the block manager does to a block (prefix caching,
copy-on-write, swapping, preemption by recompute) holds for both pools. A step with drafts:

1. the chain: k one-token steps of the draft over the drafted sequences, from each one's
   last token; each step's argmax is the next draft ([R, k] drafts, on the device);
2. the fill: the draft's forward over the step's tokens, drafts in place, writing its KV
   (the chain's writes again, and the last draft's);
3. the target's step, drafts in place, and the sampler verifying them: a greedy draft is a
   draft distribution certain of its token, so rejection sampling keeps the target's.

Only the verdicts come back to the host, as without speculation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.backend import AttentionBackend, AttentionSpec
from kernels_pallas.kv_cache import PAD_SLOT, copy_blocks
from kernels_pallas.metadata import AttentionMetadata
from models.config import ModelConfig
from models.errors import ModelLoadError
from models.llama import Params, forward_logits
from models.loader import load_model, resolve_model_path
from pagedjax.core.memory import KVCacheSpec
from pagedjax.core.sched_output import ScheduledSequence
from pagedjax.core.spec_decode import SpeculativeConfig
from pagedjax.platforms import Platform

logger = logging.getLogger(__name__)


@dataclass
class DraftModel:
    """The draft's weights (the worker places them), attention and KV pool shape."""

    config: ModelConfig
    params: Params
    attention: AttentionBackend
    kv_spec: KVCacheSpec
    num_speculative_tokens: int
    vocab_size: int  # the target's: drafts are tokens the target can sample
    # The draft is the target's checkpoint (its first layers): new target weights are its too.
    follows_target: bool = False

    def weights_from_target(self, params: Params) -> Params:
        """The draft's weights out of the target's (pagedjax layout)."""
        return first_layers(params, self.config.num_layers)


def first_layers(params: Params, num_layers: int) -> Params:
    """A model's params with only its first `num_layers` layers (stacked on axis 0)."""
    return {**params, "layers": jax.tree.map(lambda a: a[:num_layers], params["layers"])}


def load_draft_model(
    spec: SpeculativeConfig,
    target: ModelConfig,
    target_path: str | None,
    platform: Platform,
    dtype: jnp.dtype,
    kv_dtype: jnp.dtype,
    block_size: int,
    attention_backend: str,
    batch_invariant: bool = False,
) -> DraftModel:
    """Loads `spec.model` (its first `spec.num_hidden_layers` layers, if given) for drafting
    beside `target`; ValueError if it cannot be a draft (longer context needed, too few
    layers)."""
    keep_blocks = platform.keeps_quantized_weights(dtype)
    try:
        config, params = load_model(spec.model, dtype, keep_blocks=keep_blocks)
    except ModelLoadError as error:
        raise ValueError(f"speculative_config: the draft model: {error}") from error
    layers = spec.num_hidden_layers
    if layers is not None:
        if layers > config.num_layers:
            raise ValueError(
                f"speculative_config: num_hidden_layers={layers} but the draft model has "
                f"{config.num_layers} layers"
            )
        windows = config.sliding_windows[:layers] if config.sliding_windows else ()
        config = replace(config, num_layers=layers, sliding_windows=windows)
        params = first_layers(params, layers)
    if config.vocab_size < target.vocab_size:
        logger.warning(
            "the draft model's vocabulary (%d) is smaller than the target's (%d): check that "
            "they share a tokenizer",
            config.vocab_size,
            target.vocab_size,
        )
    attention_spec = AttentionSpec(
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        kv_dtype.name,
        block_size,
        sinks=config.attention_sinks,
    )
    attention = platform.attention_backend(attention_backend, attention_spec)
    if batch_invariant:
        attention = platform.batch_invariant_backend(attention, dtype)
    kv_spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype)
    logger.info(
        "draft model %s: %d layers, %.1fM parameters in its layers, %d KV bytes per token",
        spec.model,
        config.num_layers,
        config.num_layer_params() / 1e6,
        kv_spec.bytes_per_token,
    )
    return DraftModel(
        config,
        params,
        attention,
        kv_spec,
        spec.num_speculative_tokens,
        target.vocab_size,
        _same_files(spec.model, target_path),
    )


def _same_files(a: str | None, b: str | None) -> bool:
    """Whether two model paths (None: the default model) name the same checkpoint."""
    try:
        return resolve_model_path(a).path.resolve() == resolve_model_path(b).path.resolve()
    except ModelLoadError:
        return False


def mark_model_drafts(
    seqs: Sequence[ScheduledSequence], tokens: np.ndarray, first: int, k: int
) -> list[tuple[int, int, int, int]]:
    """Turns the stand-ins of the step's model drafts in `tokens` (the step's flat token ids)
    into placeholders naming the drafts (sequence d's draft j is entry first + d * k + j of
    what placeholders name); returns (sequence index, its last token's index in the step,
    that token's position, its number of drafts m) per drafted sequence."""
    drafted, start = [], 0
    for i, seq in enumerate(seqs):
        m = seq.num_model_drafts
        if m:
            last = start + len(seq.token_ids) - 1 - m
            base = first + len(drafted) * k
            tokens[last + 1 : last + 1 + m] = -1 - np.arange(base, base + m)
            drafted.append((i, last, seq.num_computed_tokens + last - start, m))
        start += len(seq.token_ids)
    return drafted


def verify_index(
    drafted: list[tuple[int, int, int, int]], rows: list[tuple[int, int]], k: int, size: int
) -> np.ndarray:
    """[size] the flattened [R, k] draft each sample row verifies, -1 for none. rows: (its
    sequence index, its offset) each; row j of a drafted sequence (offset m - j) verifies
    that sequence's draft j < m."""
    ordinal = {seq: (d, m) for d, (seq, *_, m) in enumerate(drafted)}
    index = np.full(size, -1, np.int32)
    for r, (seq, offset) in enumerate(rows):
        if seq in ordinal and offset >= 1:
            d, m = ordinal[seq]
            index[r] = d * k + m - offset
    return index


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ChainInputs:
    """Host arrays of the chain for R (padded) drafted sequences and k steps: step j runs
    each sequence's token at position `positions[j]` (its last token at j = 0, draft j
    after), writing `slots[j]` (PAD_SLOT past the sequence's drafts) with context
    `seq_lens[j]`."""

    tokens: np.ndarray  # [R] i32: each sequence's last token (0 where `sources` names it)
    sources: np.ndarray  # [R] i32: -1, or the previous step's sample row that token is
    positions: np.ndarray  # [k, R] i32
    slots: np.ndarray  # [k, R] i32
    seq_lens: np.ndarray  # [k, R] i32
    block_tables: np.ndarray  # [R, W] i32
    num_seqs: np.int32  # real sequences (the rest is padding)


def chain_inputs(
    drafted: list[tuple[int, int, int, int]],
    tokens: np.ndarray,
    sources: np.ndarray,
    slots: np.ndarray,
    tables: np.ndarray,
    num_steps: int,
    num_rows: int,
) -> ChainInputs:
    """The chain's inputs from a prepared step's host arrays (`tokens`, `sources`, `slots`
    per token, block `tables` per sequence). `drafted`: (sequence index, its last token's
    index in the step, that token's position, its number of drafts m) per drafted sequence,
    as `ModelRunner.prepare` lists them; the drafts follow the last token. Steps j >= m of a
    sequence write nothing and read only its own pages (their drafts are never used)."""
    k, r = num_steps, num_rows
    out_tokens, out_sources = np.zeros(r, np.int32), np.full(r, -1, np.int32)
    positions, seq_lens = np.zeros((k, r), np.int32), np.zeros((k, r), np.int32)
    out_slots = np.full((k, r), PAD_SLOT, np.int32)
    out_tables = np.zeros((r, tables.shape[1]), np.int32)
    steps = np.arange(k)
    for d, (seq, first, position, m) in enumerate(drafted):
        out_tokens[d], out_sources[d] = tokens[first], sources[first]
        lens = position + 1 + np.minimum(steps, m)  # the step's context, its token included
        positions[:, d], seq_lens[:, d] = lens - 1, lens
        out_slots[:m, d] = slots[first : first + m]
        out_tables[d] = tables[seq]
    return ChainInputs(
        out_tokens,
        out_sources,
        positions,
        out_slots,
        seq_lens,
        out_tables,
        np.int32(len(drafted)),
    )


@partial(
    jax.jit,
    static_argnames=("config", "attention_fn", "decode_only", "vocab_size"),
    donate_argnames=("kv_cache",),
)
def draft_chain(
    params: Params,
    kv_cache,
    inputs: ChainInputs,
    previous: jax.Array,  # [P] i32: the previous step's sampled tokens (async scheduling)
    copies: jax.Array,  # [C, 2] i32: the step's copy-on-write copies (src, dst), first
    config: ModelConfig,
    attention_fn: AttentionBackend,
    decode_only: bool | None,
    vocab_size: int,
) -> tuple[jax.Array, object]:
    """The step's copy-on-write copies, then k greedy one-token steps of the draft: ([R, k]
    drafts, the draft's pool)."""
    if copies.shape[0]:  # a sequence's drafts may read a block copied for it this step
        kv_cache = copy_blocks(kv_cache, copies)
    if decode_only is not None:
        attention_fn = partial(attention_fn, decode_only=decode_only)
    sources = inputs.sources
    tokens = jnp.where(sources >= 0, previous[jnp.maximum(sources, 0)], inputs.tokens)
    num_rows = tokens.shape[0]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    n = inputs.num_seqs
    query_start = jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), n)

    def step(carry, per_step):
        cache, tokens = carry
        positions, slots, seq_lens = per_step
        metadata = AttentionMetadata(
            slot_mapping=slots,
            block_tables=inputs.block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start,
            num_seqs=n,
            num_tokens=n,
        )
        logits, cache = forward_logits(
            params, config, tokens, positions, cache, metadata, rows, attention_fn
        )
        drafts = jnp.argmax(logits[:, :vocab_size], axis=-1).astype(jnp.int32)
        return (cache, drafts), drafts

    (kv_cache, _), drafts = jax.lax.scan(
        step, (kv_cache, tokens), (inputs.positions, inputs.slots, inputs.seq_lens)
    )
    return drafts.T, kv_cache


@partial(jax.jit, static_argnames=("size",))
def join_drafts(sampled: jax.Array, drafts: jax.Array | None, size: int) -> jax.Array:
    """The tokens a step's placeholders name: the previous step's samples [P], then the
    drafts [R, k] flattened and padded to `size` entries."""
    flat = jnp.zeros(size, jnp.int32)
    if drafts is not None:
        flat = flat.at[: drafts.size].set(drafts.reshape(-1)[:size])
    return jnp.concatenate([sampled, flat])


@jax.jit
def verified_drafts(drafts: jax.Array, index: jax.Array) -> jax.Array:
    """[S] the draft each sample row verifies (index[i] into the flattened [R, k] drafts),
    -1 where index is -1."""
    return jnp.where(index >= 0, drafts.reshape(-1)[jnp.maximum(index, 0)], -1)
