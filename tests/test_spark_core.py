"""The Spark-free core of the PySpark integration: options, the exactly-once ingest protocol, scan
planning, attribute split keys and the Arrow conversions. No SparkSession is started here."""

from __future__ import annotations

import collections
import random
import time
import uuid
import zlib

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attrindex import AttributeIndex, Record, SegmentStore
from attrindex.errors import CorruptDataError, InvalidInputError, InvalidKeyError
from attrindex.spark import arrow, ingest
from attrindex.spark.ingest import (
    CommitLedger,
    EventColumns,
    Faults,
    InjectedFailure,
    StreamTarget,
    TaskReport,
    abort_write,
    commit_write,
    publish,
    query_token,
    stage_attempt,
    staging_dir,
    task_writer_id,
    write_direct,
    write_token,
)
from attrindex.spark.options import Options
from attrindex.log.columnar import records_to_arrow
from attrindex.spark.scan import READ_CHUNK, ScanBounds, ScanRange, _split, plan_scan, scan
from storage_adapters import open_storage

BASE_TS = 1_700_000_000_000


# =============================================================================================
# Options
# =============================================================================================
def test_options_lookups_are_case_insensitive():
    opts = Options({"keyColumn": "id", "PATH": "/data", "batchEvents": "5"}, "attrindex")
    # Spark hands the options over lower-cased; we look up by any spelling.
    assert opts.raw == {"keycolumn": "id", "path": "/data", "batchevents": "5"}
    assert opts.has("keyColumn") and opts.has("KEYCOLUMN") and opts.has("path")
    assert not opts.has("stream")
    assert opts.required("keyColumn", "the key column") == "id"
    assert opts.required("Path", "where") == "/data"
    assert opts.text("KeyColumn") == "id"
    assert opts.text("missing") is None
    assert opts.text("missing", "fallback") == "fallback"
    assert opts.integer("batchEvents") == 5


@pytest.mark.parametrize("raw", [{}, {"keycolumn": ""}, {"keycolumn": "   "}])
def test_options_required_error_names_the_option_as_the_user_writes_it(raw):
    opts = Options(raw, "attrindex.attributes")
    with pytest.raises(InvalidInputError) as info:
        opts.required("keyColumn", "the column holding keys")
    message = str(info.value)
    assert message.startswith("attrindex.attributes: ")
    assert "'keyColumn'" in message and "keycolumn" not in message
    assert "the column holding keys" in message


def test_options_integer_parsing_and_minimum():
    opts = Options({"n": " 42 ", "neg": "-3", "bad": "4.5", "word": "many"}, "src")
    assert opts.integer("N") == 42
    assert opts.integer("neg") == -3
    assert opts.integer("absent") is None
    assert opts.integer("absent", 7) == 7
    assert opts.integer("absent", 7, minimum=100) == 7  # a default is not checked
    assert opts.integer("n", minimum=42) == 42
    with pytest.raises(InvalidInputError, match=r"src: the option 'Neg' must be >= 0, got -3"):
        opts.integer("Neg", minimum=0)
    for name in ("bad", "word"):
        with pytest.raises(InvalidInputError, match=rf"the option '{name}' must be an integer"):
            opts.integer(name)


def test_options_choice():
    opts = Options({"mode": " STAGED ", "other": "sideways"}, "src")
    assert opts.choice("Mode", ("direct", "staged"), "direct") == "staged"
    assert opts.choice("absent", ("direct", "staged"), "direct") == "direct"
    assert opts.choice("absent", ("direct", "staged"), "DIRECT") == "direct"
    with pytest.raises(InvalidInputError, match=r"'other' must be one of direct, staged; got 'sideways'"):
        opts.choice("other", ("direct", "staged"), "direct")


def test_options_int_set():
    opts = Options({"a": "1,2, 3,,2", "b": "", "c": "1,x", "d": "4,-1", "e": "7"}, "src")
    assert opts.int_set("A") == frozenset({1, 2, 3})
    assert opts.int_set("b") == frozenset()
    assert opts.int_set("absent") == frozenset()
    assert opts.int_set("e") == frozenset({7})
    with pytest.raises(InvalidInputError, match=r"'c' must be comma-separated integers"):
        opts.int_set("c")
    with pytest.raises(InvalidInputError, match=r"'d' takes integers >= 0"):
        opts.int_set("d")


def test_options_storage_options():
    opts = Options({
        "path": "s3://bucket/x",
        "storage.anon": "True",
        "storage.use_ssl": " false ",
        "storage.client_kwargs": '{"endpoint_url": "http://h:1", "region_name": "eu"}',
        "storage.list": "[1, 2]",
        "storage.key": "abc",
        "storage.number": "123",
        "Storage.Endpoint_URL": "http://x",
        "storage.obj": 5,  # not a string: kept as is
        "storagex.no": "1",
    }, "src")
    assert opts.storage_options() == {
        "anon": True,
        "use_ssl": False,
        "client_kwargs": {"endpoint_url": "http://h:1", "region_name": "eu"},
        "list": [1, 2],
        "key": "abc",
        "number": "123",  # other strings are kept, not converted to numbers
        "endpoint_url": "http://x",
        "obj": 5,
    }
    assert Options({"path": "p"}, "src").storage_options() == {}


@pytest.mark.parametrize("bad", ["{not json", "[1, 2", "{'single': 'quotes'}"])
def test_options_storage_option_with_bad_json_is_rejected(bad):
    with pytest.raises(InvalidInputError, match="does not parse"):
        Options({"storage.client_kwargs": bad}, "src").storage_options()


# =============================================================================================
# ingest: helpers
# =============================================================================================
def rows(tag: str, n: int, per_batch: int = 10) -> list[EventColumns]:
    """``n`` rows in batches: values ``tag-i``, keyed (some unkeyed), timestamped, some headers."""
    out = []
    for start in range(0, n, per_batch):
        idx = range(start, min(n, start + per_batch))
        out.append(EventColumns(
            values=[f"{tag}-{i}".encode() for i in idx],
            keys=[None if i % 4 == 3 else f"k{i % 5}" for i in idx],
            timestamps=[BASE_TS + i for i in idx],
            headers=[(("h", b"%d" % i),) if i % 2 else () for i in idx],
        ))
    return out


def values_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def stream_records(url, options, stream) -> list[tuple[str, Record]]:
    """Every record of a stream as ``(segment, record)``, read through a fresh store handle."""
    out = []
    with SegmentStore.open(url, storage_options=options) as store:
        for name in store.stream_segments(stream):
            seg = store.segment(name)
            seg.refresh()
            out.extend((name, r) for r in seg.read(0, 1_000_000))
    return out


def value_counts(url, options, stream) -> collections.Counter:
    return collections.Counter(r.value for _, r in stream_records(url, options, stream))


def check_record_contents(records, segments: int, headers: bool = True) -> None:
    """Rows keep their key routing, timestamp and headers (none if not ``headers``: ``arrow_rows``),
    and each tag's rows of one segment are in row order."""
    last_index: dict[tuple, int] = {}
    for name, record in records:
        tag, _, index = record.value.decode().rpartition("-")
        i = int(index)
        assert record.timestamp == BASE_TS + i
        assert record.headers == ((("h", b"%d" % i),) if i % 2 and headers else ())
        if i % 4 == 3:
            assert record.key is None
        else:
            assert record.key == f"k{i % 5}".encode()
            assert name.endswith(f"/{zlib.crc32(record.key) % segments}")
        previous = last_index.get((name, tag), -1)
        assert i > previous, f"{tag} rows out of order in {name}"
        last_index[(name, tag)] = i


