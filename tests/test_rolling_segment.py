"""RollingSegment behaviour on every backend (memory, local disk, S3 through moto's server)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from attrindex import errors
from storage_adapters import (
    BadOffsetError,
    ChunkInfo,
    InvalidInputError,
    OffsetOutOfRangeError,
    RollingSegment,
    StorageError,
    TruncatedError,
    chunk_name,
    open_storage,
)


def test_append_returns_offsets_and_reads_back(storage):
    seg = RollingSegment(storage, "orders")
    assert (seg.length, seg.start_offset) == (0, 0)
    assert seg.append(b"hello") == 0
    assert seg.append(b" world", expected_offset=5) == 5
    assert seg.length == 11
    assert seg.read(0, 11) == b"hello world"
    assert seg.read(3, 4) == b"lo w"
    assert seg.read(11, 0) == b""


def test_reopened_handle_sees_everything(storage):
    with RollingSegment(storage, "orders", rolling_size=8) as seg:
        for i in range(10):
            seg.append(b"record-%d;" % i)
        expected = b"".join(b"record-%d;" % i for i in range(10))
    reopened = RollingSegment(storage, "orders")
    assert reopened.length == len(expected)
    assert reopened.read(0, len(expected)) == expected


def test_wrong_expected_offset_raises_and_writes_nothing(storage):
    seg = RollingSegment(storage, "orders")
    seg.append(b"abc")
    for wrong in (0, 2, 4, 1000):
        with pytest.raises(BadOffsetError) as caught:
            seg.append(b"zzz", expected_offset=wrong)
        assert (caught.value.expected_offset, caught.value.actual_offset) == (wrong, 3)
        assert "orders" in str(caught.value) and str(wrong) in str(caught.value)
    assert RollingSegment(storage, "orders").read(0, 3) == b"abc"
    assert RollingSegment(storage, "orders").length == 3


def test_stale_handle_loses_the_race_and_catches_up(storage):
    writer, stale = RollingSegment(storage, "s"), RollingSegment(storage, "s")
    writer.append(b"first")
    with pytest.raises(BadOffsetError) as caught:
        stale.append(b"second", expected_offset=stale.length)
    assert caught.value.actual_offset == 5
    assert stale.length == 5  # the refused append refreshed the handle
    assert stale.append(b"second", expected_offset=5) == 5
    # An unconditional append from a stale handle lands at the end, never over other data.
    assert writer.append(b"third") == 11
    assert RollingSegment(storage, "s").read(0, 16) == b"firstsecondthird"


def test_refresh_sees_other_handles(storage):
    a, b = RollingSegment(storage, "s"), RollingSegment(storage, "s")
    a.append(b"0123456789")
    a.truncate(4)
    assert (b.length, b.start_offset) == (0, 0)
    b.refresh()
    assert (b.length, b.start_offset) == (10, 4)


def test_chunks_are_named_by_their_start_offset(storage):
    seg = RollingSegment(storage, "orders", rolling_size=10)
    for piece in (b"aaaaaa", b"bbbbbb", b"cc", b"dddddddddddd", b"e"):
        seg.append(piece)
    chunks = seg.chunks()
    assert all(c.name == chunk_name(c.start) and len(c.name) == 20 for c in chunks)
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)
    for before, after in zip(chunks, chunks[1:]):
        assert before.end == after.start
    if storage.appendable:
        # The active chunk grows until it reaches rolling_size, then a new one starts.
        assert [(c.start, c.length) for c in chunks] == [(0, 12), (12, 14), (26, 1)]
    else:
        assert [(c.start, c.length) for c in chunks] == [(0, 6), (6, 6), (12, 2), (14, 12), (26, 1)]
    stored = storage.list_files("orders.seg")
    assert sorted(stored) == [c.name for c in chunks]
    assert RollingSegment(storage, "orders").chunks() == chunks


def test_reads_span_chunks(storage):
    seg = RollingSegment(storage, "s", rolling_size=3)
    data = bytes(range(40))
    for i in range(0, 40, 4):
        seg.append(data[i:i + 4])
    for offset in range(0, 40, 3):
        for length in (0, 1, 5, 13, 40 - offset):
            length = min(length, 40 - offset)
            assert seg.read(offset, length) == data[offset:offset + length]


def test_read_past_the_end_is_an_error(storage):
    seg = RollingSegment(storage, "s")
    seg.append(b"12345")
    with pytest.raises(OffsetOutOfRangeError) as caught:
        seg.read(3, 3)
    assert "[0, 5)" in str(caught.value)
    with pytest.raises(OffsetOutOfRangeError):
        seg.read(6, 0)
    with pytest.raises(OffsetOutOfRangeError):
        RollingSegment(storage, "empty").read(0, 1)


def test_read_after_another_handle_appended_refreshes(storage):
    reader, writer = RollingSegment(storage, "s"), RollingSegment(storage, "s")
    writer.append(b"abcdef")
    assert reader.read(2, 3) == b"cde"


def test_truncate_deletes_whole_chunks_and_survives_reopen(storage):
    storage.deletion_grace = 0  # objects: dead chunks deleted at once (the default grace: test_s3_requests.py)
    seg = RollingSegment(storage, "s", rolling_size=4)
    for piece in (b"0000", b"1111", b"2222", b"3333"):
        seg.append(piece)
    seg.truncate(9)
    assert seg.start_offset == 9
    assert [c.start for c in seg.chunks()] == [8, 12]  # [0,4) and [4,8) lie wholly below 9
    assert sorted(storage.list_files("s.seg")) == [chunk_name(8), chunk_name(12), "truncation/" + chunk_name(9)]
    with pytest.raises(TruncatedError) as caught:
        seg.read(8, 2)
    assert caught.value.start_offset == 9 and "truncated" in str(caught.value)
    assert seg.read(9, 7) == b"2223333"
    reopened = RollingSegment(storage, "s")
    assert (reopened.start_offset, reopened.length) == (9, 16)
    with pytest.raises(TruncatedError):
        reopened.read(0, 1)
    # The truncation offset only moves forward.
    reopened.truncate(3)
    assert RollingSegment(storage, "s").start_offset == 9


def test_truncate_to_the_end_keeps_the_last_chunk_until_the_next_append(storage):
    seg = RollingSegment(storage, "s", rolling_size=2)
    seg.append(b"ab")
    seg.append(b"cd")
    seg.truncate(4)
    assert [c.start for c in seg.chunks()] == [2]  # holds the length
    assert RollingSegment(storage, "s").length == 4
    assert seg.append(b"ef", expected_offset=4) == 4
    assert [c.start for c in RollingSegment(storage, "s").chunks()] == [4]
    assert seg.read(4, 2) == b"ef"


def test_truncate_beyond_the_end_is_an_error(storage):
    seg = RollingSegment(storage, "s")
    seg.append(b"abc")
    with pytest.raises(OffsetOutOfRangeError):
        seg.truncate(4)
    assert RollingSegment(storage, "s").start_offset == 0


def test_reader_behind_a_truncation_gets_truncated_error(storage):
    storage.deletion_grace = 0  # objects: dead chunks deleted at once (the default grace: test_s3_requests.py)
    reader, owner = RollingSegment(storage, "s", rolling_size=2), RollingSegment(storage, "s", rolling_size=2)
    for piece in (b"aa", b"bb", b"cc"):
        owner.append(piece)
    reader.refresh()
    owner.truncate(4)
    with pytest.raises(TruncatedError):
        reader.read(0, 2)  # its chunk is gone; the reader learns the new start offset
    assert reader.start_offset == 4


def test_delete_removes_every_chunk(storage):
    seg = RollingSegment(storage, "s", rolling_size=2)
    for piece in (b"aa", b"bb", b"cc"):
        seg.append(piece)
    seg.truncate(3)
    other = RollingSegment(storage, "s/inner")  # a segment nested under the name survives
    other.append(b"keep")
    seg.delete()
    assert storage.list_files("s.seg") == {}
    assert (seg.length, seg.start_offset) == (0, 0)
    assert RollingSegment(storage, "s").length == 0
    assert RollingSegment(storage, "s/inner").read(0, 4) == b"keep"


def test_closed_handle_refuses_work(storage):
    with RollingSegment(storage, "s") as seg:
        seg.append(b"x")
    with pytest.raises(StorageError, match="closed"):
        seg.append(b"y")


@pytest.mark.parametrize(
    "call",
    [
        lambda seg: seg.append(b""),
        lambda seg: seg.append("text"),
        lambda seg: seg.append(b"x", expected_offset=-1),
        lambda seg: seg.read(-1, 1),
        lambda seg: seg.read(0, -1),
        lambda seg: seg.truncate(-5),
    ],
)
def test_bad_arguments_are_value_errors(call):
    seg = RollingSegment(open_storage("memory://bad-args"), "s")
    with pytest.raises(InvalidInputError) as caught:
        call(seg)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("name", ["", ".hidden", "a//b", "a/", "x.seg", "a/b.seg/c", "sp ace", "a/../b", "tab\t"])
def test_bad_segment_names(name):
    with pytest.raises(InvalidInputError, match="segment name"):
        RollingSegment(open_storage("memory://names"), name)


@pytest.mark.parametrize("size", [0, -1, 1.5, None])
def test_bad_rolling_size(size):
    with pytest.raises(InvalidInputError, match="rolling_size"):
        RollingSegment(open_storage("memory://names"), "s", rolling_size=size)


def test_chunk_info_end():
    assert ChunkInfo(10, 5, chunk_name(10)).end == 15


def test_errors_module_reexports_storage_errors():
    assert errors.BadOffsetError is BadOffsetError
    assert issubclass(errors.StorageError, errors.AttrIndexError)
    for name in ("BadOffsetError", "TruncatedError", "ChunkExistsError", "CorruptDataError"):
        assert issubclass(getattr(errors, name), errors.StorageError)
    for name in ("InvalidInputError", "InvalidKeyError", "InvalidValueError", "UnsupportedSchemeError"):
        assert issubclass(getattr(errors, name), ValueError)


def test_stale_handle_cannot_resurrect_a_truncated_chunk(storage):
    stale, owner = RollingSegment(storage, "s", rolling_size=2), RollingSegment(storage, "s", rolling_size=2)
    owner.append(b"aa")
    stale.refresh()  # stale believes the segment ends at 2
    owner.append(b"bb")
    owner.append(b"cc")
    owner.truncate(6)  # the chunk starting at 2 is deleted: its name is free again
    with pytest.raises(BadOffsetError) as caught:
        stale.append(b"XX", expected_offset=2)
    assert caught.value.actual_offset == 6
    assert stale.append(b"dd") == 6  # an unconditional append retries at the true end
    fresh = RollingSegment(storage, "s")
    assert (fresh.start_offset, fresh.length) == (6, 8) and fresh.read(6, 2) == b"dd"
    assert [c.start for c in fresh.chunks()] == [6]  # the dead chunk at 4 went with the append


def test_storage_read_clamps_a_range_past_the_end(storage):
    """Reading [start, huge) gives the bytes there are, without allocating the range."""
    storage.create("f/x", b"0123456789")
    assert storage.read("f/x", 4, 1 << 40) == b"456789"
    assert storage.read("f/x", 12, 1 << 40) == b""
    with pytest.raises(FileNotFoundError):
        storage.read("f/missing", 0, 1 << 40)


# -- reads and views that hold under damage and concurrency (issue 10, classes 6 and 7) --
def test_a_chunk_file_shorter_than_committed_is_corrupt_data(tmp_path):
    storage = open_storage(str(tmp_path))
    seg = RollingSegment(storage, "s", rolling_size=8)
    for i in range(4):
        seg.append(b"record%d;" % i)
    os.truncate(tmp_path / "s.seg" / chunk_name(16), 3)  # lost its tail behind the commit record's back
    assert seg.read(0, 16) == b"record0;record1;"
    for offset, length in ((16, 8), (12, 10), (19, 1), (20, 2)):
        missing = max(offset, 19)  # the first byte the read wanted that the file lacks
        with pytest.raises(errors.CorruptDataError, match=f"chunk {chunk_name(16)}.*byte {missing - 16}") as caught:
            seg.read(offset, length)
        assert caught.value.segment == "s" and caught.value.offset == missing


def test_refresh_and_read_stay_consistent_under_concurrent_append_and_truncate(tmp_path):
    """Another process appends and truncates with tiny chunks; this one refreshes and reads."""
    from . import storage_workers

    root, rolling_size, seconds = str(tmp_path), 64, 3.0
    RollingSegment(open_storage(root), "s", rolling_size=rolling_size).append(storage_workers.pattern(0, 10))
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.storage_workers", "churn", root, "s", str(seconds), str(rolling_size)],
        cwd=os.path.dirname(os.path.dirname(__file__)), stdout=subprocess.PIPE,
    )
    seg = RollingSegment(open_storage(root), "s")
    views = reads = truncated = 0
    previous = 0
    try:
        while child.poll() is None:
            seg.refresh()
            chunks, start, length = seg.chunks(), seg.start_offset, seg.length
            assert start <= length and length >= previous, (start, length, previous)
            assert all(a.end == b.start for a, b in zip(chunks, chunks[1:])), chunks
            assert not chunks or chunks[0].start <= start, (chunks[0], start)
            previous, views = length, views + 1
            offset, size = start, min(length - start, 200)  # the oldest bytes: the next to be truncated
            try:
                assert seg.read(offset, size) == storage_workers.pattern(offset, size)
                reads += 1
            except TruncatedError:
                truncated += 1
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0
    assert views > 50 and reads > 10, (views, reads, truncated)
    print(f"views={views} reads={reads} truncated={truncated}")
