"""Verifying, opening and retention beside another process's writer: benign races are never
reported as damage or leak the storage layer's errors, and housekeeping never fails a durable act."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from attrindex import SegmentStore
from attrindex.errors import RecordTruncatedError, StorageError, TruncatedError
from attrindex import replay
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_verify_and_open_beside_a_merging_writer_with_retention(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root) as store:
        store.segment("s", create=True).append([b"first"])
    writer = subprocess.Popen([sys.executable, "-m", "tests.workers", "merging_writer", root, "s", "4"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    verifies = opens = 0
    false_damage = []
    try:
        with SegmentStore.open(root, mode="r+") as store:
            deadline = time.monotonic() + 3.5
            while time.monotonic() < deadline and writer.poll() is None:
                report = store.verify_segment("s")
                verifies += 1
                if not report.ok:
                    false_damage.append(report.damage)
                with SegmentStore.open(root, mode="r+") as reader:
                    try:
                        reader.segment("s").get_attribute(1)
                    except RecordTruncatedError:
                        pass
                    opens += 1
    finally:
        out, err = writer.communicate(timeout=30)
    assert writer.returncode == 0, err
    assert verifies > 5 and not false_damage, f"{len(false_damage)} of {verifies} verifies: {false_damage[:2]}"


def test_open_looks_again_when_retention_removes_what_it_replays(monkeypatch):
    real_open, calls = replay.open_at_checkpoint, []

    def racing_open(log, *args):
        calls.append(1)
        if len(calls) == 1:
            raise TruncatedError(log.segment, 0, 1, 10, 20)  # what a concurrent retention causes
        return real_open(log, *args)

    monkeypatch.setattr(replay, "open_at_checkpoint", racing_open)
    with SegmentStore.open("memory://open-race-1") as store:
        store.segment("s", create=True).append([b"x"])
    assert len(calls) == 2

    monkeypatch.setattr(replay, "open_at_checkpoint", lambda log, *_: (_ for _ in ()).throw(TruncatedError(log.segment, 0, 1, 10, 20)))
    with SegmentStore.open("memory://open-race-2") as store:
        with pytest.raises(StorageError, match="retention") as caught:
            store.segment("s", create=True)
        assert not isinstance(caught.value, TruncatedError)


def _scans_always_meet_a_switch(monkeypatch) -> list[int]:
    """Every scan of a chunk meets chunks replaced under it (as if another handle kept
    consolidating), so ``SegmentLog.catch_up`` resyncs to its bound; return the list that counts
    the calls of ``catch_up``."""
    from attrindex.errors import LayoutChangedError
    from attrindex.log.segment_log import SegmentLog

    calls: list[int] = []
    real_catch_up = SegmentLog.catch_up

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real_catch_up(self, *args, **kwargs)

    def switched(self, *_args):
        raise LayoutChangedError(f"segment {self.segment!r}: log chunks were replaced during the read")

    monkeypatch.setattr(SegmentLog, "catch_up", counted)
    monkeypatch.setattr(SegmentLog, "_scan_chunk", switched)
    return calls


def test_a_lazy_open_passes_up_a_catch_up_that_resynced_to_its_bound(tmp_path, monkeypatch):
    """``Segment._open_tail`` looks again after a single layout change, but a catch-up that
    already resynced ``MAX_RESYNC_ATTEMPTS`` times is passed up after ONE call, not run again."""
    from attrindex.errors import RetriesExhaustedError
    from attrindex.segment import Segment

    with SegmentStore.open(str(tmp_path)) as store:
        store.segment("s", create=True).append([b"x"], [(1, 1)])
        calls = _scans_always_meet_a_switch(monkeypatch)
        with pytest.raises(RetriesExhaustedError, match="catch-up 10 times in a row"):
            Segment(store.storage, "s", store.options, lazy_attributes=True)
        assert len(calls) == 1


def test_a_lazy_load_passes_up_a_catch_up_that_resynced_to_its_bound(tmp_path, monkeypatch):
    """``AttributeState.ensure_loaded`` likewise: the tree it opens is ahead of the log's view
    (another handle merged), its catch-up resyncs to the bound, and the load raises that after ONE
    catch-up; the handle loads once the layout holds still."""
    from attrindex.errors import RetriesExhaustedError
    from attrindex.segment import Segment

    with SegmentStore.open(str(tmp_path)) as store:
        store.segment("s", create=True).append([b"x"], [(1, 1)])
        lazy = Segment(store.storage, "s", store.options, lazy_attributes=True)
        with SegmentStore.open(str(tmp_path)) as other:
            seg = other.segment("s")
            seg.append([b"y"], [(1, 2)])
            seg.flush()  # merged: the tree's checkpoint is past the lazy handle's view
        with monkeypatch.context() as patched:
            calls = _scans_always_meet_a_switch(patched)
            with pytest.raises(RetriesExhaustedError, match="catch-up 10 times in a row"):
                lazy.get_attribute(1)
            assert len(calls) == 1 and not lazy._attributes.loaded
        assert lazy.get_attribute(1) == 2
        lazy.close()


def test_open_after_a_retention_race_replays_from_the_newer_checkpoint(tmp_path, monkeypatch):
    """The retry must not keep the checkpoint it read before the race: retention merged first, and
    the log below that newer checkpoint is gone (the stale one made the retry report damage)."""
    root, options = str(tmp_path / "store"), {"log_rolling_size": 512}
    with SegmentStore.open(root, **options) as store:
        seg = store.segment("s", create=True)
        for i in range(20):
            seg.append([b"r%02d" % i], [(1, i)])
    real_open, raced = replay.open_at_checkpoint, []

    def racing_open(log, *args):
        if not raced:  # the handle under test: another handle appends and applies retention now
            raced.append(1)
            with SegmentStore.open(root, **options) as other:
                seg = other.segment("s")  # its own open is the real one
                for i in range(20, 40):
                    seg.append([b"r%02d" % i], [(1, i)] + ([(2, i)] if i < 30 else []))
                assert seg.apply_retention(max_bytes=600) > 0  # key 2's batches: merged, then deleted
            raise TruncatedError(log.segment, 0, 1, 10, 20)  # what its replay then meets
        return real_open(log, *args)

    monkeypatch.setattr(replay, "open_at_checkpoint", racing_open)
    with SegmentStore.open(root, **options) as store:
        seg = store.segment("s")
        assert seg.get_attributes([1, 2]) == [39, 29]
        assert [r.value for r in seg.read(seg.start_offset, 100)][-1] == b"r39"


@pytest.mark.parametrize("kind", ["fail_before", "lost_ack"])
def test_retention_is_not_failed_by_its_housekeeping(tmp_path, kind):
    faulty = FaultyStorage(open_storage(str(tmp_path / "store")), seed=5)
    with SegmentStore(faulty, log_rolling_size=256, index_interval_bytes=64) as store:
        seg = store.segment("s", create=True)
        for i in range(60):
            seg.append([b"record %03d" % i])
        faulty.script(kind, op="delete", times=1000)  # every deletion after the truncation fails
        deleted = seg.apply_retention(start_offset=40)
        assert deleted > 0 and seg.start_offset > 0
        assert [r.value for r in seg.read(seg.start_offset, 100)][-1] == b"record 059"
        faulty.enabled = False
        seg.append([b"after"])



def test_a_merge_that_fails_while_rebuilding_tier_1_keeps_it_whole():
    """A merge that finds another handle's merge ahead of it rebuilds tier 1 from the log; a read
    failing half-way must not leave tier 1 cleared, or the handle would answer, and validate
    conditions, with values older than the log it had already read (two compare-and-sets would
    both succeed against one value)."""
    url = f"memory://rebuild-{os.getpid()}-{time.monotonic_ns()}"
    with SegmentStore.open(url) as first, SegmentStore.open(url) as second:
        a = first.segment("s", create=True)
        a.append([], [(1, 10)])
        b = second.segment("s")
        b.append([], [(2, 1)])
        b.flush()  # b's merge covers more of the log than a has seen
        b.append([], [(1, 20)])  # not merged: only in the log

        def failing_batches(*args, **kwargs):
            raise StorageError("injected: a read of the log failed")

        a._log.batches = failing_batches
        with pytest.raises(StorageError, match="injected"):
            a.flush()  # finds b's merge ahead, catches up (sees 20), then the replay fails
        assert a.get_attribute(1) == 20  # never the tree's older 10
        del a._log.batches
        a.flush()
        assert a.get_attribute(1) == 20


def _cut_past_the_tree(tmp_path):
    """Handles ``mine`` and ``theirs`` of segment "s": the tree covers key 1 = 1; then key 1 = 2
    (mine), key 2 = 3 and key 3 = 4 (theirs) are only in the log, and theirs cuts the log after
    key 2's batch WITHOUT merging first (as damage or a lost merge would): 1 = 2 and 2 = 3 are in
    no tree version and no longer in the log."""
    mine, theirs = SegmentStore.open(str(tmp_path)), SegmentStore.open(str(tmp_path))
    seg = mine.segment("s", create=True)
    seg.append([b"a"], [(1, 1)])
    seg.flush()
    seg.append([b"b"], [(1, 2)])
    other = theirs.segment("s")
    other.append([b"c"], [(2, 3)])
    cut = other._log.position
    other.append([b"d"], [(3, 4)])
    other._log.truncate_at(cut)
    return mine, theirs, seg


def test_a_log_cut_past_every_tree_version_is_lost_data_not_a_silent_rollback(tmp_path):
    """A catch-up that steps over the cut rebuilds tier 1 from the newest tree version; none
    covers the cut, so the updates in between are lost: ``CorruptDataError`` (as on open), never
    tier 1 rebuilt from the log's new start, which would answer key 1 = 1 over the acknowledged 2."""
    from attrindex.errors import CorruptDataError

    mine, theirs, seg = _cut_past_the_tree(tmp_path)
    try:
        with pytest.raises(CorruptDataError, match="updates in between are lost"):
            seg.refresh()
        with pytest.raises(CorruptDataError):  # reads rebuild first: never the stale or rolled-back value
            seg.get_attribute(1)
    finally:
        theirs.close()
        mine.close()


