"""The ``attrindex`` Spark data source against Parquet: write and read throughput, in one session.

    python -m sims.spark.run [--rows 1000000] [--partitions 4] [--master local[2]] [--rounds 3]
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
                       for the attrindex stream and the Parquet files

Every phase runs --rounds times (fresh Parquet directory, stream and writeId each round), with
attrindex first in one round and Parquet first in the next; the medians are reported, and the
ratio of every round. The reads are checked: count = --rows, count(distinct value) = --rows, and
the same payload bytes as Parquet. Prints a table and writes results.json and results.md to
--out. The goals: direct write and full read >= 1.0x Parquet, staged write >= 0.8x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import pyspark

import attrindex.spark as ais

KEYS = 50_000
TARGET_RATIO = 0.5  #: the lower bar for the direct write (the table's "Target" line)
GOALS = {"attrindex_direct": 1.0, "attrindex_staged": 0.8, "attrindex_read_full": 1.0}  #: the goals per phase
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


LOADS: list[float] = []  #: the 1-minute load average after each timed phase (the machine may be shared)


def timed(label: str, action) -> tuple[float, object]:
    """Run ``action()``, printing the phase and the load average after it; (seconds, its result)."""
    print(f"  {label} ...", end="", flush=True)
    start = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - start
    LOADS.append(os.getloadavg()[0])
    print(f" {seconds:.2f} s (load {LOADS[-1]:.1f})", flush=True)
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


def run(spark, rows: int, partitions: int, work: str, rounds: int) -> dict:
    """All phases, ``rounds`` times with the order of attrindex and Parquet alternating; the
    seconds of every run of every phase, and what the reads returned."""
    store = os.path.join(work, "store")
    print(f"events: {rows:,} rows in {partitions} partitions", flush=True)
    df = events(spark, rows, partitions).cache()
    seconds, count = timed("generate and cache (untimed in the results)", df.count)
    check(count == rows, f"cached {count} rows, expected {rows}")
    payload_bytes = df.selectExpr("sum(length(value))").collect()[0][0]
    print("warm-up ...", flush=True)
    warm_up(spark, partitions, work)

    runs: dict[str, list[float]] = {}
    got, summaries = {}, {}
    for r in range(rounds):
        parquet = os.path.join(work, f"events-{r}.parquet")
        stream, staged_stream = f"bench{r}", f"bench_staged{r}"
        writes = [("parquet_write", "parquet write", lambda: df.write.mode("overwrite").parquet(parquet)),
                  ("attrindex_direct", "attrindex exactly-once write (direct)",
                   lambda: attrindex_write(df, store, stream, f"bench-{r}")),
                  ("attrindex_staged", "attrindex exactly-once write (staged)",
                   lambda: attrindex_write(df, store, staged_stream, f"bench-staged-{r}", staged=True))]
        if r % 2:
            writes.reverse()
        print(f"round {r + 1} writes:", flush=True)
        for phase, label, action in writes:
            runs.setdefault(phase, []).append(timed(label, action)[0])
        runs.setdefault("attrindex_rerun", []).append(
            timed("attrindex rerun (no-op)", lambda: attrindex_write(df, store, stream, f"bench-{r}"))[0])
        summaries[stream] = ais.write_summary(store, stream, f"bench-{r}")
        summaries[staged_stream] = ais.write_summary(store, staged_stream, f"bench-staged-{r}")

        print(f"round {r + 1} reads:", flush=True)
        frames = [("attrindex", read_attrindex(spark, store, stream)), ("parquet", spark.read.parquet(parquet))]
        if r % 2:
            frames.reverse()
        for name, frame in frames:
            for kind, action, label in (("count", frame.count, "count()"),
                                        ("full", lambda: frame.selectExpr("sum(length(value))").collect()[0][0],
                                         "sum(length(value))")):
                seconds, result = timed(f"{name} {label}", action)
                runs.setdefault(f"{name}_read_{kind}", []).append(seconds)
                got[f"{name}_{'count' if kind == 'count' else 'bytes'}"] = result

        print("checks (untimed) ...", flush=True)
        ours = read_attrindex(spark, store, stream)
        staged = read_attrindex(spark, store, staged_stream)
        got["attrindex_distinct"] = ours.selectExpr("count(distinct value)").collect()[0][0]
        got["staged_count"], got["staged_distinct"] = staged.selectExpr("count(*)", "count(distinct value)").collect()[0]
        for name in ("attrindex_count", "parquet_count", "attrindex_distinct", "staged_count", "staged_distinct"):
            check(got[name] == rows, f"{name} = {got[name]}, expected {rows}")
        for name in ("attrindex_bytes", "parquet_bytes"):
            check(got[name] == payload_bytes, f"{name} = {got[name]}, expected {payload_bytes}")
        for name, summary in summaries.items():
            check(summary is not None and summary["rows"] == rows, f"{name}: commit summary {summary}")
    df.unpersist()
    t = {phase: statistics.median(values) for phase, values in runs.items()}
    return {"seconds": t, "runs": runs, "checks": got, "payload_bytes": payload_bytes, "commits": summaries,
            "sizes": {"parquet": dir_bytes(os.path.join(work, "events-0.parquet")),
                      "attrindex": dir_bytes(store) // rounds}}


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


def ratios_per_round(runs: dict) -> dict:
    """Each compared phase's ratio to its Parquet counterpart, round by round (rows/s ÷ rows/s)."""
    return {phase: [round(b / a, 3) for a, b in zip(runs[phase], runs[base])]
            for _, phase, base in ROWS if base}


