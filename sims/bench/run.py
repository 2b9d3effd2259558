"""attrindex against sqlite3, LMDB, RocksDB and LevelDB: same data, same machine, same disk, one run.

    python -m sims.bench.run [--keys 1000000] [--updates N] [--big-keys 10000000] [--out sims/out/bench]
    python -m sims.bench.run --keys 100000 --big-keys 0          # a quick run (about a minute)
    python -m sims.bench.run --big-keys 0 --repeat 3              # medians of 3 rounds (a shared machine)

Each engine runs in a child process of its own (its peak RSS is its own), on data generated from
the same seed. Every write is durable: sqlite3 ``synchronous=FULL``, LMDB ``sync=True``, RocksDB
(``rocksdict``) and LevelDB (``plyvel``) with ``sync=True`` on every write, attrindex's default.
Measured for each engine on local disk:

- bulk load of N random (16-byte key, int64) pairs: one transaction (sqlite3, LMDB), one write
  batch (RocksDB, LevelDB), one ``bulk_load`` (attrindex; ``update`` where the index has no
  ``bulk_load``);
- warm random point lookups and ``get_many`` of 1,000 keys, after the load and again after the
  updates (attrindex then has a non-empty write-ahead overlay, where it has one);
- durable batched random updates, 1,000 keys per call (``AttributeIndex.update``; one durable
  transaction for the peers) over ``--updates`` keys: keys/s and the latency of each call
  (p50, p99, max), and the cyclic GC's collections meanwhile (count, longest: each stops every
  thread of the process);
- size on disk after the load and after the updates;
- single-key durable updates, one call / transaction each;
- 1, 4 and 16 writer threads doing single-key durable updates at once (one handle shared by the
  threads; one connection per thread for sqlite3);
- peak RSS of the child (and of the data alone, measured before the engine starts).

Then, for attrindex alone at ``--big-keys``: the bulk load, and cold lookups with a page cache that
holds only the index pages (storage reads per lookup): its ``cache_bytes`` is sized from the index
pages' decoded memory, shard by shard (``index_pages_cache_bytes``), since the cache charges a page
its memory, not its stored size. Prints a table with ratios to each peer
and to the best peer of each row, and writes results.csv. A peer whose package is missing
(``pip install '.[sims]'``) is skipped with a note.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import math
import os
import random
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from attrindex.attribute_index import AttributeIndex

BATCH = 1000
GET_MANY = 1000
THREADS = (1, 4, 16)


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def disk_bytes(path: str) -> int:
    """Bytes allocated on disk below ``path`` (LMDB's map file is sparse, so st_size would lie)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def percentile(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(p * len(sorted_values)))] if sorted_values else float("nan")


class SQLite:
    name = "sqlite3"

    def __init__(self, directory: str):
        self.path = directory
        self.file = os.path.join(directory, "bench.db")
        os.makedirs(directory, exist_ok=True)
        self.db = self._connect()
        self.db.execute("CREATE TABLE t (k BLOB PRIMARY KEY, v INTEGER NOT NULL) WITHOUT ROWID")
        self._local = threading.local()

    def _connect(self):
        db = sqlite3.connect(self.file, isolation_level=None, timeout=120, check_same_thread=False)
        db.execute("PRAGMA synchronous=FULL")
        return db

    def load(self, pairs):
        self.db.execute("BEGIN")
        self.db.executemany("INSERT INTO t VALUES (?, ?)", pairs)
        self.db.execute("COMMIT")

    def warm(self):
        self.db.execute("SELECT count(*), max(v) FROM t").fetchone()

    def lookups(self, keys):
        query = self.db.execute
        return [query("SELECT v FROM t WHERE k=?", (k,)).fetchone() for k in keys]

    def get_many(self, keys):
        """The faster of: one IN query with all keys bound, or a temp-table join."""
        in_query = "SELECT k, v FROM t WHERE k IN (%s)" % ",".join("?" * len(keys))
        t_in, rows = timed(lambda: dict(self.db.execute(in_query, keys).fetchall()))
        def join():
            self.db.execute("CREATE TEMP TABLE IF NOT EXISTS q (k BLOB PRIMARY KEY) WITHOUT ROWID")
            self.db.execute("DELETE FROM q")
            self.db.executemany("INSERT OR IGNORE INTO q VALUES (?)", [(k,) for k in keys])
            return dict(self.db.execute("SELECT t.k, t.v FROM q JOIN t ON t.k = q.k").fetchall())
        t_join, _ = timed(join)
        return min(t_in, t_join), [rows.get(k) for k in keys]

    def update(self, pairs):
        self.db.execute("BEGIN")
        self.db.executemany("INSERT OR REPLACE INTO t VALUES (?, ?)", pairs)
        self.db.execute("COMMIT")

    def update_one(self, key, value):
        """One durable transaction; each thread on its own connection (sqlite3's rule)."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT OR REPLACE INTO t VALUES (?, ?)", (key, value))
        db.execute("COMMIT")

    def size(self):
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return disk_bytes(self.path)


class LMDB:
    name = "lmdb"

    def __init__(self, directory: str):
        import lmdb

        self.path = directory
        self.env = lmdb.open(directory, map_size=16 << 30, sync=True, metasync=True)

    def load(self, pairs):
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(((k, v.to_bytes(8, "little", signed=True)) for k, v in pairs))

    def warm(self):
        with self.env.begin() as txn:
            sum(1 for _ in txn.cursor())

    def lookups(self, keys):
        with self.env.begin(buffers=False) as txn:
            get = txn.get
            return [get(k) for k in keys]

    def get_many(self, keys):
        def run():
            with self.env.begin() as txn:
                get = txn.get
                return [get(k) for k in keys]
        return timed(run)

    def update(self, pairs):
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(((k, v.to_bytes(8, "little", signed=True)) for k, v in pairs))

    def update_one(self, key, value):
        with self.env.begin(write=True) as txn:
            txn.put(key, value.to_bytes(8, "little", signed=True))

    def size(self):
        return disk_bytes(self.path)


def _int64(value: int) -> bytes:
    return value.to_bytes(8, "little", signed=True)


class RocksDB:
    """RocksDB through ``rocksdict`` (raw bytes), every write ``sync=True``."""

    name = "rocksdb"
    package = "rocksdict"

    def __init__(self, directory: str):
        from rocksdict import Options, Rdict, WriteOptions

        self.path = directory
        self.db = Rdict(directory, Options(raw_mode=True))
        self.sync = WriteOptions()
        self.sync.sync = True

    def _batch(self, pairs):
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        for k, v in pairs:
            batch.put(k, _int64(v))
        self.db.write(batch, self.sync)

    load = update = _batch

    def warm(self):
        sum(1 for _ in self.db.keys())

    def lookups(self, keys):
        get = self.db.get
        return [get(k) for k in keys]

    def get_many(self, keys):
        return timed(self.db.get, keys)  # RocksDB's MultiGet

    def update_one(self, key, value):
        self.db.put(key, _int64(value), self.sync)

    def size(self):
        self.db.flush()
        return disk_bytes(self.path)


class LevelDB:
    """LevelDB through ``plyvel``, every write ``sync=True``."""

    name = "leveldb"
    package = "plyvel"

    def __init__(self, directory: str):
        import plyvel

        self.path = directory
        self.db = plyvel.DB(directory, create_if_missing=True)

    def _batch(self, pairs):
        with self.db.write_batch(sync=True) as batch:
            for k, v in pairs:
                batch.put(k, _int64(v))

    load = update = _batch

    def warm(self):
        sum(1 for _ in self.db.iterator(include_value=False))

    def lookups(self, keys):
        get = self.db.get
        return [get(k) for k in keys]

    def get_many(self, keys):
        get = self.db.get
        return timed(lambda: [get(k) for k in keys])

    def update_one(self, key, value):
        self.db.put(key, _int64(value), sync=True)

    def size(self):
        return disk_bytes(self.path)


class Attrindex:
    name = "attrindex"

    def __init__(self, directory: str, value_cache: bool = True):
        self.path = directory
        self.index = AttributeIndex.open(directory, value_cache_entries=(1 << 21) if value_cache else 0)

    def load(self, pairs):
        bulk_load = getattr(self.index, "bulk_load", None)
        if bulk_load is None:
            self.index.update(pairs)
        else:
            bulk_load(pairs)

    def warm(self):
        sum(1 for _ in self.index.items())

    def lookups(self, keys):
        get = self.index.get
        return [get(k) for k in keys]

    def get_many(self, keys):
        return timed(self.index.get_many, keys)

    def update(self, pairs):
        self.index.update(pairs)

    def update_one(self, key, value):
        self.index.update(((key, value),))

    def size(self):
        return disk_bytes(self.path)

    def overlay_keys(self) -> int | None:
        """Keys in the write-ahead overlay, where the index has one (its stats say)."""
        stats = self.index.stats()
        for field in ("pending_attributes", "overlay_keys", "pending_keys"):
            if hasattr(stats, field):
                return getattr(stats, field)
        return None


ENGINES = {"sqlite3": SQLite, "lmdb": LMDB, "rocksdb": RocksDB, "leveldb": LevelDB, "attrindex": Attrindex}
PEERS = [name for name in ENGINES if name != "attrindex"]
PACKAGES = {"lmdb": "lmdb", "rocksdb": "rocksdict", "leveldb": "plyvel"}  #: peers that need a package


# -- data, the same in every child ---------------------------------------------------------------
def make_data(args):
    rng = random.Random(1)
    keys = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(args.keys)]
    pairs = [(k, rng.randrange(-(1 << 63), 1 << 63)) for k in keys]
    probe = [rng.choice(keys) for _ in range(args.lookups)]
    batches = [[(rng.choice(keys), rng.randrange(1 << 40)) for _ in range(BATCH)] for _ in range(args.updates // BATCH)]
    singles = [(rng.choice(keys), rng.randrange(1 << 40)) for _ in range(args.single)]
    threaded = [(rng.choice(keys), rng.randrange(1 << 40)) for _ in range(args.thread_ops)]
    return pairs, probe, batches, singles, threaded


# -- phases --------------------------------------------------------------------------------------
def lookup_rates(engine, probe, rounds, suffix=""):
    engine.lookups(probe)  # warm the caches with the keys we will look up
    best = min(timed(engine.lookups, probe)[0] for _ in range(rounds))
    groups = [probe[i:i + GET_MANY] for i in range(0, min(len(probe), 20 * GET_MANY), GET_MANY)]
    per_key = min(sum(engine.get_many(g)[0] for g in groups) for _ in range(rounds)) / sum(map(len, groups))
    return {f"lookups_per_s{suffix}": len(probe) / best, f"get_many_us_per_key{suffix}": per_key * 1e6}


def latencies(prefix: str, seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {f"{prefix}_p50_ms": percentile(ordered, 0.50) * 1e3, f"{prefix}_p99_ms": percentile(ordered, 0.99) * 1e3,
            f"{prefix}_max_ms": ordered[-1] * 1e3 if ordered else float("nan")}


@contextlib.contextmanager
def gc_pauses(row: dict, prefix: str):
    """Record the cyclic GC's collections meanwhile, whichever thread ran them (each holds the
    GIL: every thread of the process waits), as ``{prefix}_gc_count`` and ``{prefix}_gc_max_ms``."""
    pauses, started = [], {}

    def callback(phase, info):
        if phase == "start":
            started[threading.get_ident()] = time.perf_counter()
        elif threading.get_ident() in started:
            pauses.append(time.perf_counter() - started.pop(threading.get_ident()))
    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)
        row[f"{prefix}_gc_count"] = len(pauses)
        row[f"{prefix}_gc_max_ms"] = max(pauses, default=0.0) * 1e3


def timed_calls(fn, items) -> tuple[float, list[float]]:
    each = []
    clock = time.perf_counter
    start = clock()
    for item in items:
        t = clock()
        fn(*item) if isinstance(item, tuple) else fn(item)
        each.append(clock() - t)
    return clock() - start, each


def threaded_updates(engine, ops: list[tuple[bytes, int]], threads: int) -> float:
    """Keys/s of single-key durable updates from ``threads`` threads sharing ``ops``."""
    shares = [ops[i::threads] for i in range(threads)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads + 1)

    def work(share):
        barrier.wait()
        try:
            for key, value in share:
                engine.update_one(key, value)
        except BaseException as error:  # reported after the run
            errors.append(error)

    workers = [threading.Thread(target=work, args=(share,)) for share in shares]
    for worker in workers:
        worker.start()
    barrier.wait()
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return len(ops) / elapsed


def bench_engine(engine, data, args) -> dict:
    pairs, probe, batches, singles, threaded = data
    row = {"engine": engine.name, "keys": len(pairs)}
    cpu = time.process_time()
    t, _ = timed(engine.load, pairs)
    row["load_s"], row["load_per_s"], row["load_cpu_s"] = t, len(pairs) / t, time.process_time() - cpu
    row["size_after_load"] = engine.size()
    engine.warm()
    row.update(lookup_rates(engine, probe, args.rounds))
    with gc_pauses(row, "update"):
        t, each = timed_calls(engine.update, batches)
    row["updates_per_s"] = sum(map(len, batches)) / t if batches else float("nan")
    row.update(latencies("update", each))
    if isinstance(engine, Attrindex):
        row["overlay_keys_after_updates"] = engine.overlay_keys()
    row.update(lookup_rates(engine, probe, args.rounds, "_after_updates"))
    row["size_after_updates"] = engine.size()
    t, each = timed_calls(engine.update_one, singles)
    row["single_per_s"] = len(singles) / t if singles else float("nan")
    row.update(latencies("single", each))
    for threads in THREADS:
        row[f"threads_{threads}_per_s"] = threaded_updates(engine, threaded, threads)
    return row


def run_child(args) -> int:
    """One engine in this process: print its row as JSON on the last line of stdout."""
    data = make_data(args)
    data_rss = peak_rss_mib()
    engine = ENGINES[args.child](args.dir)
    row = bench_engine(engine, data, args)
    if args.child == "attrindex":  # the page path alone: same data, recent-values cache off
        # Closing merges the overlay into the tree, so no background merge competes with these
        # lookups and every lookup takes the page path.
        engine.index.close()
        plain = Attrindex.__new__(Attrindex)
        plain.path = engine.path
        plain.index = AttributeIndex.open(engine.path, value_cache_entries=0)
        plain.warm()
        rates = lookup_rates(plain, data[1], args.rounds)
        row["lookups_per_s_page_path"] = rates["lookups_per_s"]
        row["get_many_us_per_key_page_path"] = rates["get_many_us_per_key"]
    row["data_rss_mib"] = data_rss
    row["peak_rss_mib"] = peak_rss_mib()
    # attrindex's merge worker process (closed and reaped by now): its own peak, on top of the above
    row["worker_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps(row))
    return 0


def progress_bar(desc: str):
    """A tqdm bar (stderr) driven by a ``bulk_load`` progress callback, which reports in passes
    (reading, sorting, building), each counting from 0 up to its total."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="pair", unit_scale=True, mininterval=1.0)

    def progress(done: int, total: int) -> None:
        if total and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)  # (redrawn at most once per mininterval; a new pass starts back at 0)

    return bar, progress


