"""Sorted runs: batches of updates stored beside the main tree, merged into it later (no I/O).

A merge of random keys into a large tree rewrites about every leaf, whatever the batch's size, so
merging each batch as it comes writes the whole tree per batch. Instead, once the main tree holds
``RUN_MIN_ENTRIES``, a batch is written as a *run*: a small immutable tree of its own (built
bottom-up like a bulk load, its leaves ``RUN_LEAF`` pages that also record removals) plus a key
filter (``key_filter.py``) that lets a lookup skip it without a read. The version's footer then
points at a *runs page* listing the main tree and the runs, newest first, instead of at the main
tree's root. A lookup asks the runs newest first, then the main tree. When the runs hold
``RUN_SHARE`` of the main tree's entries, the next merge rebuilds the main tree from all of them
(a dense merge): the tree is rewritten once per that many updated keys, not once per batch.
When ``MAX_RUNS`` runs exist, the next batch is merged with the newest of them into one run
instead (``merged_runs``: size-tiered). ``RunPolicy`` decides; the reads and writes are
``BTreeIndex``'s (``tree.py``) over ``PageReader`` (``pages.py``).

Everything lies in the tree's own storage and is committed by its footer, as an update's pages
are: a run's pages, its filter and the runs page are one update (appended in pieces if large).
Layouts in docs/format.md, the trade in docs/design.md ("Sorted runs").
"""

from __future__ import annotations

from typing import Iterator

import attrs
import numpy as np

from storage_adapters.errors import CorruptDataError

from .footer import Footer
from .key_filter import KeyFilter, decode_filter
from .page import FILTER, HEADER_SIZE, RUN_REF, RUNS, TREE_REF, check_page

#: The fewest entries in the main tree before batches are written as runs: below, a merge
#: rewrites the touched leaves or rebuilds the tree at once (a rebuild of 2M entries takes about
#: 0.2 s of CPU).
RUN_MIN_ENTRIES = 1 << 21
#: Runs are merged into the main tree once they hold this share of its entries: the tree is
#: rewritten once per this share of updated keys (the tree bytes written per updated key are
#: about ``1 / RUN_SHARE`` times an entry), and lookups of keys in runs cost a run's leaf.
RUN_SHARE = 0.125
MAX_RUNS = 8  #: runs at most; the batch that would make one more is merged with the newest of them
FILTER_BITS_PER_KEY = 10  #: a key filter's bits per key (about 1% false positives)
#: The most entries in one run: its filter (``FILTER_BITS_PER_KEY`` bits a key) fills one page of
#: at most ``MAX_FILTER_BYTES``; a merge that would make a larger run rebuilds the main tree.
MAX_FILTER_BYTES = 12 << 20
MAX_RUN_ENTRIES = MAX_FILTER_BYTES * 8 // FILTER_BITS_PER_KEY
#: Storage a version with runs may retain per live byte before the next merge rebuilds the main
#: tree (the bounded compaction policy's target: docs/design.md, "Progressive compaction").
MAX_RETAINED = 1.45
#: How far past ``share`` a merge someone waits for may add runs (``RunPolicy.plan``'s ``defer_rebuild``).
DEFERRED_SHARE = 2
RUN_ENTRY_BYTES = 27  #: about what a run stores per entry: 25 in its leaves, its index pages, its filter


@attrs.frozen
class TreeRef:
    """A tree stored in the segment: its root page and what its pages add up to."""

    offset: int = 0
    length: int = 0  #: 0: the tree is empty
    height: int = 0
    entries: int = 0
    pages: int = 0
    live_bytes: int = 0
    min_offset: int = 0  #: the lowest offset of its pages

    def packed(self) -> tuple:
        return (self.offset, self.length, self.height, 0, self.entries, self.pages, self.live_bytes, self.min_offset)

    @classmethod
    def of_footer(cls, footer: Footer) -> TreeRef:
        """The main tree of a version without runs, as its footer describes it."""
        return cls(footer.root_offset, footer.root_length, footer.height, footer.entry_count, footer.page_count,
                   footer.live_bytes, footer.min_offset)


