"""The local append path keeps its lock file and its chunk open between appends.

What that must not change: writers of one directory still exclude each other (threads sharing the
storage, a forked child that inherited its descriptors, a process whose lock file was replaced
when the directory was removed and made again), an append lands in the file its name leads to now
(a chunk deleted and made again is another file), and a deleted chunk's space comes back. What it
buys: an append to an existing chunk opens and creates no file, and stats only the chunk and the
lock file.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading

import pytest

from storage_adapters import RollingSegment
from storage_adapters.framing import LengthChecksumFraming
from storage_adapters.local import MAX_OPEN_LOCKS, LocalChunkStorage

CHUNK = "00000000000000000000"
FRAMING = LengthChecksumFraming()
frame = FRAMING.frame


def _segment(storage, name="s", **kwargs) -> RollingSegment:
    return RollingSegment(storage, name, framing=FRAMING, **kwargs)


def _payloads(seg: RollingSegment) -> list[bytes]:
    return FRAMING.payloads(seg.read(0, seg.length))


def _waits_while_held(holder_lock, contender_lock) -> None:
    """``contender_lock`` is not acquired while ``holder_lock`` is held, and is right after."""
    acquired = threading.Event()
    done = threading.Event()

    def contend():
        with contender_lock:
            acquired.set()
        done.set()

    with holder_lock:
        thread = threading.Thread(target=contend, daemon=True)
        thread.start()
        assert not acquired.wait(0.3)  # correct code never acquires here, however slow the machine
    assert done.wait(60)
    thread.join(60)


def test_threads_sharing_one_storage_exclude_each_other(tmp_path):
    storage = LocalChunkStorage(str(tmp_path))
    with storage.lock("d"):
        pass  # the lock file is now kept open: both threads use that one descriptor
    _waits_while_held(storage.lock("d"), storage.lock("d"))


def test_two_storages_in_one_process_exclude_each_other(tmp_path):
    first, second = LocalChunkStorage(str(tmp_path)), LocalChunkStorage(str(tmp_path))
    _waits_while_held(first.lock("d"), second.lock("d"))


def test_a_lock_file_replaced_with_its_directory_is_opened_again(tmp_path):
    """A process that kept the old lock file open would lock a file nobody else opens."""
    old, other = LocalChunkStorage(str(tmp_path)), LocalChunkStorage(str(tmp_path))
    with old.lock("d"):
        pass
    shutil.rmtree(tmp_path / "d")  # e.g. the segment deleted and made again by another process
    os.makedirs(tmp_path / "d")
    _waits_while_held(other.lock("d"), old.lock("d"))
    _waits_while_held(old.lock("d"), other.lock("d"))


def _child_locks(root: str, go, acquired) -> None:
    storage = _inherited[0]
    go.wait()
    with storage.lock("d"):
        acquired.set()


_inherited: list[LocalChunkStorage] = []


def test_a_forked_child_does_not_share_its_parents_lock(tmp_path):
    """flock does not exclude holders of one open file description; a forked child inherits the
    parent's: it must open its own."""
    storage = LocalChunkStorage(str(tmp_path))
    with storage.lock("d"):
        pass  # the descriptor the child inherits
    _inherited[:] = [storage]
    context = multiprocessing.get_context("fork")
    go, acquired = context.Event(), context.Event()
    child = context.Process(target=_child_locks, args=(str(tmp_path), go, acquired))
    child.start()
    try:
        with storage.lock("d"):
            go.set()
            assert not acquired.wait(0.5)
        assert acquired.wait(60)
    finally:
        child.join(60)
        _inherited.clear()
    assert child.exitcode == 0


