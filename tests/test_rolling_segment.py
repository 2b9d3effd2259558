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

from .framed import FRAMING, frame, offsets, open_segment, overhead, payloads, pieces


def test_append_returns_offsets_and_reads_back(storage):
    seg = open_segment(storage, "orders")
    hello, world = pieces(storage, [b"hello", b" world"])
    assert (seg.length, seg.start_offset) == (0, 0)
    assert seg.append(hello) == 0
    assert seg.append(world, expected_offset=len(hello)) == len(hello)
    assert seg.length == len(hello + world)
    assert seg.read(0, seg.length) == hello + world
    assert seg.read(3, 4) == (hello + world)[3:7]
    assert seg.read(seg.length, 0) == b""
    assert payloads(storage, seg.read(0, seg.length)) == ([b"hello", b" world"] if storage.torn_appends
                                                          else [b"hello world"])


def test_reopened_handle_sees_everything(storage):
    records = pieces(storage, [b"record-%d;" % i for i in range(10)])
    with open_segment(storage, "orders", rolling_size=8) as seg:
        for record in records:
            seg.append(record)
        expected = b"".join(records)
    reopened = open_segment(storage, "orders")
    assert reopened.length == len(expected)
    assert reopened.read(0, len(expected)) == expected


def test_wrong_expected_offset_raises_and_writes_nothing(storage):
    seg = open_segment(storage, "orders")
    abc, zzz = pieces(storage, [b"abc", b"zzz"])
    seg.append(abc)
    end = len(abc)
    for wrong in (0, end - 1, end + 1, 1000):
        with pytest.raises(BadOffsetError) as caught:
            seg.append(zzz, expected_offset=wrong)
        assert (caught.value.expected_offset, caught.value.actual_offset) == (wrong, end)
        assert "orders" in str(caught.value) and str(wrong) in str(caught.value)
    assert open_segment(storage, "orders").read(0, end) == abc
    assert open_segment(storage, "orders").length == end


def test_stale_handle_loses_the_race_and_catches_up(storage):
    writer, stale = open_segment(storage, "s"), open_segment(storage, "s")
    first, second, third = pieces(storage, [b"first", b"second", b"third"])
    writer.append(first)
    with pytest.raises(BadOffsetError) as caught:
        stale.append(second, expected_offset=stale.length)
    assert caught.value.actual_offset == len(first)
    assert stale.length == len(first)  # the refused append refreshed the handle
    assert stale.append(second, expected_offset=len(first)) == len(first)
    # An unconditional append from a stale handle lands at the end, never over other data.
    assert writer.append(third) == len(first + second)
    assert open_segment(storage, "s").read(0, len(first + second + third)) == first + second + third


def test_refresh_sees_other_handles(storage):
    a, b = open_segment(storage, "s"), open_segment(storage, "s")
    (data,) = pieces(storage, [b"0123456789"])
    a.append(data)
    a.truncate(4)
    assert (b.length, b.start_offset) == (0, 0)
    b.refresh()
    assert (b.length, b.start_offset) == (len(data), 4)


def test_chunks_are_named_by_their_start_offset(storage):
    # 10 bytes of payload per chunk: the framed sizes roll at the same appends as the raw ones.
    seg = open_segment(storage, "orders", rolling_size=10 + overhead(storage))
    stored = pieces(storage, [b"aaaaaa", b"bbbbbb", b"cc", b"dddddddddddd", b"e"])
    for piece in stored:
        seg.append(piece)
    chunks = seg.chunks()
    assert all(c.name == chunk_name(c.start) and len(c.name) == 20 for c in chunks)
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)
    for before, after in zip(chunks, chunks[1:]):
        assert before.end == after.start
    at = offsets(stored)
    if storage.appendable:
        # The active chunk grows until it reaches rolling_size, then a new one starts.
        assert [(c.start, c.end) for c in chunks] == [(at[0], at[2]), (at[2], at[4]), (at[4], at[5])]
        assert [c.length >= seg.rolling_size for c in chunks] == [True, True, False]
    else:
        assert [(c.start, c.end) for c in chunks] == list(zip(at, at[1:]))
    assert sorted(storage.list_files("orders.seg")) == [c.name for c in chunks]
    assert open_segment(storage, "orders").chunks() == chunks


def test_reads_span_chunks(storage):
    seg = open_segment(storage, "s", rolling_size=3)
    source = bytes(range(40))
    stored = pieces(storage, [source[i:i + 4] for i in range(0, 40, 4)])
    for piece in stored:
        seg.append(piece)
    data = b"".join(stored)
    assert len(seg.chunks()) == len(stored)  # every append reaches the rolling size
    for offset in range(0, len(data), 3):
        for length in (0, 1, 5, 13, 40, len(data) - offset):
            length = min(length, len(data) - offset)
            assert seg.read(offset, length) == data[offset:offset + length]


