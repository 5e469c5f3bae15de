"""Sampler semantics against numpy, seeded reproducibility across batches, and param checks."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.cpu_native import build, sampling
from pagedjax.cpu_native.sampling import CPU_SAMPLING
from pagedjax.sampler import XLA_SAMPLING, build_sampling_metadata, sample, truncate
from pagedjax.sampling_params import SamplingParams

V = 50


def run(
    logits, params, prompts=None, outputs=None, seeds=None, num_logprobs=0, kernels=CPU_SAMPLING
):
    n = len(params)
    prompts, outputs = prompts or [[]] * n, outputs or [[]] * n
    meta = build_sampling_metadata(
        params,
        [p + o for p, o in zip(prompts, outputs, strict=True)],
        [len(p) for p in prompts],
        seeds if seeds is not None else list(range(n)),
    )
    return sample(np.asarray(logits, np.float32), meta, kernels, num_logprobs=num_logprobs)


@pytest.fixture(params=["cpu_kernel", "xla"])
def draw_with(request):
    """The sampler's kernels as the CPU runs them (the C++ draw), or as a GPU does (XLA's
    noise argmax)."""
    return CPU_SAMPLING if request.param == "cpu_kernel" else XLA_SAMPLING


def random_logits(rows, seed=0):
    return np.random.default_rng(seed).normal(0, 2, (rows, V)).astype(np.float32)


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = random_logits(4)
    out = run(logits, [SamplingParams(temperature=0, logprobs=5)] * 4, num_logprobs=5)
    np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(-1))
    shifted = logits - logits.max(-1, keepdims=True)
    expected = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    logprobs = out.logprobs
    np.testing.assert_allclose(
        np.asarray(logprobs.top_logprobs), -np.sort(-expected)[:, :5], rtol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(logprobs.top_token_ids)[:, 0], logits.argmax(-1))
    np.testing.assert_allclose(
        np.asarray(logprobs.logprobs), expected[np.arange(4), logits.argmax(-1)], rtol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(logprobs.ranks), 1)


def test_token_logprobs_rank_any_token():
    logits = random_logits(3, seed=4)
    tokens = np.array([7, 0, V - 1], np.int32)
    out = XLA_SAMPLING.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 2)
    order = np.argsort(-logits, axis=-1)
    ranks = [1 + int(np.nonzero(order[r] == t)[0][0]) for r, t in enumerate(tokens)]
    np.testing.assert_array_equal(np.asarray(out.ranks), ranks)
    np.testing.assert_array_equal(np.asarray(out.top_token_ids), order[:, :2])


def test_without_logprobs_the_same_tokens_and_no_logprob_arrays():
    logits = random_logits(6)
    params = [SamplingParams(temperature=t, seed=s) for s, t in enumerate([0, 1, 0, 0.5, 2, 0])]
    with_logprobs = run(logits, params, num_logprobs=0)
    without = run(logits, params, num_logprobs=None)
    np.testing.assert_array_equal(
        np.asarray(without.token_ids), np.asarray(with_logprobs.token_ids)
    )
    np.testing.assert_array_equal(np.asarray(without.finite), np.asarray(with_logprobs.finite))
    assert without.logprobs is None


def test_seeded_draws_do_not_depend_on_the_batch(draw_with):
    logits = random_logits(6)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    alone = [
        int(run(logits[i : i + 1], params[i : i + 1], seeds=[i], kernels=draw_with).token_ids[0])
        for i in (1, 4)
    ]
    together = run(logits, params, seeds=list(range(6)), kernels=draw_with).token_ids
    reordered = run(
        logits[[4, 0, 1]], [params[i] for i in (4, 0, 1)], seeds=[4, 0, 1], kernels=draw_with
    ).token_ids
    assert alone == [int(together[1]), int(together[4])]
    assert alone == [int(reordered[2]), int(reordered[0])]


def test_draws_follow_the_distribution_and_seeds_differ(draw_with):
    logits = np.tile(random_logits(1, seed=3) / 2, (2000, 1))
    params = [SamplingParams(temperature=1.0)] * 2000
    tokens = np.asarray(run(logits, params, seeds=list(range(2000)), kernels=draw_with).token_ids)
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    freq = np.bincount(tokens, minlength=V) / len(tokens)
    assert np.abs(freq - probs).max() < 0.04
    assert len(set(tokens.tolist())) > 5


def test_top_k_top_p_min_p_restrict_the_support(draw_with):
    logits = random_logits(1, seed=5)
    order = np.argsort(-logits[0])
    n = 400
    batch = np.tile(logits, (n, 1))
    for kwargs, allowed in (
        (dict(top_k=3), set(order[:3])),
        (dict(top_p=1e-6), {order[0]}),
        (dict(min_p=1.0), {order[0]}),
    ):
        params = [SamplingParams(temperature=5.0, **kwargs)] * n
        out = run(batch, params, seeds=list(range(n)), kernels=draw_with)
        tokens = set(np.asarray(out.token_ids).tolist())
        assert tokens <= allowed and tokens, (kwargs, tokens)


def test_top_p_keeps_the_smallest_set_reaching_p(draw_with):
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)], np.float32))
    n = 600
    params = [SamplingParams(temperature=1.0, top_p=0.7)] * n
    out = run(np.tile(logits, (n, 1)), params, seeds=list(range(n)), kernels=draw_with)
    tokens = np.asarray(out.token_ids)
    assert set(tokens.tolist()) == {0, 1}


def test_penalties_match_vllm_formulas():
    logits = random_logits(1, seed=7)
    prompt, output = [1, 2, 3], [3, 4, 4, 5]
    params = SamplingParams(
        temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25
    )
    expected = logits[0].copy()
    for t in set(prompt + output):
        expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
    for t in set(output):
        expected[t] -= 0.5 * output.count(t) + 0.25
    # Make the penalised argmax differ from the raw one, then check the choice.
    for target in range(V):
        shifted = logits.copy()
        shifted[0, target] += 100
        exp = expected.copy()
        exp[target] = (
            shifted[0, target] / 1.5 if target in prompt + output else shifted[0, target]
        ) - (0.5 * output.count(target) + 0.25 if target in output else 0)
        token = int(run(shifted, [params], [prompt], [output]).token_ids[0])
        assert token == int(np.argmax(exp))


def test_logit_bias_and_stop_masking():
    logits = random_logits(1)
    low = int(np.argmin(logits[0]))
    out = run(logits, [SamplingParams(temperature=0, logit_bias={low: 1000.0})])
    assert int(out.token_ids[0]) == low


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logprobs=100), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(output_kind=2), "output_kind"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (
        1,
        1.0,
        1.0,
        0,
        16,
        0,
    )
    assert SamplingParams(stop="x").stop == ["x"]


def _truncate_by_sorting(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> set:
    """The textbook rule, one row: sort, keep the top k, then the smallest prefix whose mass
    reaches top_p, then probabilities >= min_p x the largest."""
    order = np.argsort(-logits, kind="stable")
    kept = order[: top_k or len(order)]
    probs = np.exp(logits[kept] - logits[kept].max())
    probs /= probs.sum()
    if top_p < 1.0:
        before = np.cumsum(probs) - probs
        reach = (before < top_p) | (np.arange(len(kept)) == 0)
        kept, probs = kept[reach], probs[reach]
    kept = kept[(probs >= min_p * probs.max()) & np.isfinite(logits[kept])]
    return set(kept.tolist())


def _kept_by_the_cpu_kernel(logits: np.ndarray, meta) -> np.ndarray:
    """The C++ sampler's kept tokens: those at or above its threshold (scaled logits)."""
    assert build.available()
    rows = logits.shape[0]
    tokens, thresholds = sampling.random_sample(
        jnp.asarray(logits),
        meta.temperature,
        meta.top_k,
        meta.top_p,
        meta.min_p,
        jnp.asarray(np.random.default_rng(0).integers(0, 2**32, (rows, 2), dtype=np.uint64)),
    )
    scaled = logits / np.asarray(meta.temperature)[:, None]
    kept = np.isfinite(logits) & (scaled >= np.asarray(thresholds)[:, None])
    assert kept[np.arange(rows), np.asarray(tokens)].all()  # each draw is a kept token
    return kept


