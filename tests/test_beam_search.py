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
    llm, _ = tiny
    engine = llm.llm_engine
    prompt = [(7 * i) % 120 + 3 for i in range(3 * BLOCK + 5)]  # three full blocks and a part
    width, new = 4, 5
    peak = 0
    step = engine.step

    def counting_step():
        nonlocal peak
        outputs = step()
        peak = max(peak, engine.stats()["kv_blocks_used"])
        return outputs

    engine.step = counting_step
    try:
        llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=new))
    finally:
        del engine.step
    alone = -(-(len(prompt) + new) // BLOCK)  # blocks one beam holds without sharing
    assert 0 < peak < width * alone, (peak, width * alone)
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
