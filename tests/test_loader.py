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
