"""Engine configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from pagedjax.attention import BACKENDS
from pagedjax.core.sched_policy import POLICIES
from pagedjax.core.spec_decode import SpeculativeConfig
from pagedjax.core.swap_policy import PREEMPTION_MODES

if TYPE_CHECKING:
    from kernels_pallas.backend import AttentionBackend

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
ATTENTION_BACKENDS = ("auto", *BACKENDS)
KV_CACHE_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16", "fp8")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None: the default SmolLM2 model
    tokenizer: str | None = None  # a directory holding the tokenizer; None: the model's
    max_model_len: int = 2048  # prompt + output tokens of one request
    block_size: int | None = None  # tokens per KV block; None: the platform's default
    num_kv_blocks: int | None = None  # explicit pool size (the null block included)
    # Pool budget when num_kv_blocks is not given. None: on a GPU, gpu_memory_utilization of
    # the card's memory minus weights, the profiled activation peak and the sampler's
    # reserve (capped by JAX's allocator); on the CPU, 1 GiB.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 128  # running requests at once
    enable_prefix_caching: bool = True
    # The KV cache's host tier (`pagedjax/core/host_pool.py`): GiB of host memory for the
    # blocks of preempted requests (vLLM's name and default; 0: none), mapped as used.
    # preemption_mode: "auto" swaps a victim out when copying its KV out and back costs less
    # than recomputing it (`pagedjax/core/swap_policy.py`), "swap" whenever the tier has
    # room, "recompute" never.
    swap_space: float = 4.0
    preemption_mode: str = "auto"
    # A model with sliding-window layers gives back the blocks its windows passed (KV cache
    # groups over one pool, `kernels_pallas/kv_groups.py`, vLLM's hybrid allocator); it then
    # has no host tier and preempts by recompute. True (vLLM's flag), preemption_mode="swap"
    # or a draft model keep one table for every layer.
    disable_hybrid_kv_cache_manager: bool = False
    long_prefill_token_threshold: int = 0  # > 0: cap on one request's prefill chunk per step
    # "auto": the platform's choice (Pallas kernels on a GPU; on the CPU the C++ kernel, or
    # XLA's loops where it does not apply); "reference": the per-token oracle; "pallas" on
    # the CPU runs the kernels in interpret mode (tests). See pagedjax/attention.py. Or a
    # user's backend object with the contract of `kernels_pallas.backend.AttentionBackend`.
    attention_backend: str | AttentionBackend = "auto"
    # Block-quantized weights (a GGUF's Q4_0, Q4_1, Q8_0) multiply each row's activations
    # quantized to int8 per 32 inputs, as llama.cpp does: integer dot products (AVX-512 VNNI,
    # or AVX2) do fewer operations than float32 FMAs, but the result is not the float32
    # product, so greedy tokens may differ from transformers'. Still batch invariant. The
    # CPU's C++ kernels only.
    int8_activations: bool = False
    # Every token's numerics independent of its batch, chunk, step and neighbours, as vLLM's
    # VLLM_BATCH_INVARIANT: logprobs do not change with load, and `LLM.dense_kernels()` lets
    # the dense training forward reproduce them bit for bit (`docs/batch_invariance.md`). The
    # CPU's C++ kernels only; prefill attention runs each query by the decode path.
    batch_invariant: bool = False
    # "auto" (vLLM's default) with a Pallas failure at start-up (compile or first step): warn
    # once and run the next backend of the platform's auto list (XLA); False: raise instead.
    attention_fallback: bool = True
    # Weights and activations. "auto": the platform's choice, decided once at start-up (the
    # engine's config then holds it): on a GPU the checkpoint's dtype (bfloat16 for a GGUF),
    # on the CPU float32.
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # "auto" follows dtype; "fp8" (e4m3) halves KV bytes vs bf16
    # fp8 pools only: compute per-layer, per-KV-head scales from a calibration forward at
    # start-up (vLLM's name), or give them: a number, or a JSON file's path holding
    # {"k_scale": ..., "v_scale": ...} (see pagedjax/kv_scales.py). Neither: scales of 1.
    calculate_kv_scales: bool = False
    kv_cache_scales: float | str | None = None
    seed: int = 0  # seeds the draws of requests that give no seed
    # Queue order and preemption victims: "priority" (lower value first, then arrival) or
    # "fcfs" (arrival only), as in vLLM; policies live in pagedjax/core/sched_policy.py.
    scheduling_policy: str = "priority"
    # Schedule and prepare step N+1 while step N runs on the device (as vLLM v1's async
    # scheduling); its tokens from step N are read on the device. Greedy output is unchanged.
    async_scheduling: bool = True
    # Decode steps per dispatch (vLLM V0's name): a step whose every sequence decodes runs up
    # to this many forward+sample iterations in one jitted loop, its slots reserved ahead, so
    # the host's cost is paid once per loop (logprobs come back for every step, penalties keep
    # their history on the device, a row short of min_tokens runs up to it, a row whose token
    # mask follows each token, a grammar's or bad words', takes one step of the loop). Logits
    # processors and beams make the step a single one. Greedy output is unchanged; seeded
    # draws too (each row's key follows its token count).
    num_scheduler_steps: int = 1
    # Speculative decoding, as vLLM's dict ({"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4}; {"model": draft, "num_speculative_tokens": 4}) or a
    # SpeculativeConfig (`pagedjax/core/spec_decode.py`); None: none. Greedy output is
    # unchanged; sampled output keeps its distribution.
    speculative_config: SpeculativeConfig | dict | None = None
    # LoRA adapters (vLLM's keywords, `pagedjax/lora/`): up to max_loras adapters of rank up
    # to max_lora_rank in one step, each in a device slot; max_cpu_loras packed adapters kept
    # on the host (None: max_loras), the others read from their path again when needed.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Devices: tensor_parallel_size of them run each engine replica, the model split over
    # them (Megatron-style, `models/tensor_parallel.py`); data_parallel_size replicas, each
    # with its own scheduler and KV pool, share the requests (`pagedjax/data_parallel.py`).
    # Replica r runs on devices r*T .. r*T + T - 1 of `jax.devices()`.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Several hosts (`pagedjax/distributed.py`): process 0's host:port, the number of
    # processes and this one's id, for jax.distributed.initialize (else from the
    # PAGEDJAX_* variables; none needed if the script joined JAX's processes itself).
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # After start-up, move the objects alive then out of the collector's generations (as vLLM
    # does), so full collections stop rescanning the model's and tokenizer's objects.
    freeze_gc: bool = True

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> EngineConfig:
        """The config of `LLM(model, **options)`: EngineConfig's fields, and vLLM's engine
        keywords (`pagedjax/vllm_compat.py`); a TypeError names unknown options, a
        ValueError a vLLM keyword's unsupported value."""
        from pagedjax.vllm_compat import split_options

        known = {f.name for f in fields(cls)} - {"model"}
        return cls(model=model, **split_options(options, known))

    def _check_lora(self, check: Callable[[bool, str], None], drafting: bool) -> None:
        check(
            self.max_loras >= 1 and self.max_lora_rank >= 1,
            f"max_loras and max_lora_rank must be positive: {self.max_loras}, {self.max_lora_rank}",
        )
        check(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})",
        )
        check(
            not (self.enable_lora and drafting),
            'LoRA adapters with a draft model are not supported: use method "ngram"',
        )

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(
            self.block_size is None or self.block_size in SUPPORTED_BLOCK_SIZES,
            f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}",
        )
        check(self.max_model_len >= 1, f"max_model_len must be positive: {self.max_model_len}")
        check(self.max_num_seqs >= 1, f"max_num_seqs must be positive: {self.max_num_seqs}")
        check(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be positive: {self.max_num_batched_tokens}",
        )
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config)
        )
        check(self.swap_space >= 0, f"swap_space must be >= 0 GiB, got {self.swap_space}")
        check(
            self.preemption_mode in PREEMPTION_MODES,
            f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}",
        )
        backend = self.attention_backend
        check(
            backend in ATTENTION_BACKENDS
            if isinstance(backend, str)
            else callable(backend) and hasattr(backend, "supports"),
            f"attention_backend must be one of {ATTENTION_BACKENDS} or an AttentionBackend "
            f"object (kernels_pallas.backend), got {backend!r}",
        )
        check(
            self.dtype in DTYPE_NAMES,
            f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}",
        )
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPE_NAMES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_NAMES}, got {self.kv_cache_dtype!r}",
        )
        check(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            f"num_kv_blocks must be at least 2 (one is the null block): {self.num_kv_blocks}",
        )
        check(
            self.scheduling_policy in POLICIES,
            f"scheduling_policy must be one of {sorted(POLICIES)}, got {self.scheduling_policy!r}",
        )
        check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0")
        check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1]: {self.gpu_memory_utilization}",
        )
        check(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be positive: {self.tensor_parallel_size}",
        )
        check(
            self.data_parallel_size >= 1,
            f"data_parallel_size must be positive: {self.data_parallel_size}",
        )
        check(
            not (self.calculate_kv_scales and self.tensor_parallel_size > 1),
            "calculate_kv_scales runs on one device: calibrate with tensor_parallel_size=1 "
            "and give the scales as kv_cache_scales",
        )
        scaled = self.calculate_kv_scales or self.kv_cache_scales is not None
        check(
            not scaled or self.kv_cache_dtype.startswith("fp8"),
            "calculate_kv_scales and kv_cache_scales need an fp8 kv_cache_dtype, got "
            f"{self.kv_cache_dtype!r}",
        )
        check(
            not (self.calculate_kv_scales and self.kv_cache_scales is not None),
            "give calculate_kv_scales or kv_cache_scales, not both",
        )
        check(
            self.num_scheduler_steps >= 1,
            f"num_scheduler_steps must be positive: {self.num_scheduler_steps}",
        )
        check(
            self.num_scheduler_steps == 1 or self.speculative_config is None,
            "num_scheduler_steps > 1 and speculative decoding both run several tokens per "
            "step: choose one (num_scheduler_steps=1 with speculative_config)",
        )
        drafting = self.speculative_config is not None and self.speculative_config.model
        check(
            not (drafting and self.tensor_parallel_size > 1),
            "speculative decoding with a draft model runs on one device per engine: use "
            'tensor_parallel_size=1 (data_parallel_size replicates), or method "ngram"',
        )
        check(
            not (drafting and scaled),
            "fp8 KV scales are the target model's: drop kv_cache_scales and "
            'calculate_kv_scales with a draft model, or use method "ngram"',
        )
        self._check_lora(check, drafting)
        if self.kv_cache_scales is not None:
            from pagedjax.kv_scales import read_kv_scales  # imports JAX: only when needed

            read_kv_scales(self.kv_cache_scales)  # ValueError on a bad number, file or scale
