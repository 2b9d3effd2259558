"""Durable small appends on local disk: the v1 commit protocol (two fdatasyncs) against v2 (one fsync).

    python -m sims.segments.fsync [--ops 1000] [--payload 100] [--dir DIR]

One process, one disk (a temp dir under --dir). Every variant is set up once and does --ops durable
operations, interleaved one by one with the other variants and each timed alone, so a burst of load
from other processes hits them all alike; the median latency is reported. Variants:

  raw syscalls, 100-byte appends (what each protocol costs without attrindex):
    v1 sidecar     pwrite data, fdatasync; pwrite a 16-byte record to NAME.commit, fdatasync
    v2 xattr       pwrite data, sync_file_range (write, wait; no flush), fsetxattr record, fsync
    in-file, prefilled   (rejected design, for reference) pwrite data into a zero-filled region,
                   pwrite a record into the file's first page, one fdatasync: no journal commit,
                   but no order between record and data either (see docs/storage.md)
  RollingSegment.append of 100 bytes, sync=True: commit_format "sidecar" (before) and "xattr" (after)
  Segment.append of one 100-byte record with one attribute update (SegmentStore, local disk):
    "sidecar" and "xattr"
  one-key durable transactions: sqlite3 (synchronous=FULL, rollback journal) and LMDB (sync=True),
    the classes of sims.bench.run

Prints ops/s (1 / median latency), p50/p90 latencies, mean ops/s and the after/before ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

from attrindex import SegmentStore
from sims.bench.run import LMDB, SQLite
from storage_adapters import RollingSegment, open_storage
from storage_adapters.local import _write_out, encode_commit_record, encode_commit_xattr

PAYLOAD = os.urandom(100)  # --payload replaces it


class Variant:
    """Set up once in a fresh directory; ``step(i)`` is durable operation number ``i``."""

    def __init__(self, name: str, make: Callable[[str], tuple[Callable[[int], None], Callable[[], None]]]):
        self.name, self.make, self.latencies = name, make, []
        self.step: Callable[[int], None] = lambda i: None


def raw_v1(directory):
    data = os.open(os.path.join(directory, "c"), os.O_RDWR | os.O_CREAT, 0o644)
    commit = os.open(os.path.join(directory, "c.commit"), os.O_RDWR | os.O_CREAT, 0o644)

    def step(i):
        os.pwrite(data, PAYLOAD, i * len(PAYLOAD))
        os.fdatasync(data)
        os.pwrite(commit, encode_commit_record((i + 1) * len(PAYLOAD)), i * 16)
        os.fdatasync(commit)
    return step, lambda: (os.close(data), os.close(commit))


def raw_v2(directory):
    fd = os.open(os.path.join(directory, "c"), os.O_RDWR | os.O_CREAT, 0o644)

    def step(i):
        os.pwrite(fd, PAYLOAD, i * len(PAYLOAD))
        _write_out(fd, i * len(PAYLOAD), len(PAYLOAD))
        os.setxattr(fd, "user.attrindex.commit", encode_commit_xattr([(i + 1) * len(PAYLOAD), i * len(PAYLOAD)]))
        os.fsync(fd)
    return step, lambda: os.close(fd)


def raw_in_file(ops):
    def make(directory):
        fd = os.open(os.path.join(directory, "c"), os.O_RDWR | os.O_CREAT, 0o644)
        os.pwrite(fd, bytes(4096 + ops * len(PAYLOAD) + 4096), 0)
        os.fsync(fd)

        def step(i):
            os.pwrite(fd, PAYLOAD, 4096 + i * len(PAYLOAD))
            os.pwrite(fd, encode_commit_record((i + 1) * len(PAYLOAD)), (i % 64) * 64)
            os.fdatasync(fd)
        return step, lambda: os.close(fd)
    return make


def rolling(commit_format):
    def make(directory):
        seg = RollingSegment(open_storage(directory, commit_format=commit_format), "s")
        return (lambda i: seg.append(PAYLOAD)), seg.close
    return make


def segment(commit_format):
    def make(directory):
        store = SegmentStore.open(directory, {"commit_format": commit_format})
        seg = store.segment("s", create=True)
        return (lambda i: seg.append([PAYLOAD], [(i % 1000, i)])), store.close
    return make


def engine(cls):
    def make(directory):
        db = cls(directory)
        return (lambda i: db.update([(i.to_bytes(16, "big"), i)])), lambda: None
    return make


def run(variants: list[Variant], ops: int, base: str) -> None:
    """Each variant is set up once; then operation ``i`` of every variant runs before operation
    ``i + 1`` of any, each timed alone, so a burst of load from other processes hits all alike."""
    opened = []
    try:
        for variant in variants:
            step, close = variant.make(tempfile.mkdtemp(dir=base))
            opened.append(close)
            step(0)  # creation (chunk, directory fsync, tables) is not the steady state
            variant.step = step
        clock = time.perf_counter
        for i in range(1, ops + 1):
            for variant in variants:
                started = clock()
                variant.step(i)
                variant.latencies.append(clock() - started)
            if i % max(1, ops // 10) == 0:
                print(f"{i}/{ops} operations of each variant", file=sys.stderr, flush=True)
    finally:
        for close in opened:
            close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=1000, help="durable operations per variant")
    parser.add_argument("--payload", type=int, default=100, help="bytes per append (and per record)")
    parser.add_argument("--dir", default=None, help="where the data goes (default: a temp dir)")
    args = parser.parse_args(argv)
    global PAYLOAD
    PAYLOAD = os.urandom(args.payload)
    base = tempfile.mkdtemp(prefix="fsync-", dir=args.dir)
    variants = [
        Variant("raw v1 sidecar (2 fdatasync)", raw_v1),
        Variant("raw v2 xattr (1 fsync)", raw_v2),
        Variant("raw in-file record, prefilled (rejected)", raw_in_file(args.ops + 1)),
        Variant("RollingSegment.append sidecar", rolling("sidecar")),
        Variant("RollingSegment.append xattr", rolling("xattr")),
        Variant("Segment.append sidecar", segment("sidecar")),
        Variant("Segment.append xattr", segment("xattr")),
        Variant("sqlite3 one-key txn (FULL)", engine(SQLite)),
        Variant("LMDB one-key txn (sync)", engine(LMDB)),
    ]
    try:
        run(variants, args.ops, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    median = {v.name: statistics.median(v.latencies) for v in variants}
    print(f"\ndurable operations of {args.payload} bytes, {args.ops} of each, interleaved one by one; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"  {'variant':<42}{'ops/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'mean ops/s':>12}")
    for v in variants:
        ordered = sorted(v.latencies)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        print(f"  {v.name:<42}{1 / median[v.name]:>9,.0f}{median[v.name] * 1e3:>9.2f}{p90 * 1e3:>9.2f}"
              f"{len(ordered) / sum(ordered):>12,.0f}")
    ratios = [
        ("raw: v2 / v1", "raw v2 xattr (1 fsync)", "raw v1 sidecar (2 fdatasync)"),
        ("RollingSegment.append: xattr / sidecar", "RollingSegment.append xattr", "RollingSegment.append sidecar"),
        ("Segment.append: xattr / sidecar", "Segment.append xattr", "Segment.append sidecar"),
        ("RollingSegment.append xattr / sqlite3", "RollingSegment.append xattr", "sqlite3 one-key txn (FULL)"),
        ("RollingSegment.append xattr / LMDB", "RollingSegment.append xattr", "LMDB one-key txn (sync)"),
        ("Segment.append xattr / sqlite3", "Segment.append xattr", "sqlite3 one-key txn (FULL)"),
        ("Segment.append xattr / LMDB", "Segment.append xattr", "LMDB one-key txn (sync)"),
    ]
    by_name = {v.name: v for v in variants}
    print("ratios of throughput (1 / median latency; and by mean latency):")
    for label, top, bottom in ratios:
        mean_ratio = sum(by_name[bottom].latencies) / sum(by_name[top].latencies)
        print(f"  {label:<42}{median[bottom] / median[top]:>9.2f}x{mean_ratio:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
