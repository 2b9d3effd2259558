"""S3-compatible stores as a user meets them: SeaweedFS (a real second implementation, started by
``seaweedfs_options`` in conftest.py) and a store that ignores ``If-None-Match`` (``single_writer``)."""

from __future__ import annotations

import uuid

import pytest

from attrindex import AttributeIndex
from attrindex.tree_index import TreeIndex
from storage_adapters import (
    ChunkExistsError,
    ExclusiveCreateUnsupportedError,
    OutcomeUnknownError,
    RollingSegment,
    StorageError,
    open_storage,
)
from storage_adapters.faults import FaultyStorage
from storage_adapters.s3 import probe_exclusive_create

from .conftest import S3_KEY, SEAWEEDFS_BUCKET, make_s3_url
from .test_open_storage import IgnoresIfNoneMatch


def _seaweed_url() -> str:
    return f"s3://{SEAWEEDFS_BUCKET}/{uuid.uuid4().hex}"


# -- SeaweedFS ------------------------------------------------------------------------------------
def test_seaweedfs_412_without_condition_is_exists(seaweedfs_options):
    """Its 412 has no <Condition> element (s3fs raises OSError): the probe and create still see 'exists'."""
    storage = open_storage(_seaweed_url(), **seaweedfs_options)
    assert probe_exclusive_create(storage.fs, f"{storage.root}/probe") is True
    storage.create("d/x", b"first")
    with pytest.raises(ChunkExistsError):
        storage.create("d/x", b"second")
    assert storage.read("d/x", 0, 100) == b"first"


def test_seaweedfs_indexes_and_segments(seaweedfs_options):
    url = _seaweed_url()
    with AttributeIndex.open(url, storage_options=seaweedfs_options) as index:
        index.update({k: k * 2 for k in range(500)})
        index.update({k: None for k in range(0, 500, 2)})
    with AttributeIndex.open(url, storage_options=seaweedfs_options, mode="r") as index:
        assert index.get(3) == 6 and index.get(4) is None and len(index) == 250
    storage = open_storage(url, **seaweedfs_options)
    tree = TreeIndex(storage, "tree", page_size=512)
    for round_ in range(20):  # compaction truncates: markers, dead chunks kept for the grace
        tree.update({k: round_ for k in range(round_ * 50, round_ * 50 + 200)})
    assert TreeIndex(storage, "tree", page_size=512).get(999) == 19
    counts = storage.requests
    assert counts.put >= 20 and counts.get >= 0


def test_seaweedfs_bad_credentials_are_a_clear_error(seaweedfs_options):
    storage = open_storage(_seaweed_url(), **{**seaweedfs_options, "secret": "wrong-" + S3_KEY}, max_attempts=1)
    with pytest.raises(StorageError, match="credentials") as caught:
        RollingSegment(storage, "s").append(b"x")
    assert not isinstance(caught.value, OSError)


# -- a store that ignores If-None-Match, with single_writer=True ------------------------------------
def _ignoring_store(s3_options, single_writer=True):
    storage = open_storage(make_s3_url(s3_options), single_writer=single_writer, **s3_options)
    storage.fs = IgnoresIfNoneMatch()  # accepts If-None-Match: * and overwrites anyway
    storage._endpoint = f"ignoring-store-{uuid.uuid4().hex}"  # its own probe result
    return storage


def test_refusal_says_what_single_writer_promises(s3_options):
    with pytest.raises(ExclusiveCreateUnsupportedError, match="at most one process at a time writes"):
        RollingSegment(_ignoring_store(s3_options, single_writer=False), "s").append(b"x")


def test_single_writer_serialises_the_handles_of_one_process(s3_options):
    """Two handles of one process on a store that would let the second overwrite the first's chunk."""
    storage = _ignoring_store(s3_options)
    first, stale = RollingSegment(storage, "s"), RollingSegment(storage, "s")
    assert first.append(b"aa") == 0
    assert stale.append(b"bb") == 2  # its create at 0 was refused before it was sent: it caught up
    assert RollingSegment(storage, "s").read(0, 4) == b"aabb"
    assert not storage.exclusive_create_enforced


class _OverwrittenAfterCreate(FaultyStorage):
    """Another process's blind PUT lands on our new chunk, and our response is lost."""

    def create(self, path, data):
        self.inner.create(path, data)
        self.inner.fs.pipe_file(self.inner._abs(path), b"another process's bytes")
        raise OutcomeUnknownError(f"lost response to the create of {path!r}")


def test_an_overwrite_found_by_the_read_back_is_an_error(s3_options):
    storage = _ignoring_store(s3_options)
    RollingSegment(storage, "s").append(b"probe done")
    seg = RollingSegment(_OverwrittenAfterCreate(storage, seed=1), "s")
    with pytest.raises(OutcomeUnknownError, match="overwritten"):
        seg.append(b"ours")
