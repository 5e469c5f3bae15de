"""The Pallas attention kernels against the pure-jnp oracle, their backend object, and their
CUDA lowering.

On CPU the kernels run in Pallas interpret mode (slow: pools are tiny). With
PAGEDJAX_PALLAS_INTERPRET=0 (and JAX_PLATFORMS=cuda) on a GPU the same tests run compiled.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    MIXED,
    RAGGED_CASES,
    assert_matches,
    expected,
    make_case,
    quantize_fp8,
    ragged_case,
)

from kernels_pallas.backend import AttentionBackend, AttentionSpec
from kernels_pallas.decode_attention import (
    DecodeConfig,
    choose_num_splits,
)
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata, build_metadata
from kernels_pallas.paged_attention import (
    PALLAS,
    paged_attention,
    resolve_interpret,
)
from kernels_pallas.pallas_common import fp8_to_float32
from kernels_pallas.ragged_paged_attention import RaggedConfig
from models.config import ModelConfig
from models.llama import forward_logits_jit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from triton_compile import (  # noqa: E402  (a developer tool)
    cuda_target,
    lower_for_cuda,
    triton_call_targets,
    triton_ir_text,
    triton_kernels,
)

INTERPRET = resolve_interpret()


@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim,kv_dtype,window,soft_cap,layer",
    [c[1:] for c in RAGGED_CASES],
    ids=[c[0] for c in RAGGED_CASES],
)
def test_ragged_kernel_matches_reference(
    block_size, num_kv_heads, group, head_dim, kv_dtype, window, soft_cap, layer
):
    q, cache, metadata, kwargs = ragged_case(
        block_size, num_kv_heads, group, head_dim, kv_dtype, window, soft_cap, layer
    )
    # With a window, small tiles and query blocks make the kernel skip tiles left of the
    # window and split chunks over several query blocks; num_stages 3 loads each tile's page
    # ids one iteration ahead (fold_kv_tiles).
    config = RaggedConfig(16, 16, num_stages=3) if window else RaggedConfig()
    out = paged_attention(
        q,
        cache,
        jnp.int32(layer),
        metadata,
        interpret=INTERPRET,
        decode_only=False,
        ragged_config=config,
        **kwargs,
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, expected(q, cache, layer, metadata, **kwargs), metadata, kv_dtype)


def test_ragged_kernel_random_mixes_in_one_bucket():
    """Random ragged steps in one fixed bucket (one compile): prefill, chunked prefill, decode,
    sequences of every length from 1 token up to many pages."""
    rng = np.random.default_rng(1)
    for seed in range(4):
        num_seqs = int(rng.integers(1, 6))
        seqs = []
        budget = 32
        for _ in range(num_seqs):
            q_len = int(rng.integers(1, max(2, budget // 2)))
            if budget - q_len < 0:
                break
            budget -= q_len
            seqs.append((q_len, q_len + int(rng.integers(0, 60))))
        q, cache, metadata = make_case(
            seed,
            seqs,
            block_size=8,
            num_kv_heads=2,
            group=2,
            head_dim=64,
            num_tokens_padded=32,
            num_seqs_padded=6,
            max_blocks_per_seq=10,
            spare_blocks=60 - sum(-(-c // 8) for _, c in seqs),
        )
        out = paged_attention(
            q, cache, 1, metadata, scale=0.125, interpret=INTERPRET, decode_only=False
        )
        assert_matches(out, expected(q, cache, 1, metadata, scale=0.125), metadata, jnp.float32)


DECODE_SEQS = [(1, 200), (1, 1), (1, 37), (1, 129), (1, 64)]


@pytest.mark.parametrize("decode_only,software_fp8", [(False, False), (False, True), (True, True)])
def test_fp8_pool_with_per_head_scales(decode_only, software_fp8):
    """Both kernels on an fp8 pool; software_fp8 is the integer upcast GPUs before sm_89 run."""
    seqs = DECODE_SEQS if decode_only else MIXED
    q, cache, metadata = make_case(
        2, seqs, block_size=16, num_kv_heads=2, group=2, head_dim=64, max_blocks_per_seq=13
    )
    k_scale, v_scale = jnp.array([0.5, 2.0]), jnp.array([1.5, 0.25])
    fp8 = quantize_fp8(cache, k_scale, v_scale)
    q = q.astype(jnp.bfloat16)
    out = paged_attention(
        q,
        fp8,
        1,
        metadata,
        scale=0.125,
        k_scale=k_scale,
        v_scale=v_scale,
        interpret=INTERPRET,
        decode_only=decode_only,
        software_fp8=software_fp8,
    )
    want = expected(q, fp8, 1, metadata, scale=0.125, k_scale=k_scale, v_scale=v_scale)
    assert_matches(out, want, metadata, jnp.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_software_fp8_upcast_is_exact_for_every_value(dtype):
    values = jnp.arange(256, dtype=jnp.uint8).view(dtype)
    got = np.asarray(fp8_to_float32(values))
    want = np.asarray(values.astype(jnp.float32))
    np.testing.assert_array_equal(got, want)  # NaNs compare equal here
    # -0.0 stays -0.0; a NaN's sign is not compared (XLA:GPU's own conversion drops it).
    numbers = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got)[numbers], np.signbit(want)[numbers])


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_k_matches_reference(num_splits):
    q, cache, metadata = make_case(
        3,
        DECODE_SEQS,
        block_size=16,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        num_seqs_padded=6,  # a padding sequence
        num_tokens_padded=6,  # and its padding token
        max_blocks_per_seq=13,
    )
    kwargs = dict(scale=0.125, sliding_window=jnp.int32(50) if num_splits == 3 else None)
    out = paged_attention(
        q,
        cache,
        1,
        metadata,
        interpret=INTERPRET,
        decode_only=True,
        # num_stages 3: page ids loaded one tile ahead, clamped in splits past a sequence's end.
        decode_config=DecodeConfig(
            num_splits=num_splits, kv_tile_tokens=16, num_stages=2 if num_splits == 1 else 3
        ),
        **kwargs,
    )
    assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


# Two decode rows long enough to split (min_tokens_per_split 32: 64 positions and up), one
# short decode row, prefill chunks, a padding sequence and padding tokens.
LONG_MIXED = [(7, 7), (1, 300), (20, 45), (1, 40), (1, 200), (3, 70)]


@pytest.mark.parametrize("long_rows,window", [(8, None), (1, 50)])
def test_a_mixed_steps_long_decode_rows_run_split_k(long_rows, window):
    """The first `mixed_long_rows` long decode rows of a mixed step run split-K (the rest, and
    every other row, the ragged kernel): every token still matches the oracle."""
    q, cache, metadata = make_case(
        6,
        LONG_MIXED,
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        num_tokens_padded=40,
        num_seqs_padded=8,
        max_blocks_per_seq=20,
    )
    kwargs = dict(scale=0.125, sliding_window=None if window is None else jnp.int32(window))
    config = DecodeConfig(kv_tile_tokens=16, min_tokens_per_split=32, mixed_long_rows=long_rows)
    out = paged_attention(
        q, cache, 1, metadata, interpret=INTERPRET, decode_only=False, decode_config=config,
        **kwargs,
    )  # fmt: skip
    assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
def test_invariant_mode_gives_a_token_the_same_bits_in_any_batch(kv_dtype):
    """invariant=True: sequence A's token at position 599 (its query fixed) computed as a
    decode row alone (which split-K would cut in two), as a decode row among chunks and other
    decodes (another bucket), and as the last token of a 40-token chunk: the same bits."""
    _, cache, _ = make_case(7, [(1, 600), (1, 80), (30, 60)], block_size=16, num_kv_heads=2,
                            group=2, head_dim=64, kv_dtype=kv_dtype)  # fmt: skip
    rng = np.random.default_rng(8)
    tables = [list(range(1, 39)), list(range(39, 44)), list(range(44, 48))]  # A, B, C
    q_dtype = jnp.float32 if kv_dtype == jnp.float32 else jnp.bfloat16

    def token_of_a(seqs, a_index, padded_tokens, padded_seqs):
        """A's last token's output in a step of `seqs` ((q_len, context, table) each)."""
        metadata = build_metadata(
            [q for q, _, _ in seqs], [c for _, c, _ in seqs], [t for _, _, t in seqs], 16,
            num_tokens_padded=padded_tokens, num_seqs_padded=padded_seqs, max_blocks_per_seq=40,
        )  # fmt: skip
        metadata = jax.tree.map(jnp.asarray, metadata)
        q = rng.normal(size=(padded_tokens, 4, 64)).astype(np.float32)
        last = int(metadata.query_start_loc[a_index + 1]) - 1
        q[last] = a_query
        out = paged_attention(jnp.asarray(q, q_dtype), cache, 1, metadata, scale=0.125,
                              interpret=INTERPRET, decode_only=True, invariant=True)  # fmt: skip
        return np.asarray(out[last].astype(jnp.float32))

    a_query = rng.normal(size=(4, 64)).astype(np.float32)
    alone = token_of_a([(1, 600, tables[0])], 0, 2, 2)
    among = token_of_a([(5, 60, tables[2]), (1, 600, tables[0]), (1, 80, tables[1])], 1, 16, 4)
    chunk = token_of_a([(1, 80, tables[1]), (40, 600, tables[0])], 1, 64, 4)
    np.testing.assert_array_equal(alone, among)
    np.testing.assert_array_equal(alone, chunk)


def test_decode_split_k_bf16_gqa8_soft_cap():
    q, cache, metadata = make_case(
        4,
        DECODE_SEQS,
        block_size=32,
        num_kv_heads=1,
        group=8,
        head_dim=128,
        kv_dtype=jnp.bfloat16,
        max_blocks_per_seq=7,
    )
    kwargs = dict(scale=128**-0.5, soft_cap=4.0)
    out = paged_attention(q, cache, 0, metadata, interpret=INTERPRET, decode_only=True, **kwargs)
    assert_matches(out, expected(q, cache, 0, metadata, **kwargs), metadata, jnp.bfloat16)


def test_dispatch_on_square_buckets_picks_the_right_kernel():
    """decode_only=None on a T == S bucket: a decode-only step and a step with a chunk (which
    the decode kernel would get wrong) both match the oracle."""
    for seqs in ([(1, 30), (1, 5), (1, 17), (0, 0)], [(3, 30), (1, 5), (0, 0), (0, 0)]):
        real = [s for s in seqs if s[0]]
        q, cache, metadata = make_case(
            5,
            real,
            block_size=8,
            num_kv_heads=1,
            group=2,
            head_dim=64,
            num_tokens_padded=4,
            num_seqs_padded=4,
            max_blocks_per_seq=4,
        )
        out = paged_attention(q, cache, 1, metadata, scale=0.125, interpret=INTERPRET)
        assert_matches(out, expected(q, cache, 1, metadata, scale=0.125), metadata, jnp.float32)


def test_drop_in_for_attention_fn_inside_a_layer_scan():
    """The model's call: traced layer index and per-layer traced window inside lax.scan."""
    q, cache, metadata = make_case(
        6, MIXED[:4], block_size=16, num_kv_heads=1, group=2, head_dim=64, num_layers=2
    )
    windows = jnp.array([0, 9], jnp.int32)
    attention_fn = functools.partial(paged_attention, interpret=INTERPRET)

    @jax.jit
    def run(q, cache, metadata):
        def step(carry, per_layer):
            layer, window = per_layer
            out = attention_fn(q, cache, layer, metadata, scale=0.125, sliding_window=window)
            return carry, out

        return jax.lax.scan(step, 0, (jnp.arange(2, dtype=jnp.int32), windows))[1]

    outs = run(q, cache, metadata)
    for layer in range(2):
        want = expected(q, cache, layer, metadata, scale=0.125, sliding_window=windows[layer])
        assert_matches(outs[layer], want, metadata, jnp.float32)


