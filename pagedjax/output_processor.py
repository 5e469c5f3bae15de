"""The output processor: detokenizes what each step produced, finds stop strings, and builds the
`RequestOutput`s of vLLM's API (as vLLM v1's OutputProcessor does).

The engine core reports, per sequence, its new token and whether a stop token, max_tokens or
max_model_len finished it; text-level stops live here, because only the detokenized text can
match them: a stop string finishes the sequence, and the engine tells the core to free it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import repeat

from pagedjax.core.engine_request import RequestStatus, request_finished
from pagedjax.core.sched_output import CoreOutput, DecodeOutputs, EngineCoreOutput
from pagedjax.detokenizer import IncrementalDetokenizer
from pagedjax.logprobs import Logprob
from pagedjax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams


def logprob_entry(
    token: int, logprobs, row: int, k: int, decode: Callable[[int], str]
) -> dict[int, Logprob]:
    """vLLM's logprobs entry for one position: the chosen token, then the k most likely,
    each with its text (`decode`)."""
    entry = {token: Logprob(float(logprobs.logprobs[row]), int(logprobs.ranks[row]), decode(token))}
    top_ids, top_logprobs = logprobs.top_token_ids[row][:k], logprobs.top_logprobs[row][:k]
    for rank, (top_id, logprob) in enumerate(zip(top_ids, top_logprobs, strict=True), start=1):
        top_id = int(top_id)
        entry.setdefault(top_id, Logprob(float(logprob), rank, decode(top_id)))
    return entry


class TokenTexts:
    """Each token's own text, as vLLM's `Logprob.decoded_token` shows it (the token
    converted alone: a byte-level token that is part of a character shows as U+FFFD);
    remembered, since the same tokens come back step after step."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            text = self._texts[token] = self.tokenizer.convert_tokens_to_string([piece])
        return text


@dataclass(slots=True)
class _Sequence:
    """One of a request's n completions, as its outputs show it."""

    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    status: RequestStatus | None = None
    stop_reason: int | str | None = None
    num_returned_tokens: int = 0  # output tokens already in a DELTA output
    finish_time: float | None = None


