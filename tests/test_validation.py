"""Bad input is refused at the call, before any side effect, with a project error naming the argument.

Every public entry point gets garbage (None, str for int, float, bool, negative, huge, nan,
wrong-length bytes, dict where a list goes, list where a dict goes, a generator); whatever it
raises must be an ``AttrIndexError``, and bad arguments an ``InvalidInputError`` whose message
names the argument. Bad writer and store arguments leave storage byte-for-byte unchanged. A single
key where an iterable of keys is expected is refused, never taken as an iterable of its bytes.
"""

from __future__ import annotations

import os
import uuid

import pytest

from attrindex import AttributeIndex, AttributeUpdate, EventWriter, Record, SegmentStore, UpdateType
from attrindex.conditional import resolve_updates
from attrindex.errors import AttrIndexError, InvalidInputError, RecordTruncatedError
from attrindex.keys import to_key, to_update, to_value

HUGE = 1 << 70


def _generator():
    yield 1


GARBAGE = [None, "x", 1.5, True, -1, HUGE, float("nan"), float("inf"), b"\0" * 3, {}, [], "generator"]


def _snapshot(root) -> dict[str, bytes | None]:
    """Every file (with its bytes) and directory under ``root``."""
    found: dict[str, bytes | None] = {}
    for directory, subdirs, files in os.walk(root):
        for name in subdirs:
            found[os.path.join(directory, name)] = None
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[path] = f.read()
    return found


@pytest.fixture
def local_store(tmp_path):
    with SegmentStore.open(str(tmp_path / "store")) as store:
        store.segment("seg", create=True).append([b"a", b"b"])
        yield store


# -- timeouts -----------------------------------------------------------------------------------
BAD_TIMEOUTS = [float("nan"), float("inf"), -1, -0.5, True, "1", b"", [], HUGE]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_reader_timeouts_must_be_finite_and_not_negative(local_store, timeout):
    reader = local_store.segment("seg").reader(2)  # at the tail: a bad timeout would wait (nan: forever)
    with pytest.raises(InvalidInputError, match="timeout"):
        reader.read(timeout=timeout)
    with pytest.raises(InvalidInputError, match="timeout"):
        reader.read_batch(10, timeout=timeout)
    assert reader.read(timeout=0) is None and reader.read_batch(timeout=0.01) == []


def test_reader_read_batch_checks_max_records(local_store):
    reader = local_store.segment("seg").reader(0)
    for bad in (0, -1, 1.5, None, "3"):
        with pytest.raises(InvalidInputError, match="max_records"):
            reader.read_batch(bad, timeout=0)
    assert [r.value for r in reader.read_batch(5, timeout=0)] == [b"a", b"b"]


# -- nothing written by bad writer and store arguments --------------------------------------------
BAD_WRITER_ARGUMENTS = [
    ("stream", dict(stream="_reserved")), ("stream", dict(stream="a b")), ("stream", dict(stream=None)),
    ("segments", dict(segments=0)), ("segments", dict(segments=-2)), ("segments", dict(segments="2")),
    ("segments", dict(segments=1.0)), ("segments", dict(segments=True)), ("segments", dict(segments=HUGE)),
    ("writer_id", dict(writer_id="not-a-uuid")), ("writer_id", dict(writer_id=b"short")),
    ("writer_id", dict(writer_id=1.5)), ("writer_id", dict(writer_id=-1)), ("writer_id", dict(writer_id=[])),
    ("batch_events", dict(batch_events=0)), ("batch_events", dict(batch_events="10")),
    ("batch_bytes", dict(batch_bytes=None)), ("batch_bytes", dict(batch_bytes=2.5)),
    ("retries", dict(retries=-1)), ("retries", dict(retries=True)),
    ("retry_delay", dict(retry_delay=float("nan"))), ("retry_delay", dict(retry_delay=-0.1)),
    ("retry_delay", dict(retry_delay="0.1")), ("retry_delay", dict(retry_delay=float("inf"))),
    ("shared", dict(shared="yes")), ("shared", dict(shared=1)), ("shared", dict(shared=None)),
]


@pytest.mark.parametrize("argument, given", BAD_WRITER_ARGUMENTS, ids=lambda x: repr(x)[:40])
def test_a_bad_writer_argument_leaves_storage_unchanged(tmp_path, argument, given):
    root = tmp_path / "store"
    with SegmentStore.open(str(root)) as store:
        store.segment("seg", create=True).append([b"x"])
        before = _snapshot(root)
        arguments = dict(stream="events", segments=3) | given
        with pytest.raises(InvalidInputError, match=argument):
            EventWriter(store, arguments.pop("stream"), arguments.pop("segments"), **arguments)
        assert _snapshot(root) == before