def target_for(storage_url, segments=3, batch_events=7) -> StreamTarget:
    url, options = storage_url
    target = StreamTarget(url, "events", storage_options=dict(options), segments=segments,
                          batch_events=batch_events)
    assert target.prepare() == segments
    return target


# =============================================================================================
# ingest: tokens and writer ids
# =============================================================================================
def test_tokens_and_task_writer_ids():
    assert write_token("x") == write_token("x")
    assert write_token("x") != write_token("y")
    assert write_token(None) != write_token(None)
    assert isinstance(write_token(None), uuid.UUID)
    assert query_token("q") == query_token("q")
    assert query_token("x") != write_token("x")  # the two namespaces do not collide

    token = write_token("job")
    assert task_writer_id(token, 0, 3) == task_writer_id(token, 0, 3)
    ids = {task_writer_id(t, v, p) for t in (token, write_token("other")) for v in range(12) for p in range(25)}
    assert len(ids) == 2 * 12 * 25  # (1, 23) and (12, 3) and every other combination differ


# =============================================================================================
# ingest: direct mode
# =============================================================================================
@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_direct_reruns_of_a_task_write_each_row_once(storage_url):
    url, options = storage_url
    target = target_for(storage_url)
    token = write_token("job-1")
    p0 = rows("p0", 40)

    first = write_direct(target, token, 0, 0, 0, p0)
    assert (first.partition, first.attempt, first.rows, first.written, first.skipped) == (0, 0, 40, 40, 0)
    again = write_direct(target, token, 0, 0, 1, p0)
    assert (again.rows, again.written, again.skipped) == (40, 0, 40)

    other = write_direct(target, token, 0, 1, 0, rows("p1", 25))  # another partition of the write
    assert (other.rows, other.written, other.skipped) == (25, 25, 0)

    records = stream_records(url, options, "events")
    assert collections.Counter(r.value for _, r in records) == collections.Counter(values_of("p0", 40) + values_of("p1", 25))
    check_record_contents(records, 3)

    # A new write (new token) of the same rows writes them again.
    fresh = write_direct(target, write_token("job-2"), 0, 0, 0, p0)
    assert (fresh.written, fresh.skipped) == (40, 0)
    counts = value_counts(url, options, "events")
    assert all(counts[v] == 2 for v in values_of("p0", 40))
    assert all(counts[v] == 1 for v in values_of("p1", 25))


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_direct_a_new_version_of_the_same_token_writes_again(storage_url):
    url, options = storage_url
    target = target_for(storage_url, segments=2)
    token = query_token("query")
    batch = rows("b", 15)
    assert write_direct(target, token, 0, 0, 0, batch).written == 15
    assert write_direct(target, token, 1, 0, 0, batch).written == 15
    assert write_direct(target, token, 1, 0, 1, batch).skipped == 15
    assert set(value_counts(url, options, "events").values()) == {2}


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
@pytest.mark.parametrize("fail_after", [1, 7, 23, 50])
def test_direct_failed_attempt_then_retry_writes_each_row_once(storage_url, fail_after):
    url, options = storage_url
    target = target_for(storage_url, batch_events=7)
    token = write_token(f"fail-{fail_after}")
    batches = rows("p0", 50)
    faults = Faults(fail_partitions=frozenset({0}), fail_after_rows=fail_after)

    with pytest.raises(InjectedFailure, match=f"after {fail_after} rows"):
        write_direct(target, token, 0, 0, 0, batches, faults)
    # The rows before the failure landed (flushed), nothing after them.
    assert value_counts(url, options, "events") == collections.Counter(values_of("p0", fail_after))

    # Partitions not named are not failed, even on attempt 0.
    other = write_direct(target, token, 0, 1, 0, rows("p1", 12), faults)
    assert (other.rows, other.written) == (12, 12)

    retry = write_direct(target, token, 0, 0, 1, batches, faults)  # faults apply to attempt 0 only
    assert (retry.rows, retry.skipped, retry.written) == (50, fail_after, 50 - fail_after)
    records = stream_records(url, options, "events")
    assert collections.Counter(r.value for _, r in records) == collections.Counter(values_of("p0", 50) + values_of("p1", 12))
    check_record_contents(records, 3)


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_direct_with_a_concurrent_speculative_twin_writes_each_row_once(storage_url):
    url, options = storage_url
    target = target_for(storage_url, batch_events=5)
    expected = collections.Counter()
    for run in range(3):
        token = write_token(f"twin-{run}")
        batches = rows(f"r{run}", 200, per_batch=17)
        report = write_direct(target, token, 0, 0, 0, batches, Faults(duplicate_partitions=frozenset({0})))
        assert report.rows == 200
        assert report.written + report.skipped == 200
        expected.update(values_of(f"r{run}", 200))
        records = stream_records(url, options, "events")
        assert collections.Counter(r.value for _, r in records) == expected
        check_record_contents(records, 3)
        # Whatever the twin did, a retry finds every row there.
        assert write_direct(target, token, 0, 0, 2, batches).skipped == 200


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_direct_commit_records_the_write_and_a_replay_is_a_no_op(storage_url):
    url, options = storage_url
    target = target_for(storage_url)
    token = write_token("commit-direct")
    reports = [write_direct(target, token, 0, p, 0, rows(f"p{p}", 10 + p)) for p in range(3)]
    reports.append(write_direct(target, token, 0, 0, 1, rows("p0", 10)))  # a duplicate report
    summary = commit_write(target, token, 0, reports[:3], staged=False)
    assert summary["token"] == token.hex and summary["version"] == 0
    assert (summary["tasks"], summary["rows"], summary["written"], summary["skipped"]) == (3, 33, 33, 0)

    with SegmentStore.open(url, storage_options=options) as store:
        assert CommitLedger(store.storage, "events").committed(token, 0) == summary
        assert CommitLedger(store.storage, "events").committed(token, 1) is None

    replay = commit_write(target, token, 0, reports, staged=False)
    assert replay == summary  # the recorded summary, committed_ms included
    assert sum(value_counts(url, options, "events").values()) == 33


# =============================================================================================
# ingest: staged mode
# =============================================================================================
def paths(*reports) -> list[str]:
    """The staging file paths of task reports (``staged`` holds ``[path, size]`` entries)."""
    return [path for report in reports for path, _size in report.staged]


def staged_files(storage, stream, token, version) -> dict:
    return storage.list_files(staging_dir(stream, token, version))


def segment_offsets(url, options, stream) -> list[int]:
    with SegmentStore.open(url, storage_options=options) as store:
        out = []
        for name in store.stream_segments(stream):
            seg = store.segment(name)
            seg.refresh()
            out.append(seg.next_offset)
        return out


