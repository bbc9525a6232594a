"""The request-to-token table: row r holds the KV slots of the request in row r, in sequence order."""

from __future__ import annotations

import numpy as np


class ReqToTokenPool:
    """[max_reqs, max_context] int64 host table plus a free list of rows."""

    def __init__(self, max_reqs: int, max_context: int):
        self.table = np.zeros((max_reqs, max_context), dtype=np.int64)
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int] | np.ndarray) -> None:
        self.table[row, start : start + len(slots)] = slots

    def gather(self, rows: list[int], lengths: list[int]) -> np.ndarray:
        """Concatenated slots of several requests: the ForwardBatch's kv_indices."""
        if not rows:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.table[r, :n] for r, n in zip(rows, lengths, strict=True)])
