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
from pagedjax.output_processor import TokenTexts, logprob_entry
from pagedjax.outputs import Logprob
from pagedjax.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from pagedjax.engine import LLMEngine
    from pagedjax.inputs import PromptType


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(
                f"beam_width must be in [1, {MAX_LOGPROBS // 2}] (2 x beam_width candidates per "
                f"beam are read from the logprobs), got {self.beam_width}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")


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
    if engine.has_unfinished_requests():
        raise InvalidRequestError(
            "beam_search steps the engine on its own: let its other requests finish (or abort "
            "them) first"
        )
    core = engine.engine_core
    tokenizer = engine.tokenizer
    eos = tokenizer.eos_token_id
    width = params.beam_width
    starts = [engine._tokenize(prompt)[1] for prompt in parse_prompts(prompts)]
    for ids in starts:
        core.check_fits(len(ids), params.max_tokens, 1)
    step_params = SamplingParams(
        temperature=params.temperature,
        max_tokens=params.max_tokens,
        logprobs=2 * width,
        ignore_eos=True,  # the beams' EOS is decided here, from the candidates
    )
    texts = TokenTexts(tokenizer)
    search_id = uuid.uuid4().hex

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    def new_request(index: int, tokens: list[int], prompt: list[int]) -> EngineRequest:
        request = EngineRequest(
            f"beam-{search_id}-{index}",
            prompt,
            step_params,
            max_tokens=params.max_tokens,
            seed=index,  # a sampled token is replaced by the chosen one: any seed does
        )
        request.all_token_ids = list(tokens)
        request.hold_samples = True
        return request

    num_requests = 0
    live: dict[str, _Beam] = {}
    beams: list[list[_Beam]] = [[] for _ in starts]
    done: list[list[BeamSearchSequence]] = [[] for _ in starts]  # complete or at max_tokens
    slots = engine.config.max_num_seqs * len(engine.workers)
    limit = max(1, min(concurrency_limit or len(starts), slots // width))
    next_prompt = num_finished = 0
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(starts), desc="Beam search", dynamic_ncols=True)

    def select(i: int) -> None:
        """Ranks prompt i's candidates and makes the engine's sequences follow the best."""
        candidates = []
        for beam in beams[i]:
            for token, logprob in beam.entry.items():
                seq = BeamSearchSequence(
                    beam.seq.tokens + [token],
                    beam.seq.logprobs + [beam.entry],
                    beam.seq.cum_logprob + logprob.logprob,
                )
                if token == eos and not params.ignore_eos:
                    seq.finish_reason = "stop"
                    done[i].append(seq)
                else:
                    candidates.append((beam, token, seq))
        candidates.sort(key=lambda c: score(c[2]), reverse=True)
        nonlocal num_requests
        kept: list[_Beam] = []
        followed: set[str] = set()
        for beam, token, seq in candidates[:width]:
            request = beam.request
            if request.status.finished:  # it reached max_tokens
                seq.finish_reason = "length"
                done[i].append(seq)
            elif request.request_id not in followed:
                followed.add(request.request_id)
                request.all_token_ids[-1] = token
                request.held = False
                kept.append(_Beam(request, seq, i))
            else:
                num_requests += 1
                tokens = request.all_token_ids[:-1] + [token]
                child = new_request(num_requests, tokens, request.prompt_token_ids)
                core.fork_request(request, child)
                kept.append(_Beam(child, seq, i))
        dropped = [b.request.request_id for b in beams[i] if b.request.request_id not in followed]
        core.abort_requests(dropped)  # frees them (finished ones are ignored)
        for request_id in dropped:
            live.pop(request_id, None)
        for beam in kept:
            live[beam.request.request_id] = beam
        beams[i] = kept

    try:
        while num_finished < len(starts):
            while next_prompt < len(starts) and next_prompt - num_finished < limit:
                num_requests += 1
                ids = starts[next_prompt]
                request = new_request(num_requests, ids, ids)
                core.add_request(request)
                beam = _Beam(request, BeamSearchSequence(list(ids)), next_prompt)
                beams[next_prompt] = [beam]
                live[request.request_id] = beam
                next_prompt += 1
            num_steps = core.num_steps
            outputs = core.step()
            if core.num_steps == num_steps and not core.has_step_in_flight():
                raise RuntimeError("beam search stalled: the engine scheduled no step")
            reported = set()
            for out in outputs:
                beam = live.get(out.request_id)
                if beam is None:
                    continue
                if out.new_token_ids:
                    token = out.new_token_ids[0]
                    beam.entry = logprob_entry(
                        token, out.logprobs, out.logprobs_row, 2 * width, texts
                    )
                else:  # NaN logits ended it: the beam is dropped
                    del live[out.request_id]
                    beams[beam.prompt].remove(beam)
                reported.add(beam.prompt)
            for i in sorted(reported):
                if all(beam.entry is not None for beam in beams[i]):
                    select(i)
                    if not beams[i]:
                        num_finished += 1
                        if bar is not None:
                            bar.update(1)
    except BaseException:
        core.abort_requests(list(live))  # leave the engine clean for the next call
        raise
    finally:
        if bar is not None:
            bar.close()
    results = []
    for i in range(len(starts)):
        best = sorted(done[i], key=score, reverse=True)[:width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens)  # the prompt's and the beam's, as vLLM
        results.append(BeamSearchOutput(best))
    engine.end_call(results)
    return results