def run_big(args) -> int:
    """``--big-keys`` for attrindex: bulk load, then cold lookups with a cache for index pages only."""
    rng = random.Random(7)
    universe = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(args.big_keys)]
    pairs = [(k, i) for i, k in enumerate(universe)]
    data_rss = peak_rss_mib()
    index = AttributeIndex.open(args.dir)
    cpu = time.process_time()
    if hasattr(index, "bulk_load"):
        bar, progress = progress_bar(f"bulk load {args.big_keys:,}")
        t, _ = timed(lambda: index.bulk_load(pairs, progress=progress))
        bar.close()
    else:
        t, _ = timed(index.update, pairs)
    load_cpu = time.process_time() - cpu
    del pairs
    tree = btree_of(index)
    live_bytes = tree.state.footer.live_bytes
    cache_bytes, index_pages, index_bytes, index_memory = index_pages_cache_bytes(tree)
    index.close()
    del tree, index  # its page cache (every leaf passed through it) must not weigh on the cold lookups
    gc.collect()
    cold = AttributeIndex.open(args.dir, cache_bytes=cache_bytes, value_cache_entries=0)
    cold_tree = btree_of(cold)
    for key in rng.sample(universe, 2000):  # the index pages come in; leaves churn through
        cold.get(key)
    before = cold_tree.io.storage_reads
    probe = rng.sample(universe, args.cold_lookups)
    t_lookup, _ = timed(lambda: [cold.get(k) for k in probe])
    reads = cold_tree.io.storage_reads - before
    held = cold_tree.cache.values()
    print(json.dumps({"big_keys": args.big_keys, "big_load_s": t, "big_load_per_s": args.big_keys / t,
                      "big_load_cpu_s": load_cpu, "index_pages": index_pages, "index_memory": index_memory,
                      "index_pages_cached": sum(not page.is_leaf for page in held),
                      "leaves_cached": sum(page.is_leaf for page in held),
                      "index_bytes": index_bytes, "cache_bytes": cache_bytes, "leaf_bytes": live_bytes - index_bytes,
                      "reads_per_cold_lookup": reads / len(probe), "cold_lookups_per_s": len(probe) / t_lookup,
                      "data_rss_mib": data_rss, "peak_rss_mib": peak_rss_mib()}))
    return 0


