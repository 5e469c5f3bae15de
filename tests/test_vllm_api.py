"""A vLLM user's habits, one test each, written as vLLM's documentation writes them."""

from __future__ import annotations

import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.inputs import TextPrompt, TokensPrompt

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TEMPLATE = (
    "{% for m in messages %}<s> w{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w99{% endif %}{% if shout %} w98{% endif %}"
)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    return LLM(
        model=str(path),
        max_model_len=64,
        num_kv_blocks=48,
        max_num_batched_tokens=32,
        block_size=16,
    )


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_every_prompt_form_gives_the_same_greedy_tokens(llm):
    text = "w5 w9 w11 w40"
    ids = llm.get_tokenizer().encode(text)
    forms = [
        text,
        [text],
        {"prompt": text},
        TextPrompt(prompt=text),
        [{"prompt_token_ids": ids}],
        TokensPrompt(prompt_token_ids=ids),
        ids,
        [ids],
    ]
    results = [tokens(llm.generate(form, GREEDY, use_tqdm=False)) for form in forms]
    assert all(r == results[0] for r in results), results
    both = llm.generate(
        prompts=[TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids, prompt=text)],
        sampling_params=GREEDY,
        use_tqdm=False,
    )
    assert tokens(both) == results[0] * 2
    assert [o.prompt for o in both] == [text, text]


def test_a_bad_prompt_dict_names_its_keys(llm):
    with pytest.raises(ValueError, match="unknown keys \\['prompt_ids'\\]"):
        llm.generate({"prompt_ids": [1, 2]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="text models"):
        llm.generate({"prompt": "w5", "multi_modal_data": {}}, GREEDY, use_tqdm=False)
    assert tokens(llm.generate("w5 w6", GREEDY, use_tqdm=False))  # still serving


def test_one_sampling_params_per_prompt_and_priority_per_prompt(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    llm = LLM(str(path), max_model_len=64, num_kv_blocks=48, max_num_seqs=1)
    prompts = ["w5 w6", "w7 w8", "w9 w10"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 3, 4)]
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1])
    assert [len(t) for t in tokens(outputs)] == [2, 3, 4]
    # One sequence at a time: the lowest priority value runs first.
    first = [o.metrics.first_token_time for o in outputs]
    assert first[1] < first[2] < first[0]
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(prompts, params, priority=[0, 1])