def test_split_count_follows_batch_against_sms():
    # 132 SMs, 8 KV heads: fill ~2 waves, never below 256 positions per split.
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 33
    assert choose_num_splits(16, 8, 4096, num_sms=132) == 3
    assert choose_num_splits(64, 8, 2048, num_sms=132) == 1
    assert choose_num_splits(256, 8, 1024, num_sms=132) == 1
    assert choose_num_splits(1, 8, 512, num_sms=132) == 2  # short context caps the split
    assert choose_num_splits(1, 8, 32768, num_sms=108) == 27  # fewer SMs, fewer splits


# --- the backend object ----------------------------------------------------------------------


def test_backend_is_a_hashable_attention_backend():
    assert isinstance(PALLAS, AttentionBackend)
    assert PALLAS.name == "pallas" and PALLAS.cost_follows_context is False
    assert hash(PALLAS) == hash(PALLAS)
    assert jax.jit(lambda x, backend: x, static_argnums=1)(1, PALLAS) == 1  # a static argument


@pytest.mark.parametrize(
    "spec,reason",
    [
        (AttentionSpec(8, 2, 64, "bfloat16", 16), None),
        (AttentionSpec(4, 4, 16, "float32", 8), None),
        (AttentionSpec(8, 2, 256, "float8_e4m3fn", 32), None),
        (AttentionSpec(8, 3, 64, "float32", 16), "multiple"),
        (AttentionSpec(8, 2, 64, "float32", 12), "block_size 12"),
        (AttentionSpec(8, 2, 96, "float32", 16), "head_dim 96"),
        (AttentionSpec(8, 2, 512, "float32", 16), "head_dim 512"),
        (AttentionSpec(8, 2, 64, "int8", 16), "int8"),
    ],
)
def test_backend_supports(spec, reason):
    got = PALLAS.supports(spec)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


