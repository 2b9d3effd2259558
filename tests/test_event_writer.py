"""EventWriter: exactly-once per (writer, segment, event number), through restarts and lost acks."""

from __future__ import annotations

import threading
import uuid
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _twice_at_once(attempt) -> None:
    """Run ``attempt`` in two threads at once (two copies of one writer) and wait for both."""
    threads = [threading.Thread(target=attempt) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


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

    _twice_at_once(attempt)
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


# -- a reused writer id with different events ------------------------------------------------------
def _write(writer, values, keys=None, flush_every=None):
    for i, value in enumerate(values):
        writer.write(value, None if keys is None else keys[i])
        if flush_every and i % flush_every == flush_every - 1:
            writer.flush()
    writer.flush()


@pytest.mark.parametrize("changed", ["payload", "routing key", "order"])
def test_a_reused_writer_id_with_other_events_raises_instead_of_dropping_them(store, changed):
    writer_id = uuid.uuid4()
    values, keys = [b"e%d" % i for i in range(10)], ["k"] * 10
    _write(EventWriter(store, "s", segments=1, writer_id=writer_id), values, keys)
    other_values, other_keys = list(values), list(keys)
    if changed == "payload":
        other_values[6] = b"something else"
    elif changed == "routing key":
        other_keys[3] = "k2"  # one segment: the same segment, another record key
    else:
        other_values[2], other_values[3] = other_values[3], other_values[2]
    resumed = EventWriter(store, "s", writer_id=writer_id)
    for value, key in zip(other_values[:9], other_keys[:9]):
        resumed.write(value, key)  # not yet checkable: the replay has not reached the stored number
    with pytest.raises(WriterConflictError, match="differ from the ones stored.*new writer_id"):
        resumed.write(other_values[9], other_keys[9])
    assert [v for _, _, v in stream_events(store, "s")] == values  # nothing dropped silently, nothing added
    fresh = EventWriter(store, "s", writer_id=uuid.uuid4())  # the documented way out
    _write(fresh, [b"new"])
    assert [v for _, _, v in stream_events(store, "s")] == values + [b"new"]


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
@pytest.mark.parametrize("first_batch, first_flush, second_batch", [(3, 7, 5), (1, 1, 1000), (1000, None, 2)])
def test_a_resumed_writer_with_the_same_events_passes_the_check_however_they_were_batched(
        store, first_batch, first_flush, second_batch):
    writer_id = uuid.uuid4()
    values = [b"%d" % i for i in range(60)]
    keys = [i % 4 for i in range(60)]
    first = EventWriter(store, "s", segments=2, writer_id=writer_id, batch_events=first_batch)
    _write(first, values[:45], keys[:45], flush_every=first_flush)
    second = EventWriter(store, "s", writer_id=writer_id, batch_events=second_batch)
    _write(second, values, keys)
    assert second.events_skipped == 45
    assert sorted(v for _, _, v in stream_events(store, "s")) == sorted(values)
    third = EventWriter(store, "s", writer_id=writer_id)  # the digest went on through the second life
    _write(third, values)
    with pytest.raises(WriterConflictError):
        _write(EventWriter(store, "s", writer_id=writer_id), values[:59] + [b"not 59"], keys)


def test_a_twin_that_sent_as_many_other_events_is_a_conflict_not_an_acknowledgement(store):
    """A lost-race check: the segment holds exactly as many events as this writer sent, but they are
    the other writer's; they must not be taken as this writer's acknowledgement."""
    writer_id = uuid.uuid4()
    store.create_stream("s", 1)
    mine = EventWriter(store, "s", writer_id=writer_id)
    for i in range(10):
        mine.write(b"mine %d" % i)  # queued
    theirs = EventWriter(store, "s", writer_id=writer_id)
    _write(theirs, [b"theirs %d" % i for i in range(10)])
    with pytest.raises(WriterConflictError, match="not the ones it sent"):
        mine.flush()
    assert [v for _, _, v in stream_events(store, "s")] == [b"theirs %d" % i for i in range(10)]


def test_a_number_stored_without_a_digest_is_a_conflict(store):
    """An EventWriter stores its event number and their digest in one append: a number alone under
    its id was written by something else, and the writer refuses it instead of resuming over it."""
    writer_id = uuid.uuid4()
    store.create_stream("s", 1)
    store.segment("s/0").append([b"0", b"1", b"2"], [(writer_id.bytes, 3)])
    with pytest.raises(WriterConflictError, match="event number 3 under this writer's id but no digest"):
        _write(EventWriter(store, "s", writer_id=writer_id, batch_events=2), [b"%d" % i for i in range(6)])
    assert [v for _, _, v in stream_events(store, "s")] == [b"0", b"1", b"2"]  # nothing appended


_EVENTS = st.lists(st.tuples(st.sampled_from([b"", b"a", b"b", b"ab"]), st.sampled_from([None, "k", "kk", b""])),
                   max_size=14)


@settings(max_examples=60, deadline=None)
@given(first=_EVENTS, second=_EVENTS, first_batch=st.integers(1, 4), second_batch=st.integers(1, 4),
       flush_every=st.integers(1, 5))
def test_resumed_writer_model(first, second, first_batch, second_batch, flush_every):
    """Model: a second life of one writer id on one segment (any batching) raises
    WriterConflictError exactly when the events it replays over the stored ones differ from them;
    otherwise the segment holds the first life's events then the second life's new ones."""
    with SegmentStore.open(f"memory://model-{uuid.uuid4().hex}") as store:
        writer_id = uuid.uuid4()
        life = EventWriter(store, "s", segments=1, writer_id=writer_id, batch_events=first_batch)
        for i, (payload, key) in enumerate(first):
            life.write(payload, key)
            if i % flush_every == 0:
                life.flush()
        life.flush()
        resumed = EventWriter(store, "s", writer_id=writer_id, batch_events=second_batch)
        stored = len(first)
        replayed_over = second[:stored]
        conflict = len(second) >= stored > 0 and replayed_over != first
        try:
            for payload, key in second:
                resumed.write(payload, key)
            resumed.flush()
        except WriterConflictError:
            assert conflict
            expected = first
        else:
            assert not conflict
            expected = first + second[stored:]
        key_bytes = (lambda k: None if k is None else k if isinstance(k, bytes) else k.encode())
        records = store.segment("s/0").read(0, 100)
        assert [(r.value, r.key) for r in records] == [(p, key_bytes(k)) for p, k in expected]


# -- linger: a background flusher turns a stream of small events into few appends ----
def _flusher_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("attrindex-EventWriter-flusher")]


