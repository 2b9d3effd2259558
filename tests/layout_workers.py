"""Code run in child processes by the chunk-switch tests (importable under ``spawn``)."""

from __future__ import annotations

import os
import random
import signal
import sys
import time

from storage_adapters import ChunkStorage, LayoutConflictError, RollingSegment, open_storage

from .framed import open_segment, overhead, pieces

NAME = "switch/0"
CHUNK = 16  #: payload bytes per chunk


def chunk_size(storage: ChunkStorage) -> int:
    """The stored size of one chunk of ``original`` (a frame on local disk: tests/framed.py)."""
    return CHUNK + overhead(storage)


def original(storage: ChunkStorage, chunks: int) -> bytes:
    """The bytes the switch tests write: ``chunks`` appends of ``CHUNK`` distinct bytes each, one
    chunk each (``chunk_size`` bytes stored)."""
    return b"".join(pieces(storage, [bytes([(i * 7 + j) % 251 for j in range(CHUNK)]) for i in range(chunks)]))


def open_switched(storage: ChunkStorage) -> RollingSegment:
    """The switch tests' segment, rolling after each chunk of ``original``."""
    return open_segment(storage, NAME, rolling_size=chunk_size(storage))


class KillingStorage(ChunkStorage):
    """Delegates to ``inner`` and SIGKILLs its own process at its ``kill_at``-th write (before it)."""

    def __init__(self, inner: ChunkStorage, kill_at: int):
        super().__init__(inner.url)
        self.inner, self.kill_at, self.writes = inner, kill_at, 0
        self.appendable = inner.appendable
        self.torn_appends = inner.torn_appends
        self.deletion_grace = inner.deletion_grace

    def _write(self) -> None:
        self.writes += 1
        if self.writes == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def list_files(self, directory):
        return self.inner.list_files(directory)

    def read(self, path, start, end):
        return self.inner.read(path, start, end)

    def exists(self, path):
        return self.inner.exists(path)

    def size(self, path):
        return self.inner.size(path)

    def trim(self, path, size):
        self._write()
        self.inner.trim(path, size)

    def lock(self, directory):
        return self.inner.lock(directory)

    def create(self, path, data):
        self._write()
        self.inner.create(path, data)

    def put_marker(self, path):
        self._write()
        self.inner.put_marker(path)

    def delete(self, paths):
        self._write()
        self.inner.delete(paths)

    def remove_directory(self, directory):
        self.inner.remove_directory(directory)

    def append(self, path, position, data, *, clear_to=0):
        self._write()
        self.inner.append(path, position, data, clear_to=clear_to)


def replace_until_killed(url: str, options: dict, kill_at: int, seed: int, chunks: int) -> None:
    """Replace random runs of chunks by their exact bytes (or by fewer: ``seed`` odd) until killed."""
    rng = random.Random(seed)
    seg = open_switched(KillingStorage(open_storage(url, **options), kill_at))
    for _ in range(50):
        sealed = seg.chunks()[:-1]
        i = rng.randrange(len(sealed))
        j = min(len(sealed) - 1, i + rng.randrange(3))
        start, end = sealed[i].start, sealed[j].end
        data = original(seg.storage, chunks)[start:end] if seed % 2 == 0 else b"x" * rng.randrange(end - start + 1)
        if any(c.stored < c.length for c in sealed[i:j + 1]):
            data = data[:0]
        seg.replace_range(start, end, data)
    sys.exit(3)  # never killed: the parent asked for a write that never came


def race_replace(url: str, options: dict, who: int, rounds: int, barrier, results) -> None:
    """Each round: refresh, wait for everyone, then replace a range overlapping the other's."""
    seg = open_switched(open_storage(url, **options))
    outcome = []
    for _round in range(rounds):
        seg.refresh()
        sealed = seg.chunks()[:-1]
        # Process 0 takes the first two sealed chunks, process 1 the second and third: they share one.
        first = sealed[who] if len(sealed) > who + 1 else None
        barrier.wait()
        if first is not None:
            run = sealed[who:who + 2]
            try:
                seg.replace_range(run[0].start, run[-1].end, seg.read(run[0].start, run[-1].stored_end - run[0].start))
                outcome.append("won")
            except LayoutConflictError:
                outcome.append("lost")
        else:
            outcome.append("none")
        barrier.wait()
    results.put((who, outcome))


def read_while_switching(url: str, options: dict, chunks: int, seconds: float, results) -> None:
    """Read the whole segment over and over; every read must be the original bytes exactly."""
    seg = open_switched(open_storage(url, **options))
    expected, reads, deadline = original(seg.storage, chunks), 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            start = random.randrange(len(expected))
            got = seg.read(start, len(expected) - start)
            assert got == expected[start:], f"wrong bytes at {start}"
            reads += 1
        results.put(("ok", reads))
    except BaseException as exc:  # report, never hang the parent
        results.put(("error", repr(exc)))


def append_records(url: str, options: dict, name: str, count: int, rolling: int, results) -> None:
    """Append ``count`` records (values = their offsets), a few per batch, as fast as it can."""
    from attrindex import SegmentStore

    try:
        seg = SegmentStore.open(url, storage_options=options, log_rolling_size=rolling).segment(name)
        written = 0
        while written < count:
            n = min(1 + written % 3, count - written)
            seg.append([b"%d" % (written + i) for i in range(n)])
            written += n
        results.put(("writer", written))
    except BaseException as exc:  # report, never hang the parent
        results.put(("writer", repr(exc)))


def tail_records(url: str, options: dict, name: str, count: int, rolling: int, seconds: float, results) -> None:
    """Tail the segment from offset 0 until ``count`` records came (or ``seconds`` passed)."""
    from attrindex import SegmentStore

    try:
        seg = SegmentStore.open(url, storage_options=options, log_rolling_size=rolling).segment(name)
        reader = seg.reader(offset=0)
        got, deadline = [], time.monotonic() + seconds
        while len(got) < count and time.monotonic() < deadline:
            got += [(r.offset, r.value) for r in reader.read_batch(max_records=1000, timeout=0.2)]
        results.put(("reader", got))
    except BaseException as exc:
        results.put(("reader", repr(exc)))


def assert_only_live_chunks_left(seg: RollingSegment) -> None:
    """Every chunk object listed is a live chunk of ``seg``'s view, except, on an object store
    with a deletion grace, dead plain chunk names this handle waits to delete (a stale appender
    must not be able to re-create them)."""
    from storage_adapters.rolling import CHUNK_NAME, SWITCH_DIR, TRUNCATION_DIR

    files = seg.storage.list_files(seg.name + ".seg")
    data = {n for n in files if not n.startswith((SWITCH_DIR, TRUNCATION_DIR))}
    live = {c.name for c in seg.chunks()}
    assert live <= data
    extra = data - live
    if not seg.storage.appendable and seg.storage.deletion_grace > 0:
        assert all(CHUNK_NAME.fullmatch(n) and n in seg._handle.doomed for n in extra), extra
    else:
        assert not extra, extra
