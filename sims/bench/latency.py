"""Where the time of one ``AttributeIndex.update`` goes while background merges run.

    python -m sims.bench.latency [--keys 200000] [--calls 1000] [--merge-keys 250000] [--dir DIR]
                                 [--merge-thread] [--gc-freeze] [--switch-interval MS] [--memory]

Bulk-loads ``--keys`` random pairs on local disk, then makes ``--calls`` durable updates of 1,000
random keys each (one thread) and records, per call: wall time, the calling thread's CPU time,
whether a merge was running when it started or ended, and how long it waited for the segment's
lock, for back-pressure, inside the durable log append (write + fsync) and in collections of the
cyclic GC that the calling thread ran. Prints p50/p99/max overall and split by "a merge was
running", the slowest calls with their breakdown, the truncations of the merged log, the merges'
own wall and CPU time (the merge thread's: near zero when the merge runs in the worker process,
the default on local disk; ``--merge-thread`` for the in-thread host) and the peak RSS of the
writer and of the merge worker. The instrumentation wraps a few methods of the private Segment
(this driver only): it measures the index as shipped, not a copy.

On a shared, loaded machine, wall time well above CPU time + fsync time with nothing waited for
points at the scheduler (load, or the GIL held by the merge thread), not at a lock.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import shutil
import sys
import tempfile
import threading
import time

from attrindex.attribute_index import AttributeIndex
from attrindex.log.segment_log import SegmentLog
from attrindex.appender import Appender
from attrindex.attribute_state import AttributeState
from storage_adapters import local

BATCH = 1000


class Probe:
    """Per-call timings collected by the wrapped methods (the calling thread's own)."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.merges: list[tuple] = []  # (start, wall, thread cpu, keys, syncs)
        self.truncations: list[float] = []  # seconds of each truncation of the merged log (holds the lock)

    def reset(self) -> dict:
        self.local.t = {"lock": 0.0, "room": 0.0, "append": 0.0, "sync": 0.0, "gc": 0.0}
        return self.local.t

    def add(self, what: str, seconds: float) -> None:
        t = getattr(self.local, "t", None)
        if t is not None:
            t[what] = t.get(what, 0.0) + seconds


def instrument(probe: Probe) -> None:
    """Wrap the Appender, AttributeState and SegmentLog methods on the append and merge paths with timers."""
    clock = time.perf_counter
    write_group, wait_for_room = Appender._write_group, AttributeState.wait_for_room
    append_many, merge_once = SegmentLog.append_many, AttributeState._merge_once

    def timed_write_group(self, group):
        t = clock()
        with self._lock:  # re-entered by the real method at no cost: measures the wait alone
            probe.add("lock", clock() - t)
            return write_group(self, group)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                probe.add(name, clock() - t)
        return wrapper

    def timed_merge(self, *args, **kwargs):
        start, cpu, t = clock(), time.thread_time(), probe.reset()
        keys = 0 if self._frozen is None else len(self._frozen)
        try:
            return merge_once(self, *args, **kwargs)
        finally:
            probe.merges.append((start, clock() - start, time.thread_time() - cpu, keys, t["sync"]))

    Appender._write_group = timed_write_group
    local._write_out = timed("sync", local._write_out)  # write-back of the data, then the fsync
    os.fsync = timed("sync", os.fsync)
    AttributeState.wait_for_room = timed("room", wait_for_room)
    SegmentLog.append_many = timed("append", append_many)
    AttributeState._merge_once = timed_merge
    truncate = AttributeState._truncate_merged

    def timed_truncate(self):
        start = clock()
        try:
            return truncate(self)
        finally:
            probe.truncations.append(clock() - start)
    AttributeState._truncate_merged = timed_truncate


def watch_gc(probe: Probe) -> list:
    """Collections of the cyclic GC during the run: (generation, seconds), whichever thread ran them
    (a collection holds the GIL: every other thread waits for it). A collection run by the
    calling thread is added to its call's "gc" time."""
    pauses, started = [], {}

    def callback(phase, info):
        if phase == "start":
            started[threading.get_ident()] = time.perf_counter()
        else:
            seconds = time.perf_counter() - started.pop(threading.get_ident(), 0.0)
            pauses.append((info["generation"], seconds))
            probe.add("gc", seconds)
    gc.callbacks.append(callback)
    return pauses


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)

    def at(p):
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1e3
    return f"p50 {at(0.5):7.2f}  p99 {at(0.99):7.2f}  max {ordered[-1] * 1e3:7.2f} ms  (n={len(ordered)})"


