"""Several decode steps per dispatch (num_scheduler_steps): every token, greedy or seeded, must
equal single steps, whatever the scheduling, memory pressure, stops and aborts around it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedjax.config import EngineConfig
from pagedjax.sampling_params import SamplingParams
from tests.test_async_scheduling import MIXED, all_tokens
from tests.test_engine import GREEDY, hf_greedy, make_engine, make_prompts, run, tokens_of

STEPS = 4
# Rows that run several steps (greedy, seeded draws with truncation, stop tokens, n > 1 once
# forked, logprobs, min_tokens up to where it ends, penalties) beside rows that need the host
# between tokens (bad words).
PARAMS = [
    *MIXED,
    SamplingParams(max_tokens=14, temperature=0.8, top_k=20, seed=7),
    SamplingParams(max_tokens=13, temperature=0.0, stop_token_ids=[5, 9, 17, 33]),
    SamplingParams(max_tokens=12, temperature=0.8, frequency_penalty=0.7, seed=8),
    SamplingParams(max_tokens=11, temperature=0.0, bad_words=["w5 w6", "w40"]),
]


def assert_same_logprobs(got, want) -> None:
    for got_output, want_output in zip(got, want, strict=True):
        for g, w in zip(got_output.outputs, want_output.outputs, strict=True):
            assert (g.logprobs is None) == (w.logprobs is None)
            for got_entry, want_entry in zip(g.logprobs or [], w.logprobs or [], strict=True):
                assert got_entry.keys() == want_entry.keys()
                for token, logprob in got_entry.items():
                    assert logprob.logprob == pytest.approx(want_entry[token].logprob, abs=1e-4)
                    assert logprob.rank == want_entry[token].rank
                    assert logprob.decoded_token == want_entry[token].decoded_token


def check_multi_step(engine) -> None:
    """The engine ran steps of several decode steps and gave every block back."""
    core = engine.engine_core
    assert core.num_model_steps > core.num_steps
    assert core.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefill beside decodes
        {"num_kv_blocks": 14, "block_size": 8, "max_model_len": 64},  # preemption
        {"enable_prefix_caching": True, "block_size": 8},
    ],
    ids=["plain", "chunked", "preempting", "prefix_cached"],
)
def test_tokens_equal_single_steps(tiny, options):
    """Steps of several decode steps, with async scheduling off and on, against single
    synchronous steps (the same tokens and logprobs either way)."""
    prompts = make_prompts(len(PARAMS), seed=21)
    if options.get("enable_prefix_caching"):  # shared prefixes, hit while others decode
        prompts = prompts + [prompts[0][:20] + p for p in prompts[:4]]
    params = (PARAMS * 2)[: len(prompts)]
    single = run(make_engine(tiny, async_scheduling=False, **options), prompts, params)
    for async_scheduling in (False, True):
        engine = make_engine(
            tiny, async_scheduling=async_scheduling, num_scheduler_steps=STEPS, **options
        )
        got = run(engine, prompts, params)
        assert all_tokens(got) == all_tokens(single), async_scheduling
        assert_same_logprobs(got, single)
        check_multi_step(engine)
        if "num_kv_blocks" in options:
            assert engine.engine_core.scheduler.num_preemptions > 0


def test_greedy_matches_transformers(tiny):
    prompts = make_prompts(4, seed=22)
    engine = make_engine(tiny, num_scheduler_steps=8)
    outputs = run(engine, prompts, SamplingParams(max_tokens=19, **GREEDY))
    hf_model = tiny("llama")[1]
    for prompt, tokens in zip(prompts, tokens_of(outputs), strict=True):
        assert tokens == hf_greedy(hf_model, prompt, 19)
    check_multi_step(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_block_cached_by_the_loops_first_token_holds_its_kv(tiny, async_scheduling):
    """The first loop after a 15-token prompt computes position 15, filling and caching
    the second 8-token block: a later prompt that extends that sequence hits the block, and
    its tokens are transformers' (the block was not left without that token's KV)."""
    engine = make_engine(
        tiny, num_scheduler_steps=STEPS, block_size=8, async_scheduling=async_scheduling
    )
    first = make_prompts(1, seed=26, lo=15, hi=16)[0]
    greedy = SamplingParams(max_tokens=6, **GREEDY)
    sampled = tokens_of(run(engine, [first], greedy))[0]
    second = first + sampled[:1] + [9, 10, 11]
    stats = engine.engine_core.kv_cache_manager.prefix_cache_stats
    hits = stats.hits
    assert tokens_of(run(engine, [second], greedy))[0] == hf_greedy(tiny("llama")[1], second, 6)
    assert stats.hits - hits == 16  # both blocks
    check_multi_step(engine)


def test_stop_strings_end_requests_where_single_steps_do(tiny):
    """The loop runs on past a stop string: the text and tokens after it are dropped."""
    prompts = make_prompts(4, seed=23)
    plain = run(make_engine(tiny), prompts, SamplingParams(max_tokens=20, **GREEDY))
    texts = [o.outputs[0].text for o in plain]
    stops = [" " + t.split()[len(t.split()) * 2 // 3] for t in texts]  # a word late in the text
    params = [SamplingParams(max_tokens=20, stop=[s], **GREEDY) for s in stops]
    expected = run(make_engine(tiny), prompts, params)
    engine = make_engine(tiny, num_scheduler_steps=STEPS)
    got = run(engine, prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert tokens_of(got) == tokens_of(expected)
    assert any(o.outputs[0].stop_reason is not None for o in got)
    check_multi_step(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_abort_mid_loop_frees_the_request_and_spares_the_others(tiny, async_scheduling):
    prompts = make_prompts(3, seed=24)
    params = SamplingParams(max_tokens=30, **GREEDY)
    expected = tokens_of(run(make_engine(tiny), prompts, params))
    engine = make_engine(tiny, num_scheduler_steps=8, async_scheduling=async_scheduling)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    for _ in range(3):  # the prefill, then loops of 8 decode steps
        engine.step()
    assert engine.engine_core.num_model_steps > engine.engine_core.num_steps
    engine.abort_request("1")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["0"] == expected[0] and done["2"] == expected[2]
    assert "1" not in done
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_a_steady_workload_compiles_nothing_new(tiny):
    engine = make_engine(tiny, num_scheduler_steps=STEPS)
    prompts = make_prompts(6, seed=25)
    run(engine, prompts, SamplingParams(max_tokens=16, **GREEDY))
    compiled = engine.engine_core.worker.runner.num_compilations
    run(engine, prompts, SamplingParams(max_tokens=16, **GREEDY))
    assert engine.engine_core.worker.runner.num_compilations == compiled


def test_config_refuses_what_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="num_scheduler_steps must be positive"):
        EngineConfig(model=str(tmp_path), num_scheduler_steps=0)
    with pytest.raises(ValueError, match="choose one"):
        EngineConfig(
            model=str(tmp_path),
            num_scheduler_steps=4,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


def test_warmup_compiles_the_loops_a_greedy_workload_takes(tiny):
    engine = make_engine(tiny, num_scheduler_steps=STEPS, max_num_seqs=4)
    runner = engine.engine_core.worker.runner
    runner.warmup()
    compiled = runner.num_compilations
    run(engine, make_prompts(4, seed=26), SamplingParams(max_tokens=16, **GREEDY))
    check_multi_step(engine)
    assert runner.num_compilations == compiled


def test_logprobs_min_tokens_and_penalties_run_inside_the_loop(tiny):
    """Rows asking for logprobs take several steps (the loop returns each step's); a row
    whose min_tokens is not reached yet takes steps up to it, its stop tokens masked; a row
    with penalties keeps its output history on the device."""
    prompts = make_prompts(6, seed=27)
    stops = [5, 9, 17, 33, 40, 51, 64, 77, 90, 101, 115]
    params = [
        SamplingParams(max_tokens=16, logprobs=3, **GREEDY),
        SamplingParams(max_tokens=16, logprobs=0, temperature=0.9, seed=4),
        SamplingParams(max_tokens=16, min_tokens=9, stop_token_ids=stops, temperature=0.0),
        SamplingParams(max_tokens=16, min_tokens=3, stop_token_ids=stops, temperature=1.0, seed=6),
        SamplingParams(max_tokens=16, repetition_penalty=1.5, presence_penalty=0.3, **GREEDY),
        SamplingParams(max_tokens=16, frequency_penalty=1.0, temperature=0.9, seed=11),
    ]
    single = run(make_engine(tiny), prompts, params)
    engine = make_engine(tiny, num_scheduler_steps=8)
    got = run(engine, prompts, params)
    assert all_tokens(got) == all_tokens(single)
    assert_same_logprobs(got, single)
    for g, w in zip(got, single, strict=True):
        assert (
            g.outputs[0].cumulative_logprob
            == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)
            if w.outputs[0].cumulative_logprob is not None
            else True
        )
    assert len(got[2].outputs[0].token_ids) >= 9
    core = engine.engine_core
    assert core.num_model_steps >= 2 * core.num_steps  # mostly steps of several
    assert core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_rows_with_token_masks_take_one_step_of_the_loop_and_processors_a_single_step(tiny):
    """allowed_token_ids and bad words change the mask with each token: such a row takes the
    loop's first step only while the others run on; a logits processor (Python on the host)
    makes the step a single one. Every token equals single steps."""
    prompts = make_prompts(4, seed=28)
    masked = [
        SamplingParams(max_tokens=12, **GREEDY),
        SamplingParams(max_tokens=12, allowed_token_ids=list(range(3, 60)), **GREEDY),
        SamplingParams(max_tokens=12, bad_words=["w5 w6", "w40"], temperature=0.8, seed=3),
        SamplingParams(max_tokens=12, temperature=0.9, seed=5),
    ]
    single = run(make_engine(tiny), prompts, masked)
    engine = make_engine(tiny, num_scheduler_steps=STEPS)
    assert all_tokens(run(engine, prompts, masked)) == all_tokens(single)
    check_multi_step(engine)

    def no_w7(output_ids, logits):
        logits[7] = float("-inf")
        return logits

    processed = [*masked[:3], SamplingParams(max_tokens=12, logits_processors=[no_w7], **GREEDY)]
    single = run(make_engine(tiny), prompts, processed)
    engine = make_engine(tiny, num_scheduler_steps=STEPS)
    assert all_tokens(run(engine, prompts, processed)) == all_tokens(single)
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_the_loop_lowers_for_cuda_with_the_pallas_decode_kernel_inside(tiny, monkeypatch):
    """Several decode steps lowered for a GPU (not here): one compiled Triton kernel (the
    decode one: a static flag, no run-time choice between kernels), inside the loop."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from triton_compile import cuda_target, triton_call_targets

    engine = make_engine(tiny, num_scheduler_steps=STEPS, attention_backend="pallas")
    runner = engine.engine_core.worker.runner
    monkeypatch.setenv("PAGEDJAX_PALLAS_INTERPRET", "0")  # the kernels compiled, not interpreted
    with cuda_target(90):
        lowered = runner.lower_decode_steps(4, STEPS, lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert len(triton_call_targets(lowered)) == 1
    assert "stablehlo.while" in text


def test_a_loops_tokens_stop_at_nan_logits_or_a_stop_token():
    """A row's tokens up to its first NaN row (it finishes with an error), its stop token
    (the tokens the loop ran on past it are dropped) or its length limit."""
    import numpy as np

    from pagedjax.core.engine_request import EngineRequest, RequestStatus
    from pagedjax.core.kv_cache_manager import KVCacheManager
    from pagedjax.core.sched_output import ModelRunnerOutput
    from pagedjax.core.scheduler import Scheduler

    scheduler = Scheduler(
        KVCacheManager(64, 4), max_num_batched_tokens=64, max_num_seqs=8, max_model_len=12,
        num_scheduler_steps=STEPS, placeholder_stride=8,
    )  # fmt: skip
    requests = [
        EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=m), max_tokens=m, seed=i,
                      stop_token_ids=frozenset({2}))
        for i, (prompt, m) in enumerate([([5, 6, 7], 8)] * 3 + [([5, 6, 7], 1 + STEPS),
                                                                ([5, 6, 7, 8, 9, 10, 11], 5)])
    ]  # fmt: skip
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()  # the prefill: one token each
    scheduler.update_from_output(out, ModelRunnerOutput(np.full(5, 9), np.ones(5, bool)))
    out = scheduler.schedule()
    assert out.row_steps == [STEPS] * 5
    tokens = np.arange(10, 30).reshape(5, STEPS)
    tokens[1, 1] = 2  # the stop token
    finite = np.ones((5, STEPS), bool)
    finite[2, 2] = False
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(tokens, finite))
    assert [(o.new_token_ids, o.status) for o in outputs] == [
        ([10, 11, 12, 13], None),
        ([14, 2], RequestStatus.FINISHED_STOPPED),
        ([18, 19], RequestStatus.FINISHED_ERROR),
        ([22, 23, 24, 25], RequestStatus.FINISHED_LENGTH),
        ([26, 27, 28, 29], RequestStatus.FINISHED_LENGTH),
    ]
    assert requests[0].all_token_ids == [5, 6, 7, 9, 10, 11, 12, 13]
    assert requests[2].all_token_ids == [5, 6, 7, 9, 18, 19]