@pytest.mark.parametrize("implementation", ["xla_bisection", "cpu_kernel"])
def test_truncation_without_a_sort_matches_sorting(implementation):
    """The bisection thresholds (XLA) and the C++ sampler's keep exactly the tokens a sort-based
    top-k/top-p/min-p keeps (random continuous logits, so no ties)."""
    rng = np.random.default_rng(7)
    rows, vocab = 16, 500
    for trial in range(6):
        logits = rng.normal(size=(rows, vocab)).astype(np.float32) * (0.5 + trial)
        logits[:, :2] = -np.inf  # banned tokens stay banned
        params = [
            SamplingParams(
                temperature=1.0,
                top_k=int(rng.choice([0, 1, 5, 80])),
                top_p=float(rng.choice([1.0, 0.3, 0.9, 0.999])),
                min_p=float(rng.choice([0.0, 0.05, 0.5])),
            )
            for _ in range(rows)
        ]
        meta = build_sampling_metadata(params, [[]] * rows, [0] * rows, [0] * rows)
        if implementation == "cpu_kernel":
            kept = _kept_by_the_cpu_kernel(logits, meta)
        else:
            kept = np.isfinite(np.asarray(truncate(jnp.asarray(logits), meta)))
        for i, p in enumerate(params):
            want = _truncate_by_sorting(logits[i].astype(np.float64), p.top_k, p.top_p, p.min_p)
            assert set(np.flatnonzero(kept[i]).tolist()) == want, (trial, i, p)


