"""Bulk load: build a whole B+tree bottom-up from (key, value) pairs and write it as one update.

Two phases, so that bad input never writes anything (but temporary files, deleted) and a lost
compare-and-append race can be retried without the caller's input (which may be a one-shot
iterator):

1. **Read** (:func:`read_pairs`): validate every pair and turn the input into sorted unique
   keys in compact columns (a :class:`SortedRun`: 16 bytes per key, 8 per value; about 24 bytes a
   pair, against about 100 for Python lists). Input that arrives in ascending order (equal
   neighbours allowed) is streamed into the run chunk by chunk; from the first chunk out of order
   on, the pairs are packed into key and value columns and sorted there with numpy
   (``column_sort.py``). Once what is held
   reaches ``spill_bytes`` (256 MiB by default), it is sorted and written to a temporary file as
   a sorted run, and reading goes on with empty memory: the load's memory does not grow with its
   input (``spill.py``, an external sort: runs read back block by block, merged where their key
   ranges overlap). Duplicate keys: the last wins. ``None`` values mean absent: they remove
   existing keys when loading into a non-empty tree and are dropped otherwise. The cyclic garbage
   collector is paused while reading (see :func:`read_pairs`).
2. **Build** (:func:`build`): stream the run, merged with the existing tree's leaves (read in
   key order as numpy columns, ``columns.py``, and merged in blocks), into full leaves, then index levels over them (child offsets, lengths and
   subtree minimum offsets), then the footer: one update, appended in pieces of about
   ``piece_size`` bytes as the pages fill (docs/format.md, "Updates in pieces"). Each piece ends
   with a footer that restates the old tree, so only the last append, ending with the new
   footer, changes what readers see: a crash or a failed append before it leaves the old tree;
   every page of the old tree becomes dead, and the truncation after the load reclaims their
   chunks. Memory is one piece of pages, the pointers to the leaves (28 bytes a leaf) and a block
   of the run (the whole run when it was not spilled).

Leaves are full (``leaf_capacity`` entries) but for the last; index pages likewise, except that
the last page of a level never holds a single child. The pages are the ones of ``page.py``,
byte for byte (leaves are encoded from the columns directly, without a per-entry Python step).
"""

from __future__ import annotations

import gc
import itertools
import operator
import struct
from array import array
from typing import Callable, Iterator

import numpy as np

from storage_adapters.errors import InvalidInputError

from ..arguments import check_progress
from ..keys import KEY_SIZE, VALUE_MAX, VALUE_MIN, pair_iter, to_key, to_update
from .column_sort import ColumnCollector
from .columns import KEY_DTYPE, VALUE_DTYPE, RunCursor, merge_columns
from .sorted_run import SortedRun
from .spill import SpilledRuns
from .footer import FOOTER_SIZE, Footer
from .key_filter import FilterBuilder, KeyFilter
from .page import FILTER, FORMAT_VERSION, HEADER, LEAF, RUN_LEAF, encode_blob, encode_index, encode_runs, page_checksum
from .runs import FILTER_BITS_PER_KEY, MAX_FILTER_BYTES, RunRef, TreeRef, forest_footer

READ_CHUNK = 1 << 16  #: pairs validated and sorted-checked at a time
PROGRESS_EVERY = 1 << 16  #: pairs (or entries) between progress calls
DEFAULT_SPILL_BYTES = 256 << 20  #: about what the pairs held in memory may take before they are spilled
_CRC = struct.Struct("<I")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)

Progress = Callable[[int, int], None]


# -- phase 1: read and validate ----------------------------------------------------------------
def _canonical_chunk(chunk: list, first: int) -> tuple[list[bytes], list[int | None], bool]:
    """Keys and values of ``chunk`` (pairs number ``first``...), validated, and whether the chunk's
    pairs are canonical already (tuples of 16-byte ``bytes`` and int64 or ``None``): those are
    checked with C-level passes."""
    if set(map(type, chunk)) == {tuple} and set(map(len, chunk)) == {2}:
        keys, values = list(map(_FIRST, chunk)), list(map(_SECOND, chunk))  # zip(*chunk): 1.7x slower
        if set(map(type, keys)) == {bytes} and set(map(len, keys)) == {KEY_SIZE}:
            types = set(map(type, values))
            if types <= {int, type(None)}:
                ints = [v for v in values if v is not None] if type(None) in types else values
                if not ints or (VALUE_MIN <= min(ints) and max(ints) <= VALUE_MAX):
                    return keys, values, True
    keys, values = [], []
    for i, pair in enumerate(chunk, first):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidInputError(f"pair {i} must be a (key, value) pair, got {pair!r:.60}")
        try:
            keys.append(to_key(pair[0]))
            values.append(to_update(pair[1]))
        except InvalidInputError as error:
            raise type(error)(f"pair {i}: {error}") from None
    return keys, values, False


