"""Kernel hardening that interpret mode cannot show (issue 25): page ids clamped into the pool
before they form an address, masked positions that hold NaN kept out of P V, and 64-bit
offsets into pools past 4 GiB.

Interpret mode clamps an out-of-range index where a compiled kernel faults, so the clamps
are also checked on the Triton IR; pools past 4 GiB are lowered from shapes alone (no
allocation) and their IR read for 64-bit offsets.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import MIXED, assert_matches, expected, make_case

from kernels_pallas.decode_attention import DecodeConfig, decode_attention_kernel
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.paged_attention import paged_attention, resolve_interpret
from kernels_pallas.pallas_common import int32_offsets_overflow
from kernels_pallas.ragged_paged_attention import RaggedConfig, ragged_paged_attention_kernel
from kernels_pallas.reference import ragged_paged_attention as reference
from kernels_pallas.xla_attention import ragged_paged_attention_xla

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from triton_compile import (  # noqa: E402  (a developer tool)
    compile_for_sm,
    cuda_target,
    lower_for_cuda,
    triton_ir_text,
    triton_kernels,
)

INTERPRET = resolve_interpret()
DECODE_SEQS = [(1, 200), (1, 1), (1, 37), (1, 129), (1, 64)]


def decode_case(seed: int, kv_dtype=jnp.float32):
    """DECODE_SEQS with a padding sequence and spare table columns (q, cache, metadata)."""
    return make_case(
        seed,
        DECODE_SEQS,
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        kv_dtype=kv_dtype,
        num_seqs_padded=6,
        num_tokens_padded=6,
        max_blocks_per_seq=16,
    )


def mixed_case(seed: int, kv_dtype=jnp.float32):
    """MIXED prefill chunks and decode tokens, with padding tokens, sequences and columns."""
    return make_case(
        seed,
        MIXED,
        block_size=8,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        kv_dtype=kv_dtype,
        num_tokens_padded=40,
        num_seqs_padded=8,
        max_blocks_per_seq=12,
    )


def with_garbage_padding(metadata: AttentionMetadata, cache: KVCache) -> AttentionMetadata:
    """The block tables with every entry past a sequence's pages (and every entry of padding
    sequences) replaced by page ids the pool does not have: past its end, the largest int32,
    negative ones."""
    _, _, num_blocks, block_size, _ = cache.k.shape
    garbage = np.array([num_blocks, num_blocks + 5, 2**31 - 1, -1, -7, -(2**31)], np.int64)
    tables = np.array(metadata.block_tables)
    for s, seq_len in enumerate(np.asarray(metadata.seq_lens)):
        used = -(-int(seq_len) // block_size)
        tables[s, used:] = np.resize(garbage, tables.shape[1] - used).astype(np.int32)
    return dataclasses.replace(metadata, block_tables=jnp.asarray(tables, jnp.int32))


def poison_unwritten(cache: KVCache, metadata: AttentionMetadata) -> KVCache:
    """The pool with NaN at every position no sequence's context covers: unused blocks,
    the null block and the tail of each sequence's last page."""
    _, _, num_blocks, block_size, _ = cache.k.shape
    written = np.zeros((num_blocks, block_size), bool)
    tables = np.asarray(metadata.block_tables)
    for s, seq_len in enumerate(np.asarray(metadata.seq_lens)):
        positions = np.arange(seq_len)
        written[tables[s, positions // block_size], positions % block_size] = True
    mask = jnp.asarray(written)[None, None, :, :, None]
    return KVCache(jnp.where(mask, cache.k, jnp.nan), jnp.where(mask, cache.v, jnp.nan))


def left_of_window_to_page(
    metadata: AttentionMetadata, window: int, block_size: int, page: int
) -> AttentionMetadata:
    """Table entries of pages no query of their sequence sees (wholly left of every query's
    window) pointed at `page`, as a manager that frees them would leave them."""
    tables = np.array(metadata.block_tables)
    qsl, seq_lens = np.asarray(metadata.query_start_loc), np.asarray(metadata.seq_lens)
    for s, seq_len in enumerate(seq_lens):
        first_key = seq_len - (qsl[s + 1] - qsl[s]) - window + 1  # the first query's window
        tables[s, : max(first_key, 0) // block_size] = page
    return dataclasses.replace(metadata, block_tables=jnp.asarray(tables, jnp.int32))


def pallas(decode_only: bool, **kwargs):
    """paged_attention with one kernel, in interpret mode off a GPU."""
    return functools.partial(
        paged_attention, interpret=INTERPRET, decode_only=decode_only, **kwargs
    )


ATTENTIONS = {
    "ragged": pallas(False),
    "decode": pallas(True, decode_config=DecodeConfig(num_splits=3, kv_tile_tokens=16)),
    "decode-prefetch": pallas(
        True, decode_config=DecodeConfig(num_splits=2, kv_tile_tokens=32, num_stages=3)
    ),
    "xla": functools.partial(ragged_paged_attention_xla, decode_tile=2, key_chunk=32),
    "reference": reference,
}


def run(name: str, q, cache, layer, metadata, **kwargs) -> jax.Array:
    return ATTENTIONS[name](q, cache, layer, metadata, **kwargs)


def decode_only_case(name: str) -> bool:
    return name.startswith("decode")


# -- 1. page ids from the table are clamped -----------------------------------------------


@pytest.mark.parametrize("name", ["ragged", "decode", "decode-prefetch", "xla"])
def test_garbage_page_ids_in_padding_entries_change_nothing(name):
    """Out-of-range ids (past the pool, int32 max, negative) in every table entry a sequence
    does not use give the result of clean tables: they are clamped, then masked."""
    q, cache, metadata = (decode_case if decode_only_case(name) else mixed_case)(1)
    garbage = with_garbage_padding(metadata, cache)
    assert np.any(np.asarray(garbage.block_tables) < 0)
    assert np.any(np.asarray(garbage.block_tables) >= cache.k.shape[2])
    out = run(name, q, cache, 1, garbage, scale=0.125)
    assert_matches(out, expected(q, cache, 1, metadata, scale=0.125), metadata, jnp.float32)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _uses(lines: list[str], at: int) -> list[int]:
    """Indices of the lines that read the value line `at` defines, within its region (MLIR
    reuses value names in sibling regions)."""
    name = lines[at].split(" = ", 1)[0].strip()
    operand = re.compile(re.escape(name) + r"(?![\w#])")
    found = []
    for index in range(at + 1, len(lines)):
        if _indent(lines[index]) < _indent(lines[at]):  # the region ends
            break
        if operand.search(lines[index].split(" = ", 1)[-1]):
            found.append(index)
    return found


def _definition(lines: list[str], name: str, before: int) -> int:
    """Index of the nearest line before `before` that defines `name`."""
    return max(i for i in range(before) if lines[i].strip().startswith(f"{name} = "))


def _splat_constant(lines: list[str], name: str, before: int) -> int:
    """The integer in the `tt.splat` of an `arith.constant` named `name` at line `before`."""
    splat = _definition(lines, name, before)
    scalar = re.search(r"tt\.splat (%\w+)", lines[splat])[1]
    constant = lines[_definition(lines, scalar, splat)]
    return int(re.search(r"arith\.constant (-?\d+)", constant)[1])


def clamped_table_loads(ir: str) -> list[tuple[int, int]]:
    """(low, high) bounds of the clamp applied to each block-table gather (a tensor load of
    int32s), asserting that nothing but the clamp reads the loaded ids."""
    lines = ir.splitlines()
    load = re.compile(r"%\w+ = tt\.load %\w+ : tensor<\d+x!tt\.ptr<i32>>")
    bounds = []
    for at in (i for i, line in enumerate(lines) if load.search(line)):
        [maximum] = _uses(lines, at)  # the raw ids reach nothing but max(ids, 0)
        low = re.search(r"arith\.maxsi %\w+, (%\w+)", lines[maximum])
        assert low, lines[maximum]
        [minimum] = _uses(lines, maximum)
        high = re.search(r"arith\.minsi %\w+, (%\w+)", lines[minimum])
        assert high, lines[minimum]
        bounds.append(
            (
                _splat_constant(lines, low[1], maximum),
                _splat_constant(lines, high[1], minimum),
            )
        )
    return bounds


def embedded_triton_ir(lowered: jax.stages.Lowered) -> list[str]:
    """The Triton IR of each kernel in `lowered`; skips where the jaxlib embeds none (one that
    compiles the kernels to PTX at lowering)."""
    kernels = triton_kernels(lowered)
    if not kernels:
        pytest.skip("this jaxlib embeds no Triton IR (it compiles at lowering)")
    return [triton_ir_text(kernel) for kernel in kernels]


@pytest.mark.parametrize(
    "kernel,num_stages", [("ragged", 2), ("ragged", 3), ("decode", 2), ("decode", 3)]
)
def test_page_ids_are_clamped_before_they_form_an_address(kernel, num_stages):
    """In the Triton IR each id gathered from the block table goes through max(id, 0) and
    min(., N - 1) (lower_for_cuda's pool has N = 64 pages) before any address uses it."""
    config = (RaggedConfig if kernel == "ragged" else DecodeConfig)(num_stages=num_stages)
    lowered = lower_for_cuda(kernel, kv_dtype=jnp.bfloat16, head_dim=64, group=4, config=config)
    [ir] = embedded_triton_ir(lowered)
    bounds = clamped_table_loads(ir)
    assert bounds and set(bounds) == {(0, 63)}, bounds


# -- 2. masked positions holding NaN stay out of the output ------------------------------


@pytest.mark.parametrize(
    "name,kv_dtype",
    [
        ("ragged", jnp.float32),
        ("ragged", jnp.float8_e4m3fn),
        ("decode", jnp.float32),
        ("decode-prefetch", jnp.bfloat16),
        ("xla", jnp.float32),
        ("reference", jnp.float32),
    ],
)
def test_nan_in_unwritten_positions_stays_out_of_the_output(name, kv_dtype):
    """NaN in every position no context covers (unused and null blocks, the tail of each
    last page): P is 0 there and V's rows are zeroed, so no 0 x NaN reaches a row."""
    q, cache, metadata = (decode_case if decode_only_case(name) else mixed_case)(2, kv_dtype)
    poisoned = poison_unwritten(cache, metadata)
    assert np.isnan(np.asarray(poisoned.v.astype(jnp.float32))).any()
    out = run(name, q, poisoned, 1, metadata, scale=0.125)
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
    assert_matches(out, expected(q, cache, 1, metadata, scale=0.125), metadata, kv_dtype)


@pytest.mark.parametrize("name", ["ragged", "decode", "xla", "reference"])
def test_nan_pages_left_of_the_window_stay_out_of_the_output(name):
    """Pages wholly left of every query's sliding window may be freed and their entries
    point at a stale NaN page (here the null block): the output is that of clean pages."""
    q, cache, metadata = (decode_case if decode_only_case(name) else mixed_case)(3)
    window, block_size = 20, cache.k.shape[3]
    freed = left_of_window_to_page(metadata, window, block_size, page=0)
    assert not np.array_equal(np.asarray(freed.block_tables), np.asarray(metadata.block_tables))
    poisoned = poison_unwritten(cache, metadata)  # the null block too: no table had it
    kwargs = dict(scale=0.125, sliding_window=jnp.int32(window))
    out = run(name, q, poisoned, 1, freed, **kwargs)
    assert np.isfinite(np.asarray(out)).all()
    assert_matches(out, expected(q, cache, 1, metadata, **kwargs), metadata, jnp.float32)


# -- 3. pools past 4 GiB: 64-bit offsets -------------------------------------------------

GIB = 2**30


@pytest.mark.parametrize(
    "elements,dtype,overflows",
    [
        (2**31, jnp.float8_e4m3fn, False),  # 2 GiB: the last offset is 2**31 - 1
        (2**31 + 128, jnp.float8_e4m3fn, True),  # 32-bit offsets, past 2**31 - 1
        (2**32, jnp.float8_e4m3fn, True),  # 4 GiB: still 32-bit offsets
        (2**32 + 128, jnp.float8_e4m3fn, False),  # past 4 GiB: 64-bit offsets
        (2**31, jnp.bfloat16, False),  # 4 GiB of 2-byte elements: 32 bits suffice
        (2**31 + 128, jnp.bfloat16, False),  # 64-bit offsets
        (2**30 + 128, jnp.float32, False),
    ],
)
def test_int32_offsets_overflow_follows_the_lowering_rule(elements, dtype, overflows):
    assert int32_offsets_overflow((elements // 128, 128), dtype) is overflows


def lower_large_pool(
    kernel: str, kv_dtype, num_blocks: int, num_layers: int = 2
) -> jax.stages.Lowered:
    """One kernel lowered for sm_90 from shapes alone, over a pool of `num_layers` x 8 KV
    heads x `num_blocks` pages of 16 x 128 (`lower_for_cuda` with a pool of any size)."""
    pool = jax.ShapeDtypeStruct((num_layers, 8, num_blocks, 16, 128), kv_dtype)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    scales = jax.ShapeDtypeStruct((), jnp.float32) if jnp.dtype(kv_dtype).itemsize == 1 else None
    static = dict(scale=0.1, soft_cap=None, use_window=False, interpret=False)
    num_seqs = 8
    if kernel == "ragged":
        fn = functools.partial(ragged_paged_attention_kernel, **static)
        q = jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16)
        args = (q, pool, pool, i32(()), i32((num_seqs + 1,)), i32((num_seqs,)))
    else:
        fn = functools.partial(decode_attention_kernel, config=DecodeConfig(num_splits=4), **static)
        q = jax.ShapeDtypeStruct((num_seqs, 32, 128), jnp.bfloat16)
        args = (q, pool, pool, i32(()), i32((num_seqs,)))
    args += (i32((num_seqs, 16)), i32(()), scales, scales)
    with cuda_target(90):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


NUM_OUTPUTS = {"ragged": 1, "decode": 3}  # pointer arguments after the K and V pools


def pool_offset_types(ir: str, kernel: str) -> set[str]:
    """The integer types of the offsets added to the K and V pools' pointers in `ir`."""
    signature = re.search(r"tt\.func public @\w+\((.*?)\)\s*(attributes|\{)", ir, re.S)[1]
    num_args = len(re.findall(r"%arg\d+:", signature))
    first_pool = num_args - NUM_OUTPUTS[kernel] - 2
    types = set()
    for arg in (f"%arg{first_pool}", f"%arg{first_pool + 1}"):
        for splat in re.findall(rf"(%\w+) = tt\.splat {arg} ", ir):
            pattern = rf"tt\.addptr {splat}, %\w+ : [^,]+, tensor<[\dx]+x(i\d+)>"
            types.update(re.findall(pattern, ir))
    return types


@pytest.mark.parametrize(
    "kernel,kv_dtype,gib",
    [
        ("ragged", jnp.bfloat16, 6),
        ("decode", jnp.bfloat16, 6),
        ("ragged", jnp.float8_e4m3fn, 6),
        ("decode", jnp.float8_e4m3fn, 6),
        ("decode", jnp.bfloat16, 1),  # small pools keep 32-bit offsets
    ],
)
def test_pools_past_4_gib_are_addressed_with_64_bit_offsets(kernel, kv_dtype, gib):
    """A pool's offsets (page x page stride + ...) are i64 when it holds more than 2**31
    elements, i32 below: every KV tile address is in range for a pool of any size."""
    num_blocks = gib * GIB // (2 * 8 * 16 * 128 * jnp.dtype(kv_dtype).itemsize)
    lowered = lower_large_pool(kernel, kv_dtype, num_blocks)
    [ir] = embedded_triton_ir(lowered)
    assert pool_offset_types(ir, kernel) == ({"i64"} if gib > 4 else {"i32"})


@pytest.mark.parametrize("kernel", ["ragged", "decode"])
def test_fp8_pool_of_2_to_4_gib_is_read_one_layer_at_a_time(kernel):
    """jax's lowering gives an fp8 pool of 2-4 GiB 32-bit offsets that overflow past 2 GiB;
    the kernels then get a copy of the step's layer (under 2**31 elements), with a warning."""
    num_blocks = 3 * GIB // (2 * 8 * 16 * 128)
    with pytest.warns(UserWarning, match="2-4 GiB"):
        lowered = lower_large_pool(kernel, jnp.float8_e4m3fn, num_blocks)
    one_layer = f"tensor<1x8x{num_blocks}x16x128xf8E4M3FN>"
    assert one_layer in lowered.as_text()
    [ir] = embedded_triton_ir(lowered)
    assert pool_offset_types(ir, kernel) == {"i32"}


def test_fp8_layer_of_2_to_4_gib_is_refused():
    num_blocks = 3 * GIB // (8 * 16 * 128)
    with pytest.raises(ValueError, match="one layer"):
        lower_large_pool("decode", jnp.float8_e4m3fn, num_blocks, num_layers=1)


@pytest.mark.parametrize(
    "kernel,kv_dtype", [("ragged", jnp.bfloat16), ("decode", jnp.float8_e4m3fn)]
)
def test_64_bit_offsets_compile_without_spilling(kernel, kv_dtype):
    """The i64 address arithmetic of a 6 GiB pool still fits the registers on sm_90."""
    pytest.importorskip("triton", reason="Triton has wheels for Linux x86-64 only")
    num_blocks = 6 * GIB // (2 * 8 * 16 * 128 * jnp.dtype(kv_dtype).itemsize)
    lowered = lower_large_pool(kernel, kv_dtype, num_blocks)
    embedded_triton_ir(lowered)  # skips where there is none
    [triton_kernel] = triton_kernels(lowered)
    compiled = compile_for_sm(triton_kernel, 90)
    assert compiled.stack_bytes == 0, compiled
    assert compiled.cp_async > 0, compiled
