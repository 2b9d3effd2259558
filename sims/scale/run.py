"""attrindex at scale: one ``AttributeIndex`` of 10M-1B keys against RocksDB, every process's memory sampled.

    python -m sims.scale.run [--sizes 1e7,1e8,1e9] [--engines attrindex,rocksdb] [--unsorted]
                             [--update-calls 1000] [--rounds 1] [--dir DIR] [--max-rss-gib 10]
    python -m sims.scale.run --quick          # 200k keys, 100 update calls: about a minute

Each engine runs in a child process of its own, on the same keys (``sims/scale/data.py``: computed
from their index, streamed from a generator, never held), one after the other on the same disk;
with ``--rounds R`` every size runs R times, the engine order rotated each round. The parent samples
the child's whole process tree every 50 ms (``procs.py``: attrindex's merge worker included) and
kills it if its RSS passes ``--max-rss-gib`` (the run then says in which phase). Phases, in order:

- ``load``: attrindex ``bulk_load`` of the sorted pairs (``--unsorted`` adds a load-only child with
  the pairs in a scrambled order); RocksDB (``rocksdict``) write batches of 100k pairs, the last one
  ``sync=True``, then a flush of the memtable. Time, keys/s, CPU seconds, storage bytes and bytes per key.
- ``open``: attrindex reopens the index with default options (the replay of an empty WAL).
- ``warm lookups``: ``--lookups`` random keys looked up twice, the second pass timed (default caches).
- ``updates``: ``--update-calls`` durable updates of ``--batch`` (1,000) random existing keys each
  (``AttributeIndex.update``; a RocksDB write batch with ``sync=True``): keys/s, latency of each
  call p50 / p99 / max, and keys/s counting the close that follows (attrindex's merges what is
  pending: when the merge is the bottleneck, the rate at which updates reach the tree); bytes written by the process tree (``/proc/PID/io`` write_bytes, the
  merge worker's included) per logical byte (24 per updated key), and the bytes appended to the
  tree (its length before the updates and after the close) per logical byte; storage over the
  tree's live bytes (RocksDB: over 24 bytes a key).
- ``close``: attrindex's close merges what is pending, in the calling process.
- ``cold lookups``: the OS page cache of the files is dropped (``posix_fadvise(DONTNEED)``
  after an ``fsync``), the store reopened (attrindex read-only, with a page cache sized for the
  index pages only and no value cache), ``--cold-warmup`` lookups bring the index pages in, then
  ``--cold-lookups`` random lookups: lookups/s and, for attrindex, storage reads per lookup.

Peak RSS is reported for the whole tree and for each process of it (``main``, ``worker N``), per
phase, from the samples, and each child's exact ``ru_maxrss`` (its own, and of its reaped children:
the merge worker, reaped when the index closes). A forked child's ``ru_maxrss`` (Linux) starts at
its parent's RSS at the fork, before the exec, so the reaped children's figure is at least the
writer's RSS when the worker started: the sampled peak is the worker's own. Prints a table per size, attrindex first, the
ratio against RocksDB where both measured it (>1: attrindex better), and writes
``results.json`` (every round, every phase) and ``results.csv`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from . import data
from .procs import TreeSampler

ENGINES = ("attrindex", "attrindex-unsorted", "attrindex-noruns", "rocksdb")
#: ``AttributeIndex.open`` options of each attrindex engine: "noruns" merges every batch into the
#: main tree (``run_share=0``), as before sorted runs (docs/decisions/0007)
ENGINE_OPTIONS = {"attrindex-noruns": {"run_share": 0}}
LOGICAL_BYTES = 24  #: a key and its value: what one updated key means to the user
CACHE_SHARDS = 16  #: the page cache's shards (``attrindex.cache.ShardedLRUCache``'s default)
BYTES_PER_KEY_ESTIMATE = {"attrindex": 60, "attrindex-unsorted": 60, "attrindex-noruns": 60, "rocksdb": 45}  #: disk needed, with room
DISK_MARGIN = 8 << 30  #: free space left to the machine's other users


# -- measuring helpers, used in the children ----------------------------------------------------
def warm_lookups(get, n: int, lookups: int) -> dict:
    """Lookups of ``lookups`` random keys of ``n``, the second pass timed (the first warms)."""
    probe = data.keys_of(data.random_indexes(11, n, lookups), n)
    found = sum(get(k) is not None for k in probe)
    start = time.perf_counter()
    for k in probe:
        get(k)
    return dict(warm_lookups_per_s=len(probe) / (time.perf_counter() - start), warm_found=found / len(probe))


def disk_bytes(path: str) -> int:
    """Bytes allocated on disk below ``path``."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # a chunk deleted meanwhile (truncation, compaction)
                pass
    return total


