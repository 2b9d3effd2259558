"""The recent-values cache: recent attribute values (and known absences), in two dict generations.

A lookup is one or two dict probes; there is no per-hit bookkeeping. New entries go to the young
generation; when it fills, it becomes the old one and the previous old one is dropped. A hit in the
old generation is promoted. So the cache holds between ``capacity`` and ``2 * capacity`` entries,
and what survives a turnover is whatever was used since the last one (a clock-like policy).

Lock-free readers (``TreeIndex``, a segment's read view) probe ``young`` directly, then ``peek``,
which never writes: the owner promotes and fills under its own lock, and only if the tree did not
change meanwhile (a value read before a change must not be cached after it). ``get`` promotes
itself, for owners that call it under their lock.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from .btree.columns import KEY_DTYPE, positions
from .errors import InvalidInputError

MISSING = object()


class ValueCache:
    """Maps 16-byte keys to their value, or to ``None`` when the key is known to be absent."""

    __slots__ = ("capacity", "young", "old", "hits", "misses")

    def __init__(self, capacity: int):
        if type(capacity) is not int or capacity < 0:
            raise InvalidInputError(f"value_cache_entries must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.young: dict[bytes, int | None] = {}
        self.old: dict[bytes, int | None] = {}
        self.hits = self.misses = 0

    def get(self, key: bytes) -> object:
        """The cached value (``None`` = known absent) or ``MISSING``."""
        value = self.young.get(key, MISSING)
        if value is MISSING:
            value = self.old.get(key, MISSING)
            if value is MISSING:
                self.misses += 1
                return MISSING
            self.put(key, value)
        self.hits += 1
        return value

    def peek(self, key: bytes) -> tuple[object, bool]:
        """``(value, from_old)``: as ``get`` (hits and misses counted) but never promoting, so it
        is safe beside writers; ``from_old`` says the value came from the old generation (the
        caller may ``put`` it back under its lock to promote it)."""
        value = self.young.get(key, MISSING)
        if value is not MISSING:
            self.hits += 1
            return value, False
        value = self.old.get(key, MISSING)
        if value is MISSING:
            self.misses += 1
            return MISSING, False
        self.hits += 1
        return value, True

    def peek_many(self, keys: list[bytes]) -> tuple[list[object], list[int]]:
        """``peek`` for each key: ``(values, indexes of keys found in the old generation)``
        (C-level probes of the young generation; the rest one by one). Never writes."""
        found = list(map(self.young.get, keys, repeat(MISSING, len(keys))))
        misses = found.count(MISSING)
        from_old: list[int] = []
        if misses:
            get_old = self.old.get
            for i, value in enumerate(found):
                if value is MISSING:
                    value = found[i] = get_old(keys[i], MISSING)
                    if value is MISSING:
                        self.misses += 1
                    else:
                        from_old.append(i)
                        self.hits += 1
            self.hits += len(keys) - misses
        else:
            self.hits += len(keys)
        return found, from_old

    def put(self, key: bytes, value: int | None) -> None:
        if not self.capacity:
            return
        young = self.young
        young[key] = value
        if len(young) >= self.capacity:
            self.old, self.young = young, {}

    def put_many(self, keys, values) -> None:
        for key, value in zip(keys, values):
            self.put(key, value)

    def refresh_many(self, updates: dict[bytes, int | None]) -> None:
        """Update the keys of ``updates`` that are cached; add none (for bulk writes)."""
        for table in (self.young, self.old):
            if len(table) < len(updates):
                for key in [k for k in table if k in updates]:
                    table[key] = updates[key]
            else:
                for key in [k for k in updates if k in table]:
                    table[key] = updates[key]

    def refresh_columns(self, keys, values, gone) -> None:
        """``refresh_many`` for a batch as columns (sorted ``S16`` keys, int64 values, removal
        flags): the cached keys are looked up in the batch (one numpy search), none is added."""
        for table in (self.young, self.old):
            if not table or not len(keys):
                continue
            cached = list(table)
            at, hit = positions(keys, np.frombuffer(b"".join(cached), KEY_DTYPE))
            rows = np.flatnonzero(hit)
            where = at[rows]
            for row, value, removed in zip(rows.tolist(), values[where].tolist(), gone[where].tolist()):
                table[cached[row]] = None if removed else value

    def clear(self) -> None:
        self.young, self.old = {}, {}

    def __len__(self) -> int:
        return len(self.young) + sum(1 for k in self.old if k not in self.young)
