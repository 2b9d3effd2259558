"""Fault hunt: opening a plain index beside a writer whose merge truncates the WAL.

``Segment._open`` read the tree's checkpoint, then listed the WAL again (``open_at``) and started
replaying at ``max(checkpoint, the log's start)``. When another handle merged past that tree
version and truncated the WAL in between, the replay silently began above the checkpoint and
the open missed acknowledged updates (a stale read: "got 152, acknowledged 202" in a writer +
opener race, 8 wrong opens in 3,500). It now sees the truncation, re-reads the tree, and retries.

Also the memory backend under the same race: a listing looked sizes up by name after taking the
names (``KeyError`` when a truncation deleted one meanwhile), and a read's buffer export made a
concurrent append raise ``BufferError``.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from attrindex import AttributeIndex
from attrindex.log import segment_log
from storage_adapters import memory, open_storage

N = 60


def _url(backend, tmp_path) -> str:
    return f"memory://hunt-open-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_an_open_racing_a_merge_and_wal_truncation_sees_every_acknowledged_update(backend, tmp_path, monkeypatch):
    url = _url(backend, tmp_path)
    writer = AttributeIndex(open_storage(url), page_size=256, wal_rolling_size=200, merge_keys=10**6,
                            merge_seconds=10**6)
    for i in range(N):
        writer.update({i: i})
    writer.flush()  # tree checkpoint C0; the WAL below its chunk is cut
    for i in range(N):
        writer.update({i: 1000 + i})  # acknowledged; in the WAL after C0, over several chunks
    real = segment_log.SegmentLog.open_at
    raced = []

    def open_at(self, position):
        if not raced and self.segment.endswith("_wal"):
            raced.append(position)
            writer.flush()  # another handle merges past the reader's tree version and cuts the WAL
        return real(self, position)

    monkeypatch.setattr(segment_log.SegmentLog, "open_at", open_at)
    reader = AttributeIndex(open_storage(url), page_size=256)
    assert raced and writer.checkpoint > raced[0]  # the race happened
    assert reader.get_many(range(N)) == [1000 + i for i in range(N)]
    assert len(reader) == N
    reader.close()
    writer.close()


def test_a_memory_listing_is_one_moment_of_the_store(monkeypatch):
    """A truncation deleting files while a listing reads their sizes: the listing still shows the
    store as it was when it was taken (never a KeyError, never an empty log)."""
    storage = open_storage(f"memory://hunt-list-{uuid.uuid4().hex}")
    for name in ("d/a", "d/b", "d/truncation/b"):
        storage.create(name, b"12345")
    real = memory._size
    deleted = []

    def size(chunk):
        if not deleted:
            deleted.append(True)
            storage.delete(["d/a", "d/b", "d/truncation/b"])  # lands between the names and the sizes
        return real(chunk)

    monkeypatch.setattr(memory, "_size", size)
    assert storage.list_files("d") == {"a": 5, "b": 5, "truncation/b": 5}


def test_an_append_beside_a_read_of_the_same_memory_chunk_waits_instead_of_failing():
    """A read exports the chunk's buffer while it copies; an append growing the buffer meanwhile
    raised ``BufferError`` (a writer thread died of it in a writer + opener race)."""
    storage = open_storage(f"memory://hunt-buf-{uuid.uuid4().hex}")
    storage.append("c", 0, b"x" * 100)
    chunk = storage.fs.store[storage._abs("c")]
    exported, release = threading.Event(), threading.Event()

    def slow_getbuffer():  # a read stopped by the scheduler in the middle of its copy
        buffer = type(chunk).getbuffer(chunk)
        exported.set()
        release.wait(10)
        return buffer

    chunk.getbuffer = slow_getbuffer
    got, errors = [], []
    reader = threading.Thread(target=lambda: got.append(storage.read("c", 0, 100)))
    reader.start()
    assert exported.wait(10)
    del chunk.getbuffer  # the append and later reads use the real one

    def append():
        try:
            storage.append("c", 100, b"y" * 10)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    appender = threading.Thread(target=append)
    appender.start()
    appender.join(1.0)  # without the guard the append fails at once, while the export is held
    release.set()
    reader.join(10)
    appender.join(10)
    assert errors == [] and got == [b"x" * 100]
    assert storage.read("c", 0, 200) == b"x" * 100 + b"y" * 10


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_an_open_racing_log_compaction_sees_every_attribute_update(backend, tmp_path, monkeypatch):
    """The same race with log compaction instead of truncation: the cleaner drops the attribute
    updates of the batches it rewrites below its limit (a newer tree version holds them); an open
    that read the older tree version replayed the rewritten batches and missed them."""
    from attrindex import SegmentStore
    from attrindex.log.batch.records import Record

    url = _url(backend, tmp_path)
    store = SegmentStore.open(url, log_rolling_size=200, flush_keys=10**6, flush_seconds=10**6)
    writer = store.segment("s", create=True, cleanup_policy="compact")
    writer.configure(min_compaction_lag_ms=0)
    writer.append([Record(b"first", key=b"k")], [(0, 0)])
    writer.flush()  # tree checkpoint C0
    for i in range(1, 30):  # each batch supersedes the last one's record: the cleaner drops them
        writer.append([Record(b"v%d" % i, key=b"k")], [(i, i)])
    real = segment_log.SegmentLog.open_at
    raced = []

    def open_at(self, position):
        if not raced and self.segment == "s":
            raced.append(position)
            writer.compact(min_lag_ms=0)  # merges (checkpoint C1), then rewrites chunks below C1
        return real(self, position)

    monkeypatch.setattr(segment_log.SegmentLog, "open_at", open_at)
    reader = SegmentStore.open(url).segment("s")
    assert raced
    assert reader.get_attributes(range(30)) == list(range(30))
    reader.close()
    writer.close()


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_an_update_that_lost_a_race_survives_a_truncation_during_its_catch_up(backend, tmp_path, monkeypatch):
    """Writer B loses the append race, catches up, and the chunk its catch-up is about to read is
    truncated by writer A's merge: B's update raised ``TruncatedError`` (nothing written). It now
    lists again, rebuilds from the tree, and its update goes through."""
    from storage_adapters import rolling

    url = _url(backend, tmp_path)
    options = dict(page_size=256, wal_rolling_size=200, merge_keys=10**6, merge_seconds=10**6)
    a = AttributeIndex(open_storage(url), **options)
    b = AttributeIndex(open_storage(url), **options)
    b.update({1000: 1})
    for i in range(N):
        a.update({i: i})  # B's view is now several chunks behind
    real = rolling.RollingSegment.read
    b_bytes = b._log.bytes
    raced = []

    def read(self, offset, length):
        if self is b_bytes and not raced:
            raced.append(offset)
            a.flush()  # A merges and truncates the WAL under B's catch-up
        return real(self, offset, length)

    monkeypatch.setattr(rolling.RollingSegment, "read", read)
    b.update({1001: 2})  # was: TruncatedError
    assert raced
    assert b.get_many([0, N - 1, 1000, 1001]) == [0, N - 1, 1, 2]
    monkeypatch.setattr(rolling.RollingSegment, "read", real)
    fresh = AttributeIndex(open_storage(url), page_size=256)
    assert fresh.get_many([0, N - 1, 1000, 1001]) == [0, N - 1, 1, 2]
    for index in (fresh, a, b):
        index.close()
