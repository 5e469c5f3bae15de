"""The worker: loads the model, sizes the KV pool from the memory left, allocates it.

As vLLM's worker does: load the weights (in the layout the platform's kernels want), profile
what a step needs besides the pool, then give the pool the rest; the model runner it builds
runs the steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.backend import AttentionBackend, AttentionSpec
from kernels_pallas.kv_cache import KV_CACHE_DTYPES
from kernels_pallas.kv_groups import kv_cache_groups
from models.config import ModelConfig
from models.llama import Params
from models.loader import checkpoint_dtype, load_model, load_tokenizer
from models.tensor_parallel import (
    AXIS,
    TensorParallel,
    layout_params,
    local_bytes,
    place_params,
    replicate_kv_scales,
    tensor_parallel_config,
)
from models.weights import LinearWeight, StackedLinearWeight
from pagedjax.config import EngineConfig
from pagedjax.core.memory import KVCacheSpec, blocks_held
from pagedjax.core.sched_output import SchedulerOutput
from pagedjax.distributed import StepChannel
from pagedjax.kv_scales import calibrate_kv_scales, calibration_prompts, describe, load_kv_scales
from pagedjax.platforms import Platform
from pagedjax.worker.draft_model import DraftModel, load_draft_model
from pagedjax.worker.model_runner import ModelRunner, StepHandle, activation_bytes

logger = logging.getLogger(__name__)


class AttentionBackendError(RuntimeError):
    """The attention backend failed to compile or run the engine's first step at start-up."""


class _BackendFailure(Exception):
    """Internal: what the attention backend raised while compiling or running a step."""

    def __init__(self, error: Exception):
        super().__init__(error)
        self.error = error


def resolve_dtype(config: EngineConfig, platform: Platform, params: Params | None) -> str:
    """The platform's dtype name for `config.dtype`, from the checkpoint's dtype (or the given
    params') when "auto"; logged, as it decides the weights', the activations' and the
    pool's bytes."""
    checkpoint = None
    if config.dtype == "auto":
        checkpoint = checkpoint_dtype(config.model) if params is None else _params_dtype(params)
    dtype = platform.resolve_dtype(config.dtype, checkpoint)
    logger.info(
        "dtype %s (asked %r on %s; checkpoint %s)", dtype, config.dtype, platform.name, checkpoint
    )
    return dtype


def _params_dtype(params: Params) -> str:
    return jnp.dtype(params["final_norm"].dtype).name


def _summary(error: Exception) -> str:
    """The error's type, first and last lines: Pallas, Triton and XLA errors run to pages
    (a compiler's summary comes first, a runtime error's cause last)."""
    lines = [line.strip()[:200] for line in str(error).splitlines() if line.strip()]
    text = " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    return f"{type(error).__name__}: {text}"


