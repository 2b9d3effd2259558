"""``attrindex demo``: the Spark pipeline end to end, with the failures it is built to survive.

1. Generate a day of shop events (views, carts, purchases by 50,000 users) as a Spark DataFrame.
2. Ingest it exactly once into a stream of segments while the first attempts of some tasks fail
   half-way and another task runs with a concurrent duplicate attempt; then run the job again
   with the same ``writeId``, as a scheduler retrying a job it thinks failed would.
3. Read everything back and count duplicates and losses.
4. Bulk-load each user's purchase total as attributes and look some users up.
5. Report what was measured: throughput, the stream's shape, the attribute index's figures.

Each run of the demo writes under ``run-N/`` in the store (``N`` = 1, 2, ... claimed by an
exclusive create of ``_demo/run-N``), so the demo can run again on the same store, and everything
it names stays there afterwards. Before Spark starts, the demo checks what would otherwise fail
minutes later inside it: Java 17+, the ``--master``, and that the store can be written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from typing import Any, Callable, Iterator

import attrs

from .errors import AttrIndexError, ChunkExistsError, InvalidInputError, MissingDependencyError, StorageError
from .layout import DEMO_RUNS_DIR

STREAM = "shop-events"
TOTALS = "user-purchase-totals"
USERS = 50_000
DAY_MS = 86_400_000
START_MS = 1_763_683_200_000  # 2025-11-21T00:00:00Z
JAVA_MIN = 17
MAX_TASK_ATTEMPTS = 4  #: local[N] runs as local[N,4]: the injected failures need a retry


@attrs.define
class DemoReport:
    url: str
    rows: int
    run: int = 0  #: the run number: this run's data is under run-N/
    ingest_seconds: float = 0.0
    rerun_seconds: float = 0.0
    read_seconds: float = 0.0
    load_seconds: float = 0.0
    failed_tasks: list = attrs.Factory(list)  #: tasks whose first attempt was made to fail
    duplicated_tasks: list = attrs.Factory(list)  #: tasks run with a concurrent twin attempt
    rows_read: int = 0
    distinct_events: int = 0
    missing_events: int = 0
    written_by_retries: int = 0  #: rows the failed/duplicate attempts had written, skipped by the retries
    records_before_rerun: int = 0  #: records in the stream after the first job
    records_after_rerun: int = 0  #: ... and after the same job ran again
    segments: list = attrs.Factory(list)  #: SegmentStats of the stream's segments
    attributes_loaded: int = 0
    lookups: int = 0
    lookup_mismatches: int = 0
    totals: Any = None  #: SegmentStats of the attribute segment

    @property
    def prefix(self) -> str:
        return f"run-{self.run}"

    @property
    def stream(self) -> str:
        return f"{self.prefix}/{STREAM}"

    @property
    def totals_segment(self) -> str:
        return f"{self.prefix}/{TOTALS}"

    @property
    def rerun_appended(self) -> int:
        return self.records_after_rerun - self.records_before_rerun

    @property
    def exactly_once(self) -> bool:
        return (self.rows_read == self.rows == self.distinct_events and not self.missing_events
                and self.rerun_appended == 0)


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


def _driver_options(url: str, options: dict) -> dict:
    """The options of the demo's own (driver-side) storage clients: on S3 they fail fast, as the
    command line's do; Spark's tasks keep the client defaults, since a task is retried anyway."""
    from .locations import failing_fast

    return failing_fast(url, options)


def claim_run(url: str, storage_options: dict | None = None, *, rows: int = 0) -> int:
    """The next run number in the store at ``url``, claimed by an exclusive create of
    ``_demo/run-N``. It is the run's first write, so a store that cannot be written (a missing
    bucket, no credentials, an unreachable endpoint, a read-only directory, an S3 without
    conditional writes) fails here, before Spark starts."""
    from .store import SegmentStore

    options = _driver_options(url, dict(storage_options or {}))
    with SegmentStore.open(url, storage_options=options) as store:  # creates the store if it is new
        storage = store.storage
        numbers = [int(m[1]) for m in map(re.compile(rf"{DEMO_RUNS_DIR}/run-(\d+)").fullmatch, storage.list_files(DEMO_RUNS_DIR)) if m]
        first = max(numbers, default=0) + 1
        claim = json.dumps({"rows": rows, "started_ms": int(time.time() * 1000)}).encode()
        for run in range(first, first + 100):  # another demo on the same store may take a number first
            try:
                storage.create(f"{DEMO_RUNS_DIR}/run-{run}", claim)
                return run
            except ChunkExistsError:
                continue
    raise StorageError(f"could not claim a demo run number in {url} (runs {first}..{first + 99} were taken meanwhile)")


def _stream_records(url: str, options: dict, stream: str) -> int:
    from .store import SegmentStore

    with SegmentStore.open(url, storage_options=options, mode="r+") as store:
        return sum(s.next_offset - s.start_offset for s in (store.segment(n).stats() for n in store.stream_segments(stream)))


def _injected(partitions: int) -> tuple[list[int], list[int]]:
    """Tasks whose first attempt fails half-way, and tasks run with a duplicate attempt."""
    failing = [p for p in (1, 5) if p < partitions]
    duplicated = [3 if partitions > 3 else 0]
    return failing, duplicated


def run_demo(spark, url: str, storage_options: dict | None = None, *, rows: int = 400_000,
             segments: int = 4, partitions: int = 8, run: int | None = None,
             say: Callable[[str], None] = print) -> DemoReport:
    """Run the pipeline against the store at ``url`` with ``spark``, as run number ``run``
    (default: claim the next one); returns what it measured."""
    import attrindex.spark as ais

    from .store import SegmentStore

    options = dict(storage_options or {})
    driver = _driver_options(url, options)
    spark_options = {f"storage.{k}": json.dumps(v) if isinstance(v, (dict, list)) else str(v) for k, v in options.items()}
    report = DemoReport(url=url, rows=rows, run=claim_run(url, options, rows=rows) if run is None else run)
    report.failed_tasks, report.duplicated_tasks = _injected(partitions)
    _uuid_sql(spark)
    df = events(spark, rows, partitions).cache()
    say(f"[1/5] run {report.run}: generating {rows:,} events of {USERS:,} users over one day ({partitions} partitions)")
    df.count()

    write_id = f"demo-ingest-{report.prefix}"
    writer = (df.select("key", "value", "ts").write.format("attrindex").option("path", url)
              .option("stream", report.stream).option("segments", segments).option("keyColumn", "key")
              .option("timestampColumn", "ts").option("writeId", write_id).options(**spark_options))
    fail_after = max(1, rows // partitions // 2)
    say(f"[2/5] exactly-once ingest into stream {report.stream!r} of {segments} segments; the first attempts of "
        f"task(s) {', '.join(map(str, report.failed_tasks))} fail after {fail_after:,} rows, task(s) "
        f"{', '.join(map(str, report.duplicated_tasks))} run with a duplicate attempt")
    started = time.perf_counter()
    (writer.option("testing.failPartitions", ",".join(map(str, report.failed_tasks)))
     .option("testing.failAfterRows", fail_after)
     .option("testing.duplicatePartitions", ",".join(map(str, report.duplicated_tasks))).mode("append").save())
    report.ingest_seconds = time.perf_counter() - started
    summary = ais.write_summary(url, report.stream, write_id, driver) or {}
    report.written_by_retries = summary.get("skipped", 0)
    report.records_before_rerun = _stream_records(url, driver, report.stream)
    say(f"      {rows / report.ingest_seconds:,.0f} rows/s; the retries skipped {report.written_by_retries:,}"
        " rows that failed or duplicate attempts had written")
    started = time.perf_counter()
    writer.mode("append").save()  # the whole job again, as a scheduler retrying it would
    report.rerun_seconds = time.perf_counter() - started
    report.records_after_rerun = _stream_records(url, driver, report.stream)
    say(f"      the same job rerun with writeId {write_id!r}: {report.rerun_seconds:.1f} s, appended "
        f"{report.rerun_appended:,} rows (the stream holds {report.records_after_rerun:,} records)")

    say("[3/5] reading the stream back (parallel by segment and log chunk)")
    started = time.perf_counter()
    back = (spark.read.format("attrindex").option("path", url).option("stream", report.stream).options(**spark_options)
            .load().selectExpr("cast(get_json_object(cast(value as string), '$.event_id') as long) as event_id"))
    counts = back.selectExpr("count(*) as n", "count(distinct event_id) as d",
                             f"count(distinct if(event_id between 0 and {rows - 1}, event_id, null)) as known").collect()[0]
    report.read_seconds = time.perf_counter() - started
    report.rows_read, report.distinct_events = counts.n, counts.d
    report.missing_events = rows - counts.known  # ids 0 .. rows-1 that never came back
    say(f"      {report.rows_read:,} rows read, {report.distinct_events:,} distinct events, "
        f"{report.rows_read - report.distinct_events:,} duplicates, {report.missing_events:,} missing")

    say(f"[4/5] bulk-loading each user's purchase total (cents) into the attributes of {report.totals_segment!r}")
    totals = df.where("kind = 'purchase'").groupBy("key").agg({"cents": "sum"}).withColumnRenamed("sum(cents)", "value")
    started = time.perf_counter()
    (totals.write.format("attrindex.attributes").option("path", url).option("segment", report.totals_segment)
     .options(**spark_options).mode("append").save())
    report.load_seconds = time.perf_counter() - started
    expected = {r.key: r.value for r in totals.collect()}
    report.attributes_loaded = len(expected)
    sample = spark.createDataFrame([(k,) for k in list(expected)[:2000]] + [("00000000-0000-0000-0000-000000000000",)],
                                   "user string")
    looked = ais.lookup(sample, "user", url, report.totals_segment, value_col="total_cents", storage_options=options).collect()
    report.lookups = len(looked)
    report.lookup_mismatches = sum(1 for r in looked if r.total_cents != expected.get(r.user))
    say(f"      {report.attributes_loaded:,} users loaded in {report.load_seconds:.1f} s; {report.lookups:,} lookups,"
        f" {report.lookup_mismatches} mismatches")

    with SegmentStore.open(url, storage_options=driver, mode="r+") as store:
        report.segments = [store.segment(name).stats() for name in store.stream_segments(report.stream)]
        report.totals = store.segment(report.totals_segment).stats()
    df.unpersist()
    return report


def print_report(report: DemoReport, say: Callable[[str], None] = print) -> None:
    """The report: every figure in it was measured by ``run_demo``."""
    say("[5/5] report")
    say(f"  store                {report.url}, run {report.run} under {report.prefix}/ (kept)")
    say(f"  ingest               {report.rows:,} rows in {report.ingest_seconds:.1f} s "
        f"({report.rows / report.ingest_seconds:,.0f} rows/s); the retries skipped {report.written_by_retries:,} rows "
        "that failed or duplicate attempts had written")
    say(f"  job rerun            same writeId: appended {report.rerun_appended:,} rows in {report.rerun_seconds:.1f} s")
    say(f"  read back + verify   {report.rows_read:,} rows in {report.read_seconds:.1f} s "
        f"({report.rows_read / max(report.read_seconds, 1e-9):,.0f} rows/s, JSON parsing and a distinct count included)")
    say(f"  exactly once         {'yes' if report.exactly_once else 'NO'}: "
        f"{report.rows_read - report.distinct_events} duplicates, {report.missing_events} missing")
    for seg in report.segments:
        say(f"  segment {seg.name:<24}{seg.next_offset - seg.start_offset:>9,} records, {seg.log_bytes:>11,} bytes"
            f" in {seg.log_chunks} log chunk(s), {seg.attributes.entry_count} writer ids")
    if report.totals is not None:
        index = report.totals.attributes
        say(f"  attribute index      {index.entry_count:,} keys in {index.page_count} pages, height {index.height}; "
            f"{index.live_bytes:,} live bytes of {index.storage_bytes:,} stored")
        say(f"  compaction           {index.start_offset:,} of {index.length:,} bytes ever appended were reclaimed"
            f" (pages moved to the tail so head chunks could be deleted)")
    say(f"  lookups              {report.lookups:,} users looked up, {report.lookup_mismatches} mismatches")


# -- before Spark starts -----------------------------------------------------------------------
_LOCAL_MASTER = re.compile(r"local(?:\[(\*|\d+)(?:\s*,\s*(\d+))?\])?")


def spark_master(master: str) -> tuple[str, str | None]:
    """The master to run with, and a note if it differs from ``master``. The demo makes tasks
    fail once on purpose, and plain ``local[N]`` never retries a task (Spark's local mode takes
    its attempts from ``local[N,F]``), so ``local[N]`` runs as ``local[N,4]``; ``local[N,1]`` and
    ``local[0]`` are refused. Cluster masters retry tasks by default (``spark.task.maxFailures``)."""
    text = master.strip()
    match = _LOCAL_MASTER.fullmatch(text)
    if not match:
        return text, None
    threads, attempts = match[1] or "1", match[2]
    if threads == "0":
        raise InvalidInputError(f"--master {master!r} runs no threads; give local[N] with N >= 1, or local[*]")
    if attempts is None:
        chosen = f"local[{threads},{MAX_TASK_ATTEMPTS}]"
        return chosen, (f"--master {text} never retries a failed task and the demo makes tasks fail on purpose, "
                        f"so it runs as {chosen}")
    if int(attempts) < 2:
        raise InvalidInputError(f"--master {master!r} tries each task once, but the demo makes tasks fail on purpose "
                                f"and needs a retry; give local[{threads},{MAX_TASK_ATTEMPTS}] (or leave out the count)")
    return text, None


def check_java() -> str:
    """The ``java -version`` line of the Java Spark will start (``$JAVA_HOME/bin/java``, else
    ``java`` on the PATH, as spark-submit picks it); ``MissingDependencyError`` if there is none
    or it is older than Java 17."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    where = f"JAVA_HOME={home}" if home else "the PATH"
    install = (f"install Java {JAVA_MIN} or newer (e.g. sudo apt install openjdk-{JAVA_MIN}-jre-headless, "
               "or brew install openjdk@17) and make sure 'java -version' runs")
    if not java or not os.access(java, os.X_OK):
        raise MissingDependencyError(f"the demo runs Spark, which needs Java {JAVA_MIN}+, and there is no java "
                                     f"in {where}; {install}")
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MissingDependencyError(f"{java} -version did not run ({exc}); {install}") from None
    output = (done.stderr or done.stdout).strip()
    match = re.search(r'version "(\d+)(?:\.(\d+))?', output)
    if done.returncode != 0 or not match:
        raise MissingDependencyError(f"{java} -version failed: {output.splitlines()[0] if output else done.returncode}; {install}")
    major = int(match[2]) if match[1] == "1" and match[2] else int(match[1])  # "1.8.0" is Java 8
    if major < JAVA_MIN:
        raise MissingDependencyError(f"the demo runs Spark, which needs Java {JAVA_MIN}+, and {java} is Java {major}; {install}")
    return output.splitlines()[0]


