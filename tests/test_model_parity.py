"""Our model against transformers, float32 on the CPU: full prompts and paged incremental runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernels_pallas.kv_cache import allocate_kv_cache
from kernels_pallas.metadata import build_metadata, token_positions
from kernels_pallas.reference import ragged_paged_attention
from kernels_pallas.xla_attention import ragged_paged_attention_xla
from models.llama import forward_logits_jit
from models.loader import load_model
from pagedjax.core.memory import KVCacheSpec
from pagedjax.cpu_native.attention import CPU_NATIVE
from pagedjax.cpu_native.matmul import pack_params
from tests.conftest import TINY_MODELS

TOLERANCE = 1e-4


def kv_spec(config, dtype=jnp.float32) -> KVCacheSpec:
    return KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, dtype)


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_full_prompt_logits_match_transformers(name, tiny_model_dir):
    path, hf_model = tiny_model_dir(name)
    config, params = load_model(path)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, config.vocab_size, 23).tolist()
    block_size = 8
    table = [3, 1, 4]  # deliberately out of order
    cache = allocate_kv_cache(kv_spec(config), 6, block_size)
    meta = build_metadata([len(prompt)], [len(prompt)], [table], block_size)
    logits, _ = forward_logits_jit(
        params,
        config,
        np.asarray(prompt, np.int32),
        token_positions([len(prompt)], [len(prompt)], len(prompt)),
        cache,
        meta,
        np.arange(len(prompt), dtype=np.int32),
    )
    expected = hf_logits(hf_model, prompt)
    error = float(np.max(np.abs(np.asarray(logits) - expected)))
    print(f"{name}: max abs logit error {error:.2e}")
    assert error < TOLERANCE


# The XLA attention with tiny tiles, so steps span several decode tiles, query tiles and key
# chunks; with it, the matmul weights split per layer as the CPU runner holds them.
SMALL_TILES = functools.partial(
    ragged_paged_attention_xla, decode_tile=2, query_tile=4, key_chunk=8
)


ATTENTIONS = ("reference", "xla", "cpu_native")
# Mixtures of experts on the CPU's whole path only: their experts run the same way whatever
# the attention (and each compile of theirs costs seconds). gpt-oss's sinks run on XLA's.
RAGGED_CASES = [
    (name, attention)
    for name in ("llama", "mistral_window", "qwen2", "qwen3", "gemma2", "gemma3")
    for attention in ATTENTIONS
] + [("qwen2_moe", "cpu_native"), ("mixtral", "cpu_native"), ("gpt_oss", "xla")]


@pytest.mark.parametrize("name,attention", RAGGED_CASES)
def test_ragged_chunked_prefill_then_decode_matches_transformers(name, attention, tiny_model_dir):
    """Three sequences share each step: prefill in uneven chunks, then decode one token at a time,
    through shuffled block tables, with padding tokens and a padding sequence in every step.
    Every step has one padded shape, as the engine's buckets do: one compilation per case."""
    path, hf_model = tiny_model_dir(name)
    config, params = load_model(path)
    attention_fn = {"reference": ragged_paged_attention, "xla": SMALL_TILES}.get(
        attention, CPU_NATIVE
    )
    if attention == "cpu_native":  # the CPU platform's whole path: packed weights too
        params = pack_params(params)
    rng = np.random.default_rng(2)
    lengths = [19, 6, 26]
    seqs = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    expected = [hf_logits(hf_model, s) for s in seqs]

    block_size, num_blocks = 4, 32
    free = rng.permutation(np.arange(1, num_blocks)).tolist()  # block 0 is the null block
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    cache = allocate_kv_cache(kv_spec(config), num_blocks, block_size)
    prompt_chunks = {0: [5, 9, 2], 1: [6], 2: [1, 11, 7]}  # prompts: the first 16, 6, 19 tokens
    done = [0, 0, 0]
    t_pad, s_pad = 24, 4  # at least 3 padding tokens (the largest step has 21) and a sequence
    step = 0
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        live = [s for s in range(3) if done[s] < lengths[s]]
        q_lens = [prompt_chunks[s][step] if step < len(prompt_chunks[s]) else 1 for s in live]
        seq_lens = [done[s] + q for s, q in zip(live, q_lens, strict=True)]
        num_tokens = sum(q_lens)
        tokens = np.zeros(t_pad, np.int32)
        tokens[:num_tokens] = np.concatenate(
            [seqs[s][done[s] : L] for s, L in zip(live, seq_lens, strict=True)]
        )
        meta = build_metadata(
            q_lens,
            seq_lens,
            [tables[s] for s in live],
            block_size,
            num_tokens_padded=t_pad,
            num_seqs_padded=s_pad,
            max_blocks_per_seq=8,
        )
        positions = token_positions(q_lens, seq_lens, t_pad)
        logits, cache = forward_logits_jit(
            params,
            config,
            tokens,
            positions,
            cache,
            meta,
            np.arange(t_pad, dtype=np.int32),  # the real rows come first
            attention_fn,
        )
        logits = np.asarray(logits)
        row = 0
        for s, q, L in zip(live, q_lens, seq_lens, strict=True):
            error = np.max(np.abs(logits[row : row + q] - expected[s][L - q : L]))
            assert error < TOLERANCE, f"step {step}, sequence {s}: error {error:.2e}"
            row += q
            done[s] = L
        step += 1
    assert step == 10  # the longest sequence: 3 prefill chunks, then 7 decode steps


