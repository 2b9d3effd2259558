"""EventWriter: exactly-once per (writer, segment, event number), through restarts and lost acks."""

from __future__ import annotations

import uuid
import zlib

import pytest

from attrindex import EventWriter, SegmentStore
from attrindex.errors import InvalidInputError, StreamNotFoundError, WriterConflictError
from tests.flaky import FlakyStorage
from storage_adapters import open_storage


def stream_events(store, stream):
    out = []
    for name in store.stream_segments(stream):
        seg = store.segment(name)
        seg.refresh()
        out.extend((name, r.key, r.value) for r in seg.read(0, 1_000_000))
    return out


@pytest.fixture
def store(storage_url):
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options) as opened:
        yield opened


def test_events_route_by_key_and_arrive_once(store):
    writer = EventWriter(store, "orders", segments=4, batch_events=7)
    for i in range(60):
        writer.write(b"e%d" % i, routing_key=f"customer-{i % 5}")
    writer.flush()
    events = stream_events(store, "orders")
    assert sorted(v for _, _, v in events) == sorted(b"e%d" % i for i in range(60))
    for name, routing, _ in events:  # a routing key always maps to the same, stable segment
        assert name == f"orders/{zlib.crc32(routing) % 4}"
    assert sum(writer.last_event_numbers().values()) == 60


def test_stream_must_exist_or_be_created(store):
    with pytest.raises(StreamNotFoundError):
        EventWriter(store, "missing")
    EventWriter(store, "s", segments=2)
    with pytest.raises(InvalidInputError, match="has 2 segments"):
        EventWriter(store, "s", segments=3)
    with pytest.raises(InvalidInputError):
        EventWriter(store, "s", writer_id="not-a-uuid")


def test_a_restarted_writer_skips_what_it_already_wrote(store):
    writer_id = uuid.uuid4()
    first = EventWriter(store, "s", segments=3, writer_id=writer_id)
    for i in range(50):
        first.write(b"%d" % i, routing_key=i)
    first.flush()
    # A crash before flushing: 10 more events queued but never sent.
    for i in range(50, 60):
        first.write(b"%d" % i, routing_key=i)
    second = EventWriter(store, "s", writer_id=writer_id)
    for i in range(80):  # the restarted writer replays its input from the beginning
        second.write(b"%d" % i, routing_key=i)
    second.flush()
    assert second.events_skipped == 50
    assert sorted(int(v) for _, _, v in stream_events(store, "s")) == list(range(80))


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_lost_acknowledgements_and_timeouts_never_duplicate_or_lose(storage_url):
    url, options = storage_url
    flaky = FlakyStorage(open_storage(url, **options), rate=0.15, seed=3)
    store = SegmentStore(flaky)
    writer = EventWriter(store, "s", segments=2, batch_events=5, retries=50, retry_delay=0)
    for i in range(300):
        writer.write(b"%d" % i, routing_key=i % 11)
        if i % 13 == 0:
            writer.flush()
    writer.flush()
    assert flaky.lost_acks > 5 and flaky.failed_writes > 5
    with SegmentStore.open(url, storage_options=options) as clean:
        assert sorted(int(v) for _, _, v in stream_events(clean, "s")) == list(range(300))


def _twins(url, options, shared, events=400):
    """Two copies of one writer (separate store handles, as two task attempts have) writing the same
    events at the same time; returns what each raised."""
    import threading

    writer_id = uuid.uuid4()
    with SegmentStore.open(url, storage_options=options) as setup:
        setup.create_stream("s", 2)
    errors = []
    barrier = threading.Barrier(2)

    def attempt():
        with SegmentStore.open(url, storage_options=options) as own:
            writer = EventWriter(own, "s", writer_id=writer_id, batch_events=7, shared=shared)
            barrier.wait()
            try:
                for i in range(events):
                    writer.write(b"%d" % i, routing_key=i % 5)
                    if i % 50 == 0:
                        writer.flush()
                writer.flush()
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors.append(exc)

    threads = [threading.Thread(target=attempt) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_shared_twins_write_every_event_exactly_once(storage_url):
    url, options = storage_url
    assert _twins(url, options, shared=True) == []
    with SegmentStore.open(url, storage_options=options) as clean:
        assert sorted(int(v) for _, _, v in stream_events(clean, "s")) == list(range(400))


@pytest.mark.parametrize("shared", [True, False])
def test_a_twin_that_got_further_is_skipped_only_when_shared(store, shared):
    writer_id = uuid.uuid4()
    store.create_stream("s", 1)
    first = EventWriter(store, "s", writer_id=writer_id, shared=shared)
    for i in range(10):
        first.write(b"%d" % i)  # queued, not sent yet
    twin = EventWriter(store, "s", writer_id=writer_id, shared=shared)
    for i in range(20):
        twin.write(b"%d" % i)
    twin.flush()
    if not shared:
        with pytest.raises(WriterConflictError, match="another writer using the same id"):
            first.flush()
        return
    first.flush()  # finds the segment at event 20, past the 10 it queued: the twin wrote them
    for i in range(10, 30):
        first.write(b"%d" % i)
    first.flush()
    assert first.events_skipped == 20
    assert [int(v) for _, _, v in stream_events(store, "s")] == list(range(30))


def test_write_many_is_write_in_a_loop(storage_url):
    """The bulk path routes, numbers and skips exactly as write() does, for every key type."""
    url, options = storage_url
    rows = [(b"%d" % i, [f"k{i % 7}", b"b%d" % (i % 3), i % 5, None][i % 4], 1_700_000_000_000 + i,
             [("h", b"%d" % i)] if i % 10 == 0 else ()) for i in range(250)]
    with SegmentStore.open(url, storage_options=options) as store:
        one = EventWriter(store, "one", segments=3, batch_events=16)
        for value, key, stamp, headers in rows:
            one.write(value, key, timestamp=stamp, headers=headers)
        one.flush()
        many = EventWriter(store, "many", segments=3, batch_events=16)
        columns = list(zip(*rows))
        many.write_many(list(columns[0][:100]), list(columns[1][:100]), timestamps=list(columns[2][:100]),
                        headers=list(columns[3][:100]))
        many.write_many(list(columns[0][100:]), list(columns[1][100:]), timestamps=list(columns[2][100:]),
                        headers=list(columns[3][100:]))
        many.flush()

        def contents(stream):
            return [[(r.value, r.key, r.timestamp, r.headers, r.offset) for r in store.segment(n).read(0, 1000)]
                    for n in store.stream_segments(stream)]

        assert contents("many") == contents("one")
        again = EventWriter(store, "many", writer_id=many.writer_id)  # a restart: everything is skipped
        again.write_many([v for v, *_ in rows], [k for _, k, *_ in rows])
        again.flush()
        assert again.events_skipped == 250 and contents("many") == contents("one")
        with pytest.raises(InvalidInputError, match="routing_keys has 1 items for 2 payloads"):
            again.write_many([b"a", b"b"], ["k"])
        with pytest.raises(InvalidInputError, match="payload must be bytes"):
            again.write_many(["text"])
