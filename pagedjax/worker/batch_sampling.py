"""What a step's sample rows ask of the sampler (`BatchSampling`), and a kept batch's sampling
arrays edited row by row as its rows leave and join (`edit_rows`): a steady batch's finish or
join then costs the rows it names, not a build over every row.

The flags come from a count of the rows' kinds (`row_kind`), so a row leaving or joining
changes a count, and the flags stay exactly what a build over the rows would give. Rows whose
arrays are a padding row's (`distinct_rows`: greedy rows asking nothing else) need no edit at
all: a batch of only those has the arrays of padding rows (`padding_rows`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from functools import cache

import numpy as np

from pagedjax.sampler import SamplingMetadata, build_sampling_metadata, penalizes, truncates
from pagedjax.sampling_params import SamplingParams

RowKind = tuple[bool, bool, bool, int | None]  # (greedy, truncates, penalizes, logprobs)


def row_kind(params: SamplingParams) -> RowKind:
    """What of the sampler a row with these params needs."""
    return params.greedy, truncates(params), penalizes(params), params.logprobs


def row_kinds(params: Iterable[SamplingParams]) -> Counter[RowKind]:
    """How many rows of each kind."""
    return Counter(map(row_kind, params))


@dataclass(frozen=True)
class BatchSampling:
    """What a step's sample rows ask of the sampler, from their params: worked out once per
    batch and kept while the batch is steady (`key`: r_pad, then each row's params and seed;
    empty for a kept batch's, which is edited, not looked up)."""

    key: list
    use_penalties: bool
    use_truncation: bool
    all_greedy: bool
    num_logprobs: int | None

    @staticmethod
    def of(key: list, params: Iterable[SamplingParams]) -> BatchSampling:
        return BatchSampling.of_kinds(key, row_kinds(params))

    @staticmethod
    def of_kinds(key: list, kinds: Counter[RowKind]) -> BatchSampling:
        """The flags of rows of these kinds (those counted more than zero times)."""
        kinds = [kind for kind, count in kinds.items() if count > 0]
        wanted = [logprobs for *_, logprobs in kinds if logprobs is not None]
        return BatchSampling(
            key,
            any(penalties for _, _, penalties, _ in kinds),
            any(truncation for _, truncation, _, _ in kinds),
            all(greedy for greedy, *_ in kinds),
            max(wanted) if wanted else None,
        )

    def flags(self) -> dict:
        """The sampler's keyword arguments."""
        return dict(
            use_penalties=self.use_penalties,
            use_truncation=self.use_truncation,
            all_greedy=self.all_greedy,
            num_logprobs=self.num_logprobs,
        )


@cache
def padding_row() -> SamplingMetadata:
    """What a build puts in a padding row (a greedy row asking nothing), as one row."""
    return build_sampling_metadata([], [], [], [], num_rows=1)


@cache
def padding_rows(num_rows: int) -> SamplingMetadata:
    """What a build gives for num_rows rows that are each a padding row's, or a greedy row's
    that asks nothing else; host arrays, without draw counters."""
    return replace(build_sampling_metadata([], [], [], [], num_rows=num_rows), steps=None)


def distinct_rows(meta: SamplingMetadata, n: int) -> np.ndarray:
    """[n] bool: whether each of `meta`'s first n rows has arrays other than a padding row's
    (a row with a mask or a draft always has)."""
    padding = padding_row()
    distinct = np.zeros(n, bool)
    if n == 0:  # a step beside the batch with no sample rows of its own
        return distinct
    for field in fields(meta):
        name, values = field.name, getattr(meta, field.name)
        if name == "steps" or values is None:
            continue
        if (fill := getattr(padding, name)) is None:
            return np.ones(n, bool)
        distinct |= (values[:n].reshape(n, -1) != fill.flat[0]).any(axis=1)
    return distinct


def edit_rows(
    meta: SamplingMetadata, keep: np.ndarray, joined: SamplingMetadata | None, r_pad: int
) -> SamplingMetadata | None:
    """`meta`'s rows `keep` (in that order), then `joined`'s rows, then padding rows as a
    build pads (greedy, nothing asked), r_pad in all; host arrays, without draw counters.
    Lists (biases, histories) as wide as the wider of the two, padded as a build pads them.
    None where a full build is needed instead: `joined` has a mask or drafts."""
    padding = padding_row()
    n = len(keep)
    edited = {"steps": None}
    for field in fields(meta):
        name = field.name
        old, new = getattr(meta, name), None if joined is None else getattr(joined, name)
        if name == "steps":
            continue
        if old is None or getattr(padding, name) is None:
            if new is not None or old is not None:
                return None  # masks and drafts are never a kept batch's
            continue
        widths = old.shape[1:] if new is None else np.maximum(old.shape[1:], new.shape[1:])
        out = np.full((r_pad, *widths), getattr(padding, name).flat[0], old.dtype)
        out[(slice(0, n), *map(slice, old.shape[1:]))] = old[keep]
        if new is not None:
            out[(slice(n, n + len(new)), *map(slice, new.shape[1:]))] = new
        edited[name] = out
    return replace(meta, **edited)


def same_arrays(a: SamplingMetadata, b: SamplingMetadata) -> bool:
    """Whether two sets of host sampling arrays are the same bit for bit (shapes too)."""
    for field in fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if x is None or y is None:
            if x is not y:
                return False
        elif x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            return False
    return True
