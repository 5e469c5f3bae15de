"""Loading Hugging Face directories: sharded weights, and a clear error for each bad input."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from models.config import SUPPORTED_ARCHITECTURES
from models.errors import ModelLoadError, UnsupportedArchitectureError
from models.loader import load_model
from tests.conftest import build_tiny_hf_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny_hf_model("llama").save_pretrained(path, safe_serialization=True)
    return path


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_sharded_safetensors_load_like_a_single_file(saved_llama, tmp_path):
    sharded = tmp_path / "sharded"
    build_tiny_hf_model("llama").save_pretrained(sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    config_a, params_a = load_model(saved_llama)
    config_b, params_b = load_model(sharded)
    assert config_a == config_b
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_missing_path_says_what_to_pass(tmp_path):
    with pytest.raises(ModelLoadError, match="no model found.*config.json.*gguf"):
        load_model(tmp_path / "does-not-exist")


def test_directory_without_weights(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(path)


def test_truncated_safetensors(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(path)


def test_garbage_safetensors(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    (path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(path)


def test_unknown_architecture_names_the_supported_ones(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as error:
        load_model(path)
    assert "GPT2LMHeadModel" in str(error.value)
    assert all(arch in str(error.value) for arch in SUPPORTED_ARCHITECTURES)


def test_config_that_disagrees_with_the_weights(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no tensor 'model.layers.3"):
        load_model(path)

    config["num_hidden_layers"] -= 1
    config["intermediate_size"] += 8
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(path)

    # Projections narrower than the config's fused width are refused, not left half-filled.
    config["intermediate_size"] -= 8
    config["head_dim"] = 2 * config["hidden_size"] // config["num_attention_heads"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="q_proj.*outputs, not"):
        load_model(path)


def test_unsupported_rope_scaling(saved_llama, tmp_path):
    path = _copy(saved_llama, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="longrope"):
        load_model(path)
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        load_model(path)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads Linux's /proc")
def test_a_bf16_checkpoint_loads_in_bf16_without_a_float32_copy_on_the_host():
    """Peak RSS growth while loading a sharded bf16 checkpoint in bf16 (a fresh process): the
    files' mapped pages, the CPU device's copy, one stacked weight at a time and the
    allocators' slack, well under what stacking every layer in float32 first took
    (benchmarks/README.md, "Loading a bf16 checkpoint in bf16")."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from load_memory import measure, save_checkpoint

    model = save_checkpoint(hidden=512, layers=6, vocab_size=2048)
    files = list(model.glob("*.safetensors"))
    checkpoint = sum(f.stat().st_size for f in files)
    assert len(files) > 1
    got = measure(model, ROOT)
    assert got["dtypes"] == ["bfloat16"]
    assert got["peak_growth"] < 3.6 * checkpoint, got["peak_growth"] / checkpoint


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path):
    """gpt-oss as published: its experts' weights as MXFP4 blocks and scales
    (NAME_blocks, NAME_scales, quantization_config mxfp4). They load as the float32 values
    transformers' own dequantization gives, and the logits match a transformers model holding
    those values; another quantization method is refused, naming it."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kernels_pallas.kv_cache import allocate_kv_cache
    from kernels_pallas.metadata import build_metadata, token_positions
    from models.llama import forward_logits_jit
    from pagedjax.core.memory import KVCacheSpec

    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p)
            )
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                experts, inputs, outputs = p.shape
                blocks = rng.integers(0, 256, (experts, outputs, inputs // 32, 16), np.uint8)
                scales = rng.integers(121, 125, (experts, outputs, inputs // 32), np.uint8)
                p.copy_(convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                                   dtype=torch.float32))  # fmt: skip
                packed[name] = (blocks, scales)
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf_config = json.loads((tmp_path / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))

    ours, params = load_model(tmp_path)
    prompt = rng.integers(0, 64, 19).astype(np.int32)
    spec = KVCacheSpec(ours.num_layers, ours.num_kv_heads, ours.head_dim, np.float32)
    logits, _ = forward_logits_jit(
        params, ours, prompt, token_positions([19], [19], 19), allocate_kv_cache(spec, 4, 8),
        build_metadata([19], [19], [[1, 2, 3]], 8), np.arange(19, dtype=np.int32),
    )  # fmt: skip
    with torch.no_grad():
        want = model(torch.tensor([prompt.tolist()])).logits[0].numpy()
    assert np.max(np.abs(np.asarray(logits) - want)) < 1e-4
    hf_config["quantization_config"] = {"quant_method": "gptq"}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ModelLoadError, match="quantized as 'gptq'"):
        load_model(tmp_path)
