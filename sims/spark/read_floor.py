"""What a Spark read of a Python data source costs before the source does any work: the floor
under ``attrindex``'s read, against Parquet and ``attrindex`` in the same session.

    python -m sims.spark.read_floor [--rows 300000] [--partitions 4] [--master local[2]] [--rounds 3]
                                    [--dir DIR]

Writes the rows of ``sims.spark.run`` once into a 4-segment stream (the data source, direct mode)
and once into Parquet. Then, for --rounds rounds (the order of the three readers rotating), times
``count()`` and ``sum(length(value))`` of:

  parquet     spark.read.parquet
  attrindex   spark.read.format("attrindex")
  floor       a Python data source with attrindex's schema and partitions (one per segment) whose
              tasks read nothing: each yields ready-made Arrow batches of 10,000 rows of the same
              shape (a segment name, offsets, timestamps, 10-byte keys, 100-byte values, empty
              headers) built with numpy, no Python object per row

The floor is what Spark's Python data source path (planning in a Python worker, a Python task per
partition, Arrow batches into the JVM, rows out of them) costs for these rows; the gap between it
and attrindex is what attrindex's own reading costs. Prints medians, per-round figures and the
load average after each phase.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

import attrindex.spark as ais
from attrindex.spark.events import EVENTS_DDL

from .run import attrindex_write, events, read_attrindex


class FloorSource(DataSource):
    """``attrindex``'s schema, ``rows`` rows in ``partitions`` partitions, read from nowhere."""

    @classmethod
    def name(cls):
        return "attrindex_floor"

    def schema(self):
        return EVENTS_DDL

    def reader(self, schema):
        return FloorReader(int(self.options["rows"]), int(self.options["partitions"]))


class FloorReader(DataSourceReader):
    def __init__(self, rows: int, partitions: int):
        self.rows, self.partitions_count = rows, partitions

    def partitions(self):
        share = -(-self.rows // self.partitions_count)
        return [InputPartition((p, min(share, self.rows - p * share))) for p in range(self.partitions_count)]

    def read(self, partition):
        import numpy as np
        import pyarrow as pa

        from attrindex.log.columnar import constant_strings
        from attrindex.spark.arrow import EVENT_SCHEMA, HEADERS_TYPE

        number, count = partition.value
        for start in range(0, count, 10_000):
            n = min(10_000, count - start)
            offsets = np.arange(start, start + n, dtype=np.int64)
            key_ends = (np.arange(n + 1, dtype=np.int32) * 10)
            value_ends = (np.arange(n + 1, dtype=np.int32) * 100)
            keys = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(key_ends), pa.py_buffer(b"user-12345" * n)])
            values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(value_ends),
                                                            pa.py_buffer(np.random.bytes(100 * n))])
            headers = pa.Array.from_buffers(HEADERS_TYPE, n, [None, pa.py_buffer(bytes(4 * (n + 1)))],
                                            children=[pa.array([], HEADERS_TYPE.value_type)])
            stamps = pa.array(1767225600000000 + offsets * 10_000, pa.int64()).cast(EVENT_SCHEMA.field("timestamp").type)
            yield pa.RecordBatch.from_arrays([constant_strings(f"floor/{number}", n), pa.array(offsets), stamps, keys,
                                              values, headers], schema=EVENT_SCHEMA)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="attrindex-read-floor-", dir=args.dir)
    spark = ais.session(args.master, "attrindex-read-floor", conf={"spark.driver.memory": "4g",
                                                                    "spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import sims
    spark.dataSource.register(FloorSource)
    store, parquet = os.path.join(work, "store"), os.path.join(work, "events.parquet")
    try:
        df = events(spark, args.rows, args.partitions).cache()
        df.count()
        df.write.parquet(parquet)
        attrindex_write(df, store, "events", "floor-1")
        df.unpersist()
        frames = {
            "parquet": lambda: spark.read.parquet(parquet),
            "attrindex": lambda: read_attrindex(spark, store, "events"),
            "floor": lambda: spark.read.format("attrindex_floor").option("rows", args.rows)
                                  .option("partitions", args.partitions).load(),
        }
        for frame in frames.values():  # untimed warm-up: workers, JIT
            frame().selectExpr("sum(length(value))").collect()
        seconds: dict[str, list[float]] = {}
        loads = []
        names = list(frames)
        for round_ in range(args.rounds):
            order = names[round_ % 3:] + names[:round_ % 3]
            for name in order:
                for kind, action in (("count", lambda f: f.count()),
                                     ("sum", lambda f: f.selectExpr("sum(length(value))").collect()[0][0])):
                    start = time.perf_counter()
                    result = action(frames[name]())
                    took = time.perf_counter() - start
                    expected = args.rows if kind == "count" else args.rows * 100
                    if result != expected:
                        raise AssertionError(f"{name} {kind} gave {result}, expected {expected}")
                    seconds.setdefault(f"{name} {kind}", []).append(took)
                    loads.append(os.getloadavg()[0])
                    print(f"  round {round_ + 1} {name:<10} {kind:<6} {took:6.2f} s (load {loads[-1]:.1f})", flush=True)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.rows:,} rows, {args.partitions} partitions, {args.master}; load average {min(loads):.1f} to "
          f"{max(loads):.1f}\n")
    for kind in ("count", "sum"):
        base = statistics.median(seconds[f"parquet {kind}"])
        for name in names:
            runs = seconds[f"{name} {kind}"]
            median = statistics.median(runs)
            print(f"{name + ' ' + kind:<18}{median:7.2f} s  vs parquet {base / median:5.2f}x  rounds "
                  f"{', '.join(f'{s:.2f}' for s in runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
