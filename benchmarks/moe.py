"""Mixture-of-experts steps: the experts as a grouped matmul (tokens sorted by expert, in tiles)
against every expert computed for every token, the same model and steps in the same run.

A random Qwen3-MoE-shaped model (8 experts, top-2 by default) runs the engine's jitted step
(`forward_logits_jit`, the platform's attention and weight layout) on a decode batch (B rows,
one token each, over a context) and a prefill chunk; tok/s is tokens per median step time.
On the CPU with the C++ kernels, the grouped kernel alone against the C++ matmul run per
expert on exactly its rows (the bound the packed matmul sets for the same work).

    python benchmarks/moe.py [--experts 8] [--top-k 2] [--hidden 512] [--expert-size 1024]
        [--layers 4] [--decode-rows 1 16 64 256] [--prefill 2048] [--repeats 7]
        [--smoke (a tiny model, two shapes, one repeat)]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from report import add_smoke_flag, report  # noqa: E402  (benchmarks/ is the script directory)


def build(args, dense: bool):
    """(config, params) of a random model with the platform's weight layout."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.config import ModelConfig, MoeConfig
    from models.hf_params import param_shapes
    from pagedjax.platforms import current_platform

    moe = MoeConfig(
        num_experts=args.experts,
        top_k=args.top_k,
        intermediate_size=args.expert_size,
        normalize_top_k=True,
        sparse_layers=(True,) * args.layers,
        dense_experts=dense,
    )
    head_dim = 64
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=0,
        num_layers=args.layers,
        num_heads=args.hidden // head_dim,
        num_kv_heads=max(1, args.hidden // head_dim // 2),
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        qk_norm=True,
        moe=moe,
    )
    rng = np.random.default_rng(0)

    def leaf(path, shape):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(shape, jnp.float32)
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2]))

    params = jax.tree_util.tree_map_with_path(
        leaf, param_shapes(config), is_leaf=lambda s: isinstance(s, tuple)
    )
    platform = current_platform()
    prepared = platform.prepare_params(params, jnp.float32)
    if dense:  # the peer's einsums take the experts as plain arrays; the rest as prepared
        experts = {k: v for k, v in params["layers"].items() if k.startswith("experts_")}
        prepared = {**prepared, "layers": {**prepared["layers"], **experts}}
    return config, prepared, platform


