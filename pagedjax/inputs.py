"""Prompts as vLLM takes them: a string, token ids, or `TextPrompt` / `TokensPrompt` dicts.

    llm.generate("Hello")                                   # one text prompt
    llm.generate(["Hello", "Bonjour"])                      # a batch
    llm.generate({"prompt": "Hello"})                       # TextPrompt
    llm.generate([{"prompt_token_ids": [1, 2, 3]}])         # TokensPrompt, in a batch
    llm.generate([1, 2, 3])                                 # token ids: one prompt

`parse_prompts` turns any of these into a list of `Prompt`s, or raises `InvalidRequestError`
naming what it could not read. `cache_salt` keeps a prompt's prefix-cache entries apart from
other users' (vLLM's field). vLLM's multimodal fields are refused: pagedjax runs text models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from pagedjax.errors import InvalidRequestError


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """A prompt as text, tokenized by the engine."""

    cache_salt: str


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_Tokens, total=False):
    """A prompt as token ids; `prompt` (its text) is optional and only echoed back."""

    prompt: str
    cache_salt: str


PromptType = str | list[int] | TextPrompt | TokensPrompt

_TEXT_KEYS = {"prompt", "cache_salt"}
_TOKENS_KEYS = {"prompt_token_ids", "prompt", "cache_salt"}
_MULTIMODAL_KEYS = {"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"}


@dataclass(frozen=True)
class Prompt:
    """One parsed prompt: text to tokenize, or token ids (with optional text to echo)."""

    text: str | None
    token_ids: list[int] | None
    cache_salt: str | None = None

    @property
    def source(self) -> str | list[int]:
        """What the engine tokenizes: the ids when given, else the text."""
        return self.token_ids if self.token_ids is not None else self.text


def _is_token_ids(value: object) -> bool:
    """A list of token ids (checked one by one when tokenized) rather than of prompts."""
    return (
        isinstance(value, list)
        and bool(value)
        and isinstance(value[0], (int, np.integer))
        and not isinstance(value[0], bool)
    )


def parse_prompt(prompt: object) -> Prompt:
    """One prompt of any accepted form; InvalidRequestError for anything else."""
    if isinstance(prompt, str):
        return Prompt(prompt, None)
    if _is_token_ids(prompt) or prompt == []:
        return Prompt(None, list(prompt))
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys & _MULTIMODAL_KEYS:
            raise InvalidRequestError(
                f"{sorted(keys & _MULTIMODAL_KEYS)}: pagedjax runs text models; give the "
                "prompt as text or token ids"
            )
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequestError(f"cache_salt must be a string, got {salt!r}")
        if "prompt_token_ids" in prompt:
            unknown = keys - _TOKENS_KEYS
            ids = prompt["prompt_token_ids"]
            if not unknown and isinstance(ids, list):
                return Prompt(prompt.get("prompt"), list(ids), salt)
        elif "prompt" in prompt:
            unknown = keys - _TEXT_KEYS
            if not unknown and isinstance(prompt["prompt"], str):
                return Prompt(prompt["prompt"], None, salt)
        else:
            unknown = keys
        if unknown:
            raise InvalidRequestError(
                f"a prompt dict has unknown keys {sorted(unknown)}: a TextPrompt holds "
                "'prompt' (and 'cache_salt'), a TokensPrompt 'prompt_token_ids' (and "
                "'prompt', 'cache_salt')"
            )
    raise InvalidRequestError(
        f"cannot read a prompt from {type(prompt).__name__} {prompt!r:.80}: give a string, a "
        "list of token ids, or a TextPrompt / TokensPrompt dict"
    )


def parse_prompts(prompts: PromptType | Sequence[PromptType]) -> list[Prompt]:
    """A single prompt or a sequence of them -> the list of parsed prompts."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [parse_prompt(prompts)]
    if isinstance(prompts, Sequence):
        return [parse_prompt(p) for p in prompts]
    return [parse_prompt(prompts)]
