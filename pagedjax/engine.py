"""LLMEngine: requests in, `RequestOutput`s out, one step at a time (vLLM's LLMEngine).

It checks and tokenizes each request, hands it to the engine core (schedule, execute, update:
`engine_core.py`), and turns the core's per-sequence results into outputs through the output
processor (detokenize, stop strings: `output_processor.py`).
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import jax
import numpy as np

from models.config import ModelConfig
from models.llama import Params
from models.loader import load_tokenizer
from models.peft import LoRAAdapter, LoRAError, check_adapter, load_peft_adapter
from models.training import DenseKernels
from pagedjax import distributed
from pagedjax.config import EngineConfig
from pagedjax.constraints import ConstraintBuilder
from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.sched_output import CoreOutput
from pagedjax.data_parallel import DataParallelCore, replica_devices
from pagedjax.distributed import StepChannel
from pagedjax.engine_core import EngineCore
from pagedjax.engine_core_client import CoreProcessClient
from pagedjax.errors import DuplicateRequestIdError, EngineSleepingError, InvalidRequestError
from pagedjax.inputs import Prompt, PromptType, parse_prompt
from pagedjax.lora.request import LoRARequest
from pagedjax.output_processor import OutputProcessor
from pagedjax.outputs import RequestOutput
from pagedjax.platforms import current_platform, reserve_device_memory
from pagedjax.sampling_params import SamplingParams
from pagedjax.weight_sync import as_params
from pagedjax.worker.worker import Worker


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        params: Params | None = None,
        tokenizer=None,
        *,
        core_process: bool = False,
    ):
        """core_process: run the engine core (scheduler, model, KV pool) in a process of its
        own (`engine_core_client.py`), so this process's work (a server's HTTP, tokenizing,
        detokenizing) never holds the core's interpreter lock; one host only, weights loaded
        from `config.model`."""
        # The tokenizer loads on a thread while the weights load and pack: most of its time is
        # importing transformers, and the weights' numpy work releases the GIL.
        pool = ThreadPoolExecutor(1)
        source = config.tokenizer or config.model
        pending = pool.submit(load_tokenizer, source) if tokenizer is None else None
        pool.shutdown(wait=False)  # the load already submitted runs on
        self.core_process: CoreProcessClient | None = None
        if core_process:
            if params is not None or distributed.joins_processes(config.coordinator_address):
                raise ValueError(
                    "core_process runs one host's engine on weights it loads itself: drop "
                    "params and the coordinator address, or run the core in this process"
                )
            self.core_process = CoreProcessClient(config)
            self.channel, self.is_leader, self.workers = None, True, []
            self.engine_core: EngineCore | DataParallelCore | CoreProcessClient = self.core_process
            config, self.model_config = self.core_process.config, self.core_process.model_config
        else:
            config = self._start_core(config, model_config, params)
        self.config = config
        self.loras: dict[int, LoRARequest] = {}  # the LoRA adapters requests may name, by id
        self._lora_versions: dict[int, int] = {}  # adapters replaced in place: how often
        self.tokenizer = tokenizer if pending is None else pending.result()
        self.output_processor = OutputProcessor(self.tokenizer)
        self.constraints = ConstraintBuilder(self.tokenizer, self.model_config.vocab_size)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(
            self.model_config.eos_token_ids + (() if eos is None else (eos,))
        )
        self._rng = np.random.default_rng(config.seed)
        if config.freeze_gc:
            # The objects alive now (modules, tokenizer, the weights' Python side) leave the
            # collector's generations, so full collections stop rescanning them; reference
            # counting still frees them.
            gc.freeze()
            # Unfrozen at exit, so the interpreter's last collection still frees them:
            # extension objects never freed print leak reports (triton's bindings).
            atexit.unregister(gc.unfreeze)
            atexit.register(gc.unfreeze)

    def _start_core(
        self, config: EngineConfig, model_config: ModelConfig | None, params: Params | None
    ) -> EngineConfig:
        """Builds the workers and engine cores in this process; returns the config as the
        workers resolved it."""
        reserve_device_memory(config.gpu_memory_utilization)  # before JAX starts a backend
        # Processes join before JAX touches a device; then the leader schedules.
        distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
        self.channel = StepChannel() if jax.process_count() > 1 else None
        self.is_leader = self.channel is None or self.channel.is_leader
        platform = current_platform()
        if config.block_size is None:
            config = replace(config, block_size=platform.default_block_size)
        # One engine core per data-parallel replica, each on its own devices.
        replicas = replica_devices(config) or [None]
        self.workers = [
            Worker(config, platform, model_config, params, devices, self.channel, replica)
            for replica, devices in enumerate(replicas)
        ]
        # The worker decides "auto" options once (the dtype): the engine's config holds them.
        config = self.workers[0].config
        cores = [EngineCore(config, worker) for worker in self.workers]
        self.engine_core = cores[0] if len(cores) == 1 else DataParallelCore(cores)
        self.model_config = self.workers[0].model_config
        return config

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates everything first; raises ValueError (and changes nothing) on bad input.
        lora_request: the LoRA adapter it runs with (enable_lora), read now if new."""
        if request_id in self.output_processor.requests:
            raise DuplicateRequestIdError(
                f"request id {request_id!r} is already in use; pick a new one"
            )
        request, prompt_text = self.process_request(
            request_id, prompt, params, priority, arrival_time, lora_request
        )
        self.add_processed_request(request, prompt_text)

    def process_request(
        self,
        request_id: str,
        prompt: PromptType | Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineRequest, str | None]:
        """Tokenizes and validates a request without touching the engine's state, so a caller
        on another thread (AsyncLLM's) can do it while steps run; raises ValueError on bad
        input. Returns the request and its prompt text (None for token ids)."""
        self._check_awake()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        prompt = prompt if isinstance(prompt, Prompt) else parse_prompt(prompt)
        prompt_text, prompt_ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-params.truncate_prompt_tokens :]  # left truncation
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.config.max_model_len - len(prompt_ids)
        self.engine_core.check_fits(len(prompt_ids), max(max_tokens, 1), params.n)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        constraints = self.constraints.build(params)  # InvalidRequestError if malformed
        if params.logits_processors and self.core_process is not None:
            raise InvalidRequestError(
                "logits_processors are Python callables that run beside the scheduler: they "
                "need the engine core in this process (core_process=False)"
            )
        if constraints is not None and self.channel is not None:
            # Their host state (grammars, callables) lives in process 0 only.
            raise InvalidRequestError(
                "allowed_token_ids, bad_words, logits_processors and structured outputs run "
                "on one host for now; serve this model from a single process to use them"
            )
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**31))
        request = EngineRequest(
            request_id,
            prompt_ids,
            params,
            max_tokens=max_tokens,
            seed=seed,
            priority=priority,
            arrival_time=arrival_time,
            stop_token_ids=stop_ids,
            min_tokens_banned=stop_ids | self.eos_token_ids,
            constraints=constraints,
        )
        request.cache_salt = prompt.cache_salt  # a key of its prefix-cache blocks
        if lora_request is not None:
            request.lora_request, request.lora_adapter = lora_request, self._adapter(lora_request)
            request.lora_id = lora_request.lora_int_id  # a key of its prefix-cache blocks too
            request.lora_version = self._lora_versions.get(request.lora_id)
        return request, prompt_text

    def _adapter(self, lora_request: LoRARequest) -> LoRAAdapter | None:
        """The adapter a request names, read and checked the first time the engine sees it
        (None after that); InvalidRequestError saying what is wrong."""
        if not self.config.enable_lora:
            raise InvalidRequestError("lora_request needs an engine with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(
                f"lora_request must be a pagedjax.lora.request.LoRARequest, got "
                f"{type(lora_request).__name__}"
            )
        known = self.loras.get(lora_request.lora_int_id)
        if known is not None:
            if known.lora_name != lora_request.lora_name:
                raise InvalidRequestError(
                    f"lora_int_id {lora_request.lora_int_id} is adapter {known.lora_name!r}: "
                    f"give {lora_request.lora_name!r} an id of its own"
                )
            return None
        try:
            adapter = load_peft_adapter(lora_request.lora_path)
            check_adapter(adapter, self.model_config, self.config.max_lora_rank)
        except LoRAError as error:
            raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r}: {error}") from None
        return adapter

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> bool:
        """Registers an adapter before any request names it (vLLM's), read from its path, or
        the given one (an adapter held in memory); the same id again replaces its weights."""
        if adapter is None:
            adapter = self._adapter(lora_request)
            if adapter is None:
                return True  # known already
        elif self.core_process is not None:
            raise InvalidRequestError(
                "an adapter from memory needs the engine core in this process (core_process=False)"
            )
        else:
            check_adapter(adapter, self.model_config, self.config.max_lora_rank)
            lora_id = lora_request.lora_int_id
            if lora_id in self.loras:  # new weights: blocks cached under the old ones never hit
                self._check_unused(lora_id, "replaced")
                self._lora_versions[lora_id] = self._lora_versions.get(lora_id, 0) + 1
        for core in self.cores:
            core.worker.runner.lora.add(lora_request, adapter)
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter no unfinished request uses; False if unknown. With the engine
        core in its own process, its copy leaves the core's caches as others fill them."""
        if lora_id not in self.loras:
            return False
        self._check_unused(lora_id, "removed")
        for core in self.cores:
            core.worker.runner.lora.remove(lora_id)
        del self.loras[lora_id]
        return True

    def _check_unused(self, lora_id: int, change: str) -> None:
        requests = [r for core in self.cores for r in core.scheduler.requests.values()]
        if any(r.lora_id == lora_id for r in requests):
            raise InvalidRequestError(
                f"LoRA adapter {lora_id} is in use by unfinished requests: it can be {change} "
                "once they finish"
            )

    def list_loras(self) -> set[int]:
        """The ids of the adapters the engine holds."""
        return set(self.loras)

    def add_processed_request(self, request: EngineRequest, prompt_text: str | None) -> None:
        """Queues a request from `process_request`; its id must not be in use."""
        if request.lora_request is not None:  # the core registers a new one (EngineCore)
            self.loras.setdefault(request.lora_id, request.lora_request)
        self.output_processor.add_request(
            request.request_id,
            prompt_text,
            request.prompt_token_ids,
            request.params,
            request.arrival_time,
        )
        self.engine_core.add_request(request)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        ids = self.tokenizer.encode(prompt.text) if prompt.token_ids is None else prompt.token_ids
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or isinstance(t, bool)]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be ints, got {bad[:5]!r}")
        vocab = self.model_config.vocab_size
        out_of_range = [t for t in ids if not 0 <= t < vocab]
        if out_of_range:
            raise InvalidRequestError(
                f"prompt token ids {out_of_range[:5]} are outside the vocabulary [0, {vocab})"
            )
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        return prompt.text, [int(t) for t in ids]

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Frees everything the requests hold; unknown or finished ids are ignored. Returns
        the final output (finish reason "abort") of each request that was running."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(ids)
        outputs = (self.output_processor.abort_request(request_id) for request_id in ids)
        return [output for output in outputs if output is not None]

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block; False (nothing changed) while requests run."""
        return self.engine_core.reset_prefix_cache()

    # ------------------------------------------------------------ weights in and out

    @property
    def cores(self) -> list[EngineCore]:
        """The engine cores of this process (none when the core runs in its own)."""
        core = self.engine_core
        if isinstance(core, CoreProcessClient):
            return []
        return core.cores if isinstance(core, DataParallelCore) else [core]

    def update_weights(self, params: Params | Mapping[str, object]) -> list[RequestOutput]:
        """Replaces the model's weights between steps (`pagedjax/weight_sync.py` has the
        whole story); returns the outputs of the step that was in flight (with the core in
        its own process, the next `step()` returns them)."""
        if self.core_process is not None:
            self.core_process.update_weights(params)  # checked there: ModelLoadError
            return []
        outputs, stopped = self.output_processor.process_outputs(self.update_core_weights(params))
        if stopped:
            self.engine_core.finish_sequences(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def update_core_weights(self, params: Params | Mapping[str, object]) -> list[CoreOutput]:
        """`update_weights` for this process's cores; returns what their steps in flight
        produced."""
        params = as_params(self.model_config, params)  # ModelLoadError, nothing changed
        core_outputs = []
        for core in self.cores:
            if self.is_leader:
                core_outputs += core.update_weights(params)
            else:  # a follower's scheduler is idle: only its devices take the weights
                core.worker.set_params(params)
        return core_outputs

    def dense_kernels(self) -> DenseKernels:
        """The kernels with which `models.training`'s dense forward computes this engine's
        logprobs bit for bit (`docs/batch_invariance.md`); a batch-invariant engine only."""
        if not self.config.batch_invariant:
            raise ValueError(
                "dense_kernels() reproduces a batch-invariant engine's arithmetic (decode rows "
                "and prefill chunks alike): build the engine with batch_invariant=True"
            )
        if not self.workers:
            raise ValueError("dense_kernels() needs the engine core in this process")
        return self.workers[0].platform.dense_kernels(self.config.block_size)

    def sleep(self, level: int = 1) -> None:
        if self.core_process is not None:
            self.core_process.sleep(level)
        for core in self.cores:
            core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.core_process is not None:
            self.core_process.wake_up(tags)
        for core in self.cores:
            core.wake_up(tags)

    def is_sleeping(self) -> bool:
        if self.core_process is not None:
            return self.core_process.is_sleeping()
        return any(core.worker.is_sleeping for core in self.cores)

    def has_weights(self) -> bool:
        if self.core_process is not None:
            return self.core_process.has_weights()
        return all(core.worker.has_weights for core in self.cores)

    def _check_awake(self) -> None:
        if self.is_sleeping():
            raise EngineSleepingError("the engine is asleep: call wake_up() before generating")
        if not self.has_weights():
            raise EngineSleepingError(
                "the engine has no weights (sleep(level=2) discarded them): give new ones "
                "with update_weights() or load_weights()"
            )

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns an output for each request that progressed,
        as its `output_kind` asks."""
        core_outputs = self.engine_core.step()
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.engine_core.finish_sequences(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    # ------------------------------------------------------------ several hosts

    def end_call(self, result: object = None) -> None:
        """Leader: the user's call (a `generate`) is done; followers return `result`."""
        if self.channel is not None:
            self.channel.send(("end", 0, result))

    def follow(self, until_stop: bool = False) -> object:
        """Follower: makes the device calls of the leader's engine until its call ends (or,
        `until_stop`, until it shuts down); returns the leader's result (None when the
        leader shut down)."""
        while True:
            kind, replica, payload = self.channel.receive()
            if kind == "end" and not until_stop:
                return payload
            if kind == "stop":
                return None
            self.workers[replica].follow(kind, payload)

    def shutdown(self) -> None:
        """Leader: releases the followers for good (they stop following); stops the core's
        process."""
        if self.core_process is not None:
            self.core_process.shutdown()
        if self.channel is not None and self.is_leader:
            self.channel.send(("stop", 0, None))

    @property
    def num_generated_tokens(self) -> int:
        return self.engine_core.num_generated_tokens

    def stats(self) -> dict:
        return self.engine_core.stats()