@pytest.mark.parametrize(
    "kv_dtype, tolerance", [(jnp.bfloat16, 0.05), (jnp.float16, 0.01), (jnp.float8_e4m3fn, 0.3)]
)
def test_low_precision_kv_pools_stay_close_to_float32(tiny_model_dir, kv_dtype, tolerance):
    """The same paged forward with a bf16 / fp16 / fp8 pool: logits near the float32 pool's."""
    path, _ = tiny_model_dir("llama")
    config, params = load_model(path)
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, 30).astype(np.int32)
    meta = build_metadata([30], [30], [[2, 5, 1, 4]], 8)
    positions = token_positions([30], [30], 30)
    rows = np.arange(30, dtype=np.int32)
    logits = {}
    for dtype in (jnp.float32, kv_dtype):
        cache = allocate_kv_cache(kv_spec(config, dtype), 6, 8)
        out, _ = forward_logits_jit(params, config, prompt, positions, cache, meta, rows)
        logits[dtype] = np.asarray(out)
    error = np.abs(logits[kv_dtype] - logits[jnp.float32]).max()
    spread = np.abs(logits[jnp.float32]).max()
    print(
        f"{jnp.dtype(kv_dtype).name} KV: max abs logit error {error:.4f} (max |logit| {spread:.1f})"
    )
    assert 0 < error < tolerance * spread


@pytest.mark.parametrize("dtype, precision", [(jnp.float32, "HIGHEST"), (jnp.bfloat16, "DEFAULT")])
def test_float32_models_ask_for_float32_matmuls_on_the_gpu(tiny_model_dir, dtype, precision):
    """JAX's default lets a GPU round float32 matmul operands to TF32 (10 mantissa bits of 23),
    far outside the 1e-4 this file allows against transformers. The forward of a float32 model,
    lowered for CUDA, asks for true float32 in every dot: layers, attention, LM head; a 16-bit
    model keeps the default."""
    path, _ = tiny_model_dir("llama")
    config, params = load_model(path)
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    cache = allocate_kv_cache(kv_spec(config), 4, 8)
    meta = build_metadata([5], [5], [[1]], 8)
    args = (params, config, np.arange(5, dtype=np.int32), token_positions([5], [5], 5), cache)
    traced = forward_logits_jit.trace(*args, meta, np.array([4], np.int32))
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    # wqkv, wo, w_gate_up, w_down, the two attention products, the LM head
    assert len(dots) >= 7
    assert all(f"precision = [{precision}, {precision}]" in line for line in dots), dots
