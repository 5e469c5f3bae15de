"""LoRA adapters: PEFT directories read, served in device slots beside the base model, and each
adapter's greedy tokens equal to transformers float32 with the adapter merged into the base
weights (W + scale * B @ A), mixed with base rows in one batch, under prefix caching, and after
an adapter is evicted from its slot and read again."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedjax.errors import InvalidRequestError
from pagedjax.lora.request import LoRARequest
from pagedjax.sampling_params import SamplingParams
from tests.test_engine import GREEDY, hf_greedy, make_engine, make_prompts, tokens_of

PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_peft_adapter(
    path: Path, hf_model, modules: list[str], rank: int, alpha: float, seed: int, **config
) -> Path:
    """A PEFT adapter directory for `hf_model` with random A and B (PEFT starts B at zero;
    random makes the adapter matter), in PEFT's tensor names."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer, block in enumerate(hf_model.model.layers):
        for module in modules:
            linear = getattr(getattr(block, PROJECTIONS[module]), module)
            out_features, in_features = linear.weight.shape
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[module]}.{module}"
            a = rng.normal(0, 0.3, (rank, in_features)).astype(np.float32)
            b = rng.normal(0, 0.3, (out_features, rank)).astype(np.float32)
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = dict(peft_type="LORA", r=rank, lora_alpha=alpha, target_modules=modules)
    (path / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    return path


def merged_model(hf_model, path: Path):
    """transformers' model with the adapter merged: W + scale * B @ A in every module."""
    from safetensors.numpy import load_file

    config = json.loads((path / "adapter_config.json").read_text())
    rank = config["r"]
    scale = config["lora_alpha"] / (rank**0.5 if config.get("use_rslora") else rank)
    merged = copy.deepcopy(hf_model)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            module = merged.get_submodule(
                name.removeprefix("base_model.model.").split(".lora_A.")[0]
            )
            module.weight += torch.from_numpy(scale * (b @ a))
    return merged


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """Two adapters of different ranks and targets: attention only (q, v, o; rank 4), and
    every projection with rsLoRA (rank 8); with their merged transformers models."""
    hf_model = tiny("llama")[1]
    root = tmp_path_factory.mktemp("adapters")
    small = write_peft_adapter(root / "small", hf_model, ["q_proj", "v_proj", "o_proj"], 4, 8, 1)
    full = write_peft_adapter(root / "full", hf_model, list(PROJECTIONS), 8, 16, 2, use_rslora=True)
    return {
        1: (LoRARequest("small", 1, str(small)), merged_model(hf_model, small)),
        2: (LoRARequest("full", 2, str(full)), merged_model(hf_model, full)),
    }


def test_a_batch_mixing_base_and_two_adapters_gives_each_its_merged_tokens(tiny, adapters):
    """One batch: base rows and two adapters' rows, prompts sharing a prefix (prefix
    caching on, so a block cached under one adapter must never serve another)."""
    shared = make_prompts(1, seed=7, lo=20, hi=21)[0]
    prompts = [shared + tail for tail in make_prompts(6, seed=8, lo=3, hi=12)]
    loras = [None, adapters[1][0], adapters[2][0]] * 2
    engine = make_engine(tiny, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8)
    params = SamplingParams(max_tokens=8, **GREEDY)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(str(i), prompt, params, lora_request=lora)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    base = tiny("llama")[1]
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        model = base if lora is None else adapters[lora.lora_int_id][1]
        assert outputs[str(i)] == hf_greedy(model, prompt, 8), f"prompt {i}, {lora}"
    assert len({tuple(outputs[str(i)]) for i in range(3)}) == 3  # the adapters matter
    assert engine.engine_core.kv_cache_manager.prefix_cache_stats.hits > 0
    assert engine.list_loras() == {1, 2}


def test_one_slot_serves_adapters_in_turn_and_reads_an_evicted_one_again(tiny, adapters):
    """max_loras=1: the scheduler runs one adapter at a time (the second adapter's request
    waits while the first's run); max_cpu_loras=1: adapter 1, dropped from the host cache
    when adapter 2 came, is read from its path again when a later request names it."""
    prompts = make_prompts(5, seed=9, lo=5, hi=15)
    loras = [adapters[1][0], adapters[2][0], adapters[1][0], None]
    engine = make_engine(tiny, enable_lora=True, max_loras=1, max_cpu_loras=1)
    params = SamplingParams(max_tokens=6, **GREEDY)
    outputs = tokens_of(run_with_loras(engine, prompts[:4], loras, params))
    slots = engine.engine_core.worker.runner.lora
    assert slots.num_loads == 2  # 1 (requests 0 and 2 together), then 2
    outputs += tokens_of(run_with_loras(engine, prompts[4:], [adapters[1][0]], params, "again"))
    assert slots.num_loads == 3
    base = tiny("llama")[1]
    for prompt, lora, tokens in zip(prompts, loras + [adapters[1][0]], outputs, strict=True):
        model = base if lora is None else adapters[lora.lora_int_id][1]
        assert tokens == hf_greedy(model, prompt, 6)


def run_with_loras(engine, prompts, loras, params, prefix: str = "") -> list:
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"{prefix}{i}", prompt, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{prefix}{i}"] for i in range(len(prompts))]


def embedding_adapter(tmp_path: Path) -> Path:
    """An adapter on the token embeddings, which pagedjax does not serve."""
    from safetensors.numpy import save_file

    folder = tmp_path / "embedding"
    folder.mkdir()
    tensor = "base_model.model.model.embed_tokens.lora_embedding_A"
    save_file({tensor: np.zeros((2, 128), np.float32)}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    return folder


def test_bad_adapters_are_refused_by_name_and_the_engine_keeps_serving(tiny, adapters, tmp_path):
    hf_model = tiny("llama")[1]
    engine = make_engine(tiny, enable_lora=True, max_lora_rank=4)
    params = SamplingParams(max_tokens=3, **GREEDY)
    cases = {
        "max_lora_rank": adapters[2][0],  # rank 8 > 4
        "use_dora": LoRARequest(
            "dora",
            3,
            str(
                write_peft_adapter(tmp_path / "d", hf_model, ["q_proj"], 2, 2, 3, use_dora=True)
            ),  # fmt: skip
        ),
        "does not exist": LoRARequest("missing", 4, str(tmp_path / "nowhere")),
        "embeddings or the LM head": LoRARequest("embed", 5, str(embedding_adapter(tmp_path))),
    }
    for message, lora in cases.items():
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request("x", [5, 6, 7], params, lora_request=lora)
    base = make_engine(tiny)  # LoRA off
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        base.add_request("x", [5, 6, 7], params, lora_request=adapters[1][0])
    with pytest.raises(InvalidRequestError, match="positive"):
        LoRARequest("zero", 0, "path")
    # Nothing was left behind: the engine serves the base and a good adapter.
    outputs = run_with_loras(engine, [[5, 6, 7]] * 2, [None, adapters[1][0]], params)
    assert tokens_of(outputs)[0] == hf_greedy(hf_model, [5, 6, 7], 3)
    assert tokens_of(outputs)[1] == hf_greedy(adapters[1][1], [5, 6, 7], 3)
    assert engine.engine_core.kv_cache_manager.num_free_blocks == 63
