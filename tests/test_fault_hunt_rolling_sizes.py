"""Fault hunt: writers of one segment with different rolling sizes forked the log (hunt bug 1's variant).

A chunk is "full" for the writer that rolls past it, not for a writer with a larger rolling size.
Writer A (rolling size 4) fills chunk X = [0, 4) and rolls into Y = [4, 8), Z = [8, 12); writer W
(rolling size 8) last saw X. A truncates at 4 but X's deletion fails (a leftover), then at 8,
which deleted Y (X was in no fresh view any more: nobody deleted leftovers). W's catch-up under the writers' lock finds X
(committed size 4) and no chunk after it; 4 < 8, so W did not roll, did not look at the
truncation offset (hunt bug 1's check runs only when rolling), and appended in place into X at
offset 4: an offset already used, below the truncation, read by nobody. The append was
acknowledged and lost, and W went on appending there. The same without a leftover: A's
truncation deletes X and Y between W's look at X and its look for Y; on local disk W then wrote
into the deleted file through the descriptor it kept open (acknowledged, lost), on memory it got a
false ``OutcomeUnknownError``.

Now a writer seals a chunk (a commit record that adds no bytes) before it creates the next one,
and a writer appends in place only to an unsealed chunk: an unsealed chunk, looked at under the
writers' lock, has no successor, so it is the last chunk and no truncation can delete it.
"""

from __future__ import annotations

import random
import uuid

import attrs
import pytest

from storage_adapters import RollingSegment, StorageError, open_storage
from storage_adapters.errors import BadOffsetError
from storage_adapters.faults import FaultyStorage
from storage_adapters.rolling import chunk_name

LOCAL_FORMATS = {"local": "xattr", "local-v1": "sidecar"}
IN_PLACE = ["memory", "local", "local-v1"]  #: the backends that grow chunks in place (and roll)


@attrs.frozen
class Store:
    backend: str
    url: str
    options: dict = attrs.Factory(dict)

    def open(self):
        """A storage object of its own (another handle, as another process would have)."""
        if self.backend in LOCAL_FORMATS:
            return open_storage(self.url, commit_format=LOCAL_FORMATS[self.backend])
        return open_storage(self.url, **self.options)


