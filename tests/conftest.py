"""Shared fixtures: tiny random Hugging Face models saved to disk, the oracle for our model."""

from __future__ import annotations

import os

# Tests compare float32 numbers with transformers: keep JAX on the CPU in float32, and quiet.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_JIT_CACHE = "JAX_COMPILATION_CACHE_DIR"
_OWNED_CACHE = pytest.StashKey[str]()  # the directory this process made (and removes)
# XLA:CPU's code generation without LLVM's slowest optimizations: the tiny models' steps run
# in microseconds but compile in seconds, so compiling is most of the suite's time. Level 1
# keeps every number bit for bit (tests/test_compile_flags.py checks; level 0 does not).
_QUICK_COMPILE = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"


def pytest_configure(config: pytest.Config) -> None:
    """Quick XLA:CPU compilation, and one persistent compilation cache per run, shared by its
    workers and the subprocesses they start: test modules and processes compile many identical
    steps (the same tiny models and buckets), and each compiles them anew otherwise
    (`jax.clear_caches` below). Fresh each run, so every step still compiles once; a
    developer's own flags and cache directory win."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a worker inherits the controller's environment
    os.environ.setdefault("XLA_FLAGS", _QUICK_COMPILE)  # a developer's own flags win
    # One OpenMP thread for torch (the oracle) and numpy's BLAS: their idle threads spin while
    # they wait, taking the core that the other worker runs on.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if _JIT_CACHE in os.environ:
        return
    os.environ[_JIT_CACHE] = tempfile.mkdtemp(prefix="pagedjax-jit-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # tiny models compile fast
    config.stash[_OWNED_CACHE] = os.environ[_JIT_CACHE]


def pytest_unconfigure(config: pytest.Config) -> None:
    if (path := config.stash.get(_OWNED_CACHE, None)) is not None:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding slow tests run first: pytest-xdist hands out whole files in this order,
    so the long ones start early and short ones fill the end, no worker left idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files stay whole


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_executables():
    """Drops each module's compiled executables after it: jax's caches keep every one, XLA:CPU
    maps each into memory with three mappings, and a whole suite's passed the kernel's limit
    of mappings (vm.max_map_count), so a later compile segfaulted."""
    yield
    import jax

    jax.clear_caches()


# name -> (HF config class name, config overrides). Small but non-degenerate: several layers,
# GQA ratios 1, 2, 3 and 4, tied and untied embeddings, each architecture's own features.
TINY_MODELS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama_mha_tied": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            num_attention_heads=6,
            hidden_size=96,
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral_window": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=7),
    ),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    # Small soft caps and scalar, so the tanh and the scale matter at these logits; every
    # other layer slides over 7 keys (layer_types).
    "gemma2": (
        "Gemma2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            sliding_window=7,
        ),
    ),
    # Gemma 3: qk-norms of 1 + w, sliding layers rotating by a base of their own while the
    # full-attention layer's RoPE is linearly scaled.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            query_pre_attn_scalar=20,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
    # Mixtures of experts. Qwen3-MoE: 3 of 8 experts renormalized (norm_topk_prob), the
    # middle layer dense (mlp_only_layers); Qwen2-MoE: a sigmoid-gated shared expert, q/k/v
    # biases, the raw top-2 probabilities, experts every other layer (decoder_sparse_step);
    # Mixtral: 2 of 4 renormalized, a sliding window.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            num_hidden_layers=4,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            sliding_window=9,
        ),
    ),
    # gpt-oss: attention sinks, q/k/v/o biases, every other layer sliding over 7 keys, YaRN
    # RoPE (factor 4 over 64 original positions), a router with a bias
    # and a softmax over its top 2 of 4, experts with biases and the clamped SwiGLU (a low
    # limit, so the clamps act at these activations).
    "gpt_oss": (
        "GptOssConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            sliding_window=7,
            swiglu_limit=1.5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}

_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def build_tiny_hf_model(name: str, seed: int = 0):
    """A float32 transformers model with random weights, norms included."""
    import torch
    import transformers

    config_class, overrides = TINY_MODELS[name]
    config = getattr(transformers, config_class)(**{**_BASE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # gpt-oss's clamped SwiGLU: transformers before 5.18 (the GPU image's) fixes its limit and
    # alpha whatever the config says, so the saved config states what the modules compute.
    for module in model.modules():
        if hasattr(module, "limit") and hasattr(module, "alpha"):
            model.config.swiglu_limit, model.config.swiglu_alpha = module.limit, module.alpha
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def build_tiny_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer over tokens "w0".."w{V-1}": text "w5 w9" <-> ids [5, 9].

    Ids 1 and 2 are the special bos "<s>" and eos "</s>" tokens, as in the tiny configs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab["<s>"], vocab["</s>"] = 1, 2
    del vocab["w1"], vocab["w2"]
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="w0"
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """name -> directory holding that tiny model saved with save_pretrained (safetensors)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model = build_tiny_hf_model(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path, safe_serialization=True)
            build_tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
            cache[name] = (path, model)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """name -> (path, hf_model, model_config, params), loaded once."""
    loaded = {}

    def get(name):
        if name not in loaded:
            path, hf_model = tiny_model_dir(name)
            from models.loader import load_model  # after JAX_PLATFORMS is set above

            config, params = load_model(path)
            loaded[name] = (path, hf_model, config, params)
        return loaded[name]

    return get


def hf_from_gguf(path: Path):
    """transformers' float32 model of a GGUF file (the oracle), loaded with two of its pure
    steps done once: gguf's reader of the file (transformers builds one for the config and
    another for the weights, each parsing the whole vocabulary in Python) and gguf's tensor-name
    map (built once per tensor). The reader parses the file's bytes read into memory rather
    than mapped: it indexes them a million times, and each index of a memmap costs a subclass's
    bookkeeping. The same model, loaded with less repeated work."""
    import functools

    import gguf
    import numpy as np
    import torch
    import transformers

    read = gguf.GGUFReader
    readers: dict[str, gguf.GGUFReader] = {}

    def in_memory(path: str | os.PathLike, mode: str = "r") -> np.ndarray:
        return np.fromfile(path, dtype=np.uint8)

    def reader(file: str | os.PathLike, *args, **kwargs) -> gguf.GGUFReader:
        if args or kwargs:  # a mode (write): not ours to share
            return read(file, *args, **kwargs)
        key = os.fspath(file)
        if key not in readers:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(gguf.gguf_reader.np, "memmap", in_memory)
                readers[key] = read(key)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' float32 model of the default GGUF, loaded once for the session (the load
    dequantizes every tensor: the slowest setup of the suite)."""
    pytest.importorskip("torch")
    from models.loader import resolve_model_path

    return hf_from_gguf(resolve_model_path(None).path)
