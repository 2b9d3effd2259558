"""Writers of one rolling segment racing each other: stale views, different rolling sizes,
truncations landing in the middle of another writer's walk, leftover chunks of failed deletions,
and trims that fail or whose writer dies.

Held: an append is acknowledged only at the segment's true end, never at an offset already used
or below the truncation offset (a fork no other handle reads); a writer appends in place only to
a chunk with no successor (looked at under the writers' lock: it is the last chunk, and no
truncation deletes it) and trims a chunk to its end before it creates the next one; every
acknowledged append is readable exactly once, in order, at its offset, and chunks on storage never
overlap. Offsets in the tests with two rolling sizes are in units of one append (4 payload bytes;
one frame on local disk: tests/framed.py).
"""

from __future__ import annotations

import random
import uuid

import attrs
import pytest

from storage_adapters import StorageError, open_storage
from storage_adapters.errors import BadOffsetError
from storage_adapters.faults import FaultyStorage
from storage_adapters.rolling import RollingSegment, chunk_name

from .framed import frame, offsets, open_segment, overhead, pieces

IN_PLACE = ["memory", "local"]  #: the backends that grow chunks in place (and roll)


@attrs.frozen
class Store:
    backend: str
    url: str
    options: dict = attrs.Factory(dict)

    def open(self):
        """A storage object of its own (another handle, as another process would have)."""
        return open_storage(self.url, **self.options)


