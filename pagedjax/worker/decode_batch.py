"""The model runner's side of a steady decode batch (`core/steady_batch.py`; vLLM V1's
persistent batch): what the step that formed it prepared and what its later steps keep.

Its steps send only each row's token, position and changed block table entries, and the
rows removed and joined (`DecodeStep`); the rest (which persistent table row each request has, the
logits rows, the sampling arrays already on the device) is this, and the draw counters
advance by one a step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedjax.core.sched_output import SampleRow


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
    sampling: Any  # the rows' BatchSampling
    rows: list[SampleRow]  # the forming step's rows: their params and seeds stay
    decode_only: bool | None  # the step's static attention flag

    @staticmethod
    def of(
        batch_id: int,
        request_ids: list[Hashable],
        table_rows: np.ndarray,
        num_blocks: int,
        counters: np.ndarray,
        sampling: Any,
        rows: list[SampleRow],
        decode_only: bool | None,
    ) -> DecodeBatch:
        n = len(rows)
        logits_rows = np.zeros(len(counters), np.int32)
        logits_rows[:n] = np.arange(n)
        owner = np.arange(n)
        return DecodeBatch(
            batch_id, request_ids, table_rows, num_blocks, owner, owner + 1, logits_rows,
            counters, sampling, rows, decode_only,
        )  # fmt: skip

    def without(self, removed: Sequence[int]) -> tuple[list, list, np.ndarray, np.ndarray]:
        """The request ids, sample rows, table rows and draw counters left once `removed`
        rows are taken out, each numbered after the removals before it."""
        ids, rows = list(self.request_ids), list(self.rows)
        table_rows, counters = self.table_rows, self.counters[: len(rows)]
        for row in removed:
            del ids[row], rows[row]
            table_rows, counters = np.delete(table_rows, row), np.delete(counters, row)
        return ids, rows, table_rows, counters
