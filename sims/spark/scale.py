"""The ``attrindex.attributes`` source at 1M-100M+ rows: a load into one segment, ``lookup``, a read.

    python -m sims.spark.scale [--sizes 1e6,1e7,1e8] [--lookups 1000000] [--keys sequential|hashed]
                               [--partitions 8] [--master local[2]] [--driver-memory 1g]
                               [--dir DIR] [--max-rss-gib 8] [--out sims/out/spark-scale] [--keep]

Each size runs in a child process of its own (the Spark driver; its JVM and the JVM's Python
workers are its descendants), whose whole process tree the parent samples every 0.25 s
(``sims.scale.procs``: RSS from ``/proc``), killing it by pid if it passes ``--max-rss-gib``.
Every process is named by what it is: ``driver`` (the child), ``jvm``, ``python daemon`` (Spark's
``pyspark.daemon``, which forks the workers) and ``python worker PID``. The rows are made in the
JVM (``spark.range``; no Python row on the driver):

  key     16 bytes computed from the row's index ``id``: ``sequential`` (its big-endian bytes:
          every task writes one ascending run of keys) or ``hashed`` (the first 16 bytes of
          SHA-256 of its decimal text: every task writes keys spread over the whole key space)
  value   ``id * 1000003 + 7``

Phases (after an untimed warm-up: 10k rows into another segment, a lookup and a read of it, which
start every kind of Python worker the phases use):

  load    ``df.write.format("attrindex.attributes")`` of N rows into segment ``attrs``
  lookup  ``attrindex.spark.lookup`` of ``--lookups`` probes, index ``(i * 7919 + 13) % 2N``: about
          half present (index < N) and half absent. Checked in Spark over all probes: matches =
          probes with index < N, and no value differs from the one computed from the index; and in
          Python over a sample of 1,000 rows (keys and values recomputed here)
  read    ``spark.read.format("attrindex.attributes")...load().count()`` = N

Per phase: wall time, rows/s, the peak RSS of the whole tree and of every process, and after
the load the storage bytes (allocated blocks) and bytes per row. Results go to ``results.json``
in ``--out``; the data directory is deleted after each size unless ``--keep``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from sims.scale.procs import TreeSampler

SEGMENT = "attrs"
VALUE_FACTOR, VALUE_OFFSET = 1_000_003, 7
PROBE_FACTOR, PROBE_OFFSET = 7919, 13
SAMPLE = 1000
KEY_EXPRESSIONS = {
    "sequential": "unhex(lpad(hex({col}), 32, '0'))",
    "hashed": "substring(unhex(sha2(cast({col} as string), 256)), 1, 16)",
}
#: The Spark settings of the harness (docs/spark.md, "Attributes at scale"): the local cluster's
#: JVM heap is set by --driver-memory; Arrow batches of 10,000 rows reach the Python workers.
SPARK_CONF = {
    "spark.sql.execution.arrow.maxRecordsPerBatch": "10000",
    "spark.python.worker.reuse": "true",
    "spark.sql.shuffle.partitions": "8",
    "spark.ui.showConsoleProgress": "false",
}


def key_of(index: int, keys: str) -> bytes:
    """The key of row ``index``, computed in Python as the Spark expression computes it."""
    if keys == "sequential":
        return index.to_bytes(16, "big")
    return hashlib.sha256(str(index).encode()).digest()[:16]


def value_of(index: int) -> int:
    return index * VALUE_FACTOR + VALUE_OFFSET


def disk_bytes(path: str) -> int:
    """Bytes allocated on disk below ``path``."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


