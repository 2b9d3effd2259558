"""Profile the per-task write path of the ``attrindex`` Spark sink, without Spark.

    python -m sims.spark.profile_write [--rows 200000] [--batch 10000] [--mode direct|staged]
                                       [--arrow] [--others 0] [--top 25] [--out sims/out/spark]
                                       [--dir DIR]

One Spark task's work, in process: ``attrindex.spark.ingest.write_direct`` (or, with
``--mode staged``, ``stage_attempt`` and then the driver's ``commit_write``) on --rows events in
batches of --batch rows (Spark's default Arrow batch), to a 4-segment stream on local disk. The
events are those of ``sims.spark.run``: key 'user-<i % 50000>', a 100-byte payload, a timestamp
in ms. They are built in Python as ``EventColumns``; ``--arrow`` builds Arrow batches instead and
times their conversion as part of the task, as the data source does it (``arrow_columns``: a
direct write routes and encodes them column by column through ``EventWriter.write_arrow``, a
staged one encodes them column by column; ``--row-path`` converts them to lists for
``write_many`` instead, the path of writes with a headers column).
``--others N`` starts N more processes that write the same rows to the same stream at the same
time, as the other tasks of a Spark job do (they are not profiled).

The write runs once untimed by cProfile (rows/s), then again into a fresh stream under cProfile.
Prints the top --top functions by cumulative and by own time, and writes them to
profile-write-MODE.txt (and the raw .prof) in --out. cProfile sees only the main thread: in staged
mode, ``publish`` runs in a thread pool and shows as lock waits.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import multiprocessing
import os
import pstats
import shutil
import sys
import tempfile
import time

from attrindex.spark import ingest

KEYS = 50_000
EPOCH_MS = 1767225600000


def payload(i: int) -> bytes:
    """The 100-byte value of event ``i`` (as ``sims.spark.run`` makes it in the JVM)."""
    text = str(i).encode()
    return b"%012d" % i + hashlib.sha512(text).digest() + hashlib.sha256(text).digest()[:24]


def make_batches(rows: int, batch: int, arrow: bool) -> list:
    """The events as ``EventColumns`` (or as Arrow record batches with ``arrow``)."""
    out = []
    for start in range(0, rows, batch):
        ids = range(start, min(start + batch, rows))
        values = [payload(i) for i in ids]
        keys = [f"user-{i % KEYS}" for i in ids]
        stamps = [EPOCH_MS + 10 * i for i in ids]
        if arrow:
            import pyarrow as pa

            out.append(pa.RecordBatch.from_arrays(
                [pa.array(keys, pa.string()), pa.array(values, pa.binary()),
                 pa.array([s * 1000 for s in stamps], pa.timestamp("us", tz="UTC"))], names=["key", "value", "ts"]))
        else:
            out.append(ingest.EventColumns(values=values, keys=keys, timestamps=stamps))
    return out


def task(target: ingest.StreamTarget, batches: list, mode: str, arrow: bool, partition: int = 0) -> int:
    """Task ``partition``'s write (and the driver's commit of it); the rows written."""
    if arrow:  # as the data source converts: rows stay Arrow columns (lists with --row-path)
        from attrindex.spark.arrow import arrow_columns, event_columns

        if arrow == "rows":
            batches = (event_columns(b, "value", "key", "ts", None) for b in batches)
        else:
            batches = (arrow_columns(b, "value", "key", "ts") for b in batches)
    token = ingest.write_token(f"profile-{target.stream}-{partition}")  # one write per task
    if mode == "direct":
        report = ingest.write_direct(target, token, 0, partition, 0, batches)
    else:
        report = ingest.stage_attempt(target, token, 0, partition, 0, batches)
    ingest.commit_write(target, token, 0, [report], staged=mode == "staged")
    return report.rows


def run_once(work: str, stream: str, batches: list, mode: str, arrow: bool, others: int) -> tuple[float, int]:
    """Seconds and rows of task 0, written while ``others`` processes write the same rows."""
    target = ingest.StreamTarget(url=os.path.join(work, "store"), stream=stream, segments=4)
    target.prepare()
    context = multiprocessing.get_context("fork")
    peers = [context.Process(target=task, args=(target, batches, mode, arrow, p)) for p in range(1, others + 1)]
    for peer in peers:
        peer.start()
    start = time.perf_counter()
    rows = task(target, batches, mode, arrow)
    seconds = time.perf_counter() - start
    for peer in peers:
        peer.join()
        assert peer.exitcode == 0, f"a concurrent writer failed (exit code {peer.exitcode})"
    return seconds, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=10_000, help="rows per input batch")
    parser.add_argument("--mode", choices=("direct", "staged"), default="direct")
    parser.add_argument("--arrow", action="store_true", help="start from Arrow batches (event_columns included)")
    parser.add_argument("--row-path", action="store_true",
                        help="with --arrow: convert the batches to Python lists first (event_columns, write_many: "
                             "the data source's path for writes with a headersColumn)")
    parser.add_argument("--others", type=int, default=0, help="concurrent writers of the same stream")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default="sims/out/spark")
    parser.add_argument("--dir", default=None, help="where the store goes (default: a temp dir)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="attrindex-profile-", dir=args.dir)
    arrow = ("rows" if args.row_path else "columns") if args.arrow else None
    label = f"{args.mode}{f'-arrow-{arrow}' if arrow else ''}{f'-others{args.others}' if args.others else ''}"
    try:
        batches = make_batches(args.rows, args.batch, bool(arrow))
        seconds, rows = run_once(work, "plain", batches, args.mode, arrow, args.others)
        assert rows == args.rows, (rows, args.rows)
        print(f"{label}: {rows:,} rows in {seconds:.2f} s, {rows / seconds:,.0f} rows/s (no profiler)", flush=True)
        profile = cProfile.Profile()
        profile.enable()
        seconds, _ = run_once(work, "profiled", batches, args.mode, arrow, args.others)
        profile.disable()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = io.StringIO()
    text.write(f"{label}: {args.rows:,} rows under cProfile in {seconds:.2f} s\n\n"
               f"=== top {args.top} by cumulative time\n")
    stats = pstats.Stats(profile, stream=text).strip_dirs().sort_stats("cumulative")
    stats.print_stats(args.top)
    text.write(f"=== top {args.top} by own time\n")
    stats.sort_stats("tottime").print_stats(args.top)
    path = os.path.join(args.out, f"profile-write-{label}.txt")
    with open(path, "w") as handle:
        handle.write(text.getvalue())
    profile.dump_stats(os.path.join(args.out, f"profile-write-{label}.prof"))
    print(text.getvalue())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