def read_pairs(pairs: object, progress: Progress | None = None, *,
               spill_bytes: int = DEFAULT_SPILL_BYTES) -> SortedRun | SpilledRuns:
    """Validate every pair of ``pairs`` and return them sorted (the last pair for a key wins):
    a ``SortedRun`` in memory, or, once what is held reaches about ``spill_bytes``, sorted runs
    spilled to temporary files (``spill.SpilledRuns``; the caller ``close()``s it when the load
    is over). Raises ``InvalidInputError`` (or a subclass naming the pair) on any bad pair,
    having written nothing but those temporary files (deleted then).

    The cyclic garbage collector is paused meanwhile: reading makes only acyclic objects (lists,
    tuples, bytes), yet their sheer number would trigger collections that walk the caller's
    millions of pairs again and again (a third of the time of a 1M-pair load, measured).
    """
    total = len(pairs) if hasattr(pairs, "__len__") else 0  # type: ignore[arg-type]
    return _read(_pair_columns(pair_iter(pairs, "bulk_load pairs")), total, progress, spill_bytes)


def read_columns(chunks: object, progress: Progress | None = None, *,
                 spill_bytes: int = DEFAULT_SPILL_BYTES) -> SortedRun | SpilledRuns:
    """``read_pairs`` for input given as columns: an iterable of ``(keys, values)`` chunks (see
    ``column_chunk`` for what each may be), checked chunk by chunk without a Python object per
    pair. The last value for a key wins; columns remove nothing (no ``None`` values)."""
    if chunks is None or isinstance(chunks, (str, bytes, bytearray, memoryview, tuple)):
        raise InvalidInputError(f"bulk_load_columns takes an iterable of (keys, values) chunks, got {chunks!r:.60}")
    try:
        source = iter(chunks)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidInputError(f"bulk_load_columns takes an iterable of (keys, values) chunks, "
                                f"got {type(chunks).__name__}") from None
    return _read((column_chunk(chunk, n) + (None,) for n, chunk in enumerate(source)), 0, progress, spill_bytes)