# -- the child: the Spark driver ------------------------------------------------------------------
class CheckFailed(AssertionError):
    """A lookup or a read returned something other than what was written."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def report(**values) -> None:
    print("METRIC " + json.dumps(values), flush=True)


def phase(name: str) -> None:
    print("PHASE " + name, flush=True)


def rows_df(spark, n: int, partitions: int, keys: str, start: int = 0):
    return spark.range(start, start + n, numPartitions=partitions).selectExpr(
        KEY_EXPRESSIONS[keys].format(col='id') + ' as key', f"id * {VALUE_FACTOR} + {VALUE_OFFSET} as value")


def load(df, url: str, segment: str) -> None:
    df.write.format("attrindex.attributes").option("path", url).option("segment", segment).mode("append").save()


def child(args) -> None:
    import attrindex.spark
    from pyspark.sql import functions as F

    conf = dict(SPARK_CONF)
    conf["spark.driver.memory"] = args.driver_memory
    conf["spark.sql.shuffle.partitions"] = str(args.partitions)
    phase("start")
    spark = attrindex.spark.session(args.master, "attrindex-spark-scale", conf)
    spark.sparkContext.setLogLevel("ERROR")
    url, n = os.path.join(args.dir, "store"), args.n

    phase("warm-up")  # every kind of Python worker the phases use is started here, untimed
    load(rows_df(spark, 10_000, args.partitions, args.keys), url, "warm-up")
    attrindex.spark.lookup(rows_df(spark, 1000, args.partitions, args.keys), "key", url, "warm-up", "found").count()
    spark.read.format("attrindex.attributes").option("path", url).option("segment", "warm-up").load().count()

    phase("load")
    started = time.perf_counter()
    load(rows_df(spark, n, args.partitions, args.keys), url, SEGMENT)
    seconds = time.perf_counter() - started
    stored = disk_bytes(url)
    report(load_s=seconds, load_rows_per_s=n / seconds, storage_bytes=stored, storage_bytes_per_row=stored / n,
           tree_bytes=disk_bytes(os.path.join(url, SEGMENT, "_attributes.seg")))

    phase("lookup")
    m = args.lookups
    probes = (spark.range(m, numPartitions=args.partitions)
              .selectExpr(f"(id * {PROBE_FACTOR} + {PROBE_OFFSET}) % {2 * n} as idx")
              .selectExpr("idx", KEY_EXPRESSIONS[args.keys].format(col='idx') + ' as key'))
    looked = attrindex.spark.lookup(probes, "key", url, SEGMENT, value_col="found")
    started = time.perf_counter()
    wanted = F.when(F.col("idx") < n, F.col("idx") * VALUE_FACTOR + VALUE_OFFSET)
    totals = looked.agg(
        F.count(F.col("found")).alias("matches"),
        F.sum(F.when(F.col("idx") < n, 1).otherwise(0)).alias("present"),
        F.sum(F.when(~F.col("found").eqNullSafe(wanted), 1).otherwise(0)).alias("wrong"),
    ).collect()[0]
    seconds = time.perf_counter() - started
    report(lookup_s=seconds, lookup_rows_per_s=m / seconds, lookups=m, lookup_matches=totals.matches)
    check(totals.matches == totals.present, f"lookup: {totals.matches} matches, {totals.present} probes present")
    check(totals.wrong == 0, f"lookup: {totals.wrong} values differ from the ones written")
    sample = looked.sample(fraction=min(1.0, 2 * SAMPLE / m), seed=1).limit(SAMPLE).collect()  # from every partition
    for row in sample:
        check(bytes(row.key) == key_of(row.idx, args.keys), f"probe {row.idx}: key {bytes(row.key).hex()}")
        check(row.found == (value_of(row.idx) if row.idx < n else None), f"probe {row.idx}: value {row.found}")
    report(lookup_sample=len(sample), lookup_sample_present=sum(r.idx < n for r in sample))

    phase("read")
    started = time.perf_counter()
    count = (spark.read.format("attrindex.attributes").option("path", url).option("segment", SEGMENT)
             .option("partitions", args.partitions).load().count())
    seconds = time.perf_counter() - started
    report(read_s=seconds, read_rows_per_s=n / seconds, read_count=count)
    check(count == n, f"read: {count} rows, {n} written")
    phase("stop")
    spark.stop()


# -- the parent: one child per size, its process tree sampled -------------------------------------
def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class SparkTreeSampler(TreeSampler):
    """``TreeSampler`` naming each process of a Spark driver's tree by what it is: ``driver``,
    ``jvm``, ``daemon MODULE`` (Spark starts a ``pyspark.daemon`` per Python worker module:
    ``pyspark.worker`` runs tasks, ``pyspark.sql.worker.*`` plan data source reads and writes) and
    ``MODULE PID`` for each process a daemon forked."""

    def __init__(self, root: int, **options):
        super().__init__(root, **options)
        self._roles[root] = "driver"

    def role(self, pid: int) -> str:
        role = self._roles.get(pid)
        if role is not None:
            return role
        command = _cmdline(pid)
        if pid == self.root:
            role = "driver"
        elif command and os.path.basename(command[0]) == "java":
            role = "jvm"
        elif "pyspark.daemon" in command:
            module = command[-1].rsplit(".", 1)[-1]
            role = f"daemon {module}" if self.role(_parent(pid)) == "jvm" else f"{module} {pid}"
        else:  # not yet what it will be (spark-submit's shell before it runs java): named on a later sample
            return f"other {pid}"
        self._roles[pid] = role
        return role


def run_child(args, n: int, directory: str) -> dict:
    argv = [sys.executable, "-m", "sims.spark.scale", "--child", "--n", str(n), "--dir", directory,
            "--lookups", str(min(args.lookups, 2 * n)), "--keys", args.keys, "--partitions", str(args.partitions),
            "--master", args.master, "--driver-memory", args.driver_memory]
    row: dict = {"rows": n, "keys": args.keys, "partitions": args.partitions, "master": args.master,
                 "driver_memory": args.driver_memory, "load_average_before": os.getloadavg()[0]}
    phase_start: dict[str, float] = {}
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    sampler = SparkTreeSampler(process.pid, interval=0.25, cap_bytes=int(args.max_rss_gib * (1 << 30)))
    sampler.start()
    try:
        for line in process.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "PHASE":
                now = time.perf_counter()
                if sampler.phase in phase_start:
                    row[f"seconds[{sampler.phase}]"] = now - phase_start[sampler.phase]
                    row[f"load_average[{sampler.phase}]"] = os.getloadavg()[0]
                sampler.set_phase(rest)
                phase_start[rest] = now
                print(f"  {n:,} rows: {rest} ... (load {os.getloadavg()[0]:.1f})", flush=True)
            elif kind == "METRIC":
                values = json.loads(rest)
                row.update(values)
                print("    " + ", ".join(f"{k} {_num(v)}" for k, v in values.items()), flush=True)
            else:
                print("    " + line, end="")
        code = process.wait()
    finally:
        sampler.set_phase("end")
        sampler.stop()
        if process.poll() is None:
            process.kill()
            process.wait()
    row["exit_code"] = code
    row["wall_s"] = time.perf_counter() - started
    row["killed_over_cap_in"] = sampler.killed_over_cap
    mib = 1 << 20
    row["peak_rss_tree_mib"] = sampler.peak / mib
    for name, peaks in sampler.phase_process_peak.items():
        row[f"peak_rss_tree_mib[{name}]"] = sampler.phase_peak.get(name, 0) / mib
        for role, value in peaks.items():
            row[f"peak_rss_mib[{name}][{role}]"] = value / mib
        workers = [v for r, v in peaks.items() if r.startswith("worker ")]
        if workers:  # the task workers
            row[f"peak_rss_mib[{name}][task workers: max]"] = max(workers) / mib
            row[f"task_workers[{name}]"] = len(workers)
    if sampler.killed_over_cap:
        row["error"] = f"killed: the tree's RSS passed {args.max_rss_gib} GiB in phase {sampler.killed_over_cap!r}"
    elif code:
        row["error"] = f"exit status {code}"
    return row


def _num(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _kind(role: str) -> str:
    """``worker 1234`` -> ``worker``; ``daemon worker``, ``jvm``, ``driver`` stay."""
    head, _, tail = role.rpartition(" ")
    return head if tail.isdigit() else role


def summary(row: dict) -> str:
    lines = [f"{row['rows']:,} rows ({row['keys']} keys, {row['partitions']} partitions, {row['master']}, "
             f"driver memory {row['driver_memory']}): {row.get('error', 'ok')}",
             "| phase | s | rows/s | tree peak MiB | jvm | driver | task workers (each) | other Python processes (max) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("load", "lookup", "read"):
        if f"seconds[{name}]" not in row:
            continue
        prefix = f"peak_rss_mib[{name}]["
        roles = {k[len(prefix):-1]: v for k, v in row.items() if k.startswith(prefix) and ":" not in k}
        workers = sorted((v for r, v in roles.items() if _kind(r) == "worker"), reverse=True)
        others: dict[str, float] = {}
        for role, value in roles.items():
            if _kind(role) not in ("worker", "jvm", "driver"):
                others[_kind(role)] = max(others.get(_kind(role), 0), value)
        lines.append(f"| {name} | {row.get(f'{name}_s', row[f'seconds[{name}]']):.1f} | "
                     f"{_num(row.get(f'{name}_rows_per_s', float('nan')))} | "
                     f"{row.get(f'peak_rss_tree_mib[{name}]', 0):,.0f} | {roles.get('jvm', 0):,.0f} | "
                     f"{roles.get('driver', 0):,.0f} | {', '.join(f'{w:,.0f}' for w in workers)} | "
                     f"{', '.join(f'{k} {v:,.0f}' for k, v in sorted(others.items()))} |")
    if "storage_bytes" in row:
        lines.append(f"storage after the load: {row['storage_bytes'] / (1 << 20):,.0f} MiB "
                     f"({row['storage_bytes_per_row']:.1f} B/row; the B+tree {row['tree_bytes'] / (1 << 20):,.0f} MiB)")
    return "\n".join(lines)


def parse_sizes(text: str) -> list[int]:
    return [int(float(part)) for part in text.split(",") if part.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e6,1e7", help="rows per run, comma-separated (1e8 runs 100M)")
    parser.add_argument("--lookups", type=int, default=1_000_000, help="probes per lookup (at most 2x the rows)")
    parser.add_argument("--keys", choices=sorted(KEY_EXPRESSIONS), default="sequential")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="1g", help="the local cluster's JVM heap (spark.driver.memory)")
    parser.add_argument("--dir", default=None, help="parent directory of the data (default: a temporary one)")
    parser.add_argument("--max-rss-gib", type=float, default=8.0)
    parser.add_argument("--out", default="sims/out/spark-scale")
    parser.add_argument("--keep", action="store_true", help="keep the data directories")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    rows = []
    failed = False
    for n in parse_sizes(args.sizes):
        directory = tempfile.mkdtemp(prefix=f"spark-scale-{n}-", dir=args.dir)
        print(f"{n:,} rows in {directory}", flush=True)
        try:
            row = run_child(args, n, directory)
        finally:
            if not args.keep:
                shutil.rmtree(directory, ignore_errors=True)
        rows.append(row)
        failed = failed or "error" in row
        print(summary(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
