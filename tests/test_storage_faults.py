"""FaultyStorage: each fault kind does what it says on memory, local disk and S3 (moto)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from storage_adapters import (
    ChunkExistsError,
    InvalidInputError,
    OutcomeUnknownError,
    RetriesExhaustedError,
    RollingSegment,
    StorageError,
    StorageFullError,
    TruncatedError,
    chunk_name,
)
from storage_adapters.faults import FAULT_KINDS, FaultyStorage, Injection, faults_disabled
from storage_adapters.local import LocalChunkStorage

from .framed import FRAMING, frame, offsets, open_segment, overhead, payloads, pieces


def test_without_faults_it_is_the_inner_backend(storage):
    faulty = FaultyStorage(storage, seed=1)
    assert faulty.appendable == storage.appendable and faulty.url == storage.url
    seg = open_segment(faulty, "s", rolling_size=8 + overhead(storage))
    stored = pieces(storage, [b"rec-%d;" % i for i in range(5)])
    at = offsets(stored)
    for i, piece in enumerate(stored):
        assert seg.append(piece) == at[i]
    assert open_segment(storage, "s").read(0, at[5]) == b"".join(stored)
    assert faulty.injected == []


def test_fail_before_and_enospc_write_nothing(storage):
    faulty = FaultyStorage(storage, seed=1)
    faulty.script("fail_before", op="create")
    with pytest.raises(StorageError, match="injected"):
        faulty.create("d/a", b"data")
    faulty.script("enospc", op="create")
    with pytest.raises(StorageFullError):
        faulty.create("d/a", b"data")
    assert not storage.exists("d/a")
    assert [i.kind for i in faulty.injected] == ["fail_before", "enospc"]
    faulty.create("d/a", b"data")  # the scripts are used up
    assert storage.read("d/a", 0, 4) == b"data"


def test_lost_ack_writes_then_raises(storage):
    faulty = FaultyStorage(storage, seed=1)
    faulty.script("lost_ack", op="create", path_contains="chunk")
    faulty.create("d/other", b"x")  # does not match path_contains
    with pytest.raises(OutcomeUnknownError):
        faulty.create("d/chunk", b"payload")
    assert storage.read("d/chunk", 0, 7) == b"payload"
    assert faulty.injected == [Injection("lost_ack", "create", "d/chunk")]
    with pytest.raises(ChunkExistsError):  # the retry a client would make
        faulty.create("d/chunk", b"payload")


def test_torn_create_leaves_a_partial_temporary_on_local_disk_and_nothing_on_objects(storage):
    faulty = FaultyStorage(storage, seed=3)
    faulty.script("torn", op="create")
    with pytest.raises(StorageError, match="torn"):
        faulty.create("d/a", b"0123456789")
    assert not storage.exists("d/a") and "a" not in storage.list_files("d")
    if isinstance(storage, LocalChunkStorage):  # what a create killed mid-way leaves: its temporary
        directory = storage._abs("d")
        (temporary,) = [n for n in os.listdir(directory) if n.startswith(".tmp-a.")]
        with open(os.path.join(directory, temporary), "rb") as f:
            left = f.read()
        assert len(left) < 10 and b"0123456789".startswith(left)
    faulty.create("d/a", b"0123456789")  # the retry creates it
    assert storage.read("d/a", 0, 100) == b"0123456789"


@pytest.fixture(params=["memory", "local"])
def appendable_storage(request, tmp_path):
    from storage_adapters import open_storage

    if request.param == "memory":
        return open_storage(f"memory://faults-{uuid.uuid4().hex}")
    return open_storage(str(tmp_path / "store"))


def test_torn_append_leaves_uncommitted_bytes(appendable_storage):
    storage = appendable_storage
    faulty = FaultyStorage(storage, seed=5)
    first, torn, after = pieces(storage, [b"committed;", b"torn-tail-bytes", b"next;"])
    end = len(first)
    with faulty.lock("d"):
        faulty.append("d/c", 0, first)
        faulty.script("torn", op="append")
        with pytest.raises(StorageError, match="torn"):
            faulty.append("d/c", end, torn)
        data = storage.read("d/c", 0, 1 << 20)
        if storage.torn_appends:
            # A prefix is on disk past the chain of frames, which still ends after the first.
            assert FRAMING.chain_end(data, 0) == end
            left = data[end:].rstrip(b"\0")
            assert left and torn.startswith(left) and len(left) < len(torn)
        else:
            assert data == first  # memory: whole or nothing
        faulty.append("d/c", end, after, clear_to=end + len(torn))  # overwrites and clears the torn bytes
    data = storage.read("d/c", 0, 1 << 20)
    assert data[:end + len(after)] == first + after and not data[end + len(after):].strip(b"\0")


def test_a_torn_append_leaves_what_a_killed_writer_of_the_backend_leaves(tmp_path):
    """On local disk an append writes the zeros it needs ahead of its bytes first, so a killed
    writer never leaves its bytes at the end of a file they made longer: an injected tear of a new
    chunk's first append leaves as many bytes after its prefix (what tells a torn write from a
    file cut short: storage_adapters/tail.py)."""
    from storage_adapters import open_storage

    storage = open_storage(str(tmp_path / "store"))
    faulty = FaultyStorage(storage, seed=5)
    (torn,) = pieces(storage, [b"torn-first-bytes"])
    with faulty.lock("d"):
        faulty.script("torn", op="append")
        with pytest.raises(StorageError, match="torn"):
            faulty.append("d/n", 0, torn)
    data = storage.read("d/n", 0, 1 << 20)
    left = data.rstrip(b"\0")
    assert left and torn.startswith(left)
    assert len(data) >= storage.zeros_kept_after(0) > 0


def test_bitflip_changes_one_bit_of_what_is_returned(storage):
    storage.create("d/a", bytes(64))
    faulty = FaultyStorage(storage, seed=7)
    faulty.script("bitflip_read", path_contains="d/a")
    flipped = faulty.read("d/a", 0, 64)
    assert sum(bin(b).count("1") for b in flipped) == 1
    assert faulty.read("d/a", 0, 64) == bytes(64) == storage.read("d/a", 0, 64)


def test_latency_sleeps():
    from storage_adapters import open_storage

    faulty = FaultyStorage(open_storage("memory://faults-latency"), seed=1, latency=0.05)
    faulty.script("latency", op="exists", times=2)
    started = time.monotonic()
    for _ in range(3):
        faulty.exists("x")
    assert time.monotonic() - started >= 0.1
    assert [i.kind for i in faulty.injected] == ["latency", "latency"]


def test_seeded_schedule_is_reproducible_and_can_be_disabled(tmp_path):
    from storage_adapters import open_storage

    def run(seed, directory):
        faulty = FaultyStorage(open_storage(str(tmp_path / directory)), seed=seed,
                               rates={"fail_before": 0.2, "lost_ack": 0.2, "bitflip_read": 0.3})
        for i in range(40):
            try:
                faulty.create(f"d/{i}", b"abc")
                faulty.read(f"d/{i}", 0, 3)
            except StorageError:
                pass
        return faulty

    first, again = run(11, "first"), run(11, "again")
    assert first.injected == again.injected and len(first.injected) > 10
    assert {i.kind for i in first.injected} == {"fail_before", "lost_ack", "bitflip_read"}
    with faults_disabled(first):
        for i in range(40):
            first.exists(f"d/{i}")
    assert first.injected == again.injected


def test_bad_arguments_are_refused(storage):
    with pytest.raises(InvalidInputError, match="unknown fault kind"):
        FaultyStorage(storage, seed=1, rates={"meteor": 0.5})
    with pytest.raises(InvalidInputError):
        FaultyStorage(storage, seed=1, rates={"torn": 2})
    faulty = FaultyStorage(storage, seed=1)
    with pytest.raises(InvalidInputError, match="does not apply"):
        faulty.script("bitflip_read", op="create")
    with pytest.raises(InvalidInputError):
        faulty.script("torn", times=0)
    assert set(FAULT_KINDS) == {"fail_before", "lost_ack", "torn", "enospc", "latency", "bitflip_read"}


# -- RollingSegment under faults: ambiguous outcomes are settled by reading, never by re-applying --
def _write_op(storage) -> str:
    return "append" if storage.appendable else "create"


def _stored(storage, name="s") -> bytes:
    fresh = open_segment(storage, name)
    return fresh.read(fresh.start_offset, fresh.length - fresh.start_offset)


@pytest.mark.parametrize("expected", [True, False])
def test_lost_ack_append_returns_its_offset_once(storage, expected, caplog):
    faulty = FaultyStorage(storage, seed=1)
    seg = open_segment(faulty, "s")
    stored = pieces(storage, [b"a;", b"bb;", b"c;"])
    at = offsets(stored)
    seg.append(stored[0])
    faulty.script("lost_ack", op=_write_op(storage))
    with caplog.at_level("INFO", logger="attrindex.storage"):
        assert seg.append(stored[1], expected_offset=at[1] if expected else None) == at[1]
    assert "accepted" in caplog.text  # the recovery is logged
    assert seg.append(stored[2]) == at[2]
    assert _stored(storage) == b"".join(stored)
    assert [i.kind for i in faulty.injected] == ["lost_ack"]


class _ReadFaultAfterWrite(FaultyStorage):
    """Scripts ``read_fault`` on reads right after the next write returns or raises: on local
    disk an append looks at its chunk's end before it writes, and the fault must hit the reads
    that settle the write, not that look."""

    read_fault: str | None = None

    def _arm(self) -> None:
        if self.read_fault is not None:
            self.script(self.read_fault, op="read")
            self.read_fault = None

    def append(self, path, position, data, *, clear_to=0):
        try:
            return super().append(path, position, data, clear_to=clear_to)
        finally:
            self._arm()

    def create(self, path, data):
        try:
            return super().create(path, data)
        finally:
            self._arm()


@pytest.mark.parametrize("expected", [True, False])
def test_a_lost_ack_whose_read_back_is_flipped_is_never_a_duplicate_nor_a_false_failure(storage, expected):
    """Two faults in one append: the write lands, its answer is lost, and the read that settles it
    meets a flipped bit. Taking the object for another writer's would write the bytes again (no
    expected offset) or report "nothing written" for a stored append (with one)."""
    faulty = _ReadFaultAfterWrite(storage, seed=4)
    seg = open_segment(faulty, "s")
    stored = pieces(storage, [b"a;", b"bb;"])
    at = offsets(stored)
    seg.append(stored[0])
    faulty.script("lost_ack", op=_write_op(storage))
    faulty.read_fault = "bitflip_read"
    try:
        assert seg.append(stored[1], expected_offset=at[1] if expected else None) == at[1]
    except OutcomeUnknownError:
        pass  # allowed: the caller must read before writing again
    assert _stored(storage) == b"".join(stored)  # once, never twice, and not reported as not written
    assert [i.kind for i in faulty.injected][:2] == ["lost_ack", "bitflip_read"]


@pytest.mark.parametrize("kind", ["fail_before", "enospc", "torn"])
def test_a_failed_write_is_a_definite_error_and_leaves_nothing(storage, kind):
    faulty = FaultyStorage(storage, seed=2)
    first = frame(storage, b"abcd")
    end = len(first)
    seg = open_segment(faulty, "s", rolling_size=end)
    seg.append(first)
    faulty.script(kind, op=_write_op(storage))
    with pytest.raises(StorageError) as caught:
        seg.append(frame(storage, b"efgh;", end), expected_offset=end)
    assert not isinstance(caught.value, OutcomeUnknownError)
    assert isinstance(caught.value, StorageFullError) == (kind == "enospc")
    assert _stored(storage) == first
    assert seg.append(frame(storage, b"ij;", end), expected_offset=end) == end
    assert _stored(storage) == first + frame(storage, b"ij;", end)


def test_an_unreadable_outcome_is_reported_unknown(storage):
    faulty = _ReadFaultAfterWrite(storage, seed=3)
    seg = open_segment(faulty, "s")
    stored = pieces(storage, [b"a;", b"bb;"])
    seg.append(stored[0])
    faulty.script("lost_ack", op=_write_op(storage))
    faulty.read_fault = "fail_before"  # the read-back cannot settle it
    with pytest.raises(OutcomeUnknownError):
        seg.append(stored[1], expected_offset=len(stored[0]))
    assert _stored(storage) == b"".join(stored)  # it did happen: "unknown" was the honest answer


def test_another_writers_chunk_after_a_lost_ack_is_not_taken_for_ours():
    """On an object store, the bytes at the offset decide: different bytes are someone else's."""
    from storage_adapters import BadOffsetError, open_storage

    inner = open_storage(f"memory://faults-{uuid.uuid4().hex}")
    faulty = FaultyStorage(inner, seed=4)
    faulty.appendable = False  # memory's exclusive create makes it an object store
    seg = RollingSegment(faulty, "s")
    inner.create("s.seg/" + "0" * 20, b"theirs;")  # lands while our handle is stale
    with pytest.raises(BadOffsetError) as caught:
        seg.append(b"ours;", expected_offset=0)
    assert caught.value.actual_offset == 7
    assert seg.append(b"ours;") == 7
    assert _stored(inner) == b"theirs;ours;"


