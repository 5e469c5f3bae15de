"""The Mosaic GPU decode kernel against the oracle (Mosaic GPU's interpret mode, which
simulates its shared memory, barriers and TMA copies on the CPU), its CUDA lowering (which
runs Mosaic GPU's layout inference, stricter than the interpreter), and its backend.

Interpret mode needs jax >= 0.11: CI runs this file in its jax 0.11 environment (`.ci/run`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import assert_matches, expected, make_case
from conftest import build_tiny_tokenizer
from safetensors.numpy import save_file

from kernels_pallas.decode_attention import DecodeConfig
from kernels_pallas.mosaic_decode_attention import (
    PALLAS_MOSAIC,
    has_interpret_mode,
    mosaic_decode_attention_kernel,
    supports_mosaic_decode,
)
from kernels_pallas.paged_attention import paged_attention, resolve_interpret
from pagedjax import LLM, SamplingParams
from pagedjax.attention import get_backend
from tests.test_pallas_kernels import lower_smollm2_step, triton_call_targets

INTERPRET = resolve_interpret()
needs_interpret = pytest.mark.skipif(
    INTERPRET and not has_interpret_mode(),
    reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode (CI's jax 0.11 runs it)",
)

# A row of one position, rows ending on and past a 64-token tile, one long enough to split,
# and (with num_seqs_padded) a padding sequence.
DECODE_SEQS = [(1, 300), (1, 1), (1, 64), (1, 65), (1, 130)]


def attend(q, cache, layer, metadata, config=None, **kwargs):
    return paged_attention(
        q, cache, layer, metadata, interpret=INTERPRET, decode_only=True,
        decode_config=config or DecodeConfig(),
        decode_kernel=mosaic_decode_attention_kernel, **kwargs,
    )  # fmt: skip


@needs_interpret
@pytest.mark.parametrize(
    "block_size,group,head_dim,kv_dtype,num_splits,stages,window,soft_cap",
    [
        (16, 3, 64, jnp.bfloat16, 1, 2, None, None),  # one split streams every tile
        (16, 4, 64, jnp.float16, 4, 3, None, None),
        (32, 1, 128, jnp.bfloat16, None, 2, 50, None),  # MHA, a sliding window
        (128, 8, 64, jnp.bfloat16, 2, 2, None, 4.0),  # a page wider than the tile's 64
    ],
)
def test_decode_matches_the_oracle(
    block_size, group, head_dim, kv_dtype, num_splits, stages, window, soft_cap
):
    q, cache, metadata = make_case(
        11, DECODE_SEQS, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim,
        kv_dtype=kv_dtype, num_seqs_padded=6, num_tokens_padded=6,
        max_blocks_per_seq=-(-300 // block_size) + 1,
    )  # fmt: skip
    kwargs = dict(
        scale=head_dim**-0.5,
        sliding_window=None if window is None else jnp.int32(window),
        soft_cap=soft_cap,
    )
    config = DecodeConfig(num_splits=num_splits, num_stages=stages, min_tokens_per_split=64)
    out = attend(q, cache, 1, metadata, config, **kwargs)
    assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, kv_dtype)


@needs_interpret
def test_sinks_and_a_mixed_steps_long_rows():
    """gpt-oss's sink logits, and a mixed step whose long decode rows take this kernel while
    the ragged kernel runs the rest."""
    q, cache, metadata = make_case(
        12, [(5, 9), (1, 300), (1, 20)], block_size=16, num_kv_heads=1, group=4, head_dim=64,
        kv_dtype=jnp.bfloat16, num_tokens_padded=8, max_blocks_per_seq=20,
    )  # fmt: skip
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    kwargs = dict(scale=0.125, sinks=sinks)
    config = DecodeConfig(min_tokens_per_split=64, mixed_long_rows=2)
    out = paged_attention(
        q, cache, 0, metadata, interpret=INTERPRET, decode_only=False, decode_config=config,
        decode_kernel=mosaic_decode_attention_kernel, **kwargs,
    )  # fmt: skip
    assert_matches(out, expected(q, cache, 0, metadata, **kwargs), metadata, jnp.bfloat16)


@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (64, 128), (128, 256)])
def test_the_kernel_lowers_for_cuda(block_size, head_dim):
    """Mosaic GPU's lowering (layout inference, the shared-memory transforms wgmma reads) on
    this CPU host: what the interpreter accepts but a GPU would refuse fails here."""
    q, cache, metadata = make_case(
        13, [(1, 40), (1, 200)], block_size=block_size, num_kv_heads=2, group=2,
        head_dim=head_dim, kv_dtype=jnp.bfloat16, max_blocks_per_seq=-(-256 // block_size),
    )  # fmt: skip

    def run(q, k, v, seq_lens, tables):
        return mosaic_decode_attention_kernel(
            q, k, v, jnp.int32(1), seq_lens, tables, jnp.int32(0), None, None,
            scale=0.125, soft_cap=30.0, use_window=True, interpret=False,
        )  # fmt: skip

    args = (q, cache.k, cache.v, metadata.seq_lens, metadata.block_tables)
    text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_the_engine_step_lowers_with_the_kernel_in_its_layer_scan():
    """SmolLM2's decode step (a bfloat16 pool, the layer index traced by the layer scan) with
    the backend's decode-only variant: Mosaic GPU kernels, no Triton one."""
    attention = functools.partial(
        paged_attention,
        interpret=False,
        decode_only=True,
        decode_kernel=mosaic_decode_attention_kernel,
    )
    lowered = lower_smollm2_step(128, 128, jnp.bfloat16, attention)
    assert not triton_call_targets(lowered)
    assert "mosaic_gpu" in lowered.as_text()