def test_backend_call_matches_reference():
    q, cache, metadata = make_case(
        8, [(3, 20), (1, 9)], block_size=8, num_kv_heads=1, group=2, head_dim=64
    )
    kwargs = dict(scale=0.125, sliding_window=jnp.int32(6), soft_cap=20.0)
    out = PALLAS(q, cache, jnp.int32(1), metadata, **kwargs)
    assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


@pytest.mark.parametrize("path", ["decode", "mixed"])
def test_attention_sinks_match_the_reference(path):
    """gpt-oss's sinks, a logit per query head in every softmax: the ragged kernel adds each
    row's exp(sink - max) to its sum, split-K merges the sink as one more split; the mixed
    route (prefill rows in the ragged kernel, a long decode row split) runs both. Sinks of
    either sign, some far above the scores, so a head's output shrinks visibly; padding rows
    stay 0."""
    seqs = {"decode": [(1, c) for c in (1, 40, 300, 9)],
            "mixed": [(5, 9), (1, 600), (3, 30), (1, 7)]}[path]  # fmt: skip
    q, cache, metadata = make_case(
        4, seqs, block_size=8, num_kv_heads=2, group=3, head_dim=32,
        num_tokens_padded=sum(n for n, _ in seqs) + 3, num_seqs_padded=len(seqs) + 1,
        max_blocks_per_seq=80,
    )  # fmt: skip
    sinks = jnp.asarray([-2.0, 0.5, 3.0, 8.0, -30.0, 1.0], jnp.float32)
    kwargs = dict(scale=32**-0.5, sliding_window=jnp.int32(200), sinks=sinks)
    config = DecodeConfig(min_tokens_per_split=64)  # the 600-token row splits in "mixed"
    out = paged_attention(q, cache, jnp.int32(1), metadata, interpret=INTERPRET,
                          decode_only=path == "decode" or None, decode_config=config,
                          **kwargs)  # fmt: skip
    want = expected(q, cache, 1, metadata, **kwargs)
    assert_matches(out, want, metadata, jnp.float32)
    plain = expected(q, cache, 1, metadata, scale=32**-0.5, sliding_window=jnp.int32(200))
    assert not np.allclose(want, plain, atol=1e-3)  # the sinks matter here


