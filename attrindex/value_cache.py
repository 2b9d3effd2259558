"""Tier 1 of the cache: recent attribute values (and known absences), in two dict generations.

A lookup is one or two dict probes; there is no per-hit bookkeeping. New entries go to the young
generation; when it fills, it becomes the old one and the previous old one is dropped. A hit in the
old generation is promoted. So the cache holds between ``capacity`` and ``2 * capacity`` entries,
and what survives a turnover is whatever was used since the last one (a clock-like policy).
"""

from __future__ import annotations

from itertools import repeat

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

    def get_many(self, keys: list[bytes]) -> list[object]:
        """``get`` for each key (C-level probes of the young generation; the rest one by one)."""
        found = list(map(self.young.get, keys, repeat(MISSING, len(keys))))
        misses = found.count(MISSING)
        if misses:
            get = self.get
            for i, value in enumerate(found):
                if value is MISSING:
                    found[i] = get(keys[i])
            self.hits += len(keys) - misses
        else:
            self.hits += len(keys)
        return found

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

    def clear(self) -> None:
        self.young, self.old = {}, {}

    def __len__(self) -> int:
        return len(self.young) + sum(1 for k in self.old if k not in self.young)
