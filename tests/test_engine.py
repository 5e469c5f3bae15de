"""The engine end to end on tiny random models: exactness against transformers, invariance of
greedy outputs to scheduling and memory decisions, sampling, n > 1, stops, aborts, compiles."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernels_pallas.kv_groups import kv_cache_groups
from pagedjax.config import EngineConfig
from pagedjax.engine import LLMEngine
from pagedjax.errors import DuplicateRequestIdError, InvalidRequestError, RequestTooLongError
from pagedjax.sampler import sample
from pagedjax.sampling_params import RequestOutputKind, SamplingParams
from pagedjax.worker.batch_sampling import BatchSampling, padding_row
from tests.conftest import build_tiny_tokenizer

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(tiny, name="llama", **options) -> LLMEngine:
    path, _, config, params = tiny(name)
    settings = dict(max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=64)
    settings.update(options)
    return LLMEngine(
        EngineConfig(model=str(path), **settings), config, params, build_tiny_tokenizer()
    )


def run(engine: LLMEngine, prompts, params, arrivals: list[int] | None = None) -> list:
    """Every request's final output; `arrivals[i]`: the step before which request i is
    added (default: all before the first)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    arrivals = arrivals or [0] * len(prompts)
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            if arrivals[i] == step:
                engine.add_request(str(i), prompt, p)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return [done[str(i)] for i in range(len(prompts))]


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def make_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, rng.integers(lo, hi)).tolist() for _ in range(n)]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral_window", "gemma2", "gemma3"])
def test_greedy_matches_transformers(tiny, name):
    prompts = make_prompts(6, seed=1)
    outputs = run(make_engine(tiny, name), prompts, SamplingParams(max_tokens=10, **GREEDY))
    hf_model = tiny(name)[1]
    for prompt, tokens in zip(prompts, tokens_of(outputs), strict=True):
        assert tokens == hf_greedy(hf_model, prompt, 10)


@pytest.mark.parametrize(
    "name", ["gemma2", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]
)
def test_family_greedy_holds_through_chunks_preemption_prefix_hits_and_n(tiny, name):
    """Gemma 2 (soft caps, post-norms, every other layer sliding over 7 keys), Gemma 3
    (qk-norms, local and global RoPE) and the mixtures of experts (conftest's TINY_MODELS) give
    transformers' greedy tokens with chunked prefill, preemption, prefix-cache hits (prompts
    sharing a 24-token prefix) and n = 2."""
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 128, 24).tolist()
    prompts = [shared + rng.integers(3, 128, n).tolist() for n in (3, 9, 14, 20)]
    hf_model = tiny(name)[1]
    expected = [hf_greedy(hf_model, prompt, 12) for prompt in prompts]
    params = SamplingParams(max_tokens=12, n=2, **GREEDY)

    # One tight engine: prompts chunked by 8 tokens, a pool that forces preemptions, the
    # shared prefix's blocks served from the cache.
    # The same KV bytes for every family: 14 whole-model blocks, in a hybrid model's slabs.
    groups = kv_cache_groups(tiny(name)[2].sliding_windows, tiny(name)[2].num_layers)
    num_blocks = 14 * tiny(name)[2].num_layers // groups.num_slabs
    engine = make_engine(tiny, name, max_num_batched_tokens=8, num_kv_blocks=num_blocks,
                         block_size=8, max_model_len=64)  # fmt: skip
    for out, want in zip(run(engine, prompts, params), expected, strict=True):
        assert [c.token_ids for c in out.outputs] == [want, want]
    assert engine.engine_core.scheduler.num_preemptions > 0
    assert engine.engine_core.kv_cache_manager.prefix_cache_stats.hit_rate > 0


def test_gemma3_long_conversation_holds_its_windows_not_its_length(tiny):
    """Gemma 3's sliding layers give back the blocks their 5-token window passed (KV cache
    groups, vLLM's hybrid allocator): a 96-token conversation ends holding its
    full-attention layer's 12 blocks and 1 or 2 blocks per sliding layer, where one table
    over every layer holds 12 for each (a prefill chunk still holds its whole length); the
    greedy tokens are transformers' either way."""
    prompt = make_prompts(1, seed=9, lo=70, hi=71)[0]
    want = hf_greedy(tiny("gemma3")[1], prompt, 26)
    end_bytes = {}
    for hybrid in (True, False):
        engine = make_engine(tiny, "gemma3", block_size=8, num_kv_blocks=100,
                             disable_hybrid_kv_cache_manager=not hybrid)  # fmt: skip
        kv = engine.engine_core.kv_cache_manager
        engine.add_request("0", prompt, SamplingParams(max_tokens=26, **GREEDY))
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids
            request = engine.engine_core.scheduler.requests.get("0")
            if request is not None and kv.has_request(request.request_id):
                tables = kv.get_block_ids(request)
                end_bytes[hybrid] = kv.memory_ledger().used_bytes
        assert tokens == want
        if hybrid:  # the tables at 95 tokens: every block in the full group, a window's
            full, *sliding = tables
            assert len(full) == 12 and all(full) and len(sliding) == 2
            assert all(len(t) == 12 and 1 <= sum(map(bool, t)) <= 2 for t in sliding)
    # 12 + 2 x 2 one-layer blocks at most, against 12 three-layer blocks.
    assert end_bytes[True] <= (12 + 2 * 2) / (12 * 3) * end_bytes[False]


