"""Tier 1 of a segment's attribute state: the updates newer than the B+tree's checkpoint.

The current value of a key is the overlay's entry if it has one (``None`` there means removed,
and shadows the tree), else the tree's. ``merge_scan`` combines the two for range scans.
Keys here are already canonical (16 ``bytes``) and values int64 or ``None``: callers convert and
validate first (``attrindex.conditional.resolve_updates``), so the hot path does no per-key checks.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from itertools import chain, islice, repeat
from operator import getitem, itemgetter, setitem
from typing import Iterator, Sequence

import numpy as np

from .value_cache import MISSING

def merge_overlay(tree, overlay: AttributeOverlay, at: int, base: int | None = None) -> bool:
    """The merge of an overlay into the B+tree, whichever process hosts it (the handle's merge
    thread or the merge worker): ``overlay`` (the log's updates up to byte ``at``) as one sorted
    batch with checkpoint ``at``. False if the tree covers
    more than ``at`` already (checkpoints only move forward). ``base``: the checkpoint of the tree
    version ``overlay`` was replayed from; ``TreeMovedError`` on any other version."""
    keys, values = overlay.sorted_items()
    return tree.update_sorted(keys, values, checkpoint=at, base=base)


__all__ = ["AttributeOverlay", "merge_overlay", "merge_scan", "probe_many", "sort_keys", "MISSING"]

# Estimated bytes per entry, for flush thresholds: the 16-byte key object (49), a boxed int value
# (32; ``None`` and small ints are shared, so this is an upper bound), the dict's slot and index
# share at a typical fill (~55) and the sorted list's pointer (8).
_ENTRY_BYTES = 144
# The empty object and list. The empty shards and their tables (~8 KiB) are left out: a limit
# such as ``max_pending_bytes`` of a few KiB keeps meaning a few dozen entries.
_BASE_BYTES = 300
# The most keys one C-level step (a sort, a copy) handles. Such a step holds the GIL from start to
# end, so a 250k-key overlay sorted in one call froze every other thread of the process (an
# ``update`` beside the background merge) for 0.1-1 s; in steps this size each hold is ~2 ms.
_STEP_KEYS = 16384
# The entries are spread over this many dicts by the key's next-to-last byte. One dict grows by
# doubling its table in ONE C-level rehash that holds the GIL: the ``apply`` that crossed 350k or
# 700k keys paid 15-32 ms of the caller's CPU. Shards double a 64th of the entries each, at
# different moments, so no apply pays more than a few small rehashes (docs/design.md).
# Not a leading byte: sequential integer keys share those. Not the last byte either: sequential
# keys would fill all shards in lockstep (each batch gives each shard the same number of keys),
# and all 64 would double in the same apply (6 ms at 700k keys, against 0.6 ms by this byte, which
# fills them in turn, 256 keys at a time). Random keys spread evenly by any byte.
SHARDS = 64
_SHARD_BYTE = itemgetter(-2)


class AttributeOverlay:
    """Attribute updates newer than the B+tree's checkpoint, kept sorted by key for range scans.

    Dicts ``key -> value | None`` (``SHARDS`` of them, a key's chosen by its next-to-last byte) plus a
    sorted key list built lazily, only after new keys arrived (updates to known keys leave it
    valid). This is cheaper than a ``SortedDict`` on the hot path, a bulk ``apply`` of ~1000 keys
    per append (one C-level call), and scans still seek in O(log n) by bisecting the list. A built
    list is never mutated, only replaced, so a scan can keep iterating over the one it started with.
    """

    __slots__ = ("_shards", "_table", "_sorted", "_counted", "_len")

    def __init__(self) -> None:
        self._shards: list[dict[bytes, int | None]] = [{} for _ in range(SHARDS)]
        # Indexed by a key's next-to-last byte (0..255): its shard.
        self._table = [self._shards[b % SHARDS] for b in range(256)]
        # Holds, sorted, the first _counted[i] keys (insertion order) of each shard i; the rest
        # arrived since.
        self._sorted: list[bytes] = []
        self._counted = [0] * SHARDS
        # The number of entries, counted once per ``apply``: the write path asks for it several
        # times per append (thresholds, back-pressure, "was it empty"), 64 dicts summed each time.
        self._len = 0

    # -- reading -------------------------------------------------------------------------------
    def get(self, key: bytes) -> object:
        """The overlay's value for ``key``: an int, ``None`` (removed), or ``MISSING`` (no entry)."""
        return self._table[key[-2]].get(key, MISSING)

    @property
    def lookup(self) -> list[dict[bytes, int | None]]:
        """For lock-free readers (a segment's read view): the entries' dicts indexed by a key's
        next-to-last byte, so ``lookup[key[-2]].get(key, MISSING)`` is ``get(key)`` (``probe_many`` for
        a list). Read it, never change it. ``apply`` changes the dicts in place, one C-level call
        that a reader sees before or after, never half-way for a key; ``clear`` replaces them, so
        a holder must take ``lookup`` again after a ``clear``."""
        return self._table

    def get_many(self, keys: list[bytes]) -> list[object]:
        """``get`` for each key, in order (C-level dict probes)."""
        return probe_many(self._table, keys if isinstance(keys, list) else list(keys))

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
        # Bind the list and table now: clear() replaces both, apply() never mutates the list.
        return _scan(keys, self._table, lo, hi)

    def sorted_items(self) -> tuple[list[bytes], list[int | None]]:
        """Every entry as parallel lists ascending by key, removals included (to flush into the tree).

        In steps of at most ``_STEP_KEYS`` keys where it can (the background merge calls this on a
        full overlay, and other threads must get the GIL between steps). A sorted list that lacks
        many keys is rebuilt by ``sort_items``, which sorts the values along with the keys."""
        shards = self._shards
        sizes = list(map(len, shards))
        if sum(sizes) - len(self._sorted) > _STEP_KEYS:
            unsorted_keys: list[bytes] = []
            unsorted_values: list[int | None] = []
            for shard in shards:  # (a dict's keys and values iterate in the same order)
                unsorted_keys += shard
                unsorted_values += shard.values()
            keys, values = sort_items(unsorted_keys, unsorted_values)
            self._sorted, self._counted = keys, sizes
            return list(keys), values
        keys = list(self._sorted_keys())  # a copy: the caller may keep or change it
        shard_of, values = self._table.__getitem__, []
        for i in range(0, len(keys), _STEP_KEYS):
            step = keys[i:i + _STEP_KEYS]
            values.extend(map(getitem, map(shard_of, map(_SHARD_BYTE, step)), step))
        return keys, values

    def copy_values(self) -> dict[bytes, int | None]:
        """The entries as a new dict (a C-level copy per shard): a snapshot to work on without the lock."""
        copy: dict[bytes, int | None] = {}
        for shard in self._shards:
            copy.update(shard)
        return copy

    def __len__(self) -> int:
        return self._len

    @property
    def nbytes(self) -> int:
        """Approximate bytes held, for flush thresholds: a fixed cost per entry (``_ENTRY_BYTES``)."""
        return _BASE_BYTES + _ENTRY_BYTES * len(self)

    # -- writing -------------------------------------------------------------------------------
    def apply(self, keys: Sequence[bytes], values: Sequence[int | None]) -> None:
        """Set ``keys[i]`` to ``values[i]`` (``None`` = removed); a later duplicate key wins."""
        if len(keys) != len(values):
            # Checked first: zip(strict=True) would raise only after a partial update.
            raise ValueError(f"apply got {len(keys)} keys and {len(values)} values")
        # ONE C-level call (maps drained by a zero-length deque): each key set in its shard, in
        # order, with no Python loop and no point where another thread runs between two keys.
        try:
            deque(map(setitem, map(self._table.__getitem__, map(_SHARD_BYTE, keys)), keys, values), maxlen=0)
        finally:  # (a bad key fails part-way: count what went in)
            self._len = sum(map(len, self._shards))
        # New keys show up as growth of a shard; the sorted list catches up on the next scan.

    def clear(self) -> None:
        """Drop everything (after the overlay was flushed into the tree)."""
        # New objects rather than .clear(): running scans and read views keep the old ones.
        self.__init__()  # type: ignore[misc]

    # -- internals -----------------------------------------------------------------------------
    def _sorted_keys(self) -> list[bytes]:
        """The sorted key list, caught up with the keys applied since it was built (callers
        serialise this with ``apply``: the segment's lock)."""
        keys, shards = self._sorted, self._shards
        sizes = list(map(len, shards))
        missing = sum(sizes) - len(keys)
        if missing > _STEP_KEYS:  # many new keys (a full overlay): sort in short steps
            keys = sort_keys(list(chain.from_iterable(shards)))
            self._sorted, self._counted = keys, sizes
        elif missing:
            # Entries are never deleted one by one, so each shard's last (size - counted) keys
            # (insertion order) are exactly its new ones. Appending them and sorting lets timsort
            # merge the sorted run with the new ones: O(n + k log k), not a full O(n log n) re-sort.
            new: list[bytes] = []
            for shard, size, counted in zip(shards, sizes, self._counted):
                if size > counted:
                    new.extend(islice(reversed(shard), size - counted))
            new.sort()
            keys = keys + new
            keys.sort()
            self._sorted, self._counted = keys, sizes
        return keys

    def __repr__(self) -> str:
        return f"AttributeOverlay({len(self)} entries)"


def probe_many(lookup: Sequence[dict[bytes, int | None]], keys: list[bytes]) -> list[object]:
    """``lookup[key[-2]].get(key, MISSING)`` for each 16-byte key, in order, with ``lookup`` an
    overlay's ``lookup`` table: C-level steps, no Python loop and one call per key."""
    if not any(lookup):  # an empty overlay (a read-mostly index): nothing to probe
        return [MISSING] * len(keys)
    if len(keys) < 2:  # (an itemgetter of one index returns the item, not a tuple)
        return [lookup[key[-2]].get(key, MISSING) for key in keys]
    joined = b"".join(keys)
    if len(joined) != 16 * len(keys):
        raise ValueError("probe_many takes 16-byte keys")
    # The keys' next-to-last bytes in one slice, each key's shard picked in one itemgetter call.
    shards = itemgetter(*joined[14::16])(lookup)
    return list(map(dict.get, shards, keys, repeat(MISSING, len(keys))))


def sort_keys(keys: list[bytes]) -> list[bytes]:
    """``sorted(keys)`` for distinct 16-byte keys (``sort_items`` without values)."""
    return sort_items(keys, keys)[0]


def sort_items(keys: list[bytes], values: list) -> tuple[list[bytes], list]:
    """Distinct 16-byte ``keys`` ascending, and ``values`` (parallel to them) in the same order.

    The keys are packed (a step at a time) into big-endian 64-bit words and ordered by numpy: by
    the first word, and by both only if two keys share the first. The sorted lists are gathered
    a step at a time too, so each step holds the GIL briefly (the sort itself is one numpy call:
    0.1-0.2 s for 1M keys, against several seconds for ``sorted`` of the bytes objects, which
    compares them one by one in Python's object protocol)."""
    n = len(keys)
    if n <= _STEP_KEYS:
        order = sorted(range(n), key=keys.__getitem__)
    else:
        packed = bytearray()
        for i in range(0, n, _STEP_KEYS):
            packed += b"".join(keys[i:i + _STEP_KEYS])
        if len(packed) != 16 * n:
            raise ValueError("sort_items takes 16-byte keys")
        words = np.frombuffer(packed, ">u8").reshape(-1, 2)
        ranked = np.argsort(words[:, 0], kind="stable")
        first = words[ranked, 0]
        if (first[1:] == first[:-1]).any():  # two keys share their first 8 bytes: order by both
            ranked = np.lexsort((words[:, 1], words[:, 0]))
        order = ranked.tolist()
    sorted_keys: list[bytes] = []
    sorted_values: list = []
    for i in range(0, n, _STEP_KEYS):
        step = order[i:i + _STEP_KEYS]
        sorted_keys += map(keys.__getitem__, step)
        sorted_values += map(values.__getitem__, step)
    return sorted_keys, sorted_values


def _scan(
    keys: list[bytes], table: list[dict[bytes, int | None]], lo: int, hi: int
) -> Iterator[tuple[bytes, int | None]]:
    for i in range(lo, hi):
        key = keys[i]
        yield key, table[key[-2]][key]


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
