"""Beam search, as vLLM's `LLM.beam_search`: `beam_width` beams per prompt, each step extended
by the 2 x beam_width most likely tokens of every beam, the best beam_width kept.

Each beam is a sequence in the engine, sampling with its top 2 x beam_width logprobs. When a
beam has sampled it is held (not scheduled) until every live beam of its prompt has; then
the candidates are ranked and the engine's sequences follow the choice: a beam's first
chosen extension replaces the token it sampled (whose KV is not computed yet), each further
one is a copy-on-write fork sharing every block (`Scheduler.fork_request`), and a beam with
none is freed. So beams share their prefix blocks and each step computes one token per beam.
A beam ending in EOS (unless ignore_eos) is complete; at the end the complete and the live
beams are ranked by cumulative logprob / length ** length_penalty (length counting the
prompt, as vLLM does; EOS not counted).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedjax.core.engine_request import EngineRequest
from pagedjax.errors import InvalidRequestError
from pagedjax.logprobs import Logprob
from pagedjax.output_processor import TokenTexts, logprob_entry
from pagedjax.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedjax.engine import LLMEngine
    from pagedjax.inputs import PromptType


@dataclass
class BeamSearchSequence:
    """One beam: the prompt and its tokens so far, their logprobs, and the cumulative one."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beam_width beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's ranking: cumulative logprob over length ** length_penalty (EOS not counted)."""
    length = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cum_logprob / (length**length_penalty)


@dataclass
class _Beam:
    """A live beam: its sequence in the engine, and its logprobs entry once it has sampled."""

    request: EngineRequest
    seq: BeamSearchSequence
    prompt: int
    entry: dict[int, Logprob] | None = None