def test_cpu_sampling_kernel_survives_rows_without_finite_logits():
    """NaN and inf rows (finished with an error by the engine) still give in-range tokens, and
    a NaN does not break top-k's selection."""
    assert build.available()
    logits = np.random.default_rng(8).normal(size=(5, 1003)).astype(np.float32)
    logits[0, ::3] = np.nan
    logits[1, :] = np.nan
    logits[2, 5] = np.inf
    logits[3, :] = -np.inf
    bits = np.random.default_rng(9).integers(0, 2**32, (5, 2), dtype=np.uint64)
    for top_k, top_p, min_p in ((5, 1.0, 0.0), (0, 0.9, 0.0), (50, 0.5, 0.05)):
        tokens, _ = sampling.random_sample(
            jnp.asarray(logits),
            jnp.ones(5, jnp.float32),
            jnp.full(5, top_k, jnp.int32),
            jnp.full(5, top_p, jnp.float32),
            jnp.full(5, min_p, jnp.float32),
            jnp.asarray(bits),
        )
        tokens = np.asarray(tokens)
        assert ((tokens >= 0) & (tokens < 1003)).all()
        assert np.isfinite(logits[0, tokens[0]])  # the NaNs are never drawn


def test_top_k_keeps_every_token_tied_at_the_threshold():
    logits = np.asarray([[3.0, 2.0, 2.0, 2.0, 1.0]], np.float32)
    meta = build_sampling_metadata([SamplingParams(temperature=1.0, top_k=2)], [[]], [0], [0])
    tied = [[True, True, True, True, False]]
    assert np.isfinite(np.asarray(truncate(jnp.asarray(logits), meta))).tolist() == tied
    assert _kept_by_the_cpu_kernel(logits, meta).tolist() == tied