# --- CUDA lowering on a CPU-only host ------------------------------------------------------


LOWERING_CASES = [
    # id, kernel, block_size, kv heads, group, head_dim, kv dtype, window, soft cap
    ("ragged-bf16-d128-gqa4-window", "ragged", 16, 8, 4, 128, jnp.bfloat16, True, None),
    ("ragged-f32-d64-mha-bs8", "ragged", 8, 4, 1, 64, jnp.float32, False, None),
    ("ragged-fp8-d256-gqa8-softcap", "ragged", 32, 2, 8, 256, jnp.float8_e4m3fn, False, 30.0),
    ("ragged-f16-d128-gqa3", "ragged", 16, 2, 3, 128, jnp.float16, True, None),
    ("decode-bf16-d128-gqa4-window", "decode", 16, 8, 4, 128, jnp.bfloat16, True, None),
    ("decode-f32-d64-mha-bs8", "decode", 8, 4, 1, 64, jnp.float32, False, 50.0),
    ("decode-fp8-d256-gqa8", "decode", 32, 2, 8, 256, jnp.float8_e4m3fn, False, None),
]


@pytest.mark.parametrize(
    "kernel,block_size,num_kv_heads,group,head_dim,kv_dtype,use_window,soft_cap",
    [c[1:] for c in LOWERING_CASES],
    ids=[c[0] for c in LOWERING_CASES],
)
def test_kernel_lowers_for_cuda(
    kernel, block_size, num_kv_heads, group, head_dim, kv_dtype, use_window, soft_cap
):
    """Traces for a CUDA target without a GPU: runs the Pallas -> Triton IR lowering (every
    primitive must have a Triton rule, every shape must be a power of two) and verifies the
    Triton module (tests/test_triton_compile.py compiles it on to cubins)."""
    lowered = lower_for_cuda(
        kernel,
        kv_dtype=kv_dtype,
        head_dim=head_dim,
        group=group,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        use_window=use_window,
        soft_cap=soft_cap,
    )
    targets = triton_call_targets(lowered)
    assert len(targets) == 1, targets  # one Triton kernel, no Mosaic GPU, no fallback
    for kernel_ir in triton_kernels(lowered):  # Triton IR embedded: the two dots are tt.dot
        assert triton_ir_text(kernel_ir).count("tt.dot") == 2