def drop_os_cache(path: str) -> None:
    """Write back and drop the page cache of every file below ``path`` (no root needed)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def percentile(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


class Reporter:
    """The child's side of the protocol: one line per phase start and per metric batch."""

    def __init__(self) -> None:
        self.row: dict = {}

    def phase(self, name: str) -> None:
        print("PHASE " + name, flush=True)

    def metrics(self, **values) -> None:
        self.row.update(values)
        print("METRIC " + json.dumps(values), flush=True)


def _rusage() -> dict:
    return {"child_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "child_children_maxrss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def timed_updates(update, batches) -> tuple[float, list[float], int]:
    clock, each, keys = time.perf_counter, [], 0
    start = clock()
    for batch in batches:
        t = clock()
        update(batch)
        each.append(clock() - t)
        keys += len(batch)
    return clock() - start, each, keys


def update_metrics(elapsed: float, each: list[float], keys: int) -> dict:
    ordered = sorted(each)
    return {"update_keys_per_s": keys / elapsed if elapsed else float("nan"), "update_keys": keys,
            "update_p50_ms": percentile(ordered, 0.5) * 1e3, "update_p99_ms": percentile(ordered, 0.99) * 1e3,
            "update_max_ms": ordered[-1] * 1e3 if ordered else float("nan")}


# -- the engines (each in its own child) --------------------------------------------------------
def child_attrindex(args, out: Reporter) -> None:
    from attrindex.attribute_index import AttributeIndex
    from attrindex.btree.page import index_capacity, leaf_capacity
    from attrindex.tree_index import INDEX_ENTRY_MEMORY, LEAF_ENTRY_MEMORY, PAGE_MEMORY

    n, directory = args.n, args.dir
    sorted_input = args.child != "attrindex-unsorted"
    options = ENGINE_OPTIONS.get(args.child, {})
    out.phase("load")
    index = AttributeIndex.open(directory, **options)
    cpu, start = time.process_time(), time.perf_counter()
    if args.load_input == "columns":
        count = index.bulk_load_columns(data.columns(n, sorted_input=sorted_input))
    else:
        count = index.bulk_load(data.pairs(n, sorted_input=sorted_input))
    elapsed = time.perf_counter() - start
    out.metrics(load_s=elapsed, load_keys_per_s=n / elapsed, load_cpu_s=time.process_time() - cpu, entries=count)
    out.phase("close after load")
    index.close()
    stored = disk_bytes(directory)
    out.metrics(storage_after_load=stored, bytes_per_key_after_load=stored / n)
    if not sorted_input:
        out.metrics(**_rusage())
        return
    out.phase("open")
    start = time.perf_counter()
    index = AttributeIndex.open(directory, **options)
    out.metrics(open_s=time.perf_counter() - start)
    shape = index.stats()
    out.metrics(live_bytes_after_load=shape.live_bytes, pages=shape.page_count, height=shape.height)
    out.phase("warm lookups")
    out.metrics(**warm_lookups(index.get, n, args.lookups))
    out.phase("updates")
    before = index.stats()
    elapsed, each, keys = timed_updates(index.update, data.update_batches(12, n, args.update_calls, args.batch))
    stored_after_updates = disk_bytes(directory)
    out.metrics(**update_metrics(elapsed, each, keys), tree_length_before_updates=before.length,
                storage_after_updates=stored_after_updates)
    out.phase("close after updates")
    start = time.perf_counter()
    index.close()
    close_s = time.perf_counter() - start
    stored = disk_bytes(directory)
    out.metrics(close_s=close_s, storage_after_close=stored, update_keys_per_s_with_close=keys / (elapsed + close_s))
    out.phase("cold lookups")
    drop_os_cache(directory)
    start = time.perf_counter()
    cold_probe = data.keys_of(data.random_indexes(13, n, args.cold_warmup + args.cold_lookups), n)
    page_size = 32768
    shape_now = None
    cold = AttributeIndex.open(directory, mode="r", cache_bytes=1 << 20, value_cache_entries=0)
    try:
        shape_now = cold.stats()
    finally:
        cold.close()
    # A page cache for the index pages only: the cache charges a page its decoded memory
    # (``page_memory``), about 1,170 entries an index page; twice that for the shards' uneven
    # share, plus one leaf per shard. Leaves do not fit.
    leaves = math.ceil(shape_now.entry_count / leaf_capacity(page_size))
    index_pages = max(0, shape_now.page_count - leaves)
    index_memory = PAGE_MEMORY + index_capacity(page_size) * INDEX_ENTRY_MEMORY
    leaf_memory = PAGE_MEMORY + leaf_capacity(page_size) * LEAF_ENTRY_MEMORY
    cache_bytes = 2 * index_pages * index_memory + CACHE_SHARDS * leaf_memory  # (ShardedLRUCache: 16 shards)
    drop_os_cache(directory)
    cold = AttributeIndex.open(directory, mode="r", cache_bytes=cache_bytes, value_cache_entries=0)
    out.metrics(cold_open_s=time.perf_counter() - start)
    for k in cold_probe[:args.cold_warmup]:  # the index pages come in; leaves churn through
        cold.get(k)
    reads = cold.stats().storage_reads
    start = time.perf_counter()
    for k in cold_probe[args.cold_warmup:]:
        cold.get(k)
    elapsed = time.perf_counter() - start
    reads = cold.stats().storage_reads - reads
    out.metrics(cold_lookups_per_s=args.cold_lookups / elapsed, reads_per_cold_lookup=reads / args.cold_lookups,
                cold_cache_bytes=cache_bytes, live_bytes_after_close=shape_now.live_bytes,
                space_over_live=stored / shape_now.live_bytes, entries_after=shape_now.entry_count,
                space_over_live_after_updates=stored_after_updates / shape_now.live_bytes,
                # (the handle's own view lags the merge worker's appends: the reopened tree's length is exact)
                tree_bytes_appended_in_updates=shape_now.length - before.length)
    cold.close()
    out.metrics(**_rusage())


def child_rocksdb(args, out: Reporter) -> None:
    from rocksdict import Options, Rdict, WriteBatch, WriteOptions

    n, directory = args.n, args.dir
    sync, nosync = WriteOptions(), WriteOptions()
    sync.sync = True
    out.phase("load")
    db = Rdict(directory, Options(raw_mode=True))
    cpu, start = time.process_time(), time.perf_counter()
    batch, size = WriteBatch(raw_mode=True), 0
    for key, value in data.pairs(n):
        batch.put(key, value.to_bytes(8, "little", signed=True))
        size += 1
        if size == 100_000:
            db.write(batch, nosync)
            batch, size = WriteBatch(raw_mode=True), 0
    batch.put(data.keys_of(data.random_indexes(0, n, 1), n)[0], (0).to_bytes(8, "little"))  # the load's sync
    db.write(batch, sync)
    db.flush()
    elapsed = time.perf_counter() - start
    out.metrics(load_s=elapsed, load_keys_per_s=n / elapsed, load_cpu_s=time.process_time() - cpu, entries=n)
    stored = disk_bytes(directory)
    out.metrics(storage_after_load=stored, bytes_per_key_after_load=stored / n)
    out.phase("warm lookups")
    out.metrics(**warm_lookups(db.get, n, args.lookups))
    out.phase("updates")

    def update(pairs):
        batch = WriteBatch(raw_mode=True)
        for key, value in pairs:
            batch.put(key, value.to_bytes(8, "little", signed=True))
        db.write(batch, sync)

    elapsed, each, keys = timed_updates(update, data.update_batches(12, n, args.update_calls, args.batch))
    stored = disk_bytes(directory)
    out.metrics(**update_metrics(elapsed, each, keys), storage_after_updates=stored,
                space_over_live_after_updates=stored / (n * LOGICAL_BYTES))
    out.phase("close after updates")
    start = time.perf_counter()
    db.close()
    close_s = time.perf_counter() - start
    stored = disk_bytes(directory)
    out.metrics(storage_after_close=stored, space_over_live=stored / (n * LOGICAL_BYTES), close_s=close_s,
                update_keys_per_s_with_close=keys / (elapsed + close_s))
    out.phase("cold lookups")
    drop_os_cache(directory)
    start = time.perf_counter()
    db = Rdict(directory, Options(raw_mode=True))
    out.metrics(cold_open_s=time.perf_counter() - start)
    cold_probe = data.keys_of(data.random_indexes(13, n, args.cold_warmup + args.cold_lookups), n)
    for k in cold_probe[:args.cold_warmup]:
        db.get(k)
    start = time.perf_counter()
    for k in cold_probe[args.cold_warmup:]:
        db.get(k)
    out.metrics(cold_lookups_per_s=args.cold_lookups / (time.perf_counter() - start))
    db.close()
    out.metrics(**_rusage())


# -- the parent ----------------------------------------------------------------------------------
def load_average() -> float:
    return os.getloadavg()[0]


def run_child(args, engine: str, n: int, directory: str) -> dict:
    """Run ``engine`` at ``n`` keys in a fresh interpreter, sampling its process tree; its row."""
    argv = [sys.executable, "-m", "sims.scale.run", "--child", engine, "--n", str(n), "--dir", directory,
            "--update-calls", str(args.update_calls), "--batch", str(args.batch), "--lookups", str(args.lookups),
            "--cold-lookups", str(args.cold_lookups), "--cold-warmup", str(args.cold_warmup), "--load-input", args.load_input]
    row: dict = {"engine": engine, "keys": n, "load_average_before": load_average()}
    phase_start: dict[str, float] = {}
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    sampler = TreeSampler(process.pid, cap_bytes=int(args.max_rss_gib * (1 << 30)))
    sampler.start()
    try:
        for line in process.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "PHASE":
                now = time.perf_counter()
                if sampler.phase in phase_start:
                    row[f"seconds[{sampler.phase}]"] = now - phase_start[sampler.phase]
                sampler.set_phase(rest)
                phase_start[rest] = now
                print(f"  {engine} {n:,}: {rest} ...", flush=True)
            elif kind == "METRIC":
                row.update(json.loads(rest))
            else:
                print("  " + line, end="")
        code = process.wait()
    finally:
        sampler.set_phase("end")
        sampler.stop()
        if process.poll() is None:
            process.kill()
            process.wait()
    if sampler.phase in phase_start:
        row[f"seconds[{sampler.phase}]"] = time.perf_counter() - phase_start[sampler.phase]
    row["exit_code"] = code
    row["wall_s"] = time.perf_counter() - started
    row["load_average_after"] = load_average()
    row["killed_over_cap_in"] = sampler.killed_over_cap
    mib = 1 << 20
    row["peak_rss_tree_mib"] = sampler.peak / mib
    for role, peak in sampler.process_peak.items():
        row[f"peak_rss_mib[{role}]"] = peak / mib
    for phase, peak in sampler.phase_peak.items():
        row[f"phase_peak_rss_mib[{phase}]"] = peak / mib
        for role, value in sampler.phase_process_peak.get(phase, {}).items():
            row[f"phase_peak_rss_mib[{phase}][{role}]"] = value / mib
    for phase, written in sampler.phase_written.items():
        row[f"written_bytes[{phase}]"] = written
    updated = row.get("update_keys")
    if updated:
        written = row.get("written_bytes[updates]", 0) + row.get("written_bytes[close after updates]", 0)
        row["written_per_logical_byte"] = written / (updated * LOGICAL_BYTES)
        row["written_per_logical_byte_during_updates"] = row.get("written_bytes[updates]", 0) / (updated * LOGICAL_BYTES)
        if "tree_bytes_appended_in_updates" in row:
            row["tree_appended_per_logical_byte"] = row["tree_bytes_appended_in_updates"] / (updated * LOGICAL_BYTES)
    if code and not sampler.killed_over_cap:
        row["error"] = f"exit status {code}"
    elif sampler.killed_over_cap:
        row["error"] = f"killed: RSS of the process tree passed {args.max_rss_gib} GiB in phase {sampler.killed_over_cap!r}"
    return row


def check_disk(directory: str, n: int, engines: list[str]) -> str | None:
    """Why ``n`` keys would not fit beside the others' data (None if they fit): one engine's
    data exists at a time."""
    need = max(BYTES_PER_KEY_ESTIMATE[e] for e in engines) * n + DISK_MARGIN
    free = shutil.disk_usage(directory).free
    if free < need:
        return (f"{n:,} keys need about {need / 2**30:.0f} GiB free under {directory} "
                f"(with {DISK_MARGIN >> 30} GiB left to others), {free / 2**30:.0f} GiB are")
    return None


def parse_sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        value = float(part)
        if value < 1 or value != int(value):
            raise SystemExit(f"--sizes: {part!r} is not a whole number of keys")
        sizes.append(int(value))
    return sizes


METRICS = [  # label, field, higher is better (None: no ratio), scale
    ("load (keys/s)", "load_keys_per_s", True, 1),
    ("load (s)", "load_s", False, 1),
    ("load CPU (s)", "load_cpu_s", False, 1),
    ("storage after load (MiB)", "storage_after_load", False, 1 / 2**20),
    ("  bytes per key", "bytes_per_key_after_load", False, 1),
    ("open (s)", "open_s", None, 1),
    ("warm lookups (/s)", "warm_lookups_per_s", True, 1),
    ("durable updates, 1,000/call (keys/s)", "update_keys_per_s", True, 1),
    ("  keys/s counting the close (all merged)", "update_keys_per_s_with_close", True, 1),  # the merge's rate
    ("  latency p50 (ms)", "update_p50_ms", False, 1),
    ("  latency p99 (ms)", "update_p99_ms", False, 1),
    ("  latency max (ms)", "update_max_ms", False, 1),
    ("  written per logical byte (+ close)", "written_per_logical_byte", False, 1),
    ("  of which during the updates", "written_per_logical_byte_during_updates", False, 1),
    ("  tree bytes appended per logical byte (+ close)", "tree_appended_per_logical_byte", None, 1),
    ("storage after updates (MiB)", "storage_after_updates", False, 1 / 2**20),
    ("  over live, after updates", "space_over_live_after_updates", False, 1),
    ("close after updates (s)", "close_s", None, 1),
    ("storage after close (MiB)", "storage_after_close", False, 1 / 2**20),
    ("  over live, after close", "space_over_live", False, 1),
    ("cold lookups (/s)", "cold_lookups_per_s", True, 1),
    ("  storage reads per cold lookup", "reads_per_cold_lookup", None, 1),
    ("peak RSS, whole process tree (MiB)", "peak_rss_tree_mib", False, 1),
    ("  main process (MiB)", "peak_rss_mib[main]", False, 1),
    ("  merge worker (MiB)", "peak_rss_mib[worker 1]", None, 1),
    ("  main, exact ru_maxrss (MiB)", "child_maxrss_mib", False, 1),
    # (a child's ru_maxrss starts at its parent's RSS when it was forked, before its exec: an upper bound)
    ("  reaped children, ru_maxrss (MiB; >= RSS at fork)", "child_children_maxrss_mib", None, 1),
]


def _num(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def median_row(rows: list[dict]) -> dict:
    merged = dict(rows[0])
    for field in {f for r in rows for f in r}:
        values = [r[field] for r in rows if isinstance(r.get(field), (int, float)) and not isinstance(r.get(field), bool)]
        if values:
            merged[field] = statistics.median(values)
    return merged


def report(n: int, rounds: dict[str, list[dict]], args) -> None:
    names = [name for name, rows in rounds.items() if rows]
    by = {name: median_row(rounds[name]) for name in names}
    print(f"\n{n:,} keys in one index; {args.update_calls:,} update calls of {args.batch:,} keys; "
          f"each engine in its own process" + (f"; medians of {args.rounds} rounds, order rotated" if args.rounds > 1 else "")
          + f"; attrindex loads {'numpy columns (bulk_load_columns)' if args.load_input == 'columns' else 'pairs from a generator (bulk_load)'},"
          " RocksDB write batches of pairs")
    head = f"{'metric':<42}" + "".join(f"{name:>20}" for name in names)
    ratio = "attrindex" in by and "rocksdb" in by
    print(head + (f"{'attrindex vs rocksdb':>22}" if ratio else ""))
    print("-" * (len(head) + (22 if ratio else 0)))
    for label, field, higher, scale in METRICS:
        values = [by[name].get(field) for name in names]
        if all(v is None for v in values):
            continue
        cells = "".join(f"{_num(None if v is None else v * scale):>20}" for v in values)
        extra = ""
        if ratio and higher is not None:
            ours, theirs = by["attrindex"].get(field), by["rocksdb"].get(field)
            if ours and theirs:
                extra = f"{(ours / theirs if higher else theirs / ours):>21.2f}x"
        print(f"{label:<42}{cells}{extra}")
    print("  (ratios: >1 means attrindex is better)")
    for name in names:
        phases = [f for f in by[name] if f.startswith("phase_peak_rss_mib[") and f.count("[") == 1]
        print(f"  {name}: peak RSS of the tree by phase (MiB): "
              + ", ".join(f"{f[19:-1]} {by[name][f]:,.0f}" for f in phases))
        workers = [f for f in by[name] if f.startswith("phase_peak_rss_mib[") and f.endswith("[worker 1]")]
        if workers:
            print(f"  {name}: the merge worker by phase (MiB): "
                  + ", ".join(f"{f[19:f.index(']')]} {by[name][f]:,.0f}" for f in workers))
        for r, row in enumerate(rounds[name]):
            if row.get("error"):
                print(f"  {name} round {r + 1}: {row['error']}")
    if ratio and args.rounds > 1:
        for label, field, higher, _scale in METRICS[:1] + METRICS[7:11]:
            per = []
            for ours, theirs in zip(rounds["attrindex"], rounds["rocksdb"]):
                a, b = ours.get(field), theirs.get(field)
                per.append(f"{(a / b if higher else b / a):.2f}x" if a and b else "-")
            print(f"  {label.strip()} vs rocksdb, round by round: {', '.join(per)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e7,1e8,1e9", help="comma-separated key counts (1e7 is fine)")
    parser.add_argument("--engines", default="attrindex,rocksdb", help="comma-separated subset of " + ",".join(ENGINES))
    parser.add_argument("--unsorted", action="store_true", help="add a load-only attrindex child with unsorted input")
    parser.add_argument("--update-calls", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=1000, help="keys per durable update call")
    parser.add_argument("--lookups", type=int, default=100_000)
    parser.add_argument("--cold-lookups", type=int, default=20_000)
    parser.add_argument("--cold-warmup", type=int, default=2_000)
    parser.add_argument("--load-input", choices=("columns", "pairs"), default="columns",
                        help="attrindex's load input: numpy columns (bulk_load_columns) or pairs from a generator")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-rss-gib", type=float, default=10.0,
                        help="kill a child whose process tree passes this RSS (a shared machine)")
    parser.add_argument("--dir", default=None, help="where the data goes (default: a temp dir under /tmp)")
    parser.add_argument("--out", default="sims/out/scale")
    parser.add_argument("--quick", action="store_true", help="--sizes 2e5 --update-calls 100 --lookups 20000")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        out = Reporter()
        (child_rocksdb if args.child == "rocksdb" else child_attrindex)(args, out)
        return 0
    if args.quick:
        args.sizes, args.update_calls, args.lookups, args.cold_lookups = "2e5", 100, 20_000, 5_000
    engines = [e for e in args.engines.split(",") if e]
    if args.unsorted and "attrindex-unsorted" not in engines:
        engines.insert(1, "attrindex-unsorted")
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise SystemExit(f"--engines: unknown {', '.join(sorted(unknown))} (known: {', '.join(ENGINES)})")
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="attrindex-scale-", dir=args.dir)
    results: list[dict] = []
    print(f"data under {work}; load average {os.getloadavg()}; {os.cpu_count()} CPUs", flush=True)
    try:
        for n in parse_sizes(args.sizes):
            problem = check_disk(work, n, engines)
            if problem:
                print(f"skipping {n:,} keys: {problem}", flush=True)
                continue
            rounds: dict[str, list[dict]] = {e: [] for e in engines}
            for r in range(args.rounds):
                for engine in engines[r % len(engines):] + engines[:r % len(engines)]:
                    print(f"{engine} at {n:,} keys" + (f" (round {r + 1} of {args.rounds})" if args.rounds > 1 else ""),
                          flush=True)
                    directory = os.path.join(work, engine)
                    try:
                        row = run_child(args, engine, n, directory)
                    finally:
                        shutil.rmtree(directory, ignore_errors=True)
                    row["round"] = r + 1
                    rounds[engine].append(row)
                    results.append(row)
                    with open(os.path.join(args.out, "results.json"), "w") as f:
                        json.dump(results, f, indent=1)
            report(n, rounds, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fields = sorted({f for row in results for f in row})
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(results)
    print(f"\nwrote {args.out}/results.json and results.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
