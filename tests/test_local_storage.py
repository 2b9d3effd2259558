"""Local-disk chunk storage: one write and one ``fdatasync`` per durable append, no commit record.

The committed end of a chunk is the end of its chain of frames (tail.py), so every crash state of
an append is built here by writing what a crash would leave (a prefix of the append's bytes) or by
killing a child process mid-append: torn writes are cut and zeroed by the next append, acknowledged
appends are all there, damage before a valid frame is reported. ``create`` makes a file appear
whole or not at all, and the temporaries of creates that died are swept once they are older than
``TEMP_MAX_AGE_SECONDS``. A store in the formats with commit records is refused.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from attrindex import SegmentStore
from attrindex.errors import CorruptDataError
from storage_adapters import RollingSegment, local, open_storage
from storage_adapters.errors import ChunkExistsError, OutcomeUnknownError, StorageError, StorageFullError
from storage_adapters.framing import LengthChecksumFraming
from storage_adapters.local import MIN_PREWRITE_BYTES, PREWRITE_BYTES

CHUNK = "00000000000000000000"
FRAMING = LengthChecksumFraming()
frame = FRAMING.frame


def _segment(root, *, sync: bool = True, **kwargs) -> RollingSegment:
    return RollingSegment(open_storage(str(root), sync=sync), "s", framing=FRAMING, **kwargs)


def _chunk(root, name=CHUNK) -> str:
    return os.path.join(str(root), "s.seg", name)


def _payloads(seg: RollingSegment) -> list[bytes]:
    return FRAMING.payloads(seg.read(seg.start_offset, seg.length - seg.start_offset))


# -- one write, one sync -----------------------------------------------------------------------
def _count_syncs(monkeypatch):
    import storage_adapters.local as local

    calls = {"fdatasync": 0, "fsync": 0, "pwrite": 0}
    for name in ("fdatasync", "fsync", "pwrite"):
        real = getattr(os, name)

        def counted(*args, _name=name, _real=real):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(local.os, name, counted)
    return calls


def test_a_durable_append_costs_one_write_and_one_fdatasync(tmp_path, monkeypatch):
    seg = _segment(tmp_path)
    seg.append(frame(b"first"))  # creates the chunk (and pre-writes zeros)
    calls = _count_syncs(monkeypatch)
    for i in range(20):
        seg.append(frame(b"x" * 40), expected_offset=seg.length)
    assert calls == {"fdatasync": 20, "fsync": 0, "pwrite": 20}


def test_zeros_are_pre_written_ahead_of_the_end_and_a_full_chunk_is_trimmed_to_it(tmp_path):
    seg = _segment(tmp_path, rolling_size=4 * MIN_PREWRITE_BYTES)
    seg.append(frame(b"a" * 100))
    assert os.path.getsize(_chunk(tmp_path)) >= MIN_PREWRITE_BYTES  # a small segment stays small
    with open(_chunk(tmp_path), "rb") as f:
        assert not f.read()[seg.length:].strip(b"\0")
    while len(seg.chunks()) == 1:
        seg.append(frame(b"b" * 1000))
    first = seg.chunks()[0]
    assert os.path.getsize(_chunk(tmp_path)) == first.length  # trimmed before its successor was made
    assert os.path.getsize(_chunk(tmp_path, seg.chunks()[1].name)) >= MIN_PREWRITE_BYTES
    assert PREWRITE_BYTES >= MIN_PREWRITE_BYTES


def test_without_sync_nothing_is_synced(tmp_path, monkeypatch):
    seg = _segment(tmp_path, sync=False)
    calls = _count_syncs(monkeypatch)
    for i in range(5):
        seg.append(frame(b"y" * 10))
    assert calls["fdatasync"] == calls["fsync"] == 0
    assert _payloads(_segment(tmp_path, sync=False)) == [b"y" * 10] * 5
    assert os.path.getsize(_chunk(tmp_path)) >= MIN_PREWRITE_BYTES  # zeros ahead: no writer rolled past it


def test_a_failed_fdatasync_takes_the_bytes_back_and_the_next_append_works(tmp_path, monkeypatch):
    import storage_adapters.local as local

    seg = _segment(tmp_path)
    seg.append(frame(b"kept"))
    real = os.fdatasync

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local.os, "fdatasync", failing)
    with pytest.raises(StorageError) as caught:
        seg.append(frame(b"lost"))
    assert not isinstance(caught.value, OutcomeUnknownError)
    monkeypatch.setattr(local.os, "fdatasync", real)
    again = _segment(tmp_path)
    assert _payloads(again) == [b"kept"]  # the bytes whose sync failed were zeroed: not committed
    again.append(frame(b"next"))
    assert _payloads(_segment(tmp_path)) == [b"kept", b"next"]


def test_a_full_disk_at_an_append_commits_nothing_and_the_next_append_works(tmp_path, monkeypatch):
    import storage_adapters.local as local

    seg = _segment(tmp_path)
    seg.append(frame(b"kept"))
    real = local._write_all

    def full(fd, data, position):
        real(fd, data[: len(data) // 2], position)  # part written, then the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "_write_all", full)
    with pytest.raises(StorageFullError):
        seg.append(frame(b"z" * 200))
    monkeypatch.setattr(local, "_write_all", real)
    assert _payloads(_segment(tmp_path)) == [b"kept"]
    seg.append(frame(b"after"))
    assert _payloads(_segment(tmp_path)) == [b"kept", b"after"]


# -- torn writes and damage ----------------------------------------------------------------------
@pytest.mark.parametrize("cut", [1, 7, 19, 20, 21, 40, 63])
def test_a_torn_write_is_cut_with_a_warning_and_zeroed_by_the_next_append(tmp_path, cut, caplog):
    seg = _segment(tmp_path)
    seg.append(frame(b"one"))
    end = seg.length
    torn = FRAMING.place(frame(b"t" * 44), end)[:cut]  # what a writer killed mid-append leaves
    with open(_chunk(tmp_path), "r+b") as f:
        f.seek(end)
        f.write(torn)
    reopened = _segment(tmp_path)
    assert reopened.length == end and _payloads(reopened) == [b"one"]
    assert reopened.torn_tail == (end, torn.rstrip(b"\0"))
    with caplog.at_level("WARNING", logger="attrindex.storage"):
        reopened.append(frame(b"x"))
    assert "torn write" in caplog.text
    with open(_chunk(tmp_path), "rb") as f:
        stored = f.read()
    assert not stored[reopened.length:].strip(b"\0")  # nothing stale follows the new frames
    assert _payloads(_segment(tmp_path)) == [b"one", b"x"]


def test_a_handle_that_only_reads_says_what_a_torn_write_left_and_cuts_nothing(tmp_path, caplog):
    seg = _segment(tmp_path)
    seg.append(frame(b"one"))
    end = seg.length
    torn = FRAMING.place(frame(b"t" * 44), end)[:30]
    with open(_chunk(tmp_path), "r+b") as f:
        f.seek(end)
        f.write(torn)
        f.seek(0)
        before = f.read()
    with caplog.at_level("WARNING", logger="attrindex.storage"):
        reader = _segment(tmp_path)
        reader.refresh()
        reader.poll()
    found = [r.getMessage() for r in caplog.records if "torn write" in r.getMessage()]
    assert len(found) == 1 and f"found 30 bytes of a torn write at position {end}" in found[0], found
    assert reader.length == end and _payloads(reader) == [b"one"]
    with open(_chunk(tmp_path), "rb") as f:
        assert f.read() == before  # nothing cut: only an append into the chunk cuts


def test_a_reader_calls_bytes_past_the_end_a_torn_write_only_once_no_writer_can_be_appending(tmp_path, caplog,
                                                                                           monkeypatch):
    """A crash leaves the same bytes past the committed end as a writer's append in progress
    shows to another handle. While a writer holds the directory's lock a reader says so at DEBUG
    only; once the lock is free, a second look tells an append that finished meanwhile (nothing
    to say) from a write a crash tore (a WARNING)."""
    seg = _segment(tmp_path)
    seg.append(frame(b"one"))
    end = seg.length
    whole = FRAMING.place(frame(b"t" * 44), end)
    with open(_chunk(tmp_path), "r+b") as f:
        f.seek(end)
        f.write(whole[:30])
    writer_storage = open_storage(str(tmp_path))
    with caplog.at_level("DEBUG", logger="attrindex.storage"):
        with writer_storage.lock("s.seg"):  # a writer in the middle of its append
            _segment(tmp_path).refresh()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("append in progress" in r.getMessage() for r in caplog.records)

    caplog.clear()
    finish = local.LocalChunkStorage.lock_is_held

    def finished_meanwhile(storage, directory):  # the writer's append lands just as the lock is free
        with open(_chunk(tmp_path), "r+b") as f:
            f.seek(end)
            f.write(whole)
        return finish(storage, directory)

    with monkeypatch.context() as patched, caplog.at_level("WARNING", logger="attrindex.storage"):
        patched.setattr(local.LocalChunkStorage, "lock_is_held", finished_meanwhile)
        _segment(tmp_path).refresh()
    assert not caplog.records
    assert _payloads(_segment(tmp_path)) == [b"one", b"t" * 44]

    with open(_chunk(tmp_path), "r+b") as f:  # a crash tore the next one: no writer holds the lock
        f.seek(end + len(whole))
        f.write(FRAMING.place(frame(b"u" * 44), end + len(whole))[:30])
    with caplog.at_level("WARNING", logger="attrindex.storage"):
        _segment(tmp_path).refresh()
    assert any(f"found 30 bytes of a torn write at position {end + len(whole)}" in r.getMessage()
               for r in caplog.records)


def test_damage_before_a_valid_frame_is_reported_not_cut(tmp_path):
    seg = _segment(tmp_path)
    for payload in (b"a" * 30, b"b" * 30, b"c" * 30):
        seg.append(frame(payload))
    with open(_chunk(tmp_path), "r+b") as f:
        f.seek(60)
        f.write(b"\xff")
    damaged = _segment(tmp_path)
    assert damaged.length == seg.length  # not rolled back to the damage
    assert FRAMING.chain_end(damaged.read(0, damaged.length), 0) < damaged.length  # the layers above see it


def _log_with_a_torn_batch(tmp_path, cut: int) -> tuple[SegmentStore, int]:
    """A segment of five records whose next batch (three records) was torn after ``cut`` bytes;
    the bytes are those the append really writes (made on a copy of the store)."""
    import shutil

    src, copy = str(tmp_path / "src"), str(tmp_path / "copy")
    store = SegmentStore.open(src)
    seg = store.segment("s", create=True)
    for i in range(5):
        seg.append([b"r%d" % i])
    seg.close()
    store.close()
    shutil.copytree(src, copy)
    with SegmentStore.open(copy) as other:
        other.segment("s").append([b"t0", b"t1", b"t2"])
    path = os.path.join("s", "_log.seg", CHUNK)
    with open(os.path.join(src, path), "rb") as f:
        end = len(f.read().rstrip(b"\0"))
    with open(os.path.join(copy, path), "rb") as f:
        batch = f.read()[end:]
    batch = batch.rstrip(b"\0")
    assert cut < len(batch)
    with open(os.path.join(src, path), "r+b") as f:
        f.seek(end)
        f.write(batch[:cut])  # what a writer killed mid-append leaves
    return SegmentStore.open(src), end


@pytest.mark.parametrize("cut", [3, 40, 64, 70])
def test_a_torn_batch_is_cut_and_its_claimed_offsets_are_never_given_out_again(tmp_path, cut, caplog):
    store, _end = _log_with_a_torn_batch(tmp_path, cut)
    with store:
        seg = store.segment("s")
        # A whole header (64 bytes) claims offsets 5..7: the next record gets 8, never 5.
        expected = 8 if cut >= 64 else 5
        assert seg.next_offset == expected
        with caplog.at_level("WARNING", logger="attrindex.storage"):
            assert seg.append([b"after"]).first_offset == expected
        assert "torn write" in caplog.text
        assert [(r.offset, r.value) for r in seg.read(0)] == [(i, b"r%d" % i) for i in range(5)] + [(expected, b"after")]
    with SegmentStore.open(str(tmp_path / "src")) as again:
        assert again.segment("s").next_offset == expected + 1 and again.verify_segment("s").ok


def test_bytes_no_crash_leaves_after_the_log_are_damage_reported_and_repaired(tmp_path):
    store, end = _log_with_a_torn_batch(tmp_path, 0)
    store.close()
    with open(os.path.join(str(tmp_path / "src"), "s", "_log.seg", CHUNK), "r+b") as f:
        f.seek(end)
        f.write(b"AIXB" + b"\x07" * 100)  # a batch header that fails its checksum: no crash writes that
    with SegmentStore.open(str(tmp_path / "src")) as store:
        with pytest.raises(CorruptDataError) as caught:
            store.segment("s")
        assert caught.value.offset == end
        repair = store.repair_segment("s")
        assert repair.first_lost_offset == 5 and repair.resume_offset >= 5
        seg = store.segment("s")
        assert [r.value for r in seg.read(0)] == [b"r%d" % i for i in range(5)]
        assert seg.append([b"after"]).first_offset == repair.resume_offset


# -- a writer killed mid-append ------------------------------------------------------------------
_CHILD = r"""
import os, sys
from storage_adapters import RollingSegment, open_storage
from storage_adapters import local
from storage_adapters.framing import LengthChecksumFraming

