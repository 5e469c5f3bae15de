"""Prompt-lookup proposals: the tokens that followed an earlier occurrence of the sequence's
last n tokens.

Each sequence keeps an index from every n-gram it has seen to where its latest occurrence
ended, extended by the tokens added since the last proposal, so a proposal costs
O(new tokens x n-gram sizes) dictionary operations, never a scan of the context.
"""

from __future__ import annotations

from pagedjax.core.engine_request import EngineRequest


class NgramIndex:
    """For each n: n-gram (a tuple) -> the position right after its latest occurrence, over a
    sequence's first `num_indexed` tokens."""

    __slots__ = ("tables", "num_indexed")

    def __init__(self, sizes: range) -> None:
        self.tables = {n: {} for n in sizes}
        self.num_indexed = 0


class NgramProposer:
    on_device = False  # its drafts are known when the step is scheduled

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.sizes = range(min_n, max_n + 1)

    def propose(self, request: EngineRequest, limit: int) -> list[int]:
        """Up to min(k, limit) tokens to follow the request's tokens (all known: none is a
        placeholder), longest n-gram match first; [] when its suffix never occurred."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        tokens = request.all_token_ids
        index = request.ngram_index
        if index is None:
            index = request.ngram_index = NgramIndex(self.sizes)
        end = len(tokens)
        tables = index.tables
        # Continuations start at q: n-grams ending before q, whose next token is known.
        for q in range(max(index.num_indexed, 1), end):
            for n, table in tables.items():
                if q >= n:
                    table[tuple(tokens[q - n : q])] = q
        index.num_indexed = end
        for n in reversed(self.sizes):
            if end > n:  # the suffix must have occurred before, not be the sequence itself
                start = tables[n].get(tuple(tokens[end - n :]))
                if start is not None:
                    return tokens[start : start + limit]
        return []