@attrs.frozen
class RunRef:
    """A run: its tree (whose leaves are ``RUN_LEAF`` pages) and its key filter's page."""

    tree: TreeRef
    filter_offset: int
    filter_length: int

    def packed(self) -> tuple:
        return (*self.tree.packed(), self.filter_offset, self.filter_length, 0)


@attrs.frozen
class Forest:
    """A version with runs: the runs page's place, the main tree, and the runs newest first with
    their filters (decoded, held in memory while the version is current)."""

    offset: int
    length: int
    main: TreeRef
    runs: tuple[RunRef, ...]
    filters: tuple[KeyFilter, ...] = attrs.field(eq=False, repr=False)

    @property
    def run_entries(self) -> int:
        return sum(run.tree.entries for run in self.runs)


def decode_runs(page: bytes | memoryview, offset: int, segment: str = "?") -> tuple[TreeRef, list[RunRef]]:
    """The main tree's and the runs' references in the runs page stored at ``offset``, checked:
    everything they point at lies below the page (``CorruptDataError`` otherwise)."""
    kind, count = check_page(page, offset, segment)

    def corrupt(what: str) -> CorruptDataError:
        return CorruptDataError(f"segment {segment!r}: B+tree runs page at offset {offset}: {what}",
                                segment=segment, offset=offset)

    if kind != RUNS:
        raise corrupt(f"a page of kind {kind} where the runs page belongs")
    main = _tree_ref(TREE_REF.unpack_from(page, HEADER_SIZE), offset, corrupt)
    runs = []
    at = HEADER_SIZE + TREE_REF.size
    for _ in range(count):
        fields = RUN_REF.unpack_from(page, at)
        tree = _tree_ref(fields[:8], offset, corrupt)
        filter_offset, filter_length, reserved = fields[8:]
        if not tree.length or reserved or not filter_length or filter_offset + filter_length > offset:
            raise corrupt("a run reference out of bounds")
        runs.append(RunRef(tree, filter_offset, filter_length))
        at += RUN_REF.size
    return main, runs


def read_filter(page: bytes | memoryview, offset: int, segment: str = "?") -> KeyFilter:
    """The key filter stored in the page at ``offset``, checked (``CorruptDataError`` otherwise)."""
    kind, count = check_page(page, offset, segment)
    try:
        if kind != FILTER:
            raise ValueError(f"a page of kind {kind} where a key filter belongs")
        return decode_filter(bytes(memoryview(page)[HEADER_SIZE:HEADER_SIZE + count]))
    except ValueError as error:
        raise CorruptDataError(f"segment {segment!r}: B+tree key filter at offset {offset}: {error}",
                               segment=segment, offset=offset) from None


def _tree_ref(fields: tuple, below: int, corrupt) -> TreeRef:
    offset, length, height, reserved, entries, pages, live_bytes, min_offset = fields
    if reserved or offset + length > below or min_offset > offset or (length == 0) != (height == 0):
        raise corrupt("a tree reference out of bounds")
    return TreeRef(offset, length, height, entries, pages, live_bytes, min_offset)


@attrs.frozen
class RunPolicy:
    """When batches become runs (the options ``run_min_entries`` and ``run_share`` of
    ``TreeIndex``): into a main tree of at least ``min_entries`` entries, while the runs and the
    batch hold at most ``share`` of its entries (``share`` 0: never), in at most ``max_runs``
    runs, and while the storage the version retains stays within ``max_retained`` times its live
    bytes (the runs written and merged since the main tree was rebuilt are dead bytes that only
    the rebuild frees: ``None``, no such bound, for a tree that is never truncated)."""

    min_entries: int = RUN_MIN_ENTRIES
    share: float = RUN_SHARE
    max_runs: int = MAX_RUNS
    max_retained: float | None = MAX_RETAINED

    def plan(self, main_entries: int, forest: Forest | None, batch: int, retained: int = 0, live: int = 0,
             defer_rebuild: bool = False) -> str:
        """How a batch of ``batch`` keys goes into a version whose main tree holds
        ``main_entries``, which retains ``retained`` bytes of storage for ``live`` live bytes:
        ``"tree"`` (into the main tree: rewritten or rebuilt as ``BTreeIndex`` decides, with any
        runs merged in), ``"run"`` (a new run) or ``"runs"`` (one run of the batch and the newest runs: ``merged_runs``).
        ``defer_rebuild``: a merge someone waits for (``flush``, ``close``) lets a rebuild that the share
        makes due wait for the next background merge, up to ``DEFERRED_SHARE`` times the share."""
        if main_entries < max(self.min_entries, 1) or not self.share:
            return "tree"
        runs = forest.runs if forest is not None else ()
        held = (forest.run_entries if forest is not None else 0) + batch
        if held > main_entries * self.share * (DEFERRED_SHARE if defer_rebuild else 1):
            return "tree"
        full = len(runs) >= self.max_runs
        entries = batch + (sum(run.tree.entries for run in runs[:merged_runs(runs, batch)]) if full else 0)
        written = RUN_ENTRY_BYTES * entries  # what the new run adds
        if self.max_retained is not None and live and retained + written > self.max_retained * (live + written):
            return "tree"
        if entries > MAX_RUN_ENTRIES:
            return "tree"
        return "runs" if full else "run"