def markdown(meta: dict, lines: list, ratio: float) -> str:
    text = [f"# attrindex Spark data source vs Parquet ({meta['date']})", "",
            f"{meta['rows']:,} rows of ~{meta['value_bytes']} B payloads, {meta['partitions']} partitions, "
            f"master {meta['master']}, {meta['cpus']} cpus, PySpark {meta['pyspark']}, Python {meta['python']}; "
            f"load average {meta['load_average'][0]:.1f} to {meta['load_average'][1]:.1f}.", "",
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
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every write and read, attrindex and Parquet first in turn; medians reported")
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
        result = run(spark, args.rows, args.partitions, work, args.rounds)
    finally:
        spark.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    meta["sizes"] = result["sizes"]
    meta["rounds"] = args.rounds
    lines = table(args.rows, result["seconds"])
    ratio = lines[1][3]

    print(f"\n{args.rows:,} rows, {args.partitions} partitions\n")
    head = f"{'phase':<40}{'s':>8}{'rows/s':>12}{'vs parquet':>12}"
    print(head + "\n" + "-" * len(head))
    for label, s, rate, r in lines:
        print(f"{label:<40}{s:>8.2f}{rate:>12,.0f}" + ("" if r is None else f"{r:>11.2f}x"))
    ratios = {phase: r for (_, phase, _), (_, _, _, r) in zip(ROWS, lines)}
    for phase, goal in GOALS.items():
        print(f"  goal: {phase} >= {goal}x parquet: {ratios[phase]:.2f}x (median of rounds), "
              f"{'met' if ratios[phase] >= goal else 'NOT met'}; per round {ratios_per_round(result['runs'])[phase]}")
    print(f"  commit summaries: {json.dumps(result['commits'], sort_keys=True)}")
    meta["load_average"] = [min(LOADS), max(LOADS)]
    print(f"  load average during the timed phases: {min(LOADS):.1f} to {max(LOADS):.1f}")

    record = {**meta, "ratio_direct_vs_parquet_write": ratio, "target_ratio": TARGET_RATIO,
              "phases": {phase: {"seconds": s, "rows_per_s": rate, "vs_parquet": r}
                         for (_, phase, _), (_, s, rate, r) in zip(ROWS, lines)},
              "runs_s": result["runs"], "ratios_per_round": ratios_per_round(result["runs"]), "checks": result["checks"], "commits": result["commits"]}
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump(record, handle, indent=2, sort_keys=True)
    with open(os.path.join(args.out, "results.md"), "w") as handle:
        handle.write(markdown(meta, lines, ratio))
    print(f"\nwrote {args.out}/results.json and results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