def index_pages_cache_bytes(tree) -> tuple[int, int, int, int]:
    """A page cache size (``cache_bytes``) that holds every index page of ``tree`` and about one
    leaf per shard besides; the index pages' number, stored bytes and memory. The cache charges a page its decoded
    memory (``page_memory``), and each of its shards holds ``cache_bytes / shards``: so every shard
    gets room for the index pages that hash to it plus the largest leaf. Leaves do not fit: at
    10M keys, 16 of about 7,300."""
    from attrindex.tree_index import page_memory

    cache = tree.cache  # the loading handle's: the same shards as the cold handle's
    per_shard, leaf, pages, stored = [0] * cache.shards, 0, 0, 0
    for _depth, offset, length, page in tree.pages():
        if page.is_leaf:
            leaf = max(leaf, page_memory(page))
        else:
            per_shard[cache.shard_of(offset)] += page_memory(page)
            pages, stored = pages + 1, stored + length
    return cache.shards * (max(per_shard) + leaf), pages, stored, sum(per_shard)


def btree_of(index):
    """The ``BTreeIndex`` under an index handle (found among its attributes, a few levels down:
    the handle may be the tree index itself or a facade over a log and the tree)."""
    from attrindex.btree import BTreeIndex

    level = [index]
    for _depth in range(4):
        for candidate in level:
            if isinstance(candidate, BTreeIndex):
                return candidate
        level = [value for candidate in level if hasattr(candidate, "__dict__") for value in vars(candidate).values()]
    raise SystemExit("cannot find the B+tree under the index handle")