@pytest.mark.parametrize(
    "options",
    [
        dict(num_scheduler_steps=4),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_min": 1}),
        dict(attention_backend="xla"),
        dict(kv_cache_dtype="fp8"),
    ],
    ids=["multi_step", "ngram", "xla", "fp8"],
)  # fmt: skip
def test_kv_cache_groups_hold_with_every_kind_of_step(tiny, options):
    """Gemma 3's KV cache groups (blocks given back as its 5-token windows pass) under
    multi-step decoding, n-gram drafts, XLA's attention: transformers' greedy tokens; with
    an fp8 pool (per-layer scales over shared slabs): one table's tokens."""
    prompts = [[5, 6, 7, 8] * 5 + p for p in make_prompts(3, seed=3, lo=4, hi=20)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    engine = make_engine(tiny, "gemma3", block_size=8, **options)
    tokens = tokens_of(run(engine, prompts, params))
    if options.get("kv_cache_dtype"):
        one_table = make_engine(
            tiny, "gemma3", block_size=8, disable_hybrid_kv_cache_manager=True, **options
        )
        assert tokens == tokens_of(run(one_table, prompts, params))
    else:
        assert tokens == [hf_greedy(tiny("gemma3")[1], prompt, 16) for prompt in prompts]
    if "speculative_config" in options:
        assert engine.stats()["spec_decode_num_drafts"] > 0


@pytest.fixture(scope="module")
def reference_run(tiny):
    prompts = make_prompts(8, seed=2)
    return prompts, tokens_of(
        run(make_engine(tiny), prompts, SamplingParams(max_tokens=12, **GREEDY))
    )


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_greedy_invariant_to_block_size(tiny, reference_run, block_size):
    prompts, expected = reference_run
    engine = make_engine(tiny, block_size=block_size, num_kv_blocks=1 + 64 * 8 // block_size)
    assert tokens_of(run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))) == expected


def test_greedy_invariant_to_chunked_prefill(tiny, reference_run):
    prompts, expected = reference_run
    engine = make_engine(tiny, max_num_batched_tokens=8)
    assert tokens_of(run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))) == expected
    assert (
        engine.engine_core.num_steps > len(prompts) * 12 // 8
    )  # prompts of up to 40 tokens were chunked


def test_greedy_invariant_to_long_prefill_threshold(tiny, reference_run):
    prompts, expected = reference_run
    engine = make_engine(tiny, long_prefill_token_threshold=5)
    assert tokens_of(run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))) == expected


def test_greedy_invariant_to_preemption(tiny, reference_run):
    prompts, expected = reference_run
    engine = make_engine(
        tiny, num_kv_blocks=14, block_size=8, max_model_len=64, enable_prefix_caching=False
    )
    assert tokens_of(run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))) == expected
    print(f"preemptions: {engine.engine_core.scheduler.num_preemptions}")
    assert engine.engine_core.scheduler.num_preemptions > 0
    assert engine.engine_core.kv_cache_manager.num_free_blocks == 13


def test_greedy_invariant_to_max_num_seqs(tiny, reference_run):
    prompts, expected = reference_run
    engine = make_engine(tiny, max_num_seqs=1)
    assert tokens_of(run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))) == expected