BAD_STORE_OPTIONS = [
    ("log_rolling_size", dict(log_rolling_size=0)), ("log_rolling_size", dict(log_rolling_size="1")),
    ("log_rolling_size", dict(log_rolling_size=1.5)), ("log_rolling_size", dict(log_rolling_size=True)),
    ("index_interval_bytes", dict(index_interval_bytes=-1)), ("flush_keys", dict(flush_keys=None)),
    ("flush_bytes", dict(flush_bytes=[])), ("flush_seconds", dict(flush_seconds=float("nan"))),
    ("flush_seconds", dict(flush_seconds=-1)), ("flush_seconds", dict(flush_seconds="30")),
    ("poll_interval", dict(poll_interval=0)), ("poll_interval", dict(poll_interval=float("inf"))),
    ("poll_interval", dict(poll_interval=1e300)), ("poll_interval", dict(poll_interval=float("nan"))),
    ("codec", dict(codec="zip")), ("codec", dict(codec=1.5)), ("attribute_options", dict(attribute_options="x")),
    ("attribute_options", dict(attribute_options={"pagesize": 4096})), ("option", dict(no_such_option=1)),
    ("storage_options", dict(storage_options="x")), ("storage_options", dict(storage_options=[1])),
]


@pytest.mark.parametrize("argument, given", BAD_STORE_OPTIONS, ids=lambda x: repr(x)[:40])
def test_a_bad_store_option_is_refused_before_the_store_is_created(tmp_path, argument, given):
    root = tmp_path / "store"
    with pytest.raises(InvalidInputError, match=argument):
        SegmentStore.open(str(root), **given)
    assert not root.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options", [dict(page_size=3), dict(rolling_size=0), dict(value_cache_entries=-1),
                                     dict(value_cache_entries="x"), dict(compaction="sometimes"),
                                     dict(cache_bytes=1.5)], ids=repr)
def test_bad_attribute_options_leave_no_segment_marker(tmp_path, options):
    root = tmp_path / "store"
    with SegmentStore.open(str(root), attribute_options=options) as store:
        before = _snapshot(root)
        with pytest.raises(InvalidInputError, match=next(iter(options))):
            store.segment("seg", create=True)
        assert _snapshot(root) == before
        assert not store.exists("seg")


# -- events and records are checked at the call ---------------------------------------------------
BAD_EVENTS = [
    ("timestamp", dict(timestamp=1.5)), ("timestamp", dict(timestamp=True)), ("timestamp", dict(timestamp="1")),
    ("timestamp", dict(timestamp=1 << 63)), ("timestamp", dict(timestamp=-(1 << 63) - 1)),
    ("header", dict(headers=[("h", "a str value")])), ("header", dict(headers=[(1, b"v")])),
    ("header", dict(headers=[("h",)])), ("headers", dict(headers="h=v")), ("headers", dict(headers={"h": b"v"})),
    ("headers", dict(headers=5)), ("payload", dict(payload="a str")), ("payload", dict(payload=None)),
    ("payload", dict(payload=7)), ("routing key", dict(routing_key=1.5)), ("routing key", dict(routing_key=[1])),
]


@pytest.mark.parametrize("argument, given", BAD_EVENTS, ids=lambda x: repr(x)[:40])
def test_a_bad_event_raises_at_write_and_good_events_still_flush(local_store, argument, given):
    writer = EventWriter(local_store, "events", segments=1, batch_events=100)
    writer.write(b"good-1", "k", timestamp=1_700_000_000_000, headers=[("h", b"v")])
    event = dict(payload=b"bad", routing_key="k") | given
    with pytest.raises(InvalidInputError, match=argument):
        writer.write(event.pop("payload"), **event)
    bad_many = dict(payloads=[b"good?", b"bad"], routing_keys=["k", "k"], timestamps=[None, None],
                    headers=[(), ()])
    column = {"timestamp": "timestamps", "header": "headers", "headers": "headers", "payload": "payloads",
              "routing key": "routing_keys"}[argument]
    bad_many[column][1] = next(iter(given.values()))
    with pytest.raises(InvalidInputError, match=argument):
        writer.write_many(bad_many.pop("payloads"), bad_many.pop("routing_keys"), **bad_many)
    writer.write(b"good-2", "k")
    writer.flush()  # the bad events were never queued: nothing blocks the good ones
    seg = local_store.segment("events/0")
    assert [(r.value, r.key) for r in seg.read(0)] == [(b"good-1", b"k"), (b"good-2", b"k")]
    assert seg.read(0)[0].headers == (("h", b"v"),) and seg.read(0)[0].timestamp == 1_700_000_000_000


