"""LLM.beam_search as vLLM's, against transformers' num_beams on a tiny model."""

from __future__ import annotations

import pytest
import torch

from pagedjax import LLM
from pagedjax.beam_search import BeamSearchParams

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    path, hf_model = tiny_model_dir("llama")
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=96, block_size=BLOCK)
    return llm, hf_model


def test_beams_equal_transformers_num_beams(tiny):
    llm, hf_model = tiny
    prompt = [5, 9, 17, 33, 40, 41, 7]
    width, new = 4, 6
    hf_model.generation_config.eos_token_id = None  # both run every beam to max_tokens
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=new,
            length_penalty=1.0,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    params = BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True)
    [output] = llm.beam_search([{"prompt_token_ids": prompt}], params)
    assert [s.tokens for s in output.sequences] == expected.sequences.tolist()
    for beam, score in zip(output.sequences, expected.sequences_scores.tolist(), strict=True):
        assert beam.cum_logprob / new == pytest.approx(score, abs=1e-4)
        assert beam.finish_reason == "length" and len(beam.logprobs) == new


def test_beams_share_their_prefix_blocks(tiny):
    """Beams are copy-on-write forks: they hold fewer blocks than unshared beams would, and
    each step computes one token per beam (nothing recomputed)."""
    llm, _ = tiny
    engine = llm.llm_engine
    core = engine.engine_core
    prompt = [(7 * i) % 120 + 3 for i in range(3 * BLOCK + 5)]  # three full blocks and a part
    width, new = 4, 5
    peak = computed = 0
    step, schedule = core.step, core.scheduler.schedule

    def counting_step():
        nonlocal peak
        outputs = step()
        peak = max(peak, engine.stats()["kv_blocks_used"])
        return outputs

    def counting_schedule():
        nonlocal computed
        out = schedule()
        computed += sum(num_new for _, num_new in out.scheduled)
        return out

    core.step, core.scheduler.schedule = counting_step, counting_schedule
    try:
        llm.reset_prefix_cache()
        llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=new))
    finally:
        del core.step, core.scheduler.schedule
    alone = -(-(len(prompt) + new) // BLOCK)  # blocks one beam holds without sharing
    assert 0 < peak < width * alone, (peak, width * alone)
    assert computed <= len(prompt) + width * (new - 1)
    assert engine.stats()["kv_blocks_used"] == 0


def test_eos_completes_a_beam_and_the_ranking_follows_length_penalty(tiny):
    llm, _ = tiny
    eos = llm.get_tokenizer().eos_token_id
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5)
    [output] = llm.beam_search(["w5 w9 w17"], params)
    assert len(output.sequences) == 3
    for beam in output.sequences:
        assert (beam.finish_reason == "stop") == (beam.tokens[-1] == eos)
        assert beam.text.startswith("<s> w5 w9 w17") or beam.text.startswith("w5 w9 w17")
    scores = [
        b.cum_logprob / ((len(b.tokens) - (b.tokens[-1] == eos)) ** 0.5) for b in output.sequences
    ]
    assert scores == sorted(scores, reverse=True)


def test_bad_beam_params_say_what():
    with pytest.raises(ValueError, match="beam_width must be in \\[1, 10\\]"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        BeamSearchParams(beam_width=2, max_tokens=0)


def test_beams_are_the_same_when_preempted_held_back_or_stepped_in_sync(tiny, tiny_model_dir):
    """Fewer sequence slots than beams and a pool that fits two of them: beams wait, held
    beams are preempted for their siblings, and the search finds the same beams."""
    llm, _ = tiny
    path, _ = tiny_model_dir("llama")
    tight = LLM(
        str(path),
        max_model_len=64,
        num_kv_blocks=5,
        block_size=BLOCK,
        max_num_seqs=3,
        async_scheduling=False,
    )
    prompts = [[(5 * i + j) % 120 + 3 for i in range(BLOCK + 4)] for j in range(3)]
    params = BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True)
    expected = llm.beam_search(prompts, params)
    got = tight.beam_search(prompts, params, concurrency_limit=2)
    assert tight.llm_engine.stats()["num_preemptions"] > 0
    assert tight.llm_engine.stats()["kv_blocks_used"] == 0
    for want, have in zip(expected, got, strict=True):
        assert [s.tokens for s in have.sequences] == [s.tokens for s in want.sequences]
        for a, b in zip(have.sequences, want.sequences, strict=True):
            assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-5)
