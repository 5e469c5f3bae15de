"""Per-request constraints on the sampled tokens, kept on the host: allowed tokens, bad
words, structured outputs (a grammar) and vLLM's per-request logits processors.

Each sequence that has any carries a `RequestConstraints` (`EngineRequest.constraints`). When
the scheduler builds its sample row it asks for the tokens banned now (bad words, as -inf
biases); the model runner, once it has dispatched the step's forward, builds the step's token
masks (allowed tokens and each grammar's next tokens, a bitmask: bit t of 32-bit word
t // 32) with `MaskFiller`, all grammar rows in parallel, while the forward runs on the
device; the sampler applies them as data, with no recompilation per request
(`pagedjax/sampler.py`). Each sampled token advances the grammar (`accept`); a grammar that is
complete ends the sequence. Such a sequence needs its previous token on the host, so with
async scheduling it waits for it (`SamplingParams.needs_output_on_host`).

Structured outputs run on llguidance, one of the grammar libraries vLLM itself uses (its
"guidance" backend): JSON schemas, regular expressions, choices and Lark grammars (GBNF is
converted), with masks computed in Rust.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pagedjax.errors import InvalidRequestError
from pagedjax.sampling_params import SamplingParams, StructuredOutputsParams

NEG_INF = float("-inf")


def mask_words(vocab_size: int) -> int:
    """32-bit words of a token mask over the vocabulary."""
    return -(-vocab_size // 32)


def pack_tokens(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """[words] int32 bitmask with the bits of `token_ids` set."""
    bits = np.zeros(mask_words(vocab_size) * 32, np.uint8)
    bits[np.asarray(token_ids, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def unpack_tokens(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids whose bits a [words] bitmask sets."""
    bits = np.unpackbits(np.asarray(mask, np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


class RequestConstraints:
    """One sequence's constraints (see the module docstring)."""

    def __init__(
        self,
        allowed: np.ndarray | None,
        bad_words: list[list[int]],
        matcher: Any,
        processors: Sequence[Callable[..., Any]],
        vocab_size: int,
    ):
        self.allowed = allowed  # [words] int32 bitmask, or None
        self.bad_words = bad_words  # each word's token ids
        self.matcher = matcher  # an llguidance.LLMatcher, or None
        self.processors = tuple(processors)
        self.vocab_size = vocab_size

    def fork(self) -> RequestConstraints:
        """A copy for a sibling sequence (n > 1): the grammar's state is its own."""
        matcher = None if self.matcher is None else self.matcher.deep_copy()
        return RequestConstraints(
            self.allowed, self.bad_words, matcher, self.processors, self.vocab_size
        )

    def banned(self, output_ids: Sequence[int]) -> dict[int, float]:
        """-inf biases for the last tokens of bad words whose other tokens end the output."""
        banned = {}
        for word in self.bad_words:
            prefix = len(word) - 1
            if prefix == 0 or (
                len(output_ids) >= prefix and list(output_ids[-prefix:]) == word[:-1]
            ):
                banned[word[-1]] = NEG_INF
        return banned

    @property
    def masks(self) -> bool:
        """Whether it limits the next token to a set (allowed tokens, a grammar)."""
        return self.allowed is not None or self.matcher is not None

    def accept(self, token: int) -> bool:
        """Advances the grammar by a sampled token; True when the grammar is complete."""
        if self.matcher is None:
            return False
        self.matcher.consume_token(token)
        return self.matcher.is_stopped()


class MaskFiller:
    """Builds a step's token masks: every grammar row's at once, on llguidance's threads (the
    GIL released), while the step's forward runs on the device."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._executor = None

    def fill(
        self, constraints: Sequence[RequestConstraints | None], num_rows: int
    ) -> np.ndarray | None:
        """[num_rows, words] i32 bitmasks for a step's rows (all bits set for a row without
        one); None when no row limits its tokens."""
        if not any(c is not None and c.masks for c in constraints):
            return None
        out = np.full((num_rows, mask_words(self.vocab_size)), -1, np.int32)
        grammars = [(c.matcher, i) for i, c in enumerate(constraints) if c and c.matcher]
        if grammars:
            from llguidance import LLExecutor
            from llguidance.numpy import fill_next_token_bitmask_par

            if self._executor is None:
                self._executor = LLExecutor()
            fill_next_token_bitmask_par(self._executor, grammars, out)
        for row, c in enumerate(constraints):
            if c is not None and c.allowed is not None:
                out[row] &= c.allowed
        return out


def apply_processors(
    processors: Sequence[Callable[..., Any]],
    prompt_ids: list[int],
    output_ids: list[int],
    logits: np.ndarray,
) -> np.ndarray:
    """vLLM's per-request logits processors in order: fn(output_ids, logits) or
    fn(prompt_ids, output_ids, logits), each returning the new [V] logits."""
    for fn in processors:
        if len(inspect.signature(fn).parameters) == 3:
            logits = fn(prompt_ids, output_ids, logits)
        else:
            logits = fn(output_ids, logits)
        logits = np.asarray(logits, np.float32)
    return logits


class ConstraintBuilder:
    """Checks a request's constraints and builds its `RequestConstraints` (engine-wide: the
    grammar tokenizer is built once, at the first structured request)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._grammar_tokenizer = None

    def build(self, params: SamplingParams) -> RequestConstraints | None:
        """None when `params` has no constraint; InvalidRequestError saying what is wrong."""
        allowed = None
        if params.allowed_token_ids is not None:
            outside = [t for t in params.allowed_token_ids if t >= self.vocab_size]
            if outside:
                raise InvalidRequestError(
                    f"allowed_token_ids contains out-of-vocab token id! {outside[:5]} are not "
                    f"in [0, {self.vocab_size})"
                )
            allowed = pack_tokens(params.allowed_token_ids, self.vocab_size)
        bad_words = self._bad_words(params.bad_words or [])
        matcher = None
        if params.structured_outputs is not None:
            matcher = self._matcher(params.structured_outputs)
        processors = params.logits_processors or ()
        if allowed is None and not bad_words and matcher is None and not processors:
            return None
        return RequestConstraints(allowed, bad_words, matcher, processors, self.vocab_size)

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens alone and after a space (when that is another word of as many
        tokens), as vLLM tokenizes them."""
        token_lists: list[list[int]] = []
        for word in dict.fromkeys(words):
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise InvalidRequestError(
                    f"bad_words entries must tokenize to at least one token: {word!r}"
                )
            token_lists.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                token_lists.append(spaced)
        outside = [t for ids in token_lists for t in ids if not 0 <= t < self.vocab_size]
        if outside:
            raise InvalidRequestError(f"bad_words tokenize to ids outside the vocabulary {outside}")
        return token_lists

    def _matcher(self, spec: StructuredOutputsParams) -> Any:
        import llguidance

        try:
            grammar = grammar_of(spec)
        except Exception as e:  # noqa: BLE001  (the grammar compilers' errors have no common type)
            raise InvalidRequestError(f"structured_outputs: invalid grammar: {e}") from e
        tokenizer = self.grammar_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidRequestError(f"structured_outputs: invalid grammar: {messages[0]}")
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise InvalidRequestError(f"structured_outputs: {matcher.get_error()}")
        return matcher

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, over the model's whole vocabulary."""
        if self._grammar_tokenizer is None:
            import llguidance.hf

            try:
                self._grammar_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size
                )
            except ValueError as e:  # a decoder llguidance cannot read
                raise InvalidRequestError(
                    f"structured outputs need a tokenizer llguidance can read (byte-level "
                    f"BPE or SentencePiece); this model's cannot be: {e}"
                ) from e
        return self._grammar_tokenizer


def grammar_of(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for a structured outputs constraint."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        schema = json.loads(schema) if isinstance(schema, str) else dict(schema)
        if spec.disable_additional_properties and schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice))
    # Lark, or GBNF (llama.cpp's EBNF) converted, as vLLM's guidance backend takes them.
    return LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