def _store(backend: str, tmp_path) -> Store:
    return Store(backend, f"memory://hunt-sizes-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path))


def _three_chunks(store: Store):
    """A (rolling size 4) writes X, Y, Z = [0, 4), [4, 8), [8, 12); W (rolling size 8) saw only X."""
    faulty = FaultyStorage(store.open(), seed=1)
    a = RollingSegment(faulty, "s", rolling_size=4)
    a.append(b"AAAA")
    w_storage = store.open()
    w = RollingSegment(w_storage, "s", rolling_size=8)
    a.append(b"BBBB")
    a.append(b"CCCC")
    return faulty, a, w_storage, w


def _restore_after(store: Store, name: str, action) -> None:
    """Run ``action`` (which deletes chunk ``name``), then put the chunk back as it was, commit
    records included: what a deletion that failed or was cut short leaves (the truncations that
    follow delete such leftovers, so a test has to make one)."""
    import shutil

    raw = store.open()
    path = f"s.seg/{name}"
    if store.backend == "memory":
        kept = raw.fs.store[raw._abs(path)]
        action()
        raw.fs.store[raw._abs(path)] = kept
        return
    chunk = f"{store.url}/{path}"
    shutil.copy2(chunk, chunk + ".saved")  # with its xattr (a v2 record)
    commit = chunk + ".commit"
    copy = shutil.copytree if LOCAL_FORMATS[store.backend] == "xattr" else shutil.copy2
    copy(commit, commit + ".saved")
    action()
    shutil.move(chunk + ".saved", chunk)
    shutil.move(commit + ".saved", commit)


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_writer_with_a_larger_rolling_size_never_appends_into_a_leftover_chunk(backend, tmp_path):
    store = _store(backend, tmp_path)
    _faulty, a, _w_storage, w = _three_chunks(store)
    _restore_after(store, chunk_name(0), lambda: a.truncate(8))  # X stays, Y is gone
    raw = store.open()
    assert raw.exists(f"s.seg/{chunk_name(0)}") and not raw.exists(f"s.seg/{chunk_name(4)}")
    assert w.append(b"DDDD") == 12  # the true end, not 4 inside the leftover
    assert w.append(b"EEEE", expected_offset=16) == 16
    fresh = RollingSegment(store.open(), "s", rolling_size=4)
    assert (fresh.start_offset, fresh.length, fresh.read(8, 12)) == (8, 20, b"CCCCDDDDEEEE")
    assert raw.committed_size(f"s.seg/{chunk_name(0)}") == 4  # the leftover did not grow


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_truncation_between_the_look_at_the_last_chunk_and_the_look_past_it(backend, tmp_path):
    """No leftover: A's truncation deletes X and Y while W walks from X (the writers' lock does not
    keep truncations out)."""
    store = _store(backend, tmp_path)
    _faulty, a, w_storage, w = _three_chunks(store)
    real_exists = w_storage.exists
    raced = []

    def exists(path):
        if not raced and path.endswith(f"s.seg/{chunk_name(4)}"):
            raced.append(path)
            a.truncate(8)  # deletes X and Y
        return real_exists(path)

    w_storage.exists = exists
    assert w.append(b"DDDD") == 12
    assert raced
    fresh = RollingSegment(store.open(), "s", rolling_size=4)
    assert (fresh.start_offset, fresh.length, fresh.read(8, 8)) == (8, 16, b"CCCCDDDD")


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_roll_cut_between_sealing_and_the_next_chunk_is_finished_by_the_next_writer(backend, tmp_path):
    """The roll failed (or its writer died) after sealing X, before the chunk after it: readers see
    X's length; the next writer, whatever its rolling size, starts the chunk after X."""
    store = _store(backend, tmp_path)
    faulty = FaultyStorage(store.open(), seed=1)
    a = RollingSegment(faulty, "s", rolling_size=4)
    a.append(b"AAAA")
    faulty.script("fail_before", op="append")  # the seal went through; the new chunk's append did not
    with pytest.raises(StorageError):
        a.append(b"BBBB")
    raw = store.open()
    assert raw.committed(f"s.seg/{chunk_name(0)}") == (4, True)
    assert not raw.exists(f"s.seg/{chunk_name(4)}")
    assert RollingSegment(store.open(), "s").length == 4
    big = RollingSegment(store.open(), "s", rolling_size=1 << 20)
    assert big.append(b"CCCC", expected_offset=4) == 4
    assert raw.committed(f"s.seg/{chunk_name(0)}") == (4, True) and raw.exists(f"s.seg/{chunk_name(4)}")
    assert a.append(b"DDDD", expected_offset=8) == 8
    assert RollingSegment(store.open(), "s").read(0, 12) == b"AAAACCCCDDDD"


@pytest.mark.parametrize("backend", IN_PLACE)
def test_the_storage_refuses_appends_to_a_sealed_chunk(backend, tmp_path):
    store = _store(backend, tmp_path)
    storage = store.open()
    RollingSegment(storage, "s", rolling_size=4).append(b"AAAA")
    path = f"s.seg/{chunk_name(0)}"
    assert storage.committed(path) == (4, False)
    with storage.lock("s.seg"):
        with pytest.raises(StorageError):
            storage.seal(path, 3)  # not its committed size: nothing sealed
        assert storage.committed(path) == (4, False)
        storage.seal(path, 4)
        storage.seal(path, 4)  # sealing again changes nothing
        with pytest.raises(StorageError, match="sealed"):
            storage.append(path, 4, b"BBBB")
    other = store.open()
    assert other.committed(path) == (4, True) and other.committed_size(path) == 4
    assert RollingSegment(other, "s").read(0, 4) == b"AAAA"
    assert RollingSegment(other, "s").append(b"BBBB") == 4  # into a new chunk


def _history(store: Store, seed: int, steps: int) -> None:
    """Two writers of one segment with different rolling sizes append and truncate in turn;
    deletions fail at random (leftover chunks), and one writer's truncation lands in the middle of
    the other's catch-up. Every acknowledged append must be readable exactly once, in order, at
    its offset, and the chunks on storage must not overlap."""
    rng = random.Random(seed)
    storages = [FaultyStorage(store.open(), seed=seed + i) for i in range(2)]
    sizes = [3, 16] if seed % 2 else [16, 5]
    handles = [RollingSegment(storage, "s", rolling_size=size) for storage, size in zip(storages, sizes)]
    acked: list[tuple[int, bytes]] = []
    for step in range(steps):
        me, other = rng.sample(handles, 2)
        storage = storages[handles.index(me)]
        if rng.random() < 0.3:
            storage.script("fail_before", op="delete")  # the next deletion fails: leftovers
        roll = rng.random()
        if roll < 0.2:  # a truncation by this writer, somewhere up to its end
            me.refresh()
            me.truncate(rng.randrange(me.start_offset, me.length + 1))
            continue
        if roll < 0.4:  # the other writer truncates to its end during this one's catch-up
            storage.exists = _truncating_first(storage, other)
        data = b"%d:%d;" % (handles.index(me), step)
        expected = me.length if rng.random() < 0.5 else None
        try:
            offset = me.append(data, expected_offset=expected)
        except BadOffsetError:  # a compare-and-append that lost: nothing written
            pass
        else:
            acked.append((offset, data))
        storage.__dict__.pop("exists", None)
    _check(store, acked)


def _truncating_first(storage: FaultyStorage, other: RollingSegment):
    """``storage.exists`` that first lets ``other`` truncate to its end (once, at the first look
    for a chunk: the catch-up's walk past the view's last chunk)."""
    armed = [True]

    def exists(path):
        if armed[0] and "/truncation/" not in path and "/switch/" not in path:
            armed[0] = False
            other.refresh()
            # Its sweep of obsolete names takes the writers' lock, which this thread holds here
            # (another process's truncation would sweep after this append): this one skips it.
            other._delete_obsolete = lambda names, **kwargs: None
            try:
                other.truncate(other.length)
            finally:
                del other._delete_obsolete
        return storage.inner.exists(path)

    return exists


def _check(store: Store, acked: list[tuple[int, bytes]]) -> None:
    acked.sort()
    position = 0
    for offset, data in acked:  # the acknowledged appends tile the stream: none reused, none missing
        assert offset == position, f"append acknowledged at {offset}, expected {position}: {acked}"
        position += len(data)
    fresh = RollingSegment(store.open(), "s")
    assert fresh.length == position
    start = fresh.start_offset
    assert fresh.read(start, position - start) == b"".join(d for _o, d in acked)[start:]
    storage = store.open()
    chunks = sorted((int(name), storage.committed_size(f"s.seg/{name}") if storage.appendable else size)
                    for name, size in storage.list_files("s.seg").items() if name.isdigit())
    for (start_a, size_a), (start_b, _size_b) in zip(chunks, chunks[1:]):
        assert start_a + size_a <= start_b, f"chunks overlap: {chunks}"


@pytest.mark.parametrize("backend", IN_PLACE)
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_two_writers_with_different_rolling_sizes_lose_no_acknowledged_append(backend, seed, tmp_path):
    _history(_store(backend, tmp_path), seed, steps=80)


@pytest.mark.parametrize("backend", ["s3"])
def test_two_writers_on_s3_lose_no_acknowledged_append(storage_url):
    """S3 writes one object per append (no rolling): the same history holds through its own
    protocol (dead names kept for the deletion grace)."""
    url, options = storage_url
    _history(Store("s3", url, options), seed=5, steps=30)


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_seal_that_fails_or_whose_answer_is_lost(backend, tmp_path):
    """A lost answer is settled by reading (the seal is there: the append goes on); a seal that
    failed leaves nothing written and the append fails definitely; the next append seals again."""
    store = _store(backend, tmp_path)
    faulty = FaultyStorage(store.open(), seed=1)
    seg = RollingSegment(faulty, "s", rolling_size=4)
    seg.append(b"AAAA")
    faulty.script("lost_ack", op="seal")
    assert seg.append(b"BBBB") == 4
    faulty.script("fail_before", op="seal")
    with pytest.raises(StorageError, match="did not happen"):
        seg.append(b"CCCC")
    raw = store.open()
    assert raw.committed(f"s.seg/{chunk_name(4)}") == (4, False) and not raw.exists(f"s.seg/{chunk_name(8)}")
    assert seg.append(b"CCCC", expected_offset=8) == 8
    assert [raw.committed(f"s.seg/{chunk_name(o)}") for o in (0, 4, 8)] == [(4, True), (4, True), (4, False)]
    assert RollingSegment(store.open(), "s").read(0, 12) == b"AAAABBBBCCCC"


_KILLED_ROLLER = r"""
import os, sys
from storage_adapters import RollingSegment, open_storage
from storage_adapters.local import LocalChunkStorage

root, fmt, when = sys.argv[1], sys.argv[2], sys.argv[3]
real_seal = LocalChunkStorage.seal
seals = [0]

def seal(self, path, size):
    seals[0] += 1
    if seals[0] == 2 and when == "before":
        os.kill(os.getpid(), 9)
    real_seal(self, path, size)
    if seals[0] == 2 and when == "after":
        os.kill(os.getpid(), 9)  # sealed, the next chunk not created yet

LocalChunkStorage.seal = seal
seg = RollingSegment(open_storage(root, commit_format=fmt), "s", rolling_size=8)
for i in range(100):
    data = b"<%02d>" % i
    print(seg.append(data), data.decode(), flush=True)
"""


@pytest.mark.parametrize("backend", ["local", "local-v1"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_writer_killed_around_its_seal_loses_nothing_and_the_next_writer_rolls(backend, when, tmp_path):
    import os
    import subprocess
    import sys

    store = _store(backend, tmp_path)
    child = subprocess.run([sys.executable, "-c", _KILLED_ROLLER, store.url, LOCAL_FORMATS[backend], when],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert child.returncode == -9, child.stderr
    acked = [(int(o), d.encode()) for o, d in (line.split(" ", 1) for line in child.stdout.splitlines())]
    assert [o for o, _d in acked] == [0, 4, 8, 12]  # two chunks of 8 bytes; killed rolling past the second
    raw = store.open()
    assert raw.committed(f"s.seg/{chunk_name(8)}") == (8, when == "after")
    big = RollingSegment(store.open(), "s", rolling_size=1 << 20)  # would append in place if it could
    acked.append((big.append(b"<big>", expected_offset=16), b"<big>"))
    acked.append((RollingSegment(store.open(), "s", rolling_size=8).append(b"<!!>"), b"<!!>"))
    assert [o for o, _d in acked[-2:]] == [16, 21]
    assert raw.exists(f"s.seg/{chunk_name(16)}") == (when == "after")  # else the big writer appended in place
    _check(store, acked)


@pytest.mark.parametrize("backend", IN_PLACE)
def test_the_next_truncation_deletes_leftover_chunks(backend, tmp_path):
    """A deletion that failed (or whose process died after the marker) left chunks that no view
    holds; the truncating handle that kept them in its view was gone, so nobody deleted them: the
    next truncation, by any handle, does."""
    import os

    store = _store(backend, tmp_path)
    faulty = FaultyStorage(store.open(), seed=1)
    a = RollingSegment(faulty, "s", rolling_size=4)
    for data in (b"AAAA", b"BBBB", b"CCCC", b"DDDD"):
        a.append(data)
    faulty.script("fail_before", op="delete")
    a.truncate(8)  # X and Y stay
    a.close()  # the handle that would have retried is gone
    raw = store.open()
    assert raw.exists(f"s.seg/{chunk_name(0)}") and raw.exists(f"s.seg/{chunk_name(4)}")
    b = RollingSegment(store.open(), "s", rolling_size=4)
    assert [c.start for c in b.chunks()] == [8, 12]  # no view holds the leftovers
    b.truncate(9)  # makes nothing new dead
    assert sorted(n for n in raw.list_files("s.seg") if n.isdigit()) == [chunk_name(8), chunk_name(12)]
    if backend != "memory":
        assert sorted(n for n in os.listdir(tmp_path / "s.seg") if n.startswith("0")) == [
            chunk_name(8), chunk_name(8) + ".commit", chunk_name(12), chunk_name(12) + ".commit"]
    assert RollingSegment(store.open(), "s").read(9, 7) == b"CCCDDDD"


@pytest.mark.parametrize("backend", IN_PLACE)
def test_seal_refuses_a_missing_chunk_or_another_size_and_a_sealed_chunk_refuses_appends(backend, tmp_path):
    storage = _store(backend, tmp_path).open()
    with pytest.raises(StorageError):
        storage.seal("s.seg/00000000000000000000", 0)  # missing: a clear project error, not a crash
    RollingSegment(storage, "s").append(b"abc")  # chunk 0 holds 3 bytes
    with pytest.raises(StorageError):
        storage.seal("s.seg/00000000000000000000", 2)  # not its committed size: nothing sealed
    assert storage.committed("s.seg/00000000000000000000") == (3, False)
    storage.seal("s.seg/00000000000000000000", 3)
    storage.seal("s.seg/00000000000000000000", 3)  # twice: no change
    assert storage.committed("s.seg/00000000000000000000") == (3, True)
    with pytest.raises(StorageError, match="is sealed"):
        storage.append("s.seg/00000000000000000000", 3, b"d")
    assert storage.committed_size("s.seg/00000000000000000000") == 3
