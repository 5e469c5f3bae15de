"""Tensor parallelism (Megatron-style) over one axis of a `jax.sharding.Mesh`.

Each of T shards holds:

    wqkv, bqkv    its query heads' and KV heads' columns    (column parallel)
    w_gate_up     its slice of the MLP's gate and up columns (column parallel)
    wo            the rows of its query heads                (row parallel: partial sums)
    w_down        the rows of its MLP slice                  (row parallel: partial sums)
    experts_*     E / T whole experts (expert parallel: a partial sum of its experts' share)
    shared_*      its slice of Qwen2-MoE's shared expert, as the MLP's (router: replicated)
    embed         a contiguous slice of the vocabulary's rows
    lm_head       the same slice of the vocabulary's columns
    norms         all of them (replicated)
    KV pool       its KV heads' pages of every block ([L, Hkv/T, blocks, block_size, D])

so a layer runs on the shard's heads with no communication until its two row-parallel
products (a mixture's experts: each shard routes every token, it holds them all, and runs
those sent to its own experts), each summed over the group by one all-reduce
(`models.llama.all_reduce`); the vocabulary-parallel lookup is one more all-reduce and the
logits one all-gather per step. The forward runs under `shard_map` with the shard's own
`ModelConfig` (its heads, MLP width and vocabulary), so the model code and the attention
kernels see ordinary, smaller shapes, and the block tables and the block manager stay single
and on the host.

Fused weights are reordered at load time so that each shard's columns are contiguous and in
the model's own order (`[q | k | v]` and `[gate | up]` of its heads), and the model splits
them as it does unsharded. With fewer KV heads than shards, or a count T does not divide, KV
heads are replicated (as vLLM does) to lcm(Hkv, T) heads: each copy serves the query heads of
the original, so the attention is unchanged. The vocabulary is padded with zero rows to a
multiple of T; their logits are cut before sampling.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels_pallas.kv_cache import KVCache
from models.config import ModelConfig
from models.llama import Params
from models.weights import LinearWeight, StackedLinearWeight

AXIS = "tp"

# Where each parameter is split: the axis of its array that holds the shard's slice.
_SPLIT_AXIS = {
    "embed": 0,
    "lm_head": 1,
    "wqkv": 2,
    "bqkv": 1,
    "wo": 1,
    "w_gate_up": 2,
    "w_down": 1,
    "experts_gate_up": 1,  # expert parallel: a contiguous slice of the experts
    "experts_down": 1,
    "shared_gate_up": 2,
    "shared_down": 1,
    "experts_gate_up_bias": 1,  # gpt-oss: with its experts
    "experts_down_bias": 1,
    "sinks": 1,  # gpt-oss: with its query heads
}


class TensorParallelError(ValueError):
    """The model cannot be split over the requested number of shards."""


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel group: the mesh axis it runs over and the model's shapes.

    Hashable, so the jitted step takes it as a static argument."""

    mesh: Mesh
    config: ModelConfig  # the whole model's, with replicated KV heads and padded vocabulary
    vocab_size: int  # the real vocabulary (config's is padded to a multiple of size)
    axis: str = AXIS

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def local_config(self) -> ModelConfig:
        """One shard's model: its heads, its slice of the MLP and of the vocabulary."""
        c, t = self.config, self.size
        moe = c.moe and replace(
            c.moe, shared_intermediate_size=c.moe.shared_intermediate_size // t
        )  # the experts themselves are split whole (their count stays the router's)
        return replace(
            c,
            num_heads=c.num_heads // t,
            num_kv_heads=c.num_kv_heads // t,
            intermediate_size=c.intermediate_size // t,
            vocab_size=c.vocab_size // t,
            moe=moe,
        )

    def param_specs(self, params: Params) -> Params:
        """A PartitionSpec per parameter, in the params' tree structure."""

        def spec(name: str, array) -> PartitionSpec:
            axis = _SPLIT_AXIS.get(name)
            if axis is None:
                return PartitionSpec()
            return PartitionSpec(*([None] * axis), self.axis)

        specs = {k: spec(k, v) for k, v in params.items() if k not in ("layers", "lora")}
        specs["layers"] = {k: spec(k, v) for k, v in params["layers"].items()}
        if "lora" in params:  # a step's adapters and each token's slot (`models/lora.py`)
            weights = self.lora_specs(params["lora"]["weights"])
            specs["lora"] = {"weights": weights, "slots": PartitionSpec()}
        return specs

    def lora_specs(self, slots: dict) -> dict:
        """LoRA slots' specs: a column-parallel matmul's B split as its output columns are, a
        row-parallel one's A as its input rows are (the shard's partial sums then add up);
        the other factor whole on every shard."""
        split = {"a": PartitionSpec(None, None, self.axis), "b": PartitionSpec()}
        columns = {"a": PartitionSpec(), "b": PartitionSpec(None, None, None, self.axis)}
        return {name: columns if _SPLIT_AXIS[name] == 2 else split for name in slots}

    def pool_spec(self, cache: KVCache) -> KVCache:
        """The pool's specs: K, V and their scales split by KV head (axis 1)."""
        heads = PartitionSpec(None, self.axis)
        scale = None if cache.k_scale is None else heads
        return KVCache(heads, heads, scale, scale)

    def shardings(self, specs):
        """NamedShardings on this mesh for a tree of PartitionSpecs."""
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def run(self, step, params: Params, kv_cache: KVCache, *replicated):
        """`step(params, kv_cache, *replicated, config=, axis_name=)` -> (logits [R, V_padded],
        kv_cache), run per shard with the shard's config on the global arrays; returns the
        logits cut to the real vocabulary (replicated on the group) and the sharded pool.

        The per-shard results are not checked for replication: the attention kernels are
        opaque to that check; the logits are replicated by their all-gather."""
        pool = self.pool_spec(kv_cache)
        per_shard = jax.shard_map(
            partial(step, config=self.local_config, axis_name=self.axis),
            mesh=self.mesh,
            in_specs=(self.param_specs(params), pool, *([PartitionSpec()] * len(replicated))),
            out_specs=(PartitionSpec(), pool),
            check_vma=False,
        )
        logits, kv_cache = per_shard(params, kv_cache, *replicated)
        return logits[:, : self.vocab_size], kv_cache


