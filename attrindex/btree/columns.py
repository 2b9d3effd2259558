"""Entries as numpy columns: what a bulk build and a dense merge stream through (no I/O).

A leaf page stores its keys and values as two columns (``page.py``), so its entries are numpy
arrays over the page's own bytes (``leaf_columns``): keys as ``S16`` (numpy orders and compares
fixed-width byte strings as unsigned bytes, as the tree does) and values as little-endian int64,
without a Python object per entry. ``merge_columns`` applies sorted updates and removals to
sorted entries, and ``RunCursor`` hands out a sorted run's entries (``sorted_run.SortedRun``
chunks) up to a key at a time, so a build merges a run into the old tree's leaves block by
block. This is what makes a merge that touches every leaf cost about as much as copying the
tree (docs/design.md, "Dense merges").
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..keys import KEY_SIZE
from .page import HEADER_SIZE, LEAF, RunLeafPage, check_page
from .sorted_run import SortedRun

KEY_DTYPE = np.dtype(f"S{KEY_SIZE}")
VALUE_DTYPE = np.dtype("<i8")
_EMPTY_KEYS = np.empty(0, KEY_DTYPE)
_EMPTY_VALUES = np.empty(0, VALUE_DTYPE)


def leaf_columns(page: bytes | memoryview, offset: int, segment: str = "?",
                 kind: int = LEAF) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The keys, values and removal flags (``None`` for a main tree's leaf, which removes
    nothing) of the leaf of ``kind`` (``LEAF`` or ``RUN_LEAF``) stored at ``offset``, checked
    (``CorruptDataError`` otherwise, as ``page.decode_page`` raises), as read-only arrays over ``page``."""
    found, n = check_page(page, offset, segment)
    if found != kind:
        from storage_adapters.errors import CorruptDataError

        raise CorruptDataError(f"segment {segment!r}: B+tree page at offset {offset}: a page of kind {found} where a "
                               f"leaf of kind {kind} belongs", segment=segment, offset=offset)
    keys = np.frombuffer(page, KEY_DTYPE, n, HEADER_SIZE)
    values = np.frombuffer(page, VALUE_DTYPE, n, HEADER_SIZE + n * KEY_SIZE)
    if kind == LEAF:
        return keys, values, None
    flags = np.frombuffer(page, np.uint8, n, HEADER_SIZE + n * (KEY_SIZE + 8))
    if (flags > 1).any():
        from storage_adapters.errors import CorruptDataError

        raise CorruptDataError(f"segment {segment!r}: B+tree page at offset {offset}: a removal flag other than 0 or 1",
                               segment=segment, offset=offset)
    return keys, values, flags.astype(bool)


def page_columns(page) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A decoded leaf page's keys, values and removal flags as columns (copies of its lists;
    flags ``None`` for a main tree's leaf)."""
    keys = np.array(page.keys, KEY_DTYPE).reshape(-1)
    if not isinstance(page, RunLeafPage):
        return keys, np.array(page.values, VALUE_DTYPE), None
    gone = np.fromiter((value is None for value in page.values), bool, len(page.values))
    values = np.fromiter((0 if value is None else value for value in page.values), VALUE_DTYPE, len(page.values))
    return keys, values, gone


def run_columns(run: SortedRun) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sorted run's kept keys, their values and its removed keys, as arrays (the first two over
    the run's own buffers: the run must not change while they are in use)."""
    keys = np.frombuffer(run.keys, KEY_DTYPE) if len(run) else _EMPTY_KEYS
    values = np.frombuffer(run.values, np.int64).astype(VALUE_DTYPE, copy=False) if len(run) else _EMPTY_VALUES
    removed = np.array(run.removed, KEY_DTYPE) if run.removed else _EMPTY_KEYS
    return keys, values, removed


