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
)

from . import bulk
from .columns import KEY_DTYPE, VALUE_DTYPE, column_keys, merge_streams
from .compaction import OnePagePolicy
from .footer import EMPTY, FOOTER_SIZE, PIECE, Footer, decode_footer
from .key_filter import KeyFilter
from .page import HEADER_SIZE, INDEX_ENTRY_SIZE, LEAF, RUN_LEAF, IndexPage, LeafPage, index_capacity, leaf_capacity
from .runs import Forest, RunRef, TreeRef, decode_runs, merged_runs, newer_first, present, read_filter, RunPolicy
from .rewrite import Rewrite, UpdateBuilder
from .sorted_run import SortedRun
from .pages import ABSENT, MAX_RELIST_ATTEMPTS, PageReader, pause
from .spill import SpilledRuns

MIN_PAGE_SIZE = HEADER_SIZE + 3 * INDEX_ENTRY_SIZE  # an index page must hold at least 3 children
MAX_PAGE_SIZE = 1 << 24
# Every loop is bounded (a race lost for ever fails with an error, never spins):
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
    root: LeafPage | IndexPage | None = attrs.field(default=None, eq=False, repr=False)  #: the main tree's
    forest: Forest | None = attrs.field(default=None, eq=False, repr=False)  #: the runs, if the version has any

    @property
    def main(self) -> TreeRef:
        """The main tree (the whole tree of a version without runs)."""
        return self.forest.main if self.forest is not None else TreeRef.of_footer(self.footer)


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
                 on_external_change: Callable[[], None] | None = None, piece_size: int = DEFAULT_PIECE_SIZE,
                 runs: RunPolicy = RunPolicy()):
        if not isinstance(page_size, int) or not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE:
            raise InvalidInputError(f"page_size must be an int in [{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}], got {page_size!r}")
        if type(piece_size) is not int or not page_size <= piece_size <= MAX_PIECE_SIZE:
            raise InvalidInputError(f"piece_size must be an int in [page_size ({page_size}), {MAX_PIECE_SIZE}], "
                                    f"got {piece_size!r:.60}")
        self.segment = segment
        self.page_size = page_size
        self.piece_size = piece_size
        self.runs = runs  #: when batches become sorted runs (``runs.RunPolicy``)
        self.leaf_capacity = leaf_capacity(page_size)
        self.index_capacity = index_capacity(page_size)
        self.cache = cache if cache is not None else _Cacheless()
        self.policy = policy if policy is not None else OnePagePolicy()
        self.io = IOStats()
        self.reader = PageReader(segment, self.cache, self.io)
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
                pause(attempt)
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
            data = self.reader.read(tail, FOOTER_SIZE)
        except OffsetOutOfRangeError as error:  # the listing changed under the read: not a version
            raise self._corrupt(tail, f"the newest footer at offset {tail} is outside the stored range: {error}") from error
        footer = decode_footer(data, tail)
        if footer is None:
            raise self._corrupt(tail, f"the newest footer at offset {tail} (segment length {length}) is invalid")
        if footer.min_offset < start:
            raise self._corrupt(tail, f"the newest footer at offset {tail} references pages from offset "
                                      f"{footer.min_offset}, below the truncation offset {start}")
        return TreeState(footer, tail, length, forest=self._read_forest(footer))

    def _read_forest(self, footer: Footer) -> Forest | None:
        """The runs of the version ``footer`` ends (``None`` if it has none): the runs page and
        the runs' key filters, those the version before held reused."""
        if not footer.has_runs:
            return None
        offset, length = footer.root_offset, footer.root_length
        try:
            main, runs = decode_runs(self.reader.read(offset, length), offset, self.segment.name)
            held = self._state.forest
            known = {} if held is None else dict(zip(held.runs, held.filters))  # (a run is its whole reference)
            filters = tuple(known.get(run) or self._read_filter(run) for run in runs)
        except OffsetOutOfRangeError as error:
            raise self._corrupt(offset, f"the runs page at offset {offset} or a run's filter is outside the stored "
                                        f"range: {error}") from error
        return Forest(offset, length, main, tuple(runs), filters)

    def _read_filter(self, run: RunRef) -> KeyFilter:
        offset, length = run.filter_offset, run.filter_length
        self.io.storage_reads += 1
        return read_filter(self.reader.read(offset, length), offset, self.segment.name)

    def _corrupt(self, offset: int, what: str) -> CorruptDataError:
        """A ``CorruptDataError`` naming this segment, the chunk holding ``offset`` and the byte."""
        return corrupt_at(self.segment, offset, what)

    # -- reading -------------------------------------------------------------------------------
    def _root_page(self, state: TreeState) -> LeafPage | IndexPage:
        """The main tree's root page (the tree has one: ``state.main.length``)."""
        root = state.root
        if root is None:
            main = state.main
            root = self.reader.page(main.offset, main.length)
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
                if state.forest is not None:
                    for run, flt in zip(state.forest.runs, state.forest.filters):
                        if flt.may_contain(key):
                            value = self.reader.run_value(run.tree, key)
                            if value is not ABSENT:
                                return value  # type: ignore[return-value]
                    if not state.forest.main.length:
                        return None
                page = state.root
                if page is None:
                    page = self._root_page(state)
                return self.reader.leaf(page, key).get(key)
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
                settled = self.reader.runs_get_many(state.forest, keys) if state.forest is not None else {}
                rest = [key for key in keys if key not in settled] if settled else keys
                found = self.reader.get_many(self._root_page(state), rest, state.main.pages) if rest and state.main.length else {}
            except OffsetOutOfRangeError as error:
                self._restart(state, error)
                continue
            if settled:
                found.update(settled)
            return list(map(found.get, keys))
        raise self._gave_up("a lookup")

    def count(self, state: TreeState | None = None) -> int:
        """The keys present in ``state`` (the current version by default). With runs, each key
        of the runs (the newest run's entry for it) is looked up in the main tree, in blocks:
        a key a run sets counts if the main tree lacks it, one it removes uncounts if the main
        tree has it. ``OffsetOutOfRangeError`` if another writer's compaction freed pages of a
        ``state`` that is no longer current."""
        current = state is None
        for _ in range(MAX_READ_ATTEMPTS):
            if current:
                state = self._state
            forest = state.forest  # type: ignore[union-attr]
            if forest is None:
                return state.footer.entry_count  # type: ignore[union-attr]
            total = forest.main.entries
            try:
                streams = [self.reader.tree_leaves(run.tree, RUN_LEAF) for run in reversed(forest.runs)]
                for keys, _values, gone in merge_streams(streams, bulk.MERGE_BLOCK_ENTRIES):
                    listed = column_keys(keys)
                    found = (self.reader.get_many(self._root_page(state), listed, forest.main.pages)  # type: ignore[arg-type]
                             if forest.main.length else {})
                    stored = np.fromiter((key in found for key in listed), bool, len(listed))
                    total += int((~gone & ~stored).sum()) - int((gone & stored).sum())
            except OffsetOutOfRangeError as error:
                if not current:
                    raise
                self._restart(state, error)  # type: ignore[arg-type]
                continue
            return total
        raise self._gave_up("counting the keys")

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
                    level = [(page.keys[i] if i else bound, self.reader.child(page, i))
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
                scan = self.reader.walk(self._root_page(state), start, stop, last) if state.main.length else iter(())
                if state.forest is not None:
                    for run in reversed(state.forest.runs):  # each newer run over what is below it
                        scan = newer_first(self.reader.walk(self.reader.page(run.tree.offset, run.tree.length), start, stop, last), scan)
                    scan = present(scan)
                for key, value in scan:
                    last = key
                    yield key, value
                return
            except OffsetOutOfRangeError as error:
                restarts = 1 if last != resumed_after else restarts + 1
                self._restart(state, error)
        raise self._gave_up("a scan")

    def pages(self) -> Iterator[tuple[int, int, int, LeafPage | IndexPage]]:
        """Every live tree page as ``(depth, offset, length, page)``, depth-first: the main
        tree's, then each run's (for verification; a version's runs page and filters aside)."""
        state = self._state
        trees = [state.main, *(run.tree for run in state.forest.runs)] if state.forest is not None else [state.main]
        stack = [(1, tree.offset, tree.length) for tree in reversed(trees) if tree.length]
        while stack:
            depth, offset, length = stack.pop()
            page = self.reader.page(offset, length)
            yield depth, offset, length, page
            if not page.is_leaf:
                stack.extend((depth + 1, o, n) for o, n in zip(reversed(page.offsets), reversed(page.lengths)))

    def leaf_columns(self, state: TreeState) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The entries of ``state`` in key order as columns ``(keys, values)``, in blocks: the
        main tree's leaves (``tree_leaves``), with the runs merged over them if it has any."""
        main = state.main
        if state.forest is None:
            for keys, values, _gone in self.reader.tree_leaves(main, LEAF):
                yield keys, values
            return
        streams = [self.reader.tree_leaves(main, LEAF)] if main.length else []
        streams += [self.reader.tree_leaves(run.tree, RUN_LEAF) for run in reversed(state.forest.runs)]
        for keys, values, gone in merge_streams(streams, bulk.MERGE_BLOCK_ENTRIES):
            kept = ~gone
            yield keys[kept], values[kept]

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
        leaves with the batch as columns (docs/design.md, "Dense merges"). Into a large tree, a
        batch may be written as a sorted run instead (``runs.plan``; docs/design.md, "Sorted runs").
        """
        if self._state.forest is not None or self._plan(self._state, len(keys)) != "tree":
            return self.update_columns(*_columns(keys, values), checkpoint, base)
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
                if state.forest is not None:  # another handle's run, seen after a lost race
                    break
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
            else:
                raise RetriesExhaustedError(f"segment {self.segment.name!r}: an update lost the append race to other "
                                            f"writers (or found its pages compacted away) {MAX_UPDATE_ATTEMPTS} times in a "
                                            "row; giving up (nothing was written)")
        return self.update_columns(*_columns(keys, values), checkpoint, base)  # a version with runs takes it

    def update_columns(self, keys: np.ndarray, values: np.ndarray, gone: np.ndarray, checkpoint: int | None = None,
                       base: int | None = None, defer_rebuild: bool = False) -> TreeState:
        """``update`` for a batch as columns: ascending unique ``S16`` keys, int64 values, and
        removal flags (True: remove the key). A dense batch is rebuilt from the columns as they
        are; a sparse one (few keys: fewer than half the pages) goes through ``update``'s lists.
        Into a large tree, the batch becomes a sorted run, or one with the runs there are
        (``runs.plan``); a tree with runs is always rebuilt with them when the batch goes into it."""
        state = self._state
        how = self._plan(state, len(keys), defer_rebuild)
        if how != "tree":
            written = self._write_run(keys, values, gone, checkpoint, base, defer_rebuild)
            if written is not None:
                return written
            state = self._state  # another writer's version takes the batch into the main tree
        if state.forest is not None or self._dense(len(keys)):
            removed = column_keys(keys[gone]) if gone.any() else []
            kept = ~gone
            run = SortedRun.of_columns(keys[kept] if removed else keys, values[kept] if removed else values, removed)
            return self._load_run(run, checkpoint, base=base)
        listed = values.tolist()
        for row in np.flatnonzero(gone).tolist():
            listed[row] = None
        return self.update(column_keys(keys), listed, checkpoint, base)

    def _plan(self, state: TreeState, keys: int, defer_rebuild: bool = False) -> str:
        """``RunPolicy.plan`` for a batch of ``keys`` keys into ``state`` (the storage it retains
        counted only if this tree truncates its storage)."""
        retained = state.length - state.footer.min_offset if getattr(self.policy, "truncates", True) else 0
        return self.runs.plan(state.main.entries, state.forest, keys, retained, state.footer.live_bytes, defer_rebuild)

    def _dense(self, keys: int) -> bool:
        """Whether a batch of ``keys`` keys is merged by rebuilding the tree (``DENSE_*``): the
        tree or the batch fills ``DENSE_MIN_PAGES``, and the batch has a key per two pages."""
        pages = self._state.main.pages
        large = pages >= DENSE_MIN_PAGES or keys >= DENSE_MIN_PAGES * self.leaf_capacity
        return large and keys * DENSE_PAGES_PER_KEY >= pages

    def _build(self, state: TreeState, keys, values, checkpoint) -> tuple[UpdateBuilder, Footer] | None:
        footer = state.footer
        rewrite = Rewrite(self.reader.page, self.policy, self.page_size, self.leaf_capacity, self.index_capacity)
        return rewrite.plan(footer, state.length, keys, values, checkpoint,
                            flush=self._piece_writer(footer),
                            piece_size=self.piece_size)

    def _piece_writer(self, footer: Footer) -> Callable[[bytearray, int], int]:
        return lambda data, offset: self._append_piece(footer, data, offset)

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
        truncate_below(self.segment, self.policy, footer.min_offset)

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
        """Write a fresh tree holding ``run`` merged over the current one (its runs included);
        the state afterwards. ``checkpoint`` and ``base`` as in ``update``."""

        def build(state: TreeState):
            footer = state.footer
            if not len(run) and not footer.root_length and checkpoint in (None, footer.checkpoint):
                return state  # removals from an empty tree: nothing to write
            old = self.leaf_columns(state) if footer.root_length else None
            return bulk.build(run, old, state.length, footer.checkpoint if checkpoint is None else checkpoint,
                              leaf_capacity=self.leaf_capacity, index_capacity=self.index_capacity,
                              old_entries=footer.entry_count, progress=progress, flush=self._piece_writer(footer),
                              piece_size=self.piece_size)

        def commit(state: TreeState, at: int, data: bytes, footer: Footer) -> None:
            length = at + len(data)
            self._state = TreeState(footer, length - FOOTER_SIZE, length)
            clear = getattr(self.cache, "clear", None)
            if clear is not None:
                clear()  # every cached page is of the old tree, now dead
            log.debug("segment %r: bulk load wrote %d bytes up to offset %d (%d pages, %d entries)",
                      self.segment.name, footer.live_bytes, length, footer.page_count, footer.entry_count)

        return self._write_version("a bulk load", checkpoint, base, build, commit)  # type: ignore[return-value]

    def _write_run(self, keys: np.ndarray, values: np.ndarray, gone: np.ndarray, checkpoint: int | None,
                   base: int | None, defer_rebuild: bool) -> TreeState | None:
        """Write the batch as a new run over the current version, or as one run with its runs
        (``runs.plan``), with ``bulk.build_run``. ``checkpoint`` and ``base`` as in ``update``.
        ``None``: the version a lost race brought takes the batch into the main tree instead
        (the caller does that)."""
        made: list = []

        def build(state: TreeState):
            how = self._plan(state, len(keys), defer_rebuild)
            if how == "tree":
                return None
            held = list(state.forest.runs) if state.forest is not None else []
            filters = list(state.forest.filters) if state.forest is not None else []
            entries, streams = len(keys), []
            if how == "runs":  # the newest runs and the batch into one run, the older ones kept
                merged = merged_runs(held, len(keys))
                streams = [self.reader.tree_leaves(run.tree, RUN_LEAF) for run in reversed(held[:merged])]
                entries += sum(run.tree.entries for run in held[:merged])
                held, filters = held[merged:], filters[merged:]
            streams.append(iter([(keys, values, gone)]))
            data, footer, at, run, key_filter = bulk.build_run(
                merge_streams(streams, bulk.MERGE_BLOCK_ENTRIES), entries, state.main, held, state.length,
                state.footer.checkpoint if checkpoint is None else checkpoint, leaf_capacity=self.leaf_capacity,
                index_capacity=self.index_capacity, flush=self._piece_writer(state.footer), piece_size=self.piece_size)
            made[:] = [(run, *held), (key_filter, *filters)]
            return data, footer, at

        def commit(state: TreeState, at: int, data: bytes, footer: Footer) -> None:
            length = at + len(data)
            forest = Forest(footer.root_offset, footer.root_length, state.main, *made)
            self._state = TreeState(footer, length - FOOTER_SIZE, length, state.root, forest)
            log.debug("segment %r: wrote a run of %d entries up to offset %d (%d runs)", self.segment.name,
                      made[0][0].tree.entries, length, len(made[0]))

        return self._write_version("writing a run", checkpoint, base, build, commit)

    def _write_version(self, what: str, checkpoint: int | None, base: int | None, build, commit) -> TreeState | None:
        """Append a whole new version (a rebuild, a run) as ``build(state)`` lays it out: its last
        append ``(data, footer, offset)`` after the pieces it wrote, or a state (or ``None``) to
        return as it is. A lost compare-and-append race (or pages compacted away) builds again
        over the newer version. ``commit(old state, offset, data, footer)`` publishes it, then
        the storage below the version is freed. ``checkpoint`` and ``base`` as in ``update``."""
        with self._write_lock:
            for _ in range(MAX_UPDATE_ATTEMPTS):
                state = self._state
                footer = state.footer
                if base is not None and max(footer.checkpoint, 0) != base:  # (-1: none yet, as 0)
                    raise TreeMovedError(f"the tree moved from checkpoint {base} to {footer.checkpoint}")
                if checkpoint is not None and footer.checkpoint >= checkpoint:
                    return state
                try:
                    built = build(state)
                except OffsetOutOfRangeError as error:  # another writer compacted pages this state needs
                    self._restart(state, error)
                    continue
                except PieceLostError:  # another writer appended between two pieces: start over
                    self.reload()
                    continue
                if built is None or isinstance(built, TreeState):
                    return built
                data, new_footer, at = built
                try:
                    self.segment.append(data, expected_offset=at)
                except BadOffsetError:
                    self.reload()
                    continue
                commit(state, at, data, new_footer)
                self.io.bytes_written += len(data)
                self.io.updates_written += 1
                truncate_below(self.segment, self.policy, new_footer.min_offset)
                return self._state
        raise RetriesExhaustedError(f"segment {self.segment.name!r}: {what} lost the append race to other writers "
                                    f"{MAX_UPDATE_ATTEMPTS} times in a row; giving up (nothing was written)")



def _columns(keys: Sequence[bytes], values: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch of lists as ``update_columns`` takes it."""
    gone = np.fromiter((value is None for value in values), bool, len(values))
    numbers = np.fromiter((0 if value is None else value for value in values), VALUE_DTYPE, len(values))
    return np.array(keys, KEY_DTYPE).reshape(-1), numbers, gone


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


def truncate_below(segment: RollingSegment, policy, min_offset: int) -> None:
    """Free the chunks of ``segment`` lying wholly below a durable new version whose lowest
    page is at ``min_offset``, if ``policy`` truncates (best effort: a failure is logged and a
    later update retries). Object stores make one chunk per update: those are deleted in
    batches of at least 16, not one by one."""
    if not getattr(policy, "truncates", True):
        return
    chunks = segment.chunks()
    freeable = 0
    for chunk in chunks[:-1]:
        if chunk.end > min_offset:
            break
        freeable += 1
    if not freeable or not (segment.storage.appendable or freeable >= 16):
        return
    log.debug("segment %r: truncating below offset %d (%d chunks freed)", segment.name, min_offset, freeable)
    try:
        segment.truncate(min_offset)
    except (StorageError, OSError) as error:
        # The update is durable: freeing space is best effort, and the next update retries.
        log.warning("segment %r: truncating below offset %d failed after a durable update; "
                    "a later update retries it: %s", segment.name, min_offset, error)
