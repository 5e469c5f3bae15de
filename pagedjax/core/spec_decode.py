"""Speculative decoding's options and counters (vLLM's `speculative_config`).

A proposer guesses a running sequence's next `num_speculative_tokens` tokens: n-gram lookup on
the host (`ngram_proposer.py`), or a draft model on the device within the step
(`pagedjax/worker/draft_model.py`). The scheduler schedules them after the sequence's last
token, and one step of the target model verifies them all
(`pagedjax/sampler.py`: greedy rows accept a draft equal to their argmax, sampled rows by
rejection sampling, so the output keeps the target distribution). The accepted prefix and one
token of the target's own are kept; the slots of rejected drafts are given back.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram" (prompt lookup): the longest suffix of the sequence, of
    prompt_lookup_min to prompt_lookup_max tokens, that occurred before proposes the tokens that
    followed its latest occurrence. method "draft_model" (the default when `model` is given):
    the checkpoint at `model`, whose tokenizer must be the target's, proposes its greedy
    continuation; `num_hidden_layers` keeps only its first layers (the target's own path
    with a few layers is a draft that needs no second checkpoint). disable_by_batch_size: no
    speculation while more requests than that are unfinished (spare compute runs out in large
    batches)."""

    num_speculative_tokens: int
    method: str | None = None
    model: str | None = None
    num_hidden_layers: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"speculative_config: {message}")

        if self.method is None:  # as vLLM: a draft model when one is named
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        check(self.method in SPEC_METHODS, f"method must be one of {SPEC_METHODS}: {self.method!r}")
        check(
            (self.model is not None) == (self.method == "draft_model"),
            'method "draft_model" needs a model (the draft checkpoint) and only it takes one',
        )
        check(
            self.model is None or Path(self.model).expanduser().exists(),
            f"the draft model {self.model!r} does not exist: give a Hugging Face model directory "
            "or a .gguf file with the target's tokenizer",
        )
        check(
            self.num_hidden_layers is None
            or (isinstance(self.num_hidden_layers, int) and self.num_hidden_layers >= 1),
            f"num_hidden_layers must be None or an int >= 1, got {self.num_hidden_layers!r}",
        )
        check(
            isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 1,
            f"num_speculative_tokens must be an int >= 1, got {self.num_speculative_tokens!r}",
        )
        # As vLLM: one bound given sets the other; neither: lookups of 2 to 4 tokens.
        high = self.prompt_lookup_max or self.prompt_lookup_min or 4
        low = self.prompt_lookup_min or min(self.prompt_lookup_max or 2, 2)
        object.__setattr__(self, "prompt_lookup_max", high)
        object.__setattr__(self, "prompt_lookup_min", low)
        check(
            1 <= low <= high,
            f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}",
        )
        check(
            self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
            f"disable_by_batch_size must be None or >= 1, got {self.disable_by_batch_size}",
        )

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig, None, or vLLM's dict (`{"method": "ngram",
        "num_speculative_tokens": 5, "prompt_lookup_max": 4}`); an unknown key is an error."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a dict or a SpeculativeConfig, got {value!r}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown keys {unknown}; pagedjax supports {sorted(known)}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**value)


class DraftModelSlots:
    """The scheduler's proposer for a draft model: how many drafts a sequence gets, with
    stand-in ids; the draft model proposes their values on the device within the step, so the
    sequence's last token need not be known on the host yet (async scheduling)."""

    on_device = True

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    def propose(self, request: object, limit: int) -> list[int]:
        return [0] * max(0, min(self.k, limit))


@dataclass
class SpecDecodeStats:
    """Counters since start-up, named as vLLM's metrics."""

    num_drafts: int = 0  # sequence steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def as_dict(self) -> dict[str, float]:
        drafts, proposed = self.num_drafts, self.num_draft_tokens
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": proposed,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            # Accepted share of the proposed tokens, and tokens a drafted step emits (the
            # accepted ones and the target's own).
            "spec_decode_acceptance_rate": self.num_accepted_tokens / proposed if proposed else 0.0,
            "spec_decode_mean_acceptance_length": (
                1 + self.num_accepted_tokens / drafts if drafts else 0.0
            ),
        }
