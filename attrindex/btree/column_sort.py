"""The bulk load's sort of unsorted pairs as compact columns, vectorised with numpy where installed.

``bulk.read_pairs`` sorts input that arrives out of key order once, at the end (or once per run
it spills: ``spill.py``). In pure Python that sort touches every pair object again in random
order (about 0.7 s of CPU for 1M pairs, most of it cache misses). With numpy the pairs are
packed as they are read, in input order, into two columns (16 bytes a key, 8 a value: 24 bytes a
pair, the caller's objects no longer referenced) and sorted there: an argsort of the keys' first
8 bytes, redone by all 16 only when two keys share those 8 bytes. numpy is optional (``pip install attrindex[fast]``; pandas and
Spark users have it): without it ``bulk`` keeps its pure-Python sort, which gives the same run.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any, Callable

from ..keys import KEY_SIZE

Progress = Callable[[int, int], None]


def load_numpy() -> Any | None:
    """The numpy module, or None where it is not installed (imported on the first unsorted load,
    not with attrindex: the CLI starts without it)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class ColumnCollector:
    """Unsorted pairs packed into key and value columns in input order, sorted once by ``sort_into``.

    A removal (value ``None``) is packed as 0 and its row number kept in ``removed_rows``."""

    def __init__(self, numpy: Any):
        self.np = numpy
        self.keys = bytearray()
        self.values = bytearray()
        self.removed_rows: list[int] = []
        self.rows = 0

    def add(self, chunk: list, keys: list[bytes], values: list[int | None], canonical: bool) -> None:
        """Add one chunk's validated ``keys`` and ``values`` (``chunk``, the caller's pairs, is not
        kept: the columns are the copy)."""
        try:
            column = struct.pack(f"={len(values)}q", *values)
        except struct.error:  # a None among them: a removal
            self.removed_rows += [self.rows + i for i, value in enumerate(values) if value is None]
            column = struct.pack(f"={len(values)}q", *(0 if v is None else v for v in values))
        self.keys += b"".join(keys)
        self.values += column
        self.rows += len(values)

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
        np, n = self.np, self.rows
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
        np = self.np
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