root, step, call = sys.argv[1], sys.argv[2], int(sys.argv[3])
counts = {}
real_write_all, real_fdatasync = local._write_all, os.fdatasync

def write_all(fd, data, position):
    counts["write"] = counts.get("write", 0) + 1
    if step == "before-write" and counts["write"] == call:
        os.kill(os.getpid(), 9)  # between two writes (the zeros ahead and the bytes, or two appends)
    if step == "write" and counts["write"] == call:
        real_write_all(fd, data[: len(data) // 2], position)  # die half-way through the bytes
        os.kill(os.getpid(), 9)
    real_write_all(fd, data, position)

def fdatasync(fd):
    counts["sync"] = counts.get("sync", 0) + 1
    if step == "sync" and counts["sync"] == call:
        os.kill(os.getpid(), 9)  # written, not yet synced
    real_fdatasync(fd)
    if step == "synced" and counts["sync"] == call:
        os.kill(os.getpid(), 9)  # synced, not yet acknowledged

local._write_all = write_all
local.os.fdatasync = fdatasync
framing = LengthChecksumFraming()
seg = RollingSegment(open_storage(root), "s", rolling_size=256, framing=framing)
for i in range(1000):
    payload = b"<append %04d %s>" % (i, b"x" * (i % 7))
    offset = seg.append(framing.frame(payload))
    print(offset, payload.decode(), flush=True)
"""


@pytest.mark.parametrize("step", ["write", "before-write", "sync", "synced"])
def test_a_writer_killed_at_any_step_loses_no_acknowledged_append(tmp_path, step):
    root = str(tmp_path / "store")
    stored: list[tuple[int, bytes]] = []  # what the segment held after the previous kill
    for call in (1, 2, 3, 5, 9, 14):  # some kills land on a chunk's first append (rolling_size=256)
        stored = _kill_a_writer_and_check(root, step, call, stored)


def test_crashes_in_a_row_leave_torn_writes_never_damage(tmp_path):
    """A writer killed between its writes, then the next one killed half-way through its bytes:
    every state is a crash's, so the store opens without error and keeps what was acknowledged
    (the first kill must not leave a file whose end the next append's bytes then run past)."""
    root = str(tmp_path / "store")
    stored: list[tuple[int, bytes]] = []
    for call in (2, 3, 4, 5, 6, 7, 8, 9):
        stored = _kill_a_writer_and_check(root, "before-write", call, stored)
        stored = _kill_a_writer_and_check(root, "write", 1, stored)


def _kill_a_writer_and_check(root: str, step: str, call: int, stored: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """Run ``_CHILD`` until it is killed at ``step`` of its ``call``-th write or sync; check that
    the segment opens with every acknowledged append where it was acknowledged (``stored``: what
    it held after the previous kill), and that a torn write left after the end of the last chunk
    has the zeros the storage keeps after it (``zeros_kept_after``: what tells it from a file cut
    short). Return what it holds now."""
    child = subprocess.run([sys.executable, "-c", _CHILD, root, step, str(call)],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert child.returncode == -9, child.stderr
    acknowledged = [(int(o), d.encode()) for o, d in (line.split(" ", 1) for line in child.stdout.splitlines())]
    seg = _segment(root, rolling_size=256)  # opens without any error: a crash is no damage
    whole = seg.read(0, seg.length)
    appends, at = [], 0
    for payload in FRAMING.payloads(whole):
        appends.append((at, payload))
        at += FRAMING.header_size + len(payload)
    assert at == seg.length and FRAMING.chain_end(whole, 0) == seg.length  # whole frames only
    expected = stored + acknowledged
    assert appends[:len(expected)] == expected  # every acknowledged append, where it was acknowledged
    assert len(appends) - len(expected) <= 1  # at most the one in flight became visible
    last = seg.chunks()[-1]
    with open(_chunk(root, last.name), "rb") as f:
        file = f.read()
    end = last.end - last.start
    if file[end:].strip(b"\0"):
        assert len(file) >= end + seg.storage.zeros_kept_after(end), (step, call, end, len(file))
    return appends


# -- formats with commit records -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sidecar file", "xattr fence directory"])
def test_a_store_with_commit_records_is_refused_naming_the_format(tmp_path, kind):
    seg = _segment(tmp_path)
    seg.append(frame(b"data"))
    record = _chunk(tmp_path) + ".commit"
    if kind == "sidecar file":
        open(record, "wb").close()
    else:
        os.mkdir(record)
    with pytest.raises(CorruptDataError, match="commit records in extended attributes or sidecar files"):
        _segment(tmp_path)


def test_a_directory_named_like_a_segment_part_is_listed_as_usual(tmp_path):
    seg = RollingSegment(open_storage(str(tmp_path)), "a.commit/s", framing=FRAMING)  # ".commit" is a valid name
    seg.append(frame(b"abc"))
    assert sorted(open_storage(str(tmp_path)).list_files("")) == [f"a.commit/s.seg/{CHUNK}"]


# -- create ----------------------------------------------------------------------------------------
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


# -- temporaries of creates that died ---------------------------------------------------------------
OLD = time.time() - local.TEMP_MAX_AGE_SECONDS - 60  #: a modification time past the sweep's bound


def _temporaries(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".tmp-"))


def test_a_create_sweeps_stale_temporaries_and_keeps_fresh_ones(tmp_path):
    """A create deletes the directory's temporaries older than ``TEMP_MAX_AGE_SECONDS`` and leaves
    a younger one (a create that may still be writing it)."""
    directory = tmp_path / "d"
    directory.mkdir()
    stale, fresh = directory / ".tmp-a.123", directory / ".tmp-b.456"
    stale.write_bytes(b"left by a crash")
    fresh.write_bytes(b"being written")
    os.utime(stale, (OLD, OLD))
    storage = open_storage(str(tmp_path))
    storage.create("d/x", b"data")
    assert _temporaries(directory) == [".tmp-b.456"]
    assert storage.read("d/x", 0, 10) == b"data"


def test_a_crashed_create_leaves_a_temporary_that_a_later_create_sweeps(tmp_path):
    """A child SIGKILLed inside ``create`` after writing its temporary, before linking it, leaves
    the temporary and no file under the name; a later create keeps it while it is young and
    deletes it once it is past the bound."""
    code = (
        "import os, sys\n"
        "from storage_adapters import local, open_storage\n"
        "real = local._write_all\n"
        "def write(fd, data, position):\n"
        "    real(fd, data, position)\n"
        "    os.fsync(fd)\n"
        "    print('written', flush=True)\n"
        "    os.kill(os.getpid(), 9)\n"
        "local._write_all = write\n"
        "open_storage(sys.argv[1]).create('d/crashed', b'x' * 1000)\n"
    )
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == -signal.SIGKILL and "written" in child.stdout
    left = _temporaries(tmp_path / "d")
    assert len(left) == 1 and not (tmp_path / "d" / "crashed").exists()
    storage = open_storage(str(tmp_path))
    storage.create("d/soon", b"1")  # the temporary is young: a create may still be writing it
    assert _temporaries(tmp_path / "d") == left
    os.utime(tmp_path / "d" / left[0], (OLD, OLD))
    open_storage(str(tmp_path)).create("d/later", b"2")  # another writer, after the bound
    assert _temporaries(tmp_path / "d") == []
    assert "crashed" not in storage.list_files("d")


def test_a_create_stalled_past_the_bound_fails_and_creates_nothing(tmp_path, monkeypatch):
    """A create whose temporary another writer swept (it stalled past the bound) fails with a
    ``StorageError`` and nothing appears under its name; a retry creates it."""
    storage, sweeper = open_storage(str(tmp_path)), open_storage(str(tmp_path))
    sweeper.create("d/first", b"0")
    sweeper._swept.clear()  # its next create sweeps again
    real = local._write_all

    def stall(fd, data, position):
        real(fd, data, position)
        if data != b"late":
            return  # the sweeper's own create
        (temporary,) = _temporaries(tmp_path / "d")
        os.utime(tmp_path / "d" / temporary, (OLD, OLD))  # as if stopped for over an hour here
        sweeper.create("d/other", b"1")  # another writer sweeps it

    monkeypatch.setattr(local, "_write_all", stall)
    with pytest.raises(StorageError):
        storage.create("d/stalled", b"late")
    monkeypatch.setattr(local, "_write_all", real)
    assert not (tmp_path / "d" / "stalled").exists() and _temporaries(tmp_path / "d") == []
    storage.create("d/stalled", b"retried")  # the name is free: a retry creates it
    assert storage.read("d/stalled", 0, 10) == b"retried"


def test_a_handle_sweeps_a_directory_at_most_once_per_interval(tmp_path, monkeypatch):
    """The sweep lists a directory once per handle and interval, not on every create."""
    storage = open_storage(str(tmp_path))
    scans = []
    real = os.scandir
    monkeypatch.setattr(local.os, "scandir", lambda d: scans.append(d) or real(d))
    for i in range(5):
        storage.create(f"d/{i}", b"x")
    assert len(scans) == 1


# -- torn at every byte ----------------------------------------------------------------------------
def _chunk_before_and_after(root: str, name: str, write) -> tuple[bytes, int, int]:
    """The bytes of the last chunk of segment ``name`` after ``write()`` (one append), where in
    them the append began, and the chunk's start."""
    from storage_adapters.rolling import SEGMENT_SUFFIX

    directory = os.path.join(root, name + SEGMENT_SUFFIX)
    last = sorted(n for n in os.listdir(directory) if n.isdigit())[-1]
    with open(os.path.join(directory, last), "rb") as f:
        before = f.read()
    write()
    assert sorted(n for n in os.listdir(directory) if n.isdigit())[-1] == last, "the append rolled"
    with open(os.path.join(directory, last), "rb") as f:
        after = f.read()
    start = next(i for i in range(len(before)) if before[i] != after[i])
    return after, start, int(last)


@pytest.mark.parametrize("which", ["log batch", "tree update"])
def test_an_append_torn_at_every_byte_is_cut_back_to_the_chain_before_it(tmp_path, which):
    """Every prefix of a real append (a record batch; a B+tree update of pages and a footer), as a
    killed writer leaves it (in a file as long as after the append: its zeros ahead are written
    first): the end is where the append began, the bytes are a torn write (none is taken for
    damage), and the chunk's frames before it are all there. The same prefix at the end of a file
    cut short there is damage."""
    from attrindex.btree.framing import TREE_FRAMING
    from attrindex.log.framing import LOG_FRAMING
    from attrindex.tree_index import TreeIndex
    from storage_adapters.tail import look_at_tail

    root = str(tmp_path)
    if which == "log batch":
        store = SegmentStore.open(root)
        seg = store.segment("s", create=True)
        seg.append([b"first"], [(b"k" * 16, 1)])
        after, start, chunk_start = _chunk_before_and_after(
            root, "s/_log", lambda: seg.append([b"r%d" % i for i in range(40)], [(b"a" * 16, 7)]))
        framing = LOG_FRAMING
    else:
        index = TreeIndex.open(root, page_size=256)
        index.update({i: i for i in range(200)})
        after, start, chunk_start = _chunk_before_and_after(
            root, "attributes", lambda: index.update({i: -i for i in range(0, 200, 3)}))
        framing = TREE_FRAMING
    prefix, append = after[:start], after[start:framing.chain_end(after, chunk_start) - chunk_start]
    assert append
    kept = open_storage(root).zeros_kept_after
    assert len(after) >= start + len(append) + kept(start + len(append))
    for cut in range(1, len(append)):
        chunk = prefix + append[:cut] + bytes(len(after) - start - cut)
        look = look_at_tail(lambda a, b: chunk[a:b], chunk_start, framing, zeros_kept=kept)
        if not append[cut:].strip(b"\0"):  # the bytes not written were zeros anyway: the whole append
            assert look.end == chunk_start + start + len(append) and look.torn is None, cut
            continue
        assert (look.end, look.damaged_at) == (chunk_start + start, None), cut
        assert look.torn == (chunk_start + start, chunk_start + start + len(append[:cut].rstrip(b"\0"))), cut
        if cut < kept(start):  # a file ending there is shorter than any crash leaves it
            short = chunk[:start + cut]
            cut_short = look_at_tail(lambda a, b: short[a:b], chunk_start, framing, zeros_kept=kept)
            assert cut_short.damaged_at == chunk_start + start and cut_short.torn is None, cut
    assert look_at_tail(lambda a, b: after[a:b], chunk_start, framing, zeros_kept=kept).end == chunk_start + start + len(append)


def test_a_tail_readers_poll_is_quiet_over_a_known_torn_write_and_wakes_for_an_append(tmp_path):
    writer = _segment(tmp_path)
    writer.append(frame(b"one"))
    end = writer.length
    with open(_chunk(tmp_path), "r+b") as f:
        f.seek(end)
        f.write(FRAMING.place(frame(b"t" * 30), end)[:25])  # a torn write, left by a crash
    reader = _segment(tmp_path)
    assert reader.torn_tail is not None and not reader.poll()  # nothing new: no refresh loop
    writer.refresh()
    writer.append(frame(b"two"))  # zeroes the torn bytes and appends
    assert reader.poll()
    reader.refresh()
    assert _payloads(reader) == [b"one", b"two"] and reader.torn_tail is None