@pytest.mark.parametrize("backend", ["memory", "s3"], indirect=True)
def test_linger_groups_a_stream_of_small_events_into_few_appends(storage_url):
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options) as store:
        writer = EventWriter(store, "s", segments=4, linger_ms=200)
        tickets = [writer.write(b"e%d" % i, routing_key=i) for i in range(2000)]
        assert all(t.wait(timeout=30) for t in tickets)
        assert writer.appends <= 4 * 4  # 4 segments, a few linger periods (nowhere near 2000)
        writer.close()
        assert sorted(v for _, _, v in stream_events(store, "s")) == sorted(b"e%d" % i for i in range(2000))
    assert _flusher_threads() == []


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_linger_acknowledges_within_linger_plus_one_append(store):
    writer = EventWriter(store, "s", segments=2, linger_ms=300)
    import time

    started = time.monotonic()
    ticket = writer.write(b"one", routing_key="k")
    assert not ticket.done  # lingering: nothing was sent yet
    assert ticket.wait(timeout=10)
    took = time.monotonic() - started
    assert 0.3 <= took < 0.3 + 3  # the linger, plus one append on a loaded machine
    assert ticket.done
    assert [v for _, _, v in stream_events(store, "s")] == [b"one"]
    writer.close()


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_linger_flush_sends_now_and_waits(store):
    import time

    writer = EventWriter(store, "s", segments=3, linger_ms=600_000)
    writer.write_many([b"%d" % i for i in range(50)], routing_keys=list(range(50)))
    started = time.monotonic()
    writer.flush()
    assert time.monotonic() - started < 60  # not the ten-minute linger (generous: a loaded machine)
    assert sorted(int(v) for _, _, v in stream_events(store, "s")) == list(range(50))
    assert writer.last_event_numbers() and sum(writer.last_event_numbers().values()) == 50
    writer.close()
    assert _flusher_threads() == []


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_linger_zero_or_none_is_the_synchronous_writer(store):
    for linger in (None, 0):
        writer = EventWriter(store, f"s{linger}", segments=1, batch_events=2, linger_ms=linger)
        writer.write(b"a")
        assert writer.appends == 0
        ticket = writer.write(b"b")  # a full batch is sent inside write, as before
        assert writer.appends == 1 and ticket.done and ticket.wait(timeout=0)
        late = writer.write(b"c")
        assert not late.done and late.wait() and writer.appends == 2  # waiting sends it (flush)
        assert _flusher_threads() == []


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_a_failed_background_append_is_raised_to_the_next_call_and_nothing_is_lost(storage_url):
    from attrindex.errors import StorageError
    from storage_adapters.faults import FaultyStorage

    url, options = storage_url
    faulty = FaultyStorage(open_storage(url, **options), seed=5)
    store = SegmentStore(faulty)
    writer_id = uuid.uuid4()
    writer = EventWriter(store, "s", segments=2, writer_id=writer_id, linger_ms=20, retries=1, retry_delay=0)
    first = writer.write_many([b"%d" % i for i in range(10)], routing_keys=list(range(10)))
    assert first.wait(timeout=10)
    faulty.script("fail_before", op="append", path_contains="_log.seg", times=1000)
    ticket = writer.write(b"10", routing_key=10)
    with pytest.raises(StorageError):
        ticket.wait(timeout=10)
    for call in (lambda: writer.write(b"11", routing_key=11), writer.flush, writer.close):
        with pytest.raises(StorageError):  # every later call, until the writer is replaced
            call()
    assert _flusher_threads() == []
    faulty.enabled = False
    resumed = EventWriter(store, "s", writer_id=writer_id, linger_ms=20)
    for i in range(12):  # the way out: a new writer with the same id replays its events
        resumed.write(b"%d" % i, routing_key=i)
    resumed.close()
    assert sorted(int(v) for _, _, v in stream_events(store, "s")) == list(range(12))
    assert resumed.events_skipped == 10


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_linger_under_lost_acknowledgements_never_duplicates_or_loses(storage_url):
    url, options = storage_url
    flaky = FlakyStorage(open_storage(url, **options), rate=0.15, seed=4)
    store = SegmentStore(flaky)
    writer = EventWriter(store, "s", segments=3, batch_events=5, retries=50, retry_delay=0, linger_ms=5)
    tickets = []
    for i in range(300):
        tickets.append(writer.write(b"%d" % i, routing_key=i % 11))
        if i % 37 == 0:
            writer.flush()
    writer.close()
    assert all(t.done for t in tickets)
    assert flaky.lost_acks > 3 and flaky.failed_writes > 3
    with SegmentStore.open(url, storage_options=options) as clean:
        assert sorted(int(v) for _, _, v in stream_events(clean, "s")) == list(range(300))


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
@pytest.mark.parametrize("given", [-1, float("nan"), float("inf"), True, "100", 3_600_001])
def test_bad_linger_is_refused_before_anything_is_created(store, given):
    with pytest.raises(InvalidInputError, match="linger_ms"):
        EventWriter(store, "never", segments=1, linger_ms=given)
    assert not store.segments()


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_leaving_the_with_block_on_an_exception_stops_the_flushers(store):
    with pytest.raises(RuntimeError):
        with EventWriter(store, "s", segments=2, linger_ms=60_000) as writer:
            writer.write(b"unsent")
            raise RuntimeError("the caller failed")
    assert _flusher_threads() == []


