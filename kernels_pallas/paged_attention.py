"""The Pallas attention entry point: a drop-in for `reference.ragged_paged_attention`.

`paged_attention(q, cache, layer, metadata, *, scale, sliding_window=None, soft_cap=None)` has
the signature `models.llama` calls `attention_fn` with, so the engine swaps it in as is
(attention_backend="pallas"). It runs

- the ragged kernel (`ragged_paged_attention.py`) for any batch of prefill chunks and decode
  tokens, and
- the split-K decode kernel (`decode_attention.py`) when the batch is decode-only, and in a
  mixed batch for its long decode rows (`_mixed`): a 32k-token conversation then does not
  stream its context in one program while it shares a step with prefills.

Which one is static when the caller says so: decode_only=True (every q_len <= 1) runs the
split-K kernel, decode_only=False the ragged one. The engine's model runner knows this on the
host for each step and passes it (`PALLAS.has_decode_kernel`: the flag is part of its compile
key), so no layer carries a conditional. decode_only=None, for callers that do not know (the
plain drop-in), keeps a run-time choice on buckets shaped T == S: a `lax.cond` on
max q_len <= 1 per call (on a GPU possibly a predicate read per layer); other shapes run the
ragged kernel.

The split-K grid's split dimension is a static bound from occupancy (`choose_num_splits`:
S x Hkv x splits about two waves of SMs, capped by the table width); inside the kernel each
sequence's actual length is cut into at most that many pieces of whole KV tiles, at least
`DecodeConfig.min_tokens_per_split` positions each, and unused splits exit at once.

Both kernels are Pallas on the Triton lowering; interpret=None interprets on CPU (the CI path)
and compiles on GPU. The environment variable PAGEDJAX_PALLAS_INTERPRET=0/1 overrides that.

`PALLAS` is the same function as an `AttentionBackend` (`backend.py`).

The kernels trust the block tables: an out-of-range page id is not checked (a GPU gather would
read foreign memory; interpret mode clamps it silently). The block manager builds every table
from pages it handed out, and pads with NULL_BLOCK, so the tables are valid by construction.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.backend import AttentionSpec, FunctionBackend
from kernels_pallas.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    decode_attention_kernel,
    device_sm_count,
)
from kernels_pallas.kv_cache import KVCache
from kernels_pallas.metadata import AttentionMetadata, next_power_of_2
from kernels_pallas.pallas_common import in_place_num_blocks, matmul_dtype
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
    invariant: bool = False,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    software_fp8: bool | None = None,
    ragged_config: RaggedConfig = DEFAULT_RAGGED_CONFIG,
    decode_config: DecodeConfig = DEFAULT_DECODE_CONFIG,
    sinks: jax.Array | None = None,
    decode_kernel: Callable[..., jax.Array] = decode_attention_kernel,
) -> jax.Array:  # [T, Hq, D] in q's dtype; padding tokens get 0
    """Causal attention of each new token over its sequence's paged context (see reference).

    `layer` may be traced (the model scans over layers): the kernels index the stacked pool
    with it, no layer slice is copied. `sliding_window`: None, or an int / traced int32 with 0
    meaning unlimited. `scale` and `soft_cap` are static Python floats. `k_scale`/`v_scale`
    dequantise an fp8 pool: None (the pool's own scales, or 1), a scalar (per tensor), [Hkv]
    (per head) or [L, Hkv]. `software_fp8`: upcast an fp8 pool with integer ops; None: on
    GPUs without fp8 conversions (`gpu_lacks_fp8_conversions`). `decode_only`: True runs the
    split-K kernel (the caller guarantees every q_len <= 1), False the ragged kernel, None
    chooses at run time on T == S buckets (module docstring). `invariant`: every token runs
    the ragged kernel (decode_only is ignored, no split-K), so its result is the same bits
    whatever the step's batch: its KV tiles start at fixed positions and are summed in order,
    and a row's dots and softmax never mix with other rows'. `sinks` [Hq]: a logit per head
    in every softmax that no value goes with (gpt-oss). `decode_kernel`: the split-K kernel,
    `decode_attention_kernel`'s signature (Triton's, or Mosaic GPU's).
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
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    operands = (cache, jnp.asarray(layer, jnp.int32), metadata, window, k_scale, v_scale, sinks)
    static = dict(
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        use_window=sliding_window is not None,
        interpret=interpret,
        software_fp8=software_fp8,
    )

    def ragged(q):
        if not invariant and _routes_long_rows(cache, metadata, decode_config):
            configs = (ragged_config, decode_config)
            return _mixed(q, *operands, configs=configs, decode_kernel=decode_kernel, **static)
        return _ragged(q, *operands, config=ragged_config, **static)

    def decode(q):
        return _decode(q, *operands, config=decode_config, decode_kernel=decode_kernel, **static)

    if invariant:
        return ragged(q)
    if decode_only is True:
        return decode(q)
    if decode_only is False or num_tokens != metadata.seq_lens.shape[0]:
        return ragged(q)
    qsl = metadata.query_start_loc
    return lax.cond(jnp.all(qsl[1:] - qsl[:-1] <= 1), decode, ragged, q)


def _ragged(q, cache, layer, metadata, window, k_scale, v_scale, sinks, **static):
    """The ragged kernel on the step's flat batch."""
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
        sinks,
        **static,
    )


