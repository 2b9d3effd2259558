"""The bulk load's sort of unsorted pairs as compact columns, vectorised with numpy.

``bulk.read_pairs`` sorts input that arrives out of key order once, at the end (or once per run
it spills: ``spill.py``). The pairs are packed as they are read, in input order, into two columns
(16 bytes a key, 8 a value: 24 bytes a pair, the caller's objects no longer referenced) and
sorted there: an argsort of the keys' first 8 bytes, redone by all 16 only when two keys share
those 8 bytes.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable

import numpy as np

from ..keys import KEY_SIZE

Progress = Callable[[int, int], None]


class ColumnCollector:
    """Unsorted pairs packed into key and value columns in input order, sorted once by ``sort_into``.

    A removal (value ``None``) is packed as 0 and its row number kept in ``removed_rows``."""

    def __init__(self) -> None:
        self.keys = bytearray()
        self.values = bytearray()
        self.removed_rows: list[int] = []
        self.rows = 0

    def add_columns(self, keys: np.ndarray, values: np.ndarray, removed: np.ndarray | None) -> None:
        """Add a chunk as columns: ``S16`` keys, int64 values (0 for a removal) and which rows are
        removals (``None``: none)."""
        if removed is not None:
            self.removed_rows += (np.flatnonzero(removed) + self.rows).tolist()
        self.keys += memoryview(np.ascontiguousarray(keys).view(np.uint8))
        self.values += memoryview(np.ascontiguousarray(values, dtype="=i8").view(np.uint8))
        self.rows += len(keys)

    def add_run(self, run: Any) -> None:
        """Add the pairs of a sorted run (``SortedRun``: kept keys, then its removals), straight
        from its columns."""
        self.keys += run.keys
        self.values += run.values.tobytes()
        self.rows += len(run)
        if run.removed:
            self.removed_rows += range(self.rows, self.rows + len(run.removed))
            self.keys += b"".join(run.removed)
            self.values += bytes(8 * len(run.removed))
            self.rows += len(run.removed)

    def sort_into(self, run: Any, progress: Progress | None) -> None:
        """Fill the empty ``run`` with the pairs in key order, the last pair for a key winning."""
        n = self.rows
        if progress is not None:
            progress(0, n)
        keep = self._latest_rows()
        rows = np.frombuffer(self.keys, dtype=f"V{KEY_SIZE}")
        if self.removed_rows:
            removed = np.zeros(n, dtype=bool)
            removed[self.removed_rows] = True
            gone, keep = keep[removed[keep]], keep[~removed[keep]]
            packed = rows[gone].tobytes()
            run.removed = [packed[at:at + KEY_SIZE] for at in range(0, len(packed), KEY_SIZE)]
        # Gathered arrays go into the run through the buffer protocol: no intermediate bytes copy.
        run.keys += memoryview(rows[keep].view(np.uint8))
        del rows
        values = array("q")
        values.frombytes(memoryview(np.frombuffer(self.values, dtype="=i8")[keep].view(np.uint8)))
        run.values = values
        self.keys, self.values, self.removed_rows, self.rows = bytearray(), bytearray(), [], 0
        if progress is not None:
            progress(n, n)

    def _latest_rows(self) -> Any:
        """Row numbers in key order, only the last row of each key (an int64 array).

        Keys are compared as two big-endian 64-bit words: the first decides unless two keys share
        it (repeats of a key do too), then a stable sort by both words redoes the order. It keeps
        repeats of a key in input order, so the last of each run of equal keys is the one that
        wins. (The first sort need not be stable: it is kept only when no two keys are alike.)"""
        words = np.frombuffer(self.keys, dtype=">u8").reshape(-1, 2)
        high = words[:, 0].astype(np.uint64)
        order = np.argsort(high)
        sorted_high = high[order]
        last = np.ones(len(order), dtype=bool)
        shared = sorted_high[1:] == sorted_high[:-1]
        if shared.any():
            low = words[:, 1].astype(np.uint64)
            order = np.lexsort((low, high))  # stable: by the first word, then the second
            sorted_high, sorted_low = high[order], low[order]
            last[:-1] = (sorted_high[1:] != sorted_high[:-1]) | (sorted_low[1:] != sorted_low[:-1])
        return order[last]
