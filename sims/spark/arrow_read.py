"""Reading records into a ``pyarrow.Table`` outside Spark: attrindex against Parquet.

    python -m sims.spark.arrow_read [--rows 1000000] [--segments 4] [--rounds 3] [--dir DIR]
                                    [--out sims/out/spark]

Writes --rows events (key 'user-<i % 50000>', a 100-byte payload, a timestamp 10 ms apart: the
rows of ``sims.spark.run``) once into a --segments stream (EventWriter, 5,000 events per batch,
as the Spark source appends) and once, the same rows, into one Parquet file (pyarrow, snappy).
Then, for --rounds rounds, each side reads everything into a ``pyarrow.Table`` in a process of
its own (a fresh interpreter: no warm caches of the other side), alternating which goes first:

  attrindex   attrindex.arrow.scan_stream(store, stream).to_table()
  parquet     pyarrow.parquet.read_table(file)

Each child reads twice (the first read of a fresh process pays its page faults and lazy set-up,
the second is warm), checks the row count and the total payload bytes, and reports both read
times (imports and opening excluded) and the CPU time of the second (all of the process's
threads: both sides read with threads). Prints records/s per round with the load average, the
medians of each and the ratios, and records per CPU-second (less disturbed than wall time on a
shared machine); the issue's goal is >= 5M records/s for attrindex (the warm read). Writes
arrow-read.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

KEYS = 50_000
EPOCH_MS = 1767225600000
GOAL = 5_000_000


def payload(i: int) -> bytes:
    import hashlib

    text = str(i).encode()
    return b"%012d" % i + hashlib.sha512(text).digest() + hashlib.sha256(text).digest()[:24]


def prepare(work: str, rows: int, segments: int) -> int:
    """Write both sides; the total payload bytes."""
    import uuid

    import pyarrow as pa
    import pyarrow.parquet as pq

    from attrindex import EventWriter, SegmentStore

    values = [payload(i) for i in range(rows)]
    keys = [b"user-%d" % (i % KEYS) for i in range(rows)]
    stamps = [EPOCH_MS + 10 * i for i in range(rows)]
    with SegmentStore.open(os.path.join(work, "store")) as store:
        writer = EventWriter(store, "events", segments=segments, batch_events=5000, writer_id=uuid.uuid4())
        for start in range(0, rows, 100_000):
            writer.write_many(values[start:start + 100_000], keys[start:start + 100_000],
                              timestamps=stamps[start:start + 100_000])
        writer.close()
    table = pa.table({"key": pa.array(keys, pa.binary()), "value": pa.array(values, pa.binary()),
                      "timestamp": pa.array(stamps, pa.int64()).cast(pa.timestamp("ms", tz="UTC"))})
    pq.write_table(table, os.path.join(work, "events.parquet"))
    return sum(map(len, values))


def child(kind: str, work: str) -> None:
    """Two timed reads in this process (the first in a cold process, the second warm): prints
    JSON {seconds: [first, second], rows, bytes}."""
    import pyarrow.compute as pc

    times, cpu = [], []
    for _ in range(2):
        if kind == "attrindex":
            from attrindex import SegmentStore
            from attrindex.arrow import scan_stream

            store = SegmentStore.open(os.path.join(work, "store"), mode="r+")
            scanner = scan_stream(store, "events")
            start, start_cpu = time.perf_counter(), time.process_time()
            table = scanner.to_table()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            store.close()
        else:
            import pyarrow.parquet as pq

            start, start_cpu = time.perf_counter(), time.process_time()
            table = pq.read_table(os.path.join(work, "events.parquet"))
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    print(json.dumps({"seconds": times, "cpu_seconds": cpu, "rows": table.num_rows,
                      "bytes": pc.sum(pc.binary_length(table.column("value"))).as_py()}))


def measure(kind: str, work: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "sims.spark.arrow_read", "--child", kind, "--dir", work],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default="sims/out/spark")
    parser.add_argument("--child", choices=("attrindex", "parquet"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.dir)
        return 0
    work = tempfile.mkdtemp(prefix="attrindex-arrow-read-", dir=args.dir)
    try:
        print(f"writing {args.rows:,} rows ...", flush=True)
        payload_bytes = prepare(work, args.rows, args.segments)
        results: dict[str, list[float]] = {"attrindex": [], "parquet": []}
        cold: dict[str, list[float]] = {"attrindex": [], "parquet": []}
        cpu: dict[str, list[float]] = {"attrindex": [], "parquet": []}
        loads: list[float] = []
        for round_ in range(args.rounds):
            order = ("attrindex", "parquet") if round_ % 2 == 0 else ("parquet", "attrindex")
            for kind in order:
                got = measure(kind, work)
                if got["rows"] != args.rows or got["bytes"] != payload_bytes:
                    raise AssertionError(f"{kind} read {got['rows']} rows / {got['bytes']} B, expected "
                                         f"{args.rows} / {payload_bytes}")
                first, second = got["seconds"]
                cold[kind].append(first)
                results[kind].append(second)
                cpu[kind].append(got["cpu_seconds"][1])
                loads.append(os.getloadavg()[0])
                print(f"  round {round_ + 1} {kind:<10} cold {first:.3f} s ({args.rows / first / 1e6:.2f} M/s), "
                      f"warm {second:.3f} s ({args.rows / second / 1e6:.2f} M records/s, CPU "
                      f"{got['cpu_seconds'][1]:.3f} s), load {loads[-1]:.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in results.items()}
    cold_medians = {k: statistics.median(v) for k, v in cold.items()}
    print(f"\nfirst read of a process (median): attrindex {args.rows / cold_medians['attrindex'] / 1e6:.2f}, parquet "
          f"{args.rows / cold_medians['parquet'] / 1e6:.2f} M records/s; "
          f"{cold_medians['parquet'] / cold_medians['attrindex']:.2f}x")
    rate = args.rows / medians["attrindex"]
    ratio = medians["parquet"] / medians["attrindex"]
    print(f"second read (median): attrindex {rate / 1e6:.2f} M records/s, parquet {args.rows / medians['parquet'] / 1e6:.2f} "
          f"M records/s; attrindex/parquet {ratio:.2f}x; goal >= {GOAL / 1e6:.0f} M records/s: "
          f"{'met' if rate >= GOAL else 'NOT met'}")
    cpu_medians = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"second read, CPU time of all the process's threads (median): attrindex "
          f"{args.rows / cpu_medians['attrindex'] / 1e6:.2f}, parquet {args.rows / cpu_medians['parquet'] / 1e6:.2f} "
          f"M records per CPU-second; load average {min(loads):.2f} to {max(loads):.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "arrow-read.json"), "w") as handle:
        json.dump({"rows": args.rows, "segments": args.segments, "seconds": results, "median_s": medians,
                   "first_read_seconds": cold, "first_read_median_s": cold_medians,
                   "attrindex_records_per_s": rate, "ratio_vs_parquet": ratio, "goal": GOAL,
                   "cpu_seconds": cpu, "cpu_median_s": cpu_medians, "load_averages": loads,
                   "cpus": os.cpu_count()}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
