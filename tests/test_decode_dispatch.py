"""Issue 25: the runner tells the attention backend statically whether a step is decode-only
(one compiled variant each, no per-layer `lax.cond`), and the split-K kernel splits each
sequence's actual length, not the table width, into whole-tile pieces.

The kernels run in Pallas interpret mode on the CPU; their CUDA lowering is checked from
shapes alone (benchmarks/triton_compile.py)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import assert_matches, expected, make_case

from kernels_pallas import reference as reference_module
from kernels_pallas import xla_attention
from kernels_pallas.backend import FunctionBackend
from kernels_pallas.decode_attention import (
    MIN_TOKENS_PER_SPLIT,
    DecodeConfig,
    choose_num_splits,
    merge_splits,
    split_tiles,
)
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.paged_attention import PALLAS, paged_attention, resolve_interpret
from kernels_pallas.reference import REFERENCE
from kernels_pallas.xla_attention import XLA
from pagedjax.sampling_params import SamplingParams
from tests.test_engine import GREEDY, make_engine, make_prompts, run, tokens_of

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from triton_compile import cuda_target, triton_call_targets  # noqa: E402  (a developer tool)

INTERPRET = resolve_interpret()

# --- the split of each sequence's actual length ----------------------------------------------


def pieces(lo: int, hi: int, num_splits: int, min_tiles: int) -> list[tuple[int, int]]:
    """Every split's [start, stop) tiles, as the kernel computes them."""
    out = []
    for split in range(num_splits):
        start, stop = split_tiles(
            jnp.int32(lo), jnp.int32(hi), jnp.int32(split), num_splits, min_tiles
        )
        out.append((int(start), int(stop)))
    return out


@pytest.mark.parametrize("num_splits,min_tiles", [(1, 1), (3, 1), (4, 2), (8, 4), (64, 4)])
def test_split_tiles_cover_the_visible_tiles_in_long_enough_pieces(num_splits, min_tiles):
    for lo in (0, 3):
        for num_tiles in range(0, 40):
            hi = lo + num_tiles
            got = pieces(lo, hi, num_splits, min_tiles)
            busy = [(a, b) for a, b in got if a < b]
            # Contiguous, in split order, exactly [lo, hi): every tile read once.
            assert [t for a, b in busy for t in range(a, b)] == list(range(lo, hi))
            used = min(max(num_tiles // min_tiles, 1), num_splits)
            assert len(busy) == (used if num_tiles else 0)
            assert all(a >= b for a, b in got[used:])  # the rest exit at once
            if len(busy) > 1:  # pieces of at least min_tiles, balanced within a tile
                sizes = [b - a for a, b in busy]
                assert min(sizes) >= min_tiles and max(sizes) - min(sizes) <= 1


def test_merge_ignores_empty_splits_and_an_all_empty_row_gives_zero():
    rng = np.random.default_rng(0)
    acc = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)  # [S, splits, M, D]
    m = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    denom = jnp.asarray(rng.uniform(1, 2, size=(2, 3, 4)), jnp.float32)
    empty = np.zeros((2, 3), bool)
    empty[0, 1] = True  # one empty split in a busy row
    empty[1, :] = True  # a row no split saw (a padding sequence)
    acc = jnp.where(empty[..., None, None], 0.0, acc)
    m = jnp.where(empty[..., None], -jnp.inf, m)
    denom = jnp.where(empty[..., None], 0.0, denom)
    out = np.asarray(merge_splits(acc, m, denom))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)
    keep = [0, 2]
    want = merge_splits(acc[0, keep], m[0, keep], denom[0, keep])
    np.testing.assert_allclose(out[0], want, rtol=1e-6)


def test_grid_bound_comes_from_occupancy_and_table_width():
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 33
    assert choose_num_splits(64, 8, 2048, num_sms=132) == 1
    assert choose_num_splits(1, 8, 512, num_sms=132) == 512 // MIN_TOKENS_PER_SPLIT
    assert choose_num_splits(1, 8, 512, num_sms=132, min_tokens_per_split=64) == 8


