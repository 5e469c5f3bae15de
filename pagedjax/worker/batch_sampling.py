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
from math import prod

import numpy as np

from pagedjax.sampler import SamplingMetadata, build_sampling_metadata, penalizes, truncates
from pagedjax.sampling_params import SamplingParams
from pagedjax.worker.step_inputs import StepLayout, pack_bits

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


# Host sampling arrays without draw counters in `pack_bits`' form: how a kept batch keeps
# them, edits them (`edit_rows`) and sends them.
Packed = tuple[np.ndarray, StepLayout]


@cache
def padding_rows(num_rows: int) -> Packed:
    """What a build gives for num_rows rows that are each a padding row's, or a greedy row's
    that asks nothing else; host arrays, without draw counters."""
    return packed_rows(build_sampling_metadata([], [], [], [], num_rows=num_rows))


def packed_rows(meta: SamplingMetadata) -> Packed:
    """Built sampling arrays as a kept batch keeps them: without draw counters (a step's come
    from its forward), in `pack_bits`' form."""
    return pack_bits(replace(meta, steps=None))


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


def edit_rows(packed: Packed, keep: np.ndarray, joined: Packed | None, r_pad: int) -> Packed | None:
    """`packed`'s rows `keep` (in that order), then `joined`'s rows, then padding rows as a
    build pads (greedy, nothing asked), r_pad in all: sampling arrays without draw counters in
    `pack_bits`' form, edited there (a run of one-dimensional arrays is one block, so an edit
    is a few numpy calls, not a few per array). Lists (biases, histories) as wide as the wider
    of the two, padded as a build pads them. None where a full build is needed instead:
    `joined` has a mask or drafts."""
    bits, layout = packed
    fills, padding_layout = _padding_bits()
    if layout.treedef != padding_layout.treedef:
        return None  # masks and drafts are never a kept batch's
    new_bits, new_layout = joined if joined is not None else (np.zeros(0, np.int32), layout)
    if new_layout.treedef != layout.treedef:
        return None
    n, j = len(keep), 0 if joined is None else new_layout.shapes[0][0]
    shapes, parts, start, new_start, i = [], [], 0, 0, 0
    while i < len(layout.shapes):
        rows, *width = layout.shapes[i]
        if not width:  # the run of [R] arrays from here: one [count, R] block
            k = i
            while k < len(layout.shapes) and len(layout.shapes[k]) == 1:
                k += 1
            block = np.empty((k - i, r_pad), np.int32)
            block[:, :n] = bits[start : start + (k - i) * rows].reshape(k - i, rows)[:, keep]
            block[:, n : n + j] = new_bits[new_start : new_start + (k - i) * j].reshape(k - i, j)
            block[:, n + j :] = fills[i:k, None]
            shapes += [(r_pad,)] * (k - i)
            start, new_start, i = start + (k - i) * rows, new_start + (k - i) * j, k
        else:  # [R, W]
            old_width, new_width = width[0], new_layout.shapes[i][1] if j else 0
            block = np.full((r_pad, max(old_width, new_width)), fills[i], np.int32)
            size, new_size = rows * old_width, j * new_width
            block[:n, :old_width] = bits[start : start + size].reshape(rows, old_width)[keep]
            block[n : n + j, :new_width] = new_bits[new_start : new_start + new_size].reshape(
                j, new_width
            )
            shapes.append(block.shape)
            start, new_start, i = start + size, new_start + new_size, i + 1
        parts.append(block.ravel())
    return np.concatenate(parts), replace(layout, shapes=tuple(shapes))


@cache
def _padding_bits() -> tuple[np.ndarray, StepLayout]:
    """A padding row's value of each array (as int32 bits, in `pack_bits`' leaf order), and
    that row's layout."""
    bits, layout = padding_rows(1)
    return bits[np.cumsum([0, *(prod(shape) for shape in layout.shapes[:-1])])], layout


def same_arrays(a: Packed, b: Packed) -> bool:
    """Whether two sets of host sampling arrays (`pack_bits`' form) are the same bit for bit
    (shapes too)."""
    return a[1] == b[1] and a[0].tobytes() == b[0].tobytes()
