"""FaultyStorage: each fault kind does what it says on memory, local disk and S3 (moto)."""

from __future__ import annotations

import time
import uuid

import pytest

from storage_adapters import (
    ChunkExistsError,
    InvalidInputError,
    OutcomeUnknownError,
    RollingSegment,
    StorageError,
    StorageFullError,
)
from storage_adapters.faults import FAULT_KINDS, FaultyStorage, Injection, faults_disabled
from storage_adapters.local import LocalChunkStorage


def test_without_faults_it_is_the_inner_backend(storage):
    faulty = FaultyStorage(storage, seed=1)
    assert faulty.appendable == storage.appendable and faulty.url == storage.url
    seg = RollingSegment(faulty, "s", rolling_size=8)
    for i in range(5):
        assert seg.append(b"rec-%d;" % i) == 6 * i
    assert RollingSegment(storage, "s").read(0, 30) == b"".join(b"rec-%d;" % i for i in range(5))
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


def test_torn_create_is_partial_on_local_disk_and_nothing_on_objects(storage):
    faulty = FaultyStorage(storage, seed=3)
    faulty.script("torn", op="create")
    with pytest.raises(StorageError, match="torn"):
        faulty.create("d/a", b"0123456789")
    if isinstance(storage, LocalChunkStorage):
        left = storage.read("d/a", 0, 100)
        assert len(left) < 10 and b"0123456789".startswith(left)
    else:
        assert not storage.exists("d/a")


@pytest.fixture(params=["memory", "local"])
def appendable_storage(request, tmp_path):
    from storage_adapters import open_storage

    if request.param == "memory":
        return open_storage(f"memory://faults-{uuid.uuid4().hex}")
    return open_storage(str(tmp_path / "store"))


def test_torn_append_leaves_uncommitted_bytes(appendable_storage):
    storage = appendable_storage
    faulty = FaultyStorage(storage, seed=5)
    with faulty.lock("d"):
        faulty.append("d/c", 0, b"committed;")
        faulty.script("torn", op="append")
        with pytest.raises(StorageError, match="torn"):
            faulty.append("d/c", 10, b"torn-tail-bytes")
        assert storage.committed_size("d/c") == 10
        if isinstance(storage, LocalChunkStorage):
            assert storage.list_files("d")["c"] > 10  # a prefix is on disk, not committed
        faulty.append("d/c", 10, b"next;")  # overwrites the torn bytes
    assert storage.read("d/c", 0, 100) == b"committed;next;"


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