def test_greedy_invariant_to_prefix_caching(tiny):
    shared = make_prompts(1, seed=3, lo=40, hi=41)[0]
    prompts = [shared + tail for tail in make_prompts(6, seed=4, lo=2, hi=9)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    without = make_engine(tiny, enable_prefix_caching=False, block_size=8, num_kv_blocks=128)
    expected = tokens_of(run(without, prompts, params))
    with_cache = make_engine(tiny, enable_prefix_caching=True, block_size=8, num_kv_blocks=128)
    # Admit one first so its prefix is cached, then the rest.
    first = tokens_of(run(with_cache, prompts[:1], params))
    rest = tokens_of(run(with_cache, prompts[1:], params))
    assert first + rest == expected
    stats = with_cache.engine_core.kv_cache_manager.prefix_cache_stats
    print(f"prefix cache: {stats.hits} of {stats.queries} tokens hit ({stats.hit_rate:.0%})")
    assert with_cache.engine_core.kv_cache_manager.prefix_cache_stats.hits >= 5 * 40 // 8 * 8


def test_seeded_sampling_is_independent_of_the_batch(tiny):
    prompts = make_prompts(5, seed=5)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10) for i in range(5)]
    together = tokens_of(run(make_engine(tiny), prompts, params))
    alone = tokens_of(run(make_engine(tiny), prompts[2:3], params[2:3]))
    assert alone[0] == together[2]
    other_seed = SamplingParams(temperature=1.0, seed=7, max_tokens=10)
    assert tokens_of(run(make_engine(tiny), prompts[2:3], [other_seed]))[0] != together[2]


def test_parallel_sampling_shares_prompt_blocks(tiny):
    engine = make_engine(tiny, block_size=8, num_kv_blocks=64)
    prompt = make_prompts(1, seed=6, lo=36, hi=37)[0]  # 4 full blocks + a partial one
    engine.add_request(
        "p", prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    )
    engine.step()  # prefill + the first token of all four samples
    used = engine.engine_core.kv_cache_manager.block_pool.num_used_blocks
    assert used == 5  # the prompt's 5 blocks, shared by 4 sequences, not 20
    engine.step()  # each sample writes into the shared partial block: copy-on-write
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 5 + 3
    outputs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = out
    assert len(outputs.outputs) == 4 and all(len(c.token_ids) == 6 for c in outputs.outputs)
    assert len({tuple(c.token_ids) for c in outputs.outputs}) > 1
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_every_step_updates_the_donated_pool_in_place(tiny):
    """Prefill, decode and copy-on-write steps write into the pool's own buffers: the step
    donates the pool, so XLA aliases it to the output and no step copies the cache."""
    engine = make_engine(tiny, block_size=8, num_kv_blocks=64)
    first_pool = jax.tree.leaves(engine.engine_core.worker.runner.kv_cache)
    buffers = [leaf.unsafe_buffer_pointer() for leaf in first_pool]
    prompt = make_prompts(1, seed=6, lo=36, hi=37)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=5, ignore_eos=True)
    engine.add_request("p", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.engine_core.num_steps == 5
    assert all(leaf.is_deleted() for leaf in first_pool)  # donated to the first step
    pool = jax.tree.leaves(engine.engine_core.worker.runner.kv_cache)
    assert [leaf.unsafe_buffer_pointer() for leaf in pool] == buffers


def test_abort_mid_flight_frees_every_block(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=8)
    prompts = make_prompts(4, seed=7, lo=20, hi=30)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20, **GREEDY))
    for _ in range(3):
        engine.step()  # some mid-prefill, some waiting
    engine.abort_request(["0", "1", "2", "3"])
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_stops_and_lengths(tiny):
    engine = make_engine(tiny)
    prompt = make_prompts(1, seed=8)[0]
    free_run = tokens_of(run(engine, [prompt], SamplingParams(max_tokens=12, **GREEDY)))[0]
    target = free_run[5]
    first = free_run.index(target)

    out = run(engine, [prompt], SamplingParams(max_tokens=12, stop_token_ids=[target], **GREEDY))
    completion = out[0].outputs[0]
    assert completion.token_ids == free_run[: first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", target)

    stop_text = f"w{target}"
    out = run(engine, [prompt], SamplingParams(max_tokens=12, stop=[stop_text], **GREEDY))
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop_text
    assert stop_text not in out[0].outputs[0].text.split()

    out = run(engine, [prompt], SamplingParams(max_tokens=4, **GREEDY))
    assert out[0].outputs[0].token_ids == free_run[:4]
    assert out[0].outputs[0].finish_reason == "length"


def test_output_kinds(tiny):
    """CUMULATIVE: everything so far in each output; DELTA: only what is new, adding up to the
    same completion; FINAL_ONLY: nothing until the request finishes, then the whole of it."""
    prompts = make_prompts(2, seed=15)
    outputs = {}
    for kind in RequestOutputKind:
        engine = make_engine(tiny)
        params = SamplingParams(n=2, max_tokens=6, logprobs=2, seed=3, output_kind=kind)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs[kind] = []
        while engine.has_unfinished_requests():
            outputs[kind] += engine.step()

    def final(kind, i):
        last = [o for o in outputs[kind] if o.request_id == str(i)][-1]
        assert last.finished
        return [(c.text, c.token_ids, c.logprobs, c.cumulative_logprob) for c in last.outputs]

    final_only = outputs[RequestOutputKind.FINAL_ONLY]
    assert len(final_only) == 2 and all(o.finished for o in final_only)
    for i in range(2):
        expected = final(RequestOutputKind.CUMULATIVE, i)
        assert final(RequestOutputKind.FINAL_ONLY, i) == expected
        pieces = [o for o in outputs[RequestOutputKind.DELTA] if o.request_id == str(i)]
        assert len(pieces) == 6
        for index, (text, token_ids, logprobs, cumulative) in enumerate(expected):
            completions = [o.outputs[index] for o in pieces]
            assert "".join(c.text for c in completions) == text
            assert sum((c.token_ids for c in completions), []) == token_ids
            assert sum((c.logprobs for c in completions), []) == logprobs
            assert completions[-1].cumulative_logprob == cumulative


def test_eos_min_tokens_and_ignore_eos(tiny):
    engine = make_engine(tiny)
    prompt = make_prompts(1, seed=9)[0]
    eos = 2
    bias = {eos: 100.0}  # makes eos the greedy choice at every step
    out = run(engine, [prompt], SamplingParams(temperature=0, max_tokens=8, logit_bias=bias))
    assert out[0].outputs[0].token_ids == [eos]
    assert (out[0].outputs[0].finish_reason, out[0].outputs[0].stop_reason) == ("stop", None)
    out = run(
        engine, [prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias=bias)
    )
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].token_ids[-1] == eos
    out = run(
        engine,
        [prompt],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias=bias),
    )
    assert out[0].outputs[0].token_ids == [eos] * 5