def test_a_rebuild_whose_tree_versions_never_cover_the_cut_gives_up(tmp_path, monkeypatch):
    """Another handle keeps merging, but every version it writes stays below the log's start: after
    ``MAX_TREE_REFRESH_ATTEMPTS`` versions the rebuild raises ``RetriesExhaustedError`` (it does not
    replay from the log's start over the last version seen, losing what lies between)."""
    from attrindex.errors import RetriesExhaustedError
    from attrindex.tree_index import TreeIndex

    mine, theirs, seg = _cut_past_the_tree(tmp_path)
    merger = TreeIndex(mine.storage, seg.tree_name)
    real_refresh, refreshes = TreeIndex.refresh, []

    def refresh_after_a_lagging_merge(self):
        if self is not merger:
            refreshes.append(1)
            merger.refresh()
            merger.update_sorted([], [], checkpoint=merger.checkpoint + 1)  # newer, still below the cut
        return real_refresh(self)

    monkeypatch.setattr(TreeIndex, "refresh", refresh_after_a_lagging_merge)
    try:
        with pytest.raises(RetriesExhaustedError, match="10 tree versions in a row"):
            seg.refresh()
    finally:
        monkeypatch.undo()
        merger.close()
        theirs.close()
        mine.close()


def test_retention_whose_merges_keep_losing_cuts_nothing(tmp_path, monkeypatch):
    """Retention merges tier 1 into the tree before it cuts. If those merges keep losing to other
    handles' merges (as a handle whose merges always come second sees it), the drain gives up
    with ``RetriesExhaustedError`` and retention removes nothing, instead of leaving acknowledged
    updates in no tree version and no log."""
    from attrindex.errors import RetriesExhaustedError

    root = str(tmp_path / "store")
    with SegmentStore.open(root) as store:
        seg = store.segment("s", create=True)
        for i in range(20):
            seg.append([b"r%02d" % i], [(i % 3, i)])
        with monkeypatch.context() as patched:
            patched.setattr(seg._attributes.runner, "merge", lambda *args: False)  # every merge lost
            with pytest.raises(RetriesExhaustedError, match="kept merging"):
                seg.apply_retention(start_offset=15)
        assert seg.start_offset == 0 and len(seg.read(0, 100)) == 20
        assert seg.apply_retention(start_offset=15) >= 0 and seg.start_offset == 15
    with SegmentStore.open(root) as store:
        assert store.segment("s").get_attributes([0, 1, 2]) == [18, 19, 17]