def merging(index: AttributeIndex) -> bool:
    state = index._attributes
    return state._frozen is not None or state.runner._mutex.locked()


def run(args) -> int:
    rng = random.Random(1)
    keys = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(args.keys)]
    pairs = [(k, rng.randrange(1 << 40)) for k in keys]
    batches = [{rng.choice(keys): rng.randrange(1 << 40) for _ in range(BATCH)} for _ in range(args.calls)]
    probe = Probe()
    instrument(probe)
    directory = tempfile.mkdtemp(prefix="attrindex-latency-", dir=args.dir)
    url = f"memory://{os.path.basename(directory)}" if args.memory else directory
    try:
        index = AttributeIndex.open(url, merge_keys=args.merge_keys, merge_process=not args.merge_thread)
        index.bulk_load(pairs)
        if args.gc_freeze:
            gc.freeze()  # the data set and the loaded index out of the collector's sight (an application's choice)
        clock = time.perf_counter
        rows = []
        pauses = watch_gc(probe)
        begin, cpu_begin = clock(), time.process_time()
        for batch in batches:
            before = merging(index)
            t = probe.reset()
            start, cpu = clock(), time.thread_time()
            index.update(batch)
            wall, cpu = clock() - start, time.thread_time() - cpu
            rows.append((start - begin, wall, cpu, before or merging(index), t))
        elapsed, process_cpu = clock() - begin, time.process_time() - cpu_begin
        worker = index._attributes.runner.worker
        worker_rss = 0 if worker is None else worker.peak_rss
        index.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    walls = [r[1] for r in rows]
    print(f"{args.calls} calls of {BATCH} keys over {args.keys:,} keys, merge_keys {args.merge_keys:,}: "
          f"{args.calls * BATCH / elapsed:,.0f} keys/s; process CPU {process_cpu:.1f} s of {elapsed:.1f} s wall; "
          f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms; merges in "
          f"{'a thread' if args.merge_thread or args.memory else 'a worker process (local disk)'}")
    print(f"all calls            {percentiles(walls)}")
    print(f"  merge running      {percentiles([r[1] for r in rows if r[3]])}")
    print(f"  no merge           {percentiles([r[1] for r in rows if not r[3]])}")
    print(f"  caller CPU         {percentiles([r[2] for r in rows])}")
    for what in ("lock", "room", "append", "sync", "gc"):
        print(f"  waited {what:<11} {percentiles([r[4][what] for r in rows])}")
    print("slowest calls: at s, wall, caller cpu, merging, lock, back-pressure, log append, of it syncs, "
          "gc in the caller (ms)")
    for at, wall, cpu, merge, t in sorted(rows, key=lambda r: -r[1])[:args.show]:
        print(f"  {at:7.2f} {wall * 1e3:8.2f} {cpu * 1e3:7.2f} {'M' if merge else '-'} {t['lock'] * 1e3:8.2f} "
              f"{t['room'] * 1e3:8.2f} {t['append'] * 1e3:8.2f} {t['sync'] * 1e3:8.2f} {t['gc'] * 1e3:8.2f}")
    for generation in range(3):
        times = [p for g, p in pauses if g == generation]
        print(f"gc generation {generation}: {len(times)} collections, {sum(times) * 1e3:,.0f} ms, "
              f"longest {max(times, default=0) * 1e3:.1f} ms")
    print("truncations of the merged log (beside appends: lock held only to plan and to update the view): "
          + ", ".join(f"{t * 1e3:.0f} ms" for t in probe.truncations))
    print(f"peak RSS: writer {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB, merge worker "
          f"{worker_rss / 2**20:,.0f} MiB")
    for start, wall, cpu, n, sync in probe.merges:
        print(f"merge at {start - begin:7.2f} s: {n:,} keys, {wall * 1e3:,.0f} ms wall, {cpu * 1e3:,.0f} ms CPU, "
              f"{sync * 1e3:,.0f} ms in syncs")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--calls", type=int, default=1000, help="update calls of 1,000 random keys")
    parser.add_argument("--merge-keys", type=int, default=250_000)
    parser.add_argument("--show", type=int, default=10, help="slowest calls listed")
    parser.add_argument("--dir", default=None, help="where the index goes (default: a temp dir)")
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (ms) for the run")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the load (as an application may)")
    parser.add_argument("--memory", action="store_true", help="memory:// storage: no disk, CPU and GIL alone")
    parser.add_argument("--merge-thread", action="store_true",
                        help="merge_process=False: merges in a thread of the writer's process (the A/B baseline)")
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