def test_kernels_with_sinks_lower_for_cuda():
    """The ragged and split-K kernels with sinks (bf16 pool, a mixed step's route to both)."""
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    pool = jax.ShapeDtypeStruct((2, 8, 512, 16, 64), jnp.bfloat16)
    metadata = AttentionMetadata(i32((256,)), i32((64, 128)), i32((64,)), i32((65,)),
                                 i32(()), i32(()))  # fmt: skip
    attention = functools.partial(
        paged_attention, scale=0.125, sliding_window=None, interpret=False
    )
    with cuda_target(90):
        lowered = jax.jit(attention).trace(
            jax.ShapeDtypeStruct((256, 64, 64), jnp.bfloat16), KVCache(pool, pool),
            i32(()), metadata, sinks=f32((64,)),
        ).lower(lowering_platforms=("cuda",))  # fmt: skip
    assert len(triton_call_targets(lowered)) == 2  # ragged, and split-K for long rows
    for kernel_ir in triton_kernels(lowered):
        triton_ir_text(kernel_ir)


# The default model's shapes (SmolLM2-135M: head_dim 64, 9 query heads on 3 KV heads), the
# GPU block size and the default max_model_len's block-table width.
SMOLLM2 = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def smollm2_pool(kv_dtype) -> jax.ShapeDtypeStruct:
    """One of K and V of a pool of SMOLLM2's shapes: 4,096 pages of 16."""
    c = SMOLLM2
    return jax.ShapeDtypeStruct((c.num_layers, c.num_kv_heads, 4096, 16, c.head_dim), kv_dtype)


def lower_smollm2_step(num_tokens: int, num_seqs: int, kv_dtype, attention):
    """The GPU step of SMOLLM2's shapes (4,096 pages of 16, a 2,048-token table width) with
    `attention`, lowered for an sm_90 GPU."""
    c, width = SMOLLM2, 2048 // 16
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    L, H, I = c.num_layers, c.hidden_size, c.intermediate_size  # noqa: E741
    params = {
        "embed": f32((c.vocab_size, H)),
        "final_norm": f32((H,)),
        "layers": {
            "attn_norm": f32((L, H)),
            "mlp_norm": f32((L, H)),
            "wqkv": f32((L, H, c.q_size + 2 * c.kv_size)),
            "wo": f32((L, c.q_size, H)),
            "w_gate_up": f32((L, H, 2 * I)),
            "w_down": f32((L, I, H)),
        },
    }
    pool = smollm2_pool(kv_dtype)
    metadata = AttentionMetadata(
        slot_mapping=i32((num_tokens,)),
        block_tables=i32((num_seqs, width)),
        seq_lens=i32((num_seqs,)),
        query_start_loc=i32((num_seqs + 1,)),
        num_seqs=i32(()),
        num_tokens=i32(()),
    )
    tokens = i32((num_tokens,))
    with cuda_target(90):
        traced = forward_logits_jit.trace(
            params, c, tokens, tokens, KVCache(pool, pool), metadata, i32((num_seqs,)), attention
        )
        return traced.lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(
    "num_tokens,num_seqs,kv_dtype,kernels",
    [(1, 1, jnp.float32, 3), (128, 128, jnp.bfloat16, 3), (512, 128, jnp.float32, 2)],
    ids=["decode-bucket", "square-bucket-bf16-pool", "mixed-bucket"],
)
def test_engine_forward_with_the_kernels_lowers_for_cuda(num_tokens, num_seqs, kv_dtype, kernels):
    """The whole GPU step, as the runner traces it on a GPU (float32 stacked weights, the
    Pallas kernels inside the layer scan, a traced layer index), lowers for CUDA. A mixed step
    at this table width (2,048 tokens) runs the ragged kernel and the split-K kernel for its
    long decode rows; buckets with as many tokens as sequences hold those and the decode-only
    split-K kernel behind the decode-only dispatch."""
    attention = functools.partial(paged_attention, interpret=False)
    lowered = lower_smollm2_step(num_tokens, num_seqs, kv_dtype, attention)
    pool = smollm2_pool(kv_dtype)
    targets = triton_call_targets(lowered)
    assert len(targets) == kernels, targets
    # The pool is donated: both its arrays alias outputs, so the GPU step writes in place.
    element = {jnp.float32: "f32", jnp.bfloat16: "bf16"}[kv_dtype]
    pool_type = "x".join(map(str, pool.shape)) + "x" + element
    aliased = re.findall(r"tensor<([0-9a-z]+)> \{tf\.aliasing_output", lowered.as_text())
    assert aliased == [pool_type, pool_type], aliased
    for kernel_ir in triton_kernels(lowered):
        triton_ir_text(kernel_ir)  # parses and verifies