@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_staged_commit_publishes_only_the_winning_attempts_once(storage_url):
    url, options = storage_url
    target = target_for(storage_url, segments=2, batch_events=6)
    token, version = write_token("staged"), 0

    # Partition 0: attempt 0 dies half-way, attempt 1 wins.
    with pytest.raises(InjectedFailure):
        stage_attempt(target, token, version, 0, 0, rows("dead0", 30),
                      Faults(fail_partitions=frozenset({0}), fail_after_rows=12))
    win0 = stage_attempt(target, token, version, 0, 1, rows("p0", 30))
    # Partition 1: attempt 0 wins, a speculative attempt 1 also finished but lost.
    win1 = stage_attempt(target, token, version, 1, 0, rows("p1", 21))
    lose1 = stage_attempt(target, token, version, 1, 1, rows("spec1", 21))
    # Partition 2: a twin attempt stages a copy nobody publishes; an empty partition 3.
    win2 = stage_attempt(target, token, version, 2, 0, rows("p2", 9), Faults(duplicate_partitions=frozenset({2})))
    win3 = stage_attempt(target, token, version, 3, 0, [])

    assert (win0.rows, win1.rows, lose1.rows, win2.rows, win3.rows) == (30, 21, 21, 9, 0)
    assert win3.staged and all(r.staged for r in (win0, win1, lose1, win2))
    assert not set(paths(win1)) & set(paths(lose1))
    with SegmentStore.open(url, storage_options=options) as store:
        files = staged_files(store.storage, "events", token, version)
        assert len(files) >= 6  # win0, win1, lose1, win2 and its twin, win3
        for report in (win0, win1, lose1, win2, win3):
            for path, size in report.staged:
                assert files[path.rsplit("/", 1)[1]] == size
    assert segment_offsets(url, options, "events") == [0, 0]  # nothing in the stream before commit

    winners = [win2, win0, win3, win1]  # in any order
    summary = commit_write(target, token, version, winners, staged=True)
    assert (summary["tasks"], summary["rows"], summary["published"], summary["skipped"]) == (4, 60, 60, 0)

    records = stream_records(url, options, "events")
    expected = values_of("p0", 30) + values_of("p1", 21) + values_of("p2", 9)
    assert collections.Counter(r.value for _, r in records) == collections.Counter(expected)
    check_record_contents(records, 2)

    with SegmentStore.open(url, storage_options=options) as store:
        assert staged_files(store.storage, "events", token, version) == {}
        ledger = CommitLedger(store.storage, "events")
        assert ledger.committed(token, version) == summary
        assert ledger.manifest(token, version) == sorted([r.partition, r.staged] for r in winners)

    # A replayed commit (also with other reports) publishes nothing and returns the recorded summary.
    assert commit_write(target, token, version, winners, staged=True) == summary
    assert commit_write(target, token, version, [lose1], staged=True) == summary
    assert collections.Counter(r.value for _, r in stream_records(url, options, "events")) == collections.Counter(expected)


#: rows staged per partition by the crashed-commit tests
CRASHED_SIZES = {0: 17, 1: 11, 2: 23}


def _staged_with_manifest(storage_url, token, version, make_rows):
    """Three partitions staged (``make_rows(name, n)``) and the commit's manifest recorded, as by
    a commit that crashed right after: ``(target, attempts, plan)``."""
    url, options = storage_url
    target = target_for(storage_url, segments=3, batch_events=4)
    first = [stage_attempt(target, token, version, p, 0, make_rows(f"a{p}", n)) for p, n in CRASHED_SIZES.items()]
    plan = sorted([r.partition, r.staged] for r in first)
    with SegmentStore.open(url, storage_options=options) as store:
        assert CommitLedger(store.storage, "events").adopt_manifest(token, version, plan) == plan
    return target, first, plan


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
@pytest.mark.parametrize("abort_between", [False, True])
def test_staged_rerun_after_a_commit_crashed_mid_publish_publishes_the_manifest(storage_url, abort_between):
    url, options = storage_url
    token, version = write_token("crashed-commit"), 5
    sizes = CRASHED_SIZES
    # The first commit recorded its manifest, published partition 0 and crashed.
    target, first, plan = _staged_with_manifest(storage_url, token, version, rows)
    with SegmentStore.open(url, storage_options=options) as store:
        ledger = CommitLedger(store.storage, "events")
        done = publish(target, store, token, version, plan[:1])
        assert done == {"published": 17, "skipped": 0}
        assert ledger.committed(token, version) is None
    assert value_counts(url, options, "events") == collections.Counter(values_of("a0", 17))

    if abort_between:  # the failed job's abort must keep what the manifest names
        abort_write(target, token, version, [f for r in first for f in r.staged], everything=True)
        abort_write(target, token, version, [f for r in first for f in r.staged], everything=False)
        with SegmentStore.open(url, storage_options=options) as store:
            assert all(store.storage.exists(f) for f in paths(*first))

    # A rerun: its attempts staged other files (other rows), and its commit publishes the manifest.
    second = [stage_attempt(target, token, version, p, 0, rows(f"b{p}", n + 3)) for p, n in sizes.items()]
    summary = commit_write(target, token, version, second, staged=True)
    assert summary["published"] == sum(sizes.values())
    assert summary["skipped"] == 17  # partition 0 was in the stream already
    assert summary["rows"] == sum(sizes.values())

    records = stream_records(url, options, "events")
    expected = [v for p, n in sizes.items() for v in values_of(f"a{p}", n)]
    assert collections.Counter(r.value for _, r in records) == collections.Counter(expected)
    check_record_contents(records, 3)
    with SegmentStore.open(url, storage_options=options) as store:
        assert staged_files(store.storage, "events", token, version) == {}
        assert CommitLedger(store.storage, "events").manifest(token, version) == plan


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_staged_attempt_cut_into_many_files_publishes_in_row_order(storage_url, monkeypatch):
    url, options = storage_url
    monkeypatch.setattr(ingest, "STAGED_FILE_BYTES", 300)
    target = target_for(storage_url, segments=2, batch_events=3)
    token = write_token("many-files")
    report = stage_attempt(target, token, 0, 0, 0, rows("m", 80, per_batch=7))
    assert report.rows == 80 and len(report.staged) >= 5
    assert [p.rsplit("-", 1)[1] for p in paths(report)] == [f"{i:05d}" for i in range(len(report.staged))]
    with SegmentStore.open(url, storage_options=options) as store:
        files = staged_files(store.storage, "events", token, 0)
    assert sum(files.values()) == sum(size for _, size in report.staged)
    summary = commit_write(target, token, 0, [report], staged=True)
    assert (summary["published"], summary["skipped"]) == (80, 0)
    records = stream_records(url, options, "events")
    assert collections.Counter(r.value for _, r in records) == collections.Counter(values_of("m", 80))
    check_record_contents(records, 2)


def test_staged_publish_appends_whole_staged_batches(storage_url, monkeypatch):
    """The commit publishes each staged batch with one call (write_many of its columns if it has
    headers, else write_arrow): a call per row (EventWriter.write) cost several microseconds a
    row in the driver, which runs every row."""
    from attrindex.writer import EventWriter

    url, options = storage_url
    target = target_for(storage_url, segments=2, batch_events=4)
    token = write_token("whole-batches")
    report = stage_attempt(target, token, 0, 0, 0, rows("w", 50, per_batch=9))
    calls = []
    monkeypatch.setattr(EventWriter, "write", lambda *a, **k: pytest.fail("publish wrote one row at a time"))
    for method in ("write_many", "write_arrow"):
        original = getattr(EventWriter, method)
        monkeypatch.setattr(EventWriter, method, lambda self, values, *a, _original=original, _method=method, **k: (
            calls.append((_method, len(values))), _original(self, values, *a, **k))[1])
    summary = commit_write(target, token, 0, [report], staged=True)
    # 9-row input batches are staged in batches of at most 4 (4, 4, 1), the last 5 rows as 4, 1;
    # of the one-row batches, rows 8, 26 and 44 (even) have no header
    assert summary["published"] == 50 and sum(n for _, n in calls) == 50 and len(calls) == 5 * 3 + 2
    assert [n for method, n in calls if method == "write_arrow"] == [1] * 3
    records = stream_records(url, options, "events")
    assert sorted(r.value for _, r in records) == sorted(values_of("w", 50))
    check_record_contents(records, 2)


def arrow_rows(tag: str, n: int, per_batch: int = 10) -> list:
    """``rows`` as the Spark source hands them over (``ArrowColumns``: no headers)."""
    out = []
    for start in range(0, n, per_batch):
        idx = range(start, min(n, start + per_batch))
        out.append(arrow.ArrowColumns(pa.array([f"{tag}-{i}".encode() for i in idx], pa.binary()),
                                      pa.array([None if i % 4 == 3 else f"k{i % 5}".encode() for i in idx],
                                               pa.binary()),
                                      pa.array([BASE_TS + i for i in idx], pa.int64())))
    return out


