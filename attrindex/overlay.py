"""Tier 1 of a segment's attribute state: the updates newer than the B+tree's checkpoint.

The current value of a key is the overlay's entry if it has one (``None`` there means removed,
and shadows the tree), else the tree's. ``merge_scan`` combines the two for range scans.
Keys here are already canonical (16 ``bytes``) and values int64 or ``None``: callers convert and
validate first (``attrindex.conditional.resolve_updates``), so the hot path does no per-key checks.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import islice, repeat
from typing import Callable, Iterator

from .value_cache import MISSING

__all__ = ["AttributeOverlay", "merge_scan", "sort_keys", "MISSING"]

# Estimated bytes per entry, for flush thresholds: the 16-byte key object (49), a boxed int value
# (32; ``None`` and small ints are shared, so this is an upper bound), the dict's slot and index
# share at a typical fill (~55) and the sorted list's pointer (8).
_ENTRY_BYTES = 144
_BASE_BYTES = 300  # the empty dict, list and object
# The most keys one C-level step (a sort, a copy) handles. Such a step holds the GIL from start to
# end, so a 250k-key overlay sorted in one call froze every other thread of the process (an
# ``update`` beside the background merge) for 0.1-1 s; in steps this size each hold is ~2 ms.
_STEP_KEYS = 16384


class AttributeOverlay:
    """Attribute updates newer than the B+tree's checkpoint, kept sorted by key for range scans.

    A dict ``key -> value | None`` plus a sorted key list built lazily, only after new keys arrived
    (updates to known keys leave it valid). This is cheaper than a ``SortedDict`` on the hot path,
    a bulk ``apply`` of ~1000 keys per append (one C-level ``dict.update``), and scans still seek
    in O(log n) by bisecting the list. A built list is never mutated, only replaced, so a scan can
    keep iterating over the one it started with.
    """

    __slots__ = ("_values", "_sorted")

    def __init__(self) -> None:
        self._values: dict[bytes, int | None] = {}
        # Holds the first len(_sorted) keys of _values, sorted; the rest arrived since.
        self._sorted: list[bytes] = []

    # -- reading -------------------------------------------------------------------------------
    def get(self, key: bytes) -> object:
        """The overlay's value for ``key``: an int, ``None`` (removed), or ``MISSING`` (no entry)."""
        return self._values.get(key, MISSING)

    @property
    def lookup(self) -> Callable[[bytes, object], object]:
        """The entries' ``dict.get`` (``lookup(key, MISSING)``), for lock-free readers (a
        segment's read view): ``apply`` changes that dict in place, one C-level ``update`` that
        a reader sees before or after, never half-way for a key; ``clear`` replaces it, so a
        holder must take ``lookup`` again after a ``clear``."""
        return self._values.get

    def get_many(self, keys: list[bytes]) -> list[object]:
        """``get`` for each key, in order (C-level dict probes)."""
        keys = keys if isinstance(keys, list) else list(keys)
        return list(map(self._values.get, keys, repeat(MISSING, len(keys))))

    def items(
        self, start: bytes | None = None, stop: bytes | None = None
    ) -> Iterator[tuple[bytes, int | None]]:
        """``(key, value)`` for ``start <= key < stop`` ascending, removals (``None``) included.

        The keys are a snapshot taken when ``items`` is called: keys applied or cleared later do
        not appear or vanish. Values are read as each key is reached, so a later ``apply`` to a
        key not yet reached is seen; after ``clear`` the scan goes on over the old contents.
        """
        keys = self._sorted_keys()
        lo = 0 if start is None else bisect_left(keys, start)
        hi = len(keys) if stop is None else bisect_left(keys, stop)
        # Bind the list and dict now: clear() replaces both, apply() never mutates the list.
        return _scan(keys, self._values, lo, hi)

    def sorted_items(self) -> tuple[list[bytes], list[int | None]]:
        """Every entry as parallel lists ascending by key, removals included (to flush into the tree).

        Built in steps of at most ``_STEP_KEYS`` keys: the background merge calls this on a full
        overlay, and other threads must get the GIL between steps."""
        keys = list(self._sorted_keys())  # a copy: the caller may keep or change it
        get, values = self._values.__getitem__, []
        for i in range(0, len(keys), _STEP_KEYS):
            values.extend(map(get, keys[i:i + _STEP_KEYS]))
        return keys, values

    def copy_values(self) -> dict[bytes, int | None]:
        """The entries as a new dict (one C-level copy): a snapshot to work on without the lock."""
        return dict(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def nbytes(self) -> int:
        """Approximate bytes held, for flush thresholds: a fixed cost per entry (``_ENTRY_BYTES``)."""
        return _BASE_BYTES + _ENTRY_BYTES * len(self._values)

    # -- writing -------------------------------------------------------------------------------
    def apply(self, keys: list[bytes], values: list[int | None]) -> None:
        """Set ``keys[i]`` to ``values[i]`` (``None`` = removed); a later duplicate key wins."""
        if len(keys) != len(values):
            # Checked first: zip(strict=True) would raise only after a partial update.
            raise ValueError(f"apply got {len(keys)} keys and {len(values)} values")
        self._values.update(zip(keys, values))
        # New keys show up as growth of the dict; the sorted list catches up on the next scan.

    def clear(self) -> None:
        """Drop everything (after the overlay was flushed into the tree)."""
        # New objects rather than .clear(): running scans keep iterating the old ones.
        self._values = {}
        self._sorted = []

    # -- internals -----------------------------------------------------------------------------
    def _sorted_keys(self) -> list[bytes]:
        keys, values = self._sorted, self._values
        missing = len(values) - len(keys)
        if missing > _STEP_KEYS:  # many new keys (a full overlay): sort in short steps
            keys = sort_keys(list(values))
            self._sorted = keys
        elif missing:
            # Entries are never deleted one by one, so the dict's last `missing` keys (insertion
            # order) are exactly the new ones. Appending them and sorting lets timsort merge the
            # sorted run with the new run: O(n + k log k), not a full O(n log n) re-sort.
            keys = keys + list(islice(reversed(values), missing))
            keys.sort()
            self._sorted = keys
        return keys

    def __repr__(self) -> str:
        return f"AttributeOverlay({len(self)} entries)"


def sort_keys(keys: list[bytes]) -> list[bytes]:
    """``sorted(keys)`` for distinct keys of equal length, in steps that each hold the GIL briefly:
    a bucket sort on the first byte where the keys differ (a Python loop, which gives the GIL
    away every switch interval), recursing into buckets bigger than ``_STEP_KEYS``; small
    buckets are sorted in C. Sequential integer keys (long shared prefixes) are split at the
    first differing byte, so the depth stays small. About as fast as one ``sorted``."""
    out: list[bytes] = []
    _bucket_sort(keys, out)
    return out


def _bucket_sort(keys: list[bytes], out: list[bytes]) -> None:
    if len(keys) <= _STEP_KEYS:
        out.extend(sorted(keys))
        return
    steps = range(0, len(keys), _STEP_KEYS)  # min and max a step at a time too
    low = min([min(keys[i:i + _STEP_KEYS]) for i in steps])
    high = max([max(keys[i:i + _STEP_KEYS]) for i in steps])
    at = next((i for i, (a, b) in enumerate(zip(low, high)) if a != b), None)
    if at is None:  # not distinct keys of one length (never in an overlay): no split byte
        out.extend(sorted(keys))
        return
    buckets: list[list[bytes]] = [[] for _ in range(256)]
    put = [bucket.append for bucket in buckets]
    for key in keys:
        put[key[at]](key)
    for bucket in buckets:
        if bucket:
            _bucket_sort(bucket, out)


def _scan(
    keys: list[bytes], values: dict[bytes, int | None], lo: int, hi: int
) -> Iterator[tuple[bytes, int | None]]:
    get = values.__getitem__
    for i in range(lo, hi):
        key = keys[i]
        yield key, get(key)


def merge_scan(
    overlay_items: Iterator[tuple[bytes, int | None]],
    tree_items: Iterator[tuple[bytes, int]],
) -> Iterator[tuple[bytes, int]]:
    """The current ``(key, value)`` pairs from the overlay's and the tree's ascending scans.

    On equal keys the overlay wins; an overlay ``None`` removes the key. Lazy: reads each side
    one pair at a time, so either may be huge or stopped early.
    """
    overlay, tree = iter(overlay_items), iter(tree_items)
    o = next(overlay, None)
    t = next(tree, None)
    while o is not None and t is not None:
        if o[0] < t[0]:
            if o[1] is not None:
                yield o
            o = next(overlay, None)
        elif t[0] < o[0]:
            yield t
            t = next(tree, None)
        else:  # same key: the overlay's entry is newer
            if o[1] is not None:
                yield o
            o = next(overlay, None)
            t = next(tree, None)
    while o is not None:
        if o[1] is not None:
            yield o
        o = next(overlay, None)
    if t is not None:
        yield t
        yield from tree