class _LaggingListing(FaultyStorage):
    """An object store whose listings never show new chunks (a stale cache or a lagging index)."""

    def list_files(self, directory):
        return {}


def test_object_append_loop_is_bounded():
    from storage_adapters import open_storage
    from storage_adapters.rolling import MAX_APPEND_ATTEMPTS

    inner = open_storage(f"memory://faults-{uuid.uuid4().hex}")
    lagging = _LaggingListing(inner, seed=5)
    lagging.appendable = False
    seg = RollingSegment(lagging, "s")
    inner.create("s.seg/" + "0" * 20, b"someone else's chunk")
    with pytest.raises(RetriesExhaustedError, match=f"after {MAX_APPEND_ATTEMPTS} attempts"):
        seg.append(b"mine")
    assert _stored(inner) == b"someone else's chunk"


@pytest.mark.parametrize("expected", [True, False])
def test_s3_put_lands_response_lost_retry_gets_412(s3_options, expected):
    """A PUT that lands while its response is lost, then the client's own retry gets 412 (s3fs's
    retry on moto's server): the append is recognised as ours and lands once."""
    from botocore.parsers import ResponseParserError

    from storage_adapters import open_storage

    from .conftest import make_s3_url

    storage = open_storage(make_s3_url(s3_options), **s3_options)
    seg = RollingSegment(storage, "s")
    seg.append(b"first;")
    events = storage.fs.s3.meta.events
    statuses = []

    def lose_response(http_response, **_):
        statuses.append(http_response.status_code)
        if len(statuses) == 1:  # the PUT succeeded; the client never sees it
            raise ResponseParserError("connection dropped while reading the response")

    events.register("after-call.s3.PutObject", lose_response)
    try:
        assert seg.append(b"second;", expected_offset=6 if expected else None) == 6
    finally:
        events.unregister("after-call.s3.PutObject", lose_response)
    assert statuses == [200, 412]  # s3fs retried; the retry was refused
    assert seg.append(b"third;") == 13
    assert _stored(storage) == b"first;second;third;"