def segment_rows(url, options, stream) -> dict:
    """``{(segment number, tag): records in offset order}`` of a stream (the partitions of a
    commit are published side by side, so only each one's own order is fixed)."""
    out = collections.defaultdict(list)
    for name, r in stream_records(url, options, stream):
        out[name.rsplit("/", 1)[1], r.value.rpartition(b"-")[0]].append((r.value, r.key, r.timestamp, r.headers))
    return dict(out)


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_staged_arrow_rows_are_published_as_columns_into_what_a_direct_write_makes(storage_url, monkeypatch):
    """Rows staged from Arrow columns (no headers) are published through write_arrow, never row
    by row nor through write_many's lists, and the stream then holds, segment by segment, the
    records a direct write of the same rows makes."""
    from attrindex.writer import EventWriter

    url, options = storage_url
    target = target_for(storage_url, segments=3, batch_events=4)
    direct = StreamTarget(url, "direct", storage_options=dict(options), segments=3, batch_events=4)
    direct.prepare()
    token = write_token("arrow-staged")
    reports = [stage_attempt(target, token, 0, p, 0, arrow_rows(f"p{p}", n, per_batch=9))
               for p, n in ((0, 50), (1, 23))]
    for p, n in ((0, 50), (1, 23)):
        write_direct(direct, token, 0, p, 0, arrow_rows(f"p{p}", n, per_batch=9))
    calls = []
    monkeypatch.setattr(EventWriter, "write", lambda *a, **k: pytest.fail("publish wrote one row at a time"))
    monkeypatch.setattr(EventWriter, "write_many", lambda *a, **k: pytest.fail("publish made lists of the rows"))
    original = EventWriter.write_arrow
    monkeypatch.setattr(EventWriter, "write_arrow", lambda self, values, *a, **k: (calls.append(len(values)),
                                                                                   original(self, values, *a, **k))[1])
    summary = commit_write(target, token, 0, reports, staged=True)
    assert (summary["published"], summary["skipped"]) == (73, 0) and sum(calls) == 73
    assert segment_rows(url, options, "events") == segment_rows(url, options, "direct")


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_staged_arrow_rows_republished_after_a_crash_mid_publish_land_once(storage_url):
    url, options = storage_url
    token, version = write_token("arrow-crashed-commit"), 2
    sizes = CRASHED_SIZES
    target, first, plan = _staged_with_manifest(storage_url, token, version, arrow_rows)
    with SegmentStore.open(url, storage_options=options) as store:
        assert publish(target, store, token, version, plan[:2]) == {"published": 28, "skipped": 0}
    summary = commit_write(target, token, version, first, staged=True)
    assert (summary["published"], summary["skipped"], summary["rows"]) == (51, 28, 51)
    records = stream_records(url, options, "events")
    expected = [v for p, n in sizes.items() for v in values_of(f"a{p}", n)]
    assert collections.Counter(r.value for _, r in records) == collections.Counter(expected)
    check_record_contents(records, 3, headers=False)


@pytest.mark.parametrize("keys", [pa.array(["a", None, "b", "cc", "a"]), pa.array([7, 8, None, 10, 11], pa.int64()),
                                  None])
def test_staging_from_arrow_columns_stages_what_event_columns_stage(storage_url, keys):
    """The Spark source stages Arrow rows column by column (arrow_columns): the staged records are
    those of the Record path (event_columns), null timestamps getting the staging time."""
    from attrindex.log.batch.chain import iter_batches
    from attrindex.log.batch.decode import decode_records

    url, options = storage_url
    columns = {"value": pa.array(["v0", "v1", "v2", "v3", "v4"]),
               "ts": pa.array([5_000, None, 7_000, 5_000, 9_000], pa.timestamp("us", tz="UTC"))}
    if keys is not None:
        columns["key"] = keys
    batch = pa.RecordBatch.from_pydict(columns)
    key = "key" if keys is not None else None
    target = target_for(storage_url, segments=2, batch_events=2)

    def staged(items):
        report = stage_attempt(target, write_token(uuid.uuid4().hex), 0, 0, 0, items)
        with SegmentStore.open(url, storage_options=options) as store:
            out = []
            for path, size in report.staged:
                data = store.storage.read(path, 0, size)
                for pos, header in iter_batches(data):
                    out += [(r.value, r.key, r.timestamp) for r in decode_records(data, pos, header)]
            return out

    before = int(time.time() * 1000)
    by_arrow = staged([arrow.arrow_columns(batch, "value", key, "ts")])
    by_records = staged([arrow.event_columns(batch, "value", key, "ts", None)])
    after = int(time.time() * 1000)
    assert [r for i, r in enumerate(by_arrow) if i != 1] == [r for i, r in enumerate(by_records) if i != 1]
    assert by_arrow[1][:2] == by_records[1][:2] and before <= by_arrow[1][2] <= after
    assert by_arrow[0] == (b"v0", None if keys is None else (b"a" if keys.type == pa.string() else b"7"), 5)


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_adopt_manifest_keeps_the_first(storage):
    ledger = CommitLedger(storage, "events")
    token = write_token("m")
    assert ledger.manifest(token, 0) is None
    first = [[0, ["a", "b"]], [1, ["c"]]]
    assert ledger.adopt_manifest(token, 0, first) == first
    assert ledger.adopt_manifest(token, 0, [[0, ["x"]]]) == first
    assert ledger.manifest(token, 0) == first
    assert ledger.adopt_manifest(token, 1, [[0, ["x"]]]) == [[0, ["x"]]]


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_abort_write(storage_url):
    url, options = storage_url
    target = target_for(storage_url, segments=1)
    token = write_token("abort")

    a = stage_attempt(target, token, 0, 0, 0, rows("a", 5))
    b = stage_attempt(target, token, 0, 1, 0, rows("b", 5))
    c = stage_attempt(target, token, 0, 2, 0, rows("c", 5))
    abort_write(target, token, 0, a.staged + b.staged, everything=False)
    with SegmentStore.open(url, storage_options=options) as store:
        assert not any(store.storage.exists(f) for f in paths(a, b))
        assert all(store.storage.exists(f) for f in paths(c))
        assert set(staged_files(store.storage, "events", token, 0)) == {f.rsplit("/", 1)[1] for f in paths(c)}

    abort_write(target, token, 0, [], everything=True)
    with SegmentStore.open(url, storage_options=options) as store:
        assert staged_files(store.storage, "events", token, 0) == {}

    # With a manifest recorded by a failed commit, nothing is deleted.
    d = stage_attempt(target, token, 1, 0, 0, rows("d", 5))
    e = stage_attempt(target, token, 1, 1, 0, rows("e", 5))
    with SegmentStore.open(url, storage_options=options) as store:
        CommitLedger(store.storage, "events").adopt_manifest(token, 1, [[0, d.staged]])
    abort_write(target, token, 1, d.staged + e.staged, everything=False)
    abort_write(target, token, 1, d.staged + e.staged, everything=True)
    with SegmentStore.open(url, storage_options=options) as store:
        assert all(store.storage.exists(f) for f in paths(d, e))
    assert segment_offsets(url, options, "events") == [0]


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_commit_ledger_records_and_forgets(storage):
    ledger = CommitLedger(storage, "events")
    token, other = write_token("ledger"), write_token("other")
    assert ledger.committed(token, 0) is None
    for v in range(6):
        assert ledger.record(token, v, {"version": v})
    assert ledger.record(other, 1, {"other": True})
    assert not ledger.record(token, 2, {"version": "again"})  # already committed
    assert ledger.committed(token, 2) == {"version": 2}
    ledger.adopt_manifest(token, 1, [[0, ["f"]]])
    ledger.adopt_manifest(token, 4, [[0, ["g"]]])

    ledger.forget_before(token, 3)
    assert [ledger.committed(token, v) for v in range(6)] == [None, None, None, {"version": 3}, {"version": 4}, {"version": 5}]
    assert ledger.manifest(token, 1) is None and ledger.manifest(token, 4) == [[0, ["g"]]]
    assert ledger.committed(other, 1) == {"other": True}
    ledger.forget_before(write_token("never-written"), 10)  # nothing there: no error
    assert ledger.committed(token, 7) is None


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_commit_ledger_rejects_a_corrupt_record(storage):
    ledger = CommitLedger(storage, "events")
    token = write_token("corrupt")
    storage.create(f"_streams/events/_commits/{token.hex}/{0:020d}", b"not json{")
    with pytest.raises(CorruptDataError, match="not valid JSON"):
        ledger.committed(token, 0)


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_commit_write_keep_versions_forgets_old_versions(storage_url):
    url, options = storage_url
    target = target_for(storage_url, segments=1)
    token = query_token("streaming")
    for v in range(6):
        report = write_direct(target, token, v, 0, 0, rows(f"v{v}", 3))
        commit_write(target, token, v, [report], staged=False, keep_versions=2)
    with SegmentStore.open(url, storage_options=options) as store:
        ledger = CommitLedger(store.storage, "events")
        kept = [v for v in range(6) if ledger.committed(token, v) is not None]
    assert kept == [3, 4, 5]