def child(args, what: str, directory: str) -> dict:
    """Run ``what`` (an engine name, or "big") in a fresh interpreter; its JSON row."""
    argv = [sys.executable, "-m", "sims.bench.run", "--child", what, "--dir", directory,
            "--keys", str(args.keys), "--updates", str(args.updates), "--lookups", str(args.lookups),
            "--rounds", str(args.rounds), "--single", str(args.single), "--thread-ops", str(args.thread_ops),
            "--big-keys", str(args.big_keys), "--cold-lookups", str(args.cold_lookups)]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{what}: the child failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--updates", type=int, default=None, help="keys updated in batches of 1,000 (default --keys)")
    parser.add_argument("--big-keys", type=int, default=10_000_000, help="0 skips the big run")
    parser.add_argument("--lookups", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each lookup phase (the best counts)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every engine this many times, order rotated; the table shows medians")
    parser.add_argument("--single", type=int, default=1000, help="single-key durable updates, one call each")
    parser.add_argument("--thread-ops", type=int, default=1000, help="single-key updates per thread-count run")
    parser.add_argument("--cold-lookups", type=int, default=20_000)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    parser.add_argument("--out", default="sims/out/bench")
    parser.add_argument("--dir", default=None, help="where the databases go (default: a temp dir on the same disk)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.updates is None:
        args.updates = args.keys
    if args.child == "big":
        return run_big(args)
    if args.child:
        return run_child(args)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="attrindex-bench-", dir=args.dir)
    engines = [name for name in args.engines.split(",") if _installed(name)]
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    big = {}
    try:
        for r in range(args.repeat):
            # Rotate who goes first: a shared machine's disk and CPU drift over minutes, and a
            # fixed order would hand one engine the same slot every round.
            for name in engines[r % len(engines):] + engines[:r % len(engines)]:
                print(f"running {name}" + (f" (round {r + 1} of {args.repeat})" if args.repeat > 1 else "") + " ...",
                      flush=True)
                rounds[name].append(child(args, name, os.path.join(work, name)))
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
        if args.big_keys:
            print(f"running attrindex at {args.big_keys:,} keys ...", flush=True)
            big = child(args, "big", os.path.join(work, "big"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report([median_row(rows) for rows in rounds.values() if rows], big, args, rounds)
    return 0


def _installed(engine: str) -> bool:
    package = PACKAGES.get(engine)
    if package is None:
        return True
    try:
        __import__(package)
    except ImportError:
        print(f"{engine}: {package} is not installed (pip install '.[sims]'), skipped")
        return False
    return True


def median_row(rows: list[dict]) -> dict:
    """Each numeric field's median over the rounds (the other fields of the first round)."""
    merged = dict(rows[0])
    for field, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[field] = statistics.median(row[field] for row in rows if row.get(field) is not None)
    return merged


SPREAD = ("load_per_s", "single_per_s", "updates_per_s", "update_p99_ms", "update_max_ms")  #: per-round ratios printed


METRICS = [  # label, field, higher is better, scale
    ("bulk load (keys/s)", "load_per_s", True, 1),
    ("warm point lookups (/s)", "lookups_per_s", True, 1),
    ("get_many of 1,000 (us per key)", "get_many_us_per_key", False, 1),
    ("batched updates, durable (keys/s)", "updates_per_s", True, 1),
    ("  latency per call p50 (ms)", "update_p50_ms", False, 1),
    ("  latency per call p99 (ms)", "update_p99_ms", False, 1),
    ("  latency per call max (ms)", "update_max_ms", False, 1),
    ("  GC collections meanwhile", "update_gc_count", False, 1),
    ("  longest GC collection (ms)", "update_gc_max_ms", False, 1),
    ("warm lookups after updates (/s)", "lookups_per_s_after_updates", True, 1),
    ("get_many after updates (us/key)", "get_many_us_per_key_after_updates", False, 1),
    ("single-key durable updates (/s)", "single_per_s", True, 1),
    ("  latency p50 (ms)", "single_p50_ms", False, 1),
    ("  latency p99 (ms)", "single_p99_ms", False, 1),
    *[(f"{n} writer thread{'s' if n > 1 else ''}, 1 key/call (/s)", f"threads_{n}_per_s", True, 1) for n in THREADS],
    ("size after load (MiB)", "size_after_load", False, 1 / 2**20),
    ("size after load + updates (MiB)", "size_after_updates", False, 1 / 2**20),
    ("peak RSS (MiB)", "peak_rss_mib", False, 1),
    ("  of which the data (MiB)", "data_rss_mib", False, 1),
    ("  + merge worker process (MiB)", "worker_rss_mib", False, 1),
]


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def _ratio(ours: float, theirs: float, higher_better: bool) -> float:
    try:
        return ours / theirs if higher_better else theirs / ours
    except (ZeroDivisionError, TypeError):
        return float("nan")


def _ratio_cell(ours: float, theirs: float, higher_better: bool, width: int) -> str:
    """The ratio as ``1.23x``, or ``-`` where it means nothing: a side missing or zero (no GC
    collection in either engine, a merge worker only attrindex has)."""
    ratio = _ratio(ours, theirs, higher_better)
    return f"{'-':>{width}} " if not ours or not theirs or math.isnan(ratio) else f"{ratio:>{width}.2f}x"


def best_peer(by: dict, field: str, higher_better: bool) -> tuple[str, float]:
    """The peer with the best value of ``field`` (its name and value), or ``("", nan)``."""
    values = [(name, by[name][field]) for name in PEERS
              if name in by and by[name].get(field) is not None and not math.isnan(by[name][field])]
    if not values:
        return "", float("nan")
    return (max if higher_better else min)(values, key=lambda item: item[1])


def report(rows, big, args, rounds=None):
    by = {r["engine"]: r for r in rows}
    nan = float("nan")
    ours = by.get("attrindex", {})
    sq, lm = by.get("sqlite3", {}), by.get("lmdb", {})
    peers = [name for name in PEERS if name in by]
    print(f"\n{args.keys:,} random 16-byte keys, int64 values; {args.updates:,} updates in calls of {BATCH}; "
          f"local disk; each engine in its own process; every write durable"
          + (f"; each cell the median of {args.repeat} rounds, engine order rotated" if args.repeat > 1 else "") + "\n")
    head = (f"{'metric':<40}{'attrindex':>12}" + "".join(f"{name:>12}" for name in peers)
            + "".join(f"{'vs ' + name:>12}" for name in peers) + f"{'vs best':>10}  best peer")
    print(head)
    print("-" * len(head))
    for label, field, higher_better, scale in METRICS:
        o = ours.get(field) if ours.get(field) is not None else nan
        theirs = [(by[name].get(field) if by[name].get(field) is not None else nan) for name in peers]
        best_name, best = best_peer(by, field, higher_better)
        o, best = o * scale, best * scale
        theirs = [t * scale for t in theirs]
        print(f"{label:<40}{_num(o):>12}" + "".join(f"{_num(t):>12}" for t in theirs)
              + "".join(_ratio_cell(o, t, higher_better, 11) for t in theirs)
              + _ratio_cell(o, best, higher_better, 9) + f"  {best_name}")
    print("  (ratios: >1 means attrindex is better; RSS includes the data set, generated before the engine starts)")
    if args.repeat > 1 and rounds and rounds.get("attrindex") and peers:
        for label, field, higher_better, _scale in METRICS:
            if field in SPREAD:
                ratios = []
                for i, o in enumerate(rounds["attrindex"]):
                    same_round = {name: rounds[name][i] for name in peers if i < len(rounds.get(name, []))}
                    ratios.append(_ratio(o.get(field, nan), best_peer(same_round, field, higher_better)[1],
                                         higher_better))
                print(f"  {label.strip()} vs the best peer, round by round: " + ", ".join(f"{r:.2f}x" for r in ratios))
    cpu = {name: by[name].get("load_cpu_s", nan) for name in by}
    print("bulk load, CPU seconds (steadier than wall time on a busy machine): "
          + ", ".join(f"{name} {seconds:.2f}" for name, seconds in cpu.items()))
    if ours:
        overlay = ours.get("overlay_keys_after_updates")
        print(f"attrindex overlay after the updates: {'n/a (no write-ahead overlay)' if overlay is None else f'{overlay:,} keys'}")
        if "lookups_per_s_page_path" in ours:
            print(f"warm point lookups, page path only (recent-values cache off): {ours['lookups_per_s_page_path']:,.0f}/s "
                  f"= {_ratio(ours['lookups_per_s_page_path'], sq.get('lookups_per_s', nan), True):.2f}x sqlite3, "
                  f"{_ratio(ours['lookups_per_s_page_path'], lm.get('lookups_per_s', nan), True):.2f}x lmdb")
            print(f"get_many, page path only: {ours['get_many_us_per_key_page_path']:.2f} us/key "
                  f"= {_ratio(ours['get_many_us_per_key_page_path'], sq.get('get_many_us_per_key', nan), False):.2f}x sqlite3, "
                  f"{_ratio(ours['get_many_us_per_key_page_path'], lm.get('get_many_us_per_key', nan), False):.2f}x lmdb")
    if big:
        print(f"\nattrindex at {big['big_keys']:,} keys: bulk load {big['big_load_s']:.1f} s ({big['big_load_per_s']:,.0f} keys/s, "
              f"{big.get('big_load_cpu_s', float('nan')):.1f} s of CPU), "
              f"peak RSS {big['peak_rss_mib']:,.0f} MiB (data {big['data_rss_mib']:,.0f}); cold lookups with a cache of "
              f"{big['cache_bytes'] / 2**20:.1f} MiB of decoded pages for {big['index_bytes'] / 2**20:.2f} MiB of index "
              f"pages ({big.get('index_memory', 0) / 2**20:.1f} MiB decoded) and {big['leaf_bytes'] / 2**20:.0f} MiB "
              f"of leaves (stored): {big['reads_per_cold_lookup']:.3f} storage reads per lookup, "
              f"{big['cold_lookups_per_s']:,.0f} lookups/s; afterwards the cache held "
              f"{big.get('index_pages_cached', '?')} of {big.get('index_pages', '?')} index pages and "
              f"{big.get('leaves_cached', '?')} leaves")
    every = [{**row, "round": i + 1} for runs in (rounds or {"": rows}).values() for i, row in enumerate(runs)]
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, sorted({f for r in every for f in r}))
        writer.writeheader()
        writer.writerows(every)
    if big:
        with open(os.path.join(args.out, "big.csv"), "w", newline="") as handle:
            writer = csv.DictWriter(handle, sorted(big))
            writer.writeheader()
            writer.writerow(big)
    print(f"\nwrote {args.out}/results.csv")


if __name__ == "__main__":
    sys.exit(main())
