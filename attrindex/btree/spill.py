"""The bulk load's external sort: sorted runs spilled to local files, merged back in blocks.

``bulk.read_pairs`` keeps the pairs it has read in memory (a sorted run, or a collector of
unsorted pairs) up to a budget of bytes. At the budget, what it holds is sorted and written to a
file here, and reading goes on with empty memory. The load then reads the runs back as a stream
of sorted blocks (``SpilledRuns.chunks``), each a small ``SortedRun`` whose keys all lie above the
previous block's, the later run winning where two runs hold the same key (the last pair for a key
wins, as in memory). Memory is a block of every run and the block being merged, whatever the
number of pairs.

Input that arrives in key order (the common case: pairs streamed from a sorted source) makes runs
that follow each other, and they are read back one after the other, block by block. Runs whose
key ranges overlap are merged: each block takes, from every run, the entries up to the smallest
last key among the runs' current blocks, and sorts them with the collector ``read_pairs`` uses
for unsorted input (numpy's columns where installed).

A run is three files in a temporary directory (``tempfile``'s, so ``TMPDIR`` chooses the disk):
the kept keys (16 bytes each, ascending), their values (8 bytes each, native order) and the
removed keys (16 bytes each, ascending). They hold only what the caller gave the load, are read
by this process alone, and are deleted when the load ends (``close``), also when it fails.
"""

from __future__ import annotations

import bisect
import os
import shutil
import tempfile
from array import array
from typing import Callable, Iterator

from storage_adapters.errors import StorageError

from ..keys import KEY_SIZE
from .sorted_run import SortedRun

BLOCK_PAIRS = 1 << 16  #: entries read back from one run at a time


class RunFile:
    """One sorted run on disk: ``count`` kept keys with values, ``removed`` removed keys."""

    def __init__(self, directory: str, number: int, run: SortedRun):
        self.base = os.path.join(directory, f"run-{number:06d}")
        self.count = len(run)
        self.removed = len(run.removed)
        self.first = min(k for k in (run.key(0) if self.count else None, run.removed[0] if self.removed else None)
                         if k is not None)
        self.last = run.last_key()
        try:
            with open(self.base + ".keys", "wb") as f:
                f.write(run.keys)
            with open(self.base + ".values", "wb") as f:
                run.values.tofile(f)
            with open(self.base + ".removed", "wb") as f:
                f.write(b"".join(run.removed))
        except OSError as error:
            raise StorageError(f"bulk load: writing a sorted run of {self.count + self.removed:,} pairs to "
                               f"{directory!r} failed (set TMPDIR to a disk with room): {error}") from error

    def blocks(self, block_pairs: int) -> Iterator[SortedRun]:
        """The run again, as sorted runs of up to ``block_pairs`` kept keys each, with the removed
        keys that fall in each one's key range (the last block takes the rest)."""
        with open(self.base + ".keys", "rb") as keys, open(self.base + ".values", "rb") as values, \
                open(self.base + ".removed", "rb") as removed:
            pending = removed.read(KEY_SIZE)  # the next removed key not handed out yet
            left = self.count
            while left or pending:
                block = SortedRun()
                take = min(left, block_pairs)
                if take:
                    block.keys += keys.read(take * KEY_SIZE)
                    block.values.frombytes(values.read(take * 8))
                    left -= take
                high = block.key(take - 1) if take and left else None  # None: the last block
                while pending and (high is None or pending <= high):
                    block.removed.append(pending)
                    pending = removed.read(KEY_SIZE)
                yield block


class SpilledRuns:
    """A bulk load's pairs as sorted runs on disk (see the module doc). ``len`` is the number of
    kept keys over all runs (an upper bound: runs may share keys)."""

    def __init__(self, collect: Callable[[], object]):
        self._collect = collect  # a new collector for unsorted pairs (``bulk._new_collector``)
        self._directory: str | None = None
        self.runs: list[RunFile] = []

    def __len__(self) -> int:
        return sum(run.count for run in self.runs)

    @property
    def pairs(self) -> int:
        """Kept and removed keys over all runs."""
        return sum(run.count + run.removed for run in self.runs)

    def add(self, run: SortedRun) -> None:
        """Write ``run`` (sorted, unique keys) as the newest run: it wins over older ones."""
        if not len(run) and not run.removed:
            return
        if self._directory is None:
            try:
                self._directory = tempfile.mkdtemp(prefix="attrindex-load-")
            except OSError as error:
                raise StorageError(f"bulk load: making a directory for sorted runs failed: {error}") from error
        self.runs.append(RunFile(self._directory, len(self.runs), run))

    def close(self) -> None:
        """Delete the runs' files (idempotent)."""
        directory, self._directory, self.runs = self._directory, None, []
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> "SpilledRuns":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chunks(self) -> Iterator[SortedRun]:
        """Sorted runs of ascending, disjoint key ranges: every pair of every run, the newest
        run's where runs share a key. Read again from the files on every call."""
        runs, block_pairs = self.runs, BLOCK_PAIRS
        if all(a.last < b.first for a, b in zip(runs, runs[1:])):  # one after the other
            for run in runs:
                yield from run.blocks(block_pairs)
            return
        yield from self._merged(block_pairs)

    def _merged(self, block_pairs: int) -> Iterator[SortedRun]:
        readers = [run.blocks(block_pairs) for run in self.runs]
        heads: list[SortedRun | None] = [next(reader, None) for reader in readers]
        while any(head is not None for head in heads):
            bound = min(head.last_key() for head in heads if head is not None)  # type: ignore[type-var]
            collector = self._collect()
            for n, head in enumerate(heads):  # oldest run first: a later one's pair for a key wins
                if head is None:
                    continue
                taken, rest = _split(head, bound)
                collector.add_run(taken)  # type: ignore[attr-defined]
                heads[n] = rest if rest is not None else next(readers[n], None)
            block = SortedRun()
            collector.sort_into(block, None)  # type: ignore[attr-defined]
            yield block


def _split(run: SortedRun, bound: bytes) -> tuple[SortedRun, SortedRun | None]:
    """``run`` cut after ``bound``: the keys up to it, and the rest (``None`` if nothing is left)."""
    if run.last_key() <= bound:  # type: ignore[operator]
        return run, None
    kept = bisect.bisect_right(run.key_view(), bound)
    gone = bisect.bisect_right(run.removed, bound)
    taken, rest = SortedRun(), SortedRun()
    taken.keys += run.keys[:kept * KEY_SIZE]
    taken.values = array("q", run.values[:kept])
    taken.removed = run.removed[:gone]
    rest.keys += run.keys[kept * KEY_SIZE:]
    rest.values = array("q", run.values[kept:])
    rest.removed = run.removed[gone:]
    return taken, rest


__all__ = ["BLOCK_PAIRS", "RunFile", "SpilledRuns"]