def column_chunk(chunk: object, number: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One ``(keys, values)`` chunk of columns as ``S16`` keys and int64 values, checked
    (``InvalidInputError`` naming chunk ``number`` otherwise). Keys: a numpy array of ``S16``,
    of ``uint8`` shaped ``(n, 16)`` or of unsigned ints shaped ``(n, 2)`` (big-endian words,
    high first, as ``int.to_bytes(16, "big")`` splits them), a pyarrow ``fixed_size_binary(16)``
    array without nulls, or ``bytes`` of 16 per key. Values: an integer numpy or pyarrow array
    (or a sequence) that fits int64, without nulls."""
    what = f"bulk_load_columns chunk {number}"
    if not isinstance(chunk, (tuple, list)) or len(chunk) != 2:
        raise InvalidInputError(f"{what} must be a (keys, values) pair, got {type(chunk).__name__}")
    keys, values = _key_column(chunk[0], what), _value_column(chunk[1], what)
    if len(keys) != len(values):
        raise InvalidInputError(f"{what} has {len(keys)} keys and {len(values)} values")
    return keys, values


def _key_column(keys: object, what: str) -> np.ndarray:
    if hasattr(keys, "buffers") and hasattr(keys, "type"):  # a pyarrow array
        if str(keys.type) != f"fixed_size_binary[{KEY_SIZE}]":
            raise InvalidInputError(f"{what}: keys must be fixed_size_binary({KEY_SIZE}), got {keys.type}")
        if keys.null_count:
            raise InvalidInputError(f"{what}: {keys.null_count} keys are null")
        data = keys.buffers()[1]
        return np.frombuffer(data, KEY_DTYPE, len(keys), keys.offset * KEY_SIZE) if len(keys) else np.empty(0, KEY_DTYPE)
    if isinstance(keys, (bytes, bytearray, memoryview)):
        if len(keys) % KEY_SIZE:
            raise InvalidInputError(f"{what}: {len(keys)} bytes of keys is not a multiple of {KEY_SIZE}")
        return np.frombuffer(keys, KEY_DTYPE)
    if not isinstance(keys, np.ndarray):
        raise InvalidInputError(f"{what}: keys must be a numpy or pyarrow array or bytes, got {type(keys).__name__}")
    if keys.dtype == KEY_DTYPE and keys.ndim == 1:
        return np.ascontiguousarray(keys)
    if keys.dtype == np.uint8 and keys.shape[1:] == (KEY_SIZE,):
        return np.ascontiguousarray(keys).view(KEY_DTYPE).reshape(-1)
    if keys.dtype.kind == "u" and keys.dtype.itemsize == 8 and keys.shape[1:] == (2,):
        return np.ascontiguousarray(keys, dtype=">u8").view(KEY_DTYPE).reshape(-1)
    raise InvalidInputError(f"{what}: keys must be S16, uint8 of shape (n, 16) or uint64 of shape (n, 2), got "
                            f"{keys.dtype} of shape {keys.shape}")


def _value_column(values: object, what: str) -> np.ndarray:
    if hasattr(values, "null_count") and hasattr(values, "to_numpy"):  # a pyarrow array
        if values.null_count:
            raise InvalidInputError(f"{what}: {values.null_count} values are null (columns remove nothing)")
        values = values.to_numpy(zero_copy_only=False)
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidInputError(f"{what}: values must be integers that fit int64: {error}") from None
    if array.ndim == 1 and not len(array):
        return np.empty(0, VALUE_DTYPE)  # (an empty list is float64 to numpy)
    if array.ndim != 1 or array.dtype.kind not in "iu" or (array.dtype.kind == "u" and len(array) and array.max() > VALUE_MAX):
        raise InvalidInputError(f"{what}: values must be integers that fit int64 in one dimension, got "
                                f"{array.dtype} of shape {array.shape}")
    return array.astype(VALUE_DTYPE, copy=False)


def _pair_columns(source: Iterator) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Pairs read ``READ_CHUNK`` at a time and validated, as columns: keys, values (0 for a
    removal) and which rows are removals (``None``: none are)."""
    done = 0
    while True:
        chunk = list(itertools.islice(source, READ_CHUNK))
        if not chunk:
            return
        keys, values, _canonical = _canonical_chunk(chunk, done)
        done += len(chunk)
        key_column = np.frombuffer(b"".join(keys), KEY_DTYPE)
        try:
            yield key_column, np.frombuffer(struct.pack(f"={len(values)}q", *values), np.int64), None
        except struct.error:  # a None among them: a removal
            removed = np.fromiter(map(_is_none, values), bool, len(values))
            column = struct.pack(f"={len(values)}q", *(0 if v is None else v for v in values))
            yield key_column, np.frombuffer(column, np.int64), removed


def _is_none(value: object) -> bool:
    return value is None


def _read(chunks: Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]], total: int,
          progress: Progress | None, spill_bytes: int) -> SortedRun | SpilledRuns:
    check_progress(progress)
    if type(spill_bytes) is not int or spill_bytes < 1:
        raise InvalidInputError(f"spill_bytes must be an int >= 1, got {spill_bytes!r:.60}")
    paused = gc.isenabled()
    gc.disable()
    spilled = SpilledRuns(_new_collector)
    try:
        run = _read_runs(chunks, total, progress, spilled, spill_bytes)
        if not spilled.runs:
            return run
        spilled.add(run)
        return spilled
    except BaseException:
        spilled.close()
        raise
    finally:
        if paused:
            gc.enable()


#: Bytes a held pair costs: in a sorted run (its two columns), and collected unsorted, in numpy's
#: columns (with the sort's index arrays).
_RUN_PAIR_BYTES = KEY_SIZE + 8
_COLUMNS_PAIR_BYTES = 56