_KILLED_CHILD = """
import sys, time, uuid
from attrindex import EventWriter, SegmentStore
store = SegmentStore.open(sys.argv[1])
writer = EventWriter(store, "s", segments=4, writer_id=uuid.UUID(sys.argv[2]), linger_ms=30)
for i in range(400):
    writer.write(b"%d" % i, routing_key=i)
writer.flush()
print("flushed", flush=True)
i = 400
while True:  # keeps writing (the flushers keep appending in the background) until killed
    writer.write(b"%d" % i, routing_key=i)
    i += 1
    time.sleep(0.0005)
"""


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_sigkill_after_flush_keeps_every_acknowledged_event_exactly_once(storage_url):
    import os
    import signal
    import subprocess
    import sys
    import time

    url, _options = storage_url
    writer_id = uuid.uuid4()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, url, str(writer_id)], stdout=subprocess.PIPE,
                             env=env)
    try:
        assert child.stdout.readline() == b"flushed\n"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until background appends of later events are landing
            with SegmentStore.open(url) as look:
                if len(stream_events(look, "s")) > 400:
                    break
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    with SegmentStore.open(url) as store:
        stored = [int(v) for _, _, v in stream_events(store, "s")]
        assert len(stored) == len(set(stored))  # no duplicate
        assert set(range(400)) <= set(stored)  # every event acknowledged by flush() is there
        assert len(stored) > 400  # the kill landed while later events were being appended
        total = max(stored) + 50
        resumed = EventWriter(store, "s", writer_id=writer_id, linger_ms=30)
        for i in range(total):  # the restarted writer replays its input
            resumed.write(b"%d" % i, routing_key=i)
        resumed.close()
        assert sorted(int(v) for _, _, v in stream_events(store, "s")) == list(range(total))