@dataclass
class RequestState:
    """One user request: its prompt and its n completions (the first is the parent)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[_Sequence] = field(default_factory=list)
    first_token_time: float | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one entry per
    # prompt token, filled in as the parent's prefill chunks run.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served

    @property
    def finished(self) -> bool:
        return request_finished(self.params.n, [s.status for s in self.sequences])


_UNKNOWN = object()  # a row `_find_decode_rows` has not looked up yet (equal to no sink)


@dataclass
class _DecodeRows:
    """A steady decode batch's rows as the processor last found them: for each, the list
    its new token goes to (a FINAL_ONLY sequence without logprobs or stop strings, which
    needs nothing more until it ends), or None (it goes the general way)."""

    request_ids: list[str]
    indices: list[int]
    sinks: list[list[int] | None]
    all_sinks: bool  # no None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_text = TokenTexts(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self._decode_rows: _DecodeRows | None = None
        # Requests added, aborted or finished since: their rows are looked up again (an id
        # may come back as a new request).
        self._stale: set[str] = set()

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        state = RequestState(request_id, prompt, prompt_token_ids, params, arrival_time)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request_id] = state
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """Its rows' lists are looked up again at the next steady step."""
        rows = self._decode_rows
        if rows is None:
            return
        if len(self._stale) >= len(rows.sinks):  # more changed than kept: look all up again
            self._decode_rows, self._stale = None, set()
        else:
            self._stale.add(request_id)

    def _sequence(self, state: RequestState, index: int) -> _Sequence:
        """The index-th completion; the engine core forks children in index order."""
        if index == len(state.sequences):
            params = state.params
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                state.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
                deferred=params.output_kind is RequestOutputKind.FINAL_ONLY,
            )
            state.sequences.append(_Sequence(detokenizer))
        return state.sequences[index]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forgets the request; returns its final output (None if it was not running)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self._forget(request_id)
        now = time.monotonic()
        for seq in state.sequences:
            if seq.status is None:
                seq.detokenizer.finalize()
                seq.status, seq.finish_time = RequestStatus.FINISHED_ABORTED, now
        return self._make_output(state, finished=True)

    def process_outputs(
        self, core_outputs: list[CoreOutput]
    ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """(the outputs to return, by each request's output_kind; the (request id, index) of
        the running sequences a stop string finished, which the core must free)."""
        now = time.monotonic()
        requests = self.requests
        # The requests that progressed: True for those a sequence of which ended now (only
        # those can have finished).
        touched: dict[str, bool] = {}
        stopped: list[tuple[str, int]] = []
        for out in core_outputs:
            if isinstance(out, DecodeOutputs):
                self._process_decode(out, now, touched, stopped)
            else:
                self._process_one(out, now, touched, stopped)
        outputs = []
        for request_id, ended in touched.items():
            state = requests[request_id]
            finished = ended and state.finished
            if finished or state.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(state, finished))
            if finished:
                del requests[request_id]
                self._forget(request_id)
        return outputs, stopped

    def _process_one(
        self,
        out: EngineCoreOutput,
        now: float,
        touched: dict[str, bool],
        stopped: list[tuple[str, int]],
    ) -> None:
        """One sequence's output; marks its request in `touched` (True: a sequence ended)
        and adds it to `stopped` when a stop string ended it."""
        state = self.requests.get(out.request_id)
        if state is None:  # aborted since
            return
        if out.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, out)
        if out.num_cached_tokens is not None and out.index == 0:
            state.num_cached_tokens = out.num_cached_tokens
        if not out.new_token_ids and out.status is None:
            return  # a prefill chunk's prompt logprobs: output with the first token
        if out.index < len(state.sequences) and state.sequences[out.index].status is not None:
            return  # a stop string ended it: a core in another process ran on
        if self._update_sequence(state, out, now) is None:
            touched.setdefault(out.request_id, False)
            return
        touched[out.request_id] = True
        if out.status is None:  # a stop string ended it: the core still runs it
            stopped.append((out.request_id, out.index))

    def _process_decode(
        self,
        out: DecodeOutputs,
        now: float,
        touched: dict[str, bool],
        stopped: list[tuple[str, int]],
    ) -> None:
        """A steady decode step's rows: the tokens of those that need nothing more go
        straight to their detokenizers (no Python loop while no row is skipped); the rest
        go the general way."""
        rows, stale = self._decode_rows, self._stale
        if (
            rows is None
            or stale
            or rows.request_ids != out.request_ids
            or rows.indices != out.indices
        ):
            rows = self._find_decode_rows(out.request_ids, out.indices, rows, stale)
            self._decode_rows, self._stale = rows, set()
        tokens, skip, steps = out.token_ids, out.skip, out.steps
        add = list.append if steps == 1 else list.extend  # a token, or a step's list of them
        if rows.all_sinks and not skip:
            any(map(add, rows.sinks, tokens))
            return
        for row, (sink, token) in enumerate(zip(rows.sinks, tokens, strict=True)):
            if row in skip:
                continue
            if sink is not None:
                add(sink, token)
            else:
                new = [token] if steps == 1 else token
                one = EngineCoreOutput(
                    out.request_ids[row], out.indices[row], new, out.logprobs, row * steps
                )
                self._process_one(one, now, touched, stopped)

    def _find_decode_rows(
        self,
        request_ids: list[str],
        indices: list[int],
        last: _DecodeRows | None = None,
        stale: AbstractSet[str] = frozenset(),
    ) -> _DecodeRows:
        """Each row's token list, where its sequence needs nothing but its tokens until it
        ends: FINAL_ONLY, no logprobs, no stop strings, its first token out. The rows `last`
        had keep what they had there, but for the `stale` requests': a batch's rows change
        by a few a step, so only those are looked up."""
        keys = list(zip(request_ids, indices, strict=True))
        known = {}
        if last is not None:
            known = dict(
                zip(zip(last.request_ids, last.indices, strict=True), last.sinks, strict=True)
            )
        sinks = list(map(known.get, keys, repeat(_UNKNOWN)))
        if stale:
            for row, request_id in enumerate(request_ids):
                if request_id in stale:
                    sinks[row] = _UNKNOWN
        row = -1
        for _ in range(sinks.count(_UNKNOWN)):
            row = sinks.index(_UNKNOWN, row + 1)
            sinks[row] = self._sink_of(*keys[row])
        return _DecodeRows(request_ids, indices, sinks, None not in sinks)

    def _sink_of(self, request_id: str, index: int) -> list[int] | None:
        """A row's token list (`_find_decode_rows`), or None."""
        state = self.requests.get(request_id)
        if (
            state is not None
            and state.first_token_time is not None
            and index < len(state.sequences)
            and state.params.output_kind is RequestOutputKind.FINAL_ONLY
            and state.params.logprobs is None
            and state.sequences[index].status is None
        ):
            return state.sequences[index].detokenizer.token_sink
        return None

    def _add_prompt_logprobs(self, state: RequestState, out: EngineCoreOutput) -> None:
        entries, prompt = state.prompt_logprobs, state.prompt_token_ids
        first, count = out.prompt_logprobs_rows
        k = state.params.prompt_logprobs
        for row in range(first, first + count):
            token = prompt[len(entries)]
            entries.append(logprob_entry(token, out.prompt_logprobs, row, k, self.token_text))

    def _update_sequence(
        self, state: RequestState, out: EngineCoreOutput, now: float
    ) -> RequestStatus | None:
        """Applies a sequence's new token; returns its status if it ended (the core's, or a
        stop string's)."""
        seq, params = self._sequence(state, out.index), state.params
        tokens = out.new_token_ids
        if tokens and state.first_token_time is None and out.index == 0:
            state.first_token_time = now
        stop_string = None
        if out.logprobs is not None and params.logprobs is not None:
            stop_string = self._add_with_logprobs(seq, out, params.logprobs)
        elif tokens:  # several: a step that verified drafts, or ran several decode steps
            stop_string = seq.detokenizer.update(tokens)  # drops those after a stop string
        status, stop_reason = out.status, out.stop_reason
        by_stop_string = stop_string is not None and status is not RequestStatus.FINISHED_STOPPED
        if by_stop_string:
            status, stop_reason = RequestStatus.FINISHED_STOPPED, stop_string
        if status is None:
            return None
        if status is not RequestStatus.FINISHED_STOPPED or stop_string is None:
            seq.detokenizer.finalize()
        seq.status, seq.stop_reason, seq.finish_time = status, stop_reason, now
        return status

    def _add_with_logprobs(self, seq: _Sequence, out: EngineCoreOutput, k: int) -> str | None:
        """Each new token with its logprobs entry (rows from out.logprobs_row on), up to a stop
        string: the tokens after it are not output."""
        for row, token in enumerate(out.new_token_ids, start=out.logprobs_row):
            seq.cumulative_logprob += float(out.logprobs.logprobs[row])
            seq.logprobs.append(logprob_entry(token, out.logprobs, row, k, self.token_text))
            stop_string = seq.detokenizer.update([token])
            if stop_string is not None:
                return stop_string
        return None

    @staticmethod
    def _make_output(state: RequestState, finished: bool) -> RequestOutput:
        completions, deltas = [], []
        params = state.params
        want_logprobs = params.logprobs is not None
        only_new = params.output_kind is RequestOutputKind.DELTA
        for index, seq in enumerate(state.sequences):
            detokenizer = seq.detokenizer
            delta = detokenizer.get_delta()
            token_ids = detokenizer.output_token_ids  # a fresh list
            first = 0  # DELTA: what is new since this sequence's previous output
            if only_new:
                first, seq.num_returned_tokens = seq.num_returned_tokens, len(token_ids)
                token_ids = token_ids[first:]
            completions.append(
                CompletionOutput(
                    index=index,
                    text=delta if only_new else detokenizer.output_text,
                    token_ids=token_ids,
                    cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                    logprobs=seq.logprobs[first:] if want_logprobs else None,
                    finish_reason=seq.status.value if seq.status is not None else None,
                    stop_reason=seq.stop_reason,
                )
            )
            deltas.append(delta)
        finish_times = [s.finish_time for s in state.sequences if s.finish_time is not None]
        prompt_logprobs = state.prompt_logprobs
        if only_new and prompt_logprobs is not None:
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=RequestMetrics(
                arrival_time=state.arrival_time,
                first_token_time=state.first_token_time,
                finished_time=max(finish_times) if finished and finish_times else None,
            ),
            deltas=deltas,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
        )
