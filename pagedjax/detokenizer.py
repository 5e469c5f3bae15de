"""Incremental detokenization with stop strings, as vLLM does it.

The engine feeds each request's new token ids to its `IncrementalDetokenizer`, which turns them
into text in O(new tokens) per step, checks the stop strings and holds back the characters that
might still become the start of one, so streamed deltas never contain text past a stop string.

Decoding uses vLLM's prefix-offset / read-offset technique: decode a short window of tokens that
were already turned into text (`prefix`) with and without the new tokens, and emit the difference.
The window gives the decoder the context it needs (a leading space, the first bytes of a UTF-8
character split across byte-level BPE tokens), and text is only emitted when it does not end in
U+FFFD, i.e. when no character is still incomplete. Once emitted, text never changes.

We call `tokenizer.decode` on the window rather than `tokenizers.decoders.DecodeStream`: it does
the same thing, but works with any tokenizer that has `decode` (slow ones too) and applies the
tokenizer's own decode options. For a fast tokenizer without clean-up, transformers' `decode` is
exactly its backend's `decode` behind a wrapper that costs four times the decode itself (two
decodes per token, every step, for every running request), so we call the backend directly.
With a byte-level decoder (GPT-2, Llama 3, SmolLM2) the window's read part is the text the last
window added, so its length is kept and each step decodes once, not twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import decoders

# Prompt tokens used as decoding context for the first output tokens, as in vLLM: enough for
# a leading space or a multi-token character, small enough to stay cheap.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, step by step, and finds stop strings.

    Held-back text: while no stop string has matched, the longest suffix of the text that is a
    proper prefix of some stop string is held back from `output_text` and `get_delta()` (exact,
    as in vLLM: never more than max stop length - 1 characters, often none). `finalize()`
    releases it when the request finishes for another reason (length, EOS, stop token).

    min_tokens: stop strings are looked for once the output has that many tokens (as in
    vLLM); a match may still begin in held-back text from before.

    Several stop strings: the match that ends first in the text wins (what a character-by-
    character stream would find first, so the result does not depend on how the text is split
    into tokens); of matches ending at the same place, the longest.

    Whole-output equality: with no stop string matched, the final `output_text` equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level BPE tokenizers (GPT-2,
    Llama 3, SmolLM2) with `clean_up_tokenization_spaces=False`. Two known differences, shared
    with vLLM: the clean-up (" ." -> ".") is applied per window, so it may miss a pair that
    straddles windows; and for SentencePiece-style (Metaspace) tokenizers the first output
    token keeps its leading space, because the prompt's last tokens are the decoding context
    (the text continues the prompt), while a standalone decode would strip it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | str | None = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        deferred: bool = False,
    ) -> None:
        """deferred: the caller reads the text only once the request is over (vLLM's
        FINAL_ONLY outputs): without stop strings, the tokens are then decoded once at the
        end (or at a read) rather than twice a step, with the same text (see `_decode_new`)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._decoder = tokenizer if backend is None or cleans_up else backend
        if isinstance(stop, str):
            stop = [stop]
        # An empty stop string would match everywhere; SamplingParams never sends one.
        self.stop: list[str] = [s for s in (stop or ()) if s]
        self._stop_chars = set("".join(self.stop))
        self._longest_stop = max(map(len, self.stop), default=0)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        # Only where one decode of many tokens is the sum of the per-step ones: without a
        # clean-up pass (applied per window) and without stop strings (checked per step).
        self.deferred = deferred and not self.stop and self._decoder is backend

        # Only the prompt's last few tokens matter as context: keep those, not the whole prompt.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_REPLACEMENT_CHAR):
            # A prompt cut inside a character: the output's first bytes would complete it and
            # change text we count as already read. Decode the output on its own instead.
            context, context_text = [], ""
        # A byte-level decoder maps each token to bytes on its own, so the text of a window
        # that starts where the last one's complete text ended is that text and more: the
        # length of the window's read part is known (the last new text's) and never decoded
        # again. None for other decoders (a SentencePiece window drops its leading space).
        decoder = getattr(self._decoder, "decoder", None)
        byte_level = self._decoder is backend and isinstance(decoder, decoders.ByteLevel)
        self._prefix_len: int | None = len(context_text) if byte_level else None
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0  # start of the decoding window in _ids
        self._read_offset = len(context)  # _ids[:_read_offset] are already turned into text

        # Final text. Appending copies it, but a step adds a few characters to text of a few
        # KB: cheaper than joining a list of pieces on every read.
        self._text = ""
        self._num_sent = 0  # how many characters of _text get_delta() has returned
        self._held = ""  # text that may be the start of a stop string
        self.stop_reason: str | None = None  # the stop string that matched
        self.finished = False

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    @property
    def token_sink(self) -> list[int] | None:
        """The list a deferred detokenizer's new tokens may be appended to directly, as
        `update` would (None when each update is decoded)."""
        return self._ids if self.deferred and not self.finished else None

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_context

    @property
    def output_text(self) -> str:
        """The final text so far: without held-back text, cut at a matched stop string."""
        self._catch_up()
        return self._text

    def get_delta(self) -> str:
        """The text that became final since the last call (for streaming)."""
        self._catch_up()
        delta = self._text[self._num_sent :]
        self._num_sent = len(self._text)
        return delta

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Appends tokens; returns the stop string that now appears in the text, else None.

        After a match the request must finish (finish_reason "stop", stop_reason = the string),
        and the tokens after the one that completed it are not kept. Several tokens are decoded
        in one window; only when their text holds a match are they replayed one at a time, to
        find that token.
        """
        if self.finished:
            raise RuntimeError("update() after the request finished")
        if self.deferred:
            self._ids.extend(new_token_ids)
            return None  # no stop strings: the text waits for a read or finalize()
        several = len(new_token_ids) > 1 and self.stop
        saved = self._save() if several else None
        self._ids.extend(new_token_ids)
        may_stop = self.num_output_tokens >= self.min_tokens
        matched = self._add_text(self._decode_new(flush=False), may_stop)
        if matched is None or not several:
            return matched
        self._restore(saved)
        for token in new_token_ids:
            matched = self.update([token])
            if matched is not None:
                return matched
        return None

    def _save(self) -> tuple:
        offsets = (self._prefix_offset, self._read_offset, self._prefix_len)
        return (len(self._ids), *offsets, self._text, self._held)

    def _restore(self, saved: tuple) -> None:
        num_ids, *offsets, self._text, self._held = saved
        self._prefix_offset, self._read_offset, self._prefix_len = offsets
        del self._ids[num_ids:]
        self.finished, self.stop_reason = False, None

    def finalize(self) -> None:
        """Finishes the request for a reason other than a stop string: releases all text.

        Flushes an incomplete trailing character (as U+FFFD, as a full decode would) and the
        held-back text. A no-op after a stop string matched.
        """
        if self.finished:
            return
        self._held += self._decode_new(flush=True)
        self._release(self._held)
        self._held = ""
        self.finished = True

    def _catch_up(self) -> None:
        """A deferred detokenizer's text, up to its last complete character, before a read."""
        if self.deferred and not self.finished:
            self._release(self._decode_new(flush=False))

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, *, flush: bool) -> str:
        """The text of the tokens not yet read; "" while it ends in an incomplete character.

        Cost: two decodes of the window, which spans the previous step's tokens and the new ones
        (longer only while a character stays incomplete), not the whole output. A window of
        many new tokens (a deferred detokenizer's) gives the text that one window per token
        would: the decoder maps tokens to bytes independently, and text is taken only at
        complete characters.
        """
        if self._read_offset == len(self._ids):
            return ""
        prefix_len = self._prefix_len
        if prefix_len is None:
            prefix_len = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        full_text = self._decode(self._ids[self._prefix_offset :])
        if not flush and (len(full_text) <= prefix_len or full_text.endswith(_REPLACEMENT_CHAR)):
            # No text yet (skipped special tokens), or a character whose remaining bytes are
            # still to come: keep the offsets, so the next step decodes these tokens again with
            # the same context. A flush emits whatever there is, as the full decode would.
            return ""
        new_text = full_text[prefix_len:]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_len is not None:
            self._prefix_len = len(new_text)  # the next window's read part
        return new_text

    def _add_text(self, new_text: str, may_stop: bool) -> str | None:
        """Checks the stop strings (if `may_stop`) on the held text plus new_text, then
        releases what is safe."""
        if not self.stop:
            self._release(new_text)
            return None
        # Any stop string that ends in new_text starts inside the held text or later: the part
        # before new_text is a suffix of the old text and a prefix of the stop string, which is
        # exactly what we hold. Matches ending earlier were found in earlier steps.
        text = self._held + new_text
        match = self._first_match(text) if may_stop else None
        if match is not None:
            stop_str, start = match
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            self._release(text[:end])
            self._held = ""
            self.stop_reason = stop_str
            self.finished = True
            return stop_str
        hold = self._holdback_len(text)
        self._release(text[: len(text) - hold])
        self._held = text[len(text) - hold :]
        return None

    def _first_match(self, text: str) -> tuple[str, int] | None:
        """(stop string, start) of the match that ends first (longest on a tie), or None."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for stop_str in self.stop:
            start = text.find(stop_str)
            if start != -1:
                key = (start + len(stop_str), -len(stop_str), stop_str)
                best = key if best is None else min(best, key)
        if best is None:
            return None
        end, neg_len, stop_str = best
        return stop_str, end + neg_len

    def _holdback_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        if not text or text[-1] not in self._stop_chars:
            return 0  # such a suffix ends with one of the stop strings' characters
        longest = min(len(text), self._longest_stop - 1)
        for k in range(longest, 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self.stop):
                return k
        return 0

    def _release(self, text: str) -> None:
        self._text += text
