"""``SortedRun``: sorted unique keys with their values in compact columns, and keys to remove.

What ``bulk.read_pairs`` turns a load's input into (in memory, or block by block from the runs
``spill`` wrote), and what ``bulk.build`` reads.
"""

from __future__ import annotations

import struct
from array import array
from typing import Iterator, Sequence

from ..keys import KEY_SIZE
from .page import column_struct


class SortedRun:
    """Sorted unique keys with their values in compact columns, and sorted keys to remove."""

    __slots__ = ("keys", "values", "removed")

    def __init__(self) -> None:
        self.keys = bytearray()  # n x 16 bytes, ascending
        self.values = array("q")
        self.removed: list[bytes] = []  # ascending; disjoint from keys

    @classmethod
    def of_columns(cls, keys, values, removed: list[bytes]) -> "SortedRun":
        """A run over numpy columns without copying them: ascending unique ``S16`` keys, their
        int64 values, and the removed keys (ascending, disjoint from ``keys``). Read-only: it
        cannot be extended."""
        run = cls()
        run.keys = memoryview(keys.view("u1")) if len(keys) else bytearray()  # type: ignore[assignment]
        run.values = memoryview(values.astype("=i8", copy=False)) if len(values) else array("q")  # type: ignore[assignment]
        run.removed = removed
        return run

    def __len__(self) -> int:
        return len(self.values)

    def key(self, i: int) -> bytes:
        return bytes(self.keys[i * KEY_SIZE:(i + 1) * KEY_SIZE])

    def last_key(self) -> bytes | None:
        """The greatest key in the run, kept or removed."""
        kept = self.key(len(self) - 1) if len(self) else None
        gone = self.removed[-1] if self.removed else None
        if kept is None or gone is None:
            return kept if gone is None else gone
        return max(kept, gone)

    def clear(self) -> None:
        self.keys.clear()
        del self.values[:]
        self.removed.clear()

    def drop_last(self, key: bytes) -> None:
        """Forget ``key``, the greatest in the run (a later pair for it follows)."""
        if self.removed and self.removed[-1] == key:
            self.removed.pop()
        else:
            del self.keys[-KEY_SIZE:]
            self.values.pop()

    def extend(self, keys: Sequence[bytes], values: Sequence[int | None]) -> None:
        """Add ascending unique ``keys`` (all above the run's) and their int64 or ``None`` values."""
        try:
            # One C-level pass; array.extend(list) is five times slower (measured, 1M values).
            column = struct.pack(f"={len(values)}q", *values)
        except struct.error:  # a None among them: removals go to their own list
            self.removed += [k for k, v in zip(keys, values) if v is None]
            keys = [k for k, v in zip(keys, values) if v is not None]
            column = struct.pack(f"={len(keys)}q", *(v for v in values if v is not None))
        self.keys += b"".join(keys)
        self.values.frombytes(column)

    def extend_columns(self, keys, values, removed) -> None:
        """``extend`` from columns (numpy): ascending unique ``S16`` keys above the run's, int64
        values, and which rows are removals (a bool array, or ``None``: none are)."""
        if removed is not None and removed.any():
            gone = keys[removed].tobytes()
            self.removed += [gone[at:at + KEY_SIZE] for at in range(0, len(gone), KEY_SIZE)]
            keys, values = keys[~removed], values[~removed]
        self.keys += memoryview(keys.view("u1")) if keys.flags.c_contiguous else keys.tobytes()
        self.values.frombytes(values.astype("=i8", copy=False).tobytes())

    def key_list(self, lo: int, hi: int) -> list[bytes]:
        return list(column_struct("16s", hi - lo).unpack_from(self.keys, lo * KEY_SIZE)) if hi > lo else []

    def pairs(self) -> list[tuple[bytes, int | None]]:
        """The run as ``(key, value)`` pairs, removals as ``(key, None)`` (not in key order)."""
        return [*zip(self.key_list(0, len(self)), self.values), *((key, None) for key in self.removed)]

    def key_view(self) -> "KeyView":
        """The kept keys as a sequence, for ``bisect``."""
        return KeyView(self)

    def chunks(self) -> Iterator["SortedRun"]:
        """The run as sorted runs of ascending key ranges (as ``spill.SpilledRuns`` gives them): itself."""
        yield self

    def close(self) -> None:
        """Nothing to release (a ``spill.SpilledRuns`` deletes its files)."""


class KeyView:
    """A run's kept keys as a sequence (``SortedRun.key_view``)."""

    __slots__ = ("run",)

    def __init__(self, run: SortedRun):
        self.run = run

    def __len__(self) -> int:
        return len(self.run)

    def __getitem__(self, i: int) -> bytes:
        return self.run.key(i)


__all__ = ["KeyView", "SortedRun"]