def _read_runs(chunks: Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]], total: int,
               progress: Progress | None, spilled: SpilledRuns, spill_bytes: int) -> SortedRun:
    """The chunks read so far, sorted; the runs that reached ``spill_bytes`` go to ``spilled``.

    Chunks that arrive in ascending key order (equal neighbours allowed: the last wins) are
    appended to a sorted run; from the first chunk out of order on, the chunks are collected as
    columns and sorted once at the end, or at the spill (``column_sort``)."""
    run = SortedRun()
    collected: ColumnCollector | None = None  # once the input proved unsorted
    held = done = 0  # pairs in ``run`` or ``collected``; pairs read
    for keys, values, removed in chunks:
        done += len(keys)
        if progress is not None:
            progress(done, total)
        if not len(keys):
            continue
        if collected is None:
            if not (keys[1:] > keys[:-1]).all():
                if (keys[1:] >= keys[:-1]).all():  # repeats: the last of each wins
                    last_of_each = np.append(keys[1:] != keys[:-1], True)
                    keys, values = keys[last_of_each], values[last_of_each]
                    removed = None if removed is None else removed[last_of_each]
                else:
                    collected = _new_collector()
            last = run.last_key()
            first = keys[:1].tobytes()
            if collected is None and last is not None and first < last:
                collected = _new_collector()
            if collected is None:
                if first == last:
                    run.drop_last(last)
                run.extend_columns(keys, values, removed)
            else:  # out of order: collect from here on, sort once at the end (or at the spill)
                collected.add_run(run)
                run = SortedRun()
        if collected is not None:
            collected.add_columns(keys, values, removed)
        held += len(keys)
        cost = _RUN_PAIR_BYTES if collected is None else _COLUMNS_PAIR_BYTES
        if held * cost >= spill_bytes:
            if collected is not None:
                collected.sort_into(run, None)
            spilled.add(run)  # a newer run wins over older ones where they share keys
            run, collected, held = SortedRun(), None, 0
    if collected is not None:
        collected.sort_into(run, progress)
    return run


def _new_collector() -> ColumnCollector:
    """Where unsorted pairs go until the sort (``column_sort.py``)."""
    return ColumnCollector()


# -- phase 2: build ----------------------------------------------------------------------------
#: Entries of old leaves gathered before one merge step: numpy's calls cost microseconds each, so
#: a step spans some dozens of leaves.
MERGE_BLOCK_ENTRIES = 1 << 16