def tensor_parallel_config(config: ModelConfig, size: int) -> tuple[ModelConfig, int]:
    """The model as T shards see it together: (config with lcm(Hkv, T) KV heads and the
    vocabulary padded to a multiple of T, KV replication factor); raises TensorParallelError
    saying what does not divide."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be positive, got {size}")
    problems = []
    if config.num_heads % size:
        problems.append(f"num_attention_heads {config.num_heads}")
    if config.num_dense_layers and config.intermediate_size % size:
        problems.append(f"intermediate_size {config.intermediate_size}")
    if config.moe is not None:
        if config.moe.num_experts % size:
            problems.append(f"the {config.moe.num_experts} experts")
        if config.moe.shared_intermediate_size % size:
            shared = config.moe.shared_intermediate_size
            problems.append(f"shared_expert_intermediate_size {shared}")
    kv_heads = math.lcm(config.num_kv_heads, size)
    if not problems and config.num_heads % kv_heads:
        problems.append(
            f"num_attention_heads {config.num_heads} (with {config.num_kv_heads} KV heads "
            f"replicated to {kv_heads})"
        )
    if problems:
        raise TensorParallelError(
            f"tensor_parallel_size {size} must divide {' and '.join(problems)}; choose a "
            "tensor_parallel_size that does, or use data_parallel_size for more devices"
        )
    vocab = -(-config.vocab_size // size) * size
    return replace(config, num_kv_heads=kv_heads, vocab_size=vocab), kv_heads // config.num_kv_heads


def shard_major(parts: list[np.ndarray], size: int, axis: int, xp=np) -> np.ndarray:
    """Fused columns [p0 | p1 | ...] along `axis` reordered as T groups [p0_t | p1_t | ...]:
    each shard's slice of every part, side by side, in the model's order (xp: numpy, or
    jax.numpy for arrays on a device)."""
    groups = [xp.split(p, size, axis=axis) for p in parts]
    return xp.concatenate([g for shard in zip(*groups, strict=True) for g in shard], axis=axis)


def qkv_columns(w, config: ModelConfig, size: int, repeat: int, xp=np):
    """Fused q/k/v output columns (the last axis) in the tensor-parallel layout: KV heads
    repeated `repeat` times, then each shard's q, k and v columns side by side."""
    Q, KV = config.q_size, config.kv_size
    q, k, v = xp.split(xp.asarray(w), [Q, Q + KV], axis=-1)
    if repeat > 1:  # KV head j's copies j*r .. j*r + r - 1 serve its query heads
        shape = k.shape[:-1] + (config.num_kv_heads, config.head_dim)
        k, v = (
            xp.repeat(x.reshape(shape), repeat, axis=-2).reshape(*k.shape[:-1], KV * repeat)
            for x in (k, v)
        )
    return shard_major([q, k, v], size, w.ndim - 1, xp)