def time_step(config, params, platform, num_seqs: int, q_len: int, context: int, repeats: int):
    """Median seconds of a step of num_seqs sequences, q_len new tokens each, after `context`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.backend import AttentionSpec
    from kernels_pallas.kv_cache import allocate_kv_cache
    from kernels_pallas.metadata import build_metadata, token_positions
    from models.llama import forward_logits_jit
    from pagedjax.core.memory import KVCacheSpec

    block_size = platform.default_block_size
    seq_len = context + q_len
    blocks_each = -(-seq_len // block_size)
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, jnp.float32)
    cache = allocate_kv_cache(spec, 1 + num_seqs * blocks_each, block_size)
    attention = platform.attention_backend(
        "auto",
        AttentionSpec(
            config.num_heads, config.num_kv_heads, config.head_dim, "float32", block_size
        ),  # fmt: skip
    )
    tables = [list(range(1 + s * blocks_each, 1 + (s + 1) * blocks_each)) for s in range(num_seqs)]
    metadata = build_metadata([q_len] * num_seqs, [seq_len] * num_seqs, tables, block_size)
    num_tokens = num_seqs * q_len
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, num_tokens).astype(np.int32)
    positions = token_positions([q_len] * num_seqs, [seq_len] * num_seqs, num_tokens)
    last = (np.arange(num_seqs, dtype=np.int32) + 1) * q_len - 1
    times = []
    for _ in range(repeats + 1):  # the first compiles
        start = time.perf_counter()
        logits, cache = forward_logits_jit(
            params, config, tokens, positions, cache, metadata, last, attention
        )
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def kernel_against_matmuls(args, num_tokens: int, repeats: int) -> dict | None:
    """The C++ grouped kernel on one layer's gate/up experts ([E, H, 2 I]) for T tokens' T x k
    assignments, against the C++ matmul run per expert on exactly its rows (E calls of static
    sizes: what the packed matmul needs for this work, without tiles or padding)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.grouped_matmul import expert_tiles, tile_rows
    from pagedjax.cpu_native import build
    from pagedjax.cpu_native.matmul import pack, pack_experts

    if jax.default_backend() != "cpu" or not build.available():
        return None
    rng = np.random.default_rng(2)
    E, k, H, N = args.experts, args.top_k, args.hidden, 2 * args.expert_size  # noqa: N806
    w = rng.standard_normal((1, E, H, N), np.float32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((num_tokens, H), np.float32))
    tiles = expert_tiles(jnp.asarray(ids), E, tile_rows(ids.size, E))
    rows = x[tiles.rows]
    packed = pack_experts(w)
    grouped = jax.jit(lambda r: packed.grouped_matmul(r, 0, tiles))
    per_expert = [pack(w[0, e]) for e in range(E)]
    tokens_of = [np.nonzero((ids == e).any(axis=1))[0] for e in range(E)]
    each = jax.jit(lambda x: [p.matmul(x[t]) for p, t in zip(per_expert, tokens_of, strict=True)])

    def median_us(fn, arg) -> float:
        jax.block_until_ready(fn(arg))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(arg))
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    grouped_us, matmuls_us = median_us(grouped, rows), median_us(each, x)
    return {
        "tokens": num_tokens,
        "rows": int(ids.size),
        "padded_rows": int(tiles.num_tiles) * tiles.tile,
        "grouped_us": grouped_us,
        "per_expert_matmuls_us": matmuls_us,
        "ratio": grouped_us / matmuls_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    add_smoke_flag(parser)
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(hidden=128, expert_size=128, layers=2, vocab=512, decode_rows=[8],
                            context=32, prefill=64, repeats=1)  # fmt: skip
    args = parser.parse_args()

    import jax

    shapes = [(f"decode B={b}", b, 1) for b in args.decode_rows] + [
        (f"prefill {args.prefill}", 1, args.prefill)
    ]
    models = {kind: build(args, dense=kind == "dense") for kind in ("grouped", "dense")}
    rows = []
    device = jax.devices()[0].device_kind
    print(f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert size "
          f"{args.expert_size}, {args.layers} layers, on {device}")  # fmt: skip
    print(f"{'step':<16}{'grouped tok/s':>15}{'dense tok/s':>13}{'speedup':>9}")
    for name, num_seqs, q_len in shapes:
        seconds = {
            kind: time_step(*model, num_seqs, q_len, args.context, args.repeats)
            for kind, model in models.items()
        }
        tokens = num_seqs * q_len
        row = {
            "step": name,
            "tokens": tokens,
            "grouped_tok_s": tokens / seconds["grouped"],
            "dense_tok_s": tokens / seconds["dense"],
            "speedup": seconds["dense"] / seconds["grouped"],
        }
        rows.append(row)
        print(f"{name:<16}{row['grouped_tok_s']:>15.0f}{row['dense_tok_s']:>13.0f}"
              f"{row['speedup']:>8.2f}x")  # fmt: skip
    kernel = []
    for tokens in [*args.decode_rows, args.prefill]:
        result = kernel_against_matmuls(args, tokens, args.repeats * 3)
        if result is None:
            break
        if not kernel:
            print("\nC++ grouped kernel (one layer's gate/up) vs the C++ matmul per expert:")
            print(f"{'tokens':>8}{'rows':>7}{'padded':>8}{'grouped us':>12}{'matmuls us':>12}"
                  f"{'ratio':>7}")  # fmt: skip
        kernel.append(result)
        print(f"{tokens:>8}{result['rows']:>7}{result['padded_rows']:>8}"
              f"{result['grouped_us']:>12.0f}{result['per_expert_matmuls_us']:>12.0f}"
              f"{result['ratio']:>7.2f}")  # fmt: skip
    shape = {k: v for k, v in vars(args).items() if k != "smoke"}
    result = {"shape": shape, "device": device, "rows": rows, "kernel": kernel}
    report("moe", result, args.smoke)


if __name__ == "__main__":
    main()