def _store(backend: str, tmp_path) -> Store:
    return Store(backend, f"memory://rolling-race-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path))


def _unit(storage) -> int:
    """The stored size of one 4-byte append."""
    return 4 + overhead(storage)


def _put(storage, payload: bytes, k: int) -> bytes:
    """What is appended for the 4-byte ``payload`` at unit ``k``."""
    return frame(storage, payload, k * _unit(storage))


def _three_chunks(store: Store):
    """A (one unit per chunk) writes X, Y, Z = units [0, 1), [1, 2), [2, 3); W (two units per
    chunk) saw only X."""
    faulty = FaultyStorage(store.open(), seed=1)
    u = _unit(faulty)
    a = open_segment(faulty, "s", rolling_size=u)
    a.append(_put(faulty, b"AAAA", 0))
    w_storage = store.open()
    w = open_segment(w_storage, "s", rolling_size=2 * u)
    a.append(_put(faulty, b"BBBB", 1))
    a.append(_put(faulty, b"CCCC", 2))
    return faulty, a, w_storage, w


def _restore_after(store: Store, name: str, action) -> None:
    """Run ``action`` (which deletes chunk ``name``), then put the chunk back as it was: what a
    deletion that failed or was cut short leaves (the truncations that follow delete such
    leftovers, so a test has to make one)."""
    raw = store.open()
    path = f"s.seg/{name}"
    kept = raw.read(path, 0, 1 << 62)
    action()
    raw.create(path, kept)


# -- a stale view and a truncation by another writer ------------------------------------------

def _appends(storage) -> tuple[list[bytes], list[int], int]:
    """Four appends A, B, C, D of one chunk each (one frame each on local disk), their offsets,
    and the rolling size that makes each fill its chunk."""
    stored = pieces(storage, [b"AAAA", b"BBBB", b"CCCC", b"DDDD"])
    return stored, offsets(stored), len(stored[0])


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_stale_writer_never_rolls_into_a_chunk_another_writer_truncated(backend, tmp_path):
    """A's view ends in a full chunk X; B appends Y and Z, then truncates below Z (deleting X and
    Y) between A's look at X and its look for Y. A's append lands at the true end, not at Y's
    offset (already used, below the truncation, seen by no other handle), and B sees it."""
    url = _store(backend, tmp_path).url
    a_storage, b_storage = open_storage(url), open_storage(url)
    (x, y, z, d), at, size = _appends(a_storage)
    a = open_segment(a_storage, "s", rolling_size=size)
    a.append(x)  # chunk X, full: A's next append rolls to Y's offset
    b = open_segment(b_storage, "s", rolling_size=size)
    b.append(y)  # Y
    b.append(z)  # Z
    real_exists = a_storage.exists
    raced = []

    def exists(path):  # B's truncation lands between A's look at X and its look for Y
        if not raced and path.endswith(chunk_name(at[1])):
            raced.append(path)
            b.truncate(at[2])  # deletes X and Y
        return real_exists(path)

    a_storage.exists = exists
    assert a.append(d) == at[3]  # the true end, not the reused offset of Y
    assert raced
    assert a.length == b.length + len(d) == at[4]
    fresh = open_segment(open_storage(url), "s", rolling_size=size)
    assert fresh.start_offset == at[2] and fresh.read(at[2], at[4] - at[2]) == z + d
    with pytest.raises(BadOffsetError):
        b.append(d, expected_offset=at[3])  # B learns of A's append: nothing forked


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_writer_whose_view_ends_in_a_leftover_chunk_finds_the_true_tail(backend, tmp_path):
    """X survived (its deletion was interrupted, or the deleter's view did not hold it) while its
    successor Y was deleted: the walk from A's view (ending in X) finds nothing after X, yet A's
    append lands at the true end past the truncation."""
    url = _store(backend, tmp_path).url
    storage = open_storage(url)
    (x, y, z, d), at, size = _appends(storage)
    a = open_segment(storage, "s", rolling_size=size)
    a.append(x)
    b = open_segment(open_storage(url), "s", rolling_size=size)
    b.append(y)
    b.append(z)
    b.truncate(at[2])
    assert not storage.exists(f"s.seg/{chunk_name(at[1])}")
    storage.create(f"s.seg/{chunk_name(0)}", x)  # the leftover, as the interrupted deletion left it
    assert a.append(d, expected_offset=None) == at[3]
    assert open_segment(open_storage(url), "s", rolling_size=size).read(at[2], at[4] - at[2]) == z + d


# -- writers with different rolling sizes --------------------------------------------------------

@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_writer_with_a_larger_rolling_size_never_appends_into_a_leftover_chunk(backend, tmp_path):
    """A chunk is full for the writer that rolls past it, not for one with a larger rolling size.
    A (one unit per chunk) wrote X, Y, Z and truncated at Z with X's deletion failing (a leftover);
    W (two units per chunk) last saw X, not full for it. W appends at the true end, never in place
    into X at an offset already used; X keeps its length."""
    store = _store(backend, tmp_path)
    _faulty, a, _w_storage, w = _three_chunks(store)
    raw = store.open()
    u = _unit(raw)
    _restore_after(store, chunk_name(0), lambda: a.truncate(2 * u))  # X stays, Y is gone
    assert raw.exists(f"s.seg/{chunk_name(0)}") and not raw.exists(f"s.seg/{chunk_name(u)}")
    assert w.append(_put(raw, b"DDDD", 3)) == 3 * u  # the true end, not inside the leftover
    assert w.append(_put(raw, b"EEEE", 4), expected_offset=4 * u) == 4 * u
    fresh = open_segment(store.open(), "s", rolling_size=u)
    assert (fresh.start_offset, fresh.length) == (2 * u, 5 * u)
    assert fresh.read(2 * u, 3 * u) == b"".join(_put(raw, p, k) for k, p in ((2, b"CCCC"), (3, b"DDDD"), (4, b"EEEE")))
    assert raw.size(f"s.seg/{chunk_name(0)}") == u  # the leftover did not grow


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_truncation_between_the_look_at_the_last_chunk_and_the_look_past_it(backend, tmp_path):
    """No leftover: A's truncation deletes X and Y while W walks from X (the writers' lock does not
    keep truncations out). W's append lands at the true end: never into the deleted X through a
    descriptor it kept open (local disk), never a false ``OutcomeUnknownError`` (memory)."""
    store = _store(backend, tmp_path)
    _faulty, a, w_storage, w = _three_chunks(store)
    u = _unit(w_storage)
    real_exists = w_storage.exists
    raced = []

    def exists(path):
        if not raced and path.endswith(f"s.seg/{chunk_name(u)}"):
            raced.append(path)
            a.truncate(2 * u)  # deletes X and Y
        return real_exists(path)

    w_storage.exists = exists
    assert w.append(_put(w_storage, b"DDDD", 3)) == 3 * u
    assert raced
    fresh = open_segment(store.open(), "s", rolling_size=u)
    assert (fresh.start_offset, fresh.length) == (2 * u, 4 * u)
    assert fresh.read(2 * u, 2 * u) == _put(w_storage, b"CCCC", 2) + _put(w_storage, b"DDDD", 3)


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_roll_cut_between_trimming_and_the_next_chunk_leaves_the_last_chunk_to_append_to(backend, tmp_path):
    """The roll failed (or its writer died) after trimming X, before the chunk after it: X is
    still the last chunk (it has no successor). Readers see its length; the next writer, whatever
    its rolling size, appends at its end; nothing is lost or reused."""
    store = _store(backend, tmp_path)
    faulty = FaultyStorage(store.open(), seed=1)
    u = _unit(faulty)
    a = open_segment(faulty, "s", rolling_size=u)
    a.append(_put(faulty, b"AAAA", 0))
    faulty.script("fail_before", op="append")  # the trim went through; the new chunk's append did not
    with pytest.raises(StorageError):
        a.append(_put(faulty, b"BBBB", 1))
    raw = store.open()
    assert raw.size(f"s.seg/{chunk_name(0)}") == u  # trimmed to its end
    assert not raw.exists(f"s.seg/{chunk_name(u)}")
    assert open_segment(store.open(), "s").length == u
    big = open_segment(store.open(), "s", rolling_size=1 << 20)
    assert big.append(_put(raw, b"CCCC", 1), expected_offset=u) == u
    assert a.append(_put(raw, b"DDDD", 2), expected_offset=2 * u) == 2 * u
    stored = b"".join(_put(raw, p, k) for k, p in enumerate((b"AAAA", b"CCCC", b"DDDD")))
    assert open_segment(store.open(), "s").read(0, 3 * u) == stored


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_chunk_with_a_successor_is_never_appended_to(backend, tmp_path):
    """W (a larger rolling size) last saw X not full for it; A rolled past X meanwhile. W's append
    goes after A's chunk, never into X, and X keeps its length (trimmed to it before the roll)."""
    store = _store(backend, tmp_path)
    storage = store.open()
    u = _unit(storage)
    a = open_segment(storage, "s", rolling_size=u)
    a.append(_put(storage, b"AAAA", 0))
    w = open_segment(store.open(), "s", rolling_size=4 * u)
    assert w.chunks()[-1].length < w.rolling_size  # X is not full for W
    a.append(_put(storage, b"BBBB", 1))  # A rolls: X is trimmed, Y is its successor
    assert w.append(_put(storage, b"CCCC", 2)) == 2 * u
    assert storage.size(f"s.seg/{chunk_name(0)}") == u
    fresh = open_segment(store.open(), "s")
    assert [(c.start, c.end) for c in fresh.chunks()] == [(0, u), (u, 3 * u)]
    assert fresh.read(0, 3 * u) == b"".join(_put(storage, p, k) for k, p in enumerate((b"AAAA", b"BBBB", b"CCCC")))


def _history(store: Store, seed: int, steps: int) -> None:
    """Two writers of one segment with different rolling sizes append and truncate in turn;
    deletions fail at random (leftover chunks), and one writer's truncation lands in the middle of
    the other's catch-up. Every acknowledged append must be readable exactly once, in order, at
    its offset, and the chunks on storage must not overlap."""
    rng = random.Random(seed)
    storages = [FaultyStorage(store.open(), seed=seed + i) for i in range(2)]
    sizes = [3, 16] if seed % 2 else [16, 5]
    handles = [open_segment(storage, "s", rolling_size=size) for storage, size in zip(storages, sizes)]
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
            offset = me.append(frame(storage, data), expected_offset=expected)
        except BadOffsetError:  # a compare-and-append that lost: nothing written
            pass
        else:
            acked.append((offset, frame(storage, data, offset)))  # a frame is placed where it lands
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
            other._handle.delete_obsolete = lambda names, **kwargs: None
            try:
                other.truncate(other.length)
            finally:
                del other._handle.delete_obsolete
        return storage.inner.exists(path)

    return exists


def _check(store: Store, acked: list[tuple[int, bytes]]) -> None:
    acked.sort()
    position = 0
    for offset, data in acked:  # the acknowledged appends tile the stream: none reused, none missing
        assert offset == position, f"append acknowledged at {offset}, expected {position}: {acked}"
        position += len(data)
    fresh = open_segment(store.open(), "s")
    assert fresh.length == position
    start = fresh.start_offset
    assert fresh.read(start, position - start) == b"".join(d for _o, d in acked)[start:]
    storage = store.open()
    # Every chunk but the last is trimmed to its end before its successor is made: its stored size
    # is its length (the last one's zeros past its end are compared with nothing).
    chunks = sorted((int(name), size) for name, size in storage.list_files("s.seg").items() if name.isdigit())
    for (start_a, size_a), (start_b, _size_b) in zip(chunks, chunks[1:]):
        assert start_a + size_a <= start_b, f"chunks overlap: {chunks}"


@pytest.mark.parametrize("backend", IN_PLACE)
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_two_writers_with_different_rolling_sizes_lose_no_acknowledged_append(backend, seed, tmp_path):
    """A random history (``_history``): every acknowledged append readable exactly once, in order,
    at its offset; no two chunks overlap."""
    _history(_store(backend, tmp_path), seed, steps=80)


@pytest.mark.parametrize("backend", ["s3"])
def test_two_writers_on_s3_lose_no_acknowledged_append(storage_url):
    """S3 writes one object per append (no rolling): the same history holds through its own
    protocol (dead names kept for the deletion grace)."""
    url, options = storage_url
    _history(Store("s3", url, options), seed=5, steps=30)


@pytest.mark.parametrize("backend", IN_PLACE)
def test_a_trim_that_fails_or_whose_answer_is_lost(backend, tmp_path):
    """A lost answer is settled by reading (the chunk is trimmed: the append goes on); a trim that
    failed on local disk leaves the chunk untrimmed and the append fails definitely, with nothing
    written (memory keeps nothing past a chunk's end: there is nothing to trim); the next append
    trims again."""
    store = _store(backend, tmp_path)
    faulty = FaultyStorage(store.open(), seed=1)
    u = _unit(faulty)
    seg = open_segment(faulty, "s", rolling_size=u)
    seg.append(_put(faulty, b"AAAA", 0))
    faulty.script("lost_ack", op="trim")
    assert seg.append(_put(faulty, b"BBBB", 1)) == u
    raw = store.open()
    faulty.script("fail_before", op="trim")
    if faulty.torn_appends:
        with pytest.raises(StorageError, match="did not happen"):
            seg.append(_put(faulty, b"CCCC", 2))
        assert raw.size(f"s.seg/{chunk_name(u)}") > u and not raw.exists(f"s.seg/{chunk_name(2 * u)}")
        assert seg.append(_put(faulty, b"CCCC", 2), expected_offset=2 * u) == 2 * u
    else:
        assert seg.append(_put(faulty, b"CCCC", 2), expected_offset=2 * u) == 2 * u
    assert [raw.size(f"s.seg/{chunk_name(k * u)}") for k in (0, 1)] == [u, u]
    stored = b"".join(_put(raw, p, k) for k, p in enumerate((b"AAAA", b"BBBB", b"CCCC")))
    assert open_segment(store.open(), "s").read(0, 3 * u) == stored


_KILLED_ROLLER = r"""
import os, sys
from storage_adapters import open_storage
from storage_adapters.local import LocalChunkStorage
from tests.framed import frame, open_segment

root, when = sys.argv[1], sys.argv[2]
real_trim = LocalChunkStorage.trim
trims = [0]

def trim(self, path, size):
    trims[0] += 1
    if trims[0] == 2 and when == "before":
        os.kill(os.getpid(), 9)
    real_trim(self, path, size)
    if trims[0] == 2 and when == "after":
        os.kill(os.getpid(), 9)  # trimmed, the next chunk not created yet

LocalChunkStorage.trim = trim
storage = open_storage(root)
unit = len(frame(storage, b"<00>"))
seg = open_segment(storage, "s", rolling_size=2 * unit)
for i in range(100):
    data = b"<%02d>" % i
    print(seg.append(frame(storage, data, seg.length)), data.decode(), flush=True)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_writer_killed_around_its_trim_loses_nothing_and_the_next_writers_append_at_the_end(when, tmp_path):
    """A writer SIGKILLed just before or just after trimming the chunk it rolls past: every append
    it acknowledged is there, the trimmed (or untrimmed) chunk is the last one, and writers of any
    rolling size append at its end."""
    import os
    import subprocess
    import sys

    store = _store("local", tmp_path)
    child = subprocess.run([sys.executable, "-c", _KILLED_ROLLER, store.url, when],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert child.returncode == -9, child.stderr
    raw = store.open()
    u = _unit(raw)
    acked = [(int(o), frame(raw, d.encode(), int(o))) for o, d in (line.split(" ", 1) for line in child.stdout.splitlines())]
    assert [o for o, _d in acked] == [0, u, 2 * u, 3 * u]  # two chunks of two units; killed rolling past the second
    second = f"s.seg/{chunk_name(2 * u)}"
    if when == "after":
        assert raw.size(second) == 2 * u  # trimmed to its end
    else:
        assert raw.size(second) > 2 * u  # pre-written zeros past its end
    # The second chunk has no successor either way: it is the last chunk, appended to in place.
    big = open_segment(store.open(), "s", rolling_size=1 << 20)
    acked.append((big.append(frame(raw, b"<big>", 4 * u), expected_offset=4 * u), frame(raw, b"<big>", 4 * u)))
    assert not raw.exists(f"s.seg/{chunk_name(4 * u)}")
    end = 4 * u + len(acked[-1][1])
    acked.append((open_segment(store.open(), "s", rolling_size=2 * u).append(frame(raw, b"<!!>", end)),
                  frame(raw, b"<!!>", end)))
    assert acked[-1][0] == end and raw.exists(f"s.seg/{chunk_name(end)}")  # the full chunk rolled
    _check(store, acked)


@pytest.mark.parametrize("backend", IN_PLACE)
def test_the_next_truncation_deletes_leftover_chunks(backend, tmp_path):
    """A deletion that failed (or whose process died after the marker) left chunks that no view
    holds; the truncating handle that kept them in its view was gone, so nobody deleted them: the
    next truncation, by any handle, does."""
    import os

    store = _store(backend, tmp_path)
    faulty = FaultyStorage(store.open(), seed=1)
    u = _unit(faulty)
    a = open_segment(faulty, "s", rolling_size=u)
    for k, data in enumerate((b"AAAA", b"BBBB", b"CCCC", b"DDDD")):
        a.append(_put(faulty, data, k))
    faulty.script("fail_before", op="delete")
    a.truncate(2 * u)  # X and Y stay
    a.close()  # the handle that would have retried is gone
    raw = store.open()
    assert raw.exists(f"s.seg/{chunk_name(0)}") and raw.exists(f"s.seg/{chunk_name(u)}")
    b = open_segment(store.open(), "s", rolling_size=u)
    assert [c.start for c in b.chunks()] == [2 * u, 3 * u]  # no view holds the leftovers
    b.truncate(2 * u + 1)  # makes nothing new dead
    assert sorted(n for n in raw.list_files("s.seg") if n.isdigit()) == [chunk_name(2 * u), chunk_name(3 * u)]
    if backend != "memory":
        assert sorted(n for n in os.listdir(tmp_path / "s.seg") if n.startswith("0")) == [
            chunk_name(2 * u), chunk_name(3 * u)]
    stored = _put(raw, b"CCCC", 2) + _put(raw, b"DDDD", 3)
    assert open_segment(store.open(), "s").read(2 * u + 1, 2 * u - 1) == stored[1:]