def test_event_columns_records_fill_missing_columns():
    cols = EventColumns(values=[b"a", b"b"])
    assert len(cols) == 2
    assert list(cols.records()) == [(b"a", None, None, ()), (b"b", None, None, ())]
    assert not Faults() and Faults(fail_partitions=frozenset({1})) and Faults(duplicate_partitions=frozenset({0}))
    assert TaskReport(3, 1).staged == [] and TaskReport(3, 1).staged is not TaskReport(3, 1).staged


# =============================================================================================
# scan planning
# =============================================================================================
SCAN_SEGMENTS = ["s/0", "s/1", "s/2", "s/3"]


@pytest.fixture(scope="module")
def scan_store():
    """A 4-segment stream of many small chunks: s/0 with rising timestamps, s/1 random ones,
    s/2 empty, s/3 with its oldest records removed by retention. Yields (store, model)."""
    url = f"memory://scan-{uuid.uuid4().hex}"
    rng = random.Random(7)
    store = SegmentStore.open(url, log_rolling_size=4096)
    store.create_stream("s", 4)
    model: dict[str, list[tuple[int, int, bytes]]] = {name: [] for name in SCAN_SEGMENTS}
    for name, count in (("s/0", 700), ("s/1", 600), ("s/3", 500)):
        seg = store.segment(name)
        offset = 0
        while offset < count:
            n = min(count - offset, rng.randrange(1, 12))
            batch = []
            for i in range(offset, offset + n):
                ts = 1000 + 3 * i + rng.randrange(3) if name == "s/0" else rng.randrange(1000, 3000)
                value = b"%s-%d-" % (name.encode(), i) + bytes(rng.randrange(20, 60))
                batch.append(Record(value, None, ts))
                model[name].append((i, ts, value))
            result = seg.append(batch)
            assert result.first_offset == offset
            offset += n
    s3 = store.segment("s/3")
    s3.apply_retention(start_offset=230)
    assert 0 < s3.start_offset <= 230
    model["s/3"] = [entry for entry in model["s/3"] if entry[0] >= s3.start_offset]
    for name in SCAN_SEGMENTS:
        assert len(store.segment(name).chunk_offsets()) >= (0 if name == "s/2" else 4)
    yield store, model
    store.close()
    open_storage(url).remove_directory("")


def run_scan(store, ranges, bounds) -> list[tuple[str, int, int, bytes]]:
    out = []
    for scan_range in ranges:
        batches = list(scan(store, scan_range, bounds))
        assert all(0 < b.num_rows for b in batches)
        assert all(b.num_rows >= READ_CHUNK for b in batches[:-1])  # small stored batches are joined
        for batch in batches:
            offsets, values = batch.column(0).to_pylist(), batch.column(3).to_pylist()
            stamps = batch.column(1).cast(pa.int64()).to_pylist()
            for offset, stamp, value in zip(offsets, stamps, values):
                assert scan_range.start <= offset < scan_range.end
                out.append((scan_range.segment, offset, stamp, value))
    return out


def model_filter(model, bounds: ScanBounds, names=SCAN_SEGMENTS):
    return [(name, o, ts, v) for name in names for o, ts, v in model[name]
            if (bounds.segments is None or name in bounds.segments)
            and o >= bounds.offset_min and (bounds.offset_max is None or o < bounds.offset_max)
            and (bounds.time_min is None or ts >= bounds.time_min)
            and (bounds.time_max is None or ts < bounds.time_max)]


def test_chunk_offsets_cover_each_segment_exactly(scan_store):
    store, model = scan_store
    for name in SCAN_SEGMENTS:
        seg = store.segment(name)
        chunks = seg.chunk_offsets()
        if not model[name]:
            assert chunks == [] and seg.next_offset == 0
            continue
        assert chunks[0][0] == seg.start_offset == model[name][0][0]
        assert chunks[-1][1] == seg.next_offset == model[name][-1][0] + 1
        assert all(first < end for first, end in chunks)
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))


@pytest.mark.parametrize("max_records", [1, 10, 50, 137, 10_000])
def test_plan_covers_every_segment_exactly_at_chunk_boundaries(scan_store, max_records):
    store, model = scan_store
    ranges = plan_scan(store, SCAN_SEGMENTS, ScanBounds(), max_records)
    assert all(r.segment != "s/2" for r in ranges)  # an empty segment gives no range
    for name in ("s/0", "s/1", "s/3"):
        seg = store.segment(name)
        mine = [r for r in ranges if r.segment == name]
        assert mine[0].start == seg.start_offset and mine[-1].end == seg.next_offset
        assert all(r.start < r.end for r in mine)
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))  # contiguous, no overlap
        chunks = seg.chunk_offsets()
        boundaries = {first for first, _ in chunks} | {end for _, end in chunks}
        assert all(r.start in boundaries and r.end in boundaries for r in mine)
        if max_records == 1:
            assert [(r.start, r.end) for r in mine] == chunks  # one chunk per range
        if max_records == 10_000:
            assert len(mine) == 1
        # "about max_records": a range is not cut before it plus the next chunk would pass it.
        for a, b in zip(mine, mine[1:]):
            next_chunk_end = min(end for first, end in chunks if first >= b.start)
            assert (a.end - a.start) + (next_chunk_end - b.start) > max_records
    got = run_scan(store, ranges, ScanBounds())
    assert got == model_filter(model, ScanBounds())


@pytest.mark.parametrize("max_records", [10, 50, 100, 137, 200])
def test_plan_ranges_hold_at_most_max_records_unless_one_chunk_is_bigger(scan_store, max_records):
    store, _ = scan_store
    ranges = plan_scan(store, SCAN_SEGMENTS, ScanBounds(), max_records)
    for r in ranges:
        chunks = [c for c in store.segment(r.segment).chunk_offsets() if c[0] < r.end and c[1] > r.start]
        if len(chunks) > 1:
            assert r.end - r.start <= max_records, (r, chunks)