_LINGER_OPS = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 5)),  # an event with routing key k (0: none)
    st.tuples(st.just("many"), st.integers(1, 30)),
    st.tuples(st.just("flush"), st.just(0)),
    st.tuples(st.just("wait"), st.just(0)),
    st.tuples(st.just("sleep"), st.just(0)),
), max_size=25)


@settings(max_examples=40, deadline=None)
@given(ops=_LINGER_OPS, batch=st.integers(1, 6), linger=st.sampled_from([1, 5, 20]))
def test_linger_model(ops, batch, linger):
    """Model: per segment, the events in write order (a dict of lists). With any mix of writes,
    flushes and waits, a lingering writer stores exactly the model, and an acknowledgement that
    says durable means the events are readable."""
    import time

    with SegmentStore.open(f"memory://linger-{uuid.uuid4().hex}") as store:
        writer = EventWriter(store, "s", segments=3, batch_events=batch, linger_ms=linger)
        model: dict[str, list[bytes]] = {name: [] for name in store.stream_segments("s")}
        round_robin, n, tickets = 0, 0, []

        def expect(key):
            nonlocal round_robin
            if key is None:
                index = round_robin % 3
                round_robin += 1
            else:
                index = zlib.crc32(key) % 3
            return f"s/{index}"

        for op, arg in ops:
            if op == "write":
                key = None if arg == 0 else b"k%d" % arg
                model[expect(key)].append(b"%d" % n)
                tickets.append(writer.write(b"%d" % n, routing_key=key))
                n += 1
            elif op == "many":
                payloads = [b"%d" % (n + i) for i in range(arg)]
                keys = [None if i % 4 == 0 else b"k%d" % (i % 5) for i in range(arg)]
                for payload, key in zip(payloads, keys):
                    model[expect(key)].append(payload)
                tickets.append(writer.write_many(payloads, routing_keys=keys))
                n += arg
            elif op == "flush":
                writer.flush()
                assert all(t.done for t in tickets)
            elif op == "wait" and tickets:
                assert tickets[-1].wait(timeout=30)
                durable = {name: [r.value for r in store.segment(name).read(0, 10_000)] for name in model}
                for name in model:  # what was acknowledged is a prefix of what is stored, in order
                    assert durable[name] == model[name][: len(durable[name])]
            elif op == "sleep":
                time.sleep(linger / 1000)
        writer.close()
        assert all(t.done for t in tickets)
        stored = {name: [r.value for r in store.segment(name).read(0, 10_000)] for name in model}
        assert stored == model
    assert _flusher_threads() == []


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_linger_writes_from_many_threads_are_each_stored_once(store):
    import threading

    writer = EventWriter(store, "s", segments=4, linger_ms=10, batch_events=50)

    def produce(t):
        for i in range(300):
            writer.write(b"%d-%d" % (t, i), routing_key=i)
    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    writer.close()
    stored = [v for _, _, v in stream_events(store, "s")]
    assert sorted(stored) == sorted(b"%d-%d" % (t, i) for t in range(4) for i in range(300))


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_linger_the_first_event_after_idle_is_sent_after_the_linger_not_the_idle_wait(store):
    """Flushers idle with nothing queued wait up to a second; a write into an empty queue wakes them
    so that its own linger deadline counts (without the wake-up it is sent up to 1 s late, not after
    linger_ms)."""
    import time

    writer = EventWriter(store, "s", segments=2, linger_ms=20)
    writer.write(b"warm")
    writer.flush()
    took = []
    for i in range(3):
        time.sleep(0.15)  # the flushers are back in their idle wait
        started = time.monotonic()
        assert writer.write(b"%d" % i).wait(timeout=10)
        took.append(time.monotonic() - started)
    writer.close()
    assert min(took) < 0.5, took