def test_a_stop_string_before_min_tokens_does_not_stop(tiny):
    """The tiny tokenizer's words all contain "w": the stop string appears at once, but the
    output stops only at the min_tokens-th token, cut before its "w"."""
    engine = make_engine(tiny)
    params = SamplingParams(max_tokens=8, min_tokens=4, stop=["w"], **GREEDY)
    (output,) = run(engine, make_prompts(1, seed=22), params)
    completion = output.outputs[0]
    assert len(completion.token_ids) == 4
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "w")
    words = completion.text.split()
    assert len(words) == 3 and completion.text.endswith(" ")


def test_steady_workload_compiles_nothing_after_warmup(tiny):
    engine = make_engine(tiny, max_num_seqs=8)
    engine.engine_core.worker.runner.warmup()
    compiled = engine.engine_core.worker.runner.num_compilations
    run(engine, make_prompts(12, seed=10), SamplingParams(max_tokens=9, **GREEDY))
    assert engine.engine_core.worker.runner.num_compilations == compiled


def test_token_buckets_end_at_the_budget_and_pad_little():
    from pagedjax.worker.model_runner import token_buckets

    assert token_buckets(512) == [1, 4, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert token_buckets(100) == [1, 4, 16, 32, 64, 100] and token_buckets(1) == [1]
    # Batch invariant: no one-token step (XLA:CPU compiles its KV write otherwise).
    assert token_buckets(100, batch_invariant=True) == [2, 4, 16, 32, 64, 100]
    assert token_buckets(1, batch_invariant=True) == [2]
    for budget in (129, 600, 2048, 8192):
        buckets = token_buckets(budget)
        assert buckets == sorted(set(buckets)) and buckets[-1] == budget
        for n in range(128, budget + 1):  # past 128 a step pads less than a third of its rows
            assert next(b for b in buckets if b >= n) < 1.5 * n


def test_penalty_histories_do_not_recompile_the_sampler_as_outputs_grow(tiny):
    engine = make_engine(tiny, enable_prefix_caching=False)  # both runs prefill alike
    prompt = make_prompts(1, seed=12)
    params = dict(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5, seed=1)
    run(engine, prompt, SamplingParams(max_tokens=3, ignore_eos=True, **params))
    compiled = sample._cache_size()
    out = run(engine, prompt, SamplingParams(max_tokens=40, ignore_eos=True, **params))
    assert len(out[0].outputs[0].token_ids) == 40
    assert sample._cache_size() == compiled  # output widths 4 -> 64 reuse one variant


def test_logprobs(tiny):
    engine = make_engine(tiny)
    out = run(engine, make_prompts(1, seed=11), SamplingParams(max_tokens=3, logprobs=2, **GREEDY))
    completion = out[0].outputs[0]
    assert len(completion.logprobs) == 3
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy: the sampled token is the most likely one
        assert len(entry) == 2
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    )


