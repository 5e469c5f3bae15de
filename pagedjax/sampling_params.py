"""SamplingParams: vLLM's fields, names, defaults and validation."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Greedy when temperature is below this, as in vLLM.
_GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far: the whole text, all token ids and logprobs
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes (what LLM.generate asks for)


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint on the generated text.

    json: a JSON schema (dict or JSON text); regex: a regular expression; choice: one of
    these strings; grammar: a Lark (or GBNF) grammar; json_object: any JSON object.
    disable_any_whitespace: no free whitespace between JSON tokens."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
            if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: {given}"
            )
        if not given:
            raise ValueError(
                "You must use one kind of structured outputs constraint but none are specified"
            )
        if self.structural_tag is not None:
            raise ValueError("structural_tag is not supported; give json, regex, choice or grammar")
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported; see disable_any_whitespace")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"choice must be a list of non-empty strings, got {self.choice!r}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"json must be a JSON schema: {e}") from e


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token after the first, as in vLLM
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Words never generated: a word's last token is banned where the output ends with the
    # tokens before it (with and without a leading space, as vLLM does).
    bad_words: list[str] | None = None
    # vLLM's per-request callables fn(output_ids, logits) or fn(prompt_ids, output_ids,
    # logits) -> logits, on a row's float32 numpy logits; each such step waits for them.
    logits_processors: list[Callable[..., Any]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify()
        if self.temperature < _GREEDY_TEMPERATURE:
            # Greedy: truncation settings cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}")
        check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be greater than zero, got {self.repetition_penalty}",
        )
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            f"top_k must be -1 or 0 (disable) or at least 1, got {self.top_k}",
        )
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
        )
        check(
            self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
            f"truncate_prompt_tokens must be at least 1, got {self.truncate_prompt_tokens}",
        )
        check(all(self.stop), "stop strings must not be empty")
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}",
        )
        check(
            self.seed is None or isinstance(self.seed, int),
            f"seed must be an int or None, got {self.seed!r}",
        )
        check(
            isinstance(self.output_kind, RequestOutputKind),
            f"output_kind must be a RequestOutputKind, got {self.output_kind!r}",
        )
        check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids is not None and empty!",
        )
        check(
            self.allowed_token_ids is None
            or all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
            f"allowed_token_ids must be non-negative ints, got {self.allowed_token_ids}",
        )
        check(
            all(isinstance(w, str) and w.strip() for w in self.bad_words or []),
            f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}",
        )
        check(
            all(callable(f) for f in self.logits_processors or []),
            "logits_processors must be callables fn(output_ids, logits) or "
            "fn(prompt_ids, output_ids, logits)",
        )
        check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams, got "
            f"{type(self.structured_outputs).__name__}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def needs_output_on_host(self) -> bool:
        """Whether sampling a token needs the previous tokens' values on the host: penalties
        (sent as arrays), bad words, logits processors and structured outputs."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.bad_words)
            or bool(self.logits_processors)
            or self.structured_outputs is not None
        )


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
