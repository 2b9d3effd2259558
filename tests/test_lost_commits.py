"""Lost or damaged commit records (local disk) are damage, never a silent rollback of several writes.

A crash can tear only the newest commit record (each is synced before the next is written), so
losing it rolls back exactly one append, which no one can tell from a crash. Losing more, or two
garbled records at the end, can only be damage: the store must say so, and repair must commit the
data again (it is all there, checksummed).
"""

from __future__ import annotations

import os
import re

import pytest

from attrindex import SegmentStore
from attrindex.tree_index import TreeIndex
from attrindex.errors import CorruptDataError
from storage_adapters.local import drop_commit_records, garble_commit_records


def _last_chunk(root: str, directory: str) -> str:
    found = os.path.join(root, directory)
    return os.path.join(found, max(n for n in os.listdir(found) if re.fullmatch(r"\d{20}", n)))


def _cut_commit_records(chunk: str, records: int) -> None:
    drop_commit_records(chunk, records)  # v2: out of the record's history; v1: off the sidecar


def _garble_commit_records(chunk: str, records: int) -> None:
    garble_commit_records(chunk, records)


def _segment(root: str, appends: int = 20) -> None:
    with SegmentStore.open(root) as store:
        seg = store.segment("s", create=True)
        for i in range(appends):
            seg.append([b"r%d" % i], [(1, i)])


def _index_of_six_versions(tmp_path) -> str:
    """A B+tree whose 40 keys were all set to 0, then 1, ... 5, one update each (a tree alone: the
    write-ahead log of TreeIndex would replay a rolled-back update, see test_index_wal.py)."""
    root = str(tmp_path / "idx")
    with TreeIndex.open(root, page_size=256) as index:
        for version in range(6):
            index.update({key: version for key in range(40)})
    return root


def _records(root: str) -> list[bytes]:
    with SegmentStore.open(root, create=False) as store:
        return [r.value for r in store.segment("s").read(0, 1000)]


def test_one_lost_log_commit_record_is_a_crash_a_one_write_rollback(tmp_path):
    root = str(tmp_path / "store")
    _segment(root, appends=19)
    store = SegmentStore.open(root, create=False)  # like a process killed after its append: no merge
    store.segment("s").append([b"r19"], [(1, 19)])
    _cut_commit_records(_last_chunk(root, "s/_log.seg"), 1)
    assert _records(root) == [b"r%d" % i for i in range(19)]


@pytest.mark.parametrize("damage", [_cut_commit_records, _garble_commit_records])
def test_lost_log_commit_records_are_reported_and_repair_commits_them_again(tmp_path, damage):
    root = str(tmp_path / "store")
    _segment(root)
    damage(_last_chunk(root, "s/_log.seg"), 3)
    with SegmentStore.open(root, create=False) as store:
        with pytest.raises(CorruptDataError, match="commit record"):
            store.segment("s")  # refused: it would answer 3 writes back and reuse their offsets
        assert not store.verify_segment("s").ok
        report = store.repair_segment("s")
        assert report.cut_at is None and not report.lost_offsets
        assert report.recommitted_bytes > 0 or damage is _garble_commit_records
        assert store.verify_segment("s").ok
    assert _records(root) == [b"r%d" % i for i in range(20)]  # nothing lost
    with SegmentStore.open(root, create=False) as store:
        seg = store.segment("s")
        assert seg.get_attribute(1) == 19
        assert seg.append([b"next"]).first_offset == 20


@pytest.mark.parametrize("damage", [_cut_commit_records, _garble_commit_records])
def test_an_open_writer_whose_log_lost_commit_records_under_it_is_told_at_once(tmp_path, damage):
    """The stored end drops below what the handles read as committed. The writer once lost every
    compare-and-append race there (MAX_APPEND_RACES laps, then 'lost the race to other writers')
    and a tail reader waited for records it had read; now the first catch-up of each says what
    happened, nothing is written, and repair keeps every record."""
    root = str(tmp_path / "store")
    with SegmentStore.open(root) as store, SegmentStore.open(root) as other:
        seg = store.segment("s", create=True)
        for i in range(20):
            seg.append([b"r%d" % i], [(1, i)])
        reader = other.segment("s").reader(0)
        assert [reader.read(timeout=1).value for _ in range(20)] == [b"r%d" % i for i in range(20)]
        damage(_last_chunk(root, "s/_log.seg"), 3)
        with pytest.raises(CorruptDataError, match="committed end is byte .* below byte"):
            seg.append([b"lost"], [(1, 99)])
        with pytest.raises(CorruptDataError, match="committed end is byte .* below byte"):
            reader.read(timeout=1)
    with SegmentStore.open(root, create=False) as store:
        assert store.repair_segment("s").cut_at is None
    assert _records(root) == [b"r%d" % i for i in range(20)]  # nothing of the refused append
    with SegmentStore.open(root, create=False) as store:
        seg = store.segment("s")
        assert seg.get_attribute(1) == 19
        assert seg.append([b"next"]).first_offset == 20