# 1 token; shorter than one split; exactly 2 and 4 tiles; 3 tiles (one split); a tile plus one;
# the full table width (128 positions); and a padding sequence.
MIXED_LENGTHS = [(1, 1), (1, 20), (1, 32), (1, 64), (1, 48), (1, 17), (1, 128)]


@pytest.mark.parametrize(
    "window,num_splits,num_stages",
    [(None, 4, 2), (None, None, 3), (40, 4, 2), (16, 3, 3), (1, 4, 2), (200, 8, 2)],
)
def test_split_k_over_actual_lengths_matches_reference(window, num_splits, num_stages):
    q, cache, metadata = make_case(
        25,
        MIXED_LENGTHS,
        block_size=8,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        num_tokens_padded=8,
        num_seqs_padded=8,
        max_blocks_per_seq=16,
    )
    kwargs = dict(scale=0.125, sliding_window=None if window is None else jnp.int32(window))
    config = DecodeConfig(
        num_splits=num_splits, kv_tile_tokens=16, min_tokens_per_split=32, num_stages=num_stages
    )
    out = paged_attention(
        q, cache, 1, metadata, interpret=INTERPRET, decode_only=True, decode_config=config, **kwargs
    )
    assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


# --- the backend contract ---------------------------------------------------------------------


def test_only_the_pallas_backend_declares_a_decode_kernel():
    assert PALLAS.has_decode_kernel is True
    assert XLA.has_decode_kernel is False and REFERENCE.has_decode_kernel is False
    hash(PALLAS)


@pytest.mark.parametrize("decode_only", [None, True, False])
def test_backends_without_a_decode_kernel_accept_and_ignore_the_flag(decode_only):
    q, cache, metadata = make_case(
        7, [(1, 9), (1, 30)], block_size=8, num_kv_heads=1, group=2, head_dim=16
    )
    want = expected(q, cache, 0, metadata, scale=0.25)
    for backend in (REFERENCE, XLA):
        out = backend(q, cache, 0, metadata, scale=0.25, decode_only=decode_only)
        assert_matches(out, want, metadata, jnp.float32)