def test_cpu_greedy_kernel_matches_xla():
    """The C++ greedy pass (all-greedy batches without penalties, on the CPU) against XLA's
    bias + argmax + finite check: ties (the first index wins), biases that lift a token over
    the top, ban the top (the kernel's copy path) or repeat an id, rows with NaN or inf, and
    a vocabulary that is not a multiple of 8."""
    assert build.available()
    vocab = 1003
    logits = np.random.default_rng(5).normal(0, 2, (10, vocab)).astype(np.float32)
    logits[1, [7, 500, 900]] = 50.0  # ties: the first wins
    logits[2, :] = 1.0  # all tied
    logits[3, 10] = np.nan
    logits[4, 20] = np.inf
    logits[5, 1001] = 60.0  # the largest, in the scalar tail
    logits[6, 3] = 40.0  # the largest, banned below
    logits[7, :] = -np.inf
    biases = [
        {5: 100.0},  # lifted over the top
        {7: -1.0},  # the first of three tied tops lowered: the second wins
        {600: 0.0, 2: 0.0},  # a zero bias on a tied token: the lowest index still wins
        {},
        {},
        {1002: 3.0},
        {3: -np.inf},  # banned top: copy path
        {},
        {40: 10.0},  # repeated below: 10 + 30
        {11: -np.inf, 12: 5.0},
    ]
    greedy = [SamplingParams(temperature=0)] * 10
    meta = build_sampling_metadata(
        greedy, [[]] * 10, [0] * 10, list(range(10)), num_rows=10, extra_bias=biases
    )
    ids, values = np.asarray(meta.bias_token_ids).copy(), np.asarray(meta.bias_values).copy()
    ids = np.pad(ids, ((0, 0), (0, 1)), constant_values=-1)
    values = np.pad(values, ((0, 0), (0, 1)))
    ids[8, -1], values[8, -1] = 40, 30.0
    meta = dataclasses.replace(meta, bias_token_ids=ids, bias_values=values)

    tokens, finite = sampling.greedy_sample(jnp.asarray(logits), ids, values)
    want_tokens, want_finite = XLA_SAMPLING.greedy(jnp.asarray(logits), ids, values)
    finite = np.asarray(finite)
    np.testing.assert_array_equal(finite, np.asarray(want_finite))
    np.testing.assert_array_equal(finite, np.isfinite(logits).all(-1))
    np.testing.assert_array_equal(np.asarray(tokens)[finite], np.asarray(want_tokens)[finite])
    dense = logits.copy()
    np.add.at(dense, (np.arange(10)[:, None].repeat(ids.shape[1], 1)[ids >= 0], ids[ids >= 0]),
              values[ids >= 0])  # fmt: skip
    np.testing.assert_array_equal(np.asarray(tokens)[finite], dense.argmax(-1)[finite])
    assert list(np.asarray(tokens)[[0, 1, 2, 8]]) == [5, 500, 0, 40]
    out = sample(
        logits, meta, CPU_SAMPLING, use_penalties=False, use_truncation=False, all_greedy=True
    )
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.asarray(tokens))


@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_cpu_logprobs_kernel_matches_xla(num_logprobs):
    """The C++ log-softmax pass (logprobs and prompt logprobs on the CPU) against XLA's: ties at
    the top (the lower index first), a row of equal logits, tokens in the scalar tail of a
    vocabulary that is not a multiple of 8."""
    assert build.available()
    vocab = 1003
    logits = np.random.default_rng(6).normal(0, 3, (9, vocab)).astype(np.float32)
    logits[1, [900, 7, 500]] = 50.0
    logits[2, :] = 1.0
    logits[3, 1001] = 60.0
    tokens = np.array([4, 500, 999, 1001, 1002, 0, 17, 640, 333], np.int32)
    got = sampling.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), num_logprobs)
    want = XLA_SAMPLING.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), num_logprobs)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want.logprobs), atol=1e-6)
    chosen = logits[np.arange(9), tokens][:, None]
    np.testing.assert_array_equal(np.asarray(got[1]), 1 + (logits > chosen).sum(-1))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want.ranks))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want.top_token_ids))
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want.top_logprobs), atol=1e-6)
    if num_logprobs:
        assert list(np.asarray(got[2])[1]) == [7, 500, 900]
        assert list(np.asarray(got[2])[2]) == [0, 1, 2]