def test_lost_index_commit_records_are_reported_and_repair_commits_them_again(tmp_path):
    root = _index_of_six_versions(tmp_path)
    _cut_commit_records(_last_chunk(root, "attributes.seg"), 3)
    with pytest.raises(CorruptDataError, match="commit records were lost"):
        TreeIndex.open(root, mode="r")
    assert not TreeIndex.verify_at(root).ok
    report = TreeIndex.repair_at(root)
    assert report.recommitted_bytes > 0 and not report.rolled_back
    assert TreeIndex.verify_at(root).ok
    with TreeIndex.open(root, mode="r") as index:
        assert index.get_many(list(range(40))) == [5] * 40  # the newest version, whole


def test_one_lost_index_commit_record_rolls_back_one_update(tmp_path):
    root = _index_of_six_versions(tmp_path)
    _cut_commit_records(_last_chunk(root, "attributes.seg"), 1)
    with TreeIndex.open(root, mode="r") as index:
        assert index.get_many(list(range(40))) == [4] * 40


def test_one_lost_log_commit_record_under_merged_attributes_is_damage_and_repair_keeps_everything(tmp_path):
    """A crash cannot lose a commit record that a merge into the B+tree already covered: the tree's
    checkpoint proves the batch was committed, so this is damage (it used to open with the counter
    one ahead of the log and let the next append reuse the lost record's offset)."""
    root = str(tmp_path / "store")
    _segment(root, appends=5)  # closing the store merges every update: checkpoint = the log's end
    _cut_commit_records(_last_chunk(root, "s/_log.seg"), 1)
    with SegmentStore.open(root, create=False) as store:
        with pytest.raises(CorruptDataError, match="commit record"):
            store.segment("s")
        assert not store.verify_segment("s").ok
        report = store.repair_segment("s")
        assert report.recommitted_bytes > 0 and not report.lost_offsets
        assert store.verify_segment("s").ok
    assert _records(root) == [b"r%d" % i for i in range(5)]
    with SegmentStore.open(root, create=False) as store:
        seg = store.segment("s")
        assert seg.get_attribute(1) == 4
        assert seg.append([b"next"]).first_offset == 5


@pytest.mark.parametrize("appends", [1, 2, 3])
def test_a_raw_append_never_overwrites_bytes_a_damaged_record_cannot_account_for(tmp_path, appends):
    """The storage layer is public API: a zeroed commit record reads as 'nothing committed', and
    an append at the start must not write over the acknowledged appends stored there."""
    from storage_adapters import RollingSegment, open_storage

    with open_storage(str(tmp_path)) as storage:
        writer = RollingSegment(storage, "s", rolling_size=1 << 20)
        acknowledged = b"".join(b"append-%d;" % i for i in range(appends))
        for i in range(appends):
            writer.append(b"append-%d;" % i)
        garble_commit_records(os.path.join(str(tmp_path), "s.seg", "0" * 20), 1)
        stale = RollingSegment(storage, "s", rolling_size=1 << 20)  # sees a committed length of 0
        with pytest.raises(CorruptDataError, match="commit record is damaged"):
            stale.append(b"overwrite", expected_offset=stale.length)
        with open(os.path.join(str(tmp_path), "s.seg", "0" * 20), "rb") as f:
            assert f.read() == acknowledged
        stale.append(acknowledged, expected_offset=0)  # the same bytes again (what repair does): accepted
        assert RollingSegment(storage, "s", rolling_size=1 << 20).read(0, len(acknowledged)) == acknowledged