LLAMA_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
    intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, dtype="float32",
)  # fmt: skip


def write_tiny_llama(path: Path) -> None:
    """A random Llama checkpoint of head_dim 64 written with numpy (this file also runs where
    torch is not installed), with conftest's word-level tokenizer."""
    rng = np.random.default_rng(0)
    c = LLAMA_CONFIG
    hidden, inner, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_size, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden),
              "lm_head.weight": (c["vocab_size"], hidden), "model.norm.weight": None}  # fmt: skip
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": None,
            layer + "post_attention_layernorm.weight": None,
            layer + "self_attn.q_proj.weight": (q_size, hidden),
            layer + "self_attn.k_proj.weight": (kv, hidden),
            layer + "self_attn.v_proj.weight": (kv, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_size),
            layer + "mlp.gate_proj.weight": (inner, hidden),
            layer + "mlp.up_proj.weight": (inner, hidden),
            layer + "mlp.down_proj.weight": (hidden, inner),
        }
    tensors = {
        name: np.ones(hidden, np.float32)
        if shape is None
        else (0.02 * rng.standard_normal(shape)).astype(np.float32)
        for name, shape in shapes.items()
    }
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    build_tiny_tokenizer(c["vocab_size"]).save_pretrained(path)


@needs_interpret
def test_the_engine_on_a_bf16_pool_gives_the_reference_backends_tokens(tmp_path):
    """The engine with "pallas_mosaic" (its decode-only steps on this kernel, its prefills on
    the ragged one) and with "reference", on the same bfloat16 pool: the same greedy tokens."""
    write_tiny_llama(tmp_path / "llama")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (70, 9, 130)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    settings = dict(kv_cache_dtype="bfloat16", max_model_len=256, num_kv_blocks=64, max_num_seqs=4)

    flags = []

    def tokens(backend: str) -> list[list[int]]:
        llm = LLM(str(tmp_path / "llama"), attention_backend=backend, **settings)
        runner = llm.llm_engine.engine_core.worker.runner
        forward = runner._forward

        def spy(*args, decode_only=None, **kwargs):  # what each step told the backend
            flags.append(decode_only)
            return forward(*args, decode_only=decode_only, **kwargs)

        runner._forward = spy
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    mosaic = tokens("pallas_mosaic")
    assert all(mosaic) and mosaic == tokens("reference")  # (a failed step gives no tokens)
    assert True in flags and False in flags  # decode-only steps, and prefills


def test_the_backend_says_what_it_does_not_run():
    backend = get_backend("pallas_mosaic")
    assert backend is PALLAS_MOSAIC and backend.has_decode_kernel
    assert "float32" in supports_mosaic_decode(4, 2, 64, "float32", 16)
    assert "float8_e4m3fn" in supports_mosaic_decode(4, 2, 64, "float8_e4m3fn", 16)
    assert "multiple of 64" in supports_mosaic_decode(4, 2, 80, "bfloat16", 16)
    assert "rows of 8" in supports_mosaic_decode(4, 2, 64, "bfloat16", 4)
    assert "query heads" in supports_mosaic_decode(130, 2, 64, "bfloat16", 16)
    assert supports_mosaic_decode(9, 3, 64, "bfloat16", 16) is None
    with pytest.raises(ValueError, match="float32"):
        q, cache, metadata = make_case(14, [(1, 5)], block_size=16, num_kv_heads=1, group=1,
                                       head_dim=64)  # fmt: skip
        attend(q, cache, 0, metadata, scale=0.125)