def test_prompt_logprobs_match_transformers(tiny):
    """SamplingParams.prompt_logprobs against transformers' log-softmax at every prompt position,
    whole or chunked, with a cached copy of the prompt in the pool, and across preemptions."""
    hf_model = tiny("llama")[1]
    shared = make_prompts(1, seed=13, lo=30, hi=31)[0]
    prompts = [shared, shared, shared[:17] + [5, 9]]
    params = SamplingParams(max_tokens=12, prompt_logprobs=3, **GREEDY)
    configs = {
        "whole": dict(),
        "chunked": dict(max_num_batched_tokens=8, block_size=8, num_kv_blocks=128),
        "preempted": dict(num_kv_blocks=14, block_size=8, max_model_len=64),
    }
    for name, options in configs.items():
        engine = make_engine(tiny, **options)
        if name == "preempted":
            outputs = run(engine, prompts, params)
        else:  # one at a time: the later copies of the prompt find its blocks cached
            outputs = [run(engine, [prompt], params)[0] for prompt in prompts]
        for prompt, output in zip(prompts, outputs, strict=True):
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt])).logits[0]
            want = torch.log_softmax(logits.double(), -1).numpy()
            assert output.prompt_logprobs[0] is None
            assert len(output.prompt_logprobs) == len(prompt)
            for position, entry in enumerate(output.prompt_logprobs[1:]):
                token, row = prompt[position + 1], want[position]
                assert entry[token].logprob == pytest.approx(row[token], abs=2e-5), name
                assert entry[token].rank == 1 + int((row > row[token]).sum()), name
                top = [t for t, e in entry.items() if e.rank is not None and e.rank <= 3]
                assert sorted(top) == sorted(np.argsort(-row)[:3].tolist()), name
        if name == "preempted":
            assert engine.engine_core.scheduler.num_preemptions > 0
        assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("budget", [64, 8])
def test_prompt_logprobs_arrive_once_and_whole_in_delta_outputs(tiny, budget):
    """With the prompt in one step or prefilled in chunks of 8: the first output carries every
    prompt logprob, and no chunk before it makes an output of its own."""
    engine = make_engine(tiny, max_num_batched_tokens=budget)
    params = SamplingParams(
        n=2, max_tokens=3, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA, **GREEDY
    )
    prompt = make_prompts(1, seed=14, lo=30)[0]
    engine.add_request("d", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.prompt_logprobs is not None for o in outputs] == [True, False, False]
    assert len(outputs[0].prompt_logprobs) == len(prompt)
    assert all(len(entry) == 1 for entry in outputs[0].prompt_logprobs[1:])


def test_bad_requests_raise_and_the_engine_keeps_serving(tiny):
    engine = make_engine(tiny)
    engine.add_request("ok", make_prompts(1)[0], SamplingParams(max_tokens=4, **GREEDY))
    cases = [
        ("long", [5] * 130, SamplingParams(max_tokens=1), RequestTooLongError, "max_model_len"),
        ("sum", [5] * 120, SamplingParams(max_tokens=20), RequestTooLongError, "max_tokens"),
        ("empty", [], SamplingParams(), InvalidRequestError, "empty"),
        ("vocab", [5, 1000], SamplingParams(), InvalidRequestError, "vocabulary"),
        ("negative", [5, -1], SamplingParams(), InvalidRequestError, "vocabulary"),
        ("float", [5, 2.5], SamplingParams(), InvalidRequestError, "ints"),
        ("ok", [5], SamplingParams(), DuplicateRequestIdError, "already in use"),
    ]
    for request_id, prompt, params, error, message in cases:
        with pytest.raises(error, match=message):
            engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["ok"]
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_truncate_prompt_tokens_keeps_the_prompts_end(tiny):
    long_prompt = make_prompts(1, seed=15, lo=150, hi=151)[0]  # beyond max_model_len 128
    params = SamplingParams(max_tokens=5, truncate_prompt_tokens=100, **GREEDY)
    truncated, direct = run(make_engine(tiny), [long_prompt, long_prompt[-100:]], params)
    assert truncated.prompt_token_ids == long_prompt[-100:]
    assert truncated.outputs[0].token_ids == direct.outputs[0].token_ids


def test_pool_too_small_for_max_model_len_fails_at_startup(tiny):
    with pytest.raises(ValueError, match="max_model_len <= 64"):
        make_engine(tiny, num_kv_blocks=5, block_size=16, max_model_len=128)


