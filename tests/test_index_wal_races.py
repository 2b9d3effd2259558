"""Handles of one ``AttributeIndex`` racing each other's merges and WAL truncations.

A handle that opens, or catches up after losing an append race, reads the tree's checkpoint and
replays the WAL from there; meanwhile another handle may merge past that tree version and
truncate the WAL below where the replay starts. Each race is made deterministic by landing the
other handle's merge and truncation inside the window. Held: every acknowledged update is seen
(never a replay that silently starts above the checkpoint), an update that lost the race goes
through, a catch-up that fails leaves nothing stale to read or merge, and every retry loop is
bounded with a clear error.
"""

from __future__ import annotations

import uuid

import pytest

from attrindex import AttributeIndex
from attrindex.log import segment_log
from storage_adapters import open_storage

N = 60
OPTIONS = dict(page_size=256, wal_rolling_size=200, merge_keys=10**6, merge_seconds=10**6)


def _url(backend, tmp_path) -> str:
    return f"memory://wal-race-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_an_open_racing_a_merge_and_wal_truncation_sees_every_acknowledged_update(backend, tmp_path, monkeypatch):
    """Another handle merges past the tree version an open read and truncates the WAL before the
    open lists the WAL: the open sees the truncation, re-reads the tree and replays from its
    checkpoint, answering every acknowledged update."""
    url = _url(backend, tmp_path)
    writer = AttributeIndex(open_storage(url), **OPTIONS)
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


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_an_update_that_lost_a_race_survives_a_truncation_during_its_catch_up(backend, tmp_path, monkeypatch):
    """Writer B loses the append race, catches up, and the chunk its catch-up is about to read is
    truncated by writer A's merge: B lists again, rebuilds from the tree, and its update goes
    through (never a ``TruncatedError``)."""
    from storage_adapters import rolling

    url = _url(backend, tmp_path)
    a = AttributeIndex(open_storage(url), **OPTIONS)
    b = AttributeIndex(open_storage(url), **OPTIONS)
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
    b.update({1001: 2})
    assert raced
    assert b.get_many([0, N - 1, 1000, 1001]) == [0, N - 1, 1, 2]
    monkeypatch.setattr(rolling.RollingSegment, "read", real)
    fresh = AttributeIndex(open_storage(url), page_size=256)
    assert fresh.get_many([0, N - 1, 1000, 1001]) == [0, N - 1, 1, 2]
    for index in (fresh, a, b):
        index.close()


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_an_update_whose_rebuild_meets_another_merge_and_truncation_goes_through(backend, tmp_path, monkeypatch):
    """B's catch-up steps over A's WAL cut, so it rebuilds tier 1 from the tree's newest
    checkpoint C; A merges past C and cuts the WAL past it between B's look at the tree and B's
    read of the WAL from C. The rebuild starts over from the newer tree version (which holds what
    was cut), and B's update goes through (never a ``TruncatedError``)."""
    url = _url(backend, tmp_path)
    a = AttributeIndex(open_storage(url), **OPTIONS)
    b = AttributeIndex(open_storage(url), **OPTIONS)
    b.update({1000: 1})
    for i in range(N):
        a.update({i: i})
    a.flush()  # tree checkpoint C; the WAL below C's chunk is cut, past B's view
    for i in range(N):
        a.update({i: 100 + i})  # more WAL chunks after C
    real = segment_log.SegmentLog.batches
    raced = []

    def batches(self, start, end, *args, **kwargs):
        if self is b._log and not raced:  # B's rebuild, about to read the WAL from C
            raced.append(start)
            a.flush()  # A merges past C and cuts the WAL past it
        return real(self, start, end, *args, **kwargs)

    monkeypatch.setattr(segment_log.SegmentLog, "batches", batches)
    b.update({1001: 2})
    assert raced and a.checkpoint > raced[0]
    assert b.get_many([0, N - 1, 1000, 1001]) == [100, 100 + N - 1, 1, 2]
    monkeypatch.setattr(segment_log.SegmentLog, "batches", real)
    fresh = AttributeIndex(open_storage(url), page_size=256)
    assert fresh.get_many([0, N - 1, 1000, 1001]) == [100, 100 + N - 1, 1, 2]
    for index in (fresh, a, b):
        index.close()


