"""Idle tail readers are cheap: one shared, backing-off poller per segment handle.

Requests are counted on moto's S3 server through the s3fs client (testkit/s3_requests.py).
"""

from __future__ import annotations

import threading
import time

import pytest

from attrindex import SegmentStore
from attrindex.errors import InvalidInputError, RecordTruncatedError, StorageError
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage
from tests.conftest import make_s3_url
from tests.framed import offsets, open_segment, overhead, pieces
from testkit.s3_requests import counting


@pytest.fixture
def s3_store_url(s3_options):
    return make_s3_url(s3_options), s3_options


def _seeded(url, options, **store_options):
    """A store on ``url`` holding segment ``s`` with one record; returns a second, fresh store."""
    with SegmentStore.open(url, storage_options=options) as writer:
        writer.segment("s", create=True).append([b"first"])
    return SegmentStore.open(url, storage_options=options, **store_options)


def _in_thread(fn, *args):
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # handed to the test
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_an_idle_reader_costs_at_most_one_request_per_second(s3_store_url):
    url, options = s3_store_url
    with _seeded(url, options) as store:  # the defaults: 0.05 s backing off to 1 s
        seg = store.segment("s")
        reader = seg.reader(offset=seg.next_offset)
        with counting(store.storage) as log:
            thread, out = _in_thread(reader.read, 6.5)
            time.sleep(2.5)  # the backoff reaches its maximum after 0.05 + 0.1 + ... + 0.8 s
            warm = log.total
            thread.join(10)
        assert out == {"value": None}
        steady = log.total - warm
        assert steady <= 4 + 1, log.lines  # 4 s at 1 poll/s (+1: the window's edges)
        assert log.total <= 11, log.lines  # the start of the backoff included
        assert set(log.counts) == {"GET"}, log.counts  # a poll is a 1-byte read of the next chunk, never a LIST


def test_readers_share_one_poller_so_requests_do_not_grow_with_readers(s3_store_url):
    url, options = s3_store_url
    with _seeded(url, options, min_poll_interval=0.2, max_poll_interval=0.2) as store:
        seg = store.segment("s")
        counts = []
        for n in (1, 8):
            readers = [seg.reader(offset=seg.next_offset) for _ in range(n)]
            with counting(store.storage) as log:
                threads = [_in_thread(r.read, 1.5)[0] for r in readers[:-1]]
                assert readers[-1].read(timeout=1.5) is None  # read(timeout=...) callers share it too
                for thread in threads:
                    thread.join(5)
            counts.append(log.total)
        assert counts[0] >= 3  # it does poll: 1.5 s / 0.2 s
        # Shared: about the same count (8 polling readers would make ~8x). Not "+1": under load the
        # readers' threads start up to a few polls apart, which lengthens the 8-reader window.
        assert counts[1] <= 2 * counts[0], counts


def test_a_record_appended_by_another_handle_is_seen_within_the_maximum_interval(s3_store_url):
    url, options = s3_store_url
    with _seeded(url, options, min_poll_interval=0.05, max_poll_interval=0.5) as store, \
            SegmentStore.open(url, storage_options=options) as other:
        seg = store.segment("s")
        reader = seg.reader(offset=seg.next_offset)
        assert reader.read(timeout=1.5) is None  # backed off to 0.5 s by now
        assert seg._poller.interval == 0.5
        thread, out = _in_thread(reader.read, 10)
        time.sleep(0.3)
        other.segment("s").append([b"elsewhere"])
        appended = time.monotonic()
        thread.join(10)
        seen = time.monotonic() - appended
        assert out["value"].value == b"elsewhere"
        assert seen <= 0.5 + 1.0  # the maximum interval, plus a poll and a catch-up on a loaded machine
        time.sleep(0.05)
        assert seg._poller.interval <= 0.1  # records came: the backoff started over


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_appends_through_the_same_handle_wake_readers_without_a_poll(storage_url):
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, poll_interval=60.0) as store:
        seg = store.segment("s", create=True)
        readers = [seg.reader(offset=0) for _ in range(3)]
        threads = [_in_thread(r.read, 30) for r in readers]
        time.sleep(0.2)
        started = time.monotonic()
        seg.append([b"here"])
        for thread, out in threads:
            thread.join(10)
            assert out["value"].value == b"here"
        assert time.monotonic() - started < 30  # well inside the 60 s poll interval (a loaded machine)
        assert seg._poller.polls == 0  # a 60 s interval: nothing but the append woke them


