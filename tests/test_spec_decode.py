"""Speculative decoding: n-gram proposals, verification in one step, rejection sampling
(pagedjax/core/ngram_proposer.py, pagedjax/core/spec_decode.py, pagedjax/sampler.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.config import EngineConfig
from pagedjax.core.engine_request import EngineRequest
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.ngram_proposer import NgramProposer
from pagedjax.core.request import Request
from pagedjax.core.spec_decode import SpeculativeConfig
from pagedjax.cpu_native.sampling import CPU_SAMPLING
from pagedjax.sampler import XLA_SAMPLING, build_sampling_metadata, sample
from pagedjax.sampling_params import SamplingParams
from tests.test_engine import make_engine, make_prompts, run, tokens_of

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# Repeating prompts (their continuations are often in them) and random ones.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42, 43] * 5, *make_prompts(4, seed=7)]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def request_of(tokens: list[int]) -> EngineRequest:
    return EngineRequest("r", tokens, SamplingParams(), max_tokens=16, seed=0)


def test_ngram_proposer_takes_the_longest_latest_match():
    proposer = NgramProposer(3, min_n=1, max_n=3)
    request = request_of([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # "2 3" ends the sequence; its latest earlier occurrence is followed by 7 8 5.
    assert proposer.propose(request, limit=8) == [7, 8, 5]
    assert proposer.propose(request, limit=2) == [7, 8]
    request.all_token_ids += [7, 8]  # the index extends with the new tokens only
    assert proposer.propose(request, limit=8) == [5, 2, 3]
    assert request.ngram_index.num_indexed == 14
    assert NgramProposer(3, 2, 3).propose(request_of([1, 2, 3, 4]), limit=8) == []
    # The longest match wins over a later, shorter one.
    request = request_of([4, 5, 6, 1, 9, 6, 2, 4, 5, 6])
    assert NgramProposer(2, 1, 3).propose(request, limit=8) == [1, 9]


def test_speculative_config_takes_vllm_dicts_and_names_bad_keys():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    spec = config.speculative_config
    assert isinstance(spec, SpeculativeConfig) and spec.num_speculative_tokens == 5
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 4)
    only_max = SpeculativeConfig(4, prompt_lookup_max=3)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (2, 3)
    for bad, message in (
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown keys"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "<="),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=bad)


def test_lookahead_slots_are_never_cached_and_rejected_ones_go_back():
    manager = KVCacheManager(16, 4)
    request = Request("r", list(range(10, 16)))  # 6 tokens
    manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 5
    request.append_token_ids(99)  # decoding: 7 tokens, 6 computed
    request.num_computed_tokens = 6
    # The last token and 5 drafts: slots up to 12 (3 blocks), cached only up to 7 tokens.
    manager.allocate_slots(request, 1, num_lookahead_tokens=5)
    assert len(manager.get_blocks(request)) == 3
    assert [b.block_hash is not None for b in manager.get_blocks(request)] == [True] + [False] * 2
    request.num_computed_tokens = 8  # one draft accepted
    request.append_token_ids([20, 21])
    manager.free_tail(request)  # 9 tokens: 3 blocks still hold them
    assert len(manager.get_blocks(request)) == 3
    request.all_token_ids[7:] = []  # fewer tokens (a stop): the third block goes back
    request.num_computed_tokens = 7
    manager.free_tail(request)
    assert len(manager.get_blocks(request)) == 2
    assert manager.block_pool.num_used_blocks == 2
    manager.allocate_slots(request, 0)  # the O(1) path was reset: the full check runs
    manager.free(request)
    assert manager.block_pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def expected(tiny):
    return tokens_of(run(make_engine(tiny, block_size=8), PROMPTS, GREEDY))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_tokens_are_unchanged_and_drafts_are_counted(tiny, expected, async_scheduling):
    engine = make_engine(
        tiny, block_size=8, speculative_config=SPEC, async_scheduling=async_scheduling
    )
    engine.engine_core.worker.runner.warmup()
    compiled = engine.engine_core.worker.runner.num_compilations
    assert tokens_of(run(engine, PROMPTS, GREEDY)) == expected
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 10
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_acceptance_rate"] == pytest.approx(
        stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    )
    assert stats["num_generated_tokens"] == len(PROMPTS) * GREEDY.max_tokens
    assert stats["kv_blocks_used"] == 0
    # Drafted steps are bucketed like any other step: nothing compiled after warm-up.
    assert engine.engine_core.worker.runner.num_compilations == compiled


class OracleProposer:
    """Proposes the known greedy continuation, with every fourth position wrong."""

    def __init__(self, prompts, outputs, k=4):
        self.answers = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
        self.k = k

    def propose(self, request, limit):
        answer = self.answers[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        drafts = answer[done : done + min(self.k, limit)]
        return [t if (done + i) % 4 != 3 else (t + 1) % 128 for i, t in enumerate(drafts)]


def oracle_engine(tiny, expected, **options):
    engine = make_engine(tiny, **{"block_size": 8, "speculative_config": SPEC, **options})
    engine.engine_core.scheduler.proposer = OracleProposer(PROMPTS, expected)
    return engine


def test_long_accepted_runs_and_rejections_anywhere_keep_the_tokens(tiny, expected):
    engine = oracle_engine(tiny, expected)
    assert tokens_of(run(engine, PROMPTS, GREEDY)) == expected
    stats = engine.stats()
    # Each drafted step accepts up to the wrong position and adds the target's token.
    assert stats["spec_decode_mean_acceptance_length"] > 2.5
    assert stats["kv_blocks_used"] == 0


def test_stops_inside_accepted_drafts_end_the_output_there(tiny, expected):
    """A stop token, a stop string, max_tokens and logprobs on tokens that arrive several in
    a step: the same outputs as one token a step."""
    assert_stops_inside_drafts_match(tiny, PROMPTS, expected, oracle_engine(tiny, expected))


def assert_stops_inside_drafts_match(tiny, prompts, expected, drafting_engine) -> None:
    """`drafting_engine`'s outputs with stops, a short max_tokens and logprobs landing inside
    accepted drafts are those of the same requests one token a step (`expected`: the greedy
    tokens of `prompts`)."""
    stop_token = expected[0][5]
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=30, stop=[f"w{expected[1][6]}"]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
        *[SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 9)],
    ]
    plain = run(make_engine(tiny, block_size=8), prompts, params)
    drafted = run(drafting_engine, prompts, params)
    for a, b in zip(plain, drafted, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
    assert drafted[0].outputs[0].token_ids[-1] == stop_token
    assert len(drafted[0].outputs[0].token_ids) <= 6
    got, want = drafted[2].outputs[0].logprobs, plain[2].outputs[0].logprobs
    assert [sorted(e) for e in got] == [sorted(e) for e in want]
    for g, w in zip(got, want, strict=True):
        for token in w:
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-5)
            assert g[token].rank == w[token].rank


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_prefix_caching_and_n_keep_the_tokens(tiny, expected, mode):
    """A pool for a fraction of the requests: drafted requests are preempted (their drafts in
    flight), swapped or recomputed, and prefixes hit; greedy tokens stay, n=2 samples run,
    nothing leaks."""
    tight = dict(block_size=8, num_kv_blocks=11, max_num_batched_tokens=32, max_model_len=72)
    engine = oracle_engine(tiny, expected, preemption_mode=mode, **tight)
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    outputs = run(engine, [*PROMPTS, PROMPTS[0]], [GREEDY] * len(PROMPTS) + [sampled])
    assert tokens_of(outputs[:-1]) == expected
    assert [len(c.token_ids) for c in outputs[-1].outputs] == [12, 12]
    # Again: the prompts' blocks come from the prefix cache (or its host tier).
    assert tokens_of(run(engine, PROMPTS[:2], GREEDY)) == expected[:2]
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_drafts"] > 0
    assert stats["prefix_cache_hit_rate"] + stats["prefix_cache_host_hit_rate"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["host_kv_blocks_used"] == 0


def test_disable_by_batch_size_turns_speculation_off_in_large_batches(tiny, expected):
    spec = {**SPEC, "disable_by_batch_size": 2}
    engine = make_engine(tiny, block_size=8, speculative_config=spec)
    assert tokens_of(run(engine, PROMPTS, GREEDY)) == expected
    drafts = engine.stats()["spec_decode_num_drafts"]
    run(engine, PROMPTS[:1], GREEDY)  # alone: it speculates
    assert drafts < engine.stats()["spec_decode_num_drafts"]


@pytest.mark.parametrize("kernels", [CPU_SAMPLING, XLA_SAMPLING], ids=["cpu_kernel", "xla"])
@pytest.mark.parametrize("top_k", [0, 6])
def test_rejection_sampling_keeps_the_target_distribution(kernels, top_k):
    """Rows verifying a draft emit tokens distributed as the target (temperature and top-k
    applied) whatever the draft: a likely one, an unlikely one, or one top-k cuts."""
    vocab, rows = 40, 6000
    logits = np.random.default_rng(0).normal(0, 1.5, vocab).astype(np.float32)
    temperature = 0.7
    scaled = logits / temperature
    if top_k:
        scaled = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
    target = np.exp(scaled - scaled.max())
    target /= target.sum()
    order = np.argsort(-target)
    for draft in (order[0], order[3], order[-1]):
        params = [SamplingParams(temperature=temperature, top_k=top_k or -1)] * rows
        meta = build_sampling_metadata(
            params,
            [[]] * rows,
            [0] * rows,
            list(range(rows)),
            draft_token_ids=[int(draft)] * rows,
        )
        out = sample(
            np.tile(logits, (rows, 1)), meta, kernels, use_penalties=False, use_truncation=True
        )
        tokens, accepted = np.asarray(out.token_ids), np.asarray(out.accepted)
        assert np.all(tokens[accepted] == draft)
        assert accepted.mean() == pytest.approx(target[draft], abs=0.03)
        freq = np.bincount(tokens, minlength=vocab) / rows
        assert np.abs(freq - target).max() < 0.03, (draft, np.abs(freq - target).max())
        assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(target))


def test_greedy_rows_accept_exactly_their_argmax():
    logits = np.random.default_rng(1).normal(0, 1, (4, 30)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = [int(best[0]), int(best[1] + 1) % 30, -1, int(best[3])]
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=0.5, seed=1)]
    meta = build_sampling_metadata(params, [[]] * 4, [0] * 4, [0] * 4, draft_token_ids=drafts)
    for kwargs in (dict(all_greedy=True), dict(all_greedy=False)):
        out = sample(
            logits[:3],
            build_sampling_metadata(
                params[:3], [[]] * 3, [0] * 3, [0] * 3, draft_token_ids=drafts[:3]
            ),
            CPU_SAMPLING,
            use_penalties=False,
            use_truncation=False,
            **kwargs,
        )
        assert np.asarray(out.accepted).tolist() == [True, False, False]
        assert np.asarray(out.token_ids).tolist() == best[:3].tolist()
    out = sample(logits, meta, CPU_SAMPLING, use_penalties=False, use_truncation=False)
    assert np.asarray(out.accepted)[:3].tolist() == [True, False, False]
