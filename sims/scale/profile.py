"""The memory of each operation of an ``AttributeIndex`` (and of a segment's attributes) at N keys.

    python -m sims.scale.profile [--keys 1e7] [--ops load_sorted,merge_worker,...] [--tracemalloc]
                                 [--dir DIR] [--out sims/out/scale-profile] [--max-rss-gib 10]

Every operation runs in a fresh child process (so its memory is its own), on the index a sorted
bulk load built (copied first where the operation writes). The parent samples the child's whole
process tree every 20 ms (``procs.py``; the merge worker included) and reports, per operation:
the tree's RSS when the operation started (after its setup: the interpreter, the open handle),
its peak during the operation, the peak of the merge worker apart, and the child's exact
``ru_maxrss`` before and after. With ``--tracemalloc`` the operation runs under ``tracemalloc``
(slower: use a smaller ``--keys``), and a thread snapshots the traced allocations each time they
grow by a quarter: the top allocation sites (file:line) of the largest snapshot say which
structure held the peak. Run it at two sizes to see which operations grow with N.

Operations (``--ops``; default all):

  load_sorted      bulk_load of sorted pairs streamed from a generator (builds the base index)
  load_unsorted    bulk_load of the same pairs in a scrambled order
  open             AttributeIndex.open of the base index (its WAL empty)
  open_replay      open of a copy whose WAL holds --merge-keys pending updates (replayed on open)
  len              len() of that copy (one tree lookup per pending key)
  merge_thread     flush() of --merge-keys pending random updates, in the handle's own process
  merge_worker     the same merge run by the background merge in the merge worker process
  items            a full scan: every (key, value) of items()
  verify           AttributeIndex.verify_at of the base index
  repair           AttributeIndex.repair_at of an intact copy
  spark_load       the attrindex.attributes data source's write task (AttributesWriter.write), the
                   same pairs as Arrow batches into one segment of a SegmentStore (--spark-keys)
  segment_open     SegmentStore.segment on that store (local disk: eager, the tree opened)
  segment_lazy     Segment(..., lazy_attributes=True) on it, then the first attribute lookup
  spark_read       the data source's read task (AttributesReader.read) of the whole key range
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from . import data
from .procs import TreeSampler

OPS = ("load_sorted", "load_unsorted", "open", "open_replay", "len", "merge_thread", "merge_worker", "items",
       "verify", "repair", "spark_load", "segment_open", "segment_lazy", "spark_read")
NEEDS_BASE = set(OPS) - {"load_sorted", "load_unsorted", "spark_load", "segment_open", "segment_lazy", "spark_read"}
NEEDS_PENDING = {"open_replay", "len"}
NEEDS_STORE = {"segment_open", "segment_lazy", "spark_read"}
SEGMENT = "events"
TRACE_FRAMES = 3  #: frames kept per allocation: the line, its caller and theirs
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakSnapshots(threading.Thread):
    """Under tracemalloc: snapshot the traced allocations whenever they grew by a quarter since the
    last snapshot; keep the top sites of the largest one."""

    def __init__(self, top: int = 8):
        super().__init__(daemon=True)
        self.top = top
        self.best_size = 0
        self.best_sites: list[tuple[str, int, int]] = []  # (file:line, bytes, blocks)
        self._halt = threading.Event()

    def run(self) -> None:
        import tracemalloc

        taken = 0
        while not self._halt.wait(0.01):
            current = tracemalloc.get_traced_memory()[0]
            if current > max(8 << 20, int(taken * 1.25)):
                self.take()
                taken = current

    def take(self) -> None:
        import tracemalloc

        snapshot = tracemalloc.take_snapshot().filter_traces((
            tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
            tracemalloc.Filter(False, __file__)))
        stats = snapshot.statistics("traceback")
        size = sum(s.size for s in stats)
        if size > self.best_size:
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            self.best_size = size
            # Each site as its allocating line, then its callers ("<" reads "called from").
            self.best_sites = [(" < ".join(f"{os.path.relpath(frame.filename, root)}:{frame.lineno}"
                                           for frame in reversed(s.traceback)), s.size, s.count)
                               for s in stats[:self.top]]
        del snapshot, stats

    def stop(self) -> None:
        self._halt.set()
        self.join()


# -- the operations (in the child) ---------------------------------------------------------------
def _update_batches(n: int, keys: int):
    return data.update_batches(21, n, max(1, keys // 1000), 1000)


def setup_and_run(args) -> dict:
    """Prepare (untraced), then run ``args.child`` between the "OP" and "DONE" lines."""
    from attrindex.attribute_index import AttributeIndex

    n, op, directory = args.n, args.child, args.dir
    holder: dict = {}

    if op in ("load_sorted", "load_unsorted"):
        index = AttributeIndex.open(directory)
        holder["run"] = lambda: index.bulk_load(data.pairs(n, sorted_input=op == "load_sorted"))
        holder["after"] = index.close
    elif op == "open" or op == "open_replay":
        holder["run"] = lambda: holder.setdefault("index", AttributeIndex.open(directory))
        holder["after"] = lambda: holder["index"].close()
    elif op == "len":
        index = AttributeIndex.open(directory, merge_keys=1 << 40, merge_bytes=1 << 40, merge_seconds=1e9,
                                    max_pending_bytes=1 << 40)
        holder["run"] = lambda: len(index)
        holder["after"] = lambda: None  # (closing would merge: not this operation)
    elif op == "merge_thread":
        index = AttributeIndex.open(directory, merge_process=False, merge_keys=1 << 40, merge_bytes=1 << 40,
                                    merge_seconds=1e9, max_pending_bytes=1 << 40)
        for batch in _update_batches(n, args.merge_keys):
            index.update(batch)
        holder["run"] = index.flush
        holder["after"] = index.close
    elif op == "merge_worker":
        batches = list(_update_batches(n, args.merge_keys))
        distinct = len({key for batch in batches for key, _value in batch})
        # The merge is due when the pending keys reach merge_keys: exactly with the last batch.
        index = AttributeIndex.open(directory, merge_keys=distinct, merge_bytes=1 << 40, merge_seconds=1e9,
                                    max_pending_bytes=1 << 40)
        for batch in batches[:-1]:
            index.update(batch)

        def merge_in_worker():
            index.update(batches[-1])  # crosses merge_keys: the background merge starts, in the worker
            deadline = time.monotonic() + 1800
            while index.stats().pending_keys:
                if time.monotonic() > deadline:
                    raise SystemExit("the background merge did not finish within 30 minutes")
                time.sleep(0.2)
        holder["run"] = merge_in_worker
        holder["after"] = index.close
    elif op == "items":
        index = AttributeIndex.open(directory, mode="r")
        holder["run"] = lambda: sum(1 for _ in index.items())
        holder["after"] = index.close
    elif op == "verify":
        holder["run"] = lambda: AttributeIndex.verify_at(directory).ok
    elif op == "repair":
        holder["run"] = lambda: AttributeIndex.repair_at(directory).rolled_back
    elif op == "spark_load":
        holder["run"] = lambda: spark_write(directory, n)
    elif op == "segment_open":
        from attrindex.store import SegmentStore

        store = SegmentStore.open(directory)
        holder["run"] = lambda: store.segment(SEGMENT).get_attribute(data.keys_of(data.random_indexes(1, n, 1), n)[0])
        holder["after"] = store.close
    elif op == "segment_lazy":
        from attrindex.segment import Segment
        from attrindex.store import SegmentStore

        store = SegmentStore.open(directory)

        def lazy():
            segment = Segment(store.storage, SEGMENT, store.options, lazy_attributes=True)
            holder["segment"] = segment
            return segment.get_attribute(data.keys_of(data.random_indexes(1, n, 1), n)[0])
        holder["run"] = lazy
        holder["after"] = lambda: (holder["segment"].close(merge=False), store.close())
    elif op == "spark_read":
        from attrindex.spark.attributes import AttributesDataSource

        reader = AttributesDataSource({"path": directory, "segment": SEGMENT, "partitions": "1"}).reader(None)
        holder["run"] = lambda: sum(batch.num_rows for part in reader.partitions() for batch in reader.read(part))
    else:
        raise SystemExit(f"unknown operation {op!r}")

    tracer = None
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start(TRACE_FRAMES)
        tracer = PeakSnapshots()
        tracer.start()
    before = {"rss_start": rss_now(), "maxrss_before": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print("OP", flush=True)
    start = time.perf_counter()
    result = holder["run"]()
    elapsed = time.perf_counter() - start
    # Not str(result): an index's repr counts its keys (len), an operation of its own.
    row = dict(before, seconds=elapsed, result=result if isinstance(result, (int, bool, type(None))) else type(result).__name__,
               maxrss_after=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_end=rss_now())
    if tracer is not None:
        import tracemalloc

        tracer.stop()
        tracer.take()
        row["traced_peak"] = tracemalloc.get_traced_memory()[1]
        row["top_sites"] = tracer.best_sites
        row["top_snapshot_bytes"] = tracer.best_size
        tracemalloc.stop()
    print("DONE", flush=True)
    if "after" in holder:
        holder["after"]()
    return row


def spark_write(directory: str, n: int) -> int:
    """The data source's write task, as Spark runs it, on Arrow batches of 10,000 pairs."""
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, LongType, StructField, StructType

    from attrindex.spark.attributes import AttributesDataSource

    schema = StructType([StructField("key", BinaryType()), StructField("value", LongType())])
    writer = AttributesDataSource({"path": directory, "segment": SEGMENT}).writer(schema, False)

    def batches():
        for start in range(0, n, 10_000):
            indexes = data.order_of(n, start, min(start + 10_000, n), True)
            yield pa.RecordBatch.from_arrays([pa.array(data.keys_of(indexes, n), pa.binary()),
                                              pa.array(indexes.astype("int64"))], names=["key", "value"])
    return writer.write(batches()).updates