def _behind_a_merged_and_cut_wal(url: str, storage):
    """Handles A and B (B on ``storage``): B set key 7 to 0, then A set it to 1, merged and cut the
    WAL past B's view, and wrote more. B's next catch-up steps over the cut and must rebuild tier 1
    from the tree (where 7 is 1): tier 1 still says 0."""
    a = AttributeIndex(open_storage(url), **OPTIONS)
    b = AttributeIndex(storage, **OPTIONS)
    b.update({7: 0})
    a.update({7: 1})
    for i in range(N):
        a.update({100 + i: i})
    a.flush()
    for i in range(N):
        a.update({100 + i: 1000 + i})
    return a, b


@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize("fails", ["scan", "rebuild"])
def test_a_failed_catch_up_never_serves_or_merges_stale_values(backend, fails, tmp_path, monkeypatch):
    """B's catch-up fails after stepping over A's WAL cut: in its scan of the tail (a storage read
    error after the restart at the new start) or in the rebuild of tier 1 from the tree (twice:
    the update's and the next read's). Its update fails cleanly (nothing written), and B never
    answers or merges the value its tier 1 held from before the cut (7 = 0 over A's acknowledged
    1): tier 1 is stale until rebuilt, reads rebuild it first (raising while they cannot), and
    B's next merge writes tier 1 as rebuilt."""
    from attrindex.errors import StorageError
    from storage_adapters.faults import FaultyStorage

    url = _url(backend, tmp_path)
    faulty = FaultyStorage(open_storage(url), seed=1)
    a, b = _behind_a_merged_and_cut_wal(url, faulty)
    rebuild_failures = []
    if fails == "scan":  # the scan after the restart at the new start (not the storage's look at its end)
        real_scan = segment_log.SegmentLog._scan_chunk
        scan_failures = []

        def scan_chunk(self, *args, **kwargs):
            if self is b._log and self.resyncs and not scan_failures:
                scan_failures.append(True)
                raise StorageError("injected: reading the WAL's tail failed")
            return real_scan(self, *args, **kwargs)

        monkeypatch.setattr(segment_log.SegmentLog, "_scan_chunk", scan_chunk)
    else:
        real = segment_log.SegmentLog.batches

        def batches(self, start, end, *args, **kwargs):
            if self is b._log and len(rebuild_failures) < 2:
                rebuild_failures.append(start)
                raise StorageError("injected: reading the WAL failed")
            return real(self, start, end, *args, **kwargs)

        monkeypatch.setattr(segment_log.SegmentLog, "batches", batches)
    with pytest.raises(StorageError):
        b.update({1001: 2})  # definite: nothing written
    assert faulty.pending_scripts() == 0
    if fails == "scan":
        assert scan_failures == [True]
    if fails == "rebuild":
        with pytest.raises(StorageError):
            b.get(7)  # the rebuild fails again: an error, never the stale 0
        assert len(rebuild_failures) == 2
    assert b.get(7) == 1 and b.get_many([7, 100, 1001]) == [1, 1000, None]
    assert len(b) == N + 1  # 7 and A's N keys
    b.update({1002: 3})
    b.flush()  # merges tier 1 as rebuilt, not the stale one
    fresh = AttributeIndex(open_storage(url), page_size=256)
    assert fresh.get_many([7, 100, 1001, 1002]) == [1, 1000, None, 3]
    for index in (fresh, a, b):
        index.close()


