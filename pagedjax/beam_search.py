"""Beam search, as vLLM's `LLM.beam_search`: `beam_width` beams per prompt, each step extended
by the 2 x beam_width most likely tokens of every beam, the best beam_width kept.

Each step is one `generate` call of one token per live beam, with the beam's tokens as its
prompt: the prefix cache serves every full block a beam shares with its parent, so beams
share their prefix blocks (ref counted) and each step computes only their last, partial
block. A beam ending in EOS (unless ignore_eos) is complete; at the end the complete and the
live beams are ranked by cumulative logprob / length ** length_penalty (length counting the
prompt, as vLLM does; EOS not counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedjax.outputs import Logprob
from pagedjax.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedjax.inputs import PromptType
    from pagedjax.llm import LLM


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


def beam_search(
    llm: LLM, prompts: Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False
) -> list[BeamSearchOutput]:
    """`llm.beam_search`: see the module docstring."""
    from pagedjax.inputs import parse_prompts

    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    width = params.beam_width
    step_params = SamplingParams(
        temperature=params.temperature,
        max_tokens=1,
        logprobs=2 * width,
        ignore_eos=True,  # the beams' EOS is decided here, from the candidates
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    starts = []
    for prompt in parse_prompts(prompts):
        _, ids = engine._tokenize(prompt)
        starts.append(ids)
    beams = [[BeamSearchSequence(list(ids))] for ids in starts]
    complete: list[list[BeamSearchSequence]] = [[] for _ in starts]
    for _ in range(params.max_tokens):
        live = [(i, beam) for i, group in enumerate(beams) for beam in group]
        if not live:
            break
        outputs = llm.generate([beam.tokens for _, beam in live], step_params, use_tqdm=use_tqdm)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in starts]
        for (i, beam), output in zip(live, outputs, strict=True):
            entry = output.outputs[0].logprobs[0]
            for token, logprob in entry.items():
                new = BeamSearchSequence(
                    beam.tokens + [token],
                    beam.logprobs + [entry],
                    beam.cum_logprob + logprob.logprob,
                )
                if token == eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    complete[i].append(new)
                else:
                    candidates[i].append(new)
        beams = [sorted(c, key=score, reverse=True)[:width] for c in candidates]
    results = []
    for i in range(len(starts)):
        for beam in beams[i]:
            beam.finish_reason = "length"
        best = sorted(complete[i] + beams[i], key=score, reverse=True)[:width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens)  # the prompt's and the beam's, as vLLM
        results.append(BeamSearchOutput(best))
    return results
