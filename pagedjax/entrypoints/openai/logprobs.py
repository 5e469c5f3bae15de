"""OpenAI's two logprobs formats (completions' and chat's) from the engine's `Logprob`s.

Each token is named by the text it adds after the token before it, so a SentencePiece
token's leading space is kept and the completions API's tokens add up to the text
(`text_offset` is then exact).
"""

from __future__ import annotations

import functools

from pagedjax.entrypoints.openai.protocol import (
    ChatLogProbs,
    ChatTokenLogprob,
    CompletionLogProbs,
    TopLogprob,
)
from pagedjax.logprobs import Logprob

# JSON has no -inf: a token the model rules out gets this logprob, as in vLLM.
MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class LogprobsFormatter:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        # Text skips special tokens (the default): after one, a token starts the text afresh.
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        # The same (previous, token) pairs recur across requests: decoding them is the cost.
        self._text = functools.lru_cache(maxsize=1 << 16)(self._decode)

    def _decode(self, previous: int | None, token: int) -> str:
        if previous is None or previous in self._special_ids:
            return self._tokenizer.decode([token])
        before = self._tokenizer.decode([previous])
        both = self._tokenizer.decode([previous, token])
        if both.startswith(before):
            return both[len(before) :]
        return self._tokenizer.decode([token])

    def token_text(self, previous: int | None, token: int) -> str:
        """The token's text after `previous` (None: at the start), so that a completion's
        tokens join into its text (an engine `Logprob.decoded_token` is the token alone)."""
        return self._text(previous, token)

    def completion(
        self,
        token_ids: list[int],
        entries: list[dict[int, Logprob] | None],
        previous: int | None,
        initial_offset: int = 0,
    ) -> CompletionLogProbs:
        """Each token's text, offset and logprob, and the logprobs of the chosen and most
        likely tokens (None for a prompt's first token, which has none)."""
        out = CompletionLogProbs()
        offset = initial_offset
        for token, entry in zip(token_ids, entries, strict=True):
            text = self.token_text(previous, token)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(_clamp(entry[token].logprob))
                out.top_logprobs.append(
                    {self.token_text(previous, t): _clamp(lp.logprob) for t, lp in entry.items()}
                )
            previous = token
        return out

    def chat(
        self,
        token_ids: list[int],
        entries: list[dict[int, Logprob]],
        previous: int | None,
        top_n: int,
    ) -> ChatLogProbs:
        """Each token with its logprob, UTF-8 bytes and the top_n most likely tokens."""
        content = []
        for token, entry in zip(token_ids, entries, strict=True):
            ranked = sorted(
                (lp.rank, t) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n
            )
            tops = []
            for _, t in ranked:
                text = self.token_text(previous, t)
                tops.append(
                    TopLogprob(
                        token=text, logprob=_clamp(entry[t].logprob), bytes=list(text.encode())
                    )
                )
            text = self.token_text(previous, token)
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=_clamp(entry[token].logprob),
                    bytes=list(text.encode()),
                    top_logprobs=tops,
                )
            )
            previous = token
        return ChatLogProbs(content=content)