@contextlib.contextmanager
def _output_to(log_path: str) -> Iterator[None]:
    """While Spark starts, send file descriptors 1 and 2 to ``log_path``: the JVM and the Python
    workers it starts inherit them, so their start-up warnings, logs and progress bars land in the
    log instead of the terminal. Our own descriptors come back afterwards."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)


def list_command(url: str, storage_options: dict, prefix: str) -> str:
    """The command listing a run's segments, ready to paste into a shell: the URL and every storage
    option the demo was given (``-o NAME=VALUE``, nested ones as JSON), quoted where needed."""
    words = ["attrindex", "segment", "list", url, "--prefix", prefix]
    for name, value in storage_options.items():
        words += ["-o", f"{name}={value if isinstance(value, str) else json.dumps(value)}"]
    return shlex.join(words)


def _start_spark(master: str, log_path: str):
    import attrindex.spark as ais

    conf = {"spark.ui.showConsoleProgress": "false"}
    try:
        with _output_to(log_path):
            spark = ais.session(master, app_name="attrindex-demo", conf=conf)
    except Exception as exc:  # noqa: BLE001 - Py4J and PySpark raise many kinds; all mean the same here
        raise AttrIndexError(f"Spark did not start ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); "
                             f"its output is in {log_path}") from exc
    spark.sparkContext.setLogLevel("ERROR")  # the injected failures would log pages of traces
    return spark


def main(path: str | None, storage_options: dict, rows: int, master: str = "local[*,4]", *,
         spark=None, segments: int = 4, partitions: int = 8, say: Callable[[str], None] = print) -> int:
    """The CLI entry: a local Spark (``local[*,4]``: all cores, a failed task retried up to 3
    times), in a new directory under the temporary directory unless ``path`` is given; the store
    is kept. ``spark``: a running session to use instead (it is left running). Returns the exit
    code: 0, or 3 if the exactly-once check or a lookup failed."""
    from .cli_errors import EXIT_DAMAGED, EXIT_OK

    import attrindex.spark  # noqa: F401 - without PySpark: MissingDependencyError naming the extra

    chosen, note = spark_master(master)
    if spark is None:
        java = check_java()
    url = path or tempfile.mkdtemp(prefix="attrindex-demo-")
    run = claim_run(url, storage_options, rows=rows)  # the store works before Spark starts
    say(f"attrindex demo: run {run} in {url}")
    if note:
        say(f"attrindex demo: {note}")
    started_here = spark is None
    log_path = os.path.join(tempfile.gettempdir(), f"attrindex-demo-spark-{os.getpid()}.log")
    if started_here:
        say(f"attrindex demo: starting Spark ({chosen}, {java}); Spark's own output goes to {log_path}")
        spark = _start_spark(chosen, log_path)
    try:
        report = run_demo(spark, url, storage_options, rows=rows, segments=segments, partitions=partitions,
                          run=run, say=say)
    except AttrIndexError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed Spark job surfaces as Py4J/PySpark errors of many kinds
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise AttrIndexError(f"the demo's Spark job failed: {first.strip()[:300]}"
                             + (f"; Spark's output is in {log_path}" if started_here else "")) from exc
    finally:
        if started_here:
            spark.stop()
    print_report(report, say)
    say(f"attrindex demo: the store is kept: {list_command(url, storage_options, report.prefix)}")
    return EXIT_OK if report.exactly_once and not report.lookup_mismatches else EXIT_DAMAGED