def beam_search(
    engine: LLMEngine,
    prompts: Sequence[PromptType],
    params: BeamSearchParams,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """`llm.beam_search`: see the module docstring. `concurrency_limit`: prompts searched
    at once (at most what the engine's sequence slots hold)."""
    from pagedjax.inputs import parse_prompts

    if not engine.is_leader:
        return engine.follow() or []
    if engine.core_process is not None:
        raise InvalidRequestError(
            "beam_search forks sequences in the engine core: build the LLM without core_process"
        )
    if engine.has_unfinished_requests():
        raise InvalidRequestError(
            "beam_search steps the engine on its own: let its other requests finish (or abort "
            "them) first"
        )
    starts = [engine._tokenize(prompt)[1] for prompt in parse_prompts(prompts)]
    for ids in starts:
        engine.engine_core.check_fits(len(ids), params.max_tokens, 1)
    slots = engine.config.max_num_seqs * len(engine.workers)
    limit = max(1, min(concurrency_limit or len(starts), slots // params.beam_width))
    search = _Search(engine, params, starts)
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(starts), desc="Beam search", dynamic_ncols=True)
    try:
        while search.num_finished < len(starts):
            search.admit(limit)
            finished = search.num_finished
            search.step()
            if bar is not None:
                bar.update(search.num_finished - finished)
    except BaseException:
        search.core.abort_requests(list(search.live))  # leave the engine clean for the next call
        raise
    finally:
        if bar is not None:
            bar.close()
    results = search.results()
    engine.end_call(results)
    return results


class _Search:
    """One beam search's state over the engine's core: the live beams of each prompt, the
    done ones, and the prompts not started yet."""

    def __init__(self, engine: LLMEngine, params: BeamSearchParams, starts: list[list[int]]):
        self.core = engine.engine_core
        self.tokenizer = engine.tokenizer
        self.eos = self.tokenizer.eos_token_id
        self.params, self.starts = params, starts
        self.step_params = SamplingParams(
            temperature=params.temperature,
            max_tokens=params.max_tokens,
            logprobs=2 * params.beam_width,
            ignore_eos=True,  # the beams' EOS is decided here, from the candidates
        )
        self.texts = TokenTexts(self.tokenizer)
        self.search_id = uuid.uuid4().hex
        self.num_requests = 0
        self.live: dict[str, _Beam] = {}
        self.beams: list[list[_Beam]] = [[] for _ in starts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in starts]  # complete or at length
        self.next_prompt = self.num_finished = 0

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty
        )

    def new_request(self, tokens: list[int], prompt: list[int]) -> EngineRequest:
        self.num_requests += 1
        request = EngineRequest(
            f"beam-{self.search_id}-{self.num_requests}",
            prompt,
            self.step_params,
            max_tokens=self.params.max_tokens,
            seed=self.num_requests,  # a sampled token is replaced by the chosen one: any seed does
        )
        request.all_token_ids = list(tokens)
        request.hold_samples = True
        return request

    def admit(self, limit: int) -> None:
        """Starts prompts until `limit` are searched at once."""
        while self.next_prompt < len(self.starts) and self.next_prompt - self.num_finished < limit:
            ids = self.starts[self.next_prompt]
            request = self.new_request(ids, ids)
            self.core.add_request(request)
            beam = _Beam(request, BeamSearchSequence(list(ids)), self.next_prompt)
            self.beams[self.next_prompt] = [beam]
            self.live[request.request_id] = beam
            self.next_prompt += 1

    def step(self) -> None:
        """One engine step; each prompt whose live beams have all sampled then selects."""
        num_steps = self.core.num_steps
        outputs = self.core.step()
        if self.core.num_steps == num_steps and not self.core.has_step_in_flight():
            raise RuntimeError("beam search stalled: the engine scheduled no step")
        reported = set()
        for out in outputs:
            beam = self.live.get(out.request_id)
            if beam is None:
                continue
            if out.new_token_ids:
                width = 2 * self.params.beam_width
                beam.entry = logprob_entry(
                    out.new_token_ids[0], out.logprobs, out.logprobs_row, width, self.texts
                )
            else:  # NaN logits ended it: the beam is dropped
                del self.live[out.request_id]
                self.beams[beam.prompt].remove(beam)
            reported.add(beam.prompt)
        for i in sorted(reported):
            if all(beam.entry is not None for beam in self.beams[i]):
                self.select(i)
                if not self.beams[i]:
                    self.num_finished += 1

    def candidates(self, i: int) -> list[tuple[_Beam, int, BeamSearchSequence]]:
        """Prompt i's extensions of its live beams, best first; those ending in EOS are done."""
        candidates = []
        for beam in self.beams[i]:
            for token, logprob in beam.entry.items():
                seq = BeamSearchSequence(
                    beam.seq.tokens + [token],
                    beam.seq.logprobs + [beam.entry],
                    beam.seq.cum_logprob + logprob.logprob,
                )
                if token == self.eos and not self.params.ignore_eos:
                    seq.finish_reason = "stop"
                    self.done[i].append(seq)
                else:
                    candidates.append((beam, token, seq))
        candidates.sort(key=lambda c: self.score(c[2]), reverse=True)
        return candidates

    def select(self, i: int) -> None:
        """Ranks prompt i's candidates and makes the engine's sequences follow the best."""
        kept: list[_Beam] = []
        followed: set[str] = set()
        for beam, token, seq in self.candidates(i)[: self.params.beam_width]:
            request = beam.request
            if request.status.finished:  # it reached max_tokens
                seq.finish_reason = "length"
                self.done[i].append(seq)
            elif request.request_id not in followed:
                followed.add(request.request_id)
                request.all_token_ids[-1] = token
                request.held = False
                kept.append(_Beam(request, seq, i))
            else:
                tokens = request.all_token_ids[:-1] + [token]
                child = self.new_request(tokens, request.prompt_token_ids)
                self.core.fork_request(request, child)
                kept.append(_Beam(child, seq, i))
        dropped = [
            b.request.request_id for b in self.beams[i] if b.request.request_id not in followed
        ]
        self.core.abort_requests(dropped)  # frees them (finished ones are ignored)
        for request_id in dropped:
            self.live.pop(request_id, None)
        for beam in kept:
            self.live[beam.request.request_id] = beam
        self.beams[i] = kept

    def results(self) -> list[BeamSearchOutput]:
        results = []
        for done in self.done:
            best = sorted(done, key=self.score, reverse=True)[: self.params.beam_width]
            for beam in best:
                beam.text = self.tokenizer.decode(beam.tokens)  # the prompt's and the beam's
            results.append(BeamSearchOutput(best))
        return results
