"""Tier 1 of a segment's attribute state: the updates newer than the B+tree's checkpoint.

The current value of a key is the overlay's entry if it has one (``None`` there means removed,
and shadows the tree), else the tree's. ``merge_scan`` combines the two for range scans.
Keys here are already canonical (16 ``bytes``) and values int64 or ``None``: callers convert and
validate first (``attrindex.conditional.resolve_updates``), so the hot path does no per-key checks.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from itertools import islice, repeat
from operator import getitem, itemgetter, setitem
from typing import Iterator, Sequence

import struct

import numpy as np

from .btree.columns import KEY_DTYPE, VALUE_DTYPE, column_keys, positions, upsert_columns
from .btree.runs import newer_first
from .value_cache import MISSING

def merge_overlay(tree, overlay: AttributeOverlay, at: int, base: int | None = None, defer_rebuild: bool = False) -> bool:
    """The merge of an overlay into the B+tree, whichever process hosts it (the handle's merge
    thread or the merge worker): ``overlay`` (the log's updates up to byte ``at``) as one sorted
    batch of columns with checkpoint ``at``. False if the tree covers
    more than ``at`` already (checkpoints only move forward). ``base``: the checkpoint of the tree
    version ``overlay`` was replayed from; ``TreeMovedError`` on any other version. ``defer_rebuild``: a
    merge the caller waits for (``flush``, ``close``), which leaves a rebuild of the tree that
    is not needed yet to the background merges (``TreeIndex.update_columns``)."""
    keys, values, gone = overlay.sorted_columns()
    return tree.update_columns(keys, values, gone, checkpoint=at, base=base, defer_rebuild=defer_rebuild)


__all__ = ["AttributeOverlay", "Settled", "merge_overlay", "merge_scan", "probe_many", "sort_keys", "MISSING"]

# Estimated bytes per entry of the recent part, for flush thresholds: the 16-byte key object (49),
# a boxed int value (32; ``None`` and small ints are shared, so this is an upper bound), the
# dict's slot and index share at a typical fill (~55) and the sorted list's pointer (8).
_ENTRY_BYTES = 144
#: Bytes per entry of the settled part: 16 of key, 8 of value, 1 of removal flag.
SETTLED_ENTRY_BYTES = 25
# The empty object and list. The empty shards and their tables (~8 KiB) are left out: a limit
# such as ``max_pending_bytes`` of a few KiB keeps meaning a few dozen entries.
_BASE_BYTES = 300
# The most keys one C-level step (a sort, a copy) handles. Such a step holds the GIL from start to
# end, so a 250k-key overlay sorted in one call froze every other thread of the process (an
# ``update`` beside the background merge) for 0.1-1 s; in steps this size each hold is ~2 ms.
_STEP_KEYS = 16384
#: Entries of the recent part at which its owner folds it into the settled part (``fold``): the
#: dicts then hold at most about 38 MB, and a fold copies the settled part once per this many keys.
FOLD_KEYS = 1 << 18
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
_SCAN_BLOCK = 4096  #: settled entries turned into Python objects at a time by a scan


class Settled:
    """Entries of an overlay in compact sorted columns (``SETTLED_ENTRY_BYTES`` a key, no Python
    object per entry): ``keys`` (``S16``, ascending, unique), ``values`` (int64) and ``gone``
    (True: the key is removed, its value unused). Never changed once built, so lock-free readers
    may probe it while the owner builds the next one."""

    __slots__ = ("keys", "values", "gone", "_raw")

    def __init__(self, keys: np.ndarray, values: np.ndarray, gone: np.ndarray):
        self.keys, self.values, self.gone = keys, values, gone
        self._raw = memoryview(keys.view(np.uint8)) if len(keys) else memoryview(b"")

    def __len__(self) -> int:
        return len(self.keys)

    def get(self, key: bytes) -> object:
        """The value of ``key``: an int, ``None`` (removed) or ``MISSING``."""
        i = int(self.keys.searchsorted(key))
        if i < len(self.keys) and self._raw[i * 16:i * 16 + 16] == key:
            return None if self.gone[i] else int(self.values[i])
        return MISSING

    def get_many(self, keys: list[bytes], found: list[object] | None = None) -> list[object]:
        """``get`` for each 16-byte key, in order (one numpy search for all). With ``found``
        (a list as long as ``keys``), fill in only where it holds ``MISSING``."""
        out = [MISSING] * len(keys) if found is None else found
        if not keys or not len(self.keys):
            return out
        at, hit = positions(self.keys, np.frombuffer(b"".join(keys), KEY_DTYPE))
        rows = np.flatnonzero(hit)
        where = at[rows]
        for row, value, gone in zip(rows.tolist(), self.values[where].tolist(), self.gone[where].tolist()):
            if out[row] is MISSING:
                out[row] = None if gone else value
        return out

    def items(self, start: bytes | None, stop: bytes | None) -> Iterator[tuple[bytes, int | None]]:
        """``(key, value)`` for ``start <= key < stop`` ascending, removals as ``None``."""
        lo = 0 if start is None else int(self.keys.searchsorted(start))
        hi = len(self.keys) if stop is None else int(self.keys.searchsorted(stop))
        for at in range(lo, hi, _SCAN_BLOCK):
            end = min(at + _SCAN_BLOCK, hi)
            values = [None if gone else value for value, gone in
                      zip(self.values[at:end].tolist(), self.gone[at:end].tolist())]
            yield from zip(column_keys(self.keys[at:end]), values)


def _empty_settled() -> Settled:
    return Settled(np.empty(0, KEY_DTYPE), np.empty(0, VALUE_DTYPE), np.empty(0, bool))


class AttributeOverlay:
    """Attribute updates newer than the B+tree's checkpoint, kept sorted by key for range scans.

    Two parts. The *recent* part: dicts ``key -> value | None`` (``SHARDS`` of them, a key's chosen
    by its next-to-last byte) plus a sorted key list built lazily, only after new keys arrived.
    This is cheap on the hot path, a bulk ``apply`` of ~1000 keys per append (one C-level call),
    and scans still seek in O(log n) by bisecting the list; a built list is never mutated, only
    replaced, so a scan can keep iterating over the one it started with. The *settled* part
    (``Settled``): what ``fold`` moved out of the dicts, in compact columns, about 6 times
    smaller than in dicts, so tier 1 can hold millions of keys in bounded memory. The recent part
    shadows the settled one; a key may be in both (``len`` counts it twice until the next fold).
    """

    __slots__ = ("_shards", "_table", "_sorted", "_counted", "_len", "_settled")

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
        self._settled: Settled | None = None

    # -- reading -------------------------------------------------------------------------------
    def get(self, key: bytes) -> object:
        """The overlay's value for ``key``: an int, ``None`` (removed), or ``MISSING`` (no entry)."""
        value = self._table[key[-2]].get(key, MISSING)
        if value is MISSING and self._settled is not None:
            return self._settled.get(key)
        return value

    @property
    def lookup(self) -> list[dict[bytes, int | None]]:
        """For lock-free readers (a segment's read view): the recent part's dicts indexed by a
        key's next-to-last byte, so ``lookup[key[-2]].get(key, MISSING)`` is the recent part's
        ``get(key)`` (``probe_many`` for a list); a key it does not hold is looked up in
        ``settled``. Read it, never change it. ``apply`` changes the dicts in place, one C-level
        call that a reader sees before or after, never half-way for a key; ``fold`` and ``clear``
        replace them, so a holder must take ``lookup`` and ``settled`` again after either."""
        return self._table

    @property
    def settled(self) -> Settled | None:
        """The settled part for lock-free readers (``None``: empty); see ``lookup``."""
        return self._settled

    def get_many(self, keys: list[bytes]) -> list[object]:
        """``get`` for each key, in order (C-level dict probes, one numpy search for the rest)."""
        keys = keys if isinstance(keys, list) else list(keys)
        found = probe_many(self._table, keys)
        if self._settled is not None:
            self._settled.get_many(keys, found)
        return found

    def items(
        self, start: bytes | None = None, stop: bytes | None = None
    ) -> Iterator[tuple[bytes, int | None]]:
        """``(key, value)`` for ``start <= key < stop`` ascending, removals (``None``) included.

        The recent part's keys are a snapshot taken when ``items`` is called: keys applied or
        cleared later do not appear or vanish. Its values are read as each key is reached, so a
        later ``apply`` to a key not yet reached is seen; after ``clear`` or ``fold`` the scan goes
        on over the old contents. The settled part never changes.
        """
        keys = self._sorted_keys()
        lo = 0 if start is None else bisect_left(keys, start)
        hi = len(keys) if stop is None else bisect_left(keys, stop)
        # Bind the list and table now: clear() replaces both, apply() never mutates the list.
        recent = _scan(keys, self._table, lo, hi)
        if self._settled is None:
            return recent
        return newer_first(recent, self._settled.items(start, stop))

    def snapshot_items(self, start: bytes | None = None,
                       stop: bytes | None = None) -> Iterator[tuple[bytes, int | None]]:
        """``items`` with the recent part's entries copied now (callers hold the lock that
        serialises ``apply``): later updates are not seen. The settled part, which never
        changes, is read lazily, so a scan holds at most ``FOLD_KEYS`` entries of its own."""
        keys = self._sorted_keys()
        lo = 0 if start is None else bisect_left(keys, start)
        hi = len(keys) if stop is None else bisect_left(keys, stop)
        recent = iter(list(_scan(keys, self._table, lo, hi)))
        if self._settled is None:
            return recent
        return newer_first(recent, self._settled.items(start, stop))

    def sorted_items(self) -> tuple[list[bytes], list[int | None]]:
        """Every entry as parallel lists ascending by key, removals included.

        In steps of at most ``_STEP_KEYS`` keys where it can (other threads must get the GIL
        between steps). A sorted list that lacks many keys is rebuilt by ``sort_items``, which
        sorts the values along with the keys. For a large overlay, ``sorted_columns`` holds a
        fraction of the memory."""
        if self._settled is not None:
            pairs = list(self.items())
            return [key for key, _ in pairs], [value for _, value in pairs]
        shards = self._shards
        sizes = list(map(len, shards))
        if sum(sizes) - len(self._sorted) > _STEP_KEYS:
            keys, values = self._recent_sorted(sizes)
            return list(keys), values
        keys = list(self._sorted_keys())  # a copy: the caller may keep or change it
        shard_of, values = self._table.__getitem__, []
        for i in range(0, len(keys), _STEP_KEYS):
            step = keys[i:i + _STEP_KEYS]
            values.extend(map(getitem, map(shard_of, map(_SHARD_BYTE, step)), step))
        return keys, values

    def sorted_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every entry as columns ascending by key: ``S16`` keys, int64 values and removal flags
        (the recent part over the settled one; the settled part's own arrays when the recent
        part is empty). Callers serialise this with ``apply`` (the segment's lock or the merge)."""
        recent = self._recent_columns()
        if self._settled is None:
            return recent
        settled = self._settled
        return upsert_columns(settled.keys, settled.values, settled.gone, *recent)

    def __len__(self) -> int:
        return self._len

    @property
    def recent_count(self) -> int:
        """Entries of the recent part (its owner folds it at ``FOLD_KEYS``)."""
        return self._len - (0 if self._settled is None else len(self._settled))

    @property
    def fold_due(self) -> bool:
        """Whether the recent part holds ``FOLD_KEYS`` entries: its owner should ``fold`` it."""
        return self.recent_count >= FOLD_KEYS

    @property
    def nbytes(self) -> int:
        """Approximate bytes held, for flush thresholds: a fixed cost per entry of each part."""
        settled = 0 if self._settled is None else len(self._settled)
        return _BASE_BYTES + _ENTRY_BYTES * (self._len - settled) + SETTLED_ENTRY_BYTES * settled

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
            self._len = sum(map(len, self._shards)) + (0 if self._settled is None else len(self._settled))
        # New keys show up as growth of a shard; the sorted list catches up on the next scan.

    def fold(self) -> None:
        """Move the recent part into the settled one (the recent entries win), leaving the
        recent part empty. Readers holding the old ``lookup`` and ``settled`` keep reading the
        old contents, whole: the owner publishes the new ones (see ``lookup``)."""
        keys, values, gone = self.sorted_columns()
        settled = Settled(keys, values, gone)
        self.__init__()  # type: ignore[misc]  # new dicts: readers of the old ones are unaffected
        self._settled, self._len = settled, len(settled)

    def absorb(self, newer: AttributeOverlay) -> None:
        """Take every entry of ``newer`` over this overlay's (``newer`` wins), folded into the
        settled part; ``newer`` is left as it was. Published as ``fold`` is."""
        keys, values, gone = self.sorted_columns()
        settled = Settled(*upsert_columns(keys, values, gone, *newer.sorted_columns()))
        self.__init__()  # type: ignore[misc]
        self._settled, self._len = settled, len(settled)

    def clear(self) -> None:
        """Drop everything (after the overlay was flushed into the tree)."""
        # New objects rather than .clear(): running scans and read views keep the old ones.
        self.__init__()  # type: ignore[misc]

    # -- internals -----------------------------------------------------------------------------
    def _recent_sorted(self, sizes: list[int]) -> tuple[list[bytes], list[int | None]]:
        """The recent part's keys and values sorted by ``sort_items`` (the sorted list is kept)."""
        unsorted_keys: list[bytes] = []
        unsorted_values: list[int | None] = []
        for shard in self._shards:  # (a dict's keys and values iterate in the same order)
            unsorted_keys += shard
            unsorted_values += shard.values()
        keys, values = sort_items(unsorted_keys, unsorted_values)
        self._sorted, self._counted = keys, sizes
        return keys, values

    def _recent_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The recent part as sorted columns (``sorted_columns`` without the settled part)."""
        sizes = list(map(len, self._shards))
        if not sum(sizes):
            return np.empty(0, KEY_DTYPE), np.empty(0, VALUE_DTYPE), np.empty(0, bool)
        keys, values = self._recent_sorted(sizes)
        gone = np.fromiter(map(_is_none, values), bool, len(values))
        try:
            column = struct.pack(f"={len(values)}q", *values)
        except struct.error:  # removals: 0 in their place
            column = struct.pack(f"={len(values)}q", *(0 if v is None else v for v in values))
        packed = bytearray()
        for i in range(0, len(keys), _STEP_KEYS):
            packed += b"".join(keys[i:i + _STEP_KEYS])
        return np.frombuffer(packed, KEY_DTYPE), np.frombuffer(column, np.int64).astype(VALUE_DTYPE, copy=False), gone

    def _sorted_keys(self) -> list[bytes]:
        """The recent part's sorted key list, caught up with the keys applied since it was built
        (callers serialise this with ``apply``: the segment's lock)."""
        keys, shards = self._sorted, self._shards
        sizes = list(map(len, shards))
        missing = sum(sizes) - len(keys)
        if missing > _STEP_KEYS:  # many new keys (a full overlay): sort in short steps
            keys = self._recent_sorted(sizes)[0]
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


def _is_none(value: object) -> bool:
    return value is None


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
