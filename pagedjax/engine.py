"""LLMEngine: requests in, one scheduled and executed step at a time, RequestOutputs out."""

from __future__ import annotations

import atexit
import gc
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from models.config import ModelConfig
from models.llama import Params
from pagedjax.config import EngineConfig
from pagedjax.core.engine_request import EngineRequest, RequestStatus
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.scheduler import Scheduler
from pagedjax.detokenizer import IncrementalDetokenizer
from pagedjax.errors import DuplicateRequestIdError, InvalidRequestError
from pagedjax.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedjax.platforms import current_platform
from pagedjax.sampler import TokenLogprobs
from pagedjax.sampling_params import RequestOutputKind, SamplingParams
from pagedjax.worker.model_runner import SampleRow, ScheduledSequence
from pagedjax.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    """One user request: its prompt and its n sequences (the first is the parent)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[EngineRequest] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one entry per
    # prompt token, filled in as the parent's prefill chunks run.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once

    @property
    def finished(self) -> bool:
        # Before its first token the parent has no siblings yet; it can only end then by
        # an error or an abort, which ends the whole group.
        complete = len(self.seqs) == self.params.n or self.seqs[0].status in (
            RequestStatus.FINISHED_ERROR,
            RequestStatus.FINISHED_ABORTED,
        )
        return complete and all(s.status.finished for s in self.seqs)


def _logprob_entry(token: int, logprobs: TokenLogprobs, row: int, k: int) -> dict[int, Logprob]:
    """vLLM's logprobs entry for one position: the chosen token, then the k most likely."""
    entry = {token: Logprob(float(logprobs.logprobs[row]), int(logprobs.ranks[row]))}
    top_ids, top_logprobs = logprobs.top_token_ids[row][:k], logprobs.top_logprobs[row][:k]
    for rank, (top_id, logprob) in enumerate(zip(top_ids, top_logprobs, strict=True), start=1):
        entry.setdefault(int(top_id), Logprob(float(logprob), rank))
    return entry


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        params: Params | None = None,
        tokenizer=None,
    ):
        from models.loader import load_tokenizer

        platform = current_platform()
        if config.block_size is None:
            config = replace(config, block_size=platform.default_block_size)
        self.config = config
        # The tokenizer loads on a thread while the weights load and pack: most of its time is
        # importing transformers, and the weights' numpy work releases the GIL.
        pool = ThreadPoolExecutor(1)
        pending = pool.submit(load_tokenizer, config.model) if tokenizer is None else None
        pool.shutdown(wait=False)  # the load already submitted runs on
        self.worker = Worker(config, platform, model_config, params)
        self.model_config = model_config = self.worker.model_config
        self.runner = self.worker.runner
        self.kv = KVCacheManager(
            self.worker.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            kv_spec=self.worker.kv_spec,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        )
        self.tokenizer = tokenizer if pending is None else pending.result()
        self.eos_token_ids = frozenset(
            model_config.eos_token_ids
            + ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        )
        self._groups: dict[str, _Group] = {}
        self._rng = np.random.default_rng(config.seed)
        self.num_generated_tokens = 0
        self.num_steps = 0
        # (end time, tokens generated) of recent steps, for the tokens/s statistic.
        self._recent_steps: deque[tuple[float, int]] = deque(maxlen=64)
        if config.freeze_gc:
            # The objects alive now (modules, tokenizer, the weights' Python side) leave the
            # collector's generations, so full collections stop rescanning them; reference
            # counting still frees them.
            gc.freeze()
            # Unfrozen at exit, so the interpreter's last collection still frees them:
            # extension objects never freed print leak reports (triton's bindings).
            atexit.unregister(gc.unfreeze)
            atexit.register(gc.unfreeze)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Validates everything first; raises ValueError (and changes nothing) on bad input."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise DuplicateRequestIdError(
                f"request id {request_id!r} is already in use; pick a new one"
            )
        prompt_text, prompt_ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-params.truncate_prompt_tokens :]  # left truncation
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.config.max_model_len - len(prompt_ids)
        self.scheduler.check_fits(len(prompt_ids), max(max_tokens, 1), params.n)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(2**31))
        group = _Group(request_id, prompt_text, prompt_ids, params)
        self._groups[request_id] = group
        parent = self._new_sequence(group, 0, base_seed, max_tokens, stop_ids, priority)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
            # Cached prompt tokens would be skipped, and their logprobs with them (as in vLLM).
            parent.skip_prefix_cache = len(prompt_ids) > 1
        if arrival_time is not None:
            parent.arrival_time = arrival_time
        self.scheduler.add_request(parent)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
            bad = [t for t in ids if not isinstance(t, (int, np.integer)) or isinstance(t, bool)]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be ints, got {bad[:5]!r}")
            vocab = self.model_config.vocab_size
            out_of_range = [t for t in ids if not 0 <= t < vocab]
            if out_of_range:
                raise InvalidRequestError(
                    f"prompt token ids {out_of_range[:5]} are outside the vocabulary [0, {vocab})"
                )
            ids = [int(t) for t in ids]
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        return text, ids

    def _new_sequence(
        self,
        group: _Group,
        index: int,
        base_seed: int,
        max_tokens: int,
        stop_ids: frozenset[int],
        priority: int,
    ) -> EngineRequest:
        params = group.params
        seq = EngineRequest(
            group.request_id if index == 0 else f"{group.request_id}#{index}",
            group.prompt_token_ids,
            params,
            max_tokens=max_tokens,
            seed=base_seed + index,
            priority=priority,
            stop_token_ids=stop_ids,
            parent_id=None if index == 0 else group.request_id,
            sample_index=index,
        )
        group.seqs.append(seq)
        group.detokenizers.append(
            IncrementalDetokenizer(
                self.tokenizer,
                group.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        )
        return seq

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Frees everything the requests hold; unknown or finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.pop(request_id, None)
            if group is None:
                continue
            for seq in group.seqs:
                self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns an output for each request that progressed."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        seqs, rows, row_seqs, forks, prompt_logprobs_asked = [], [], [], [], []
        for index, (seq, num_new) in enumerate(out.scheduled):
            start = seq.num_computed_tokens
            scheduled = ScheduledSequence(
                seq.all_token_ids[start : start + num_new], start, self.kv.get_block_ids(seq)
            )
            seqs.append(scheduled)
            if seq.skip_prefix_cache:  # set only while the parent's prompt logprobs are missing
                group = self._groups[seq.request_id]
                self._ask_prompt_logprobs(group, scheduled)
                if scheduled.prompt_logprob_targets:
                    prompt_logprobs_asked.append((group, len(scheduled.prompt_logprob_targets)))
            if start + num_new < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end: nothing to sample
            targets = [seq]
            group = self._groups[self._group_id(seq)]
            if seq.sample_index == 0 and seq.num_output_tokens == 0 and len(group.seqs) == 1:
                # n > 1: the children sample their first token from the parent's last logits,
                # then share its blocks (copy-on-write), instead of n prefills.
                for i in range(1, group.params.n):
                    child = self._new_sequence(
                        group, i, seq.seed, seq.max_tokens, seq.stop_token_ids, seq.priority
                    )
                    forks.append((seq, child))
                    targets.append(child)
            for target in targets:
                rows.append(self._sample_row(index, target))
                row_seqs.append(target)

        num_prompt_logprobs = max(
            (g.params.prompt_logprobs for g, _ in prompt_logprobs_asked), default=None
        )
        try:
            result = self.runner.execute(seqs, rows, out.block_copies, num_prompt_logprobs)
        except Exception:
            logger.exception("step failed; its %d requests finish with an error", len(seqs))
            return self._fail_step(out, forks)
        now = time.monotonic()
        self.num_steps += 1
        for seq, num_new in out.scheduled:
            seq.num_computed_tokens += num_new
        for parent, child in forks:
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)

        if prompt_logprobs_asked:
            self._store_prompt_logprobs(prompt_logprobs_asked, result.prompt_logprobs)
        touched: dict[str, _Group] = {}
        for row, seq in enumerate(row_seqs):
            self._append_token(seq, row, result, now)
            group_id = self._group_id(seq)
            touched[group_id] = self._groups[group_id]
        self._recent_steps.append((time.monotonic(), len(row_seqs)))
        outputs = []
        for group in touched.values():
            finished = group.finished
            if finished or group.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(group))
            if finished:
                del self._groups[group.request_id]
        return outputs

    def _fail_step(self, out, forks) -> list[RequestOutput]:
        """Finishes the step's requests with an error and frees their blocks; the engine goes on.

        If the failure consumed the donated pool, every other running request lost its KV too:
        it is preempted (recomputed later) and the prefix cache, whose blocks are gone, reset.
        """
        now = time.monotonic()
        failed = [seq for seq, _ in out.scheduled] + [child for _, child in forks]
        for seq in failed:
            seq.finish_time = now
            self.scheduler.finish(seq, RequestStatus.FINISHED_ERROR)
        if self.runner.kv_cache_lost():
            self.runner.reset_kv_cache()
            self.scheduler.preempt_all()
            self.kv.reset_prefix_cache()
        groups = {self._group_id(seq): self._groups[self._group_id(seq)] for seq in failed}
        for group in groups.values():  # siblings not in this step fail with their request
            for seq in group.seqs:
                self.scheduler.finish(seq, RequestStatus.FINISHED_ERROR)
        outputs = [self._make_output(group) for group in groups.values()]
        for output in outputs:
            del self._groups[output.request_id]
        return outputs

    @staticmethod
    def _group_id(seq: EngineRequest) -> str:
        return seq.parent_id if seq.parent_id is not None else seq.request_id

    @staticmethod
    def _ask_prompt_logprobs(group: _Group, scheduled: ScheduledSequence) -> None:
        """Names the prompt tokens this chunk predicts whose logprobs are still missing (a
        chunk recomputed after a preemption asks for none twice)."""
        prompt = group.prompt_token_ids
        start = scheduled.num_computed_tokens
        first = max(start, len(group.prompt_logprobs) - 1)
        stop = min(start + len(scheduled.token_ids), len(prompt) - 1)
        if first < stop:
            scheduled.prompt_logprob_targets = prompt[first + 1 : stop + 1]
            scheduled.prompt_logprobs_offset = first - start

    @staticmethod
    def _store_prompt_logprobs(asked: list[tuple[_Group, int]], logprobs: TokenLogprobs) -> None:
        """Appends each group's share of the step's prompt logprobs, in scheduling order."""
        row = 0
        for group, count in asked:
            entries, prompt = group.prompt_logprobs, group.prompt_token_ids
            for _ in range(count):
                token = prompt[len(entries)]
                entries.append(_logprob_entry(token, logprobs, row, group.params.prompt_logprobs))
                row += 1
            group.seqs[0].skip_prefix_cache = len(entries) < len(prompt)

    def _sample_row(self, seq_index: int, seq: EngineRequest) -> SampleRow:
        params = seq.params
        bias = {}
        if seq.num_output_tokens < params.min_tokens:
            bias = {t: -np.inf for t in seq.stop_token_ids | self.eos_token_ids}
        return SampleRow(
            seq_index, params, seq.all_token_ids, seq.num_prompt_tokens, seq.seed, bias
        )

    def _append_token(self, seq: EngineRequest, row: int, result, now: float) -> None:
        if not result.finite[row]:
            logger.error("request %s: NaN/inf logits; it finishes with an error", seq.request_id)
            seq.finish_time = now
            self.scheduler.finish(seq, RequestStatus.FINISHED_ERROR)
            return
        token = int(result.token_ids[row])
        seq.append_token_ids(token)
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if result.logprobs is not None and seq.params.logprobs is not None:
            seq.cumulative_logprob += float(result.logprobs.logprobs[row])
            seq.logprobs.append(_logprob_entry(token, result.logprobs, row, seq.params.logprobs))

        group = self._groups[self._group_id(seq)]
        detokenizer = group.detokenizers[seq.sample_index]
        stop_string = detokenizer.update([token])
        status = self._check_stop(seq, token, stop_string)
        if status is not None:
            if status is not RequestStatus.FINISHED_STOPPED or stop_string is None:
                detokenizer.finalize()
            seq.finish_time = now
            self.scheduler.finish(seq, status)

    def _check_stop(
        self, seq: EngineRequest, token: int, stop_string: str | None
    ) -> RequestStatus | None:
        num_output_tokens = seq.num_output_tokens
        if num_output_tokens >= seq.params.min_tokens:
            if token in seq.stop_token_ids:
                # vLLM reports the id of a user stop token, and None for plain EOS.
                seq.stop_reason = token if token in seq.params.stop_token_ids else None
                return RequestStatus.FINISHED_STOPPED
            if stop_string is not None:
                seq.stop_reason = stop_string
                return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, group: _Group) -> RequestOutput:
        completions, deltas = [], []
        want_logprobs = group.params.logprobs is not None
        only_new = group.params.output_kind is RequestOutputKind.DELTA
        for seq, detokenizer in zip(group.seqs, group.detokenizers, strict=True):
            delta = detokenizer.get_delta()
            first = 0  # DELTA: what is new since this sequence's previous output
            if only_new:
                first, seq.num_returned_tokens = seq.num_returned_tokens, seq.num_output_tokens
            completions.append(
                CompletionOutput(
                    index=seq.sample_index,
                    text=delta if only_new else detokenizer.output_text,
                    token_ids=seq.all_token_ids[seq.num_prompt_tokens + first :],
                    cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                    logprobs=seq.logprobs[first:] if want_logprobs else None,
                    finish_reason=seq.status.value if seq.status.finished else None,
                    stop_reason=seq.stop_reason,
                )
            )
            deltas.append(delta)
        parent = group.seqs[0]
        finish_times = [s.finish_time for s in group.seqs if s.finish_time is not None]
        prompt_logprobs = group.prompt_logprobs
        if only_new and prompt_logprobs is not None:
            prompt_logprobs = None if group.prompt_logprobs_sent else prompt_logprobs
            group.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            metrics=RequestMetrics(
                arrival_time=parent.arrival_time,
                first_token_time=parent.first_token_time,
                finished_time=max(finish_times) if group.finished and finish_times else None,
            ),
            deltas=deltas,
            prompt_logprobs=prompt_logprobs,
        )

    # --------------------------------------------------------------------- stats

    def stats(self) -> dict:
        ledger = self.kv.memory_ledger()
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": ledger.usage,
            "prefix_cache_hit_rate": self.kv.prefix_cache_stats.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compilations": self.runner.num_compilations,
            "num_generated_tokens": self.num_generated_tokens,
            "generation_tokens_per_s": self._tokens_per_second(),
        }

    def _tokens_per_second(self) -> float:
        if len(self._recent_steps) < 2:
            return 0.0
        (start, _), (end, _) = self._recent_steps[0], self._recent_steps[-1]
        tokens = sum(n for _, n in list(self._recent_steps)[1:])
        return tokens / max(end - start, 1e-9)
