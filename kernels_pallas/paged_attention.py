"""The Pallas attention entry point: a drop-in for `reference.ragged_paged_attention`.

`paged_attention(q, cache, layer, metadata, *, scale, sliding_window=None, soft_cap=None)` has
the signature `models.llama` calls `attention_fn` with, so the engine swaps it in as is
(attention_backend="pallas"). It runs

- the ragged kernel (`ragged_paged_attention.py`) for any batch of prefill chunks and decode
  tokens, and
- the split-K decode kernel (`decode_attention.py`) when the batch is decode-only: forced with
  decode_only=True (the caller knows it statically: best), or, with decode_only=None and a
  bucket shaped T == S, chosen at run time by a `lax.cond` on max q_len <= 1.

Both kernels are Pallas on the Triton lowering; interpret=None interprets on CPU (the CI path)
and compiles on GPU. The environment variable PAGEDJAX_PALLAS_INTERPRET=0/1 overrides that.

Out-of-range page ids are not checked inside the kernels (a GPU gather would read foreign
memory; interpret mode clamps them silently): `check_block_tables` (host) and
`checkify_metadata` (jittable, with jax.experimental.checkify) catch them.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from kernels_pallas.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    decode_attention_kernel,
    device_sm_count,
)
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention import RaggedConfig, ragged_paged_attention_kernel

INTERPRET_ENV = "PAGEDJAX_PALLAS_INTERPRET"
DEFAULT_RAGGED_CONFIG = RaggedConfig()
DEFAULT_DECODE_CONFIG = DecodeConfig()


def resolve_interpret(interpret: bool | None = None) -> bool:
    """None: $PAGEDJAX_PALLAS_INTERPRET if set, else interpret unless the backend is a GPU."""
    if interpret is not None:
        return interpret
    env = os.environ.get(INTERPRET_ENV)
    if env is not None and env != "":
        return env.lower() not in ("0", "false", "no")
    return jax.default_backend() != "gpu"


def gpu_lacks_fp8_conversions(device: jax.Device | None = None) -> bool:
    """True on a CUDA GPU of compute capability below 8.9 (Ampere and older): it has no fp8
    conversion instructions, so the kernels upcast fp8 pools with integer ops."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return False
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return (major, minor) < (8, 9)


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    cache: KVCache,  # k, v: [L, Hkv, num_blocks, block_size, D]
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    interpret: bool | None = None,
    decode_only: bool | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    software_fp8: bool | None = None,
    ragged_config: RaggedConfig = DEFAULT_RAGGED_CONFIG,
    decode_config: DecodeConfig = DEFAULT_DECODE_CONFIG,
) -> jax.Array:  # [T, Hq, D] in q's dtype; padding tokens get 0
    """Causal attention of each new token over its sequence's paged context (see reference).

    `layer` may be traced (the model scans over layers): the kernels index the stacked pool
    with it, no layer slice is copied. `sliding_window`: None, or an int / traced int32 with 0
    meaning unlimited. `scale` and `soft_cap` are static Python floats. `k_scale`/`v_scale`
    dequantise an fp8 pool: None (the pool's own scales, or 1), a scalar (per tensor), [Hkv]
    (per head) or [L, Hkv]. `software_fp8`: upcast an fp8 pool with integer ops; None: on
    GPUs without fp8 conversions (`gpu_lacks_fp8_conversions`).
    """
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = cache.k.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads}")
    interpret = resolve_interpret(interpret)
    if software_fp8 is None:
        software_fp8 = not interpret and cache.k.dtype.itemsize == 1 and gpu_lacks_fp8_conversions()
    if k_scale is None and v_scale is None:  # an fp8 pool carries its own scales
        k_scale, v_scale = cache.k_scale, cache.v_scale
    use_window = sliding_window is not None
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    layer = jnp.asarray(layer, jnp.int32)
    common = dict(
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        use_window=use_window,
        interpret=interpret,
        software_fp8=software_fp8,
    )

    def ragged(q):
        return ragged_paged_attention_kernel(
            q,
            cache.k,
            cache.v,
            layer,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            window,
            k_scale,
            v_scale,
            config=ragged_config,
            **common,
        )

    def decode(q):
        qsl = metadata.query_start_loc
        has_query = qsl[1:] > qsl[:-1]  # [S]
        token = jnp.clip(qsl[:-1], 0, num_tokens - 1)
        out = decode_attention_kernel(
            q[token],
            cache.k,
            cache.v,
            layer,
            jnp.where(has_query, metadata.seq_lens, 0),
            metadata.block_tables,
            window,
            k_scale,
            v_scale,
            config=decode_config,
            **common,
        )
        target = jnp.where(has_query, token, num_tokens)  # padding sequences write nothing
        return jnp.zeros_like(q).at[target].set(out, mode="drop")

    if decode_only is True:
        return decode(q)
    if decode_only is False or num_tokens != metadata.seq_lens.shape[0]:
        return ragged(q)
    qsl = metadata.query_start_loc
    return lax.cond(jnp.all(qsl[1:] - qsl[:-1] <= 1), decode, ragged, q)


