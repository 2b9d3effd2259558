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
from attrindex.attribute_state import AttributeState
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
    real_open, calls = AttributeState._open_at_checkpoint, []

    def racing_open(self):
        calls.append(1)
        if len(calls) == 1:
            raise TruncatedError(self.name, 0, 1, 10, 20)  # what a concurrent retention causes
        return real_open(self)

    monkeypatch.setattr(AttributeState, "_open_at_checkpoint", racing_open)
    with SegmentStore.open("memory://open-race-1") as store:
        store.segment("s", create=True).append([b"x"])
    assert len(calls) == 2

    monkeypatch.setattr(AttributeState, "_open_at_checkpoint", lambda self: (_ for _ in ()).throw(TruncatedError(self.name, 0, 1, 10, 20)))
    with SegmentStore.open("memory://open-race-2") as store:
        with pytest.raises(StorageError, match="retention") as caught:
            store.segment("s", create=True)
        assert not isinstance(caught.value, TruncatedError)


def test_open_after_a_retention_race_replays_from_the_newer_checkpoint(tmp_path, monkeypatch):
    """The retry must not keep the checkpoint it read before the race: retention merged first, and
    the log below that newer checkpoint is gone (the stale one made the retry report damage)."""
    root, options = str(tmp_path / "store"), {"log_rolling_size": 512}
    with SegmentStore.open(root, **options) as store:
        seg = store.segment("s", create=True)
        for i in range(20):
            seg.append([b"r%02d" % i], [(1, i)])
    real_open, raced = AttributeState._open_at_checkpoint, []

    def racing_open(self):
        if not raced:  # the handle under test: another handle appends and applies retention now
            raced.append(1)
            with SegmentStore.open(root, **options) as other:
                seg = other.segment("s")  # its own open is the real one
                for i in range(20, 40):
                    seg.append([b"r%02d" % i], [(1, i)] + ([(2, i)] if i < 30 else []))
                assert seg.apply_retention(max_bytes=600) > 0  # key 2's batches: merged, then deleted
            raise TruncatedError(self.name, 0, 1, 10, 20)  # what its replay then meets
        return real_open(self)

    monkeypatch.setattr(AttributeState, "_open_at_checkpoint", racing_open)
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
    """Found by the fault-history run (two compare-and-sets both succeeded against one value): a
    merge that finds another handle's merge ahead of it rebuilds tier 1 from the log; a read failing
    half-way used to leave tier 1 cleared, so the handle answered, and validated conditions, with
    values older than the log it had already read."""
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