class _Builder:
    """Lays out leaves (full), then index levels, then the footer, at ``base``. With ``flush``,
    the pages are handed over in pieces as they fill (``flush(data, offset)`` appends them as a
    piece and returns the offset that follows: see ``BTreeIndex``), so memory holds about one
    piece of pages plus the pointers to the leaves (28 bytes a leaf, in columns)."""

    def __init__(self, base: int, leaf_capacity: int, index_capacity: int,
                 flush: Callable[[bytearray, int], int] | None = None, piece_size: int = 0, *, removals: bool = False):
        self.base = base  #: the offset of ``buffer[0]``
        self.removals = removals  #: a run's tree: ``RUN_LEAF`` pages, which keep removal flags
        self.leaf_capacity = leaf_capacity
        self.index_capacity = index_capacity
        self.buffer = bytearray()
        self.pending: list[tuple[np.ndarray, ...]] = []  # entries short of a full leaf, as columns
        self.pending_count = 0
        # Level 1, one entry a leaf: its first key, offset and length (its minimum offset is its own).
        self.leaf_keys = bytearray()
        self.leaf_offsets = array("q")
        self.leaf_lengths = array("q")
        self.entries = 0
        self.pages = 0
        self.live_bytes = 0
        self._flush = flush
        self._piece_size = piece_size

    def add(self, keys: np.ndarray, values: np.ndarray, gone: np.ndarray | None = None) -> None:
        """Append ascending entries (all above those added before) as columns: ``S16`` keys and
        little-endian int64 values (``columns.py``), and for a run's tree their removal flags."""
        columns: tuple[np.ndarray, ...] = (keys, values)  # a main tree's leaves hold no removal flags
        if self.removals:
            columns += (np.zeros(len(keys), bool) if gone is None else gone,)
        count, at, cap = len(keys), 0, self.leaf_capacity
        if self.pending:
            at = min(cap - self.pending_count, count)
            self.pending.append(tuple(column[:at] for column in columns))
            self.pending_count += at
            if self.pending_count < cap:
                return
            self._leaf(*(np.concatenate(column) for column in zip(*self.pending)))
            self.pending, self.pending_count = [], 0
        while count - at >= cap:  # whole leaves straight from the columns
            self._leaf(*(column[at:at + cap] for column in columns))
            at += cap
        if at < count:
            self.pending.append(tuple(column[at:] for column in columns))
            self.pending_count = count - at

    def _leaf(self, keys: np.ndarray, values: np.ndarray, gone: np.ndarray | None = None) -> None:
        n = len(keys)
        offset = self.base + len(self.buffer)
        page = bytearray(HEADER.pack(FORMAT_VERSION, RUN_LEAF if self.removals else LEAF, 0, n, 0))
        page += keys.tobytes()
        page += values.astype(VALUE_DTYPE, copy=False).tobytes()
        if gone is not None:
            page += gone.astype(np.uint8).tobytes()
        _CRC.pack_into(page, 8, page_checksum(offset, page))
        self.leaf_keys += keys[:1].tobytes()  # (a slice: an element of S16 loses trailing zero bytes)
        self.leaf_offsets.append(offset)
        self.leaf_lengths.append(len(page))
        self.entries += n
        self._add(page)

    def _add(self, page: bytes | bytearray) -> None:
        self.buffer += page
        self.pages += 1
        self.live_bytes += len(page)
        if self._flush is not None and len(self.buffer) >= self._piece_size:
            self.base = self._flush(self.buffer, self.base)
            self.buffer = bytearray()

    def _leaf_pointers(self, lo: int, hi: int) -> list[tuple[bytes, int, int, int]]:
        keys, offsets, lengths = self.leaf_keys, self.leaf_offsets, self.leaf_lengths
        return [(bytes(keys[i * KEY_SIZE:(i + 1) * KEY_SIZE]), offsets[i], lengths[i], offsets[i]) for i in range(lo, hi)]

    def finish(self, checkpoint: int) -> tuple[bytes, Footer, int]:
        """Flush the last leaf, stack the index levels, append the footer: the bytes of the last
        append, its footer, and the offset to append them at (after the pieces)."""
        tree = self.finish_tree()
        footer_offset = self.base + len(self.buffer)
        footer = Footer(root_offset=tree.offset, root_length=tree.length, height=tree.height, entry_count=tree.entries,
                        page_count=tree.pages, live_bytes=tree.live_bytes,
                        min_offset=tree.min_offset if tree.length else footer_offset, checkpoint=checkpoint,
                        update_length=len(self.buffer) + FOOTER_SIZE)
        self.buffer += footer.encode(footer_offset)
        return bytes(self.buffer), footer, self.base

    def place(self, encode: Callable[[int], bytes]) -> tuple[int, int]:
        """Append the page ``encode(offset)`` returns for the offset it lands at: ``(offset, length)``."""
        offset = self.base + len(self.buffer)
        page = encode(offset)
        self._add(page)
        return offset, len(page)

    def finish_tree(self) -> TreeRef:
        """Flush the last leaf and stack the index levels: the tree built (the pages stay in the
        buffer: more may follow before the footer)."""
        if self.pending:
            self._leaf(*(np.concatenate(column) for column in zip(*self.pending)))
            self.pending, self.pending_count = [], 0
        leaves = len(self.leaf_offsets)
        height = 1 if leaves else 0
        if leaves > 1:  # the level above the leaves, one group of pointers at a time
            pointers = [self._index(self._leaf_pointers(lo, hi)) for lo, hi in _ranges(leaves, self.index_capacity)]
            height += 1
        else:
            pointers = self._leaf_pointers(0, leaves)
        while len(pointers) > 1:
            pointers = [self._index(pointers[lo:hi]) for lo, hi in _ranges(len(pointers), self.index_capacity)]
            height += 1
        root = pointers[0] if pointers else None
        if root is None:
            return TreeRef()
        return TreeRef(root[1], root[2], height, self.entries, self.pages, self.live_bytes, root[3])

    def _index(self, group: list[tuple[bytes, int, int, int]]) -> tuple[bytes, int, int, int]:
        keys, offsets, lengths, mins = map(list, zip(*group))
        offset = self.base + len(self.buffer)
        page = encode_index(keys, offsets, lengths, mins, offset)  # keys[0] is stored as MIN_KEY
        self._add(page)
        return keys[0], offset, len(page), min(mins)