def test_read_past_the_end_is_an_error(storage):
    seg = open_segment(storage, "s")
    (data,) = pieces(storage, [b"12345"])
    seg.append(data)
    end = len(data)
    with pytest.raises(OffsetOutOfRangeError) as caught:
        seg.read(end - 2, 3)
    assert f"[0, {end})" in str(caught.value)
    with pytest.raises(OffsetOutOfRangeError):
        seg.read(end + 1, 0)
    with pytest.raises(OffsetOutOfRangeError):
        open_segment(storage, "empty").read(0, 1)


def test_read_after_another_handle_appended_refreshes(storage):
    reader, writer = open_segment(storage, "s"), open_segment(storage, "s")
    (data,) = pieces(storage, [b"abcdef"])
    writer.append(data)
    assert reader.read(2, 3) == data[2:5]


def test_truncate_deletes_whole_chunks_and_survives_reopen(storage):
    storage.deletion_grace = 0  # objects: dead chunks deleted at once (the default grace: test_s3_requests.py)
    stored = pieces(storage, [b"0000", b"1111", b"2222", b"3333"])
    at = offsets(stored)  # one chunk per append: each reaches the rolling size
    seg = open_segment(storage, "s", rolling_size=len(stored[0]))
    for piece in stored:
        seg.append(piece)
    cut = at[2] + 1
    seg.truncate(cut)
    assert seg.start_offset == cut
    assert [c.start for c in seg.chunks()] == [at[2], at[3]]  # the first two lie wholly below the cut
    assert sorted(storage.list_files("s.seg")) == [chunk_name(at[2]), chunk_name(at[3]), "truncation/" + chunk_name(cut)]
    with pytest.raises(TruncatedError) as caught:
        seg.read(at[2], 2)
    assert caught.value.start_offset == cut and "truncated" in str(caught.value)
    data = b"".join(stored)
    assert seg.read(cut, at[4] - cut) == data[cut:]
    reopened = open_segment(storage, "s")
    assert (reopened.start_offset, reopened.length) == (cut, at[4])
    with pytest.raises(TruncatedError):
        reopened.read(0, 1)
    # The truncation offset only moves forward.
    reopened.truncate(3)
    assert open_segment(storage, "s").start_offset == cut


def test_truncate_to_the_end_keeps_the_last_chunk_until_the_next_append(storage):
    stored = pieces(storage, [b"ab", b"cd", b"ef"])
    at = offsets(stored)
    seg = open_segment(storage, "s", rolling_size=len(stored[0]))
    seg.append(stored[0])
    seg.append(stored[1])
    seg.truncate(at[2])
    assert [c.start for c in seg.chunks()] == [at[1]]  # holds the length
    assert open_segment(storage, "s").length == at[2]
    assert seg.append(stored[2], expected_offset=at[2]) == at[2]
    assert [c.start for c in open_segment(storage, "s").chunks()] == [at[2]]
    assert seg.read(at[2], len(stored[2])) == stored[2]


def test_truncate_beyond_the_end_is_an_error(storage):
    seg = open_segment(storage, "s")
    (data,) = pieces(storage, [b"abc"])
    seg.append(data)
    with pytest.raises(OffsetOutOfRangeError):
        seg.truncate(len(data) + 1)
    assert open_segment(storage, "s").start_offset == 0


def test_reader_behind_a_truncation_gets_truncated_error(storage):
    storage.deletion_grace = 0  # objects: dead chunks deleted at once (the default grace: test_s3_requests.py)
    stored = pieces(storage, [b"aa", b"bb", b"cc"])
    at = offsets(stored)
    size = len(stored[0])
    reader, owner = open_segment(storage, "s", rolling_size=size), open_segment(storage, "s", rolling_size=size)
    for piece in stored:
        owner.append(piece)
    reader.refresh()
    owner.truncate(at[2])
    with pytest.raises(TruncatedError):
        reader.read(0, 2)  # its chunk is gone; the reader learns the new start offset
    assert reader.start_offset == at[2]


def test_delete_removes_every_chunk(storage):
    stored = pieces(storage, [b"aa", b"bb", b"cc"])
    seg = open_segment(storage, "s", rolling_size=len(stored[0]))
    for piece in stored:
        seg.append(piece)
    seg.truncate(3)
    other = open_segment(storage, "s/inner")  # a segment nested under the name survives
    (keep,) = pieces(storage, [b"keep"])
    other.append(keep)
    seg.delete()
    assert storage.list_files("s.seg") == {}
    assert (seg.length, seg.start_offset) == (0, 0)
    assert open_segment(storage, "s").length == 0
    assert open_segment(storage, "s/inner").read(0, len(keep)) == keep


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
    stored = pieces(storage, [b"aa", b"bb", b"cc", b"dd"])
    at = offsets(stored)
    size = len(stored[0])
    stale, owner = open_segment(storage, "s", rolling_size=size), open_segment(storage, "s", rolling_size=size)
    owner.append(stored[0])
    stale.refresh()  # stale believes the segment ends after the first append
    owner.append(stored[1])
    owner.append(stored[2])
    owner.truncate(at[3])  # the chunk of the second append is deleted: its name is free again
    with pytest.raises(BadOffsetError) as caught:
        stale.append(frame(storage, b"XX", at[1]), expected_offset=at[1])
    assert caught.value.actual_offset == at[3]
    assert stale.append(stored[3]) == at[3]  # an unconditional append retries at the true end
    fresh = open_segment(storage, "s")
    assert (fresh.start_offset, fresh.length) == (at[3], at[4]) and fresh.read(at[3], size) == stored[3]
    assert [c.start for c in fresh.chunks()] == [at[3]]  # the dead chunk before it went with the append


