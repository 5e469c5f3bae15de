"""The LLM facade: input forms, output order, per-prompt params, streaming, chat, interrupts."""

from __future__ import annotations

import pytest

from pagedjax.llm import LLM
from pagedjax.sampling_params import RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    return LLM(str(path), max_model_len=64, num_kv_blocks=48, max_num_batched_tokens=32)


def test_generate_accepts_strings_token_ids_and_lists(llm):
    text = "w5 w9 w11 w40"
    ids = llm.get_tokenizer().encode(text)
    one_string = llm.generate(text, GREEDY, use_tqdm=False)
    one_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    mixed = llm.generate([ids, text], GREEDY, use_tqdm=False)
    assert len(one_string) == len(one_ids) == 1 and len(mixed) == 2
    tokens = one_string[0].outputs[0].token_ids
    assert one_ids[0].outputs[0].token_ids == tokens
    assert [o.outputs[0].token_ids for o in mixed] == [tokens, tokens]
    assert one_string[0].prompt == text and one_ids[0].prompt is None
    assert one_string[0].prompt_token_ids == ids
    # The text continues the prompt, so it keeps the separating space.
    assert one_string[0].outputs[0].text == " " + llm.get_tokenizer().decode(tokens)


def test_outputs_in_input_order_with_per_prompt_params(llm):
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(10, 70, 6)]
    params = [
        SamplingParams(temperature=0, max_tokens=1 + i % 4, ignore_eos=True) for i in range(10)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=True)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1 + i % 4 for i in range(10)]
    for o in outputs:
        m = o.metrics
        assert o.finished and m.arrival_time <= m.first_token_time <= m.finished_time


def test_params_count_must_match(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["w5", "w6", "w7"], [GREEDY, GREEDY], use_tqdm=False)


def test_stream_deltas_add_up_to_the_text(llm):
    prompts = ["w5 w6 w7", "w8 w9"]
    texts = {o.request_id: "" for o in []}
    finals = {}
    for output in llm.stream(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)):
        texts[output.request_id] = texts.get(output.request_id, "") + output.deltas[0]
        if output.finished:
            finals[output.request_id] = output.outputs[0].text
    assert len(finals) == 2 and all(texts[i] == finals[i] for i in finals)


def test_failed_add_leaves_nothing_behind(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["w5 w6", "w7 " * 70], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_interrupt_leaves_the_engine_usable(llm, monkeypatch):
    engine = llm.llm_engine
    real_step, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["w5 w6 w7"] * 4, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.kv_cache_manager.block_pool.num_used_blocks == 0
    assert len(llm.generate("w5 w6 w7", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 5


def test_unknown_engine_option():
    with pytest.raises(TypeError, match="unknown engine options"):
        LLM(None, not_an_option=1)


def test_generate_builds_final_outputs_only_and_leaves_the_params_alone(llm, monkeypatch):
    engine_step = llm.llm_engine.step
    returned = []

    def step():
        outputs = engine_step()
        returned.extend(outputs)
        return outputs

    monkeypatch.setattr(llm.llm_engine, "step", step)
    outputs = llm.generate(["w5 w9", "w7 w3 w2"], GREEDY, use_tqdm=False)
    assert len(returned) == 2 and all(o.finished for o in returned)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5]
    assert GREEDY.output_kind is RequestOutputKind.CUMULATIVE
