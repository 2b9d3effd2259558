"""``BTreeIndex``: an append-only B+tree of 16-byte keys and int64 values over a ``RollingSegment``.

An update rewrites the leaves it touches and their paths (copy-on-write), plus whatever the
compaction policy relocates, and appends them in one compare-and-append: children before parents,
the root, then the footer. Readers work on a snapshot of the root and never block the writer.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from typing import Callable, Iterator, Sequence

import attrs

from storage_adapters import BadOffsetError, RollingSegment
from storage_adapters.errors import (
    CorruptDataError,
    InvalidInputError,
    OffsetOutOfRangeError,
    RetriesExhaustedError,
    StorageError,
    TruncatedError,
)

from ..keys import MIN_KEY
from . import bulk
from .compaction import OnePagePolicy, TreeShape
from .footer import EMPTY, FOOTER_SIZE, Footer, decode_footer
from .page import (
    HEADER_SIZE,
    INDEX_ENTRY_SIZE,
    IndexPage,
    LeafPage,
    decode_page,
    encode_index,
    encode_leaf,
    index_capacity,
    leaf_capacity,
)

MIN_PAGE_SIZE = HEADER_SIZE + 3 * INDEX_ENTRY_SIZE  # an index page must hold at least 3 children
MAX_PAGE_SIZE = 1 << 24
# Every loop is bounded (a race lost for ever fails with an error, never spins):
MAX_RELIST_ATTEMPTS = 6  # fresh listings before an inconsistent view is taken for damage
MAX_READ_ATTEMPTS = 32  # restarts of one read from a newer version, each after another writer's truncation
MAX_UPDATE_ATTEMPTS = 1000  # compare-and-append races one update may lose in a row
log = logging.getLogger("attrindex.btree")
# Small batches per leaf are inserted by bisection; larger ones merged through a dict.
_BISECT_MERGE_LIMIT = 32


class TreeMovedError(Exception):
    """``update(base=...)``: the tree is no longer the version whose checkpoint is ``base`` (another
    writer wrote one meanwhile); nothing was written. Internal: the merge rebuilds instead."""


@attrs.frozen
class TreeState:
    """A durable version of the tree: its footer, and the segment length it was read or written at.

    ``root`` is the decoded root page when known: every lookup starts there, so it is kept here
    rather than fetched from the page cache each time.
    """

    footer: Footer
    footer_offset: int  # -1: nothing written yet
    length: int
    root: LeafPage | IndexPage | None = attrs.field(default=None, eq=False, repr=False)


@attrs.define
class IOStats:
    storage_reads: int = 0
    bytes_written: int = 0
    updates_written: int = 0
    pages_relocated: int = 0


class _Cacheless:
    """Stands in for the page cache when it is disabled: every page access reads storage."""

    hits = misses = 0

    def get_or_load(self, key, load, *args):
        return load(*args)[0]

    def insert(self, key, value, charge) -> None:
        pass

    def erase(self, key) -> None:
        pass


class _UpdateBuilder:
    """Serialises the pages of one update into one buffer, assigning offsets as it goes."""

    def __init__(self, base: int):
        self.base = base
        self.buffer = bytearray()
        self.pages: dict[int, tuple[LeafPage | IndexPage, int]] = {}  # offset -> (page, length)
        self.retired: list[int] = []
        self.live_delta = 0
        self.page_delta = 0
        self.entry_delta = 0
        self.relocated = 0

    def retire(self, offset: int, length: int) -> None:
        self.retired.append(offset)
        self.live_delta -= length
        self.page_delta -= 1

    def leaf(self, keys: list[bytes], values: list[int]) -> tuple[int, int, int]:
        offset = self.base + len(self.buffer)
        data = encode_leaf(keys, values, offset)
        return self._add(offset, data, LeafPage(keys, values)) + (offset,)

    def index(self, keys: list[bytes], offsets: list[int], lengths: list[int], mins: list[int]) -> tuple[int, int, int]:
        offset = self.base + len(self.buffer)
        keys = [MIN_KEY, *keys[1:]]
        data = encode_index(keys, offsets, lengths, mins, offset)
        return self._add(offset, data, IndexPage(keys, offsets, lengths, mins)) + (min(mins),)

    def _add(self, offset: int, data: bytes, page: LeafPage | IndexPage) -> tuple[int, int]:
        self.buffer += data
        self.pages[offset] = (page, len(data))
        self.live_delta += len(data)
        self.page_delta += 1
        return offset, len(data)


def _split_sizes(count: int, capacity: int, appending: bool) -> list[int]:
    """Entries per page when ``count`` entries must fit pages of ``capacity``.

    Growth at the right edge (ascending inserts) fills pages completely and leaves the remainder
    last; anything else is spread evenly, as a plain B+tree split would.
    """
    if count <= capacity:
        return [count]
    if appending:
        full, rest = divmod(count, capacity)
        return [capacity] * full + ([rest] if rest else [])
    pages = -(-count // capacity)
    base, extra = divmod(count, pages)
    return [base + 1] * extra + [base] * (pages - extra)


def _merge_leaf(keys: list[bytes], values: list[int], ukeys: Sequence[bytes], uvalues: Sequence[int | None]) -> tuple[list[bytes], list[int], bool]:
    """Apply sorted updates to a leaf's entries; returns new lists and whether they only appended."""
    if not ukeys:
        return keys, values, False
    if not keys or ukeys[0] > keys[-1]:
        if None in uvalues:
            ukeys = [k for k, v in zip(ukeys, uvalues) if v is not None]
            uvalues = [v for v in uvalues if v is not None]
        return [*keys, *ukeys], [*values, *uvalues], True
    if len(ukeys) <= _BISECT_MERGE_LIMIT:
        keys, values, low = list(keys), list(values), 0
        for key, value in zip(ukeys, uvalues):
            i = bisect.bisect_left(keys, key, low)
            if i < len(keys) and keys[i] == key:
                if value is None:
                    del keys[i], values[i]
                else:
                    values[i] = value
            elif value is not None:
                keys.insert(i, key)
                values.insert(i, value)
            low = i
        return keys, values, False
    merged = dict(zip(keys, values))
    for key, value in zip(ukeys, uvalues):
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    new_keys = sorted(merged)
    return new_keys, [merged[k] for k in new_keys], False