# -- write_arrow: events as Arrow columns, routed, numbered, digested and encoded column by column --
TS = 1_700_000_000_000
_ARROW_KEYS = {"none": None, "bytes": [b"", b"a", b"\x00k", b"user-1"], "str": ["k", "kk", "user-1", "é"],
               "int": [0, 7, 12345, -3]}


@settings(max_examples=30, deadline=None)
@given(data=st.data(), kind=st.sampled_from(sorted(_ARROW_KEYS)), segments=st.integers(1, 3),
       batch=st.integers(1, 9), cuts=st.lists(st.integers(0, 40), max_size=3))
def test_write_arrow_is_write_many_column_by_column(data, kind, segments, batch, cuts):
    """Model: events written with ``write_arrow`` (in any chunks) land where ``write_many`` puts the
    same events, as the same records; either way's digest passes a resume through the other way,
    which skips everything written and appends only the new events."""
    pa = pytest.importorskip("pyarrow")
    n = data.draw(st.integers(0, 40))
    keys = None if kind == "none" else data.draw(st.lists(st.none() | st.sampled_from(_ARROW_KEYS[kind]),
                                                          min_size=n, max_size=n))
    stamps = data.draw(st.none() | st.lists(st.none() | st.integers(TS - 10**6, TS + 10**6), min_size=n, max_size=n))
    values = [b"%d:" % i + data.draw(st.binary(max_size=6)) for i in range(n)]  # unique: rows can be matched
    key_type = {"bytes": pa.binary(), "str": pa.string(), "int": pa.int64()}.get(kind)
    bounds = sorted({0, n, *(c for c in cuts if c < n)})

    def write(writer, arrow, lo=0, hi=n):
        for start, stop in zip(bounds, bounds[1:]):
            start, stop = max(start, lo), min(stop, hi)
            if start >= stop:
                continue
            part_keys = None if keys is None else keys[start:stop]
            part_stamps = None if stamps is None else stamps[start:stop]
            if arrow:
                writer.write_arrow(pa.array(values[start:stop], pa.binary()),
                                   None if part_keys is None else pa.array(part_keys, key_type),
                                   timestamps=None if part_stamps is None else pa.array(part_stamps, pa.int64()))
            else:
                writer.write_many(values[start:stop], part_keys, timestamps=part_stamps)
        writer.flush()

    def contents(store, stream):
        out = []
        for name in store.stream_segments(stream):
            for r in store.segment(name).read(0, 1000):
                row = int(r.value.split(b":")[0])
                given = None if stamps is None else stamps[row]
                out.append((name.split("/")[1], r.offset, r.value, r.key, r.headers,
                            r.timestamp if given is not None else None))
                assert given is None or r.timestamp == given
        return out

    with SegmentStore.open(f"memory://arrow-{uuid.uuid4().hex}") as store:
        writer_id = uuid.uuid4()
        by_rows = EventWriter(store, "rows", segments=segments, writer_id=writer_id, batch_events=batch)
        write(by_rows, arrow=False)
        by_columns = EventWriter(store, "columns", segments=segments, writer_id=writer_id, batch_events=batch)
        write(by_columns, arrow=True)
        assert contents(store, "columns") == contents(store, "rows")
        assert by_columns.last_event_numbers() == {k.replace("rows", "columns"): v
                                                   for k, v in by_rows.last_event_numbers().items()}
        for stream, arrow in (("rows", True), ("columns", False)):  # a second life, through the other API
            before = contents(store, stream)
            again = EventWriter(store, stream, writer_id=writer_id, batch_events=batch)
            write(again, arrow)
            assert again.events_skipped == n and contents(store, stream) == before
            again.write_arrow(pa.array([b"new"], pa.binary())) if arrow else again.write_many([b"new"])
            again.flush()
            assert sum(again.last_event_numbers().values()) == n + 1