@pytest.mark.parametrize("where", ["scan", "rebuild"])
def test_catch_ups_that_keep_meeting_truncations_end_in_a_clear_error(where, monkeypatch):
    """Every loop is bounded: a catch-up whose scan, or whose rebuild, meets a fresh truncation
    every time gives up with a ``RetriesExhaustedError`` that says so (nothing written), not with
    the raw ``TruncatedError``; the handle works again once the truncations stop."""
    from attrindex import attribute_state
    from attrindex.errors import RetriesExhaustedError, StorageError, TruncatedError

    url = f"memory://wal-race-bound-{uuid.uuid4().hex}"
    a, b = _behind_a_merged_and_cut_wal(url, open_storage(url))
    calls = []

    def truncated(*_args, **_kwargs):
        calls.append(1)
        raise TruncatedError("attributes/_wal/_log", 0, 1, 1, 2)

    if where == "scan":
        monkeypatch.setattr(segment_log.SegmentLog, "catch_up", truncated)
        message = "kept truncating the log while this handle read its tail"
    else:
        monkeypatch.setattr(attribute_state.AttributeState, "_replayed_from_newest_tree", truncated)
        message = "kept merging and truncating the log while this handle rebuilt"
    with pytest.raises(StorageError, match=message) as raised:
        b.update({1001: 2})
    assert type(raised.value) is RetriesExhaustedError and len(calls) == 10
    monkeypatch.undo()
    assert b.get_many([7, 100, 1001]) == [1, 1000, None]
    b.update({1001: 2})
    assert b.get(1001) == 2
    for index in (a, b):
        index.close()


def test_a_refresh_rebuilds_tier_1_once_and_reports_a_wal_cut_past_every_tree_version(monkeypatch):
    """B's refresh adopts A's newer tree version and rebuilds tier 1 once: that rebuild is the one
    loop over tree versions. Here A cut its WAL past the tree's checkpoint without merging (as
    damage or a lost merge would): no version covers the cut, the updates in between are lost,
    and the refresh says so (``CorruptDataError``) after ONE look for a newer version, instead of
    rebuilding ``MAX_TREE_REFRESH_ATTEMPTS`` times from a tree that cannot cover the WAL's start."""
    from attrindex import replay
    from attrindex.errors import CorruptDataError

    url = f"memory://wal-race-refresh-{uuid.uuid4().hex}"
    a = AttributeIndex(open_storage(url), **OPTIONS)
    b = AttributeIndex(open_storage(url), **OPTIONS)
    for i in range(N):
        a.update({i: i})
    a.flush()  # tree checkpoint C
    a.update({0: 100})
    a.update({1: 101})  # only in the WAL, and cut below
    cut = a._log.position
    a.update({2: 102})
    a._log.truncate_at(cut)
    real, rebuilds = replay.from_newest_tree, []
    monkeypatch.setattr(replay, "from_newest_tree", lambda *args: rebuilds.append(1) or real(*args))
    with pytest.raises(CorruptDataError, match="updates in between are lost"):
        b.refresh()
    assert len(rebuilds) == 1
    with pytest.raises(CorruptDataError):
        b.get(0)  # never the value of the tree below the lost updates
    for index in (a, b):
        index.close()


def test_a_flush_whose_merges_keep_losing_raises_and_never_claims_them(tmp_path, monkeypatch):
    """Each merge of the flush finds the tree written by another handle (as a handle whose merges
    always come second sees it): after ``MAX_DRAIN_MERGE_ATTEMPTS`` laps the flush raises, its updates still
    in the WAL and readable, instead of returning as if they were in the tree."""
    from attrindex import attribute_state
    from attrindex.errors import RetriesExhaustedError

    index = AttributeIndex.open(str(tmp_path), **OPTIONS)
    index.update({i: i for i in range(N)})
    runner = index._attributes.runner
    laps = []

    def always_second(tree, frozen, at, base, background):
        laps.append(at)
        return False  # "another handle merged first": tier 1 is rebuilt and merged again

    monkeypatch.setattr(runner, "merge", always_second)
    with pytest.raises(RetriesExhaustedError, match="kept merging"):
        index.flush()
    assert len(laps) == attribute_state.MAX_DRAIN_MERGE_ATTEMPTS
    assert index.checkpoint is None and index.stats().pending_keys == N
    assert index.get_many(range(N)) == list(range(N))
    monkeypatch.undo()
    index.flush()  # the next flush merges them
    assert index.checkpoint is not None and index.stats().pending_keys == 0
    index.close()