def test_an_append_to_an_existing_chunk_opens_no_file(tmp_path, monkeypatch):
    import builtins

    storage = LocalChunkStorage(str(tmp_path))
    seg = _segment(storage)
    seg.append(frame(b"first"))
    seg.append(frame(b"second"))  # the chunk is opened once and kept
    calls: list[str] = []
    for module, name in ((os, "open"), (os, "mkdir"), (os, "makedirs"), (builtins, "open")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
    for i in range(5):
        seg.append(frame(b"next-%d" % i))
    monkeypatch.undo()
    assert calls == []
    fresh = _segment(LocalChunkStorage(str(tmp_path)))
    assert _payloads(fresh) == [b"first", b"second"] + [b"next-%d" % i for i in range(5)]


def test_an_append_to_the_last_chunk_stats_only_the_lock_file(tmp_path, monkeypatch):
    """Pre-written zeros after the chunk's end say no writer rolled past it (a chunk is trimmed
    to its end before its successor is made), so no successor and no switch marker is looked
    for; and the chunk itself is never ``stat``-ed or ``fstat``-ed by an append (its descriptor
    is checked through the kernel's name for it, its size by seeking: docs/storage.md): one
    ``stat`` an append, of the lock file."""
    storage = LocalChunkStorage(str(tmp_path))
    seg = _segment(storage)
    seg.append(frame(b"first"))
    stats: list[str] = []
    real_stat, real_fstat = os.stat, os.fstat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: (stats.append(os.path.basename(str(path))), real_stat(path, *a, **k))[1])
    monkeypatch.setattr(os, "fstat", lambda fd: (stats.append(f"fd {fd}"), real_fstat(fd))[1])
    for i in range(5):
        seg.append(frame(b"next-%d" % i))
    monkeypatch.undo()
    assert stats == [".lock"] * 5
    assert _payloads(_segment(LocalChunkStorage(str(tmp_path)))) == [b"first"] + [b"next-%d" % i for i in range(5)]


def test_a_writer_that_skips_the_switch_check_still_appends_and_reads_beside_a_compaction(tmp_path):
    """Another handle merges this handle's full chunks (a chunk switch) while this handle's last
    chunk is still the last: its appends skip the switch check and land at the right offsets, and
    its reads of the replaced chunks find them through a refresh. Then a roll by the other handle
    trims this handle's last chunk: the walk runs and the next append follows it."""
    piece_size = len(frame(b"m%07d" % 0))
    mine = _segment(LocalChunkStorage(str(tmp_path)), rolling_size=piece_size)
    model = []
    for i in range(6):
        model.append(b"m%07d" % i)  # one append fills a chunk: six full chunks and a last one
        mine.append(frame(model[-1]))
    model.append(b"tail")
    mine.append(frame(b"tail"))  # the last chunk (not full) in this handle's view
    other = _segment(LocalChunkStorage(str(tmp_path)), rolling_size=piece_size)
    assert other.consolidate(64 * piece_size) == 1  # the full chunks switched to one replacement
    at = mine.length
    assert mine.append(frame(b"ab")) == at  # the view's last chunk has no successor: no switch check
    model.append(b"ab")
    assert FRAMING.payloads(mine.read(0, mine.length)) == model  # the replaced chunks: gone by name, found again
    other.refresh()
    last = other.chunks()[-1]
    for payload in (b"x" * piece_size, b"other-1"):  # the first fills the chunk, the second rolls
        at = other.length
        assert other.append(frame(payload)) == at
        model.append(payload)
    rolled = [c for c in other.chunks() if c.start >= last.start][:-1]
    assert rolled and all(other.storage.size(f"s.seg/{c.name}") == c.length for c in rolled)  # trimmed to their ends
    at = other.length
    assert mine.append(frame(b"cd")) == at  # rolled past: the walk finds the other's chunk
    model.append(b"cd")
    assert _payloads(_segment(LocalChunkStorage(str(tmp_path)))) == model