def test_activation_profile_grows_with_tokens(tiny):
    from kernels_pallas.xla_attention import XLA
    from pagedjax.core.memory import KVCacheSpec
    from pagedjax.worker.model_runner import activation_bytes

    _, _, config, params = tiny("llama")
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, jnp.float32)
    small, large = (activation_bytes(config, params, t, 8, XLA, spec) for t in (16, 256))
    assert 0 < small < large


def test_stats(tiny):
    engine = make_engine(tiny)
    run(engine, make_prompts(3, seed=12), SamplingParams(max_tokens=6, **GREEDY))
    stats = engine.stats()
    assert stats["num_generated_tokens"] == 18 and stats["generation_tokens_per_s"] > 0
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_usage"] == 0.0


@pytest.mark.parametrize("backend", ["xla", "cpu_native", "pallas"])
def test_every_backend_gives_the_reference_tokens(tiny, backend):
    """Each registered attention backend (Pallas in interpret mode on the CPU) drives the
    engine to the oracle's tokens."""
    prompts = make_prompts(3, seed=13, lo=5, hi=20)
    params = SamplingParams(max_tokens=4, **GREEDY)
    expected = tokens_of(run(make_engine(tiny, attention_backend="reference"), prompts, params))
    engine = make_engine(tiny, attention_backend=backend, max_num_batched_tokens=16)
    assert engine.engine_core.worker.attention.name == backend
    assert tokens_of(run(engine, prompts, params)) == expected


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16"])  # fp8: tests/test_cpu_native_*.py
def test_narrow_pools_run_on_the_cpu_kernels(tiny, kv_cache_dtype):
    """The CPU's "auto" runs a bf16 pool on the C++ kernels, which write it in place and widen
    it as they read it: the reference attention's tokens on the same pool."""
    prompts = make_prompts(3, seed=16, lo=5, hi=20)
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine = make_engine(tiny, kv_cache_dtype=kv_cache_dtype)
    assert engine.engine_core.worker.attention.name == "cpu_native"
    reference = make_engine(tiny, attention_backend="reference", kv_cache_dtype=kv_cache_dtype)
    assert tokens_of(run(engine, prompts, params)) == tokens_of(run(reference, prompts, params))


def test_a_backend_that_cannot_run_the_model_says_why(tiny, monkeypatch):
    import dataclasses

    from kernels_pallas import xla_attention
    from pagedjax.cpu_native import attention as cpu_native

    monkeypatch.setattr(cpu_native, "MAX_GROUP", 1)  # the tiny llama has 2 query heads per KV head
    with pytest.raises(ValueError, match="cpu_native: it handles at most 1 query heads"):
        make_engine(tiny, attention_backend="cpu_native", kv_cache_dtype="bfloat16")
    auto = make_engine(tiny, kv_cache_dtype="bfloat16")  # "auto" takes the next that can
    assert auto.engine_core.worker.attention.name == "xla"
    monkeypatch.undo()
    other_layout = dataclasses.replace(xla_attention.XLA, kv_layout="block-token-head")
    monkeypatch.setattr(xla_attention, "XLA", other_layout)
    with pytest.raises(ValueError, match="xla: it reads a block-token-head pool"):
        make_engine(tiny, attention_backend="xla")


def test_fp8_kv_cache_runs_with_a_quarter_of_float32_bytes(tiny):
    prompts = make_prompts(3, seed=14)
    params = SamplingParams(max_tokens=5, **GREEDY)
    fp8 = make_engine(tiny, kv_cache_dtype="fp8")
    outputs = run(fp8, prompts, params)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outputs)
    assert fp8.engine_core.worker.runner.kv_cache.k.dtype == jnp.float8_e4m3fn
    f32 = make_engine(tiny)
    assert fp8.engine_core.kv_cache_manager.kv_spec.bytes_per_block(
        16
    ) * 4 == f32.engine_core.kv_cache_manager.kv_spec.bytes_per_block(16)


def test_block_size_defaults_by_platform(tiny):
    from pagedjax.platforms.cpu import cpu_platform
    from pagedjax.platforms.gpu import GpuPlatform

    assert EngineConfig().block_size is None
    assert (GpuPlatform().default_block_size, cpu_platform().default_block_size) == (16, 64)
    assert make_engine(tiny).config.block_size == 64
    explicit = make_engine(tiny, block_size=8)
    assert explicit.config.block_size == explicit.engine_core.kv_cache_manager.block_size == 8