class BTreeIndex:
    """The B+tree over one segment. Keys and values passed here are already canonical.

    ``cache`` is the page cache (anything with ``get_or_load``/``insert``/``erase``), ``None``
    to disable; ``policy`` a compaction policy from ``compaction.py``; ``on_external_change`` is
    called whenever the tree adopts a state written by another handle, so caches derived from the
    old state (the recent values) can be dropped.
    """

    def __init__(self, segment: RollingSegment, *, page_size: int = 32768, cache=None, policy=None,
                 on_external_change: Callable[[], None] | None = None):
        if not isinstance(page_size, int) or not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE:
            raise InvalidInputError(f"page_size must be an int in [{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}], got {page_size!r}")
        self.segment = segment
        self.page_size = page_size
        self.leaf_capacity = leaf_capacity(page_size)
        self.index_capacity = index_capacity(page_size)
        self.cache = cache if cache is not None else _Cacheless()
        self.policy = policy if policy is not None else OnePagePolicy()
        self.io = IOStats()
        self._on_external_change = on_external_change
        self._write_lock = threading.Lock()
        self._state = TreeState(EMPTY, -1, 0)
        self.reload()

    # -- state ---------------------------------------------------------------------------------
    @property
    def state(self) -> TreeState:
        return self._state

    def reload(self) -> TreeState:
        """Adopt the newest durable version of the tree from storage (others may have written).

        The version never goes back. A listing that raced another process's truncation (a chunk
        deleted between listing and reading, the newest chunk missed, the footer's pages below the
        listed truncation offset, for a new version and for the one already held alike) is taken
        again, a bounded number of times; an inconsistency that persists is damage:
        ``CorruptDataError``. So a version it returns has every page at or above the listed
        truncation offset.
        """
        problem: Exception | None = None
        for attempt in range(MAX_RELIST_ATTEMPTS):
            if attempt:
                _pause(attempt)
            try:
                self.segment.refresh()
            except FileNotFoundError as error:  # a chunk deleted between listing and sizing it
                problem = error
                continue
            length, start = self.segment.length, self.segment.start_offset
            current = self._state
            if length == current.length and (current.footer_offset >= 0 or length == 0):
                if current.footer_offset >= 0 and current.footer.min_offset < start:
                    # Writers truncate only below a newer durable version: the listing took the
                    # truncation of a version it did not list yet (or the pages are gone).
                    problem = self._corrupt(current.footer_offset, f"the newest footer at offset "
                                            f"{current.footer_offset} references pages from offset "
                                            f"{current.footer.min_offset}, below the truncation offset {start}")
                    continue
                return current
            if length < current.length:  # an append-only segment never shrinks: a stale listing
                problem = self._corrupt(length, f"the segment's length went back from {current.length} to {length}")
                continue
            try:
                state = self._read_state(length, start)
            except CorruptDataError as error:
                problem = error
                continue
            self._state = state
            if self._on_external_change is not None:
                self._on_external_change()
            return state
        if isinstance(problem, CorruptDataError):
            raise problem
        raise RetriesExhaustedError(f"segment {self.segment.name!r}: no consistent listing in {MAX_RELIST_ATTEMPTS} attempts: {problem}") from problem

    def _read_state(self, length: int, start: int) -> TreeState:
        """The version whose footer ends at ``length``: with the chain of frames (local disk) and
        whole objects the committed length is exact, so those bytes must be a valid footer (no older one is looked for:
        that would be a silent rollback)."""
        if length == 0:
            return TreeState(EMPTY, -1, 0)
        tail = length - FOOTER_SIZE
        if tail < start:
            # Truncation keeps the newest footer's pages, the footer included: never legitimate.
            raise self._corrupt(start, f"the truncation offset {start} is past the newest footer (length {length})")
        try:
            data = self._read(tail, FOOTER_SIZE)
        except OffsetOutOfRangeError as error:  # the listing changed under the read: not a version
            raise self._corrupt(tail, f"the newest footer at offset {tail} is outside the stored range: {error}") from error
        footer = decode_footer(data, tail)
        if footer is None:
            raise self._corrupt(tail, f"the newest footer at offset {tail} (segment length {length}) is invalid")
        if footer.min_offset < start:
            raise self._corrupt(tail, f"the newest footer at offset {tail} references pages from offset "
                                      f"{footer.min_offset}, below the truncation offset {start}")
        return TreeState(footer, tail, length)

    def _corrupt(self, offset: int, what: str) -> CorruptDataError:
        """A ``CorruptDataError`` naming this segment, the chunk holding ``offset`` and the byte."""
        return corrupt_at(self.segment, offset, what)

    # -- pages ---------------------------------------------------------------------------------
    def _page(self, offset: int, length: int) -> LeafPage | IndexPage:
        return self.cache.get_or_load(offset, self._read_page, offset, length)

    def _child(self, page: IndexPage, i: int) -> LeafPage | IndexPage:
        """Child ``i`` of an index page: through its weak reference if alive, else the cache."""
        refs = page.children
        if refs is None:
            refs = page.children = [None] * len(page.keys)
        ref = refs[i]
        if ref is not None:
            child = ref()
            if child is not None:
                return child
        child = self._page(page.offsets[i], page.lengths[i])
        refs[i] = weakref.ref(child)
        return child

    def _read_page(self, offset: int, length: int) -> tuple[LeafPage | IndexPage, int]:
        self.io.storage_reads += 1
        return decode_page(self._read(offset, length), offset, self.segment.name), length

    def _read(self, offset: int, length: int) -> bytes:
        """``segment.read``, with a chunk that vanished under the read told apart from a failure:
        if a fresh listing puts ``offset`` below the truncation offset, another writer's compaction
        deleted it, which is ``TruncatedError`` (the caller moves to a newer version)."""
        try:
            return self.segment.read(offset, length)
        except OffsetOutOfRangeError:
            raise
        except (FileNotFoundError, StorageError) as error:
            if isinstance(error, CorruptDataError) or not self._truncated_below(offset):
                if isinstance(error, FileNotFoundError):
                    raise StorageError(f"segment {self.segment.name!r}: reading offset {offset}: {error}") from error
                raise
            segment = self.segment
            raise TruncatedError(segment.name, offset, length, segment.start_offset, segment.length) from error

    def _truncated_below(self, offset: int) -> bool:
        """Whether a fresh listing of the segment starts above ``offset``."""
        for attempt in range(MAX_RELIST_ATTEMPTS):
            if attempt:
                _pause(attempt)
            try:
                self.segment.refresh()
            except FileNotFoundError:  # a chunk deleted between listing and sizing it: look again
                continue
            return offset < self.segment.start_offset
        return False

    # -- reading -------------------------------------------------------------------------------
    def _root_page(self, state: TreeState) -> LeafPage | IndexPage:
        root = state.root
        if root is None:
            root = self._page(state.footer.root_offset, state.footer.root_length)
            if self._state is state:
                self._state = attrs.evolve(state, root=root)
        return root

    def get(self, key: bytes) -> int | None:
        """The value of ``key``, or ``None``."""
        restarts = 0
        while True:  # bounded: a lap needs a newer version, and there are at most MAX_READ_ATTEMPTS laps
            state = self._state
            if not state.footer.root_length:
                return None
            try:
                page = state.root
                if page is None:
                    page = self._root_page(state)
                return self._descend(page, key)
            except OffsetOutOfRangeError as error:
                self._restart(state, error)  # compacted away under this snapshot: read the new root
                restarts += 1
                if restarts == MAX_READ_ATTEMPTS:
                    raise self._gave_up("a lookup") from error

    def get_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """Values of ``keys`` in input order (``None`` where absent), sharing page visits; all of them
        from one version of the tree."""
        for _ in range(MAX_READ_ATTEMPTS):
            state = self._state
            if not state.footer.root_length or not keys:
                return [None] * len(keys)
            try:
                root = state.root
                if root is None:
                    root = self._root_page(state)
                if 2 * len(keys) < state.footer.page_count:
                    # Sparse keys share few pages: sorting them would cost more than it saves.
                    return [self._descend(root, key) for key in keys]
                found = self._lookup_sorted(root, sorted(keys))
            except OffsetOutOfRangeError as error:
                self._restart(state, error)
                continue
            return list(map(found.get, keys))
        raise self._gave_up("a lookup")

    def split_keys(self, parts: int) -> list[bytes]:
        """Up to ``parts - 1`` ascending keys that cut the tree into ranges of about equal page
        counts: the lower bounds of the pages of the highest level with enough of them (a few
        page reads; a tree of one leaf is cut by its keys)."""
        for _ in range(MAX_READ_ATTEMPTS):
            state = self._state
            if parts < 2 or not state.footer.root_length:
                return []
            try:
                level = [(None, self._root_page(state))]  # (lowest key routed there, page)
                while not level[0][1].is_leaf and len(level) < parts:
                    # An index page's keys[0] is all zeros: child 0 inherits the page's own bound.
                    level = [(page.keys[i] if i else bound, self._child(page, i))
                             for bound, page in level for i in range(len(page.keys))]
            except OffsetOutOfRangeError as error:
                self._restart(state, error)
                continue
            if len(level) == 1:  # one page: a leaf is cut between its keys
                candidates = level[0][1].keys if level[0][1].is_leaf else []
            else:
                candidates = [bound for bound, _page in level]
            n = len(candidates)
            return sorted({candidates[n * i // parts] for i in range(1, parts) if 0 < n * i // parts < n})
        raise self._gave_up("splitting the key range")

    def _restart(self, state: TreeState, error: OffsetOutOfRangeError) -> None:
        """A page of ``state`` is no longer stored: adopt a newer version, or report the damage.

        Another writer's compaction frees pages only after a newer footer is durable, so a page
        missing under the newest version is damage, not a race. One ``reload`` tells: it takes a
        listing that raced that writer's truncation again itself, and it returns a version only
        if none of its pages lies below the listed truncation offset.
        """
        newest = self.reload()
        if (newest.footer_offset, newest.length) != (state.footer_offset, state.length):
            return
        raise self._corrupt(
            error.offset,
            f"B+tree page at offset {error.offset} is referenced by the newest footer (at offset "
            f"{state.footer_offset}) but lies outside the stored range [{error.start_offset}, {error.end_offset})",
        ) from error

    def _gave_up(self, what: str) -> RetriesExhaustedError:
        return RetriesExhaustedError(f"segment {self.segment.name!r}: {what} restarted {MAX_READ_ATTEMPTS} times, each "
                                     "time after another writer had compacted the pages it needed; giving up")

    def _descend(self, page: LeafPage | IndexPage, key: bytes) -> int | None:
        while not page.is_leaf:
            page = self._child(page, bisect.bisect_right(page.keys, key) - 1)
        return page.get(key)

    def _lookup_sorted(self, root: LeafPage | IndexPage, keys: list[bytes]) -> dict[bytes, int]:
        """Look up ascending ``keys``, keeping the root-to-leaf path between consecutive keys."""
        found: dict[bytes, int] = {}
        path: list[tuple[LeafPage | IndexPage, bytes | None]] = [(root, None)]  # (page, end key)
        page = root
        for key in keys:
            end = path[-1][1]
            if end is not None and key >= end:
                while path[-1][1] is not None and key >= path[-1][1]:
                    path.pop()
                page = path[-1][0]
            while not page.is_leaf:
                bounds = page.keys
                i = bisect.bisect_right(bounds, key) - 1
                end = bounds[i + 1] if i + 1 < len(bounds) else path[-1][1]
                page = self._child(page, i)
                path.append((page, end))
            value = page.get(key)
            if value is not None:
                found[key] = value
        return found

    def items(self, start: bytes | None = None, stop: bytes | None = None) -> Iterator[tuple[bytes, int]]:
        """Entries with ``start <= key < stop`` in ascending order, from a snapshot of the root.

        If compaction frees pages under the snapshot, iteration resumes from the new root after the
        last key returned, so it never repeats or skips a key that stayed in the tree.
        """
        last: bytes | None = None
        restarts = 0  # since the last key returned: a scan that makes progress may restart again
        while restarts < MAX_READ_ATTEMPTS:
            state = self._state
            if not state.footer.root_length:
                return
            resumed_after = last
            try:
                for key, value in self._walk(self._root_page(state), start, stop, last):
                    last = key
                    yield key, value
                return
            except OffsetOutOfRangeError as error:
                restarts = 1 if last != resumed_after else restarts + 1
                self._restart(state, error)
        raise self._gave_up("a scan")

    def _walk(self, page, start, stop, after) -> Iterator[tuple[bytes, int]]:
        keys = page.keys
        if page.is_leaf:
            i = 0
            if after is not None:
                i = bisect.bisect_right(keys, after)
            if start is not None:
                i = max(i, bisect.bisect_left(keys, start))
            j = len(keys) if stop is None else bisect.bisect_left(keys, stop)
            values = page.values
            for n in range(i, j):
                yield keys[n], values[n]
            return
        low = after if after is not None and (start is None or after >= start) else start
        i = 0 if low is None else max(bisect.bisect_right(keys, low) - 1, 0)
        for n in range(i, len(keys)):
            if stop is not None and n > i and keys[n] >= stop:
                return
            yield from self._walk(self._child(page, n), start, stop, after)

    def pages(self) -> Iterator[tuple[int, int, int, LeafPage | IndexPage]]:
        """Every live page as ``(depth, offset, length, page)``, depth-first (for verification)."""
        footer = self._state.footer
        if not footer.root_length:
            return
        stack = [(1, footer.root_offset, footer.root_length)]
        while stack:
            depth, offset, length = stack.pop()
            page = self._page(offset, length)
            yield depth, offset, length, page
            if not page.is_leaf:
                stack.extend((depth + 1, o, n) for o, n in zip(reversed(page.offsets), reversed(page.lengths)))

    # -- writing -------------------------------------------------------------------------------
    def update(self, keys: Sequence[bytes], values: Sequence[int | None], checkpoint: int | None = None,
               base: int | None = None) -> TreeState:
        """Apply ``keys[i] -> values[i]`` (``None`` removes); keys sorted, unique. One durable append.

        A lost compare-and-append race reloads the tree and applies the batch again. With
        ``checkpoint`` (the log position the batch brings the tree up to), checkpoints only move
        forward: a tree that already covers ``checkpoint`` (another writer got there first) is left
        as it is, since re-applying older values would undo newer ones. With ``base``, the batch
        holds only what changed since the version with that checkpoint: on any other version
        (another writer's, seen now or after a lost race) ``TreeMovedError``, nothing written.
        """
        with self._write_lock:
            for _ in range(MAX_UPDATE_ATTEMPTS):
                state = self._state
                if base is not None and max(state.footer.checkpoint, 0) != base:  # (-1: none yet, as 0)
                    raise TreeMovedError(f"the tree moved from checkpoint {base} to {state.footer.checkpoint}")
                if checkpoint is not None and state.footer.checkpoint >= checkpoint:
                    return state
                try:
                    builder = self._build(state, keys, values, checkpoint)
                except OffsetOutOfRangeError as error:  # another writer compacted pages this stale state needs
                    self._restart(state, error)
                    continue
                if builder is None:
                    return state
                data, footer = builder
                try:
                    self.segment.append(data.buffer, expected_offset=state.length)
                except BadOffsetError:
                    self.reload()
                    continue
                self._commit(state, data, footer)
                return self._state
        raise RetriesExhaustedError(f"segment {self.segment.name!r}: an update lost the append race to other writers "
                                    f"(or found its pages compacted away) {MAX_UPDATE_ATTEMPTS} times in a row; giving up "
                                    "(nothing was written)")

    def _build(self, state: TreeState, keys, values, checkpoint) -> tuple[_UpdateBuilder, Footer] | None:
        footer = state.footer
        shape = TreeShape(state.length, footer.min_offset, footer.live_bytes, self.page_size, footer.update_length)
        relocate_below = self.policy.threshold(shape) if footer.root_length else 0
        unchanged_checkpoint = checkpoint in (None, footer.checkpoint)
        if not keys and relocate_below <= footer.min_offset and unchanged_checkpoint:
            return None
        builder = _UpdateBuilder(state.length)
        if footer.root_length:
            pointers = self._rewrite(builder, footer.root_offset, footer.root_length, keys, values, 0, len(keys), relocate_below)
            height = footer.height
        else:
            new_keys, new_values, _ = _merge_leaf([], [], keys, values)
            if not new_keys and unchanged_checkpoint:
                return None  # removing keys from an empty tree changes nothing
            pointers = self._leaves(builder, new_keys, new_values, True)
            builder.entry_delta = len(new_keys)
            height = 1
        root, height = self._root(builder, pointers, height)
        footer_offset = state.length + len(builder.buffer)
        new_footer = Footer(
            root_offset=root[1] if root else 0,
            root_length=root[2] if root else 0,
            height=height if root else 0,
            entry_count=footer.entry_count + builder.entry_delta,
            page_count=footer.page_count + builder.page_delta,
            live_bytes=footer.live_bytes + builder.live_delta,
            min_offset=root[3] if root else footer_offset,
            checkpoint=footer.checkpoint if checkpoint is None else checkpoint,
            update_length=len(builder.buffer) + FOOTER_SIZE,
        )
        builder.buffer += new_footer.encode(footer_offset)
        return builder, new_footer

    def _root(self, builder: _UpdateBuilder, pointers: list[tuple], height: int) -> tuple[tuple | None, int]:
        """Stack index pages over ``pointers`` until one root remains; collapse single-child roots."""
        while len(pointers) > 1:
            columns = list(zip(*pointers))
            pointers = self._indexes(builder, *map(list, columns), False)
            height += 1
        if not pointers:
            return None, 0
        root = pointers[0]
        while height > 1:
            page = builder.pages[root[1]][0] if root[1] in builder.pages else self._page(root[1], root[2])
            if len(page) != 1:
                break
            # A root with one child is replaced by that child: the tree gets shorter.
            builder.retire(root[1], root[2])
            root = (MIN_KEY, page.offsets[0], page.lengths[0], page.min_offsets[0])
            height -= 1
        return root, height

    def _rewrite(self, builder: _UpdateBuilder, offset: int, length: int, keys, values, lo: int, hi: int, relocate_below: int) -> list[tuple]:
        """Rewrite the page at ``offset`` with updates ``[lo, hi)``; returns its replacement pointers."""
        page = self._page(offset, length)
        builder.retire(offset, length)
        if offset < relocate_below and lo == hi:
            builder.relocated += 1
        if page.is_leaf:
            new_keys, new_values, appending = _merge_leaf(page.keys, page.values, keys[lo:hi], values[lo:hi])
            builder.entry_delta += len(new_keys) - len(page.keys)
            return self._leaves(builder, new_keys, new_values, appending)
        bounds, count = page.keys, len(page.keys)
        visits: dict[int, tuple[int, int]] = {}
        while lo < hi:
            i = bisect.bisect_right(bounds, keys[lo]) - 1
            end = bisect.bisect_left(keys, bounds[i + 1], lo, hi) if i + 1 < count else hi
            visits[i] = (lo, end)
            lo = end
        if relocate_below and min(page.min_offsets) < relocate_below:
            for i, low in enumerate(page.min_offsets):
                if low < relocate_below and i not in visits:
                    visits[i] = (hi, hi)
        new_keys, new_offsets, new_lengths, new_mins = [], [], [], []
        copied = 0
        appending = False
        for i in sorted(visits):
            new_keys += bounds[copied:i]
            new_offsets += page.offsets[copied:i]
            new_lengths += page.lengths[copied:i]
            new_mins += page.min_offsets[copied:i]
            replaced = self._rewrite(builder, page.offsets[i], page.lengths[i], keys, values, *visits[i], relocate_below)
            for n, pointer in enumerate(replaced):
                new_keys.append(bounds[i] if n == 0 else pointer[0])
                new_offsets.append(pointer[1])
                new_lengths.append(pointer[2])
                new_mins.append(pointer[3])
            appending = i == count - 1 and len(replaced) > 1
            copied = i + 1
        new_keys += bounds[copied:]
        new_offsets += page.offsets[copied:]
        new_lengths += page.lengths[copied:]
        new_mins += page.min_offsets[copied:]
        return self._indexes(builder, new_keys, new_offsets, new_lengths, new_mins, appending)

    def _leaves(self, builder: _UpdateBuilder, keys: list[bytes], values: list[int], appending: bool) -> list[tuple]:
        pointers, at = [], 0
        if not keys:
            return []
        for size in _split_sizes(len(keys), self.leaf_capacity, appending):
            chunk_keys = keys[at:at + size]
            pointers.append((chunk_keys[0], *builder.leaf(chunk_keys, values[at:at + size])))
            at += size
        return pointers

    def _indexes(self, builder: _UpdateBuilder, keys, offsets, lengths, mins, appending: bool) -> list[tuple]:
        pointers, at = [], 0
        if not keys:
            return []
        for size in _split_sizes(len(keys), self.index_capacity, appending):
            end = at + size
            pointers.append((keys[at], *builder.index(keys[at:end], offsets[at:end], lengths[at:end], mins[at:end])))
            at = end
        return pointers

    def _commit(self, old: TreeState, builder: _UpdateBuilder, footer: Footer) -> None:
        """After a successful append: publish the new root, cache the new pages, truncate."""
        length = old.length + len(builder.buffer)
        root = builder.pages[footer.root_offset][0] if footer.root_length else None
        self._state = TreeState(footer, length - FOOTER_SIZE, length, root)
        retired = set(builder.retired)
        for offset in retired:
            self.cache.erase(offset)
        for offset, (page, size) in builder.pages.items():
            if offset not in retired:
                self.cache.insert(offset, page, size)
        self.io.bytes_written += len(builder.buffer)
        self.io.updates_written += 1
        self.io.pages_relocated += builder.relocated
        if log.isEnabledFor(logging.DEBUG):
            log.debug("segment %r: update wrote %d bytes at offset %d (%d pages, %d relocated by compaction)",
                      self.segment.name, len(builder.buffer), old.length, len(builder.pages), builder.relocated)
        self._truncate_after(footer.min_offset)

    def _truncate_after(self, min_offset: int) -> None:
        """Free the chunks below a durable new version (best effort, as the policy says)."""
        if getattr(self.policy, "truncates", True):
            try:
                self._truncate(min_offset)
            except (StorageError, OSError) as error:
                # The update is durable: freeing space is best effort, and the next update retries.
                log.warning("segment %r: truncating below offset %d failed after a durable update; "
                            "a later update retries it: %s", self.segment.name, min_offset, error)

    # -- bulk load -----------------------------------------------------------------------------
    def bulk_load(self, pairs, *, checkpoint: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> int:
        """Load ``(key, value)`` pairs (a mapping or an iterable, any order) as a fresh tree built
        bottom-up: full leaves, then index levels, then the footer, in ONE durable append.

        Every pair is validated before anything is written (``InvalidInputError`` otherwise). The
        last pair for a key wins; ``None`` means absent (it removes a key the tree holds). Into a
        non-empty tree, its entries are merged with the new ones in one streaming pass and the
        whole tree is written afresh: every old page becomes dead and is truncated away. Sorted
        input is streamed into compact columns; unsorted input is sorted in memory (see
        ``bulk.py``). ``checkpoint`` as in ``update`` (a covered one writes nothing).
        ``progress(done, total)`` is called in passes, each counting up to its total: reading
        (pairs read; total ``len(pairs)``, 0 if unknown), sorting (unsorted input only: pairs
        sorted) and building (entries merged and written). Returns the number of entries in the
        tree afterwards. A lost compare-and-append race rebuilds over the newer tree from the
        already validated pairs. ``pairs`` may be a ``bulk.SortedRun`` from
        ``bulk.read_pairs`` (checked already: read it before writing anything else).
        """
        bulk.validate_checkpoint(checkpoint)
        # A run from ``bulk.read_pairs`` is checked already: callers that must write something
        # first (a facade's log entry) read and check the pairs before that.
        run = pairs if isinstance(pairs, bulk.SortedRun) else bulk.read_pairs(pairs, progress)
        return self._load_run(run, checkpoint, progress).footer.entry_count

    def _load_run(self, run: bulk.SortedRun, checkpoint: int | None, progress=None) -> TreeState:
        """Write a fresh tree holding ``run`` merged over the current one; the state afterwards."""
        with self._write_lock:
            for _ in range(MAX_UPDATE_ATTEMPTS):
                state = self._state
                footer = state.footer
                if checkpoint is not None and footer.checkpoint >= checkpoint:
                    return state
                if not len(run) and not footer.root_length and checkpoint in (None, footer.checkpoint):
                    return state  # removals from an empty tree: nothing to write
                target = footer.checkpoint if checkpoint is None else checkpoint
                try:
                    old = bulk.leaves(self._root_page(state), self._child) if footer.root_length else None
                    data, new_footer = bulk.build(run, old, state.length, target, leaf_capacity=self.leaf_capacity,
                                                  index_capacity=self.index_capacity, old_entries=footer.entry_count,
                                                  progress=progress)
                except OffsetOutOfRangeError as error:  # another writer compacted pages this state needs
                    self._restart(state, error)
                    continue
                try:
                    self.segment.append(data, expected_offset=state.length)
                except BadOffsetError:
                    self.reload()
                    continue
                self._commit_bulk(state, data, new_footer)
                return self._state
        raise RetriesExhaustedError(f"segment {self.segment.name!r}: a bulk load lost the append race to other writers "
                                    f"{MAX_UPDATE_ATTEMPTS} times in a row; giving up (nothing was written)")

    def _commit_bulk(self, old: TreeState, data: bytes, footer: Footer) -> None:
        """After a bulk load's append: publish the new root, drop the dead pages, truncate."""
        length = old.length + len(data)
        self._state = TreeState(footer, length - FOOTER_SIZE, length)
        clear = getattr(self.cache, "clear", None)
        if clear is not None:
            clear()  # every cached page is of the old tree, now dead
        self.io.bytes_written += len(data)
        self.io.updates_written += 1
        log.debug("segment %r: bulk load wrote %d bytes at offset %d (%d pages, %d entries)",
                  self.segment.name, len(data), old.length, footer.page_count, footer.entry_count)
        self._truncate_after(footer.min_offset)

    def _truncate(self, min_offset: int) -> None:
        """Delete storage chunks lying wholly below the live tree (the new root is already durable)."""
        chunks = self.segment.chunks()
        freeable = 0
        for chunk in chunks[:-1]:
            if chunk.end > min_offset:
                break
            freeable += 1
        # Object stores make one chunk per update: delete them in batches, not one by one.
        if freeable and (self.segment.storage.appendable or freeable >= 16):
            log.debug("segment %r: truncating below offset %d (%d chunks freed)", self.segment.name, min_offset, freeable)
            self.segment.truncate(min_offset)


def chunk_of(segment: RollingSegment, offset: int) -> str:
    """The storage path of the chunk holding ``offset`` (as of the segment's last listing)."""
    chunks = segment.chunks()
    starts = [chunk.start for chunk in chunks]
    i = bisect.bisect_right(starts, offset) - 1
    name = chunks[i].name if i >= 0 else f"{offset:020d}"
    return f"{segment.name}.seg/{name}"


def corrupt_at(segment: RollingSegment, offset: int, what: str) -> CorruptDataError:
    """A ``CorruptDataError`` naming the segment, the chunk holding ``offset`` and the byte."""
    return CorruptDataError(f"segment {segment.name!r}, chunk {chunk_of(segment, offset)}: {what}",
                            segment=segment.name, offset=offset)


def _pause(attempt: int) -> None:
    """Back off before looking again: 1, 2, 4 ... ms."""
    time.sleep(0.001 * (1 << min(attempt - 1, 8)))