@pytest.mark.parametrize("argument, bad", [
    ("records", None), ("records", 5), ("records", b"one value"), ("value", ["str"]),
    ("timestamp", [Record(b"x", timestamp=1.5)]), ("timestamp", [Record(b"x", timestamp=True)]),
    ("key", [Record(b"x", key="k")]), ("header", [Record(b"x", headers=[("h", "v")])]),
    ("headers", [Record(b"x", headers="hv")]), ("attribute updates", None),
], ids=repr)
def test_bad_records_and_updates_are_refused_before_appending(local_store, argument, bad):
    seg = local_store.segment("seg")
    call = (lambda: seg.append([b"x"], bad)) if argument == "attribute updates" else (lambda: seg.append(bad))
    with pytest.raises(InvalidInputError, match=argument):
        call()
    assert seg.next_offset == 2
    assert seg.append([b"c"]).first_offset == 2


# -- mappings and None for attribute updates -----------------------------------------------------
def test_update_attributes_takes_a_mapping_and_refuses_none(local_store):
    seg = local_store.segment("seg")
    seg.update_attributes({7: 1, 8: None, uuid.UUID(int=9): 3})
    assert seg.get_attributes([7, 8, 9]) == [1, None, 3]
    seg.update_attributes({7: None})
    assert seg.get_attribute(7) is None
    for bad in (None, 5, "k", AttributeUpdate(1, value=1)):
        with pytest.raises(InvalidInputError, match="attribute updates"):
            seg.update_attributes(bad)
    with pytest.raises(InvalidInputError, match="attribute updates"):
        seg.append([b"x"], attribute_updates=None)
    assert seg.next_offset == 2


def test_index_update_refuses_none_and_non_pairs(tmp_path):
    index = AttributeIndex.open(str(tmp_path / "index"))
    for bad in (None, 5, "xy", b"\0" * 3, [1], _generator()):
        with pytest.raises(InvalidInputError, match="updates|update 0"):
            index.update(bad)
    index.update({1: 5})
    assert index.get(1) == 5


def test_update_type_by_unknown_id_or_name_is_an_input_error():
    assert UpdateType("accumulate") is UpdateType.ACCUMULATE and UpdateType(4) is UpdateType.REPLACE_IF_EQUALS
    for bad in (None, 9, -1, 1.5, "sometimes", b"x"):
        with pytest.raises(InvalidInputError, match="update type"):
            UpdateType(bad)


# -- a reader overtaken by retention --------------------------------------------------------------
def test_a_reader_overtaken_by_retention_gets_record_truncated_error(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root, log_rolling_size=1024) as mine, SegmentStore.open(root, log_rolling_size=1024) as other:
        seg = mine.segment("s", create=True)
        for _ in range(40):
            seg.append([b"x" * 200])
        reader = seg.reader(0)  # behind, with this handle's view still starting at 0
        assert other.segment("s").apply_retention(start_offset=30) > 0  # deletes the chunks under it
        with pytest.raises(RecordTruncatedError) as caught:
            reader.read(timeout=1)
        assert caught.value.offset == 0 and caught.value.start_offset == 30
        with pytest.raises(RecordTruncatedError):  # still at 0: it says so again, never skips silently
            reader.read_batch(100, timeout=0)
        stale = SegmentStore.open(root, log_rolling_size=1024)
        stale_segment = stale.segment("s")  # its view: records from 0 on
        assert other.segment("s").apply_retention(start_offset=35) > 0
        with pytest.raises(RecordTruncatedError, match="records start at 35"):
            stale_segment.read(30)
        stale.close()