def test_housekeeping_after_the_durable_point_never_fails_the_append(storage):
    storage.deletion_grace = 0  # objects: dead chunks deleted at once (the default grace: test_s3_requests.py)
    faulty = FaultyStorage(storage, seed=6)
    stored = pieces(storage, [b"abcd", b"efgh", b"ijkl"])
    at = offsets(stored)
    seg = open_segment(faulty, "s", rolling_size=len(stored[0]))
    seg.append(stored[0])
    seg.truncate(at[1])  # the last chunk is kept until an append starts the next one
    faulty.script("fail_before", op="delete")
    assert seg.append(stored[1]) == at[1]  # deleting the dead chunk failed: logged, not raised
    assert seg.append(stored[2]) == at[2]  # and retried here
    assert _stored(storage) == stored[1] + stored[2]
    assert "0" * 20 not in storage.list_files("s.seg")


# -- refresh under races: bounded relisting, never a hole or a raw FileNotFoundError --------------
class _MarkerAhead(FaultyStorage):
    """A listing that always shows a truncation marker beyond every chunk it lists (a torn listing)."""

    def list_files(self, directory):
        files = dict(self.inner.list_files(directory))
        if directory.endswith(".seg"):
            files["truncation/" + "9" * 20] = 0
        return files


def test_refresh_relists_a_torn_listing_and_gives_up_after_its_bound():
    from storage_adapters import open_storage
    from storage_adapters.rolling import MAX_REFRESH_ATTEMPTS

    inner = open_storage(f"memory://faults-{uuid.uuid4().hex}")
    RollingSegment(inner, "s").append(b"abc")
    listings = []
    torn = _MarkerAhead(inner, seed=1)
    torn.list_files = lambda directory: listings.append(directory) or _MarkerAhead.list_files(torn, directory)
    with pytest.raises(RetriesExhaustedError, match=f"{MAX_REFRESH_ATTEMPTS} listings"):
        RollingSegment(torn, "s")
    assert len(listings) == MAX_REFRESH_ATTEMPTS