def _metadata_problems(
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    num_seqs: int,
    num_tokens_padded: int,
    num_blocks: int,
    block_size: int,
) -> list[str]:
    problems = []
    width = block_tables.shape[1]
    q_lens = np.diff(query_start_loc)
    if np.any(q_lens < 0) or query_start_loc[0] != 0:
        problems.append("query_start_loc must start at 0 and be non-decreasing")
    if query_start_loc[-1] > num_tokens_padded:
        problems.append(f"query_start_loc ends at {query_start_loc[-1]} > {num_tokens_padded}")
    for s in range(num_seqs):
        if q_lens[s] > seq_lens[s]:
            problems.append(f"sequence {s}: q_len {q_lens[s]} > seq_len {seq_lens[s]}")
        if seq_lens[s] > width * block_size:
            problems.append(f"sequence {s}: seq_len {seq_lens[s]} exceeds the table width")
        bad = np.flatnonzero((block_tables[s] < 0) | (block_tables[s] >= num_blocks))
        if bad.size:
            col = int(bad[0])
            problems.append(
                f"sequence {s}: block_tables[{s}, {col}] = {int(block_tables[s, col])} is not "
                f"a page of a {num_blocks}-block pool"
            )
    return problems


def check_block_tables(metadata: AttentionMetadata, num_blocks: int, block_size: int) -> None:
    """Host-side check of what the kernels trust: every page id of a real sequence's table row
    is in [0, num_blocks), each context fits its table, query_start_loc is consistent.

    Raises ValueError naming the first problems. Needs concrete (non-traced) metadata."""
    num_seqs = int(np.asarray(metadata.num_seqs))
    problems = _metadata_problems(
        np.asarray(metadata.block_tables),
        np.asarray(metadata.seq_lens),
        np.asarray(metadata.query_start_loc),
        num_seqs,
        int(np.asarray(metadata.slot_mapping).shape[0]),
        num_blocks,
        block_size,
    )
    if problems:
        raise ValueError("invalid attention metadata: " + "; ".join(problems[:5]))


def metadata_is_valid(
    metadata: AttentionMetadata, num_blocks: int, block_size: int
) -> jax.Array:  # [] bool
    """Jittable form of `check_block_tables`: True iff the kernels may trust the metadata."""
    tables, seq_lens, qsl = metadata.block_tables, metadata.seq_lens, metadata.query_start_loc
    real = jnp.arange(seq_lens.shape[0]) < metadata.num_seqs  # [S]
    q_lens = qsl[1:] - qsl[:-1]
    pages_ok = jnp.all((tables >= 0) & (tables < num_blocks), axis=1)
    fits = seq_lens <= tables.shape[1] * block_size
    rows_ok = ~real | (pages_ok & fits & (q_lens <= seq_lens))
    return (
        jnp.all(rows_ok)
        & jnp.all(q_lens >= 0)
        & (qsl[0] == 0)
        & (qsl[-1] <= metadata.slot_mapping.shape[0])
    )


def checkify_metadata(metadata: AttentionMetadata, num_blocks: int, block_size: int) -> None:
    """`checkify.check` of `metadata_is_valid`: inside a function wrapped with
    `jax.experimental.checkify.checkify`, a bad block table becomes a returned error."""
    checkify.check(
        metadata_is_valid(metadata, num_blocks, block_size),
        "invalid attention metadata: a page id is outside the pool, a context exceeds its "
        "table, or query_start_loc is inconsistent",
    )


__all__ = [
    "INTERPRET_ENV",
    "DecodeConfig",
    "RaggedConfig",
    "check_block_tables",
    "checkify_metadata",
    "choose_num_splits",
    "device_sm_count",
    "metadata_is_valid",
    "paged_attention",
    "resolve_interpret",
]