def gate_up_columns(w, size: int, xp=np):
    """Fused [gate | up] output columns (the last axis) as each shard's [gate | up]."""
    return shard_major(xp.split(xp.asarray(w), 2, axis=-1), size, w.ndim - 1, xp)


def layout_lora(packed: dict, config: ModelConfig, size: int) -> dict:
    """A packed adapter (`models.peft.pack_adapter`) in the tensor-parallel layout: the B of
    the column-parallel matmuls has its output columns arranged as their weights' are."""
    _, repeat = tensor_parallel_config(config, size)
    out = dict(packed)
    out["wqkv"] = {**packed["wqkv"], "b": qkv_columns(packed["wqkv"]["b"], config, size, repeat)}
    out["w_gate_up"] = {**packed["w_gate_up"], "b": gate_up_columns(packed["w_gate_up"]["b"], size)}
    return out


def layout_params(params: Params, config: ModelConfig, size: int) -> Params:
    """Arrays in the unsharded layout -> arrays in the tensor-parallel layout (the same shapes
    but for replicated KV heads and the padded vocabulary); see the module doc. Host arrays
    stay on the host; JAX arrays are rearranged where they are (new weights on a device)."""
    tp_config, repeat = tensor_parallel_config(config, size)
    xp = jnp if isinstance(params["layers"]["wqkv"], jax.Array) else np
    for name, weight in [*params.items(), *params["layers"].items()]:
        if isinstance(weight, (LinearWeight, StackedLinearWeight)):
            raise TensorParallelError(
                f"{name} is a {type(weight).__name__}; tensor parallelism splits float "
                "weights only (load the model unquantized)"
            )
    out = {k: v for k, v in params.items() if k != "layers"}
    layers = dict(params["layers"])
    layers["wqkv"] = qkv_columns(layers["wqkv"], config, size, repeat, xp)
    if "bqkv" in layers:
        layers["bqkv"] = qkv_columns(layers["bqkv"], config, size, repeat, xp)
    for name in ("w_gate_up", "shared_gate_up"):
        if name in layers:
            layers[name] = gate_up_columns(layers[name], size, xp)
    out["layers"] = layers
    pad = tp_config.vocab_size - config.vocab_size
    if pad and "embed" in out:
        out["embed"] = xp.pad(xp.asarray(out["embed"]), ((0, pad), (0, 0)))
    if pad and "lm_head" in out:
        out["lm_head"] = xp.pad(xp.asarray(out["lm_head"]), ((0, 0), (0, pad)))
    return out


def replicate_kv_scales(scales: np.ndarray, repeat: int) -> np.ndarray:
    """[L, Hkv] per-head scales -> [L, Hkv * repeat], one per KV head copy."""
    return np.repeat(np.asarray(scales), repeat, axis=1)


def place_params(params: Params, tp: TensorParallel) -> Params:
    """Arrays (tensor-parallel layout) -> global arrays split over the group: from the host,
    each device receives only its slice, so no device ever holds the whole model; JAX arrays
    move device to device."""
    specs = tp.param_specs(params)

    def place(array, spec: PartitionSpec) -> jax.Array:
        sharding = NamedSharding(tp.mesh, spec)
        if isinstance(array, jax.Array):
            return jax.device_put(array, sharding)
        array = np.asarray(array)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    return jax.tree.map(place, params, specs)


def local_bytes(tree) -> dict[int, int]:
    """Bytes held on each device (by device id) by the arrays of a tree."""
    held: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):  # host arrays hold none
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective a compiled module's HLO text holds (an async pair counts
    once). A scanned layer's collectives appear once, in the loop body."""
    found = re.findall(rf"\s({'|'.join(COLLECTIVES)})(?:-start)?\(", hlo_text)
    return {name: found.count(name) for name in COLLECTIVES}