def _ranges(count: int, capacity: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each index page's children among ``count`` pointers: full groups of
    ``capacity`` but the last; a last group of one borrows from the one before (an index page
    routes to at least two children)."""
    bounds = [*range(0, count, capacity), count]
    ranges = list(zip(bounds, bounds[1:]))
    if len(ranges) > 1 and ranges[-1][1] - ranges[-1][0] == 1:
        (a, b), d = ranges[-2], ranges[-1][1]
        ranges[-2:] = [(a, b - 1), (b - 1, d)]
    return ranges


def build(run: SortedRun | SpilledRuns, old_leaves: Iterator[tuple[np.ndarray, np.ndarray]] | None, base: int,
          checkpoint: int, *, leaf_capacity: int, index_capacity: int, old_entries: int = 0,
          progress: Progress | None = None, flush: Callable[[bytearray, int], int] | None = None,
          piece_size: int = 0) -> tuple[bytes, Footer, int]:
    """A fresh tree holding ``run`` merged over ``old_leaves`` (the current tree's leaves in key
    order as columns, ``(keys, values)`` from ``columns.leaf_columns``; ``None`` for an empty
    tree), appended from ``base`` on, with at most ``leaf_capacity`` entries a leaf and
    ``index_capacity`` an index page: ``(bytes, footer, offset)``, the last append and where it
    goes. With ``flush``, pages are handed to it in pieces of about ``piece_size`` bytes first
    (see ``_Builder``). ``run`` is read once, chunk by chunk (``chunks()``: sorted runs of
    ascending key ranges). The old entries are merged with the run's in blocks of about
    ``MERGE_BLOCK_ENTRIES`` (``columns.merge_columns``)."""
    builder = _Builder(base, leaf_capacity, index_capacity, flush, piece_size)
    total, done, reported = len(run) + old_entries, 0, 0
    cursor = RunCursor(run.chunks())

    def merge_block(block: list[tuple[np.ndarray, np.ndarray]]) -> int:
        keys = block[0][0] if len(block) == 1 else np.concatenate([k for k, _ in block])
        values = block[0][1] if len(block) == 1 else np.concatenate([v for _, v in block])
        new_keys, new_values, removed = cursor.through(keys[-1:].tobytes())
        builder.add(*merge_columns(keys, values, new_keys, new_values, removed))
        return len(keys) + len(new_keys)

    block: list[tuple[np.ndarray, np.ndarray]] = []
    held = 0
    for keys, values in old_leaves or ():
        if not len(keys):
            continue
        block.append((keys, values))
        held += len(keys)
        if held >= MERGE_BLOCK_ENTRIES:
            done += merge_block(block)
            block, held = [], 0
            if progress is not None and done - reported >= PROGRESS_EVERY:
                progress(min(done, total), total)
                reported = done
    if block:
        done += merge_block(block)
    for keys, values in cursor.rest():  # above the old tree's keys: straight from the columns
        for at in range(0, len(keys), PROGRESS_EVERY):
            builder.add(keys[at:at + PROGRESS_EVERY], values[at:at + PROGRESS_EVERY])
            done += min(PROGRESS_EVERY, len(keys) - at)
            if progress is not None:
                progress(min(done, total), total)
    if progress is not None:
        progress(total, total)
    return builder.finish(checkpoint)


def build_run(batch: Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]], keys: int, main: TreeRef,
              runs: list[RunRef], base: int, checkpoint: int, *, leaf_capacity: int, index_capacity: int,
              flush: Callable[[bytearray, int], int] | None = None, piece_size: int = 0) -> tuple[bytes, Footer, int, RunRef, KeyFilter]:
    """A version that adds the run of ``batch`` (ascending ``(keys, values, gone)`` blocks, at
    most ``keys`` entries: its filter is sized for them) over ``main`` and ``runs`` (newest first,
    kept as they are): the run's tree, its key filter, the runs page and the footer, appended
    from ``base`` on (in pieces as ``build`` is). ``(bytes, footer, offset, run, filter)``: the
    last append, where it goes, and the new run."""
    builder = _Builder(base, leaf_capacity, index_capacity, flush, piece_size, removals=True)
    filter_builder = FilterBuilder(keys, FILTER_BITS_PER_KEY, MAX_FILTER_BYTES)
    for block_keys, values, gone in batch:
        builder.add(block_keys, values, gone)
        filter_builder.add(block_keys)
    tree = builder.finish_tree()
    key_filter = filter_builder.finish()
    filter_at = builder.place(lambda offset: encode_blob(FILTER, key_filter.encode(), offset))
    run = RunRef(tree, *filter_at)
    kept = [run, *runs]
    runs_at = builder.place(lambda offset: encode_runs(main.packed(), [r.packed() for r in kept], offset))
    extra_pages = len(kept) + 1  # the filters and the runs page
    extra_bytes = sum(r.filter_length for r in kept) + runs_at[1]
    footer = forest_footer(main, kept, runs_at, checkpoint, len(builder.buffer) + FOOTER_SIZE, extra_pages, extra_bytes)
    builder.buffer += footer.encode(builder.base + len(builder.buffer))
    return bytes(builder.buffer), footer, builder.base, run, key_filter


def validate_checkpoint(checkpoint: object) -> None:
    if checkpoint is not None and (type(checkpoint) is not int or not 0 <= checkpoint <= VALUE_MAX):
        raise InvalidInputError(f"checkpoint must be an int >= 0 or None, got {checkpoint!r:.60}")
