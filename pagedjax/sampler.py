"""The sampler: one jitted, batched function with per-request parameters as arrays.

Order, as in vLLM: penalties and logit bias on the raw logits, then greedy argmax, or
temperature -> top-k -> top-p -> min-p -> a draw. Logprobs are those of the raw model
distribution. Each row draws from its own key (request seed folded with the number of tokens
it has generated), so a seeded request samples the same tokens whatever else is in the batch.
A draw is argmax(probs / Exp(1) noise) in XLA; on the CPU, C++ passes (`cpu_sampling.py`) do
the truncation and one inverse-CDF draw from 53 bits of the key (the same distribution, other
tokens for a seed than a GPU's), the greedy argmax with bias and finite check, and logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_sampling
from pagedjax.sampling_params import SamplingParams

_NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [S] f32, 0 for greedy rows
    top_k: jax.Array  # [S] i32, 0 for no top-k
    top_p: jax.Array  # [S] f32, 1 for no top-p
    min_p: jax.Array  # [S] f32, 0 for no min-p
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    repetition_penalty: jax.Array  # [S] f32
    seeds: jax.Array  # [S] u32
    steps: jax.Array  # [S] i32, tokens generated so far (the draw's counter)
    prompt_token_ids: jax.Array  # [S, P] i32, -1 padded (repetition penalty)
    output_token_ids: jax.Array  # [S, O] i32, -1 padded (all three penalties)
    bias_token_ids: jax.Array  # [S, K] i32, -1 padded (logit_bias, min_tokens stop masking)
    bias_values: jax.Array  # [S, K] f32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenLogprobs:
    """Given tokens' logprobs under the raw model distribution, and the most likely tokens."""

    logprobs: jax.Array  # [R] f32
    ranks: jax.Array  # [R] i32, 1 for the most likely token
    top_token_ids: jax.Array  # [R, num_logprobs] i32
    top_logprobs: jax.Array  # [R, num_logprobs] f32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # [S] i32
    finite: jax.Array  # [S] bool: False when a row's logits hold NaN or inf (its token is junk)
    # The rest only when logprobs are asked for (num_logprobs is not None):
    logprobs: TokenLogprobs | None = None


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_logprobs: int) -> TokenLogprobs:
    """logits [R, V] f32, tokens [R] i32 -> their logprobs and ranks, and the top
    `num_logprobs` of each row (vLLM's ranks: 1 + the number of strictly likelier tokens)."""
    if cpu_sampling.supports(logits):
        return TokenLogprobs(*cpu_sampling.token_logprobs(logits, tokens, num_logprobs))
    return _token_logprobs_xla(logits, tokens, num_logprobs)