def test_split_unit_cases():
    chunks = [(0, 30), (30, 60), (60, 90), (90, 100)]
    assert _split("s", 0, 100, chunks, 1) == [ScanRange("s", a, b) for a, b in chunks]
    assert _split("s", 0, 100, chunks, 1000) == [ScanRange("s", 0, 100)]
    # A start and end inside chunks: the outer ranges are cut there, the inner ones at chunk ends.
    assert _split("s", 45, 75, chunks, 1) == [ScanRange("s", 45, 60), ScanRange("s", 60, 75)]
    assert _split("s", 95, 100, chunks, 10) == [ScanRange("s", 95, 100)]
    # Offsets past the listed chunks (appended after listing) are still covered.
    assert _split("s", 0, 120, chunks, 1000) == [ScanRange("s", 0, 120)]
    assert _split("s", 0, 30, [], 10) == [ScanRange("s", 0, 30)]


def test_split_never_packs_several_chunks_past_max_records():
    # Three 30-record chunks and max_records=50: two chunks (60 records) exceed it though no single
    # chunk does, so each chunk must be a range of its own.
    assert _split("s", 0, 90, [(0, 30), (30, 60), (60, 90)], 50) == [
        ScanRange("s", 0, 30), ScanRange("s", 30, 60), ScanRange("s", 60, 90)]


def test_plan_with_starts_and_ends(scan_store):
    store, model = scan_store
    starts = {"s/0": 100, "s/1": 590}
    ends = {"s/0": 250, "s/1": 10_000, "s/3": 400}  # s/2 is missing: nothing of it is read
    ranges = plan_scan(store, SCAN_SEGMENTS, ScanBounds(), 40, ends=ends, starts=starts)
    got = run_scan(store, ranges, ScanBounds())
    expected = [(n, o, ts, v) for n in SCAN_SEGMENTS for o, ts, v in model[n]
                if starts.get(n, 0) <= o < ends.get(n, 0)]
    assert got == expected
    assert {r.segment for r in ranges} == {"s/0", "s/1", "s/3"}


def test_scan_bounds_narrowing():
    bounds = ScanBounds()
    bounds.keep_segments(["a", "b", "c"])
    bounds.keep_segments(("b", "c", "d"))
    assert bounds.segments == frozenset({"b", "c"})
    bounds.raise_offset(10)
    bounds.raise_offset(5)
    assert bounds.offset_min == 10
    bounds.lower_offset_max(100)
    bounds.lower_offset_max(200)
    assert bounds.offset_max == 100
    bounds.raise_time(7)
    bounds.raise_time(3)
    assert bounds.time_min == 7
    bounds.lower_time_max(50)
    bounds.lower_time_max(60)
    assert bounds.time_max == 50


@settings(max_examples=50, deadline=None)
@given(
    segments=st.none() | st.frozensets(st.sampled_from(SCAN_SEGMENTS + ["s/9"])),
    offset_min=st.integers(0, 720),
    offset_max=st.none() | st.integers(0, 720),
    time_min=st.none() | st.integers(900, 3100),
    time_max=st.none() | st.integers(900, 3100),
    max_records=st.integers(1, 400),
)
def test_scan_returns_exactly_the_records_the_bounds_select(scan_store, segments, offset_min, offset_max,
                                                            time_min, time_max, max_records):
    store, model = scan_store
    bounds = ScanBounds(segments, offset_min, offset_max, time_min, time_max)
    ranges = plan_scan(store, SCAN_SEGMENTS, bounds, max_records)
    for name in SCAN_SEGMENTS:
        mine = [r for r in ranges if r.segment == name]
        seg = store.segment(name)
        low = max(offset_min, seg.start_offset)
        high = seg.next_offset if offset_max is None else min(seg.next_offset, offset_max)
        assert all(low <= r.start < r.end <= high for r in mine)
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
        if segments is not None and name not in segments:
            assert not mine
    assert run_scan(store, ranges, bounds) == model_filter(model, bounds)


@settings(max_examples=50, deadline=None)
@given(first=st.integers(0, 200), length=st.integers(0, 200), max_records=st.integers(1, 80),
       sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12))
def test_split_model(first, length, max_records, sizes):
    chunks, at = [], 0
    for size in sizes:
        chunks.append((at, at + size))
        at += size
    first = min(first, at)
    last = min(first + length, at)
    if first >= last:
        return
    out = _split("s", first, last, chunks, max_records)
    assert out[0].start == first and out[-1].end == last
    assert all(r.start < r.end for r in out)
    assert all(a.end == b.start for a, b in zip(out, out[1:]))
    boundaries = {a for a, _ in chunks} | {b for _, b in chunks} | {first, last}
    assert all(r.start in boundaries and r.end in boundaries for r in out)


# =============================================================================================
# attribute split keys
# =============================================================================================
def check_split_keys(split, model: dict, parts: int, scan_range) -> None:
    assert len(split) <= max(parts - 1, 0)
    assert all(type(k) is bytes and len(k) == 16 for k in split)
    assert all(a < b for a, b in zip(split, split[1:]))
    if model and split:
        assert min(model) <= split[0] and split[-1] <= max(model)
    bounds = [None, *split, None]
    got = []
    for low, high in zip(bounds, bounds[1:]):
        part = list(scan_range(low, high))
        assert all((low is None or k >= low) and (high is None or k < high) for k, _ in part)
        got.extend(part)
    assert got == sorted(model.items())


@pytest.fixture(scope="module")
def attr_segment():
    url = f"memory://attrs-{uuid.uuid4().hex}"
    store = SegmentStore.open(url, attribute_options={"page_size": 512})
    seg = store.segment("a", create=True)
    yield seg
    store.close()
    open_storage(url).remove_directory("")


