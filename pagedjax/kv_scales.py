"""fp8 KV scales: given by the user (`kv_cache_scales`) or calibrated (`calculate_kv_scales`).

An fp8 pool stores value / scale per layer and KV head (`kernels_pallas/kv_cache.py`), and a
write saturates at the format's largest value (448 for e4m3fn) times the scale. Scales of 1,
the default, fit K/V within that range; a model whose K or V reach past it needs larger ones.

`kv_cache_scales` is a number (every layer and head) or the path of a JSON file

    {"k_scale": S, "v_scale": S}

where each S is a number, a list of num_kv_heads numbers (the same for every layer) or a
list of num_layers such lists. Calibration runs the model's forward over a few fixed texts
into a temporary pool in the model's dtype, takes each layer's and head's largest |K| and |V|
over the written slots, and sets scale = absmax / the format's max, as vLLM's calibration does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.kv_cache import allocate_kv_cache
from kernels_pallas.metadata import build_metadata
from models.config import ModelConfig
from models.llama import AttentionFn, Params, forward_logits_jit
from pagedjax.core.memory import KVCacheSpec

# Floor of a calibrated scale, so a head that wrote only zeros still divides by a positive one.
MIN_SCALE = 1e-6

# Calibration texts: prose, dialogue, code and numbers, so the K/V of several kinds of tokens
# are seen; each is one sequence of the calibration forward.
CALIBRATION_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Books "
    "that had taken scribes months to copy could now be produced in days, and within fifty "
    "years presses were running in more than two hundred European cities. Literacy spread, "
    "scientific results were shared faster, and the Reformation owed much of its reach to "
    "cheap pamphlets.",
    "User: Can you explain why the sky is blue?\nAssistant: Sunlight contains every colour. "
    "As it passes through the atmosphere, the short blue wavelengths are scattered by the "
    "nitrogen and oxygen molecules far more than the long red ones (Rayleigh scattering), so "
    "blue light reaches your eyes from every direction of the sky.\nUser: And sunsets?",
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):"
    "\n        out.append(a)\n        a, b = b, a + b\n    return out\n\n"
    "print(fibonacci(12))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89]\n"
    "Total: 3,141.59 EUR on 2024-03-14; order #A-7781; 42% off; x = -0.0071, y = 1e6.",
)


def _check(value: object, name: str) -> np.ndarray:
    """`value` as float32 with at most 2 dimensions; ValueError unless every entry is a
    positive, finite number."""
    try:
        scales = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a number or a (nested) list of numbers: {e}") from e
    if isinstance(value, bool) or scales.dtype == np.bool_ or scales.ndim > 2:
        raise ValueError(f"{name} must be a number, [num_kv_heads] or [num_layers, num_kv_heads]")
    if scales.size == 0 or not np.all(np.isfinite(scales) & (scales > 0)):
        raise ValueError(f"{name} must be positive and finite, got {np.asarray(value).tolist()}")
    return scales


def read_kv_scales(source: float | str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """The (k, v) scales a `kv_cache_scales` value names, checked but not yet broadcast to a
    model; ValueError on a bad value, file or scale."""
    if isinstance(source, (int, float)) and not isinstance(source, bool):
        scale = _check(float(source), "kv_cache_scales")
        return scale, scale.copy()
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"kv_cache_scales must be a number or a JSON file's path, got {source!r}")
    try:
        with open(source) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"kv_cache_scales: cannot read {str(source)!r}: {e}") from e
    if not isinstance(data, dict) or not {"k_scale", "v_scale"} <= set(data):
        raise ValueError(
            f'kv_cache_scales file {str(source)!r} must hold {{"k_scale": ..., "v_scale": ...}}'
        )
    return _check(data["k_scale"], "k_scale"), _check(data["v_scale"], "v_scale")


def broadcast_scales(
    scales: np.ndarray, num_layers: int, num_kv_heads: int, name: str = "scale"
) -> np.ndarray:
    """A scalar, [num_kv_heads] or [num_layers, num_kv_heads] scale as [num_layers,
    num_kv_heads] float32; ValueError on any other shape."""
    scales = np.asarray(scales, np.float32)
    shape = (num_layers, num_kv_heads)
    if scales.shape not in ((), (num_kv_heads,), shape):
        raise ValueError(
            f"{name} has shape {list(scales.shape)}; this model needs a number, "
            f"[{num_kv_heads}] (num_kv_heads) or [{num_layers}, {num_kv_heads}] "
            "(num_layers, num_kv_heads)"
        )
    return np.broadcast_to(scales, shape).copy()


def load_kv_scales(
    source: float | str | os.PathLike, num_layers: int, num_kv_heads: int
) -> tuple[np.ndarray, np.ndarray]:
    """The [num_layers, num_kv_heads] (k, v) scales of a number or a JSON file (see above)."""
    k_scale, v_scale = read_kv_scales(source)
    return (
        broadcast_scales(k_scale, num_layers, num_kv_heads, "k_scale"),
        broadcast_scales(v_scale, num_layers, num_kv_heads, "v_scale"),
    )


def scales_from_absmax(absmax: np.ndarray, dtype: jax.typing.DTypeLike) -> np.ndarray:
    """Scales that map each |K| or |V| maximum onto the largest finite value of `dtype`."""
    fp8_max = float(jnp.finfo(dtype).max)
    return np.maximum(np.asarray(absmax, np.float32) / fp8_max, MIN_SCALE).astype(np.float32)


def calibration_prompts(
    tokenizer, max_num_tokens: int, max_prompt_len: int, texts: Sequence[str] | None = None
) -> list[list[int]]:
    """The token ids of `texts` (None: CALIBRATION_TEXTS), each cut to `max_prompt_len`, as
    many as fit in `max_num_tokens` (the first one at least, cut to fit)."""
    prompts, total = [], 0
    for text in CALIBRATION_TEXTS if texts is None else texts:
        ids = list(tokenizer.encode(text))[: min(max_prompt_len, max_num_tokens - total)]
        if not ids:
            break
        prompts.append(ids)
        total += len(ids)
    return prompts


def kv_absmax(
    params: Params,
    model_config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    attention_fn: AttentionFn,
    dtype: jax.typing.DTypeLike,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The largest |K| and |V| ([num_layers, num_kv_heads] each) the prompts' prefill writes,
    from one forward over all of them into a temporary `dtype` pool."""
    if not prompts or not all(prompts):
        raise ValueError("calibration needs at least one non-empty prompt")
    lens = [len(p) for p in prompts]
    tables, next_block = [], 1  # block 0 is the null block
    for n in lens:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    spec = KVCacheSpec(
        model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype
    )
    cache = allocate_kv_cache(spec, next_block, block_size)
    metadata = build_metadata(lens, lens, tables, block_size)
    token_ids = jnp.asarray([t for p in prompts for t in p], jnp.int32)
    positions = jnp.asarray([i for n in lens for i in range(n)], jnp.int32)
    rows = jnp.zeros(1, jnp.int32)  # logits are not needed; one row is the least to ask for
    _, cache = forward_logits_jit(
        params, model_config, token_ids, positions, cache, metadata, rows, attention_fn
    )
    # Unwritten slots hold zeros, which never raise a maximum of absolute values.
    k, v = (
        np.asarray(jnp.max(jnp.abs(a.astype(jnp.float32)), axis=(2, 3, 4)))
        for a in (cache.k, cache.v)
    )
    return k, v


def calibrate_kv_scales(
    params: Params,
    model_config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    attention_fn: AttentionFn,
    kv_dtype: jax.typing.DTypeLike,
    compute_dtype: jax.typing.DTypeLike,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """[num_layers, num_kv_heads] k and v scales for a `kv_dtype` pool, from the K/V the
    prompts' prefill writes (in `compute_dtype`); ValueError if those are not finite."""
    k_max, v_max = kv_absmax(params, model_config, prompts, attention_fn, compute_dtype, block_size)
    if not (np.all(np.isfinite(k_max)) and np.all(np.isfinite(v_max))):
        raise ValueError("calibration: the model wrote non-finite K/V; give kv_cache_scales")
    return scales_from_absmax(k_max, kv_dtype), scales_from_absmax(v_max, kv_dtype)


def describe(k_scale: np.ndarray, v_scale: np.ndarray) -> str:
    """One line for the log: the scales' ranges."""
    return (
        f"k_scale {float(np.min(k_scale)):.4g}..{float(np.max(k_scale)):.4g}, "
        f"v_scale {float(np.min(v_scale)):.4g}..{float(np.max(v_scale)):.4g} "
        f"over {k_scale.size} (layer, KV head) pairs"
    )