def _token_logprobs_xla(logits: jax.Array, tokens: jax.Array, num_logprobs: int) -> TokenLogprobs:
    raw = jax.nn.log_softmax(logits, axis=-1)
    logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)
    # Counted on the logits: the log-softmax is a shift of the row, whose rounding makes ties.
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)
    ranks = 1 + jnp.sum(logits > chosen, axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(raw, num_logprobs)
    return TokenLogprobs(logprobs[:, 0], ranks, top_ids.astype(jnp.int32), top_logprobs)


@partial(jax.jit, static_argnames=("num_logprobs",))
def prompt_logprobs(
    logits: jax.Array,  # [S, V] f32: the step's logits rows
    rows: jax.Array,  # [P] i32: which of them predict a prompt token
    targets: jax.Array,  # [P] i32: that prompt token
    num_logprobs: int,
) -> TokenLogprobs:
    """Logprobs of prompt tokens given the tokens before them (SamplingParams.prompt_logprobs)."""
    return token_logprobs(logits[rows], targets, num_logprobs)


def _token_counts(token_ids: jax.Array, vocab_size: int) -> jax.Array:
    """[S, L] -1-padded ids -> [S, V] counts."""
    rows = jnp.arange(token_ids.shape[0])[:, None]
    ids = jnp.where(token_ids < 0, vocab_size, token_ids)  # padding goes out of range: dropped
    counts = jnp.zeros((token_ids.shape[0], vocab_size), jnp.int32)
    return counts.at[rows, ids].add(1, mode="drop")


def apply_penalties(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    vocab_size = logits.shape[-1]
    output_counts = _token_counts(meta.output_token_ids, vocab_size)
    seen = (output_counts + _token_counts(meta.prompt_token_ids, vocab_size)) > 0
    rep = meta.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits -= meta.frequency_penalty[:, None] * output_counts
    logits -= meta.presence_penalty[:, None] * (output_counts > 0)
    return logits


def apply_logit_bias(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(meta.bias_token_ids < 0, logits.shape[-1], meta.bias_token_ids)
    return logits.at[rows, ids].add(meta.bias_values, mode="drop")


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys with the order of the float32 values x (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = bits >> 31 == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key_where(keys: jax.Array, enough) -> jax.Array:
    """[S, 1] the largest key t of each row with enough(keys >= t) true, by bisection over the
    32-bit key space (32 masked passes over [S, V] instead of a sort, which on the CPU took
    1.3 s for 64 rows of a 49k vocabulary). enough must be monotone: true for small t."""
    rows = keys.shape[0]

    def step(_, bounds):
        lo, hi = bounds  # enough(lo) holds; every key above hi fails
        mid = hi - (hi - lo) // 2  # the upper midpoint, without overflowing uint32
        ok = enough(keys >= mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jnp.zeros((rows, 1), jnp.uint32)
    hi = jnp.full((rows, 1), 0xFFFFFFFF, jnp.uint32)
    return jax.lax.fori_loop(0, 32, step, (lo, hi))[0]


def truncate(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Top-k, then top-p, then min-p, on temperature-scaled logits; masked entries get -inf.

    Each rule keeps the tokens at or above a threshold logit (ties at the threshold are kept):
    top-k the k-th largest logit; top-p, over the top-k distribution, the smallest logit whose
    tokens and all larger ones reach mass p; min-p probabilities of at least min_p x the top.
    """
    keys = _order_keys(logits)
    no_threshold = jnp.zeros((logits.shape[0], 1), jnp.uint32)  # below every key
    k = jnp.where(meta.top_k > 0, meta.top_k, logits.shape[-1])[:, None]
    top_k_key = jax.lax.cond(
        jnp.any(meta.top_k > 0),
        lambda: _largest_key_where(keys, lambda kept: jnp.sum(kept, -1, keepdims=True) >= k),
        lambda: no_threshold,
    )
    in_top_k = keys >= top_k_key
    probs = jax.nn.softmax(jnp.where(in_top_k, logits, _NEG_INF), axis=-1)
    top_p = meta.top_p[:, None]
    uses_top_p = top_p < 1.0  # 1 keeps everything (a float sum of all probs may fall short of 1)
    top_p_key = jax.lax.cond(
        jnp.any(uses_top_p),
        lambda: _largest_key_where(
            keys, lambda kept: jnp.sum(jnp.where(kept, probs, 0.0), -1, keepdims=True) >= top_p
        ),
        lambda: no_threshold,
    )
    top_p_key = jnp.where(uses_top_p, top_p_key, no_threshold)
    keep = in_top_k & (keys >= top_p_key)
    keep &= probs >= meta.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    # The smallest kept logit is each row's threshold (ties at the threshold are kept).
    threshold = jnp.min(jnp.where(keep, logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, _NEG_INF)


def _row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    """A row's draw key: its request's seed folded with the tokens it has generated."""
    return jax.random.fold_in(jax.random.key(seed), step)


def _draw(probs: jax.Array, seed: jax.Array, step: jax.Array) -> jax.Array:
    key = _row_key(seed, step)
    noise = jax.random.exponential(key, probs.shape, jnp.float32)
    return jnp.argmax(probs / noise).astype(jnp.int32)


@partial(jax.jit, static_argnames=("num_logprobs", "use_penalties", "use_truncation", "all_greedy"))
def sample(
    logits: jax.Array,  # [S, V] f32
    meta: SamplingMetadata,
    num_logprobs: int | None = None,
    use_penalties: bool = True,
    use_truncation: bool = True,
    all_greedy: bool = False,
) -> SamplerOutput:
    """Samples one token per row. The static flags let an all-greedy, penalty-free batch skip
    the [S, V] sort, scatters and noise, and a batch that asks for no logprobs (None, as
    SamplingParams.logprobs) skip the log-softmax, the costliest [S, V] pass left on the CPU.
    num_logprobs 0 returns the sampled tokens' logprobs only."""
    if cpu_sampling.supports(logits):
        tokens, finite = _sample_cpu(logits, meta, use_penalties, all_greedy)
    else:
        tokens, finite = _sample_xla(logits, meta, use_penalties, use_truncation, all_greedy)
    if num_logprobs is None:
        return SamplerOutput(tokens, finite)
    return SamplerOutput(tokens, finite, token_logprobs(logits, tokens, num_logprobs))


def _adjusted(
    logits: jax.Array, meta: SamplingMetadata, use_penalties: bool
) -> tuple[jax.Array, jax.Array]:
    """(the logits after penalties and logit bias, whether each raw row is finite)."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    if use_penalties:
        logits = apply_penalties(logits, meta)
    return apply_logit_bias(logits, meta), finite


def _sample_cpu(
    logits: jax.Array, meta: SamplingMetadata, use_penalties: bool, all_greedy: bool
) -> tuple[jax.Array, jax.Array]:
    """The C++ passes: greedy (bias, argmax and finite check in one), or temperature,
    truncation and one inverse-CDF draw from 53 random bits per row (the same distribution as
    XLA's noise argmax; XLA:CPU took 0.4-0.7 s for 256 rows of a 49k vocabulary). Rows
    without truncation carry no-op values (top_k 0, top_p 1, min_p 0)."""
    if all_greedy and not use_penalties:
        return cpu_sampling.greedy_sample(logits, meta.bias_token_ids, meta.bias_values)
    logits, finite = _adjusted(logits, meta, use_penalties)
    bits = jax.vmap(lambda seed, step: jax.random.bits(_row_key(seed, step), (2,)))(
        meta.seeds, meta.steps
    )
    tokens, _ = cpu_sampling.random_sample(
        logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p, bits
    )
    return tokens, finite


def _sample_xla(
    logits: jax.Array,
    meta: SamplingMetadata,
    use_penalties: bool,
    use_truncation: bool,
    all_greedy: bool,
) -> tuple[jax.Array, jax.Array]:
    logits, finite = _adjusted(logits, meta, use_penalties)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    if all_greedy:
        return greedy_tokens, finite
    return _draw_rows(logits, greedy_tokens, meta, use_truncation), finite


def _draw_rows(
    logits: jax.Array, greedy_tokens: jax.Array, meta: SamplingMetadata, use_truncation: bool
) -> jax.Array:
    greedy = meta.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, meta.temperature)[:, None]
    if use_truncation:
        scaled = truncate(scaled, meta)
    probs = jax.nn.softmax(scaled, axis=-1)
    drawn = jax.vmap(_draw)(probs, meta.seeds, meta.steps)
    return jnp.where(greedy, greedy_tokens, drawn)


def build_sampling_metadata(
    params: list[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
    seeds: list[int],
    *,
    num_rows: int | None = None,
    extra_bias: list[dict[int, float]] | None = None,
    history_width: int = 1,
) -> SamplingMetadata:
    """Host-side arrays for a batch of rows; rows past len(params) (padding) are greedy.

    `token_ids[i]` is row i's prompt followed by its output so far (an engine passes its
    sequences' own lists: they are sliced only for rows with penalties, never copied per step).
    Token-list widths are rounded up to powers of two, and the prompt and output histories
    (sent only when some row has a penalty) to at least `history_width`: an engine passes its
    max_model_len, so a growing output never changes a shape (no recompile mid-generation).
    `extra_bias` adds per-row biases (the engine masks stop tokens below min_tokens with -inf
    this way).
    """
    num_rows = num_rows or len(params)
    real = len(params)

    def column(values: list, dtype, fill) -> np.ndarray:
        out = np.full(num_rows, fill, dtype)
        out[:real] = values
        return out

    def padded(lists: list[list[int]], dtype=np.int32, fill=-1, min_width: int = 1) -> np.ndarray:
        width = max(_bucket(max((len(x) for x in lists), default=0)), _bucket(min_width))
        out = np.full((num_rows, width), fill, dtype)
        for i, x in enumerate(lists):
            if len(x):  # most rows have no history or bias to send: skip numpy's per-call cost
                out[i, : len(x)] = x
        return out

    uses_repetition = [p.repetition_penalty != 1.0 for p in params]
    uses_output = [
        r or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        for p, r in zip(params, uses_repetition, strict=True)
    ]
    histories = list(zip(token_ids, num_prompt_tokens, strict=True))
    extra_bias = extra_bias or [{}] * real
    biases = [
        {**(p.logit_bias or {}), **extra} for p, extra in zip(params, extra_bias, strict=True)
    ]
    return SamplingMetadata(
        temperature=column([0.0 if p.greedy else p.temperature for p in params], np.float32, 0),
        top_k=column([max(p.top_k, 0) for p in params], np.int32, 0),
        top_p=column([p.top_p for p in params], np.float32, 1),
        min_p=column([p.min_p for p in params], np.float32, 0),
        presence_penalty=column([p.presence_penalty for p in params], np.float32, 0),
        frequency_penalty=column([p.frequency_penalty for p in params], np.float32, 0),
        repetition_penalty=column([p.repetition_penalty for p in params], np.float32, 1),
        seeds=column([s % 2**32 for s in seeds], np.uint32, 0),
        steps=column([len(t) - n for t, n in histories], np.int32, 0),
        prompt_token_ids=padded(
            [t[:n] if r else [] for (t, n), r in zip(histories, uses_repetition, strict=True)],
            min_width=history_width if any(uses_repetition) else 1,
        ),
        output_token_ids=padded(
            [t[n:] if u else [] for (t, n), u in zip(histories, uses_output, strict=True)],
            min_width=history_width if any(uses_output) else 1,
        ),
        bias_token_ids=padded([list(b) for b in biases]),
        bias_values=padded([list(b.values()) for b in biases], np.float32, 0),
    )


def _bucket(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def needs_penalties(params: list[SamplingParams]) -> bool:
    return any(
        p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        for p in params
    )


def needs_truncation(params: list[SamplingParams]) -> bool:
    return any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p in params)
