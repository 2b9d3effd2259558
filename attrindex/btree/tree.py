"""``BTreeIndex``: an append-only B+tree of 16-byte keys and int64 values over a ``RollingSegment``.

An update rewrites the leaves it touches and their paths (copy-on-write), plus whatever the
compaction policy relocates, and appends them: children before parents, the root, then the
footer. An update of more than ``piece_size`` bytes is appended in pieces, each a compare-and-append
right after the one before, each ended by a footer that restates the version the update builds on;
only the last append, ending with the update's own footer, changes the tree readers see. Readers
work on a snapshot of the root and never block the writer.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from typing import Callable, Iterator, Sequence

import attrs
import numpy as np

from storage_adapters import BadOffsetError, RollingSegment
from storage_adapters.errors import (
    CorruptDataError,
    InvalidInputError,
    OffsetOutOfRangeError,
    OutcomeUnknownError,
    RetriesExhaustedError,
    StorageError,
    TruncatedError,
)

from . import bulk
from .columns import column_keys, leaf_columns, page_columns
from .compaction import OnePagePolicy
from .footer import EMPTY, FOOTER_SIZE, PIECE, Footer, decode_footer
from .page import HEADER_SIZE, INDEX_ENTRY_SIZE, IndexPage, LeafPage, decode_page, index_capacity, leaf_capacity
from .rewrite import Rewrite, UpdateBuilder
from .sorted_run import SortedRun
from .spill import SpilledRuns

MIN_PAGE_SIZE = HEADER_SIZE + 3 * INDEX_ENTRY_SIZE  # an index page must hold at least 3 children
MAX_PAGE_SIZE = 1 << 24
# Every loop is bounded (a race lost for ever fails with an error, never spins):
MAX_RELIST_ATTEMPTS = 6  # fresh listings before an inconsistent view is taken for damage
MAX_READ_ATTEMPTS = 32  # restarts of one read from a newer version, each after another writer's truncation
MAX_UPDATE_ATTEMPTS = 1000  # compare-and-append races one update may lose in a row
#: An update of at least one key for this many pages of the tree is merged by rebuilding the tree
#: (``update``). Random keys at that density touch 40% of the leaves (1 - e^-1/2), and the rewrite
#: of those costs more time than a rebuild of all of them (1M keys, 735 leaves: 367 keys took
#: 0.27 s rewritten, 0.18 s rebuilt; 183 keys 0.11 s against 0.20 s; docs/design.md, "Dense merges").
DENSE_PAGES_PER_KEY = 2
#: ... in a tree of at least this many pages, or by a batch that fills as many. A smaller tree is
#: rewritten for a smaller batch: briefly (64 leaves at most, ~1 ms each), and the pages it keeps
#: in the page cache spare the next merge reading the tree back (on S3, a GET per run of leaves).
DENSE_MIN_PAGES = 64
LEAF_READ_BYTES = 4 << 20  #: the most bytes of consecutive leaves a merge reads at once
DEFAULT_PIECE_SIZE = 8 << 20  #: an update larger than this is appended in pieces of about this size
#: The largest ``piece_size``: one append (a piece, or the last: less than a piece and a page, then
#: the footer) stays well within the footer's 32-bit update length.
MAX_PIECE_SIZE = 1 << 30
log = logging.getLogger("attrindex.btree")


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

    def peek(self, key) -> None:
        return None


class PieceLostError(Exception):
    """Another writer appended between two pieces of an update: the pieces written so far are
    dead (no footer references them) and the update starts over from the newer version.
    Internal to ``BTreeIndex.update``."""


def _same_version(a: Footer, b: Footer) -> bool:
    """Whether two footers name the same tree (a piece's or a copy's restates another's)."""
    return attrs.evolve(a, update_length=0, kind=0) == attrs.evolve(b, update_length=0, kind=0)


class BTreeIndex:
    """The B+tree over one segment. Keys and values passed here are already canonical.

    ``cache`` is the page cache (anything with ``get_or_load``/``insert``/``erase``), ``None``
    to disable; ``policy`` a compaction policy from ``compaction.py``; ``on_external_change`` is
    called whenever the tree adopts a state written by another handle, so caches derived from the
    old state (the recent values) can be dropped. An update that writes more than ``piece_size``
    bytes is appended in pieces of about that size (docs/format.md, "Updates in pieces"), so its
    memory does not grow with the tree.
    """

    def __init__(self, segment: RollingSegment, *, page_size: int = 32768, cache=None, policy=None,
                 on_external_change: Callable[[], None] | None = None, piece_size: int = DEFAULT_PIECE_SIZE):
        if not isinstance(page_size, int) or not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE:
            raise InvalidInputError(f"page_size must be an int in [{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}], got {page_size!r}")
        if type(piece_size) is not int or not page_size <= piece_size <= MAX_PIECE_SIZE:
            raise InvalidInputError(f"piece_size must be an int in [page_size ({page_size}), {MAX_PIECE_SIZE}], "
                                    f"got {piece_size!r:.60}")
        self.segment = segment
        self.page_size = page_size
        self.piece_size = piece_size
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
            if state.footer.restates and _same_version(state.footer, current.footer):
                # A piece of another writer's update in progress (or a repair's copy of this very
                # version): the tree is the one this handle reads, and its caches stay valid.
                state = attrs.evolve(state, root=current.root)
                self._state = state
                return state
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

    def leaf_columns(self, state: TreeState) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The leaves of ``state`` in key order as checked columns (``columns.leaf_columns``): from
        the page cache if it holds them, else from storage without filling the cache, consecutive
        leaves in one read of up to ``LEAF_READ_BYTES`` (after a rebuild, leaves lie in key order)."""
        root = self._root_page(state)
        if root.is_leaf:
            if root.keys:
                yield page_columns(root)
            return
        peek = self.cache.peek
        for page in self._lowest_index_pages(root, 1, state.footer.height):
            offsets, lengths = page.offsets, page.lengths
            i, n = 0, len(offsets)
            while i < n:
                cached = peek(offsets[i])
                if cached is not None:
                    yield page_columns(cached)
                    i += 1
                    continue
                start, end, j = offsets[i], offsets[i] + lengths[i], i + 1
                while (j < n and offsets[j] == end and end + lengths[j] - start <= LEAF_READ_BYTES
                       and peek(offsets[j]) is None):
                    end += lengths[j]
                    j += 1
                data = memoryview(self._read(start, end - start))
                self.io.storage_reads += 1
                for k in range(i, j):
                    at = offsets[k] - start
                    yield leaf_columns(data[at:at + lengths[k]], offsets[k], self.segment.name)
                i = j

    def _lowest_index_pages(self, page: IndexPage, depth: int, height: int) -> Iterator[IndexPage]:
        """The index pages right above the leaves under ``page`` (at ``depth``), in key order."""
        if depth == height - 1:
            yield page
            return
        for i in range(len(page.keys)):
            yield from self._lowest_index_pages(self._child(page, i), depth + 1, height)  # type: ignore[arg-type]

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

        A dense batch (``_dense``) rebuilds the tree as a bulk load into it does, merging the
        leaves with the batch as columns (docs/design.md, "Dense merges").
        """
        if self._dense(len(keys)):
            run = SortedRun()
            run.extend(keys, values)
            return self._load_run(run, checkpoint, base=base)
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
                except PieceLostError:  # another writer appended between two pieces: start over
                    self.reload()
                    continue
                if builder is None:
                    return state
                data, footer = builder
                try:
                    self.segment.append(data.buffer, expected_offset=data.base)
                except BadOffsetError:
                    self.reload()
                    continue
                self._commit(state, data, footer)
                return self._state
        raise RetriesExhaustedError(f"segment {self.segment.name!r}: an update lost the append race to other writers "
                                    f"(or found its pages compacted away) {MAX_UPDATE_ATTEMPTS} times in a row; giving up "
                                    "(nothing was written)")

    def update_columns(self, keys: np.ndarray, values: np.ndarray, gone: np.ndarray, checkpoint: int | None = None,
                       base: int | None = None) -> TreeState:
        """``update`` for a batch as columns: ascending unique ``S16`` keys, int64 values, and
        removal flags (True: remove the key). A dense batch is rebuilt from the columns as they
        are; a sparse one (few keys: fewer than half the pages) goes through ``update``'s lists."""
        if self._dense(len(keys)):
            removed = column_keys(keys[gone]) if gone.any() else []
            kept = ~gone
            run = SortedRun.of_columns(keys[kept] if removed else keys, values[kept] if removed else values, removed)
            return self._load_run(run, checkpoint, base=base)
        listed = values.tolist()
        for row in np.flatnonzero(gone).tolist():
            listed[row] = None
        return self.update(column_keys(keys), listed, checkpoint, base)

    def _dense(self, keys: int) -> bool:
        """Whether a batch of ``keys`` keys is merged by rebuilding the tree (``DENSE_*``): the
        tree or the batch fills ``DENSE_MIN_PAGES``, and the batch has a key per two pages."""
        pages = self._state.footer.page_count
        large = pages >= DENSE_MIN_PAGES or keys >= DENSE_MIN_PAGES * self.leaf_capacity
        return large and keys * DENSE_PAGES_PER_KEY >= pages

    def _build(self, state: TreeState, keys, values, checkpoint) -> tuple[UpdateBuilder, Footer] | None:
        footer = state.footer
        rewrite = Rewrite(self._page, self.policy, self.page_size, self.leaf_capacity, self.index_capacity)
        return rewrite.plan(footer, state.length, keys, values, checkpoint,
                            flush=lambda data, offset: self._append_piece(footer, data, offset),
                            piece_size=self.piece_size)

    def _append_piece(self, footer: Footer, data: bytearray, offset: int) -> int:
        """Append ``data`` (pages of an update in progress) at ``offset``, ended by a piece's
        footer that restates the version ``footer`` (so readers still see that version); return
        the offset after it. ``PieceLostError`` if another writer appended meanwhile."""
        footer_offset = offset + len(data)
        data += attrs.evolve(footer, update_length=len(data) + FOOTER_SIZE, kind=PIECE).encode(footer_offset)
        try:
            self.segment.append(data, expected_offset=offset)
        except BadOffsetError:
            raise PieceLostError(f"segment {self.segment.name!r}: another writer appended at offset {offset}") from None
        except OutcomeUnknownError as error:  # whether the piece landed or not, the update did not
            raise StorageError(f"segment {self.segment.name!r}: appending a piece of an update failed, the update "
                               f"was not applied (the piece may or may not be stored, unreferenced): {error}") from error
        self.io.bytes_written += len(data)
        return footer_offset + FOOTER_SIZE

    def _commit(self, old: TreeState, builder: UpdateBuilder, footer: Footer) -> None:
        """After a successful append: publish the new root, cache the new pages, truncate."""
        length = builder.base + len(builder.buffer)
        root = builder.page(footer.root_offset) if footer.root_length else None
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
            log.debug("segment %r: update wrote %d bytes at offset %d (%d pieces before, %d pages cached, %d relocated "
                      "by compaction)", self.segment.name, builder.piece_bytes + len(builder.buffer), old.length,
                      builder.pieces, len(builder.pages), builder.relocated)
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
    def bulk_load(self, pairs, *, checkpoint: int | None = None, progress: Callable[[int, int], None] | None = None,
                  spill_bytes: int = bulk.DEFAULT_SPILL_BYTES) -> int:
        """Load ``(key, value)`` pairs (a mapping or an iterable, any order) as a fresh tree built
        bottom-up: full leaves, then index levels, then the footer, in ONE durable update (appended in
        pieces of about ``piece_size``, which readers see only once its last append lands).

        Every pair is validated before anything is written (``InvalidInputError`` otherwise). The
        last pair for a key wins; ``None`` means absent (it removes a key the tree holds). Into a
        non-empty tree, its entries are merged with the new ones in one streaming pass and the
        whole tree is written afresh: every old page becomes dead and is truncated away. Sorted
        input is streamed into compact columns; unsorted input is sorted in memory; past
        ``spill_bytes`` of pairs held, sorted runs go to temporary files (see ``bulk.py``). ``checkpoint`` as in ``update`` (a covered one writes nothing).
        ``progress(done, total)`` is called in passes, each counting up to its total: reading
        (pairs read; total ``len(pairs)``, 0 if unknown), sorting (unsorted input only: pairs
        sorted) and building (entries merged and written). Returns the number of entries in the
        tree afterwards. A lost compare-and-append race rebuilds over the newer tree from the
        already validated pairs. ``pairs`` may be what ``bulk.read_pairs`` returned (checked
        already: read it before writing anything else; the caller closes it).
        """
        bulk.validate_checkpoint(checkpoint)
        # A run from ``bulk.read_pairs`` is checked already: callers that must write something
        # first (a facade's log entry) read and check the pairs before that, and close it after.
        if isinstance(pairs, (bulk.SortedRun, SpilledRuns)):
            return self._load_run(pairs, checkpoint, progress).footer.entry_count
        run = bulk.read_pairs(pairs, progress, spill_bytes=spill_bytes)
        try:
            return self._load_run(run, checkpoint, progress).footer.entry_count
        finally:
            run.close()  # the sorted runs spilled to temporary files, if any

    def _load_run(self, run: bulk.SortedRun | SpilledRuns, checkpoint: int | None, progress=None, *,
                  base: int | None = None) -> TreeState:
        """Write a fresh tree holding ``run`` merged over the current one; the state afterwards.
        ``checkpoint`` and ``base`` as in ``update``."""
        with self._write_lock:
            for _ in range(MAX_UPDATE_ATTEMPTS):
                state = self._state
                footer = state.footer
                if base is not None and max(footer.checkpoint, 0) != base:  # (-1: none yet, as 0)
                    raise TreeMovedError(f"the tree moved from checkpoint {base} to {footer.checkpoint}")
                if checkpoint is not None and footer.checkpoint >= checkpoint:
                    return state
                if not len(run) and not footer.root_length and checkpoint in (None, footer.checkpoint):
                    return state  # removals from an empty tree: nothing to write
                target = footer.checkpoint if checkpoint is None else checkpoint
                try:
                    old = self.leaf_columns(state) if footer.root_length else None
                    data, new_footer, at = bulk.build(
                        run, old, state.length, target, leaf_capacity=self.leaf_capacity,
                        index_capacity=self.index_capacity, old_entries=footer.entry_count, progress=progress,
                        flush=lambda pages, offset: self._append_piece(footer, pages, offset), piece_size=self.piece_size)
                except OffsetOutOfRangeError as error:  # another writer compacted pages this state needs
                    self._restart(state, error)
                    continue
                except PieceLostError:  # another writer appended between two pieces: start over
                    self.reload()
                    continue
                try:
                    self.segment.append(data, expected_offset=at)
                except BadOffsetError:
                    self.reload()
                    continue
                self._commit_bulk(at, data, new_footer)
                return self._state
        raise RetriesExhaustedError(f"segment {self.segment.name!r}: a bulk load lost the append race to other writers "
                                    f"{MAX_UPDATE_ATTEMPTS} times in a row; giving up (nothing was written)")

    def _commit_bulk(self, at: int, data: bytes, footer: Footer) -> None:
        """After a bulk load's last append (``data`` at ``at``): publish the new root, drop the dead
        pages, truncate."""
        length = at + len(data)
        self._state = TreeState(footer, length - FOOTER_SIZE, length)
        clear = getattr(self.cache, "clear", None)
        if clear is not None:
            clear()  # every cached page is of the old tree, now dead
        self.io.bytes_written += len(data)
        self.io.updates_written += 1
        log.debug("segment %r: bulk load wrote %d bytes up to offset %d (%d pages, %d entries)",
                  self.segment.name, footer.live_bytes, length, footer.page_count, footer.entry_count)
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
