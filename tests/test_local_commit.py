"""Local disk commit records: v2 (one xattr, one fsync per append) and v1 (sidecar, two fdatasyncs).

Every crash state of an append is built here, either by killing a child process at each step of the
protocol or by writing the state a crash would leave: torn appends are invisible and overwritten,
acknowledged appends are all there, and damage (a flipped committed byte, a record without its
data) is reported, never taken for a torn tail. Chunks written by the v1 code path still open,
read and take appends.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import subprocess
import sys
import zlib

import pytest

from attrindex import SegmentStore
from attrindex.errors import CorruptDataError
from storage_adapters import RollingSegment, open_storage
from storage_adapters.errors import ChunkExistsError, InvalidInputError, StorageError, StorageFullError
from storage_adapters.local import (
    COMMIT_RECORD_SIZE,
    COMMIT_SUFFIX,
    XATTR_HISTORY,
    LocalChunkStorage,
    decode_commit_record,
    decode_commit_xattr,
    encode_commit_record,
    encode_commit_xattr,
    read_commit_record,
    write_commit_record,
)

CHUNK = "00000000000000000000"
FORMATS = ["xattr", "sidecar"]


def _segment(root, commit_format="xattr", **kwargs) -> RollingSegment:
    return RollingSegment(open_storage(str(root), commit_format=commit_format), "s", **kwargs)


@pytest.fixture(params=FORMATS)
def segment_dir(tmp_path, request):
    seg = _segment(tmp_path, request.param)
    seg.append(b"committed-1;")
    seg.append(b"committed-2;")
    return tmp_path / "s.seg", tmp_path, request.param


# -- the records ---------------------------------------------------------------------------------
def test_v1_commit_record_round_trip_and_rejects_damage():
    record = encode_commit_record(123456789)
    assert len(record) == COMMIT_RECORD_SIZE and decode_commit_record(record) == 123456789
    assert decode_commit_record(record[:-1]) is None
    for i in range(COMMIT_RECORD_SIZE):
        damaged = bytearray(record)
        damaged[i] ^= 0x40
        assert decode_commit_record(bytes(damaged)) is None


def test_v2_commit_record_round_trip_and_rejects_damage():
    record = encode_commit_xattr([300, 200, 100, 0])
    assert decode_commit_xattr(record) == [300, 200, 100, 0]
    assert decode_commit_xattr(encode_commit_xattr([7])) == [7]
    for cut in range(len(record)):
        assert decode_commit_xattr(record[:cut]) is None
    for i in range(len(record)):
        damaged = bytearray(record)
        damaged[i] ^= 0x40
        assert decode_commit_xattr(bytes(damaged)) is None
    assert decode_commit_xattr(encode_commit_xattr([1] * (XATTR_HISTORY + 1))) is None


def test_bad_commit_format_is_refused(tmp_path):
    with pytest.raises(InvalidInputError, match="commit_format"):
        open_storage(str(tmp_path), commit_format="journal")


# -- v2: one fsync ---------------------------------------------------------------------------------
class _Syscalls:
    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in ("fsync", "fdatasync"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._counting(name, real))

    def _counting(self, name, real):
        def call(fd):
            self.calls.append(name)
            return real(fd)
        return call


def test_a_durable_append_to_a_v2_chunk_costs_one_fsync(tmp_path, monkeypatch):
    seg = _segment(tmp_path)
    seg.append(b"first")  # creates the chunk (and fsyncs the directory once)
    syscalls = _Syscalls(monkeypatch)
    for i in range(5):
        seg.append(b"next-%d" % i)
    assert syscalls.calls == ["fsync"] * 5
    chunk = str(tmp_path / "s.seg" / CHUNK)
    assert decode_commit_xattr(read_commit_record(chunk)) == [35, 29, 23, 17]
    assert os.listdir(chunk + COMMIT_SUFFIX) == ["committed"]  # the v1 fence, marked after the first commit


def test_v2_writes_the_data_out_before_it_sets_the_record(tmp_path, monkeypatch):
    """The order the one-sync argument rests on (docs/storage.md): data written, written out to the
    device, then the record, then the only sync."""
    from storage_adapters import local

    seg = _segment(tmp_path)
    seg.append(b"first")
    order = []
    for module, name in ((local, "_write_all"), (local, "_write_out"), (os, "setxattr"), (os, "fsync"), (os, "fdatasync")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real: (order.append(_n), _r(*a))[1])
    seg.append(b"second")
    assert order == ["_write_all", "_write_out", "setxattr", "fsync"]


def test_without_sync_file_range_the_data_is_fdatasynced_before_the_record(tmp_path, monkeypatch):
    from storage_adapters import local

    seg = _segment(tmp_path)
    seg.append(b"first")
    monkeypatch.setattr(local, "_SYNC_FILE_RANGE", lambda *args: (ctypes.set_errno(errno.ENOSYS), -1)[1])
    syscalls = _Syscalls(monkeypatch)
    seg.append(b"second")
    assert syscalls.calls == ["fdatasync", "fsync"]
    monkeypatch.setattr(local, "_SYNC_FILE_RANGE", None)  # not Linux
    seg.append(b"third")
    assert syscalls.calls == ["fdatasync", "fsync"] * 2
    assert _segment(tmp_path).read(0, 16) == b"firstsecondthird"


def test_a_durable_append_to_a_v1_chunk_still_costs_two(tmp_path, monkeypatch):
    seg = _segment(tmp_path, "sidecar")
    seg.append(b"first")
    syscalls = _Syscalls(monkeypatch)
    seg.append(b"next")
    assert syscalls.calls == ["fdatasync", "fdatasync"]
    assert read_commit_record(str(tmp_path / "s.seg" / CHUNK)) is None


def test_sync_false_writes_v1_records_without_any_sync(tmp_path, monkeypatch):
    storage = LocalChunkStorage(str(tmp_path), sync=False)
    seg = RollingSegment(storage, "s")
    seg.append(b"a")
    syscalls = _Syscalls(monkeypatch)
    seg.append(b"bc")
    assert syscalls.calls == []
    assert RollingSegment(open_storage(str(tmp_path)), "s").read(0, 3) == b"abc"
    # v1: a v2 record, committed by the journal within seconds, would run ahead of unsynced data.
    assert os.path.isfile(tmp_path / "s.seg" / (CHUNK + COMMIT_SUFFIX))


def test_a_failed_fsync_takes_the_record_back(tmp_path, monkeypatch):
    seg = _segment(tmp_path)
    seg.append(b"kept;")
    real = os.fsync

    def failing(fd):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(StorageError):
        seg.append(b"lost;")
    monkeypatch.setattr(os, "fsync", real)
    fresh = _segment(tmp_path)
    assert fresh.length == 5
    assert fresh.append(b"next;", expected_offset=5) == 5
    assert _segment(tmp_path).read(0, 10) == b"kept;next;"


def test_a_full_disk_at_the_record_is_storage_full_and_nothing_is_committed(tmp_path, monkeypatch):
    seg = _segment(tmp_path)
    seg.append(b"kept;")

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "setxattr", full)
    with pytest.raises(StorageFullError):
        seg.append(b"lost;")
    monkeypatch.undo()
    assert _segment(tmp_path).length == 5


def test_a_filesystem_without_user_xattrs_gets_v1_chunks(tmp_path, monkeypatch):
    def unsupported(*args):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "getxattr", unsupported)
    monkeypatch.setattr(os, "setxattr", unsupported)
    seg = _segment(tmp_path)
    seg.append(b"one;")
    seg.append(b"two;")
    assert _segment(tmp_path).read(0, 8) == b"one;two;"
    assert os.path.isfile(tmp_path / "s.seg" / (CHUNK + COMMIT_SUFFIX))


def test_the_fence_is_no_file_to_list_and_goes_with_its_chunk(tmp_path):
    seg = _segment(tmp_path, rolling_size=4)
    seg.append(b"abcd")
    seg.append(b"efgh")
    assert sorted(seg.storage.list_files("s.seg")) == [CHUNK, "00000000000000000004"]
    seg.truncate(4)
    seg.append(b"ijkl")  # rolls: the dead first chunk goes, fence and all
    assert sorted(os.listdir(tmp_path / "s.seg")) == [
        ".lock", "00000000000000000004", "00000000000000000004.commit",
        "00000000000000000008", "00000000000000000008.commit", "truncation"]
    # Code that knows only v1 sidecars reads the fence and fails instead of seeing an empty chunk.
    with pytest.raises(IsADirectoryError):
        with open(tmp_path / "s.seg" / ("00000000000000000004" + COMMIT_SUFFIX), "rb") as sidecar:
            sidecar.read(COMMIT_RECORD_SIZE)


# -- crash states, either format -------------------------------------------------------------------
def test_bytes_past_the_commit_are_invisible_and_overwritten(segment_dir):
    directory, root, fmt = segment_dir
    with open(directory / CHUNK, "ab") as chunk:
        chunk.write(b"torn-garbage-from-a-killed-writer")
    seg = _segment(root, fmt)
    assert seg.length == 24
    assert seg.uncommitted_tail() == (24, b"torn-garbage-from-a-killed-writer")
    assert seg.append(b"next;", expected_offset=24) == 24
    assert _segment(root, fmt).read(0, 29) == b"committed-1;committed-2;next;"
    assert os.path.getsize(directory / CHUNK) == 29


def test_new_chunk_without_any_commit_counts_as_empty(tmp_path):
    for fmt in FORMATS:
        root = tmp_path / fmt
        seg = _segment(root, fmt, rolling_size=4)
        seg.append(b"abcd")
        # A writer rolled to a new chunk and died before committing anything to it.
        (root / "s.seg" / "00000000000000000004").write_bytes(b"partial")
        if fmt == "xattr":
            os.mkdir(root / "s.seg" / ("00000000000000000004" + COMMIT_SUFFIX))  # it got as far as the fence
        reopened = _segment(root, fmt, rolling_size=4)
        assert reopened.length == 4
        assert reopened.append(b"efgh", expected_offset=4) == 4
        assert _segment(root, fmt).read(0, 8) == b"abcdefgh"


def test_v1_torn_commit_record_is_ignored(tmp_path):
    seg = _segment(tmp_path, "sidecar")
    seg.append(b"committed-1;")
    seg.append(b"committed-2;")
    commit_path = tmp_path / "s.seg" / (CHUNK + COMMIT_SUFFIX)
    with open(tmp_path / "s.seg" / CHUNK, "ab") as chunk:
        chunk.write(b"in-flight;")
    with open(commit_path, "ab") as commits:
        commits.write(encode_commit_record(34)[:7])  # the process died inside the record write
    seg = _segment(tmp_path)  # a v2 handle keeps the chunk's v1 format
    assert seg.length == 24
    seg.append(b"after;")
    assert _segment(tmp_path).read(0, 30) == b"committed-1;committed-2;after;"
    assert os.path.getsize(commit_path) == 3 * COMMIT_RECORD_SIZE


def test_v1_garbled_last_commit_record_falls_back_to_the_previous_one(tmp_path):
    seg = _segment(tmp_path, "sidecar")
    seg.append(b"committed-1;")
    seg.append(b"committed-2;")
    commit_path = tmp_path / "s.seg" / (CHUNK + COMMIT_SUFFIX)
    raw = bytearray(commit_path.read_bytes())
    raw[-3] ^= 0xFF  # the newest record's checksum no longer matches
    commit_path.write_bytes(bytes(raw))
    seg = _segment(tmp_path)
    assert seg.length == 12
    seg.append(b"redo-2;")
    assert _segment(tmp_path).read(0, 19) == b"committed-1;redo-2;"


def test_v2_garbled_record_commits_nothing_and_the_bytes_stay_for_the_layers_above(tmp_path):
    seg = _segment(tmp_path)
    seg.append(b"committed-1;")
    seg.append(b"committed-2;")
    chunk = str(tmp_path / "s.seg" / CHUNK)
    write_commit_record(chunk, bytes(len(read_commit_record(chunk))))
    seg = _segment(tmp_path)
    assert seg.length == 0
    assert seg.uncommitted_tail() == (0, b"committed-1;committed-2;")  # two whole appends: damage, see test_lost_commits
    with pytest.raises(StorageError, match="committed size is 0"):
        LocalChunkStorage(str(tmp_path))._append(f"s.seg/{CHUNK}", 24, b"x")  # a writer out of step is refused


def test_v2_record_without_its_data_is_damage_reported_on_read(tmp_path):
    """No crash leaves it (the data reaches the device before the record is set, and every journal
    commit that makes the record durable flushes first), so it is reported, never cut away."""
    seg = _segment(tmp_path)
    seg.append(b"committed-1;")
    chunk = str(tmp_path / "s.seg" / CHUNK)
    write_commit_record(chunk, encode_commit_xattr([24, 12]))
    seg = _segment(tmp_path)
    assert seg.length == 24
    with pytest.raises(CorruptDataError, match="shorter than"):
        seg.read(12, 12)


# -- SIGKILL at each step of the v2 protocol ----------------------------------------------------------
_CHILD = r"""
import os, sys
from storage_adapters import RollingSegment, open_storage
from storage_adapters import local