def _routes_long_rows(cache: KVCache, metadata: AttentionMetadata, config: DecodeConfig) -> bool:
    """Whether a mixed step's long decode rows go to the split-K kernel: static, from the
    block-table width, so buckets of short contexts launch no second kernel."""
    max_context = metadata.block_tables.shape[1] * cache.k.shape[3]
    return config.mixed_long_rows > 0 and max_context >= 2 * config.min_tokens_per_split


def _mixed(
    q, cache, layer, metadata, window, k_scale, v_scale, sinks, *, configs, decode_kernel, **static
):
    """The ragged kernel on the step, but for its first `mixed_long_rows` decode rows of at
    least 2 x min_tokens_per_split positions: those run split-K, and the ragged kernel sees
    them as one-position contexts (cheap; their output is replaced)."""
    ragged_config, decode_config = configs
    num_tokens, num_seqs = q.shape[0], metadata.seq_lens.shape[0]
    qsl, seq_lens = metadata.query_start_loc, metadata.seq_lens
    long = (qsl[1:] - qsl[:-1] == 1) & (seq_lens >= 2 * decode_config.min_tokens_per_split)
    num_rows = min(decode_config.mixed_long_rows, num_seqs)
    (rows,) = jnp.nonzero(long, size=num_rows, fill_value=num_seqs)  # [R]; num_seqs: none
    picked = jnp.zeros(num_seqs, bool).at[rows].set(True, mode="drop")
    short = dataclasses.replace(metadata, seq_lens=jnp.where(picked, 1, seq_lens))
    out = _ragged(
        q, cache, layer, short, window, k_scale, v_scale, sinks, config=ragged_config, **static
    )
    real = rows < num_seqs
    row = jnp.minimum(rows, num_seqs - 1)
    token = qsl[row]  # [R] each long row's one new token
    long_out = decode_kernel(
        q[token],
        cache.k,
        cache.v,
        layer,
        jnp.where(real, seq_lens[row], 0),
        metadata.block_tables[row],
        window,
        k_scale,
        v_scale,
        sinks,
        config=decode_config,
        **static,
    )
    return out.at[jnp.where(real, token, num_tokens)].set(long_out, mode="drop")


def _decode(q, cache, layer, metadata, window, k_scale, v_scale, sinks, *, decode_kernel, **static):
    """The split-K kernel on each sequence's one new token, scattered back to the flat batch."""
    num_tokens = q.shape[0]
    qsl = metadata.query_start_loc
    has_query = qsl[1:] > qsl[:-1]  # [S]
    token = jnp.clip(qsl[:-1], 0, num_tokens - 1)
    out = decode_kernel(
        q[token],
        cache.k,
        cache.v,
        layer,
        jnp.where(has_query, metadata.seq_lens, 0),
        metadata.block_tables,
        window,
        k_scale,
        v_scale,
        sinks,
        **static,
    )
    target = jnp.where(has_query, token, num_tokens)  # padding sequences write nothing
    return jnp.zeros_like(q).at[target].set(out, mode="drop")


def _supports(spec: AttentionSpec) -> str | None:
    """None if the kernels run `spec`, else why not."""
    if spec.num_q_heads % spec.num_kv_heads:
        return f"{spec.num_q_heads} query heads are not a multiple of {spec.num_kv_heads}"
    if spec.block_size != next_power_of_2(spec.block_size):
        return f"block_size {spec.block_size} is not a power of two"
    # Triton tensors have power-of-two sizes, and its dots at least 16 rows and columns.
    if spec.head_dim != next_power_of_2(spec.head_dim) or not 16 <= spec.head_dim <= 256:
        return f"head_dim {spec.head_dim} is not a power of two from 16 to 256"
    try:
        matmul_dtype(jnp.dtype(spec.kv_dtype))
    except (TypeError, ValueError):
        return f"no Pallas kernel for KV pool dtype {spec.kv_dtype}"
    return None


# The kernels compiled on a GPU and interpreted elsewhere (correct but slow: for tests). The
# ragged kernel's grid and the split-K grid bound follow the block-table width.
PALLAS = FunctionBackend(
    "pallas",
    paged_attention,
    cost_follows_context=False,
    check=_supports,
    has_decode_kernel=True,
    fit_num_blocks=in_place_num_blocks,
    takes_sinks=True,
)

__all__ = [
    "INTERPRET_ENV",
    "PALLAS",
    "DecodeConfig",
    "RaggedConfig",
    "choose_num_splits",
    "device_sm_count",
    "gpu_lacks_fp8_conversions",
    "paged_attention",
    "resolve_interpret",
]