@pytest.mark.parametrize("proc", [True, False], ids=["proc", "no-proc"])
@pytest.mark.parametrize("gone", ["deleted", "renamed"])
def test_an_append_lands_in_the_file_its_chunk_name_leads_to_now(tmp_path, monkeypatch, gone, proc):
    """The kept descriptor is checked against the name: a chunk deleted, or moved away, and made
    again (here by hand, as a repair or a segment made again would) is written through a new
    descriptor; also without ``/proc`` (the kernel's name for a descriptor unknown: a ``stat``)."""
    if not proc:
        from storage_adapters import local

        monkeypatch.setattr(local, "_fd_link", lambda fd: None)
    storage = LocalChunkStorage(str(tmp_path), sync=False)
    path = f"d/{CHUNK}"
    with storage.lock("d"):
        storage.append(path, 0, b"old-1;")
        storage.append(path, 6, b"old-2;")  # kept open now
    other = LocalChunkStorage(str(tmp_path), sync=False)
    if gone == "deleted":
        other.delete([path])
    else:
        os.rename(tmp_path / "d" / CHUNK, tmp_path / "d" / "moved-away")
    with other.lock("d"):
        other.append(path, 0, b"new-1;")
    with storage.lock("d"):
        storage.append(path, 6, b"new-2;")
    with open(str(tmp_path / "d" / CHUNK), "rb") as f:
        stored = f.read()
    assert stored[:12] == b"new-1;new-2;" and not stored[12:].strip(b"\0")  # then pre-written zeros


def _open_files() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_deleting_a_chunk_closes_the_descriptor_kept_on_it(tmp_path):
    storage = LocalChunkStorage(str(tmp_path))
    path = f"d/{CHUNK}"
    with storage.lock("d"):
        storage.append(path, 0, b"a")
        storage.append(path, 1, b"b")
    target = str(tmp_path / "d" / CHUNK)
    assert target in _open_files()
    storage.delete([path])
    assert not any(name.startswith(target) for name in _open_files())  # no "(deleted)" file held open
    storage.remove_directory("d")
    assert not any(name.startswith(str(tmp_path / "d")) for name in _open_files())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_lock_files_kept_open_are_bounded_and_closed_with_the_storage(tmp_path):
    storage = LocalChunkStorage(str(tmp_path))
    for i in range(MAX_OPEN_LOCKS + 10):
        with storage.lock(f"d{i}"):
            pass
    held = [name for name in _open_files() if name.startswith(str(tmp_path))]
    assert 0 < len(held) <= MAX_OPEN_LOCKS
    with storage.lock("d0"):  # still locks after an eviction
        pass
    storage.close()
    assert not any(name.startswith(str(tmp_path)) for name in _open_files())
    with storage.lock("d1"):  # and after close
        pass


def test_a_torn_append_beside_the_kept_descriptor_is_cut_by_the_next_one(tmp_path):
    """The torn bytes are written by another file handle (as a killed writer's would be) while
    this storage keeps the chunk open and has looked at it in the same lock hold: the settle
    must see the old end, and the next append must zero the torn bytes."""
    from storage_adapters.errors import StorageError
    from storage_adapters.faults import FaultyStorage

    faulty = FaultyStorage(LocalChunkStorage(str(tmp_path)), seed=3)
    seg = _segment(faulty)
    seg.append(frame(b"one"))
    seg.append(frame(b"two"))
    end = seg.length
    faulty.script("torn", op="append")
    with pytest.raises(StorageError, match="torn"):
        seg.append(frame(b"a-long-torn-append;" * 3))
    assert seg.append(frame(b"three")) == end
    fresh = _segment(LocalChunkStorage(str(tmp_path)))
    assert _payloads(fresh) == [b"one", b"two", b"three"]
    with open(tmp_path / "s.seg" / CHUNK, "rb") as f:
        assert not f.read()[fresh.length:].strip(b"\0")  # the torn bytes are gone


def test_a_full_disk_through_the_kept_descriptor_commits_nothing_and_the_next_append_works(tmp_path, monkeypatch):
    import errno

    from storage_adapters.errors import StorageFullError

    seg = _segment(LocalChunkStorage(str(tmp_path)))
    seg.append(frame(b"one"))
    seg.append(frame(b"two"))
    end = seg.length
    real = os.pwrite

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(StorageFullError):
        seg.append(frame(b"lost"))
    monkeypatch.setattr(os, "pwrite", real)
    assert seg.append(frame(b"three")) == end
    assert _payloads(_segment(LocalChunkStorage(str(tmp_path)))) == [b"one", b"two", b"three"]