root, step, call = sys.argv[1], sys.argv[2], int(sys.argv[3])
counts = {}

def killing(name, real):
    def wrapped(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        if name == step and counts[name] == call:
            if name == "_write_all":  # die half-way through the data
                fd, data, position = args
                real(fd, data[: len(data) // 2], position)
            os.kill(os.getpid(), 9)
        result = real(*args, **kwargs)
        if step == name + "!" and counts[name] == call:
            os.kill(os.getpid(), 9)
        return result
    return wrapped

for name in ("_write_all", "_write_out"):
    setattr(local, name, killing(name, getattr(local, name)))
os.setxattr = killing("setxattr", os.setxattr)
os.fsync = killing("fsync", os.fsync)
seg = RollingSegment(open_storage(root, commit_format="xattr"), "s", rolling_size=64)
for i in range(1000):
    data = b"<append %04d %s>" % (i, b"x" * (i % 7))
    offset = seg.append(data)
    print(offset, data.decode(), flush=True)
"""

# Every step of an append, killed before it (and after the last one): the data half written, data
# written but not yet out, out but no record, record set but not synced, record synced.
_STEPS = ["_write_all", "_write_out", "setxattr", "fsync", "fsync!"]


@pytest.mark.parametrize("step", _STEPS)
def test_a_writer_killed_at_any_step_loses_no_acknowledged_append(tmp_path, step):
    root = str(tmp_path / "store")
    stored: list[tuple[int, bytes]] = []  # what the segment held after the previous kill
    for call in (1, 2, 3, 5, 9):  # some kills land on a chunk's first append (rolling_size=64)
        child = subprocess.run([sys.executable, "-c", _CHILD, root, step, str(call)],
                               capture_output=True, text=True, timeout=60,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert child.returncode == -9, child.stderr
        acknowledged = [(int(o), d.encode()) for o, d in (line.split(" ", 1) for line in child.stdout.splitlines())]
        seg = _segment(root, rolling_size=64)  # opens without any error: a crash is no damage
        whole = seg.read(0, seg.length)
        appends, offset = [], 0
        for piece in whole.split(b">")[:-1]:
            assert piece.startswith(b"<append ") and set(piece[14:]) <= {ord("x")}, whole  # whole appends only
            appends.append((offset, piece + b">"))
            offset += len(piece) + 1
        assert offset == len(whole)
        expected = stored + acknowledged
        assert appends[:len(expected)] == expected  # every acknowledged append, where it was acknowledged
        assert len(appends) - len(expected) <= 1  # at most the one in flight became visible
        stored = appends


# -- chunks written by the v1 code path ------------------------------------------------------------
def _v1_write(directory, start: int, appends: list[bytes]) -> None:
    """A tiny writer of the v1 format, independent of the code under test: data, then 16-byte
    records ``AIcm | size u64 | crc32`` in ``NAME.commit``."""
    os.makedirs(directory, exist_ok=True)
    name = os.path.join(directory, f"{start:020d}")
    size = 0
    with open(name, "wb") as chunk, open(name + ".commit", "wb") as commits:
        for data in appends:
            chunk.write(data)
            size += len(data)
            body = struct.pack("<4sQ", b"AIcm", size)
            commits.write(body + zlib.crc32(body).to_bytes(4, "little"))


def test_chunks_written_by_v1_open_read_and_take_appends(tmp_path):
    _v1_write(tmp_path / "s.seg", 0, [b"old-1;", b"old-2;"])
    with open(tmp_path / "s.seg" / CHUNK, "ab") as chunk:
        chunk.write(b"torn")  # a v1 writer died before its record
    seg = _segment(tmp_path, rolling_size=16)
    assert seg.length == 12 and seg.read(0, 12) == b"old-1;old-2;"
    seg.append(b"new-3;")  # still v1: the chunk keeps its format
    seg.append(b"new-4;")  # rolls: the new chunk is v2
    reopened = _segment(tmp_path, rolling_size=16)
    assert reopened.read(0, 24) == b"old-1;old-2;new-3;new-4;"
    first, second = str(tmp_path / "s.seg" / CHUNK), str(tmp_path / "s.seg" / "00000000000000000018")
    # Three commits, then the seal (the size repeated) before the roll.
    assert read_commit_record(first) is None and os.path.getsize(first + COMMIT_SUFFIX) == 4 * COMMIT_RECORD_SIZE
    with open(first + COMMIT_SUFFIX, "rb") as commits:
        records = commits.read()
    sizes = [decode_commit_record(records[i:i + COMMIT_RECORD_SIZE]) for i in range(0, len(records), COMMIT_RECORD_SIZE)]
    assert sizes == [6, 12, 18, 18]
    assert decode_commit_xattr(read_commit_record(second)) == [6, 0]


def test_a_segment_store_written_with_v1_chunks_reopens_and_continues(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root, {"commit_format": "sidecar"}) as store:
        seg = store.segment("s", create=True)
        for i in range(5):
            seg.append([b"r%d" % i], [(1, i)])
    with SegmentStore.open(root, create=False) as store:
        seg = store.segment("s")
        assert seg.get_attribute(1) == 4
        assert seg.append([b"r5"], [(1, 5)]).first_offset == 5
    with SegmentStore.open(root, create=False) as store:
        assert [r.value for r in store.segment("s").read(0, 100)] == [b"r%d" % i for i in range(6)]


# -- damage below and at the committed end ------------------------------------------------------------
@pytest.mark.parametrize("which", ["older", "newest"])
def test_a_flipped_committed_byte_is_corruption_even_in_the_newest_append(tmp_path, which):
    """v2 never guesses a crash from a checksum: a flip in the newest append is reported as it was
    with v1 (a design that checked data checksums to find torn appends would roll it back)."""
    root = str(tmp_path / "store")
    with SegmentStore.open(root, {"commit_format": "xattr"}) as store:
        seg = store.segment("s", create=True)
        for i in range(4):
            seg.append([b"record-%d" % i * 8])
    log = tmp_path / "store" / "s" / "_log.seg" / CHUNK
    sizes = decode_commit_xattr(read_commit_record(str(log)))
    at = (sizes[0] + sizes[1]) // 2 if which == "newest" else sizes[-1] // 2 + 1
    raw = bytearray(log.read_bytes())
    raw[at] ^= 0x10
    log.write_bytes(bytes(raw))
    with pytest.raises(CorruptDataError):
        with SegmentStore.open(root, create=False) as store:
            list(store.segment("s").read(0, 100))


def test_only_fences_are_left_out_of_listings_not_directories_named_like_them(tmp_path):
    seg = RollingSegment(open_storage(str(tmp_path)), "a.commit/s")  # a valid name: ".commit" is no suffix of ours
    seg.append(b"abc")
    assert sorted(open_storage(str(tmp_path)).list_files("")) == [
        f"a.commit/s.seg/{CHUNK}"]


def test_a_created_file_appears_whole_to_a_concurrent_reader(tmp_path, monkeypatch):
    """``create`` of index files, markers and replacement chunks: while its bytes are being
    written, the name is not visible to any reader (a short file would read as damage)."""
    import storage_adapters.local as local

    storage = open_storage(str(tmp_path))
    data = os.urandom(1 << 16)
    seen_while_writing = []
    write_all = local._write_all

    def watched(fd, payload, position):
        seen_while_writing.append(storage.list_files("d"))
        write_all(fd, payload, position)
        seen_while_writing.append(storage.list_files("d"))

    monkeypatch.setattr(local, "_write_all", watched)
    storage.create("d/00000000000000000000", data)
    assert seen_while_writing == [{}, {}], "the name was visible before its bytes were complete"
    assert storage.list_files("d") == {"00000000000000000000": len(data)}
    with pytest.raises(ChunkExistsError):
        storage.create("d/00000000000000000000", b"other")
    assert storage.read("d/00000000000000000000", 0, len(data)) == data


def test_a_crash_mid_create_leaves_no_file_under_the_name(tmp_path):
    """A writer killed while creating leaves only a temporary file, which listings skip and a
    later create of the same name does not collide with."""
    storage = open_storage(str(tmp_path))
    os.makedirs(tmp_path / "d")
    (tmp_path / "d" / ".tmp-00000000000000000007.abcdef").write_bytes(b"half")
    assert storage.list_files("d") == {}
    storage.create("d/00000000000000000007", b"whole")
    assert storage.list_files("d") == {"00000000000000000007": 5}


@pytest.mark.parametrize("failing", ["_write_all", "fsync"])
def test_a_create_that_fails_with_a_full_disk_leaves_nothing(tmp_path, monkeypatch, failing):
    """ENOSPC while the bytes are written or synced: ``StorageFullError``, no file under the name,
    no temporary file left, and the same name can be created afterwards."""
    import storage_adapters.local as local

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    storage = open_storage(str(tmp_path))
    with monkeypatch.context() as patch:
        patch.setattr(local, "_write_all", full) if failing == "_write_all" else patch.setattr(local.os, "fsync", full)
        with pytest.raises(StorageFullError):
            storage.create("d/00000000000000000003", b"x" * 100)
    assert storage.list_files("d") == {} and os.listdir(tmp_path / "d") == []
    storage.create("d/00000000000000000003", b"y" * 10)
    assert storage.read("d/00000000000000000003", 0, 10) == b"y" * 10