# -- garbage at every entry point -----------------------------------------------------------------
def _entry_points(store, tmp_path):
    """``(name, argument named in the message, call)`` for every public entry point and argument."""
    seg = store.segment("seg")
    reader = seg.reader(seg.next_offset)
    index = AttributeIndex.open(str(tmp_path / "index"))
    full_index = AttributeIndex.open(f"memory://validation-{uuid.uuid4().hex}", page_size=256)
    full_index.update({i: i for i in range(200)})  # several pages: split_keys has levels to walk
    writer = EventWriter(store, "w", 2)
    return [
        # A str is a valid path: keep it under tmp_path, never the working directory.
        ("SegmentStore.open", "url", lambda g: SegmentStore.open(str(tmp_path / g) if isinstance(g, str) else g)),
        ("SegmentStore.open", "storage_options", lambda g: SegmentStore.open("memory://v", storage_options=g)),
        ("SegmentStore.open", "log_rolling_size", lambda g: SegmentStore.open("memory://v", log_rolling_size=g)),
        ("SegmentStore.open", "flush_seconds", lambda g: SegmentStore.open("memory://v", flush_seconds=g)),
        ("SegmentStore.open", "poll_interval", lambda g: SegmentStore.open("memory://v", poll_interval=g)),
        ("SegmentStore.open", "attribute_options", lambda g: SegmentStore.open("memory://v", attribute_options=g)),
        ("SegmentStore.open", "codec", lambda g: SegmentStore.open("memory://v", codec=g)),
        ("segment", "name", lambda g: store.segment(g)),
        ("segment", "create", lambda g: store.segment("new", create=g)),
        ("exists", "name", lambda g: store.exists(g)),
        ("segments", "prefix", lambda g: store.segments(g)),
        ("create_stream", "name", lambda g: store.create_stream(g, 1)),
        ("create_stream", "segments", lambda g: store.create_stream("st", g)),
        ("stream_segments", "name", lambda g: store.stream_segments(g)),
        ("append", "record", lambda g: seg.append(g)),
        ("append", "attribute updates", lambda g: seg.append([b"x"], g)),
        ("append", "expected_offset", lambda g: seg.append([b"x"], expected_offset=g)),
        ("append", "timestamp", lambda g: seg.append([b"x"], timestamp=g)),
        ("append", "codec", lambda g: seg.append([b"x"], codec=g)),
        ("update_attributes", "attribute updates", lambda g: seg.update_attributes(g)),
        ("update_attributes", "expected_offset", lambda g: seg.update_attributes({1: 1}, g)),
        ("get_attribute", "key", lambda g: seg.get_attribute(g)),
        ("get_attributes", "key", lambda g: seg.get_attributes(g)),
        ("attributes", "key", lambda g: list(seg.attributes(g))),
        ("attribute_split_keys", "parts", lambda g: seg.attribute_split_keys(g)),
        ("read", "offset", lambda g: seg.read(g)),
        ("read", "max_records", lambda g: seg.read(0, g)),
        ("read", "max_bytes", lambda g: seg.read(0, 10, max_bytes=g)),
        ("reader", "offset", lambda g: seg.reader(g)),
        ("reader", "timestamp", lambda g: seg.reader(timestamp=g)),
        ("offset_for_timestamp", "timestamp", lambda g: seg.offset_for_timestamp(g)),
        ("apply_retention", "max_age_ms", lambda g: seg.apply_retention(g)),
        ("apply_retention", "max_bytes", lambda g: seg.apply_retention(max_bytes=g)),
        # (None means "wait forever", and the reader is at the tail: 0 stands for it)
        ("SegmentReader.read", "timeout", lambda g: reader.read(timeout=0 if g is None else g)),
        ("SegmentReader.read_batch", "max_records", lambda g: reader.read_batch(g, timeout=0)),
        ("SegmentReader.read_batch", "timeout", lambda g: reader.read_batch(1, timeout=0 if g is None else g)),
        ("EventWriter", "stream", lambda g: EventWriter(store, g, 1)),
        ("EventWriter", "segments", lambda g: EventWriter(store, "w2", g)),
        ("EventWriter", "writer_id", lambda g: EventWriter(store, "w", writer_id=g)),
        ("EventWriter", "batch_events", lambda g: EventWriter(store, "w", batch_events=g)),
        ("EventWriter", "retry_delay", lambda g: EventWriter(store, "w", retry_delay=g)),
        ("EventWriter", "shared", lambda g: EventWriter(store, "w", shared=g)),
        ("write", "payload", lambda g: writer.write(g)),
        ("write", "routing key", lambda g: writer.write(b"x", g)),
        ("write", "timestamp", lambda g: writer.write(b"x", timestamp=g)),
        ("write", "header", lambda g: writer.write(b"x", headers=g)),
        ("write_many", "payload", lambda g: writer.write_many(g)),
        ("write_many", "routing", lambda g: writer.write_many([b"x"], g)),
        ("write_many", "timestamp", lambda g: writer.write_many([b"x"], timestamps=g)),
        ("write_many", "header", lambda g: writer.write_many([b"x"], headers=g)),
        ("segment_for", "routing key", lambda g: writer.segment_for(g)),
        ("AttributeUpdate", "key", lambda g: AttributeUpdate(g)),
        ("AttributeUpdate", "update type", lambda g: AttributeUpdate(1, g, 1)),
        ("AttributeUpdate", "value", lambda g: AttributeUpdate(1, UpdateType.REPLACE, g)),
        ("AttributeUpdate", "compare", lambda g: AttributeUpdate(1, UpdateType.REPLACE_IF_EQUALS, 1, g)),
        ("resolve_updates", "update", lambda g: resolve_updates(g, lambda keys: [None] * len(keys))),
        ("UpdateType", "update type", lambda g: UpdateType(g)),
        ("to_key", "key", to_key),
        ("to_value", "value", to_value),
        ("to_update", "value", to_update),
        ("AttributeIndex.open", "page_size", lambda g: AttributeIndex.open("memory://vi", page_size=g)),
        ("AttributeIndex.get", "key", lambda g: index.get(g)),
        ("AttributeIndex.update", "update", lambda g: index.update(g)),
        ("AttributeIndex.items", "key", lambda g: list(index.items(g))),
        ("AttributeIndex.split_keys", "parts", lambda g: full_index.split_keys(g)),
        ("AttributeIndex.bulk_load", "progress", lambda g: index.bulk_load([(1, 1)], progress=g)),
        ("AttributeIndex.verify", "progress", lambda g: index.verify(progress=g)),
        ("AttributeIndex.verify_at", "progress", lambda g: AttributeIndex.verify_at("memory://vi", progress=g)),
        ("AttributeIndex.update", "checkpoint", lambda g: index.update({1: 1}, checkpoint=g)),
    ]