def make_pending(directory: str, n: int, keys: int) -> None:
    """Leave ``keys`` durable, unmerged updates in the index's WAL: a writer that never merges, and
    exits without closing (as if killed); the next open replays them."""
    code = ("import os, sys; from attrindex.attribute_index import AttributeIndex; from sims.scale.profile import "
            "_update_batches; ix = AttributeIndex.open(sys.argv[1], merge_keys=1 << 40, merge_bytes=1 << 40, "
            "merge_seconds=1e9, max_pending_bytes=1 << 40); [ix.update(b) for b in _update_batches(int(sys.argv[2]), "
            "int(sys.argv[3]))]; sys.stdout.flush(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, directory, str(n), str(keys)], check=True)


# -- the parent ----------------------------------------------------------------------------------
def run_op(args, op: str, directory: str) -> dict:
    argv = [sys.executable, "-m", "sims.scale.profile", "--child", op, "--n", str(args.n_keys), "--dir", directory,
            "--merge-keys", str(args.merge_keys)] + (["--tracemalloc"] if args.tracemalloc else [])
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    sampler = TreeSampler(process.pid, interval=0.02, cap_bytes=int(args.max_rss_gib * (1 << 30)))
    sampler.start()
    row: dict = {"op": op, "keys": args.n_keys if op not in ("spark_load", *NEEDS_STORE) else args.spark_keys}
    try:
        for line in process.stdout:
            if line.startswith("OP"):
                sampler.set_phase("op")
            elif line.startswith("DONE"):
                sampler.set_phase("after")
            elif line.startswith("{"):
                row.update(json.loads(line))
            else:
                print("  " + line, end="")
        code = process.wait()
    finally:
        sampler.stop()
        if process.poll() is None:
            process.kill()
            process.wait()
    row["exit_code"] = code
    row["tree_peak_op"] = sampler.phase_peak.get("op", 0)
    row["main_peak_op"] = sampler.phase_process_peak.get("op", {}).get("main", 0)
    row["worker_peak_op"] = max((v for k, v in sampler.phase_process_peak.get("op", {}).items() if k != "main"),
                                default=0)
    row["killed_over_cap"] = sampler.killed_over_cap
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=float, default=1e7)
    parser.add_argument("--spark-keys", type=float, default=None, help="keys of the segment (default --keys)")
    parser.add_argument("--merge-keys", type=int, default=100_000, help="pending random updates a merge moves")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--max-rss-gib", type=float, default=10.0)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default="sims/out/scale-profile")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(setup_and_run(args)), flush=True)
        return 0
    args.n_keys = int(args.keys)
    args.spark_keys = int(args.spark_keys or args.keys)
    ops = [op for op in args.ops.split(",") if op]
    unknown = set(ops) - set(OPS)
    if unknown:
        raise SystemExit(f"--ops: unknown {', '.join(sorted(unknown))}")
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="attrindex-profile-", dir=args.dir)
    base, pending, store = (os.path.join(work, name) for name in ("base", "pending", "store"))
    rows = []
    print(f"{args.n_keys:,} keys under {work}; load average {os.getloadavg()}", flush=True)
    try:
        for op in ops:
            if op in NEEDS_BASE and not os.path.exists(base) and "load_sorted" not in ops[:ops.index(op)]:
                rows.append(run_op(args, "load_sorted", base))
            if op in NEEDS_PENDING and not os.path.exists(pending):
                shutil.copytree(base, pending)
                make_pending(pending, args.n_keys, args.merge_keys)
            if op in NEEDS_STORE and not os.path.exists(store):
                saved, args.n_keys = args.n_keys, args.spark_keys
                rows.append(run_op(args, "spark_load", store))
                args.n_keys = saved
            print(f"{op} ...", flush=True)
            if op == "load_sorted":
                target = base
            elif op == "spark_load":
                target = store if not os.path.exists(store) else os.path.join(work, "store-again")
            elif op in NEEDS_STORE:
                target = store
            elif op in NEEDS_PENDING:
                target = pending
            elif op in ("merge_thread", "merge_worker", "repair"):
                target = os.path.join(work, op)
                shutil.copytree(base, target)
            elif op == "load_unsorted":
                target = os.path.join(work, op)
            else:
                target = base
            if op in ("spark_load", *NEEDS_STORE):
                saved, args.n_keys = args.n_keys, args.spark_keys
                rows.append(run_op(args, op, target))
                args.n_keys = saved
            else:
                rows.append(run_op(args, op, target))
            if target not in (base, pending, store):
                shutil.rmtree(target, ignore_errors=True)
            with open(os.path.join(args.out, f"profile-{args.n_keys}{'-traced' if args.tracemalloc else ''}.json"), "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows, args)
    return 0


def report(rows: list[dict], args) -> None:
    mib = 1 << 20
    print(f"\n{'operation':<15}{'keys':>12}{'s':>8}{'RSS at start':>14}{'tree peak':>11}{'main peak':>11}"
          f"{'worker':>9}{'peak-start':>12}{'B/key':>8}{'maxrss':>9}" + ("  traced peak, top sites" if args.tracemalloc else ""))
    for row in rows:
        if row.get("exit_code") or "rss_start" not in row:
            print(f"{row['op']:<15} failed: exit {row.get('exit_code')}, killed over cap: {row.get('killed_over_cap')}")
            continue
        grown = row["tree_peak_op"] - row["rss_start"]
        line = (f"{row['op']:<15}{row['keys']:>12,}{row['seconds']:>8.1f}{row['rss_start'] / mib:>14,.0f}"
                f"{row['tree_peak_op'] / mib:>11,.0f}{row['main_peak_op'] / mib:>11,.0f}{row['worker_peak_op'] / mib:>9,.0f}"
                f"{grown / mib:>12,.0f}{grown / row['keys']:>8.1f}{row['maxrss_after'] / mib:>9,.0f}")
        if args.tracemalloc:
            line += f"  {row['traced_peak'] / mib:,.0f} MiB"
        print(line)
        for site, size, count in row.get("top_sites", [])[:5]:
            print(f"{'':<17}{size / mib:>8,.1f} MiB in {count:>10,} blocks  {site}")
    print("  (MiB; peak-start: the tree's peak during the operation over the RSS when it started;"
          " B/key: that per key of the index)")


if __name__ == "__main__":
    sys.exit(main())
