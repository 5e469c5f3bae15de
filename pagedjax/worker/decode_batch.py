"""The model runner's side of a steady decode batch (`core/steady_batch.py`; vLLM V1's
persistent batch): what the step that formed it prepared and what its later steps keep.

Its steps send only each row's token, position and changed block table entries, and the
rows removed and joined (`DecodeStep`); the rest (which persistent table row each request has, the
logits rows, the sampling arrays already on the device) is this, and the draw counters
advance by one a step. Rows that leave or join edit these arrays where they are (one
transfer of the sampling arrays then), not a build over every row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from pagedjax.core.sched_output import SampleRow
from pagedjax.worker.batch_sampling import BatchSampling, Packed, RowKind
from pagedjax.worker.step_inputs import PackedSampling


@dataclass
class DecodeBatch:
    batch_id: int
    request_ids: list[Hashable]  # [n] each row's request
    table_rows: np.ndarray  # [n] each row's row of the persistent block tables
    num_blocks: int  # the most block table entries any row uses
    owner: np.ndarray  # [n] each token's sequence: row i's is i
    ends: np.ndarray  # [n] each row's query end: i + 1
    logits_rows: np.ndarray  # [R] int32 each sample row's logits row: i (0 past n)
    counters: np.ndarray  # [R] int32 each row's draw counter (SamplingMetadata.steps)
    sampling: BatchSampling  # the rows' sampler flags
    kinds: Counter[RowKind]  # how many rows of each kind (the flags, edited row by row)
    rows: list[SampleRow]  # each row's sample row: its params and seed stay
    decode_only: bool | None  # the step's static attention flag
    # [R] the rows' sampling arrays without draw counters, on the host (None: not built
    # yet) and on the device (None: not sent since they changed).
    host_sampling: Packed | None = None  # `pack_bits`' form
    device_sampling: PackedSampling | None = None
    # [n] whether each row's sampling arrays may be other than a padding row's (with
    # host_sampling; a row joining beside one that is counts as one): where none is, the
    # arrays are the padding's, sent once per row bucket.
    distinct: np.ndarray | None = None
    advance: int = 1  # the decode steps of the batch's last step: its draw counters' advance

    @staticmethod
    def of(
        batch_id: int,
        request_ids: list[Hashable],
        table_rows: np.ndarray,
        num_blocks: int,
        counters: np.ndarray,
        sampling: BatchSampling,
        kinds: Counter[RowKind],
        rows: list[SampleRow],
        decode_only: bool | None,
        host_sampling: Packed | None = None,
        device_sampling: PackedSampling | None = None,
        distinct: np.ndarray | None = None,
    ) -> DecodeBatch:
        n = len(rows)
        logits_rows = np.zeros(len(counters), np.int32)
        logits_rows[:n] = np.arange(n)
        owner = np.arange(n)
        return DecodeBatch(
            batch_id, request_ids, table_rows, num_blocks, owner, owner + 1, logits_rows,
            counters, sampling, kinds, rows, decode_only, host_sampling, device_sampling,
            distinct,
        )  # fmt: skip

    def without(self, removed: Sequence[int]) -> tuple[list, list, list[SampleRow], np.ndarray]:
        """The request ids and sample rows left once `removed` rows are taken out, each
        numbered after the removals before it; the sample rows taken out; the rows kept (their
        old numbers, in order)."""
        ids, rows, gone = list(self.request_ids), list(self.rows), []
        keep = np.arange(len(rows))
        for row in removed:
            del ids[row]
            gone.append(rows.pop(row))
            keep = np.delete(keep, row)
        return ids, rows, gone, keep