def test_garbage_at_every_entry_point_raises_only_project_errors_naming_the_argument(tmp_path):
    """No bare TypeError/ValueError/KeyError/AttributeError, and no hang, for any garbage."""
    refused = 0
    with SegmentStore.open(str(tmp_path / "store")) as store:
        store.segment("seg", create=True).append([b"a"])
        for name, argument, call in _entry_points(store, tmp_path):
            for garbage in GARBAGE:
                given = _generator() if garbage == "generator" else garbage
                try:
                    call(given)
                except InvalidInputError as exc:
                    refused += 1
                    assert argument.lower() in str(exc).lower(), f"{name}({argument}={garbage!r}): {exc}"
                except AttrIndexError:
                    refused += 1  # e.g. SegmentNotFoundError for a well-formed name that does not exist
                except Exception as exc:  # noqa: BLE001 - the point of the test
                    pytest.fail(f"{name}({argument}={garbage!r}) raised {type(exc).__name__}: {exc}")
    assert refused > 0.75 * len(GARBAGE) * 70


@pytest.mark.parametrize("call", [
    lambda root: AttributeIndex.open(root, storage_options=1.5),
    lambda root: AttributeIndex.open(root, storage_options="x"),
    lambda root: AttributeIndex.repair_at(root, name=None),
    lambda root: AttributeIndex.verify_at(root, name=5),
    lambda root: AttributeIndex.repair_at(root, name="../x"),
], ids=["options-float", "options-str", "repair-name-none", "verify-name-int", "repair-name-dotdot"])
def test_index_opens_refuse_bad_options_and_names_before_touching_storage(tmp_path, call):
    root = str(tmp_path / "idx")
    with pytest.raises(InvalidInputError):
        call(root)
    assert not os.path.exists(root)


@pytest.mark.parametrize("index_class", ["AttributeIndex", "TreeIndex"])
def test_open_with_bad_options_creates_no_index(tmp_path, index_class):
    """Both index classes share ``open``: options are checked by a handle built before the index's
    marker is written, so a bad option leaves nothing behind (a later mode="r" open finds none)."""
    from attrindex.errors import IndexNotFoundError
    from attrindex.tree_index import TreeIndex

    cls = AttributeIndex if index_class == "AttributeIndex" else TreeIndex
    with pytest.raises(InvalidInputError, match="page_size"):
        cls.open(str(tmp_path), page_size=-1)
    with pytest.raises(IndexNotFoundError):
        cls.open(str(tmp_path), mode="r")


# -- a single key where keys are expected ------------------------------------------------------------
SINGLE_KEYS = [b"x" * 16, bytearray(b"x" * 16), memoryview(b"x" * 16), "x" * 16, uuid.UUID(int=7), 7]
NOT_ITERABLE = [None, 7.5]


@pytest.mark.parametrize("keys", SINGLE_KEYS + NOT_ITERABLE,
                         ids=lambda keys: f"memoryview({bytes(keys)!r})" if isinstance(keys, memoryview) else repr(keys))
def test_get_many_refuses_a_single_key(keys):
    with AttributeIndex.open(f"memory://single-key-{uuid.uuid4().hex}") as idx:
        idx.update({b"x" * 16: 1})
        with pytest.raises(InvalidInputError, match="iterable of keys"):
            idx.get_many(keys)
        assert idx.get_many([b"x" * 16]) == [1] and idx.get_many(iter([7])) == [None]
