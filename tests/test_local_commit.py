"""Local disk: torn appends and torn commit records are invisible, and the next append repairs them."""

from __future__ import annotations

import os

import pytest

from storage_adapters import RollingSegment, open_storage
from storage_adapters.local import COMMIT_RECORD_SIZE, COMMIT_SUFFIX, decode_commit_record, encode_commit_record


@pytest.fixture
def segment_dir(tmp_path):
    seg = RollingSegment(open_storage(str(tmp_path)), "s")
    seg.append(b"committed-1;")
    seg.append(b"committed-2;")
    return tmp_path / "s.seg", tmp_path


def test_commit_record_round_trip_and_rejects_damage():
    record = encode_commit_record(123456789)
    assert len(record) == COMMIT_RECORD_SIZE and decode_commit_record(record) == 123456789
    assert decode_commit_record(record[:-1]) is None
    for i in range(COMMIT_RECORD_SIZE):
        damaged = bytearray(record)
        damaged[i] ^= 0x40
        assert decode_commit_record(bytes(damaged)) is None


def test_bytes_past_the_commit_are_invisible_and_overwritten(segment_dir):
    directory, root = segment_dir
    with open(directory / "00000000000000000000", "ab") as chunk:
        chunk.write(b"torn-garbage-from-a-killed-writer")
    seg = RollingSegment(open_storage(str(root)), "s")
    assert seg.length == 24
    assert seg.append(b"next;", expected_offset=24) == 24
    assert RollingSegment(open_storage(str(root)), "s").read(0, 29) == b"committed-1;committed-2;next;"
    assert os.path.getsize(directory / "00000000000000000000") == 29


def test_torn_commit_record_is_ignored(segment_dir):
    directory, root = segment_dir
    commit_path = directory / ("00000000000000000000" + COMMIT_SUFFIX)
    with open(directory / "00000000000000000000", "ab") as chunk:
        chunk.write(b"in-flight;")
    with open(commit_path, "ab") as commits:
        commits.write(encode_commit_record(34)[:7])  # the process died inside the record write
    seg = RollingSegment(open_storage(str(root)), "s")
    assert seg.length == 24
    seg.append(b"after;")
    assert RollingSegment(open_storage(str(root)), "s").read(0, 30) == b"committed-1;committed-2;after;"
    assert os.path.getsize(commit_path) == 3 * COMMIT_RECORD_SIZE


def test_garbled_last_commit_record_falls_back_to_the_previous_one(segment_dir):
    directory, root = segment_dir
    commit_path = directory / ("00000000000000000000" + COMMIT_SUFFIX)
    raw = bytearray(commit_path.read_bytes())
    raw[-3] ^= 0xFF  # the newest record's checksum no longer matches
    commit_path.write_bytes(bytes(raw))
    seg = RollingSegment(open_storage(str(root)), "s")
    assert seg.length == 12
    seg.append(b"redo-2;")
    assert RollingSegment(open_storage(str(root)), "s").read(0, 19) == b"committed-1;redo-2;"


def test_new_chunk_without_any_commit_counts_as_empty(tmp_path):
    seg = RollingSegment(open_storage(str(tmp_path)), "s", rolling_size=4)
    seg.append(b"abcd")
    # A writer rolled to a new chunk and died before committing anything to it.
    (tmp_path / "s.seg" / "00000000000000000004").write_bytes(b"partial")
    reopened = RollingSegment(open_storage(str(tmp_path)), "s", rolling_size=4)
    assert reopened.length == 4
    assert reopened.append(b"efgh", expected_offset=4) == 4
    assert RollingSegment(open_storage(str(tmp_path)), "s").read(0, 8) == b"abcdefgh"