class Worker:
    """One engine's model, KV pool and step runner, on one device or split over a
    tensor-parallel group (`devices`). `config.block_size` must be set."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        model_config: ModelConfig | None = None,
        params: Params | None = None,
        devices: Sequence[jax.Device] | None = None,
        channel: StepChannel | None = None,
        replica: int = 0,
    ):
        """devices: the engine's devices (tensor_parallel_size of them); None: JAX's default
        device. channel: where the devices span processes, the leader's worker sends each
        device call's inputs on it and the followers' make the same calls
        (`pagedjax/distributed.py`); replica names this worker in its messages."""
        self.channel, self.replica = channel, replica
        self._last: StepHandle | None = None  # a follower's last step, for placeholders
        given = model_config is not None and params is not None
        if config.int8_activations:
            platform = platform.with_int8_activations()
        config = replace(config, dtype=resolve_dtype(config, platform, params if given else None))
        self.config, self.platform = config, platform
        self.devices = tuple(devices) if devices is not None else (jax.devices()[0],)
        self._placed = devices is not None
        self._memory: tuple[dict[int, int], dict[int, int]] | None = None
        size = config.tensor_parallel_size
        if len(self.devices) != size:
            raise ValueError(f"{len(self.devices)} devices for tensor_parallel_size {size}")
        dtype = jnp.dtype(config.dtype)
        keep_blocks = size == 1 and platform.keeps_quantized_weights(dtype)
        if config.int8_activations and not keep_blocks:
            raise ValueError(
                "int8_activations=True multiplies a GGUF's block-quantized weights, which the "
                "CPU keeps with dtype float32 and tensor_parallel_size 1 only: drop one or the "
                "other"
            )
        if not given:
            model_config, params = load_model(
                config.model, dtype, keep_blocks=keep_blocks, on_host=size > 1
            )
        self.model_config = model_config
        self.tp, kv_repeat, shard = None, 1, model_config
        if size > 1:
            tp_config, kv_repeat = tensor_parallel_config(model_config, size)
            mesh = jax.sharding.Mesh(np.asarray(self.devices), (AXIS,))
            self.tp = TensorParallel(mesh, tp_config, model_config.vocab_size)
            shard = self.tp.local_config
        self.params = self._place_params(self._own(params) if given else params)
        self.is_sleeping = False
        self.has_weights = True  # False from sleep() until wake_up() or set_params()
        # sleep(level=1): the weights on the host, with their shardings.
        self._host_weights: tuple[Params, Params] | None = None
        kv_name = config.kv_cache_dtype
        kv_dtype = dtype if kv_name == "auto" else jnp.dtype(KV_CACHE_DTYPES[kv_name])
        # The whole pool (its KV heads replicated where the split needs more), and one
        # device's part of it, which the device's memory budget sizes.
        self.kv_groups = kv_cache_groups(
            model_config.sliding_windows, model_config.num_layers, self._hybrid()
        )
        # A block holds a group's slabs (every layer without groups).
        self.kv_spec = KVCacheSpec(
            self.kv_groups.num_slabs,
            shard.num_kv_heads * size,
            model_config.head_dim,
            kv_dtype,
        )
        self.device_kv_spec = replace(self.kv_spec, num_kv_heads=shard.num_kv_heads)
        # Given scales are checked against the model's shape before anything is allocated.
        kv_scales = None
        if config.kv_cache_scales is not None:
            kv_scales = load_kv_scales(
                config.kv_cache_scales, model_config.num_layers, model_config.num_kv_heads
            )
            kv_scales = tuple(replicate_kv_scales(s, kv_repeat) for s in kv_scales)
        # What the attention kernels see: one shard's heads.
        self.attention_spec = AttentionSpec(
            shard.num_heads,
            shard.num_kv_heads,
            model_config.head_dim,
            kv_dtype.name,
            config.block_size,
            sinks=model_config.attention_sinks,
        )
        self.draft = self._load_draft(dtype, kv_dtype)
        self.num_host_blocks = self._host_blocks()
        backends = platform.attention_backends(config.attention_backend, self.attention_spec)
        if config.batch_invariant:
            backends = (platform.batch_invariant_backend(backends[0], dtype),)
        self._start(backends)
        if config.calculate_kv_scales:
            kv_scales = self.calibrate_kv_scales()
        if kv_scales is not None:
            self.runner.set_kv_scales(*kv_scales)
            how = "calibrated" if config.calculate_kv_scales else "given"
            logger.info("fp8 KV scales (%s): %s", how, describe(*kv_scales))

    def _load_draft(self, dtype: jnp.dtype, kv_dtype: jnp.dtype) -> DraftModel | None:
        """Speculative decoding's draft model, if the config names one (on one device:
        EngineConfig refuses a split)."""
        config = self.config
        spec = config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        draft = load_draft_model(
            spec,
            self.model_config,
            config.model,
            self.platform,
            dtype,
            kv_dtype,
            config.block_size,
            config.attention_backend,
            config.batch_invariant,
        )
        draft.params = self._place_params(draft.params)
        return draft

    def bytes_per_block(self) -> int:
        """One device's KV bytes per block: the target's pool, and the draft's beside it."""
        block_size = self.config.block_size
        total = self.device_kv_spec.bytes_per_block(block_size)
        if self.draft is not None:
            total += self.draft.kv_spec.bytes_per_block(block_size)
        return total

    def _hybrid(self) -> bool:
        """Whether the KV cache is split into groups that free what their windows passed."""
        config = self.config
        spec = config.speculative_config
        return not (
            config.disable_hybrid_kv_cache_manager
            or config.preemption_mode == "swap"
            or (spec is not None and spec.method == "draft_model")
        )

    def _host_blocks(self) -> int:
        """The host tier's blocks for swap_space (of the whole pool's heads); ValueError for
        more than the machine's memory. 0 where KV cache groups give blocks back (a swap
        could not restore them)."""
        config = self.config
        swap_bytes = int(config.swap_space * 2**30)
        if not swap_bytes or self.kv_groups.frees_blocks:
            return 0
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if swap_bytes > machine:
            raise ValueError(
                f"swap_space={config.swap_space} GiB is more than this machine's "
                f"{machine / 2**30:.1f} GiB of memory: lower swap_space (0 turns swapping off)"
            )
        block_bytes = self.bytes_per_block() * config.tensor_parallel_size  # every head
        return swap_bytes // block_bytes

    def _place_params(self, params: Params) -> Params:
        """Weights (pagedjax layout) as the step runs them: in the platform's layout on this
        engine's device, or split over its tensor-parallel group."""
        if self.tp is not None:
            # The split's layout, then each device receives only its slice of the weights.
            size = self.config.tensor_parallel_size
            placed = place_params(layout_params(params, self.model_config, size), self.tp)
            return self.platform.prepare_split_params(placed, jnp.dtype(self.config.dtype))
        params = self.platform.prepare_params(params, jnp.dtype(self.config.dtype))
        if self._placed:
            params = jax.device_put(params, self.devices[0])
        return params

    # ------------------------------------------------------------ weights in and out

    def _own(self, params: Params) -> Params:
        """A caller's weights as the engine's own copy, in its dtype: they never alias the
        caller's arrays, which a training step may donate or overwrite."""
        dtype = jnp.dtype(self.config.dtype)

        weight_types = (LinearWeight, StackedLinearWeight)

        def own(a):
            if isinstance(a, weight_types):
                return a  # a weight type (block codes) keeps its own dtypes
            if isinstance(a, jax.Array) or self.tp is None:
                return jnp.array(a, dtype=dtype, copy=True)
            return np.asarray(a, dtype)  # the split places host arrays slice by slice

        return jax.tree.map(own, params, is_leaf=lambda a: isinstance(a, weight_types))

    def set_params(self, params: Params) -> None:
        """Replaces the weights by `params` (pagedjax layout, float, shapes checked by the
        caller), prepared and placed as at start-up. Weights of the types the engine runs
        already compile nothing new; float weights replacing block codes (a GGUF's) compile
        the step once more. A draft model that is the target's checkpoint gets its layers of
        the new weights too."""
        placed = self._place_params(self._own(params))
        self._delete(self.params)
        self.params = self.runner.params = placed
        draft = self.draft
        if draft is not None and draft.follows_target:  # the draft is the target's first layers
            self._delete(draft.params)
            draft.params = self._place_params(self._own(draft.weights_from_target(params)))
        self.has_weights = True
        self._memory = None  # the weights' bytes may differ (block codes replaced)
        self._host_weights = None  # a sleeping engine's copy of the old ones is moot

    @staticmethod
    def _delete(tree) -> None:
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()

    def sleep(self, level: int = 1) -> None:
        """Frees this engine's device memory for another program (a trainer): the KV pool,
        and the weights, copied to the host at level 1 and discarded at level 2 (the next
        weights then come from `set_params`)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.is_sleeping:
            return
        if level == 1 and self.has_weights:
            shardings = jax.tree.map(lambda a: a.sharding, self.params)
            self._host_weights = (jax.device_get(self.params), shardings)
        self._delete(self.params)
        self._delete((self.runner.kv_cache, self.runner.draft_cache))  # a draft's weights stay
        self.is_sleeping, self.has_weights = True, False

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Gives back what `sleep` freed: "weights" (from their host copy; after level 2, new
        ones come from `set_params`) and "kv_cache" (a zeroed pool); both by default."""
        tags = ("weights", "kv_cache") if tags is None else tuple(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}: use weights, kv_cache")
        if "weights" in tags and self._host_weights is not None:
            weights, shardings = self._host_weights
            self.params = self.runner.params = jax.device_put(weights, shardings)
            self._host_weights = None
            self.has_weights = True
        if "kv_cache" in tags and self.runner.kv_cache_lost():
            self.runner.reset_kv_cache()
        self.is_sleeping = self._host_weights is not None or self.runner.kv_cache_lost()

    def _start(self, backends: Sequence[AttentionBackend]) -> None:
        """Sizes the pool and builds the runner on the first of `backends` that compiles and
        (where the platform probes) runs a first step. With attention_backend "auto" and
        attention_fallback, a failure is one warning and the next backend is tried; otherwise,
        or when none is left, it raises AttentionBackendError."""
        config = self.config
        alternatives = len(backends) > 1
        if config.attention_backend != "auto" or not config.attention_fallback:
            backends = backends[:1]
        for index, backend in enumerate(backends):
            self.attention = backend
            try:
                self.num_blocks = self.determine_num_blocks()
                if self.channel is not None:  # memory differs a little between hosts
                    self.num_blocks = self.channel.share(self.num_blocks)
                self.runner = ModelRunner(
                    config,
                    self.model_config,
                    self.params,
                    self.kv_spec,
                    self.num_blocks,
                    self.attention,
                    self.platform.sampling,
                    tp=self.tp,
                    device=self.devices[0] if self._placed and self.tp is None else None,
                    num_host_blocks=self.num_host_blocks,
                    kv_groups=self.kv_groups,
                    prepare_lora=self.platform.prepare_lora,
                    draft=self.draft,
                    prefetch_results=self.platform.prefetches_results,
                )
                if self.platform.probes_attention:
                    self._probe()
                return
            except _BackendFailure as failure:
                error = failure.error
            self._drop_runner()
            if index + 1 == len(backends):
                raise AttentionBackendError(self._failure_message(error, alternatives)) from error
            logger.warning(
                "attention backend %r failed at start-up (%s); running on %r instead "
                "(attention_fallback=False raises)",
                backend.name,
                _summary(error),
                backends[index + 1].name,
            )
            logger.debug("the %r backend's failure", backend.name, exc_info=error)

    def _probe(self) -> None:
        """Compiles and runs the smallest and the largest step shape, and waits for them."""
        try:
            self.runner.warmup(probe=True)
        except Exception as error:
            raise _BackendFailure(error) from error

    def _drop_runner(self) -> None:
        """Frees a failed runner's pool now (a failed call may have consumed it, or not), so
        that the next backend's pool does not sit beside it."""
        runner = self.__dict__.pop("runner", None)
        if runner is not None:
            for leaf in jax.tree.leaves(runner.kv_cache):
                if not leaf.is_deleted():
                    leaf.delete()

    def _failure_message(self, error: Exception, alternatives: bool) -> str:
        config, name = self.config, self.attention.name
        if config.attention_backend != "auto":
            hint = 'choose another attention_backend ("xla" runs everywhere)'
        elif not config.attention_fallback and alternatives:
            hint = "attention_fallback=True runs the next backend instead"
        else:
            hint = "no other attention backend can run this model here"
        return f"attention backend {name!r} failed at start-up ({_summary(error)}); {hint}"

    def calibrate_kv_scales(self) -> tuple[np.ndarray, np.ndarray]:
        """The pool's scales from a prefill of the built-in calibration texts (tokenized with
        the model's tokenizer) into a temporary pool in the model's dtype."""
        config, model_config = self.config, self.model_config
        dtype = jnp.dtype(config.dtype)
        spec = replace(self.attention_spec, kv_dtype=dtype.name)
        # The backend that started (it ran a step) if it reads the temporary pool's dtype.
        attention = self.attention
        if attention.supports(spec) is not None:
            attention = self.platform.attention_backend(config.attention_backend, spec)
        prompts = calibration_prompts(
            load_tokenizer(config.tokenizer or config.model),
            config.max_num_batched_tokens,
            config.max_model_len,
        )
        return calibrate_kv_scales(
            self.params,
            model_config,
            prompts,
            attention,
            self.kv_spec.dtype,
            dtype,
            config.block_size,
        )

    def determine_num_blocks(self) -> int:
        """`num_kv_blocks`, else the blocks of `kv_cache_memory_bytes`, else of the platform's
        budget; raises ValueError if one request of max_model_len would not fit."""
        config = self.config
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            budget = config.kv_cache_memory_bytes
            if budget is None:
                budget = self.platform.kv_budget_bytes(
                    config, self._activation_peak, self.model_config.vocab_size, self.devices[0]
                )
            # The budget is one device's: each holds its KV heads' part of every block.
            num_blocks = self.fit_num_blocks(budget // self.bytes_per_block())
        usable, block_size = num_blocks - 1, config.block_size  # block 0 is the null block
        tokens = usable * block_size
        logger.info(
            "KV cache: %d blocks, %d tokens, max concurrency %.1f at max_model_len %d",
            usable,
            tokens,
            tokens / config.max_model_len,
            config.max_model_len,
        )
        windows, step = self.kv_groups.windows, config.max_num_batched_tokens
        needed = blocks_held(config.max_model_len, block_size, windows, step)
        if usable < needed:
            shorter = "lower max_model_len"
            if not self.kv_groups.frees_blocks:  # then a block holds block_size tokens
                shorter = f"set max_model_len <= {tokens}"
            raise ValueError(
                f"the KV pool has {usable} blocks of {block_size} tokens, fewer than the "
                f"{needed} one request of max_model_len {config.max_model_len} may hold: "
                f"{shorter} or give more KV memory (num_kv_blocks or kv_cache_memory_bytes)"
            )
        return num_blocks

    def fit_num_blocks(self, num_blocks: int) -> int:
        """`num_blocks`, or fewer where the attention backend reads a pool that large more
        slowly (`fit_num_blocks` of the backend: an fp8 pool of 2-4 GiB for the Pallas
        kernels), for the target's pool and the draft's."""
        block_size, fitted = self.config.block_size, num_blocks
        pools = [(self.attention, self.device_kv_spec)]
        if self.draft is not None:
            pools.append((self.draft.attention, self.draft.kv_spec))
        for backend, spec in pools:
            fit = getattr(backend, "fit_num_blocks", None)
            if fit is not None:
                per_block = spec.num_layers * spec.num_kv_heads * block_size * spec.head_dim
                fitted = min(fitted, fit(num_blocks, per_block, spec.dtype))
        if fitted < num_blocks:
            logger.info(
                "KV pool: %d blocks instead of %d, so that the %r attention reads it in place",
                fitted,
                num_blocks,
                self.attention.name,
            )
        return fitted

    def _activation_peak(self) -> int:
        """The forward's compiled temporaries; the first compile of the attention backend
        when the pool is sized from memory, so a failure is the backend's (`_start`)."""
        config = self.config
        model_config, params = self.model_config, self.params
        if self.tp is not None:  # one shard's forward, on one shard's weights
            model_config = self.tp.local_config
            params = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.sharding.shard_shape(a.shape), a.dtype), params
            )
        try:
            return activation_bytes(
                model_config,
                params,
                config.max_num_batched_tokens,
                -(-config.max_model_len // config.block_size),
                self.attention,
                self.device_kv_spec,
                self.kv_groups,
            )
        except Exception as error:
            raise _BackendFailure(error) from error

    def memory_stats(self) -> dict[str, int]:
        """Device memory held by the weights and the KV pool: per device (the most any of
        this engine's devices holds) and in total over its devices."""
        if self._memory is None:  # fixed once the pool is allocated
            runner, draft = self.runner, self.draft
            weights = (self.params, draft.params if draft else None)
            self._memory = local_bytes(weights), local_bytes((runner.kv_cache, runner.draft_cache))
        weights, pool = self._memory
        return {
            "num_devices": len(self.devices),
            "weights_bytes_per_device": max(weights.values(), default=0),
            "weights_bytes_total": sum(weights.values()),
            "kv_cache_bytes_per_device": max(pool.values(), default=0),
            "kv_cache_bytes_total": sum(pool.values()),
        }

    def execute_model(self, out: SchedulerOutput, previous: StepHandle | None = None) -> StepHandle:
        """Dispatches the step; the handle's `result()` waits for it. Placeholder tokens are
        `previous`'s samples."""
        inputs = (out.seqs, out.freed_request_ids, out.rows, out.block_copies)
        inputs += (out.num_prompt_logprobs,)
        swaps = (out.swaps_out, out.swaps_in)
        steps = (out.num_steps, out.row_steps, out.decode, out.batch_id)
        self._publish("step", (*inputs, previous is not None, swaps, steps))
        return self.runner.dispatch(*inputs, previous, swaps, *steps)

    @property
    def steady_decode(self) -> bool:
        """Whether the runner keeps a steady decode batch's inputs (`Scheduler(steady_decode)`)."""
        return self.runner.supports_steady_decode

    def warmup(self) -> float:
        """Compiles every step shape; returns the seconds spent."""
        self._publish("warmup", None)
        return self.runner.warmup()

    def _publish(self, kind: str, payload: object) -> None:
        """The leader tells the followers which device call comes next."""
        if self.channel is not None:
            self.channel.send((kind, self.replica, payload))

    def follow(self, kind: str, payload: object) -> None:
        """A follower makes the device call the leader's worker announced."""
        if kind == "step":
            *inputs, has_previous, swaps, steps = payload
            previous = self._last if has_previous else None
            self._last = self.runner.dispatch(*inputs, previous, swaps, *steps)
        elif kind == "warmup":
            self.runner.warmup()
        elif kind == "reset":
            self.runner.reset_kv_cache()
        else:
            raise ValueError(f"unknown device call {kind!r} from the leader")

    def kv_cache_lost(self) -> bool:
        """Whether a failed step consumed the donated pool (every request's KV with it)."""
        return self.runner.kv_cache_lost()

    def reset_kv_cache(self) -> None:
        self._publish("reset", None)
        self.runner.reset_kv_cache()
