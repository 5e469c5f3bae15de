"""The sampler: one jitted, batched function with per-request parameters as arrays.

Order, as in vLLM: penalties and logit bias on the raw logits, then greedy argmax, or
temperature -> top-k -> top-p -> min-p -> a draw. Logprobs are those of the raw model
distribution. Each row draws from its own key (request seed folded with the number of tokens
it has generated), so a seeded request samples the same tokens whatever else is in the batch.

A row may verify a draft token (speculative decoding): a greedy row accepts it if it is the
argmax; a sampled row accepts it with the target's probability of it and otherwise draws from
the target distribution without it (rejection sampling against a draft that is certain of its
token: the output keeps the target distribution). The row's token is the draft if accepted.

The passes over the [S, V] logits run in `SamplingKernels` the platform chose: XLA's here
(a draw is argmax(probs / Exp(1) noise)), or the CPU's C++ passes
(`pagedjax/cpu_native/sampling.py`, one inverse-CDF draw from 53 bits of the key: the same
distribution, other tokens for a seed than XLA's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.metadata import next_power_of_2
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
    # [S, ceil(V / 32)] i32: the tokens each row may sample (bit t of word t // 32), for
    # allowed_token_ids and structured outputs; None when no row has a mask (its own trace).
    token_mask: jax.Array | None = None
    # [S] i32: the draft token each row verifies, -1 for none; None when no row has one.
    draft_token_ids: jax.Array | None = None


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
    # Only when logprobs are asked for (num_logprobs is not None):
    logprobs: TokenLogprobs | None = None
    # Only when rows verify drafts: [S] bool, whether the row's draft was accepted.
    accepted: jax.Array | None = None


class SamplingKernels(Protocol):
    """The sampler's passes over [S, V] float32 logits, as one platform runs them."""

    def greedy(
        self, logits: jax.Array, bias_token_ids: jax.Array, bias_values: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(argmax(raw logits + bias) [S] i32, whether each raw row is finite [S] bool)."""
        ...

    def draw(
        self, logits: jax.Array, meta: SamplingMetadata, use_truncation: bool, all_greedy: bool
    ) -> jax.Array:
        """[S] i32 tokens from logits with penalties and bias applied: the argmax for greedy
        rows, else temperature, truncation (`truncate`'s rule) and the row's draw."""
        ...

    def token_logprobs(
        self, logits: jax.Array, tokens: jax.Array, num_logprobs: int
    ) -> TokenLogprobs:
        """Logprobs and ranks of `tokens` [R] under logits [R, V], and the top `num_logprobs`
        of each row (vLLM's ranks: 1 + the number of strictly likelier tokens)."""
        ...


@dataclass(frozen=True)
class XlaSampling:
    """SamplingKernels in XLA, for every platform."""

    def greedy(
        self, logits: jax.Array, bias_token_ids: jax.Array, bias_values: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        finite = jnp.all(jnp.isfinite(logits), axis=-1)
        biased = _add_bias(logits, bias_token_ids, bias_values)
        return jnp.argmax(biased, axis=-1).astype(jnp.int32), finite

    def draw(
        self, logits: jax.Array, meta: SamplingMetadata, use_truncation: bool, all_greedy: bool
    ) -> jax.Array:
        greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if all_greedy:
            return greedy_tokens
        greedy = meta.temperature <= 0
        scaled = logits / jnp.where(greedy, 1.0, meta.temperature)[:, None]
        if use_truncation:
            scaled = truncate(scaled, meta)
        probs = jax.nn.softmax(scaled, axis=-1)
        drawn = jax.vmap(_draw)(probs, meta.seeds, meta.steps)
        return jnp.where(greedy, greedy_tokens, drawn)

    def token_logprobs(
        self, logits: jax.Array, tokens: jax.Array, num_logprobs: int
    ) -> TokenLogprobs:
        raw = jax.nn.log_softmax(logits, axis=-1)
        logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)
        # Counted on the logits: the log-softmax is a shift of the row, whose rounding makes
        # ties.
        chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)
        ranks = 1 + jnp.sum(logits > chosen, axis=-1, dtype=jnp.int32)
        top_logprobs, top_ids = jax.lax.top_k(raw, num_logprobs)
        return TokenLogprobs(logprobs[:, 0], ranks, top_ids.astype(jnp.int32), top_logprobs)


XLA_SAMPLING = XlaSampling()


@partial(jax.jit, static_argnames=("num_logprobs", "kernels"))
def prompt_logprobs(
    logits: jax.Array,  # [S, V] f32: the step's logits rows
    rows: jax.Array,  # [P] i32: which of them predict a prompt token
    targets: jax.Array,  # [P] i32: that prompt token
    num_logprobs: int,
    kernels: SamplingKernels = XLA_SAMPLING,
) -> TokenLogprobs:
    """Logprobs of prompt tokens given the tokens before them (SamplingParams.prompt_logprobs)."""
    return kernels.token_logprobs(logits[rows], targets, num_logprobs)


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


def _add_bias(logits: jax.Array, bias_token_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(bias_token_ids < 0, logits.shape[-1], bias_token_ids)  # padding: dropped
    return logits.at[rows, ids].add(bias_values, mode="drop")


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys with the order of the float32 values x (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = bits >> 31 == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key_where(keys: jax.Array, enough) -> jax.Array:
    """[S, 1] the largest key t of each row with enough(keys >= t) true, by bisection over the
    32-bit key space (32 masked passes over [S, V] instead of a sort, which XLA:CPU runs
    slowly over a whole vocabulary). enough must be monotone: true for small t."""
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


def row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    """A row's draw key: its request's seed folded with the tokens it has generated."""
    return jax.random.fold_in(jax.random.key(seed), step)


_ACCEPT_STREAM = 1  # folded into a row's key for its acceptance test: apart from its draw


def _verify_drafts(
    adjusted: jax.Array,
    meta: SamplingMetadata,
    kernels: SamplingKernels,
    use_truncation: bool,
) -> tuple[jax.Array, jax.Array]:
    """([S] tokens, [S] accepted) for rows verifying meta.draft_token_ids on logits with
    penalties and bias applied. A sampled row accepts its draft d with probability p(d) under
    its target distribution p (temperature and truncation applied), and otherwise draws from
    p without d: the residual max(p - q, 0) of a draft distribution q certain of d."""
    drafts = meta.draft_token_ids
    greedy = meta.temperature <= 0
    has_draft = drafts >= 0
    scaled = adjusted / jnp.where(greedy, 1.0, meta.temperature)[:, None]
    if use_truncation:
        scaled = truncate(scaled, meta)
    safe = jnp.maximum(drafts, 0)[:, None]
    p_draft = jnp.exp(
        jnp.take_along_axis(scaled, safe, axis=-1)[:, 0]
        - jax.scipy.special.logsumexp(scaled, axis=-1)
    )
    u = jax.vmap(
        lambda seed, step: jax.random.uniform(
            jax.random.fold_in(row_key(seed, step), _ACCEPT_STREAM)
        )
    )(meta.seeds, meta.steps)
    argmax = jnp.argmax(adjusted, axis=-1).astype(jnp.int32)
    accepted = has_draft & jnp.where(greedy, argmax == drafts, u < p_draft)
    rows = jnp.arange(adjusted.shape[0])
    masked = jnp.where(has_draft & ~greedy, drafts, adjusted.shape[-1])  # out of range: none
    residual = scaled.at[rows, masked].set(_NEG_INF, mode="drop")
    # Scaled and truncated already: the draw applies a temperature of 1 and no truncation.
    unit = dataclasses.replace(
        meta,
        temperature=jnp.where(greedy, 0.0, 1.0),
        top_k=jnp.zeros_like(meta.top_k),
        top_p=jnp.ones_like(meta.top_p),
        min_p=jnp.zeros_like(meta.min_p),
    )
    tokens = kernels.draw(residual, unit, False, False)
    return tokens, accepted


def _draw(probs: jax.Array, seed: jax.Array, step: jax.Array) -> jax.Array:
    noise = jax.random.exponential(row_key(seed, step), probs.shape, jnp.float32)
    return jnp.argmax(probs / noise).astype(jnp.int32)


@partial(
    jax.jit,
    static_argnames=("kernels", "num_logprobs", "use_penalties", "use_truncation", "all_greedy"),
)
def sample(
    logits: jax.Array,  # [S, V] f32
    meta: SamplingMetadata,
    kernels: SamplingKernels = XLA_SAMPLING,
    num_logprobs: int | None = None,
    use_penalties: bool = True,
    use_truncation: bool = True,
    all_greedy: bool = False,
) -> SamplerOutput:
    """Samples one token per row. The static flags let a batch skip what none of its rows
    uses: penalties, truncation and draws, and the logprobs pass unless some row asks for
    logprobs (num_logprobs None, as SamplingParams.logprobs; 0 returns the sampled tokens'
    logprobs only)."""
    raw = logits
    drafts = meta.draft_token_ids
    accepted = None
    if meta.token_mask is not None:
        logits = apply_token_mask(logits, meta.token_mask)
    if all_greedy and not use_penalties:
        tokens, finite = kernels.greedy(logits, meta.bias_token_ids, meta.bias_values)
        if meta.token_mask is not None:  # masked entries are -inf on purpose
            finite = jnp.all(jnp.isfinite(raw), axis=-1)
        if drafts is not None:
            accepted = tokens == drafts
    else:
        finite = jnp.all(jnp.isfinite(raw), axis=-1)
        adjusted = apply_penalties(logits, meta) if use_penalties else logits
        adjusted = _add_bias(adjusted, meta.bias_token_ids, meta.bias_values)
        if drafts is None:
            tokens = kernels.draw(adjusted, meta, use_truncation, all_greedy)
        else:
            tokens, accepted = _verify_drafts(adjusted, meta, kernels, use_truncation)
    if accepted is not None:
        tokens = jnp.where(accepted, drafts, tokens)
    logprobs = None
    if num_logprobs is not None:
        logprobs = kernels.token_logprobs(raw, tokens, num_logprobs)
    return SamplerOutput(tokens, finite, logprobs, accepted)


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """-inf for the tokens whose bit is clear in each row's [W] i32 bitmask."""
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    bits = (mask[:, ids // 32] >> (ids % 32)[None, :]) & 1
    return jnp.where(bits != 0, logits, _NEG_INF)


def build_sampling_metadata(
    params: list[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
    seeds: list[int],
    *,
    num_rows: int | None = None,
    extra_bias: list[dict[int, float]] | None = None,
    history_width: int = 1,
    num_tokens: Sequence[int] | None = None,
    token_mask: np.ndarray | None = None,
    draft_token_ids: Sequence[int] | None = None,
) -> SamplingMetadata:
    """Host-side arrays for a batch of rows; rows past len(params) (padding) are greedy.

    `token_ids[i]` is row i's prompt followed by its output so far (an engine passes its
    sequences' own lists: they are sliced only for rows with penalties, never copied per step).
    Token-list widths are rounded up to powers of two, and the prompt and output histories
    (sent only when some row has a penalty) to at least `history_width`: an engine passes its
    max_model_len, so a growing output never changes a shape (no recompile mid-generation).
    `extra_bias` adds per-row biases (the engine masks stop tokens below min_tokens with -inf
    this way). `token_mask`: [num_rows, ceil(V / 32)] bitmasks of the tokens each row may
    sample, or None. `num_tokens[i]`: how many of `token_ids[i]` come before the
    sampled token (default: all; a list may already hold placeholders for this and later
    samples). `draft_token_ids[i]`: the draft row i verifies (-1: none), or None for none.
    """
    num_rows = num_rows or len(params)
    real = len(params)

    def column(values: list, dtype, fill) -> np.ndarray:
        out = np.full(num_rows, fill, dtype)
        out[:real] = values
        return out

    def padded(lists: list[list[int]], dtype=np.int32, fill=-1, min_width: int = 1) -> np.ndarray:
        longest = max((len(x) for x in lists), default=0)
        width = max(next_power_of_2(longest), next_power_of_2(min_width))
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
    if num_tokens is None:
        num_tokens = [len(t) for t in token_ids]
    histories = list(zip(token_ids, num_prompt_tokens, num_tokens, strict=True))
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
        # A greedy row draws nothing: the padding's seed, so greedy rows' arrays stay the
        # same wherever they move (a steady batch keeps its arrays on the device then).
        seeds=column(
            [0 if p.greedy else s % 2**32 for p, s in zip(params, seeds, strict=True)],
            np.uint32,
            0,
        ),
        steps=column([length - n for _, n, length in histories], np.int32, 0),
        prompt_token_ids=padded(
            [t[:n] if r else [] for (t, n, _), r in zip(histories, uses_repetition, strict=True)],
            min_width=history_width if any(uses_repetition) else 1,
        ),
        output_token_ids=padded(
            [
                t[n:length] if u else []
                for (t, n, length), u in zip(histories, uses_output, strict=True)
            ],
            min_width=history_width if any(uses_output) else 1,
        ),
        bias_token_ids=padded([list(b) for b in biases]),
        bias_values=padded([list(b.values()) for b in biases], np.float32, 0),
        token_mask=token_mask,
        draft_token_ids=None if draft_token_ids is None else column(draft_token_ids, np.int32, -1),
    )


def penalizes(p: SamplingParams) -> bool:
    """Whether a row with these params reads its histories (any of the three penalties)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def truncates(p: SamplingParams) -> bool:
    """Whether a row with these params samples from a truncated distribution."""
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)
