"""``attrindex demo``: the Spark pipeline end to end, with the failures it is built to survive.

1. Generate a day of shop events (views, carts, purchases by 50,000 users) as a Spark DataFrame.
2. Ingest it exactly once into a stream of segments while the first attempts of two tasks fail
   half-way and a third task runs with a concurrent duplicate attempt; then run the job again
   with the same ``writeId``, as a scheduler retrying a job it thinks failed would.
3. Read everything back and prove there are no duplicates and no losses.
4. Bulk-load each user's purchase total as attributes and look some users up.
5. Report throughput, the stream's shape and the attribute index's figures.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any, Callable

import attrs

from .errors import AttrIndexError

STREAM = "shop-events"
TOTALS = "user-purchase-totals"
USERS = 50_000
DAY_MS = 86_400_000
START_MS = 1_763_683_200_000  # 2025-11-21T00:00:00Z


@attrs.define
class DemoReport:
    url: str
    rows: int
    ingest_seconds: float = 0.0
    rerun_seconds: float = 0.0
    read_seconds: float = 0.0
    load_seconds: float = 0.0
    rows_read: int = 0
    distinct_events: int = 0
    missing_events: int = 0
    written_by_retries: int = 0  #: rows the failed/duplicate attempts had written, skipped by the retries
    segments: list = attrs.Factory(list)  #: SegmentStats of the stream's segments
    attributes_loaded: int = 0
    lookups: int = 0
    lookup_mismatches: int = 0
    totals: Any = None  #: SegmentStats of the attribute segment

    @property
    def exactly_once(self) -> bool:
        return self.rows_read == self.rows == self.distinct_events and not self.missing_events


def events(spark, rows: int, partitions: int):
    """A day of shop events: a unique ``event_id``, a user (``key``), a JSON payload (``value``)
    and the event time (``ts``). Built inside the JVM, so generation costs the Python side nothing."""
    return (spark.range(rows, numPartitions=partitions).selectExpr(
        "id as event_id",
        f"uuid_from(pmod(xxhash64(id), {USERS})) as key",
        f"timestamp_millis({START_MS} + cast(id * {DAY_MS} / {rows} as long)) as ts",
        "element_at(array('view', 'view', 'view', 'cart', 'purchase'), cast(pmod(xxhash64(id, 1), 5) + 1 as int)) as kind",
        "cast(pmod(xxhash64(id, 2), 20000) + 99 as long) as cents",
    ).selectExpr(
        "event_id", "key", "ts", "kind", "cents",
        "cast(to_json(named_struct('event_id', event_id, 'user', key, 'kind', kind, 'cents', cents,"
        " 'page', concat('/p/', cast(pmod(event_id, 997) as string)))) as binary) as value",
    ))


def _uuid_sql(spark) -> None:
    """``uuid_from(n)``: a stable UUID string per user number (a v4-shaped hex of a hash)."""
    spark.sql("""CREATE OR REPLACE TEMPORARY FUNCTION uuid_from(n BIGINT) RETURNS STRING RETURN
                 regexp_replace(substr(sha2(cast(n as string), 256), 1, 32),
                                '^(.{8})(.{4})(.{4})(.{4})(.{12})$', '$1-$2-$3-$4-$5')""")


def run_demo(spark, url: str, storage_options: dict | None = None, *, rows: int = 400_000,
             segments: int = 4, partitions: int = 8, say: Callable[[str], None] = print) -> DemoReport:
    """Run the pipeline against the store at ``url`` with ``spark``; returns what it measured."""
    import attrindex.spark as ais
    from .store import SegmentStore

    options = dict(storage_options or {})
    spark_options = {f"storage.{k}": str(v) for k, v in options.items()}
    report = DemoReport(url=url, rows=rows)
    _uuid_sql(spark)
    df = events(spark, rows, partitions).cache()
    say(f"[1/5] generating {rows:,} events of {USERS:,} users over one day ({partitions} partitions)")
    df.count()

    write_id = f"demo-ingest-{int(time.time())}"
    writer = (df.select("key", "value", "ts").write.format("attrindex").option("path", url)
              .option("stream", STREAM).option("segments", segments).option("keyColumn", "key")
              .option("timestampColumn", "ts").option("writeId", write_id).options(**spark_options))
    say(f"[2/5] exactly-once ingest into {segments} segments; the first attempts of tasks 1 and 5 fail"
        f" after {rows // partitions // 2:,} rows, task 3 runs with a duplicate attempt")
    started = time.perf_counter()
    (writer.option("testing.failPartitions", "1,5").option("testing.failAfterRows", max(1, rows // partitions // 2))
     .option("testing.duplicatePartitions", "3").mode("append").save())
    report.ingest_seconds = time.perf_counter() - started
    summary = ais.write_summary(url, STREAM, write_id, options) or {}
    report.written_by_retries = summary.get("skipped", 0)
    say(f"      {rows / report.ingest_seconds:,.0f} rows/s; retried attempts skipped {report.written_by_retries:,}"
        " rows their failed attempts had written")
    started = time.perf_counter()
    writer.mode("append").save()  # the whole job again, as a scheduler retrying it would
    report.rerun_seconds = time.perf_counter() - started
    say(f"      the same job rerun with writeId {write_id!r}: {report.rerun_seconds:.1f} s, nothing appended")

    say("[3/5] reading the stream back (parallel by segment and log chunk)")
    started = time.perf_counter()
    back = (spark.read.format("attrindex").option("path", url).option("stream", STREAM).options(**spark_options)
            .load().selectExpr("cast(get_json_object(cast(value as string), '$.event_id') as long) as event_id"))
    counts = back.selectExpr("count(*) as n", "count(distinct event_id) as d",
                             f"count(distinct if(event_id between 0 and {rows - 1}, event_id, null)) as known").collect()[0]
    report.read_seconds = time.perf_counter() - started
    report.rows_read, report.distinct_events = counts.n, counts.d
    report.missing_events = rows - counts.known  # ids 0 .. rows-1 that never came back
    say(f"      {report.rows_read:,} rows read, {report.distinct_events:,} distinct events, "
        f"{report.rows_read - report.distinct_events:,} duplicates, {report.missing_events:,} missing")

    say(f"[4/5] bulk-loading each user's purchase total (cents) into the attributes of {TOTALS!r}")
    totals = df.where("kind = 'purchase'").groupBy("key").agg({"cents": "sum"}).withColumnRenamed("sum(cents)", "value")
    started = time.perf_counter()
    (totals.write.format("attrindex.attributes").option("path", url).option("segment", TOTALS)
     .options(**spark_options).mode("append").save())
    report.load_seconds = time.perf_counter() - started
    expected = {r.key: r.value for r in totals.collect()}
    report.attributes_loaded = len(expected)
    sample = spark.createDataFrame([(k,) for k in list(expected)[:2000]] + [("00000000-0000-0000-0000-000000000000",)],
                                   "user string")
    looked = ais.lookup(sample, "user", url, TOTALS, value_col="total_cents", storage_options=options).collect()
    report.lookups = len(looked)
    report.lookup_mismatches = sum(1 for r in looked if r.total_cents != expected.get(r.user))
    say(f"      {report.attributes_loaded:,} users loaded in {report.load_seconds:.1f} s; {report.lookups:,} lookups,"
        f" {report.lookup_mismatches} mismatches")

    with SegmentStore.open(url, storage_options=options) as store:
        report.segments = [store.segment(name).stats() for name in store.stream_segments(STREAM)]
        report.totals = store.segment(TOTALS).stats()
    df.unpersist()
    return report


def print_report(report: DemoReport, say: Callable[[str], None] = print) -> None:
    say("[5/5] report")
    say(f"  store                {report.url}")
    say(f"  ingest               {report.rows:,} rows in {report.ingest_seconds:.1f} s "
        f"({report.rows / report.ingest_seconds:,.0f} rows/s, exactly once, with 2 failed attempts and a duplicate)")
    say(f"  read back + verify   {report.rows_read:,} rows in {report.read_seconds:.1f} s "
        f"({report.rows_read / max(report.read_seconds, 1e-9):,.0f} rows/s, JSON parsing and a distinct count included)")
    say(f"  exactly once         {'yes' if report.exactly_once else 'NO'}: "
        f"{report.rows_read - report.distinct_events} duplicates, {report.missing_events} missing")
    for seg in report.segments:
        say(f"  segment {seg.name:<16}{seg.next_offset - seg.start_offset:>9,} records, {seg.log_bytes:>11,} bytes"
            f" in {seg.log_chunks} log chunk(s), {seg.attributes.entry_count} writer ids")
    if report.totals is not None:
        index = report.totals.attributes
        say(f"  attribute index      {index.entry_count:,} keys in {index.page_count} pages, height {index.height}; "
            f"{index.live_bytes:,} live bytes of {index.storage_bytes:,} stored")
        say(f"  compaction           {index.start_offset:,} of {index.length:,} bytes ever appended were reclaimed"
            f" (pages moved to the tail so head chunks could be deleted)")
    say(f"  lookups              {report.lookups:,} users looked up, {report.lookup_mismatches} mismatches")


def main(path: str | None, storage_options: dict, rows: int, master: str = "local[*,4]") -> int:
    """The CLI entry: a local Spark (``local[*,4]``: all cores, a failed task retried up to 3
    times), in a temporary directory store unless ``path`` is given."""
    try:
        import attrindex.spark as ais
    except AttrIndexError as exc:
        print(f"attrindex demo: {exc}")
        return 1
    from storage_adapters import open_storage

    with tempfile.TemporaryDirectory(prefix="attrindex-demo-") as tmp:
        url = path or tmp
        open_storage(url, **storage_options).close()  # a bad URL or option fails now, not inside Spark
        print(f"attrindex demo: starting Spark ({master}) ...")
        spark = ais.session(master, app_name="attrindex-demo")
        spark.sparkContext.setLogLevel("OFF")  # the injected failures would print pages of traces
        try:
            report = run_demo(spark, url, storage_options, rows=rows)
            print_report(report)
        finally:
            spark.stop()
    return 0 if report.exactly_once and not report.lookup_mismatches else 1
