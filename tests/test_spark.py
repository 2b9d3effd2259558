"""The PySpark data sources end to end, on one local[2,4] SparkSession: exactly-once writes
through injected task failures and duplicate attempts (local disk and S3), writeId reruns,
streaming through a restart with a replayed batch, attribute bulk loads and lookups."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import uuid

import pytest

pytest.importorskip("pyspark")  # the spark extra; the test extra always installs it

import attrindex.spark  # noqa: E402
from attrindex import SegmentStore  # noqa: E402

pytestmark = pytest.mark.slow

ROWS = 12_000


def events_df(spark, rows=ROWS, partitions=4, start=0):
    """Unique payloads (so duplicates and losses are countable), 97 routing keys, timestamps."""
    return (spark.range(start, start + rows, numPartitions=partitions)
            .selectExpr("concat('user-', cast(id % 97 as string)) as key",
                        "cast(concat('event-', cast(id as string)) as binary) as value",
                        "timestamp_millis(1700000000000 + id) as ts"))


def write(df, url, stream, options=None, **extra):
    writer = (df.write.format("attrindex").option("path", url).option("stream", stream)
              .option("keyColumn", "key").option("timestampColumn", "ts"))
    for key, value in {**(options or {}), **extra}.items():
        writer = writer.option(key, value)
    writer.mode("append").save()


def read(spark, url, stream, options=None):
    reader = spark.read.format("attrindex").option("path", url).option("stream", stream)
    for key, value in (options or {}).items():
        reader = reader.option(key, value)
    return reader.load()


def payloads(spark, url, stream, options=None) -> list[bytes]:
    return [bytes(r.value) for r in read(spark, url, stream, options).select("value").collect()]


def storage_opts(options: dict) -> dict:
    return {f"storage.{k}": v for k, v in options.items()}


FAULTS = {"testing.failPartitions": "1,2", "testing.failAfterRows": "1200", "testing.duplicatePartitions": "3"}


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_exactly_once_through_failed_and_duplicate_attempts(spark, storage_url, mode):
    url, options = storage_url
    write(events_df(spark), url, "events", storage_opts(options), segments=3, commitMode=mode,
          writeId="load-1", **FAULTS)
    got = payloads(spark, url, "events", storage_opts(options))
    expected = {b"event-%d" % i for i in range(ROWS)}
    assert len(got) == ROWS and set(got) == expected  # no duplicates, no losses
    summary = attrindex.spark.write_summary(url, "events", "load-1", options)
    assert summary["rows"] == ROWS
    if mode == "direct":  # the retried tasks found the rows their failed attempts had written
        assert summary["skipped"] > 0 and summary["written"] + summary["skipped"] == ROWS
    with SegmentStore.open(url, storage_options=options) as store:
        staging = store.storage.list_files("_streams/events/_staging")
        assert staging == {}  # failed and duplicate attempts' staged files were cleaned up


def test_routing_keys_timestamps_and_headers_survive(spark, tmp_path):
    url = str(tmp_path / "store")
    df = spark.createDataFrame(
        [("a", b"1", 1_700_000_000_123, [("h", b"x")]), ("b", b"2", 1_700_000_000_456, []),
         ("a", b"3", 1_700_000_000_789, None)],
        "key string, value binary, ts long, headers array<struct<key:string,value:binary>>")
    write(df, url, "s", segments=2, headersColumn="headers")
    rows = {bytes(r.value): r for r in read(spark, url, "s").collect()}
    assert bytes(rows[b"1"].key) == b"a" and rows[b"1"].segment == rows[b"3"].segment
    assert rows[b"1"].headers[0].key == "h" and bytes(rows[b"1"].headers[0].value) == b"x"
    assert rows[b"2"].headers == []
    assert int(rows[b"2"].timestamp.timestamp() * 1000) == 1_700_000_000_456
    offsets = sorted((r.segment, r.offset) for r in rows.values())
    assert offsets[0][1] == 0


def test_the_same_write_id_appends_once(spark, tmp_path):
    url = str(tmp_path / "store")
    df = events_df(spark, rows=3000)
    write(df, url, "s", segments=2, writeId="nightly-2026-11-21")
    write(df, url, "s", writeId="nightly-2026-11-21")  # a rerun of the whole job
    assert read(spark, url, "s").count() == 3000
    write(events_df(spark, rows=3000, start=3000), url, "s", writeId="nightly-2026-11-22")
    assert sorted(payloads(spark, url, "s")) == sorted(b"event-%d" % i for i in range(6000))
    write(df, url, "s", writeId="nightly-2026-11-21", commitMode="staged")  # recorded: skipped too
    assert read(spark, url, "s").count() == 6000


def python_worker_pids(spark) -> set[int]:
    """The process ids of the Python workers a 4-task job runs in (reused idle workers if any)."""
    import pyarrow as pa

    def pid(batches):
        for _batch in batches:
            pass
        yield pa.RecordBatch.from_pylist([{"pid": os.getpid()}])

    return {r.pid for r in spark.range(0, 400, numPartitions=4).mapInArrow(pid, "pid long").collect()}


def test_a_skipped_rerun_leaves_the_python_workers_reusable(spark, tmp_path):
    # A task that returns without reading its rows makes Spark drop its Python worker: the next
    # job's tasks would start new workers and import everything again (seconds each).
    url = str(tmp_path / "store")
    df = events_df(spark, rows=2000)
    write(df, url, "s", segments=2, writeId="once")
    before = python_worker_pids(spark)
    write(df, url, "s", writeId="once")  # committed already: every task skips its rows
    assert python_worker_pids(spark) <= before
    assert read(spark, url, "s").count() == 2000


def test_a_failed_job_rerun_with_its_write_id_completes_it_exactly_once(spark, tmp_path):
    url = str(tmp_path / "store")
    df = events_df(spark, rows=4000)
    with pytest.raises(Exception, match="injected failure"):  # every attempt of task 2 fails
        write(df, url, "s", segments=2, writeId="w", **{"testing.failPartitions": "2",
                                                         "testing.failAfterRows": "300",
                                                         "testing.failAttempts": "4"})
    partial = read(spark, url, "s").count()
    write(df, url, "s", writeId="w")
    assert 300 <= partial < 4000 and sorted(payloads(spark, url, "s")) == sorted(b"event-%d" % i for i in range(4000))


def _run_stream(spark, url, checkpoint, source_options=None):
    source = spark.readStream.format("attrindex").option("path", url).option("stream", "in")
    for key, value in (source_options or {}).items():
        source = source.option(key, value)
    query = (source.load().selectExpr("key", "value", "timestamp as ts")
             .writeStream.format("attrindex").option("path", url).option("stream", "out")
             .option("segments", 2).option("keyColumn", "key").option("timestampColumn", "ts")
             .option("checkpointLocation", checkpoint).start())
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    return query


def _forget_last_spark_commit(checkpoint) -> int:
    """Make Spark replay its last micro-batch, as after a crash between our commit and its own."""
    commits = os.path.join(checkpoint, "commits")
    last = max(int(n) for n in os.listdir(commits) if n.isdigit())
    for name in (str(last), f".{last}.crc"):
        path = os.path.join(commits, name)
        if os.path.exists(path):
            os.remove(path)
    return last


def test_streaming_read_to_write_through_a_restart_with_a_replayed_batch(spark, tmp_path):
    url, checkpoint = str(tmp_path / "store"), str(tmp_path / "checkpoint")
    write(events_df(spark, rows=5000), url, "in", segments=3)
    _run_stream(spark, url, checkpoint)
    assert read(spark, url, "out").count() == 5000

    # A restart that replays the last batch, after more input arrived.
    replayed = _forget_last_spark_commit(checkpoint)
    write(events_df(spark, rows=2000, start=5000), url, "in")
    query = _run_stream(spark, url, checkpoint)
    assert [p["batchId"] for p in query.recentProgress][0] == replayed
    assert sorted(payloads(spark, url, "out")) == sorted(b"event-%d" % i for i in range(7000))

    # A crash after the tasks wrote but before anything was committed: both commit records go.
    replayed = _forget_last_spark_commit(checkpoint)
    with SegmentStore.open(url) as store:
        ledger = store.storage.list_files("_streams/out/_commits")
        store.storage.delete([f"_streams/out/_commits/{p}" for p in ledger if p.endswith(f"{replayed:020d}")])
    _run_stream(spark, url, checkpoint)
    assert sorted(payloads(spark, url, "out")) == sorted(b"event-%d" % i for i in range(7000))


def test_streaming_reader_starts_at_latest_when_asked(spark, tmp_path):
    url, checkpoint = str(tmp_path / "store"), str(tmp_path / "checkpoint")
    write(events_df(spark, rows=1000), url, "in", segments=2)
    with SegmentStore.open(url) as store:
        store.create_stream("out", 2)
    _run_stream(spark, url, checkpoint, {"startingOffsets": "latest"})
    assert read(spark, url, "out").count() == 0
    write(events_df(spark, rows=500, start=1000), url, "in")
    _run_stream(spark, url, checkpoint)
    assert sorted(payloads(spark, url, "out")) == sorted(b"event-%d" % i for i in range(1000, 1500))


def test_reads_split_by_chunk_and_filter_by_time(spark, tmp_path):
    url = str(tmp_path / "store")
    write(events_df(spark, rows=6000), url, "s", segments=2, logRollingSize=4096, batchEvents=100)
    df = read(spark, url, "s", {"maxRecordsPerPartition": "1000"})
    assert df.rdd.getNumPartitions() >= 6  # 2 segments cut at chunk boundaries
    assert df.count() == 6000
    # Timestamps are 1700000000000 + id ms: the time index narrows the scan to ids 1000..1999.
    narrowed = read(spark, url, "s", {"startingTimestamp": 1_700_000_001_000, "endingTimestamp": 1_700_000_002_000})
    assert sorted(payloads(spark, url, "s", {"startingTimestamp": 1_700_000_001_000,
                                             "endingTimestamp": 1_700_000_002_000})) == \
        sorted(b"event-%d" % i for i in range(1000, 2000))
    assert narrowed.count() == 1000


def test_filters_on_a_reused_dataframe_stay_correct_by_default(spark, tmp_path):
    url = str(tmp_path / "store")
    write(events_df(spark, rows=2000), url, "s", segments=2)
    df = read(spark, url, "s")
    assert df.where("segment = 's/1' and offset < 10").count() == 10
    assert df.count() == 2000  # PySpark 4.3 would reuse the filtered read if filters were pushed


def test_pushed_filters_give_the_same_rows_as_spark_filtering(spark, tmp_path):
    url = str(tmp_path / "store")
    write(events_df(spark, rows=3000), url, "s", segments=3)
    queries = ["segment = 's/1' and offset >= 100 and offset < 350",
               "segment in ('s/0', 's/2') and offset > 5 and offset <= 40",
               "timestamp >= timestamp_millis(1700000001000) and timestamp < timestamp_millis(1700000001500)",
               "offset = 7"]
    expected = {q: sorted(payloads_where(read(spark, url, "s"), q)) for q in queries}
    attrindex.spark.register(spark, filter_pushdown=True)
    try:
        for q in queries:
            df = read(spark, url, "s").where(q)  # a fresh DataFrame per query (see register())
            assert sorted(bytes(r.value) for r in df.select("value").collect()) == expected[q], q
        # The segment filter prunes whole segments: one segment's single chunk is one partition.
        assert read(spark, url, "s").where("segment = 's/1'").rdd.getNumPartitions() == 1
    finally:
        spark.conf.set(attrindex.spark.FILTER_PUSHDOWN_CONF, "false")
        attrindex.spark.register(spark)


def payloads_where(df, condition):
    return [bytes(r.value) for r in df.where(condition).select("value").collect()]


def test_attribute_bulk_load_then_lookup_matches_a_dict(spark, tmp_path):
    url = str(tmp_path / "store")
    rng = random.Random(5)
    model = {}
    rows = []
    for _ in range(3000):
        key = rng.randrange(1 << 40)
        value = rng.randrange(-(1 << 63), 1 << 63)
        model[key] = value
        rows.append((key, value))
    df = spark.createDataFrame(rows, "key long, value long").repartition(3)
    df.write.format("attrindex.attributes").option("path", url).option("segment", "attrs").mode("append").save()
    # Updates by UUID string and removals by null, in a second load.
    removed = rng.sample(sorted(model), 200)
    second = [(str(uuid.UUID(int=k)), None) for k in removed] + [(str(uuid.UUID(int=7)), 70)]
    for k in removed:
        del model[k]
    model[7] = 70
    (spark.createDataFrame(second, "key string, value long").write.format("attrindex.attributes")
     .option("path", url).option("segment", "attrs").mode("append").save())

    probes = sorted(model)[::3] + removed[:50] + [1 << 41, 1 << 42]
    looked = attrindex.spark.lookup(spark.createDataFrame([(k,) for k in probes], "k long"), "k", url, "attrs")
    assert {r.k: r.value for r in looked.collect()} == {k: model.get(k) for k in probes}
    # Lookups of 7 rows at a time, with null keys among the probes: every row keeps its own answer.
    rows = [(k, i) for i, k in enumerate(probes)] + [(None, -1), (None, -2)]
    looked = attrindex.spark.lookup(spark.createDataFrame(rows, "k long, i long").repartition(2), "k", url, "attrs",
                                    batch_rows=7)
    assert sorted((r.i, r.value) for r in looked.collect()) == sorted(
        [(i, model.get(k)) for i, k in enumerate(probes)] + [(-1, None), (-2, None)])

    back = (spark.read.format("attrindex.attributes").option("path", url).option("segment", "attrs")
            .option("partitions", 4).load())
    assert {int.from_bytes(bytes(r.key), "big"): r.value for r in back.collect()} == model


#: a row's 16-byte key from its index, in Spark SQL and in Python: keys spread over the key space
SPREAD_KEY = "substring(unhex(sha2(cast({col} as string), 256)), 1, 16)"


def spread_key(index: int) -> bytes:
    return hashlib.sha256(str(index).encode()).digest()[:16]


def test_attribute_load_lookup_and_read_of_rows_made_in_spark(spark, tmp_path):
    """200k rows made in the JVM, loaded by 4 tasks (taking turns), looked up by 60k probes (half
    absent) in batches smaller than a partition, and read back whole."""
    from pyspark.sql import functions as F

    url, n = str(tmp_path / "store"), 200_000
    (spark.range(n, numPartitions=4).selectExpr(SPREAD_KEY.format(col="id") + " as key", "id * 1000003 + 7 as value")
     .write.format("attrindex.attributes").option("path", url).option("segment", "big").mode("append").save())

    probes = (spark.range(60_000, numPartitions=3).selectExpr(f"(id * 7919 + 13) % {2 * n} as idx")
              .selectExpr("idx", SPREAD_KEY.format(col="idx") + " as key"))
    looked = attrindex.spark.lookup(probes, "key", url, "big", value_col="found", batch_rows=15_000)
    wanted = F.when(F.col("idx") < n, F.col("idx") * 1000003 + 7)
    totals = looked.agg(F.count("found").alias("matches"), F.sum((F.col("idx") < n).cast("int")).alias("present"),
                        F.sum((~F.col("found").eqNullSafe(wanted)).cast("int")).alias("wrong")).collect()[0]
    assert totals.matches == totals.present > 20_000 and totals.wrong == 0
    sample = looked.limit(300).collect()
    assert {r.idx < n for r in sample} == {True, False}
    for r in sample:
        assert bytes(r.key) == spread_key(r.idx) and r.found == (r.idx * 1000003 + 7 if r.idx < n else None)

    back = (spark.read.format("attrindex.attributes").option("path", url).option("segment", "big")
            .option("partitions", 4).load())
    got = back.agg(F.count("*").alias("rows"), F.countDistinct("key").alias("keys"), F.sum("value").alias("total"),
                   F.min("key").alias("first")).collect()[0]
    assert (got.rows, got.keys, got.total) == (n, n, sum(i * 1000003 + 7 for i in range(n)))
    assert bytes(got.first) == min(spread_key(i) for i in range(n))


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _command(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def task_worker_pids() -> list[int]:
    """The Python processes running this session's tasks: the children of the JVM's
    ``pyspark.daemon`` for the ``pyspark.worker`` module (the JVM is this process's child)."""
    return [worker for jvm in _children(os.getpid()) if os.path.basename(_command(jvm)[0]) == b"java"
            for daemon in _children(jvm) if b"pyspark.daemon" in _command(daemon) and b"pyspark.worker" in _command(daemon)
            for worker in _children(daemon)]


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_task_worker_rss(job) -> int:
    """The largest peak RSS (KiB) of a task worker while ``job()`` ran: every worker's peak is
    reset first (``/proc/PID/clear_refs``); workers forked meanwhile count from their fork."""
    for pid in task_worker_pids():
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
    job()
    peaks = []
    for pid in task_worker_pids():
        with contextlib.suppress(OSError, StopIteration):
            peaks.append(_status_kib(pid, "VmHWM"))
    assert peaks
    return max(peaks)


def test_an_attribute_load_task_holds_no_more_memory_for_more_rows(spark, tmp_path):
    """One task loading 500k rows, then one loading 1M: its worker's peak RSS stays within noise
    of the first (tier 1 is ``maxPendingBytes``, 4 MiB; one process's RSS levels off after about
    400k rows, when the page cache is full; measured: 5.8 MiB more, twice). Holding the task's
    updates (a list of them, or a value per key cached: over 100 bytes a row) would add over
    50 MB for the 500k rows more, well above the 24 MiB allowed."""
    def load(rows: int, segment: str):
        def job():
            (spark.range(rows, numPartitions=1).selectExpr("unhex(lpad(hex(id), 32, '0')) as key", "id as value")
             .write.format("attrindex.attributes").option("path", str(tmp_path / "store")).option("segment", segment)
             .option("maxPendingBytes", 4 << 20).mode("append").save())
        return job

    load(20_000, "warm")()  # a worker that has run a load: its imports are resident
    small = peak_task_worker_rss(load(500_000, "small"))
    large = peak_task_worker_rss(load(1_000_000, "large"))
    assert large - small < 24 << 10, (small, large)
    with SegmentStore.open(str(tmp_path / "store"), mode="r+") as store:
        assert store.segment("large").stats().attributes.entry_count == 1_000_000


def test_lookup_by_binary_and_uuid_keys(spark, tmp_path):
    url = str(tmp_path / "store")
    keys = [uuid.uuid4() for _ in range(50)]
    df = spark.createDataFrame([(k.bytes, i) for i, k in enumerate(keys)], "key binary, value long")
    df.write.format("attrindex.attributes").option("path", url).option("segment", "a").mode("append").save()
    by_uuid = attrindex.spark.lookup(spark.createDataFrame([(str(k),) for k in keys], "id string"),
                                     "id", url, "a", value_col="n")
    assert {r.id: r.n for r in by_uuid.collect()} == {str(k): i for i, k in enumerate(keys)}


@pytest.mark.parametrize("call, message", [
    (lambda s, u: read(s, u, "nope").count(), "stream 'nope' does not exist"),
    (lambda s, u: s.read.format("attrindex").option("path", u).load().count(), "option 'stream' is required"),
    (lambda s, u: write(s.range(3).selectExpr("id as value", "'k' as key", "current_timestamp() as ts"), u, "s",
                        segments=1), "column 'value' (valueColumn) has type bigint; it must be binary or string"),
    (lambda s, u: write(events_df(s, 10), u, "missing"), "stream 'missing' does not exist"),
    (lambda s, u: events_df(s, 10).write.format("attrindex").option("path", u).option("stream", "s")
     .option("segments", 1).mode("overwrite").save(), "streams are append-only"),
    (lambda s, u: write(events_df(s, 10), u, "s", segments=1, commitMode="fast"), "'commitMode' must be one of"),
    (lambda s, u: s.createDataFrame([(1.5, 1)], "key double, value long").write.format("attrindex.attributes")
     .option("path", u).option("segment", "a").mode("append").save(), "column 'key' has type double"),
    (lambda s, u: attrindex.spark.lookup(s.range(3), "id", u, "absent"), "segment 'absent' does not exist"),
    (lambda s, u: attrindex.spark.lookup(s.range(3), "id", u, "absent", batch_rows=0), "batch_rows must be an int >= 1"),
    (lambda s, u: s.createDataFrame([(b"short", 1)], "key binary, value long").write.format("attrindex.attributes")
     .option("path", u).option("segment", "a").mode("append").save(), "key must be 16 bytes"),
    (lambda s, u: read(s, "ftp://host/x", "s").count(), "unsupported storage scheme 'ftp'"),
])
def test_user_errors_are_clear_messages(spark, tmp_path, call, message):
    url = str(tmp_path / "store")
    with pytest.raises(Exception) as caught:
        call(spark, url)
    assert message in str(caught.value)


def test_workers_run_this_interpreter(spark):
    assert os.environ["PYSPARK_PYTHON"]
    import sys

    ran = spark.sparkContext.parallelize([0], 1).map(lambda _: __import__("sys").executable).collect()
    assert ran == [os.environ.get("PYSPARK_PYTHON", sys.executable)]
    assert shutil.which(ran[0]) or os.path.exists(ran[0])


def test_reads_and_writes_from_other_threads_find_the_formats(spark, tmp_path):
    """Spark looks Python data sources up in the calling JVM thread's active session only, and a
    new Python thread gets a JVM thread without one: register() makes these calls set it."""
    from concurrent.futures import ThreadPoolExecutor

    url = str(tmp_path / "store")
    df = events_df(spark, rows=2000, partitions=2)  # made in the main thread

    def write_and_read(n):
        write(df, url, f"s{n}", segments=2, writeId=f"w{n}")
        attributes = spark.createDataFrame([(n, n * 10)], "key long, value long")
        attributes.write.format("attrindex.attributes").option("path", url).option("segment", f"a{n}") \
            .mode("append").save()
        return read(spark, url, f"s{n}").count(), attrindex.spark.write_summary(url, f"s{n}", f"w{n}")["rows"]

    with ThreadPoolExecutor(2) as pool:  # fresh threads: their JVM threads have no active session
        assert list(pool.map(write_and_read, range(2))) == [(2000, 2000), (2000, 2000)]