def test_segment_attribute_split_keys(attr_segment):
    seg = attr_segment
    assert seg.attribute_split_keys(4) == []  # nothing in the B+tree yet
    rng = random.Random(11)
    model: dict[bytes, int] = {}
    for _ in range(6):
        updates = [(rng.randrange(1 << 128), rng.randrange(-100, 100)) for _ in range(500)]
        seg.update_attributes(updates)
        model.update((k.to_bytes(16, "big"), v) for k, v in updates)
    assert seg.attribute_split_keys(4) == []  # still all in tier 1: not weighed
    seg.flush()
    assert seg.stats().attributes.height >= 3
    # Later updates (some removals) only in tier 1 must still fall in some range.
    removed = rng.sample(sorted(model), 200)
    seg.update_attributes([(k, None) for k in removed] + [(k, 1) for k in range(50)])
    for k in removed:
        del model[k]
    model.update((k.to_bytes(16, "big"), 1) for k in range(50))
    for parts in (0, 1, 2, 3, 8, 16, 100, 5000):
        split = seg.attribute_split_keys(parts)
        check_split_keys(split, model, parts, seg.attributes)
        if 2 <= parts <= 100:
            assert len(split) >= parts // 2  # the tree has enough pages to cut this many ranges
    # About equal ranges: no quarter holds more than half of the keys.
    split = seg.attribute_split_keys(4)
    bounds = [None, *split, None]
    sizes = [sum(1 for _ in seg.attributes(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    assert len(sizes) == 4 and max(sizes) < len(model) / 2


def test_attribute_index_split_keys_empty_and_small():
    index = AttributeIndex(open_storage(f"memory://idx-{uuid.uuid4().hex}"), "i", page_size=256)
    assert index.split_keys(4) == []
    index.update({1: 1, 5: 2, 9: 3})
    model = {k.to_bytes(16, "big"): v for k, v in {1: 1, 5: 2, 9: 3}.items()}
    for parts in (1, 2, 4, 100):
        check_split_keys(index.split_keys(parts), model, parts, index.items)
    index.update({1: None, 5: None, 9: None})
    assert len(index) == 0
    check_split_keys(index.split_keys(4), {}, 4, index.items)


@settings(max_examples=30, deadline=None)
@given(keys=st.dictionaries(st.integers(0, (1 << 128) - 1), st.integers(-(1 << 63), (1 << 63) - 1), max_size=400),
       parts=st.integers(0, 40), page_size=st.sampled_from([120, 256, 1024]))
def test_attribute_index_split_keys_model(keys, parts, page_size):
    url = f"memory://idx-{uuid.uuid4().hex}"
    index = AttributeIndex(open_storage(url), "i", page_size=page_size)
    try:
        if keys:
            index.update(keys)
        model = {k.to_bytes(16, "big"): v for k, v in keys.items()}
        split = index.split_keys(parts)
        if not keys:
            assert split == []
        check_split_keys(split, model, parts, index.items)
    finally:
        open_storage(url).remove_directory("")


# =============================================================================================
# Arrow conversions
# =============================================================================================
def test_event_columns_binary_values_and_all_columns():
    headers = pa.array([[{"key": "a", "value": b"1"}, {"key": "b", "value": None}], [], None],
                       arrow.HEADERS_TYPE)
    batch = pa.RecordBatch.from_pydict({
        "Payload": pa.array([b"x", b"", b"zz"], pa.binary()),
        "k": pa.array(["r1", None, "r3"], pa.string()),
        "ts": pa.array([1_500, None, 2_000_999], pa.timestamp("us", tz="UTC")),
        "hdrs": headers,
    })
    # Column names are found case-insensitively, as Spark's are.
    cols = arrow.event_columns(batch, "payload", "K", "TS", "hdrs")
    assert cols.values == [b"x", b"", b"zz"]
    assert cols.keys == [b"r1", None, b"r3"]  # string routing keys arrive as their UTF-8 bytes
    assert cols.timestamps == [1, None, 2_000]
    assert cols.headers == [(("a", b"1"), ("b", b"")), (), ()]
    bare = arrow.event_columns(batch, "Payload", None, None, None)
    assert (bare.keys, bare.timestamps, bare.headers) == (None, None, None)
    assert list(bare.records()) == [(b"x", None, None, ()), (b"", None, None, ()), (b"zz", None, None, ())]


def test_event_columns_string_values_and_int_timestamps():
    batch = pa.RecordBatch.from_pydict({
        "v": pa.array(["héllo", ""], pa.string()),
        "lv": pa.array(["a", "b"], pa.large_string()),
        "t": pa.array([5, 7], pa.int64()),
        "tms": pa.array([1_000, 2_000], pa.timestamp("ms")),
        "tsec": pa.array([3, 4], pa.timestamp("s")),
    })
    cols = arrow.event_columns(batch, "v", None, "t", None)
    assert cols.values == ["héllo".encode(), b""] and all(type(v) is bytes for v in cols.values)
    assert cols.timestamps == [5, 7]
    assert arrow.event_columns(batch, "lv", None, "tms", None).values == [b"a", b"b"]
    assert arrow.event_columns(batch, "v", None, "tms", None).timestamps == [1_000, 2_000]
    assert arrow.event_columns(batch, "v", None, "tsec", None).timestamps == [3_000, 4_000]


def test_event_columns_errors():
    batch = pa.RecordBatch.from_pydict({"v": pa.array([b"a", None], pa.binary()), "V2": pa.array([b"a", b"b"]),
                                        "dup": pa.array([1, 2]), "DUP": pa.array([3, 4])})
    with pytest.raises(InvalidInputError, match=r"the value column 'v' holds nulls"):
        arrow.event_columns(batch, "v", None, None, None)
    with pytest.raises(InvalidInputError, match=r"no column 'missing'"):
        arrow.event_columns(batch, "missing", None, None, None)
    with pytest.raises(InvalidInputError, match=r"no column 'nokey'"):
        arrow.event_columns(batch, "V2", "nokey", None, None)
    with pytest.raises(InvalidInputError, match=r"no column 'Dup'"):  # ambiguous case-insensitively
        arrow.event_columns(batch, "V2", None, "Dup", None)
    assert arrow.event_columns(batch, "v2", None, "dup", None).timestamps == [1, 2]  # exact name first


def test_events_batch_round_trip():
    records = [
        Record(b"a", b"k1", 1_700_000_000_123, (("h", b"1"), ("g", b"")), 10),
        Record(b"", None, 0, (), 11),
        Record(b"\x00\xff", b"k3", 5, (("x", b"y"),), 12),
    ]
    batch = arrow.events_batch("st/1", records_to_arrow(records))
    assert batch.schema == arrow.EVENT_SCHEMA
    assert batch.column(0).to_pylist() == ["st/1"] * 3
    assert batch.column(1).to_pylist() == [10, 11, 12]
    cols = arrow.event_columns(batch, "value", "key", "timestamp", "headers")
    assert cols.values == [r.value for r in records]
    assert cols.keys == [r.key for r in records]
    assert cols.timestamps == [r.timestamp for r in records]
    assert cols.headers == [r.headers for r in records]
    plain = arrow.events_batch("s", records_to_arrow([Record(b"v", None, 9, (), 0)]))
    assert plain.column(5).to_pylist() == [[]]
    assert arrow.events_batch("s", records_to_arrow([])).num_rows == 0
    assert arrow.events_batch("", records_to_arrow(records)).column(0).to_pylist() == [""] * 3


def test_events_batch_round_trip_through_a_stream():
    """Rows from event_columns written by write_direct read back as the same events_batch rows."""
    url = f"memory://rt-{uuid.uuid4().hex}"
    source = pa.RecordBatch.from_pydict({
        "value": pa.array([b"a", b"b", b"c"]),
        "key": pa.array([b"k", b"k", b"k"]),
        "timestamp": pa.array([1_000_000, 2_000_000, 3_000_000], pa.timestamp("us", tz="UTC")),
        "headers": pa.array([[{"key": "h", "value": b"v"}], [], []], arrow.HEADERS_TYPE),
    })
    target = StreamTarget(url, "rt", segments=1)
    target.prepare()
    try:
        cols = arrow.event_columns(source, "value", "key", "timestamp", "headers")
        assert write_direct(target, write_token("rt"), 0, 0, 0, [cols]).written == 3
        with SegmentStore.open(url) as store:
            batch = arrow.events_batch("rt/0", store.segment("rt/0").read_arrow().to_batches()[0])
        assert batch.select(["value", "key", "timestamp", "headers"]).to_pydict() == source.to_pydict()
        assert batch.column(1).to_pylist() == [0, 1, 2]
    finally:
        open_storage(url).remove_directory("")


def test_attribute_keys_accepted_forms():
    u = uuid.uuid4()
    k16 = bytes(range(16))
    assert arrow.attribute_keys(pa.array([k16, None], pa.binary())) == [k16, None]
    assert arrow.attribute_keys(pa.array([k16], pa.large_binary())) == [k16]
    assert arrow.attribute_keys(pa.array([k16, None], pa.binary(16))) == [k16, None]
    assert arrow.attribute_keys(pa.array([str(u), u.hex.upper(), None], pa.string())) == [u.bytes, u.bytes, None]
    assert arrow.attribute_keys(pa.array([str(u)], pa.large_string())) == [u.bytes]
    assert arrow.attribute_keys(pa.array([0, 1, None, 2**63 - 1], pa.int64())) == [
        bytes(16), (1).to_bytes(16, "big"), None, (2**63 - 1).to_bytes(16, "big")]
    assert arrow.attribute_keys(pa.array([2**64 - 1], pa.uint64())) == [(2**64 - 1).to_bytes(16, "big")]
    assert arrow.attribute_keys(pa.array([7], pa.int8())) == [(7).to_bytes(16, "big")]


@pytest.mark.parametrize("column, error, fragment", [
    (pa.array([bytes(16), b"short"], pa.binary()), InvalidKeyError, "16 bytes"),
    (pa.array([bytes(17)], pa.binary()), InvalidKeyError, "16 bytes"),
    (pa.array([bytes(15)], pa.binary(15)), InvalidKeyError, "16 bytes"),
    (pa.array([1, -1], pa.int64()), InvalidKeyError, "2**128"),
    (pa.array(["not-a-uuid"], pa.string()), InvalidKeyError, "not a UUID"),
    (pa.array([1.0, 2.0], pa.float64()), InvalidInputError, "double"),
    (pa.array([True], pa.bool_()), InvalidInputError, "bool"),
])
def test_attribute_keys_rejects_bad_input_naming_the_column(column, error, fragment):
    with pytest.raises(error) as info:
        arrow.attribute_keys(column, "userId")
    assert "'userId'" in str(info.value)
    assert fragment in str(info.value)


def test_attribute_values():
    assert arrow.attribute_values(pa.array([1, None, -(2**63), 2**63 - 1], pa.int64())) == [1, None, -(2**63), 2**63 - 1]
    assert arrow.attribute_values(pa.array([3, None], pa.int32())) == [3, None]
    assert arrow.attribute_values(pa.array([2**63 - 1, None], pa.uint64())) == [2**63 - 1, None]
    for column in (pa.array([1.5]), pa.array(["1"]), pa.array([b"1"]), pa.array([True])):
        with pytest.raises(InvalidInputError, match=r"the value column 'score' has type .*must be an integer"):
            arrow.attribute_values(column, "score")


def test_attributes_batch():
    k1, k2 = bytes(16), bytes([1] * 16)
    batch = arrow.attributes_batch([(k1, 5), (k2, -1)])
    assert batch.schema == arrow.ATTRIBUTE_SCHEMA
    assert batch.to_pydict() == {"key": [k1, k2], "value": [5, -1]}
    empty = arrow.attributes_batch([])
    assert empty.num_rows == 0 and empty.schema == arrow.ATTRIBUTE_SCHEMA


def test_write_options_reach_the_store_and_the_writer(tmp_path):
    """codec, logRollingSize and batchEvents become SegmentStore options and the writer's batch
    size; overwrite and too-small chunks are refused (checked without a SparkSession)."""
    from pyspark.sql.types import BinaryType, StructField, StructType

    from attrindex.spark.events import write_settings

    schema = StructType([StructField("value", BinaryType())])
    raw = {"path": str(tmp_path), "stream": "s", "codec": "gzip", "logRollingSize": "8192", "batchEvents": "7"}
    settings = write_settings(raw, schema, overwrite=False)
    assert settings.target.store_options == {"codec": "gzip", "log_rolling_size": 8192}
    assert settings.target.batch_events == 7
    assert write_settings({"path": "p", "stream": "s"}, schema, False).target.batch_events == 5000
    with pytest.raises(InvalidInputError, match="'logRollingSize' must be >= 4096"):
        write_settings({**raw, "logRollingSize": "100"}, schema, False)
    with pytest.raises(InvalidInputError, match="append-only"):
        write_settings(raw, schema, overwrite=True)


# =============================================================================================
# attribute writes: options, turns of the tasks writing one segment
# =============================================================================================
def test_attribute_write_options_reach_the_task_store(tmp_path):
    from attrindex.spark.attributes import TASK_CACHE_BYTES, _target

    target = _target({"path": str(tmp_path), "segment": "a", "maxPendingBytes": str(4 << 20)})
    assert target.max_pending_bytes == 4 << 20
    with target.open_store() as store:
        assert store.options.max_pending_bytes == 4 << 20
        assert store.options.attribute_options == {"cache_bytes": TASK_CACHE_BYTES, "value_cache_entries": 0}
    assert _target({"path": "p", "segment": "a"}).max_pending_bytes is None
    with pytest.raises(InvalidInputError, match="'maxPendingBytes' must be >= 1048576"):
        _target({"path": "p", "segment": "a", "maxPendingBytes": "1000"})


def _hold_turn_in_child(root: str, segment: str):
    """A child process that takes the write turn of ``segment`` and keeps it until killed."""
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from storage_adapters import open_storage\n"
            "from attrindex.spark.turns import writer_turn\n"
            "with writer_turn(open_storage(sys.argv[1]), sys.argv[2]) as taken:\n"
            "    print('held' if taken else 'none', flush=True)\n"
            "    time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", code, root, segment], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def _attributes_writer(url: str, segment: str):
    from pyspark.sql.types import BinaryType, LongType, StructField, StructType

    from attrindex.spark import attributes

    schema = StructType([StructField("key", BinaryType()), StructField("value", LongType())])
    return attributes.AttributesWriter(attributes._target({"path": url, "segment": segment}), schema)


def test_attribute_write_tasks_on_local_disk_take_turns_and_a_killed_holder_frees_it(tmp_path):
    import threading

    url = str(tmp_path / "store")
    writers = {name: _attributes_writer(url, name) for name in ("a", "b")}  # (creates both segments)
    holder = _hold_turn_in_child(url, "a")  # as another task writing segment a
    done = {name: threading.Event() for name in writers}

    def task(name):
        writers[name].write(_attribute_batches(0, 1000))
        done[name].set()

    for name in writers:
        threading.Thread(target=task, args=(name,), daemon=True).start()
    try:
        assert done["b"].wait(60)  # another segment's turn is its own
        assert not done["a"].wait(1)  # segment a's task waits for its turn
        with SegmentStore.open(url, mode="r+") as store:
            assert store.segment("a").next_offset == 0 and store.segment("b").get_attribute(999) == 999 * 3
    finally:
        holder.kill()  # as an executor dies: the kernel releases its turn
        holder.wait()
    assert done["a"].wait(60)
    with SegmentStore.open(url, mode="r+") as store:
        assert store.segment("a").get_attributes([0, 999, 1000]) == [0, 999 * 3, None]


def test_stores_not_on_local_disk_are_written_without_turns():
    from attrindex.spark.turns import writer_turn

    with open_storage(f"memory://turns-{uuid.uuid4().hex}") as storage, writer_turn(storage, "a") as taken:
        assert taken is False


def _attribute_batches(start: int, stop: int, size: int = 5000):
    for first in range(start, stop, size):
        ids = range(first, min(first + size, stop))
        yield pa.RecordBatch.from_arrays([pa.array([i.to_bytes(16, "big") for i in ids], pa.binary()),
                                          pa.array([i * 3 for i in ids], pa.int64())], names=["key", "value"])


def test_concurrent_attribute_write_tasks_land_every_update_merged(tmp_path, monkeypatch):
    """Two tasks of one write at once (threads here, each with its own store handle): every
    update lands, each task's handle merged what it wrote before its turn passed on, so a later
    open replays nothing."""
    import threading

    from attrindex.spark import attributes

    monkeypatch.setattr(attributes, "WRITE_BATCH", 20_000)
    url = str(tmp_path / "store")
    writer = _attributes_writer(url, "a")
    done = []
    tasks = [threading.Thread(target=lambda lo, hi: done.append(writer.write(_attribute_batches(lo, hi)).updates),
                              args=(lo, lo + 60_000)) for lo in (0, 1_000_000)]
    for task in tasks:
        task.start()
    for task in tasks:
        task.join(300)
    assert sorted(done) == [60_000, 60_000]
    with SegmentStore.open(url, mode="r+") as store:
        segment = store.segment("a")
        assert segment.stats().pending_attributes == 0
        assert segment.stats().attributes.entry_count == 120_000
        probes = [0, 59_999, 60_000, 1_000_000, 1_059_999, 1_060_000]
        assert segment.get_attributes(probes) == [0, 59_999 * 3, None, 3_000_000, 1_059_999 * 3, None]