@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_close_and_cancel_end_waits_and_leave_no_thread(storage_url):
    url, options = storage_url
    before = threading.active_count()
    store = SegmentStore.open(url, storage_options=options, poll_interval=60.0)
    seg = store.segment("s", create=True)
    readers = [seg.reader(offset=0) for _ in range(4)]
    threads = [_in_thread(r.read, None) for r in readers]  # no timeout: only cancel or close ends them
    time.sleep(0.2)
    started = time.monotonic()
    readers[0].cancel()
    threads[0][0].join(5)
    assert threads[0][1] == {"value": None}
    store.close()
    for thread, out in threads[1:]:
        thread.join(5)
        assert out == {"value": None}
    assert time.monotonic() - started < 30  # woken by the close, not by the 60 s poll
    assert threading.active_count() == before


@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_rolling_poll_sees_growth_and_nothing_else(storage, backend):
    rolling = 10 + overhead(storage)  # 10 bytes of payload per chunk
    writer = open_segment(storage, "x", rolling_size=rolling)
    reader = open_segment(storage, "x", rolling_size=rolling)
    assert not reader.poll()
    stored = pieces(storage, [b"12345", b"123456", b"1"])
    for data in stored:  # grows in place, rolls (local/memory), new object (S3)
        writer.append(data)
        assert reader.poll()
        assert reader.poll()  # it only looks: the view is refreshed by refresh()
        reader.refresh()
        assert not reader.poll()
    assert len(reader.chunks()) == (2 if storage.appendable else 3)
    writer.truncate(offsets(stored)[2])
    assert not reader.poll()  # truncation is not growth
    if backend == "s3":
        with counting(storage) as log:
            reader.poll()
        assert log.counts == {"GET": 1}, log.lines


@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_a_poll_of_an_empty_view_sees_growth_that_retention_deleted_since(storage, backend):
    stored = pieces(storage, [b"0123456789"] * 4)
    at = offsets(stored)
    writer = open_segment(storage, "x", rolling_size=len(stored[0]))
    reader = open_segment(storage, "x", rolling_size=len(stored[0]))
    assert not reader.poll()
    for piece in stored:
        writer.append(piece)  # chunk after chunk
    writer.truncate(at[2])  # chunk 0, the one an empty view looks for, is gone
    assert reader.poll()
    reader.refresh()
    assert reader.start_offset == at[2] and not reader.poll()


@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_readers_made_on_an_empty_segment_follow_it_past_retention(storage_url):
    """A reader of a handle that saw the segment empty must not wait for ever once retention in
    another handle deleted the chunk the empty view polls: it reads what came, or is told."""
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, log_rolling_size=512) as a, \
            SegmentStore.open(url, storage_options=options, log_rolling_size=512, min_poll_interval=0.01,
                              max_poll_interval=0.2) as b:
        writer = a.segment("u", create=True)
        follower = b.segment("u")
        from_start, from_later = follower.reader(0), follower.reader(30)
        assert from_start.read(timeout=0.1) is None
        for i in range(40):
            writer.append([b"%02d" % i + b"x" * 60])
        assert writer.apply_retention(max_bytes=2048) > 0
        writer.append([b"more"])
        assert from_later.read(timeout=30).value.startswith(b"30")
        with pytest.raises(RecordTruncatedError, match=f"records start at {writer.start_offset}"):
            from_start.read(timeout=30)


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_a_failed_poll_is_raised_to_the_reader_and_the_next_poll_works(storage_url):
    url, options = storage_url
    faulty = FaultyStorage(open_storage(url, **options), seed=1)
    with SegmentStore(faulty, poll_interval=0.02) as store, SegmentStore.open(url) as other:
        seg = store.segment("s", create=True)
        reader = seg.reader(offset=0)
        faulty.script("fail_before", op="read", path_contains="_log.seg/00000000000000000000", times=1)
        with pytest.raises(StorageError):
            reader.read(timeout=2)
        other.segment("s").append([b"later"])
        assert reader.read(timeout=5).value == b"later"


@pytest.mark.parametrize("given", [
    dict(min_poll_interval=0), dict(max_poll_interval=float("nan")), dict(min_poll_interval=True),
    dict(min_poll_interval=2.0, max_poll_interval=1.0), dict(poll_interval="1"),
])
def test_bad_poll_intervals_are_refused_before_anything_is_opened(given):
    with pytest.raises(InvalidInputError, match="poll_interval"):
        SegmentStore.open("memory://never-created", **given)