def test_storage_read_clamps_a_range_past_the_end(storage):
    """Reading [start, huge) gives the bytes there are, without allocating the range."""
    storage.create("f/x", b"0123456789")
    assert storage.read("f/x", 4, 1 << 40) == b"456789"
    assert storage.read("f/x", 12, 1 << 40) == b""
    with pytest.raises(FileNotFoundError):
        storage.read("f/missing", 0, 1 << 40)


# -- reads and views that hold under damage and concurrency --------------------------------
def test_a_sealed_chunk_file_shorter_than_its_successor_says_is_corrupt_data(tmp_path):
    """A chunk with a successor ends where the successor starts: a file cut shorter behind the
    segment's back (its frames are not read: only the last chunk's end is looked for) is damage
    a read reports, never a short answer."""
    storage = open_storage(str(tmp_path))
    stored = pieces(storage, [b"record%d;" % i for i in range(4)])
    at = offsets(stored)
    seg = open_segment(storage, "s", rolling_size=len(stored[0]))
    for piece in stored:
        seg.append(piece)
    victim = seg.chunks()[2]
    assert (victim.start, victim.end) == (at[2], at[3])
    os.truncate(tmp_path / "s.seg" / victim.name, 3)  # lost its tail
    assert seg.read(0, at[2]) == stored[0] + stored[1]
    for offset, length in ((at[2], 8), (at[2] - 4, 10), (at[2] + 3, 1), (at[2] + 4, 2)):
        missing = max(offset, at[2] + 3)  # the first byte the read wanted that the file lacks
        with pytest.raises(errors.CorruptDataError, match=f"chunk {victim.name}.*byte {missing - at[2]}") as caught:
            seg.read(offset, length)
        assert caught.value.segment == "s" and caught.value.offset == missing


@pytest.mark.parametrize("kept", [False, True])
def test_a_last_chunk_cut_inside_a_frame_is_damage_unless_a_crash_could_leave_it(tmp_path, kept):
    """The last chunk's end is the end of its chain of whole, valid frames, and a prefix of a frame
    after it is a torn write, cut, when the file goes on for what the storage keeps after the
    chain's end (``zeros_kept_after``): a crash never shortens the file. A file cut inside its last
    frame (behind the segment's back) is shorter than that: damage, inside the end, so the layers
    above meet it where they read it."""
    storage = open_storage(str(tmp_path))
    stored = pieces(storage, [b"record%d;" % i for i in range(3)])
    at = offsets(stored)
    seg = open_segment(storage, "s")
    for piece in stored:
        seg.append(piece)
    path = tmp_path / "s.seg" / seg.chunks()[-1].name
    os.truncate(path, at[3] - 1)
    if kept:
        os.truncate(path, at[2] + storage.zeros_kept_after(at[2]))  # what a torn write leaves
    fresh = open_segment(storage, "s")
    if kept:
        assert fresh.length == at[2] and fresh.torn_tail == (at[2], stored[2][:-1])
        assert payloads(storage, fresh.read(0, fresh.length)) == [b"record0;", b"record1;"]
        with pytest.raises(OffsetOutOfRangeError):
            fresh.read(at[2], 1)
    else:
        assert fresh.length == at[3] - 1 and fresh.torn_tail is None
        assert FRAMING.chain_end(fresh.read(0, fresh.length), 0) == at[2]  # the damage, where it lies


def test_refresh_and_read_stay_consistent_under_concurrent_append_and_truncate(tmp_path):
    """Another process appends and truncates with tiny chunks; this one refreshes and reads."""
    from . import storage_workers

    root, rolling_size, seconds = str(tmp_path), 64, 3.0
    storage = open_storage(root)
    expected = storage_workers.Stream(storage)
    open_segment(storage, "s", rolling_size=rolling_size).append(expected.piece(0, 0))
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.storage_workers", "churn", root, "s", str(seconds), str(rolling_size)],
        cwd=os.path.dirname(os.path.dirname(__file__)), stdout=subprocess.PIPE,
    )
    seg = open_segment(storage, "s")
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
                assert seg.read(offset, size) == expected.read(offset, size)
                reads += 1
            except TruncatedError:
                truncated += 1
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0
    assert views > 50 and reads > 10, (views, reads, truncated)
    print(f"views={views} reads={reads} truncated={truncated}")