def test_vllm_engine_keywords_are_accepted(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    llm = LLM(
        model=str(path),
        tokenizer=str(path),
        tensor_parallel_size=1,
        trust_remote_code=False,
        enforce_eager=False,
        swap_space=4,
        gpu_memory_utilization=0.9,
        max_model_len=64,
        seed=0,
        disable_log_stats=True,
        enable_chunked_prefill=True,
        num_gpu_blocks_override=40,
        dtype="auto",
    )
    assert llm.llm_engine.stats()["kv_blocks_total"] == 39  # the null block aside
    assert tokens(llm.generate("w5 w9", GREEDY, use_tqdm=False))


@pytest.mark.parametrize(
    "keyword,error,message",
    [
        (dict(no_such_option=1), TypeError, "unknown engine options \\['no_such_option'\\]"),
        (dict(pipeline_parallel_size=2), ValueError, "pipeline_parallel_size=2 .* takes 1"),
        (dict(quantization="awq"), ValueError, "quantization='awq' .* None or \"gguf\""),
    ],
)
def test_unsupported_keywords_say_what_is_supported(tiny_model_dir, keyword, error, message):
    path, _ = tiny_model_dir("llama")
    with pytest.raises(error, match=message):
        LLM(str(path), **keyword)


def test_chat_one_conversation_or_a_batch_with_vllm_options(llm):
    conversation = [{"role": "user", "content": "3"}]
    one = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    batch = llm.chat([conversation, conversation], GREEDY, chat_template=TEMPLATE)
    assert len(one) == 1 and tokens(batch) == tokens(one) * 2
    assert one[0].prompt_token_ids == llm.get_tokenizer().encode("<s> w3 w99")
    kwargs = llm.chat(
        conversation, GREEDY, chat_template=TEMPLATE, chat_template_kwargs={"shout": True}
    )
    assert kwargs[0].prompt_token_ids[-2:] == llm.get_tokenizer().encode("w99 w98")
    continued = llm.chat(
        conversation + [{"role": "assistant", "content": "27"}],
        GREEDY,
        chat_template=TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert continued[0].prompt_token_ids == llm.get_tokenizer().encode("<s> w3 <s> w27")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conversation, GREEDY, chat_template=TEMPLATE, continue_final_message=True)


def test_reset_prefix_cache_and_num_cached_tokens(llm):
    prompt = " ".join(f"w{i}" for i in range(3, 40))  # 37 tokens: two full blocks of 16
    assert llm.reset_prefix_cache() is True
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert tokens([first]) == tokens([again])


def test_logprobs_carry_decoded_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    output = llm.generate("w5 w9 w11", params, use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    for entry in output.outputs[0].logprobs + output.prompt_logprobs[1:]:
        for token, logprob in entry.items():
            assert logprob.decoded_token == tokenizer.convert_ids_to_tokens(token)


def test_lora_requests_need_enable_lora(llm):
    from pagedjax.lora.request import LoRARequest

    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("w5", GREEDY, lora_request=LoRARequest("a", 1, "/nowhere"))


# Where vLLM users import each name from (vLLM's own modules), and pagedjax's twin module.
VLLM_IMPORTS = {
    "vllm": ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput",
             "TextPrompt", "TokensPrompt", "PromptType", "LoRARequest"],
    "vllm.lora.request": ["LoRARequest"],
    "vllm.entrypoints.llm": ["LLM"],
    "vllm.sampling_params": ["SamplingParams", "BeamSearchParams", "RequestOutputKind",
                             "StructuredOutputsParams"],
    "vllm.outputs": ["RequestOutput", "CompletionOutput"],
    "vllm.logprobs": ["Logprob"],
    "vllm.inputs": ["TextPrompt", "TokensPrompt", "PromptType"],
    "vllm.beam_search": ["BeamSearchSequence", "BeamSearchOutput"],
    "vllm.v1.engine.async_llm": ["AsyncLLM"],
}  # fmt: skip
MOVED = {"vllm.v1.engine.async_llm": "pagedjax.async_llm"}


def _import_table() -> dict[str, tuple[list[str], str]]:
    """docs/vllm_compat.md's "Import paths" table: vLLM module -> (names, pagedjax module)."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "vllm_compat.md").read_text()
    section = text.split("## Import paths", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`vllm"):
            names = [n.strip().strip("`") for n in cells[1].split(",")]
            table[cells[0].strip("`")] = (names, cells[2].strip("`"))
    return table


def test_every_name_imports_from_where_vllm_users_import_it():
    import importlib

    import pagedjax

    table = _import_table()
    assert {m: names for m, (names, _) in table.items()} == VLLM_IMPORTS
    for vllm_module, (names, module) in table.items():
        assert module == MOVED.get(vllm_module, vllm_module.replace("vllm", "pagedjax", 1))
        imported = importlib.import_module(module)
        for name in names:
            assert getattr(imported, name) is not None, f"from {module} import {name}"
    # The same class wherever it is imported from, and pagedjax's extra top-level names.
    from pagedjax.beam_search import BeamSearchParams as from_beam_search
    from pagedjax.sampling_params import BeamSearchParams

    assert pagedjax.BeamSearchParams is BeamSearchParams is from_beam_search
    for name in ("AsyncLLM", "StructuredOutputsParams", "RequestOutputKind", "EngineConfig"):
        assert getattr(pagedjax, name) is not None
    assert set(pagedjax.__all__) >= set(VLLM_IMPORTS["vllm"])
