"""Constrained sampling, as a vLLM user asks for it: structured outputs (JSON schema, regex,
choice, grammar, json_object), allowed_token_ids, bad_words and logits_processors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol():
    return LLM(max_model_len=512, max_num_seqs=64)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    return LLM(str(path), max_model_len=64, num_kv_blocks=64, block_size=16)


@pytest.mark.slow
def test_fifty_json_outputs_of_the_default_model_follow_their_schema(smol):
    conversations = [
        [{"role": "user", "content": f"Invent person number {i}: their name, age and city."}]
        for i in range(50)
    ]
    params = [
        SamplingParams(
            temperature=0.9,
            seed=i,
            max_tokens=96,
            structured_outputs=StructuredOutputsParams(json=PERSON),
        )
        for i in range(50)
    ]
    before = smol.llm_engine.stats()["num_compilations"]
    outputs = smol.chat(conversations, params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    # Other constraints reuse the compiled steps: masks are data, not shapes.
    again = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]+")
    )
    smol.chat(conversations[:50], again, use_tqdm=False)
    assert smol.llm_engine.stats()["num_compilations"] - before <= 12  # the mask's variants


@pytest.mark.slow
def test_a_bad_grammar_is_refused(smol):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: ("))
    with pytest.raises(ValueError, match="invalid grammar"):
        smol.generate(["a", "b"], params, use_tqdm=False)
    assert smol.llm_engine.stats()["kv_blocks_used"] == 0


@pytest.mark.slow
def test_regex_choice_grammar_and_json_object(smol):
    def text(constraint: StructuredOutputsParams, prompt: str, max_tokens: int = 24) -> str:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
        return smol.generate(prompt, params, use_tqdm=False)[0].outputs[0].text

    assert re.fullmatch(r"\d{3}-\d{4}", text(StructuredOutputsParams(regex=r"\d{3}-\d{4}"), "Tel:"))
    choice = StructuredOutputsParams(choice=["Paris", "London", "Rome"])
    assert text(choice, "The capital of France is") in ("Paris", "London", "Rome")
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    assert text(StructuredOutputsParams(grammar=grammar), "Is water wet?") in (
        "The answer is yes.",
        "The answer is no.",
    )
    gbnf = 'root ::= "x" [0-9] [0-9]'
    assert re.fullmatch(r"x\d\d", text(StructuredOutputsParams(grammar=gbnf), "Code:"))
    obj = text(StructuredOutputsParams(json_object=True), "A JSON object:", max_tokens=64)
    assert isinstance(json.loads(obj), dict)


@pytest.mark.slow
def test_n_sequences_each_follow_the_constraint(smol):
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=3,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(regex="(red|green|blue) (cat|dog)"),
    )
    output = smol.generate("A pet:", params, use_tqdm=False)[0]
    assert len(output.outputs) == 4
    for completion in output.outputs:
        assert re.fullmatch("(red|green|blue) (cat|dog)", completion.text), completion.text
        assert completion.finish_reason == "stop"


def test_a_tokenizer_llguidance_cannot_read_is_a_clear_error(tiny):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="w5"))
    with pytest.raises(ValueError, match="tokenizer llguidance can read"):
        tiny.generate("w5", params, use_tqdm=False)
    assert tiny.llm_engine.stats()["kv_blocks_used"] == 0


def test_allowed_token_ids_only(tiny):
    allowed = [7, 9, 11]
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=12, allowed_token_ids=allowed)
    output = tiny.generate("w5 w6", params, use_tqdm=False)[0].outputs[0]
    assert set(output.token_ids) <= set(allowed) and len(output.token_ids) == 12


def test_bad_words_are_never_completed(tiny):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    base = tiny.generate("w5 w6", greedy, use_tqdm=False)[0].outputs[0].token_ids
    pair = tiny.get_tokenizer().decode(base[2:4])  # a two-token word greedy decoding makes
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=[pair])
    tokens = tiny.generate("w5 w6", params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[:3] == base[:3] and tokens[3] != base[3]
    assert all(tokens[i : i + 2] != base[2:4] for i in range(len(tokens) - 1))
    single = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, bad_words=[f"w{base[0]}"]
    )
    assert base[0] not in tiny.generate("w5 w6", single, use_tqdm=False)[0].outputs[0].token_ids


def test_logits_processors_in_both_of_vllms_forms(tiny):
    seen = []

    def only_42(output_ids, logits):
        seen.append(list(output_ids))
        logits[:] = -1e9
        logits[42] = 0.0
        return logits

    def ban_42_after_two(prompt_ids, output_ids, logits):
        if len(output_ids) >= 2:
            logits[42] = float("-inf")
        return logits

    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logits_processors=[only_42, ban_42_after_two]
    )
    tokens = tiny.generate("w5 w6", params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[:2] == [42, 42] and 42 not in tokens[2:]
    assert seen[:3] == [[], [42], [42, 42]]


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: StructuredOutputsParams(json={}, regex="a"), "only use one kind"),
        (lambda: StructuredOutputsParams(), "must use one kind"),
        (lambda: SamplingParams(allowed_token_ids=[]), "allowed_token_ids is not None and empty"),
        (lambda: SamplingParams(bad_words=[""]), "bad_words cannot contain an empty string"),
        (lambda: SamplingParams(logits_processors=[3]), "logits_processors must be callables"),
    ],
)
def test_vllms_validation_messages(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_constraints_are_refused_before_any_state_changes(tiny):
    engine = tiny.llm_engine
    cases = [
        (SamplingParams(allowed_token_ids=[5, 100_000]), "out-of-vocab"),
    ]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            tiny.generate(["w5", "w6"], params, use_tqdm=False)
        assert not engine.has_unfinished_requests()
        assert engine.stats()["kv_blocks_used"] == 0
    assert tiny.generate("w5", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text