def merged_runs(runs: tuple[RunRef, ...] | list[RunRef], batch: int) -> int:
    """How many of the newest ``runs`` (newest first) a batch of ``batch`` keys is merged with
    when there are as many runs as allowed: each next older run while it holds no more than the
    batch and the runs taken so far (at least one), so small runs are merged together and a
    large one is rewritten only once the small ones add up to it (size-tiered)."""
    total, k = batch, 0
    while k < len(runs) and (k == 0 or runs[k].tree.entries <= total):
        total += runs[k].tree.entries
        k += 1
    return k


def forest_footer(main: TreeRef, runs: list[RunRef], runs_page: tuple[int, int], checkpoint: int,
                  update_length: int, extra_pages: int, extra_bytes: int) -> Footer:
    """The footer of a version with runs: the root is the runs page (``height`` 0 says so), and
    the counts add up every live page (the main tree's, the runs', their filters and the runs
    page; ``extra_*``: the filter pages and the runs page). ``entry_count`` counts the entries
    stored, which is more than the keys present when runs update or remove keys of the tree."""
    trees = [main, *(run.tree for run in runs)]
    lowest = [tree.min_offset for tree in trees if tree.length]
    lowest += [run.filter_offset for run in runs]
    return Footer(root_offset=runs_page[0], root_length=runs_page[1], height=0,
                  entry_count=sum(tree.entries for tree in trees),
                  page_count=sum(tree.pages for tree in trees) + extra_pages,
                  live_bytes=sum(tree.live_bytes for tree in trees) + extra_bytes,
                  min_offset=min(lowest + [runs_page[0]]), checkpoint=checkpoint, update_length=update_length)


def newer_first(newer: Iterator[tuple[bytes, object]], older: Iterator[tuple[bytes, object]]) -> Iterator:
    """Two ascending scans merged, ``newer``'s entry winning on equal keys (removals kept)."""
    n, o = next(newer, None), next(older, None)
    while n is not None and o is not None:
        if n[0] < o[0]:
            yield n
            n = next(newer, None)
        elif o[0] < n[0]:
            yield o
            o = next(older, None)
        else:
            yield n
            n, o = next(newer, None), next(older, None)
    if n is not None:
        yield n
        yield from newer
    if o is not None:
        yield o
        yield from older


def present(scan: Iterator[tuple[bytes, object]]) -> Iterator[tuple[bytes, int]]:
    """The entries of ``scan`` that are not removals."""
    return ((key, value) for key, value in scan if value is not None)  # type: ignore[misc]


def filter_probe(filters: tuple[KeyFilter, ...], keys: list[bytes]) -> list[np.ndarray]:
    """For each filter, which of ``keys`` it may hold (one vectorised probe a filter)."""
    column = np.frombuffer(b"".join(keys), "S16")
    return [flt.may_contain_many(column) for flt in filters]


__all__ = ["Forest", "MAX_RUNS", "RUN_MIN_ENTRIES", "RUN_SHARE", "RunPolicy", "RunRef", "TreeRef", "decode_runs",
           "filter_probe", "forest_footer", "merged_runs", "newer_first", "present", "read_filter"]
