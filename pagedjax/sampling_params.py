"""SamplingParams: vLLM's fields, names, defaults and validation."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Greedy when temperature is below this, as in vLLM.
_GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far: the whole text, all token ids and logprobs
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes (what LLM.generate asks for)


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

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE
