"""The ``attrindex`` Spark data source against Parquet: write and read throughput, in one session.

    python -m sims.spark.run [--rows 1000000] [--partitions 4] [--master local[2]] [--read-runs 2]
                             [--out sims/out/spark] [--dir DIR] [--keep]

One SparkSession, one cached DataFrame of --rows events made in the JVM (``spark.range``):
``key`` ('user-<id % 50000>'), ``value`` (100 distinct bytes: the zero-padded id, then SHA-512
and part of SHA-256 of it) and ``ts`` (a timestamp, 10 ms apart). It is cached and counted first,
and a small untimed warm-up write and read of each format starts the JVM code paths and the
Python workers, so the timings below hold only the work itself:

  parquet write        df.write.parquet(DIR)
  attrindex direct     exactly-once write (commitMode=direct, writeId bench-1), 4 segments
  attrindex staged     the same with commitMode=staged (stream bench_staged, writeId bench-2)
  attrindex rerun      the direct write again with writeId bench-1 (committed already: no-op)
  reads                count(), and sum(length(value)) (every payload crosses into Spark),
                       for the attrindex stream and the Parquet files; each runs --read-runs
                       times and the best counts (the first attrindex read of the big stream
                       has taken up to 2x longer than the next, despite the warm-up)

The reads are checked: count = --rows, count(distinct value) = --rows, and the same payload bytes
as Parquet. Prints a table and writes results.json and results.md to --out. The target of the
issue: an exactly-once write at >= 0.5x Parquet's rows/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import pyspark

import attrindex.spark as ais

KEYS = 50_000
TARGET_RATIO = 0.5
WARMUP_ROWS = 10_000
EVENT_COLUMNS = (
    f"concat('user-', cast(id % {KEYS} as string)) as key",
    "concat(cast(lpad(cast(id as string), 12, '0') as binary), unhex(sha2(cast(id as string), 512)),"
    " substring(unhex(sha2(cast(id as string), 256)), 1, 24)) as value",
    "timestamp_millis(1767225600000 + id * 10) as ts",
)


class BenchmarkError(AssertionError):
    """A read returned something other than what was written."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise BenchmarkError(message)


def events(spark, rows: int, partitions: int):
    """``rows`` events made in the JVM, spread over ``partitions`` partitions."""
    return spark.range(rows, numPartitions=partitions).selectExpr(*EVENT_COLUMNS)


def timed(label: str, action) -> tuple[float, object]:
    """Run ``action()``, printing the phase; (seconds, its result)."""
    print(f"  {label} ...", end="", flush=True)
    start = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - start
    print(f" {seconds:.2f} s", flush=True)
    return seconds, result


def attrindex_write(df, store: str, stream: str, write_id: str, staged: bool = False) -> None:
    writer = (df.write.format("attrindex").option("path", store).option("stream", stream).option("segments", 4)
              .option("keyColumn", "key").option("valueColumn", "value").option("timestampColumn", "ts")
              .option("writeId", write_id))
    if staged:
        writer = writer.option("commitMode", "staged")
    writer.mode("append").save()


def read_attrindex(spark, store: str, stream: str):
    return spark.read.format("attrindex").option("path", store).option("stream", stream).load()


def warm_up(spark, partitions: int, work: str) -> None:
    """Untimed: one small write and read of each format (JIT, codegen, Python workers)."""
    df = events(spark, WARMUP_ROWS, partitions)
    df.write.mode("overwrite").parquet(os.path.join(work, "warmup.parquet"))
    spark.read.parquet(os.path.join(work, "warmup.parquet")).count()
    spark.read.parquet(os.path.join(work, "warmup.parquet")).selectExpr("sum(length(value))").collect()
    store = os.path.join(work, "warmup-store")
    attrindex_write(df, store, "warmup", "warmup-1")
    attrindex_write(df, store, "warmup_staged", "warmup-2", staged=True)
    warm = read_attrindex(spark, store, "warmup")
    warm.count()
    warm.selectExpr("sum(length(value))").collect()


def run(spark, rows: int, partitions: int, work: str, read_runs: int) -> dict:
    """All phases; seconds per phase (a read's best of ``read_runs``), and what the reads returned."""
    parquet, store = os.path.join(work, "events.parquet"), os.path.join(work, "store")
    print(f"events: {rows:,} rows in {partitions} partitions", flush=True)
    df = events(spark, rows, partitions).cache()
    seconds, count = timed("generate and cache (untimed in the results)", df.count)
    check(count == rows, f"cached {count} rows, expected {rows}")
    payload_bytes = df.selectExpr("sum(length(value))").collect()[0][0]
    print("warm-up ...", flush=True)
    warm_up(spark, partitions, work)

    print("writes:", flush=True)
    t = {}
    t["parquet_write"], _ = timed("parquet write", lambda: df.write.mode("overwrite").parquet(parquet))
    t["attrindex_direct"], _ = timed("attrindex exactly-once write (direct)",
                                     lambda: attrindex_write(df, store, "bench", "bench-1"))
    t["attrindex_staged"], _ = timed("attrindex exactly-once write (staged)",
                                     lambda: attrindex_write(df, store, "bench_staged", "bench-2", staged=True))
    t["attrindex_rerun"], _ = timed("attrindex rerun of bench-1 (no-op)",
                                    lambda: attrindex_write(df, store, "bench", "bench-1"))
    summaries = {s: ais.write_summary(store, s, w) for s, w in (("bench", "bench-1"), ("bench_staged", "bench-2"))}

    print("reads:", flush=True)
    ours, theirs = read_attrindex(spark, store, "bench"), spark.read.parquet(parquet)
    staged = read_attrindex(spark, store, "bench_staged")
    got, all_reads = {}, {}
    for name, frame in (("attrindex", ours), ("parquet", theirs)):
        for kind, action, label in (("count", frame.count, "count()"),
                                    ("full", lambda: frame.selectExpr("sum(length(value))").collect()[0][0],
                                     "sum(length(value))")):
            runs = [timed(f"{name} {label}, run {i + 1}", action) for i in range(read_runs)]
            phase = f"{name}_read_{kind}"
            all_reads[phase] = [seconds for seconds, _ in runs]
            t[phase] = min(all_reads[phase])
            got[f"{name}_{'count' if kind == 'count' else 'bytes'}"] = runs[-1][1]

    print("checks (untimed) ...", flush=True)
    got["attrindex_distinct"] = ours.selectExpr("count(distinct value)").collect()[0][0]
    got["staged_count"], got["staged_distinct"] = staged.selectExpr("count(*)", "count(distinct value)").collect()[0]
    for name in ("attrindex_count", "parquet_count", "attrindex_distinct", "staged_count", "staged_distinct"):
        check(got[name] == rows, f"{name} = {got[name]}, expected {rows}")
    for name in ("attrindex_bytes", "parquet_bytes"):
        check(got[name] == payload_bytes, f"{name} = {got[name]}, expected {payload_bytes}")
    for stream, summary in summaries.items():
        check(summary is not None and summary["rows"] == rows, f"{stream}: commit summary {summary}")
    df.unpersist()
    return {"seconds": t, "read_runs": all_reads, "checks": got, "payload_bytes": payload_bytes, "commits": summaries,
            "sizes": {"parquet": dir_bytes(parquet), "attrindex": dir_bytes(store)}}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


ROWS = (  # (label, phase, compared with)
    ("parquet write", "parquet_write", None),
    ("attrindex exactly-once write (direct)", "attrindex_direct", "parquet_write"),
    ("attrindex exactly-once write (staged)", "attrindex_staged", "parquet_write"),
    ("attrindex rerun, same writeId (no-op)", "attrindex_rerun", "parquet_write"),
    ("parquet read: count()", "parquet_read_count", None),
    ("attrindex read: count()", "attrindex_read_count", "parquet_read_count"),
    ("parquet read: sum(length(value))", "parquet_read_full", None),
    ("attrindex read: sum(length(value))", "attrindex_read_full", "parquet_read_full"),
)


def table(rows: int, seconds: dict) -> list[tuple[str, float, float, float | None]]:
    """(label, seconds, rows/s, rows/s ÷ the Parquet counterpart's)."""
    out = []
    for label, phase, base in ROWS:
        ratio = seconds[base] / seconds[phase] if base else None
        out.append((label, seconds[phase], rows / seconds[phase], ratio))
    return out


def markdown(meta: dict, lines: list, ratio: float) -> str:
    text = [f"# attrindex Spark data source vs Parquet ({meta['date']})", "",
            f"{meta['rows']:,} rows of ~{meta['value_bytes']} B payloads, {meta['partitions']} partitions, "
            f"master {meta['master']}, {meta['cpus']} cpus, PySpark {meta['pyspark']}, Python {meta['python']}.", "",
            "| phase | s | rows/s | vs Parquet |", "|---|---|---|---|"]
    for label, s, rate, r in lines:
        text.append(f"| {label} | {s:.2f} | {rate:,.0f} | {'' if r is None else f'{r:.2f}x'} |")
    verdict = "met" if ratio >= TARGET_RATIO else "not met"
    text += ["", f"Target: exactly-once write >= {TARGET_RATIO}x Parquet's rows/s: {ratio:.2f}x, {verdict}.",
             f"On disk: Parquet {meta['sizes']['parquet'] / 2**20:.1f} MiB, "
             f"attrindex store (both streams) {meta['sizes']['attrindex'] / 2**20:.1f} MiB.", ""]
    return "\n".join(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--read-runs", type=int, default=2, help="runs of each read; the best is reported")
    parser.add_argument("--out", default="sims/out/spark")
    parser.add_argument("--dir", default=None, help="where the data goes (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the store and the Parquet files")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="attrindex-spark-", dir=args.dir)
    spark = ais.session(args.master, "attrindex-bench", conf={"spark.driver.memory": "4g",
                                                                   "spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    meta = {"date": datetime.date.today().isoformat(), "rows": args.rows, "partitions": args.partitions,
            "master": args.master, "cpus": os.cpu_count(), "pyspark": pyspark.__version__,
            "python": platform.python_version(), "value_bytes": 100}
    print(f"{meta['date']}: {meta['cpus']} cpus, Python {meta['python']}, PySpark {meta['pyspark']}, "
          f"{args.master}; data in {work}", flush=True)
    try:
        result = run(spark, args.rows, args.partitions, work, args.read_runs)
    finally:
        spark.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    meta["sizes"] = result["sizes"]
    meta["read_runs"] = args.read_runs
    lines = table(args.rows, result["seconds"])
    ratio = lines[1][3]

    print(f"\n{args.rows:,} rows, {args.partitions} partitions\n")
    head = f"{'phase':<40}{'s':>8}{'rows/s':>12}{'vs parquet':>12}"
    print(head + "\n" + "-" * len(head))
    for label, s, rate, r in lines:
        print(f"{label:<40}{s:>8.2f}{rate:>12,.0f}" + ("" if r is None else f"{r:>11.2f}x"))
    print(f"  target: exactly-once write >= {TARGET_RATIO}x parquet: {ratio:.2f}x, "
          f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}")
    print(f"  commit summaries: {json.dumps(result['commits'], sort_keys=True)}")

    record = {**meta, "ratio_direct_vs_parquet_write": ratio, "target_ratio": TARGET_RATIO,
              "phases": {phase: {"seconds": s, "rows_per_s": rate, "vs_parquet": r}
                         for (_, phase, _), (_, s, rate, r) in zip(ROWS, lines)},
              "read_runs_s": result["read_runs"], "checks": result["checks"], "commits": result["commits"]}
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump(record, handle, indent=2, sort_keys=True)
    with open(os.path.join(args.out, "results.md"), "w") as handle:
        handle.write(markdown(meta, lines, ratio))
    print(f"\nwrote {args.out}/results.json and results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