def test_the_scheduling_policy_is_an_engine_option(tiny):
    """FCFS chosen by name drives the scheduler; under a pool too small for every request it
    preempts, and the greedy tokens do not change."""
    from pagedjax.core.sched_policy import FCFSPolicy

    prompts = make_prompts(4, seed=21, lo=20, hi=40)
    params = SamplingParams(max_tokens=10, **GREEDY)
    expected = tokens_of(run(make_engine(tiny), prompts, params))
    fcfs = make_engine(
        tiny, scheduling_policy="fcfs", num_kv_blocks=9, block_size=8, max_model_len=64
    )
    assert isinstance(fcfs.engine_core.scheduler.policy, FCFSPolicy)
    assert tokens_of(run(fcfs, prompts, params)) == expected
    assert fcfs.engine_core.scheduler.num_preemptions > 0


def test_gc_freeze_can_be_turned_off(tiny, monkeypatch):
    import gc

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    make_engine(tiny, freeze_gc=False)
    assert not frozen
    make_engine(tiny)
    assert frozen == [True]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(block_size=12), "block_size"),
        (dict(attention_backend="cuda"), "attention_backend"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(num_kv_blocks=1), "num_kv_blocks"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(scheduling_policy="lifo"), "scheduling_policy"),
    ],
)
def test_invalid_engine_config_names_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_greedy_rows_leaving_a_steady_batch_send_no_sampling_arrays(tiny):
    """Greedy rows asking nothing else have a padding row's sampling arrays (their seeds
    unused, so the padding's): a steady batch of them, its rows finishing one after another
    and others joining or sampled beside it, samples with the padding's arrays of its row
    bucket, sent once per bucket, ever; no edit, no transfer after that. The tokens are the
    general way's."""
    prompts = make_prompts(8, seed=5, lo=3, hi=12)
    params = [SamplingParams(max_tokens=6 + 3 * i, **GREEDY) for i in range(8)]
    # Beside the batch (into its bucket), and two more joining it after it shrank to one row.
    arrivals = [0, 0, 0, 0, 0, 3, 24, 25]
    general = make_engine(tiny)
    general.engine_core.scheduler.steady_decode = False
    want = tokens_of(run(general, prompts, params, arrivals))
    engine = make_engine(tiny)
    engine.engine_core.scheduler.steady_decode = True
    runner = engine.engine_core.worker.runner
    rebuild, decode, beside = runner._rebuild, runner._decode_sampling, runner._beside_sampling
    put, puts, batch_sent = runner._put_sampling, [], []
    buckets, removed, beside_steps = [], [], []

    def batch_puts(call, *args):  # the sampling arrays a kept batch's call sends
        before = len(puts)
        out = call(*args)
        batch_sent.extend(puts[before:])
        return out

    def counted_rebuild(batch, gone, added):
        removed.extend(gone)
        return batch_puts(rebuild, batch, gone, added)

    def counted_decode(batch, steps):
        meta = batch_puts(decode, batch, steps)
        buckets.append(len(batch.counters))
        assert batch.device_sampling is runner._padding_arrays[len(batch.counters)]
        return meta

    def counted_beside(rows, r_pad, steps):
        found = batch_puts(beside, rows, r_pad, steps)
        beside_steps.append(r_pad)
        assert found[1].bits is runner._padding_arrays[r_pad].bits
        return found

    runner._rebuild, runner._decode_sampling = counted_rebuild, counted_decode
    runner._beside_sampling, runner._put_sampling = (
        counted_beside,
        lambda m: puts.append(len(m.temperature)) or put(m),
    )
    assert tokens_of(run(engine, prompts, params, arrivals)) == want
    assert beside_steps and len(removed) >= 4
    changes = sum(map(operator.ne, buckets, buckets[1:]))
    # A bucket's arrays sent once, ever (warmup's buckets never); a bucket left and come back
    # to costs nothing.
    assert len(set(batch_sent)) == len(batch_sent) < changes, (batch_sent, buckets)


def test_rows_like_padding_are_found_among_any_rows():
    """`distinct_rows`: a greedy row asking nothing else is like a padding row; a sampled
    row, one with other options (a penalty, a bias) or a mask is not; no rows (a step beside a
    batch whose own sequences sample nothing yet) is an empty answer, not an error."""
    from pagedjax.sampler import build_sampling_metadata
    from pagedjax.worker.batch_sampling import distinct_rows

    params = [
        SamplingParams(**GREEDY),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(top_k=5, **GREEDY),  # greedy drops its top-k: like padding
        SamplingParams(presence_penalty=0.5, **GREEDY),
        SamplingParams(logit_bias={3: 1.0}, **GREEDY),
        SamplingParams(max_tokens=3, **GREEDY),
    ]
    n = len(params)
    meta = build_sampling_metadata(params, [[1, 2]] * n, [1] * n, [7] * n, num_rows=8)
    assert distinct_rows(meta, n).tolist() == [False, True, False, True, True, False]
    masked = build_sampling_metadata(params[:1], [[1]], [1], [0], token_mask=np.ones((1, 4)))
    assert distinct_rows(masked, 1).tolist() == [True]
    assert distinct_rows(build_sampling_metadata([], [], [], [], num_rows=0), 0).size == 0


