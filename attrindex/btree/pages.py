"""``PageReader``: the pages of one B+tree segment, read and decoded through the page cache.

Every lookup, scan and merge of ``BTreeIndex`` reads pages through it: one page at a time
(``page``, ``child``: decoded, cached, with the children of an index page followed through weak
references), or a stored tree's leaves in key order as columns (``tree_leaves``: what a dense
merge, a run merge and a count stream through). A chunk deleted under a read by another writer's
compaction is told apart from a failure (``read``): the caller then moves to a newer version.
"""

from __future__ import annotations

import bisect
import time
import weakref
from typing import Iterator, Sequence

import numpy as np

from storage_adapters import RollingSegment
from storage_adapters.errors import CorruptDataError, OffsetOutOfRangeError, StorageError, TruncatedError

from .columns import leaf_columns, page_columns
from .page import IndexPage, LeafPage, RunLeafPage, decode_page
from .runs import Forest, TreeRef, filter_probe

MAX_RELIST_ATTEMPTS = 6  #: fresh listings before an inconsistent view is taken for damage
LEAF_READ_BYTES = 4 << 20  #: the most bytes of consecutive leaves a merge reads at once


ABSENT = object()  #: a run's answer for a key it does not hold


class PageReader:
    """Reads and decodes the pages of ``segment`` through ``cache`` (anything with
    ``get_or_load``/``peek``), counting storage reads in ``io.storage_reads``."""

    def __init__(self, segment: RollingSegment, cache, io):
        self.segment = segment
        self.cache = cache
        self.io = io

    def page(self, offset: int, length: int) -> LeafPage | IndexPage:
        return self.cache.get_or_load(offset, self.read_page, offset, length)

    def child(self, page: IndexPage, i: int) -> LeafPage | IndexPage:
        """Child ``i`` of an index page: through its weak reference if alive, else the cache."""
        refs = page.children
        if refs is None:
            refs = page.children = [None] * len(page.keys)
        ref = refs[i]
        if ref is not None:
            child = ref()
            if child is not None:
                return child
        child = self.page(page.offsets[i], page.lengths[i])
        refs[i] = weakref.ref(child)
        return child

    def read_page(self, offset: int, length: int) -> tuple[LeafPage | IndexPage, int]:
        self.io.storage_reads += 1
        return decode_page(self.read(offset, length), offset, self.segment.name), length

    def read(self, offset: int, length: int) -> bytes:
        """``segment.read``, with a chunk that vanished under the read told apart from a failure:
        if a fresh listing puts ``offset`` below the truncation offset, another writer's compaction
        deleted it, which is ``TruncatedError`` (the caller moves to a newer version)."""
        try:
            return self.segment.read(offset, length)
        except OffsetOutOfRangeError:
            raise
        except (FileNotFoundError, StorageError) as error:
            if isinstance(error, CorruptDataError) or not self.truncated_below(offset):
                if isinstance(error, FileNotFoundError):
                    raise StorageError(f"segment {self.segment.name!r}: reading offset {offset}: {error}") from error
                raise
            segment = self.segment
            raise TruncatedError(segment.name, offset, length, segment.start_offset, segment.length) from error

    def truncated_below(self, offset: int) -> bool:
        """Whether a fresh listing of the segment starts above ``offset``."""
        for attempt in range(MAX_RELIST_ATTEMPTS):
            if attempt:
                pause(attempt)
            try:
                self.segment.refresh()
            except FileNotFoundError:  # a chunk deleted between listing and sizing it: look again
                continue
            return offset < self.segment.start_offset
        return False

    def run_value(self, run: TreeRef, key: bytes) -> object:
        """The value the run whose tree is ``run`` holds for ``key``: an int, ``None`` (the run
        removes it) or ``ABSENT``. A main tree's leaf where a run's belongs is damage."""
        leaf = self.leaf(self.page(run.offset, run.length), key)
        if not isinstance(leaf, RunLeafPage):
            raise CorruptDataError(f"segment {self.segment.name!r}: a main tree's leaf in the run whose root is at "
                                   f"offset {run.offset}", segment=self.segment.name, offset=run.offset)
        return leaf.find(key, ABSENT)

    def leaf(self, page: LeafPage | IndexPage, key: bytes) -> LeafPage:
        """The leaf under ``page`` that ``key`` belongs in."""
        while not page.is_leaf:
            page = self.child(page, bisect.bisect_right(page.keys, key) - 1)
        return page  # type: ignore[return-value]

    def tree_leaves(self, tree: TreeRef, kind: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """The leaves (of ``kind``) of the stored ``tree`` in key order as checked columns
        (``columns.leaf_columns``): from the page cache if it holds them, else from storage
        without filling the cache, consecutive leaves in one read of up to ``LEAF_READ_BYTES``
        (leaves written by a rebuild or a run lie in key order)."""
        root = self.page(tree.offset, tree.length)
        if root.is_leaf:
            if root.keys:
                yield page_columns(root)
            return
        peek = self.cache.peek
        for page in self.lowest_index_pages(root, 1, tree.height):
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
                data = memoryview(self.read(start, end - start))
                self.io.storage_reads += 1
                for k in range(i, j):
                    at = offsets[k] - start
                    yield leaf_columns(data[at:at + lengths[k]], offsets[k], self.segment.name, kind)
                i = j

    def lowest_index_pages(self, page: IndexPage, depth: int, height: int) -> Iterator[IndexPage]:
        """The index pages right above the leaves under ``page`` (at ``depth``), in key order."""
        if depth == height - 1:
            yield page
            return
        for i in range(len(page.keys)):
            yield from self.lowest_index_pages(self.child(page, i), depth + 1, height)  # type: ignore[arg-type]

    def get_many(self, root, keys, pages: int) -> dict[bytes, int]:
        """The values of ``keys`` found in the tree under ``root`` (of ``pages`` pages)."""
        if 2 * len(keys) < pages:
            # Sparse keys share few pages: sorting them would cost more than it saves.
            found = {}
            for key in keys:
                value = self.leaf(root, key).get(key)
                if value is not None:
                    found[key] = value
            return found
        return self.lookup_sorted(root, sorted(keys))

    def lookup_sorted(self, root: LeafPage | IndexPage, keys: list[bytes]) -> dict[bytes, int]:
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
                page = self.child(page, i)
                path.append((page, end))
            value = page.get(key)
            if value is not None:
                found[key] = value
        return found

    def walk(self, page, start, stop, after) -> Iterator[tuple[bytes, int]]:
        """The entries under ``page`` with ``start <= key < stop`` and above ``after`` (each
        ``None``: unbounded), ascending; a run's removals as ``None`` values."""
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
            yield from self.walk(self.child(page, n), start, stop, after)

    def runs_get_many(self, forest: Forest, keys: Sequence[bytes]) -> dict[bytes, int | None]:
        """The values the runs hold for ``keys`` (newest run first; ``None``: removed by a run)."""
        keys = list(keys)
        settled: dict[bytes, int | None] = {}
        for run, may in zip(forest.runs, filter_probe(forest.filters, keys)):
            for row in np.flatnonzero(may).tolist():
                key = keys[row]
                if key not in settled:
                    value = self.run_value(run.tree, key)
                    if value is not ABSENT:
                        settled[key] = value  # type: ignore[assignment]
        return settled


def pause(attempt: int) -> None:
    """Back off before looking again: 1, 2, 4 ... ms."""
    time.sleep(0.001 * (1 << min(attempt - 1, 8)))


__all__ = ["ABSENT", "LEAF_READ_BYTES", "MAX_RELIST_ATTEMPTS", "PageReader", "pause"]