def positions(keys: np.ndarray, probes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``probes`` goes in the sorted ``keys`` and whether it is there already (one
    numpy search; ``probes`` need not be sorted)."""
    at = np.searchsorted(keys, probes)
    found = at < len(keys)
    found[found] = keys[at[found]] == probes[found]
    return at, found


def merge_columns(keys: np.ndarray, values: np.ndarray, new_keys: np.ndarray, new_values: np.ndarray,
                  removed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique entries ``keys -> values`` with ``new_keys -> new_values`` set and ``removed``
    deleted (each argument sorted and unique; ``new_keys`` and ``removed`` disjoint). New arrays
    (or the given ones, where nothing changes)."""
    flags = np.zeros(len(keys), bool)
    if len(removed):  # removals as flagged entries, dropped at the end
        keys, values, flags = upsert_columns(keys, values, flags, removed, np.zeros(len(removed), VALUE_DTYPE),
                                             np.ones(len(removed), bool))
    keys, values, flags = upsert_columns(keys, values, flags, new_keys, new_values, np.zeros(len(new_keys), bool))
    if len(removed):
        return keys[~flags], values[~flags]
    return keys, values


def upsert_columns(keys: np.ndarray, values: np.ndarray, flags: np.ndarray, new_keys: np.ndarray,
                   new_values: np.ndarray, new_flags: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted unique entries ``keys -> (values, flags)`` with the sorted unique ``new_keys`` set
    to theirs: where a key is in both, the new value and flag win. New arrays."""
    if not len(keys):
        return new_keys, new_values, new_flags
    if not len(new_keys):
        return keys, values, flags
    at, found = positions(keys, new_keys)
    values, flags = values.copy(), flags.copy()
    values[at[found]] = new_values[found]
    flags[at[found]] = new_flags[found]
    fresh = ~found
    if fresh.any():
        at = at[fresh]
        keys = np.insert(keys, at, new_keys[fresh])
        values = np.insert(values, at, new_values[fresh])
        flags = np.insert(flags, at, new_flags[fresh])
    return keys, values, flags


def column_keys(keys: np.ndarray) -> list[bytes]:
    """``S16`` keys as a list of 16-byte ``bytes`` (an element of an ``S16`` array drops its
    trailing zero bytes; these keep them)."""
    packed = keys.tobytes()
    return [packed[at:at + KEY_SIZE] for at in range(0, len(packed), KEY_SIZE)]


class ColumnCursor:
    """Ascending entries ``(keys, values, gone)`` arriving in blocks (a tree's leaves, a run's),
    taken up to a key at a time: ``bound(count)`` says how far ``count`` more entries reach,
    ``through(high)`` takes them. Holds about ``count`` entries plus a block."""

    def __init__(self, blocks: Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]):
        self._blocks = blocks
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._held = 0
        self._ended = False

    def _fill(self, count: int) -> None:
        while self._held < count and not self._ended:
            block = next(self._blocks, None)
            if block is None:
                self._ended = True
                return
            keys, values, gone = block
            if len(keys):
                self._parts.append((keys, values, np.zeros(len(keys), bool) if gone is None else gone))
                self._held += len(keys)

    def bound(self, count: int) -> bytes | None:
        """The key ``count`` entries on (the last key if fewer remain); ``None`` once empty."""
        self._fill(count)
        if not self._held:
            return None
        at = min(count, self._held) - 1
        for keys, _values, _gone in self._parts:
            if at < len(keys):
                return keys[at:at + 1].tobytes()
            at -= len(keys)
        raise AssertionError("unreachable")

    def through(self, high: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The entries up to and including ``high`` not taken yet."""
        taken: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        while True:
            if not self._parts:
                self._fill(1)
                if not self._parts:
                    break
            keys, values, gone = self._parts[0]
            j = int(np.searchsorted(keys, high, "right"))
            if j:
                taken.append((keys[:j], values[:j], gone[:j]))
                self._held -= j
            if j < len(keys):
                self._parts[0] = (keys[j:], values[j:], gone[j:])
                break
            self._parts.pop(0)
        if len(taken) == 1:
            return taken[0]
        if not taken:
            return _EMPTY_KEYS, _EMPTY_VALUES, np.empty(0, bool)
        return tuple(np.concatenate(column) for column in zip(*taken))  # type: ignore[return-value]


def merge_streams(streams: list[Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]],
                  block: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Ascending ``(keys, values, gone)`` streams merged into one, a later stream's entry winning
    over an earlier one's for the same key (so: oldest first), removal flags kept. In steps of
    at least ``block`` entries of some stream: each step takes every stream's entries up to the
    lowest key that ``block`` entries of any stream reach, so memory holds about ``block``
    entries a stream."""
    cursors = [ColumnCursor(stream) for stream in streams]
    while True:
        bounds = [bound for bound in (cursor.bound(block) for cursor in cursors) if bound is not None]
        if not bounds:
            return
        high = min(bounds)
        merged = None
        for cursor in cursors:
            part = cursor.through(high)
            merged = part if merged is None else upsert_columns(*merged, *part)
        if merged is not None and len(merged[0]):
            yield merged


class RunCursor:
    """A sorted run (the chunks of a ``SortedRun`` or ``spill.SpilledRuns``) read in key order:
    ``through(high)`` takes its entries up to ``high``, ``rest()`` what is left."""

    def __init__(self, chunks: Iterator[SortedRun]):
        self._chunks = chunks
        self._keys = self._values = self._removed = None
        self._i = self._r = 0  # the next kept entry and the next removal of the current chunk
        self._next_chunk()

    def _next_chunk(self) -> None:
        chunk = next(self._chunks, None)
        if chunk is None:
            self._keys = None
            return
        self._keys, self._values, self._removed = run_columns(chunk)
        self._i = self._r = 0

    def through(self, high: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The run's keys up to and including ``high`` not taken yet: kept keys, values, removed keys."""
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        while self._keys is not None:
            keys, removed = self._keys, self._removed
            j = self._i + int(np.searchsorted(keys[self._i:], high, "right"))
            s = self._r + int(np.searchsorted(removed[self._r:], high, "right"))
            parts.append((keys[self._i:j], self._values[self._i:j], removed[self._r:s]))
            self._i, self._r = j, s
            if j < len(keys) or s < len(removed):
                break  # this chunk goes on above ``high``
            self._next_chunk()
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return _EMPTY_KEYS, _EMPTY_VALUES, _EMPTY_KEYS
        return tuple(np.concatenate(column) for column in zip(*parts))  # type: ignore[return-value]

    def rest(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The kept entries not taken yet, chunk by chunk (removals beyond the old tree remove nothing)."""
        while self._keys is not None:
            if self._i < len(self._keys):
                yield self._keys[self._i:], self._values[self._i:]
            self._next_chunk()


__all__ = ["KEY_DTYPE", "VALUE_DTYPE", "ColumnCursor", "RunCursor", "merge_streams", "column_keys", "leaf_columns", "merge_columns", "page_columns", "positions", "run_columns", "upsert_columns"]