@pytest.mark.parametrize("decode_only,kernels", [(True, 1), (False, 1), (None, 2)])
def test_a_static_flag_lowers_one_kernel_and_no_conditional(decode_only, kernels):
    """A square bucket (T == S) lowered for CUDA: with the flag, one Triton kernel and no
    `case`; without it, both kernels behind the run-time conditional."""
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    pool = jax.ShapeDtypeStruct((2, 2, 64, 16, 64), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((8, 4, 64), jnp.bfloat16)
    metadata = AttentionMetadata(i32((8,)), i32((8, 16)), i32((8,)), i32((9,)), i32(()), i32(()))
    fn = functools.partial(PALLAS.fn, scale=0.125, interpret=False, decode_only=decode_only)
    from kernels_pallas.kv_cache import KVCache

    with cuda_target(90):
        lowered = (
            jax.jit(fn)
            .trace(q, KVCache(pool, pool), i32(()), metadata)
            .lower(lowering_platforms=("cuda",))
        )
    assert len(triton_call_targets(lowered)) == kernels
    assert ("stablehlo.case" in lowered.as_text()) == (decode_only is None)


# --- the runner ---------------------------------------------------------------------------------

TRACED_FLAGS: list[bool | None] = []


def _flag_recording_reference(q, cache, layer, metadata, *, decode_only, **kwargs):
    """The oracle, noting the decode_only flag it was traced with."""
    TRACED_FLAGS.append(decode_only)
    return reference_module.ragged_paged_attention(q, cache, layer, metadata, **kwargs)


def spy_on_steps(runner) -> list[tuple[bool | None, bool]]:
    """(decode_only passed, whether every real sequence had <= 1 token) per forward call."""
    calls, forward = [], runner._forward

    def spy(*args, decode_only=None, **kwargs):
        qsl = np.asarray(args[4].query_start_loc)
        q_lens = np.diff(qsl)[: int(args[4].num_seqs)]
        calls.append((decode_only, bool((q_lens <= 1).all())))
        return forward(*args, decode_only=decode_only, **kwargs)

    runner._forward = spy
    return calls


def test_runner_passes_decode_only_statically_and_warmup_compiles_every_variant(tiny, monkeypatch):
    backend = FunctionBackend(
        "reference-with-decode-flag",  # a fresh name: a fresh compile cache for this test
        _flag_recording_reference,
        cost_follows_context=False,
        has_decode_kernel=True,
    )
    monkeypatch.setattr(reference_module, "REFERENCE", backend)
    engine = make_engine(tiny, attention_backend="reference", max_num_seqs=8)
    runner = engine.engine_core.worker.runner
    assert runner.attention is backend and runner.has_decode_kernel
    # Buckets 1, 4, 16, 32, 64 with 8 sequences at most: decode-only steps fit the first three.
    assert [runner._step_variants(t) for t in runner.token_buckets] == [
        [True],
        [True, False],
        [True, False],
        [False],
        [False],
    ]
    TRACED_FLAGS.clear()
    runner.warmup()
    variants = sum(len(runner._step_variants(t)) for t in runner.token_buckets)
    assert runner.num_compilations == variants * len(runner.width_buckets)
    assert set(TRACED_FLAGS) == {True, False}  # the backend got the flag, never None
    compiled = runner.num_compilations
    calls = spy_on_steps(runner)
    prompts = make_prompts(12, seed=10)
    outputs = run(engine, prompts, SamplingParams(max_tokens=9, **GREEDY))
    assert runner.num_compilations == compiled  # steady decoding and mixed steps: nothing new
    assert all(flag == decode for flag, decode in calls)
    assert {flag for flag, _ in calls} == {True, False}
    monkeypatch.undo()
    plain = make_engine(tiny, attention_backend="reference", max_num_seqs=8)
    assert tokens_of(outputs) == tokens_of(
        run(plain, prompts, SamplingParams(max_tokens=9, **GREEDY))
    )


def test_backends_without_a_decode_kernel_compile_once_per_bucket(tiny, monkeypatch):
    backend = dataclasses.replace(XLA, name="xla-without-flag")  # a fresh compile cache
    monkeypatch.setattr(xla_attention, "XLA", backend)
    engine = make_engine(tiny, attention_backend="xla", max_num_seqs=8)
    runner = engine.engine_core.worker.runner
    assert not runner.has_decode_kernel
    assert all(runner._step_variants(t) == [None] for t in runner.token_buckets)
    runner.warmup()
    assert runner.num_compilations == len(runner.token_buckets) * len(runner.width_buckets)
    calls = spy_on_steps(runner)
    run(engine, make_prompts(4, seed=3), SamplingParams(max_tokens=4, **GREEDY))
    assert calls and all(flag is None for flag, _ in calls)


def test_pallas_engine_compiles_nothing_after_warmup_and_gives_the_reference_tokens(tiny):
    """The real kernels (interpreted): decode-only steps run the split-K kernel, mixed ones the
    ragged kernel, both compiled by warmup."""
    prompts = make_prompts(3, seed=13, lo=5, hi=20)
    params = SamplingParams(max_tokens=4, **GREEDY)
    settings = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    expected_tokens = tokens_of(
        run(make_engine(tiny, attention_backend="reference", **settings), prompts, params)
    )
    engine = make_engine(tiny, attention_backend="pallas", **settings)
    runner = engine.engine_core.worker.runner
    runner.warmup()
    compiled = runner.num_compilations
    calls = spy_on_steps(runner)
    assert tokens_of(run(engine, prompts, params)) == expected_tokens
    assert runner.num_compilations == compiled
    assert {flag for flag, _ in calls} == {True, False}
    assert all(flag == decode for flag, decode in calls)