class _VanishesOnce(FaultyStorage):
    """The last chunk is deleted between the listing and the look at its end (a truncation moved on)."""

    vanished = False

    def read(self, path, start, end):  # what a listing's look at the last chunk's end reads
        if not self.vanished:
            self.vanished = True
            raise FileNotFoundError(path)
        return self.inner.read(path, start, end)


def test_refresh_relists_when_a_listed_chunk_vanishes(tmp_path):
    from storage_adapters import open_storage

    inner = open_storage(str(tmp_path))
    (data,) = pieces(inner, [b"abc"])
    open_segment(inner, "s").append(data)
    vanishing = _VanishesOnce(inner, seed=1)
    seg = open_segment(vanishing, "s")
    assert (seg.length, seg.read(0, len(data))) == (len(data), data) and vanishing.vanished


def test_truncate_is_done_once_its_marker_is_durable(storage):
    storage.deletion_grace = 0  # objects: dead chunks deleted at once (the default grace: test_s3_requests.py)
    faulty = FaultyStorage(storage, seed=2)
    stored = pieces(storage, [b"abcd", b"efgh", b"ijkl", b"mnop"])
    at = offsets(stored)
    seg = open_segment(faulty, "s", rolling_size=len(stored[0]))
    for part in stored[:3]:
        seg.append(part)
    faulty.script("fail_before", op="delete")
    seg.truncate(at[2])  # deleting the dead chunks fails: logged, not raised
    assert open_segment(storage, "s").start_offset == at[2]
    with pytest.raises(TruncatedError):
        open_segment(storage, "s").read(at[1], 2)
    assert seg.append(stored[3]) == at[3]  # retries the deletions
    assert sorted(n for n in storage.list_files("s.seg") if "/" not in n) == [chunk_name(at[2]), chunk_name(at[3])]


