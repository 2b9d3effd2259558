"""Group commit: durable appends/s from 1, 4 and 16 threads sharing one Segment handle.

    python -m sims.segments.group_commit [--appends 1000] [--threads 1,4,16] [--rounds 3] [--dir DIR]

Each thread appends one 100-byte record with one plain attribute update (its own key), each
append durable (local disk, sync=True: its frames written and fdatasync'd), all through ONE handle:

  grouped:    as shipped: concurrent appends share one storage append per group;
  one-by-one: the same handle with groups of one (``max_group_requests = 1``): every append its
              own storage append, as before group commit;
  sqlite3:    one connection per thread, WAL, synchronous=FULL, one INSERT OR REPLACE transaction
              per append (a row holding the 100 bytes and the value);
  LMDB:       one environment, sync=True, one write transaction per append.

Each configuration runs --rounds times, interleaved with the others, and the best round counts
(the machine may be shared: the best is the least disturbed). Prints appends/s per engine and
thread count, with grouped / one-by-one and grouped / peer ratios, and checks what was stored
(offsets unique and dense, the last value of every key).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import tempfile
import threading
import time

from attrindex import SegmentStore

RECORD = b"r" * 100


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def run_threads(threads: int, per_thread: int, work) -> float:
    """Run ``work(thread, i)`` for i < per_thread in each of ``threads`` threads; return seconds."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def body(t: int) -> None:
        barrier.wait()
        try:
            for i in range(per_thread):
                work(t, i)
        except BaseException as exc:  # noqa: BLE001 - reported after the run
            errors.append(exc)

    pool = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def segment_run(directory: str, threads: int, per_thread: int, grouped: bool) -> dict:
    store = SegmentStore.open(directory)
    seg = store.segment("g", create=True)
    if not grouped:
        seg._appender._queue.max_group_requests = 1
    offsets: list[int] = []

    def work(t: int, i: int) -> None:
        offsets.append(seg.append([RECORD], [(key(t), i)]).first_offset)

    seconds = run_threads(threads, per_thread, work)
    stats = seg.stats()
    total = threads * per_thread
    assert sorted(offsets) == list(range(total)), "offsets are not unique and dense"
    assert seg.get_attributes([key(t) for t in range(threads)]) == [per_thread - 1] * threads
    store.close()
    return {"rate": total / seconds, "groups": stats.append_groups}


def sqlite_run(directory: str, threads: int, per_thread: int) -> dict:
    path = os.path.join(directory, "bench.db")
    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE t (k BLOB PRIMARY KEY, record BLOB, v INTEGER) WITHOUT ROWID")
    setup.close()
    local = threading.local()

    def work(t: int, i: int) -> None:
        db = getattr(local, "db", None)
        if db is None:
            db = local.db = sqlite3.connect(path, isolation_level=None, timeout=60, check_same_thread=False)
            db.execute("PRAGMA synchronous=FULL")
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT OR REPLACE INTO t VALUES (?, ?, ?)", (key(t), RECORD, i))
        db.execute("COMMIT")

    seconds = run_threads(threads, per_thread, work)
    check = sqlite3.connect(path)
    assert check.execute("SELECT count(*), min(v), max(v) FROM t").fetchone() == (threads, per_thread - 1,
                                                                                  per_thread - 1)
    check.close()
    return {"rate": threads * per_thread / seconds}


def lmdb_run(directory: str, threads: int, per_thread: int) -> dict:
    import lmdb

    env = lmdb.open(directory, map_size=1 << 30, sync=True, metasync=True, max_spare_txns=threads)

    def work(t: int, i: int) -> None:
        with env.begin(write=True) as txn:
            txn.put(key(t), RECORD + i.to_bytes(8, "little"))

    seconds = run_threads(threads, per_thread, work)
    with env.begin() as txn:
        assert all(txn.get(key(t))[100:] == (per_thread - 1).to_bytes(8, "little") for t in range(threads))
    env.close()
    return {"rate": threads * per_thread / seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--appends", type=int, default=1000, help="appends per run (split over the threads)")
    parser.add_argument("--threads", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3, help="runs per configuration; the best counts")
    parser.add_argument("--dir", default=None, help="where the data goes (default: a temp dir)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.threads.split(",")]
    work = tempfile.mkdtemp(prefix="group-commit-", dir=args.dir)
    rows = []
    try:
        for threads in counts:
            per_thread = max(1, args.appends // threads)
            row = {"threads": threads}
            for _round in range(args.rounds):
                for name, run in (("grouped", lambda d: segment_run(d, threads, per_thread, True)),
                                  ("one_by_one", lambda d: segment_run(d, threads, per_thread, False)),
                                  ("sqlite3", lambda d: sqlite_run(d, threads, per_thread)),
                                  ("lmdb", lambda d: lmdb_run(d, threads, per_thread))):
                    directory = os.path.join(work, f"{name}-{threads}")
                    os.makedirs(directory)
                    result = run(directory)
                    if result["rate"] > row.get(name, 0):
                        row[name] = result["rate"]
                        if "groups" in result:
                            row[f"{name}_appends_per_group"] = threads * per_thread / result["groups"]
                    shutil.rmtree(directory)
            rows.append(row)
            print(f"threads={threads}: " + ", ".join(f"{k}={v:,.0f}" for k, v in row.items() if k != "threads"),
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nDurable appends/s through one Segment handle (one 100-byte record + one attribute each), local disk, "
          f"best of {args.rounds}")
    print(f"{'threads':>7} {'grouped':>10} {'one-by-one':>10} {'x before':>9} {'appends/group':>13} "
          f"{'sqlite3':>9} {'LMDB':>9} {'x sqlite3':>9} {'x LMDB':>7}")
    for r in rows:
        print(f"{r['threads']:>7} {r['grouped']:>10,.0f} {r['one_by_one']:>10,.0f} "
              f"{r['grouped'] / r['one_by_one']:>8.2f}x {r['grouped_appends_per_group']:>13.1f} "
              f"{r['sqlite3']:>9,.0f} {r['lmdb']:>9,.0f} {r['grouped'] / r['sqlite3']:>8.2f}x "
              f"{r['grouped'] / r['lmdb']:>6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
