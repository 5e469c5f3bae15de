"""The engine core: schedule, execute, update, one step at a time (as vLLM v1's EngineCore).

It owns the scheduler (with the KV cache manager) and the worker (with the model and the KV
pool), takes `EngineRequest`s, and returns per-sequence `EngineCoreOutput`s; text, stop
strings and `RequestOutput`s are the output processor's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

from models.llama import Params
from pagedjax.config import EngineConfig
from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.sched_output import CoreOutput, EngineCoreOutput, SchedulerOutput
from pagedjax.core.sched_policy import POLICIES
from pagedjax.core.scheduler import RequestLimits, Scheduler
from pagedjax.core.swap_policy import SwapCostModel, preemption_policy
from pagedjax.errors import InvalidRequestError
from pagedjax.worker.model_runner import StepHandle, seqs_bucket
from pagedjax.worker.worker import Worker

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, worker: Worker):
        self.config, self.worker = config, worker
        windows = worker.kv_groups.windows
        self.kv_cache_manager: KVCacheManager | HybridKVCacheManager
        if len(windows) > 1:  # layers that attend differently: a table per group
            self.kv_cache_manager = HybridKVCacheManager(
                worker.num_blocks,
                config.block_size,
                windows,
                enable_caching=config.enable_prefix_caching,
                kv_spec=worker.kv_spec,
            )
        else:
            self.kv_cache_manager = KVCacheManager(
                worker.num_blocks,
                config.block_size,
                enable_caching=config.enable_prefix_caching,
                kv_spec=worker.kv_spec,
                num_host_blocks=worker.num_host_blocks,
                sliding_window=windows[0],
            )
        prefer_swap = None  # without a host tier every victim recomputes
        if worker.num_host_blocks:
            model, platform = worker.model_config, worker.platform
            swap_cost = SwapCostModel(
                bytes_per_token=worker.kv_spec.bytes_per_token,
                matmul_flops_per_token=2 * model.num_layer_params(),
                attention_flops_per_token_pair=4 * model.num_layers * model.q_size,
                transfer_bytes_per_s=platform.host_transfer_bytes_per_s,
                flops_per_s=platform.flops_per_s,
            )
            prefer_swap = preemption_policy(config.preemption_mode, swap_cost)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=POLICIES[config.scheduling_policy](),
            prefer_swap=prefer_swap,
            speculative=config.speculative_config,
            num_scheduler_steps=config.num_scheduler_steps,
            placeholder_stride=seqs_bucket(config),
            max_loras=config.max_loras if config.enable_lora else 0,
            steady_decode=worker.steady_decode,
        )
        self.num_steps = 0  # steps dispatched
        self.num_model_steps = 0  # forward passes they ran (several per multi-step step)
        self.device_wait_s = 0.0  # time blocked on steps' results: the rest is the host's
        # Async scheduling: the step on the device while the next one is scheduled.
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        # (end time, tokens sampled) of recent steps, for the tokens/s statistic.
        self._recent_steps: deque[tuple[float, int]] = deque(maxlen=64)

    def add_request(self, request: EngineRequest) -> None:
        if request.lora_id:
            lora = self.worker.runner.lora
            if request.lora_adapter is not None or not lora.known(request.lora_id):
                # A new adapter the front end read (or another replica's): registered here,
                # between steps; read from its path if not given.
                lora.add(request.lora_request, request.lora_adapter)
            request.lora_adapter = None
        self.scheduler.add_request(request)

    def abort_requests(self, group_ids: list[str]) -> None:
        """Frees everything the user requests hold; unknown or finished ids are ignored."""
        for group_id in group_ids:
            self.scheduler.finish_group(group_id, RequestStatus.FINISHED_ABORTED)

    def fork_request(self, parent: EngineRequest, child: EngineRequest) -> None:
        """Adds `child` continuing `parent`'s blocks (see Scheduler.fork_request)."""
        self.scheduler.fork_request(parent, child)

    def finish_sequences(self, sequences: list[tuple[str, int]], status: RequestStatus) -> None:
        """Finishes sequences (request id, index) the output processor ended (stop strings)."""
        for group_id, index in sequences:
            root = self.scheduler.requests.get(group_id)
            if root is not None:
                self.scheduler.finish(root.group[index], status)

    def has_unfinished_requests(self) -> bool:
        # An in-flight step holding only finished sequences is completed (and its rows
        # dropped) by whichever step comes next.
        return self.scheduler.has_unfinished_requests()

    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def num_unfinished_sequences(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_generated_tokens(self) -> int:
        return self.scheduler.num_generated_tokens

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        """Raises ValueError if such a request could never run (see Scheduler.check_fits)."""
        self.scheduler.check_fits(num_prompt_tokens, max_tokens, n)

    def request_limits(self) -> RequestLimits:
        return self.scheduler.limits()

    def has_request(self, group_id: str) -> bool:
        """Whether a user request still has a sequence unfinished here."""
        return group_id in self.scheduler.requests

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block; False (nothing changed) while requests hold
        blocks or a step is in flight."""
        if self.has_unfinished_requests() or self.has_step_in_flight():
            return False
        self.kv_cache_manager.reset_prefix_cache()
        return True

    # ------------------------------------------------------------ weights in and out

    def settle(self) -> list[CoreOutput]:
        """Completes the step in flight, if any, and preempts every running request: their
        KV is recomputed when they run again (after new weights, or a pool given back)."""
        outputs = self._complete(*self._in_flight) if self._in_flight is not None else []
        self._in_flight = None
        self.scheduler.preempt_all()
        return outputs

    def update_weights(self, params: Params) -> list[CoreOutput]:
        """New weights (pagedjax layout) between steps; returns the outputs of the step that
        was in flight. Unfinished requests keep their tokens and recompute their KV on the
        new weights; the prefix cache, computed with the old ones, is forgotten."""
        outputs = self.settle()
        self.worker.set_params(params)
        self.kv_cache_manager.reset_prefix_cache()
        return outputs

    def sleep(self, level: int = 1) -> None:
        """Frees the device memory (see Worker.sleep); only while no request is unfinished."""
        if self.has_unfinished_requests():
            raise InvalidRequestError(
                "sleep() while requests are unfinished: let them finish or abort them first"
            )
        self.settle()
        self.worker.sleep(level)
        self.kv_cache_manager.reset_prefix_cache()  # the pool's contents are gone

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.worker.wake_up(tags)

    def warmup(self) -> float:
        """Compiles every step shape now; returns the seconds spent."""
        return self.worker.warmup()

    def step(self) -> list[CoreOutput]:
        """Schedules and dispatches a step; returns what each sequence that progressed got.

        With async scheduling the step's results are those of the step dispatched by the
        previous call: this step was scheduled and its inputs prepared while that one ran on
        the device, and its sequences' tokens from that one are read on the device.
        """
        out = self.scheduler.schedule()
        in_flight, self._in_flight = self._in_flight, None
        outputs = []
        handle = None
        # A step may only swap (its one request preempted itself): the copies still run.
        if out.scheduled or out.swaps_out or out.swaps_in:
            try:
                handle = self.worker.execute_model(out, in_flight[1] if in_flight else None)
            except Exception:
                logger.exception(
                    "step failed; its %d requests finish with an error", len(out.scheduled)
                )
                outputs += self._fail_step(out)
        if in_flight is not None:
            outputs += self._complete(*in_flight)
        if handle is not None:
            if self.config.async_scheduling:
                self._in_flight = (out, handle)
            else:
                outputs += self._complete(out, handle)
        return outputs

    def _complete(self, out: SchedulerOutput, handle: StepHandle) -> list[CoreOutput]:
        """Waits for a dispatched step and updates its requests from what it produced."""
        start = time.perf_counter()
        try:
            result = handle.result()
        except Exception:
            logger.exception(
                "step failed; its %d requests finish with an error", len(out.scheduled)
            )
            return self._fail_step(out)
        self.device_wait_s += time.perf_counter() - start
        self.num_steps += 1
        self.num_model_steps += out.num_steps
        outputs = self.scheduler.update_from_output(out, result)
        sampled = sum(out.row_steps) if out.row_steps else len(out.row_requests)
        self._recent_steps.append((time.monotonic(), sampled))
        return outputs

    def _fail_step(self, out: SchedulerOutput) -> list[EngineCoreOutput]:
        """Finishes the step's requests with an error and frees their blocks; the engine goes on.

        If the failure consumed the donated pool, every other running request lost its KV too:
        it is preempted (recomputed later) and the prefix cache, whose blocks are gone, reset.
        """
        group_ids = dict.fromkeys(request.group_id for request, _ in out.scheduled)
        error = RequestStatus.FINISHED_ERROR
        groups = {g: self.scheduler.finish_group(g, error) for g in group_ids}
        if self.worker.kv_cache_lost():
            self.worker.reset_kv_cache()
            self.scheduler.preempt_all()
            self.kv_cache_manager.reset_prefix_cache()
        return [
            EngineCoreOutput(group_id, request.sample_index, status=error)
            for group_id, group in groups.items()
            for request in group
        ]

    def stats(self) -> dict:
        ledger = self.kv_cache_manager.memory_ledger()
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": ledger.usage,
            "kv_blocks_used": ledger.used_blocks,
            "kv_blocks_total": ledger.total_blocks,
            "prefix_cache_hit_rate": self.kv_cache_manager.prefix_cache_stats.hit_rate,
            # Prompt tokens found in the host tier (copied back, not recomputed).
            "prefix_cache_host_hit_rate": self.kv_cache_manager.prefix_cache_stats.host_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped_preemptions": self.scheduler.num_swaps,
            "host_kv_blocks_used": ledger.host_used_blocks,
            "host_kv_blocks_cached": ledger.host_cached_blocks,
            "host_kv_blocks_total": ledger.host_total_blocks,
            "num_compilations": self.worker.runner.num_compilations,
            "num_steps": self.num_steps,
            "num_model_steps": self.num_model_steps,
            "device_wait_s": self.device_wait_s,
            "num_generated_tokens": self.scheduler.num_generated_tokens,
            "num_prompt_tokens": self.scheduler.num_prompt_tokens,
            "generation_tokens_per_s": self._tokens_per_second(),
            **self.scheduler.spec_stats.as_dict(),
            **self.worker.memory_stats(),
        }

    def _tokens_per_second(self) -> float:
        if len(self._recent_steps) < 2:
            return 0.0
        (start, _), (end, _) = self._recent_steps[0], self._recent_steps[-1]
        tokens = sum(n for _, n in list(self._recent_steps)[1:])
        return tokens / max(end - start, 1e-9)