def test_truncate_settles_its_marker_by_reading(storage):
    faulty = FaultyStorage(storage, seed=3)
    stored = pieces(storage, [b"abcd", b"efgh", b"ijkl"])
    at = offsets(stored)
    seg = open_segment(faulty, "s", rolling_size=len(stored[0]))
    for part in stored:
        seg.append(part)
    faulty.script("fail_before", op="put_marker")
    with pytest.raises(StorageError) as caught:
        seg.truncate(at[1])
    assert not isinstance(caught.value, OutcomeUnknownError)
    assert open_segment(storage, "s").start_offset == 0
    faulty.script("lost_ack", op="put_marker")
    seg.truncate(at[2])  # the marker is stored: the truncation happened, and says so
    assert seg.start_offset == at[2] == open_segment(storage, "s").start_offset


@pytest.mark.parametrize("seed", [1, 2])
def test_random_faults_never_lose_or_duplicate_an_append(storage, seed):
    """Every acknowledged append is stored once at its offset, a definite failure never, an unknown
    one at most once; nothing else is stored."""
    import re

    from storage_adapters import BadOffsetError

    faulty = FaultyStorage(storage, seed=seed, rates={"fail_before": 0.08, "lost_ack": 0.08, "torn": 0.05, "enospc": 0.03})
    seg = open_segment(faulty, "s", rolling_size=64)
    acknowledged, unknown, failed = {}, set(), set()
    for i in range(40 if not storage.appendable else 200):
        record = b"<%d-%d>" % (seed, i)
        try:
            offset = seg.append(frame(storage, record), expected_offset=seg.length if i % 2 else None)
            acknowledged[offset] = record
        except OutcomeUnknownError:
            unknown.add(record)
        except (BadOffsetError, StorageError):
            failed.add(record)
    with faults_disabled(faulty):
        fresh = open_segment(storage, "s")
        start, stored = fresh.start_offset, _stored(storage)
    if storage.torn_appends:  # one record per frame
        found, position = {}, start
        for record in payloads(storage, stored, start):  # nothing torn or garbled is visible
            found[position] = record
            position += len(frame(storage, record))
        assert position == fresh.length
    else:
        found = {m.start(): m.group() for m in re.finditer(rb"<\d+-\d+>", stored)}
        assert b"".join(found.values()) == stored  # nothing torn or garbled is visible
    assert {o: r for o, r in found.items() if o in acknowledged} == acknowledged
    records = list(found.values())
    assert len(records) == len(set(records))  # no duplicates
    assert set(records) - set(acknowledged.values()) <= unknown and not set(records) & failed
    assert len(acknowledged) > 10 and len(faulty.injected) > 3