def test_write_arrow_refuses_a_replay_of_other_events(store):
    pa = pytest.importorskip("pyarrow")
    writer_id = uuid.uuid4()
    values = pa.array([b"e%d" % i for i in range(20)], pa.binary())
    first = EventWriter(store, "s", segments=2, writer_id=writer_id, batch_events=3)
    first.write_arrow(values, pa.array(["k%d" % (i % 3) for i in range(20)]))
    first.flush()
    resumed = EventWriter(store, "s", writer_id=writer_id)
    with pytest.raises(WriterConflictError, match="differ from the ones stored"):
        resumed.write_arrow(values, pa.array(["k%d" % (i % 2) for i in range(20)]))  # other routing keys
    assert sorted(v for _, _, v in stream_events(store, "s")) == sorted(values.to_pylist())


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_write_arrow_through_lost_acknowledgements_and_twins_writes_each_event_once(storage_url):
    pa = pytest.importorskip("pyarrow")
    import threading

    url, options = storage_url
    flaky = FlakyStorage(open_storage(url, **options), rate=0.15, seed=5)
    store = SegmentStore(flaky)
    writer = EventWriter(store, "s", segments=2, batch_events=5, retries=50, retry_delay=0)
    for start in range(0, 300, 23):
        stop = min(300, start + 23)
        writer.write_arrow(pa.array([b"%d" % i for i in range(start, stop)], pa.binary()),
                           pa.array([i % 11 for i in range(start, stop)]))
    writer.flush()
    assert flaky.lost_acks > 5 and flaky.failed_writes > 5
    with SegmentStore.open(url, storage_options=options) as clean:
        assert sorted(int(v) for _, _, v in stream_events(clean, "s")) == list(range(300))

    twin_id, barrier, errors = uuid.uuid4(), threading.Barrier(2), []

    def attempt():
        with SegmentStore.open(url, storage_options=options) as own:
            twin = EventWriter(own, "s", writer_id=twin_id, batch_events=7, shared=True)
            barrier.wait()
            try:
                for start in range(300, 700, 40):
                    twin.write_arrow(pa.array([b"%d" % i for i in range(start, start + 40)], pa.binary()),
                                     pa.array([i % 5 for i in range(start, start + 40)]))
                    twin.flush()
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors.append(exc)

    _twice_at_once(attempt)
    assert errors == []
    with SegmentStore.open(url, storage_options=options) as clean:
        assert sorted(int(v) for _, _, v in stream_events(clean, "s")) == list(range(700))


