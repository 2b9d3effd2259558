"""Opening a segment on S3 costs a few requests, and reads never ask for files that do not exist.

Counted on moto's server through the s3fs client (tests/s3_requests.py). Before (issue 12):
``SegmentStore.open`` + ``segment()`` = 3 GET + 3 HEAD + 6 LIST; every sealed chunk read cold
cost a GET of an index file that S3 segments never have.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest

from attrindex import SegmentStore
from attrindex.errors import RecordTruncatedError
from attrindex.listing import ListedStorage
from tests.conftest import make_s3_url
from tests.s3_requests import counting


@pytest.fixture
def s3_url(s3_options):
    return make_s3_url(s3_options), s3_options


def _write(url, options, appends: int, name: str = "s") -> None:
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment(name, create=True)
        for i in range(appends):
            seg.append([b"r%d" % i], [(i, i)])
        seg.flush()  # the attributes' B+tree covers the log: opening replays nothing


@pytest.mark.parametrize("appends", [1, 40])
def test_opening_an_existing_segment_lists_once_and_reads_two_objects(s3_url, appends):
    url, options = s3_url
    _write(url, options, appends)
    store = SegmentStore.open(url, storage_options=options)
    opened = store.storage.requests  # this store's own client: every request it sent
    seg = store.segment("s")
    segment_open = store.storage.requests - opened
    assert opened.by_kind() == {"PUT": 0, "GET": 0, "LIST": 0, "HEAD": 1, "DELETE": 0}  # the store marker
    # One LIST of the segment's directory (marker, log, index files, gaps, B+tree), then one GET
    # of the B+tree's footer and one of the log's last chunk (the next offset is in it).
    assert segment_open.by_kind() == {"PUT": 0, "GET": 2, "LIST": 1, "HEAD": 0, "DELETE": 0}
    assert seg.next_offset == appends and seg.get_attribute(appends - 1) == appends - 1
    store.close()


def test_cold_reads_never_ask_for_chunk_index_files_s3_segments_do_not_have(s3_url):
    url, options = s3_url
    _write(url, options, 40)  # 40 chunk objects of one batch each: no index files
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        with counting(store.storage) as log:
            records = seg.read(0, 1000)
            assert [r.value for r in records] == [b"r%d" % i for i in range(40)]
            read = log.total
            assert seg.chunk_offsets() == [(i, i + 1) for i in range(40)]
        assert not [line for line in log.lines if "/_index/" in line[1]], log.lines
        assert set(log.counts) == {"GET"}, log.lines
        # The read: each chunk once, plus one per chunk the offset search summarises (was three:
        # the missing index file, a header, the scan). Summaries of the rest: one GET per chunk.
        assert read <= 40 + 8, log.lines
        assert log.total - read <= 40, log.lines


def test_index_files_that_exist_are_still_used(tmp_path):
    """Where sealed chunks hold several batches (local disk), a fresh handle reads their index files."""
    root = str(tmp_path / "store")
    with SegmentStore.open(root, log_rolling_size=300) as store:
        seg = store.segment("s", create=True)
        for i in range(60):
            seg.append([b"record %d" % i])
    with SegmentStore.open(root, log_rolling_size=300) as store:
        seg = store.segment("s")
        storage = seg._log.storage
        read = storage.read
        paths = []
        storage.read = lambda path, start, end: (paths.append(path), read(path, start, end))[1]
        try:
            assert [r.value for r in seg.read(0, 100)] == [b"record %d" % i for i in range(60)]
            offsets = seg.chunk_offsets()
        finally:
            del storage.read
        assert offsets[0][0] == 0 and offsets[-1][1] == 60 and len(offsets) > 3
        assert [p for p in paths if "/_index/" in p], paths


def test_opening_beside_a_writer_and_retention_sees_a_consistent_segment(s3_url):
    url, options = s3_url
    with SegmentStore.open(url, storage_options=options) as store:
        store.segment("s", create=True).append([b"0"])
    stop = threading.Event()
    errors = []

    def writer():
        try:
            with SegmentStore.open(url, storage_options=options) as own:
                seg, i = own.segment("s"), 1
                while not stop.is_set():
                    seg.append([b"%d" % i])
                    i += 1
                    if i % 5 == 0:
                        seg.apply_retention(start_offset=i - 3)  # deletes chunks under the openers
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        deadline = time.monotonic() + 3
        opens = 0
        while time.monotonic() < deadline:
            with SegmentStore.open(url, storage_options=options) as store:
                seg = store.segment("s")
                start = seg.start_offset
                try:
                    records = seg.read(start, 100)
                except RecordTruncatedError:  # retention moved on since: the clear error, not a wrong answer
                    records = seg.read(seg.start_offset, 100)
                    start = records[0].offset if records else start
                values = [int(r.value) for r in records]
                assert values == list(range(start, start + len(values)))
                assert seg.next_offset >= start + len(values)
                opens += 1
    finally:
        stop.set()
        thread.join(30)
    assert errors == [] and opens >= 3


def test_listed_storage_answers_each_directory_twice_at_most_then_lives(tmp_path):
    from storage_adapters import open_storage

    inner = open_storage(f"memory://listed-{id(tmp_path)}")
    inner.put_marker("seg/_log.seg/00000000000000000000")
    listing = inner.list_files("seg")
    inner.put_marker("seg/_log.seg/00000000000000000007")  # written after the listing
    listed = ListedStorage(inner, "seg", listing)
    old = {"00000000000000000000": 0}
    assert listed.list_files("seg/_log.seg") == old
    assert listed.list_files("seg/_log.seg") == old
    assert len(listed.list_files("seg/_log.seg")) == 2  # the third look is live
    assert listed.list_files("seg/_gaps") == {}
    assert listed.list_files("other") == {}  # outside the listing: live
    with pytest.raises(FileNotFoundError):
        listed.read("seg/_log.seg/00000000000000000099", 0, 1)
    assert listed.expired  # a listed view that misses a file is stale: everything is live now
    assert len(listed.list_files("seg/_gaps/")) == 0 and len(listed.list_files("seg")) == 2
    again = ListedStorage(inner, "seg", listing)
    again.put_marker("seg/_gaps/x")
    assert again.expired and "_gaps/x" in again.list_files("seg")


@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_a_stale_handle_reads_its_start_offset_after_retention_elsewhere(storage_url):
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, log_rolling_size=64) as writer_store, \
            SegmentStore.open(url, storage_options=options, log_rolling_size=64) as stale_store:
        writer = writer_store.segment("s", create=True)
        for i in range(20):
            writer.append([b"record %d" % i])
        writer.flush()  # the B+tree covers the log: the stale handle opens at its end, never reading chunk 0
        stale = stale_store.segment("s")  # opened before the retention below: its view starts at 0
        writer.apply_retention(start_offset=12)
        assert stale.start_offset in (0, 12)  # its view, or the new one after a look: not a raw TruncatedError
        assert [r.value for r in stale.read(12, 100)] == [b"record %d" % i for i in range(12, 20)]
        stale.refresh()
        assert stale.start_offset == writer.start_offset == 12


def test_a_segment_opened_from_one_listing_keeps_its_storage_s_nature_and_counters(s3_url):
    url, options = s3_url
    _write(url, options, 2)
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        storage = seg._log.bytes.storage
        assert isinstance(storage, ListedStorage) and storage.expired  # live once the open is over
        assert storage.deletion_grace == store.storage.deletion_grace  # not the base class's default
        assert storage.exclusive_create_enforced == store.storage.exclusive_create_enforced
        before = store.storage.requests
        seg.append([b"one more"])
        assert (store.storage.requests - before).by_kind() == {"PUT": 1, "GET": 0, "LIST": 0, "HEAD": 0, "DELETE": 0}
        assert seg.stats().requests == store.storage.requests  # the store's counters, nothing counted twice