@pytest.mark.parametrize("steady", [False, True])
def test_sampling_arrays_are_reused_and_edited_and_stay_right(tiny, steady):
    """General steps reuse the last step's sampling arrays while its rows stay the same; a
    steady batch's arrays, edited row by row as its rows finish and join (and with the rows
    beside it edited in), are sent again only then; every step's arrays (draw counters too)
    and flags equal a full build's."""
    import dataclasses

    engine = make_engine(tiny, max_num_batched_tokens=128)
    engine.engine_core.scheduler.steady_decode = steady
    runner = engine.engine_core.worker.runner
    general, decode, beside_sampling = (
        runner._sampling_metadata,
        runner._decode_sampling,
        runner._beside_sampling,
    )
    reused, edited, edited_beside = [], [], []
    padding = padding_row()

    def check(rows, r_pad, batch, meta, token_mask=None, draft_ids=None, counters=True):
        full = runner.build_sampling_metadata(rows, r_pad, token_mask, draft_ids)
        assert batch.flags() == BatchSampling.of([], [r.params for r in rows]).flags()
        meta = meta.unpacked()  # as the sampler's call takes them apart
        for field in dataclasses.fields(full):
            if field.name == "steps" and not counters:
                continue  # a kept row's counter advances past its forming step's row's
            want, got = getattr(full, field.name), getattr(meta, field.name)
            if want is None or got is None:
                assert want is None and got is None, field.name
                continue
            got = np.asarray(got)
            if want.ndim == 2 and got.shape[1] > want.shape[1]:  # a wider row left: padding
                fill = getattr(padding, field.name).flat[0]
                assert (got[:, want.shape[1] :] == fill).all(), field.name
                got = got[:, : want.shape[1]]
            assert np.array_equal(want, got), field.name

    def checked(rows, batch, steps, token_mask=None, draft_ids=None):
        before = runner._last_sampling
        meta = general(rows, batch, steps, token_mask, draft_ids)
        reused.append(before is not None and runner._last_sampling is before)
        # Beside a steady batch, its rows are the forming step's, their counters advanced.
        beside = runner._decode_batch is not None
        check(rows, batch.key[0], batch, meta, token_mask, draft_ids, counters=not beside)
        return meta

    def checked_beside(rows, r_pad, steps):
        found = beside_sampling(rows, r_pad, steps)
        edited_beside.append(found is not None)
        if found is not None:
            check(rows, r_pad, found[0], found[1], counters=False)
        return found

    def checked_decode(batch, steps):
        edited.append(batch.host_sampling is not None and batch.device_sampling is None)
        meta = decode(batch, steps)
        check(batch.rows, len(batch.counters), batch.sampling, meta, counters=False)
        return meta

    runner._sampling_metadata, runner._decode_sampling = checked, checked_decode
    runner._beside_sampling = checked_beside
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(max_tokens=9, min_tokens=5, temperature=0.7, seed=2),
        SamplingParams(max_tokens=24, **GREEDY),  # runs on alone: the flags change
        SamplingParams(max_tokens=6, temperature=0.9, min_p=0.1, seed=3),
        SamplingParams(max_tokens=10, logit_bias={5: 0.5, 7: -1.0, 9: 0.3}, **GREEDY),
        SamplingParams(max_tokens=8, **GREEDY),
        # Beside an all-greedy batch, together: the flags change.
        SamplingParams(max_tokens=5, temperature=0.9, top_k=5, seed=7),
        SamplingParams(max_tokens=5, logprobs=2, **GREEDY),
    ]
    arrivals = [0, 0, 0, 2, 6, 9, 14, 14]
    outputs = run(engine, make_prompts(8, seed=31, lo=3, hi=10), params, arrivals)
    # A failed check fails its step, whose requests the engine finishes with an error.
    assert {c.finish_reason for out in outputs for c in out.outputs} <= {"length", "stop"}
    if steady:
        assert any(edited) and any(edited_beside)
    else:
        assert any(reused) and not all(reused)