def test_write_arrow_checks_every_column_before_queueing_and_lingers_like_write_many(store):
    pa = pytest.importorskip("pyarrow")
    writer = EventWriter(store, "s", segments=2)
    for args, kwargs, message in (((pa.array([b"a", None], pa.binary()),), {}, "must not be null"),
                                  ((pa.array(["text"]),), {}, "binary array"),
                                  ((pa.array([b"a", b"b"], pa.binary()), pa.array(["k"])), {}, "keys has 1 items"),
                                  ((pa.array([b"a"], pa.binary()),), {"timestamps": pa.array([1.5])}, "int64"),
                                  (([b"a"],), {}, "pyarrow array")):
        with pytest.raises(InvalidInputError, match=message):
            writer.write_arrow(*args, **kwargs)
    writer.flush()
    assert stream_events(store, "s") == [] and sum(writer.last_event_numbers().values()) == 0
    with EventWriter(store, "s", linger_ms=5) as lingering:
        lingering.write_arrow(pa.array([b"x", b"y"], pa.binary()), pa.array([b"k", None], pa.binary()),
                              timestamps=pa.array([5, None], pa.int64())).wait(30)
    assert sorted(v for _, _, v in stream_events(store, "s")) == [b"x", b"y"]


def test_a_backlog_refusal_is_raised_at_once_not_resent(tmp_path):
    """``MergeBacklogError`` is the segment's own bound (it waited for room and wrote nothing):
    the writer raises it on the first refusal instead of waiting ``retries`` times more, and
    once the merge works again the same writer sends the events it still holds, once each."""
    from attrindex.errors import MergeBacklogError
    from storage_adapters.faults import FaultyStorage

    root = str(tmp_path / "s")
    faulty = FaultyStorage(open_storage(root), seed=5)
    store = SegmentStore(faulty, flush_keys=1, max_pending_bytes=2_000)
    writer = EventWriter(store, "s", segments=1, retries=5, retry_delay=0)
    writer.write(b"0")
    writer.flush()
    segment = store.segment("s/0")
    faulty.script("fail_before", op="append", path_contains="_attributes", times=1_000_000)
    with pytest.raises(MergeBacklogError):  # tier 1 filled by other updates while every merge fails
        for n in range(10_000):
            segment.update_attributes({(n + 1).to_bytes(16, "big"): n})
    writer.write(b"1")
    with pytest.raises(MergeBacklogError):
        writer.flush()
    assert writer.retried_appends == 0 and writer.appends == 2
    faulty.enabled = False
    writer.flush()  # the merge works again: the queued event goes out, once
    assert sorted(v for _, _, v in stream_events(store, "s")) == [b"0", b"1"]
    assert writer.last_event_numbers() == {"s/0": 2}
    store.close()


def test_a_bound_reached_below_is_raised_at_once_not_resent(tmp_path, monkeypatch):
    """``RetriesExhaustedError`` means a loop under the append (the appender's races, a catch-up's
    resyncs, S3's attempts) already retried to its bound: the writer raises it after ONE append
    instead of running those loops ``retries`` times more, keeps the events queued, and a later
    flush sends them once each."""
    from attrindex.errors import RetriesExhaustedError
    from attrindex.segment import Segment

    store = SegmentStore(open_storage(str(tmp_path / "s")))
    writer = EventWriter(store, "s", segments=1, retries=5, retry_delay=0)
    writer.write(b"0")
    writer.flush()
    calls = []
    real_append = Segment.append

    def append_at_bound(self, *args, **kwargs):
        calls.append(self.name)
        raise RetriesExhaustedError(f"segment {self.name!r}: an append lost the race to other writers "
                                    "10000 times in a row; nothing of it was written")

    monkeypatch.setattr(Segment, "append", append_at_bound)
    writer.write(b"1")
    with pytest.raises(RetriesExhaustedError):
        writer.flush()
    assert calls == ["s/0"] and writer.retried_appends == 0
    monkeypatch.setattr(Segment, "append", real_append)
    writer.flush()  # the queued event goes out, once
    assert sorted(v for _, _, v in stream_events(store, "s")) == [b"0", b"1"]
    assert writer.last_event_numbers() == {"s/0": 2}
    store.close()
