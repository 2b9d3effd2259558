"""Fault hunt: a local store copied without extended attributes (``cp -r``, ``tar`` without
``--xattrs``) loses every v2 commit record. A chunk holding one append then looked like a chunk
whose first writer died before committing: it was read as empty and the next append reused its
offsets (a silent rollback). Committed v2 chunks now carry a mark in their fence, so the copy is
refused with a clear error, and ``restore_commit_records`` is the explicit recovery.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from attrindex import AttributeIndex, SegmentStore
from attrindex.errors import AttrIndexError
from storage_adapters import RollingSegment, open_storage
from storage_adapters.errors import CorruptDataError
from storage_adapters.local import (COMMIT_SUFFIX, COMMITTED_MARK, read_commit_record, restore_commit_records,
                                    write_commit_record)

CHUNK = "00000000000000000000"


def _copy_without_xattrs(src, dst) -> None:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)  # plain cp -r keeps no xattrs


def test_a_one_append_chunk_copied_without_xattrs_is_refused_not_rolled_back(tmp_path):
    store = SegmentStore.open(str(tmp_path / "a"))
    seg = store.segment("s", create=True)
    seg.append([b"acknowledged"])
    seg.close()
    store.close()
    _copy_without_xattrs(tmp_path / "a", tmp_path / "b")
    chunk = tmp_path / "b" / "s" / "_log.seg" / CHUNK
    assert read_commit_record(str(chunk)) is None  # the copy really lost the record
    copy = SegmentStore.open(str(tmp_path / "b"))
    with pytest.raises(CorruptDataError, match="without extended attributes"):
        copy.segment("s").read(0)  # was: [] and the next append reused offset 0
    copy.close()


def test_a_writer_never_overwrites_a_committed_chunk_that_lost_its_record(tmp_path):
    seg = RollingSegment(open_storage(str(tmp_path / "a")), "s")
    seg.append(b"acknowledged")
    seg.close()
    _copy_without_xattrs(tmp_path / "a", tmp_path / "b")
    storage = open_storage(str(tmp_path / "b"))
    with pytest.raises(CorruptDataError, match="without extended attributes"):
        storage.append(f"s.seg/{CHUNK}", 0, b"overwrite")
    with open(tmp_path / "b" / "s.seg" / CHUNK, "rb") as f:
        assert f.read() == b"acknowledged"


def test_an_uncommitted_first_append_is_still_a_torn_tail(tmp_path):
    """The state the mark tells apart: the first writer of a chunk died before its record."""
    storage = open_storage(str(tmp_path))
    seg = RollingSegment(storage, "s")
    seg.append(b"x")
    seg.close()
    chunk = tmp_path / "s.seg" / CHUNK
    os.removexattr(chunk, "user.attrindex.commit")
    os.unlink(chunk.parent / (CHUNK + COMMIT_SUFFIX) / COMMITTED_MARK)  # died before the mark too
    seg = RollingSegment(storage, "s")
    assert seg.length == 0
    assert seg.append(b"y") == 0 and seg.read(0, 1) == b"y"


def test_restore_commit_records_recovers_the_copy(tmp_path):
    index = AttributeIndex.open(str(tmp_path / "a"), "idx", merge_keys=1000)
    index.update({1: 10})
    index.flush()  # the tree gets one append (a one-append chunk too)
    index.update({2: 20})
    index.close()
    store = SegmentStore.open(str(tmp_path / "a"))
    seg = store.segment("s", create=True)
    for i in range(3):
        seg.append([b"r%d" % i])
    seg.close()
    store.close()
    _copy_without_xattrs(tmp_path / "a", tmp_path / "b")
    with pytest.raises(AttrIndexError):
        AttributeIndex.open(str(tmp_path / "b"), "idx").get(1)
    restored = restore_commit_records(str(tmp_path / "b"))
    assert restored and all(read_commit_record(p) is not None for p in restored)
    copy = AttributeIndex.open(str(tmp_path / "b"), "idx")
    assert (copy.get(1), copy.get(2), copy.get(3)) == (10, 20, None)
    assert copy.verify().ok
    copy.close()
    store = SegmentStore.open(str(tmp_path / "b"))
    seg = store.segment("s")
    assert [r.value for r in seg.read(0)] == [b"r0", b"r1", b"r2"]
    assert seg.append([b"r3"]).first_offset == 3
    seg.close()
    store.close()
    assert restore_commit_records(str(tmp_path / "b")) == []  # nothing left to restore


def test_truncation_deletes_a_marked_fence(tmp_path):
    seg = RollingSegment(open_storage(str(tmp_path)), "s", rolling_size=4)
    for _ in range(3):
        seg.append(b"12345")
    seg.truncate(10)
    seg.close()
    names = sorted(os.listdir(tmp_path / "s.seg"))
    assert CHUNK not in names and CHUNK + COMMIT_SUFFIX not in names


def test_a_reader_racing_a_first_commit_is_not_taken_for_a_lost_record(tmp_path, monkeypatch):
    """The reader finds no record (read just before the first commit), then the mark (made just
    after it): that is the commit landing, not a copy; it gets the new record's size."""
    from storage_adapters import local

    storage = open_storage(str(tmp_path))
    RollingSegment(storage, "s").append(b"first")
    chunk = str(tmp_path / "s.seg" / CHUNK)
    record = read_commit_record(chunk)
    os.removexattr(chunk, "user.attrindex.commit")  # the state before the commit
    real, calls = local._get_record, []

    def commit_lands_after_the_first_look(target):
        calls.append(target)
        if len(calls) == 1:
            return None
        write_commit_record(chunk, record)  # the writer commits, then marks
        return real(target)

    monkeypatch.setattr(local, "_get_record", commit_lands_after_the_first_look)
    assert storage.committed_size(f"s.seg/{CHUNK}") == 5
    assert len(calls) == 2
