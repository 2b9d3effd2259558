"""attrindex against sqlite3 and LMDB: same process, same data, same machine, one run.

    python -m sims.bench.run [--keys 1000000] [--big-keys 10000000] [--out sims/out/bench]

Measures, for each engine on local disk:
  bulk load of N random (16-byte key, int64) pairs in one transaction / update;
  warm random point lookups (attrindex with and without its recent-values cache);
  get_many of 1000 random keys (sqlite: its best batched query);
  batched random updates, 1000 per durable transaction / update;
  size on disk after the load and after N random updates.
Then, for attrindex alone at --big-keys, cold lookups with a page cache that holds only the index
pages: storage reads per lookup. Prints a table with ratios and writes results.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import time

from attrindex.attribute_index import AttributeIndex

BATCH = 1000


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


class SQLite:
    name = "sqlite3"

    def __init__(self, directory: str):
        self.path = directory
        os.makedirs(directory, exist_ok=True)
        self.db = sqlite3.connect(os.path.join(directory, "bench.db"), isolation_level=None)
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE t (k BLOB PRIMARY KEY, v INTEGER NOT NULL) WITHOUT ROWID")

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

    def size(self):
        return disk_bytes(self.path)


class Attrindex:
    name = "attrindex"

    def __init__(self, directory: str, value_cache: bool = True):
        self.path = directory
        self.index = AttributeIndex.open(directory, value_cache_entries=(1 << 21) if value_cache else 0)

    def load(self, pairs):
        self.index.update(pairs)

    def warm(self):
        sum(1 for _ in self.index.items())

    def lookups(self, keys):
        get = self.index.get
        return [get(k) for k in keys]

    def get_many(self, keys):
        return timed(self.index.get_many, keys)

    def update(self, pairs):
        self.index.update(pairs)

    def size(self):
        return disk_bytes(self.path)


def bench_engine(engine, pairs, probe, batches, rounds):
    row = {"engine": engine.name}
    t, _ = timed(engine.load, pairs)
    row["load_s"] = t
    row["load_per_s"] = len(pairs) / t
    row["size_after_load"] = engine.size()
    engine.warm()
    engine.lookups(probe)  # warm the caches with the keys we will look up
    best = min(timed(engine.lookups, probe)[0] for _ in range(rounds))
    row["lookups_per_s"] = len(probe) / best
    groups = [probe[i:i + 1000] for i in range(0, min(len(probe), 20_000), 1000)]
    per_key = min(sum(engine.get_many(g)[0] for g in groups) for _ in range(rounds)) / sum(len(g) for g in groups)
    row["get_many_us_per_key"] = per_key * 1e6
    t, _ = timed(lambda: [engine.update(b) for b in batches])
    row["updates_per_s"] = sum(len(b) for b in batches) / t
    row["size_after_updates"] = engine.size()
    return row


def cold_lookups(directory: str, keys: int, lookups: int) -> dict:
    """Build a --big-keys index, reopen it with a cache sized for its index pages, measure reads."""
    rng = random.Random(7)
    index = AttributeIndex.open(directory)
    universe = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(keys)]
    t, _ = timed(index.update, [(k, i) for i, k in enumerate(universe)])
    index_bytes = sum(length for _, _, length, page in index._tree.pages() if not page.is_leaf)
    cache_bytes = 2 * index_bytes + (1 << 20)
    cold = AttributeIndex.open(directory, cache_bytes=cache_bytes, value_cache_entries=0)
    for key in rng.sample(universe, 2000):  # the index pages come in; leaves churn through
        cold.get(key)
    before = cold.stats().storage_reads
    probe = rng.sample(universe, lookups)
    t_lookup, _ = timed(lambda: [cold.get(k) for k in probe])
    reads = cold.stats().storage_reads - before
    return {"big_keys": keys, "big_load_s": t, "index_bytes": index_bytes, "cache_bytes": cache_bytes,
            "leaf_bytes": cold.stats().live_bytes - index_bytes,
            "reads_per_cold_lookup": reads / lookups, "cold_lookups_per_s": lookups / t_lookup}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--big-keys", type=int, default=10_000_000, help="0 skips the cold-lookup run")
    parser.add_argument("--lookups", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="sims/out/bench")
    parser.add_argument("--dir", default=None, help="where the databases go (default: a temp dir on the same disk)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="attrindex-bench-", dir=args.dir)
    rng = random.Random(1)
    keys = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(args.keys)]
    pairs = [(k, rng.randrange(-(1 << 63), 1 << 63)) for k in keys]
    probe = [rng.choice(keys) for _ in range(args.lookups)]
    batches = [[(rng.choice(keys), rng.randrange(1 << 40)) for _ in range(BATCH)] for _ in range(args.keys // BATCH)]
    engines = [("sqlite3", SQLite), ("lmdb", LMDB), ("attrindex", Attrindex)]
    rows = []
    try:
        for label, factory in engines:
            try:
                engine = factory(os.path.join(work, label))
            except ImportError:
                print(f"{label}: not installed, skipped")
                continue
            print(f"running {label} ...", flush=True)
            rows.append(bench_engine(engine, pairs, probe, batches, args.rounds))
            if label == "attrindex":
                plain = Attrindex(os.path.join(work, label))  # same data, recent-values cache off
                plain.index = AttributeIndex.open(plain.path, value_cache_entries=0)
                plain.warm()
                plain.lookups(probe)
                best = min(timed(plain.lookups, probe)[0] for _ in range(args.rounds))
                rows[-1]["lookups_per_s_page_path"] = len(probe) / best
                groups = [probe[i:i + 1000] for i in range(0, 20_000, 1000)]
                rows[-1]["get_many_us_per_key_page_path"] = min(sum(plain.get_many(g)[0] for g in groups) for _ in range(args.rounds)) / 20_000 * 1e6
            shutil.rmtree(os.path.join(work, label), ignore_errors=True)
        big = cold_lookups(os.path.join(work, "big"), args.big_keys, 20_000) if args.big_keys else {}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows, big, args)
    return 0


def report(rows, big, args):
    by = {r["engine"]: r for r in rows}
    ours, sq = by["attrindex"], by["sqlite3"]
    lm = by.get("lmdb")
    print(f"\n{args.keys:,} random 16-byte keys, int64 values; local disk; batches of {BATCH} for updates\n")
    head = f"{'metric':<34}{'attrindex':>14}{'sqlite3':>14}{'lmdb':>14}{'vs sqlite3':>12}{'vs lmdb':>10}"
    print(head)
    print("-" * len(head))
    metrics = [
        ("bulk load (keys/s)", "load_per_s", True),
        ("warm point lookups (/s)", "lookups_per_s", True),
        ("get_many (us per key)", "get_many_us_per_key", False),
        ("batched updates, durable (keys/s)", "updates_per_s", True),
        ("size after load (MiB)", "size_after_load", False),
        ("size after updates (MiB)", "size_after_updates", False),
    ]
    for label, field, higher_better in metrics:
        scale = 1 / 2**20 if field.startswith("size") else 1
        ours_v, sq_v = ours[field] * scale, sq[field] * scale
        lm_v = lm[field] * scale if lm else float("nan")
        ratio = ours_v / sq_v if higher_better else sq_v / ours_v
        ratio_lm = (ours_v / lm_v if higher_better else lm_v / ours_v) if lm else float("nan")
        print(f"{label:<34}{ours_v:>14,.1f}{sq_v:>14,.1f}{lm_v:>14,.1f}{ratio:>11.2f}x{ratio_lm:>9.2f}x")
    print(f"{'  (ratios: >1 means attrindex is better)':<34}")
    print(f"warm point lookups, page path only (recent-values cache off): {ours['lookups_per_s_page_path']:,.0f}/s "
          f"= {ours['lookups_per_s_page_path'] / sq['lookups_per_s']:.2f}x sqlite3")
    print(f"get_many, page path only: {ours['get_many_us_per_key_page_path']:.2f} us/key "
          f"= {sq['get_many_us_per_key'] / ours['get_many_us_per_key_page_path']:.2f}x sqlite3")
    if big:
        print(f"\ncold lookups at {big['big_keys']:,} keys (load {big['big_load_s']:.1f} s): cache {big['cache_bytes'] / 2**20:.1f} MiB "
              f"for {big['index_bytes'] / 2**20:.2f} MiB of index pages and {big['leaf_bytes'] / 2**20:.0f} MiB of leaves: "
              f"{big['reads_per_cold_lookup']:.3f} storage reads per lookup, {big['cold_lookups_per_s']:,.0f} lookups/s")
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as handle:
        fields = sorted({f for r in rows for f in r})
        writer = csv.DictWriter(handle, fields)
        writer.writeheader()
        writer.writerows(rows)
    if big:
        with open(os.path.join(args.out, "cold_lookups.csv"), "w", newline="") as handle:
            writer = csv.DictWriter(handle, sorted(big))
            writer.writeheader()
            writer.writerow(big)
    print(f"\nwrote {args.out}/results.csv")


if __name__ == "__main__":
    sys.exit(main())
