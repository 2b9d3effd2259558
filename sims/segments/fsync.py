"""Durable small appends on local disk: the chain-of-frames commit (one write, one fdatasync).

    python -m sims.segments.fsync [--ops 1000] [--payload 100] [--dir DIR]

One process, one disk (a temp dir under --dir). Every variant is set up once and does --ops durable
operations, interleaved one by one with the other variants and each timed alone, so a burst of load
from other processes hits them all alike; the median latency is reported. Variants:

  raw syscalls (what the commit costs without attrindex): pwrite one frame of the payload into
    zeros pre-written ahead of it, one fdatasync (no commit record: the frames say what is committed)
  RollingSegment.append of one frame of the payload (LengthChecksumFraming), sync=True
  Segment.append of one record with one attribute update (SegmentStore, local disk)
  one-key durable transactions: sqlite3 (synchronous=FULL, rollback journal) and LMDB (sync=True),
    the classes of sims.bench.run

Prints ops/s (1 / median latency), p50/p90 latencies, mean ops/s and the ratios to the raw floor
and to the peers.
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
from storage_adapters.framing import LengthChecksumFraming
from storage_adapters.local import PREWRITE_BYTES

PAYLOAD = os.urandom(100)  # --payload replaces it


class Variant:
    """Set up once in a fresh directory; ``step(i)`` is durable operation number ``i``."""

    def __init__(self, name: str, make: Callable[[str], tuple[Callable[[int], None], Callable[[], None]]]):
        self.name, self.make, self.latencies = name, make, []
        self.step: Callable[[int], None] = lambda i: None


def raw_chain(directory):
    """pwrite one frame at the chain's end, into pre-written zeros; one fdatasync."""
    fd = os.open(os.path.join(directory, "c"), os.O_RDWR | os.O_CREAT, 0o644)
    end = [0, 0]  # the chain's end, the pre-written end

    def step(i):
        frame = LengthChecksumFraming.frame(PAYLOAD, end[0])
        os.pwrite(fd, frame, end[0])
        if end[0] + len(frame) > end[1] - PREWRITE_BYTES // 4:  # zeros ahead, as local storage does
            os.pwrite(fd, bytes(PREWRITE_BYTES), end[0] + len(frame))
            end[1] = end[0] + len(frame) + PREWRITE_BYTES
        os.fdatasync(fd)
        end[0] += len(frame)
    return step, lambda: os.close(fd)


def rolling(directory):
    framing = LengthChecksumFraming()
    seg = RollingSegment(open_storage(directory), "s", framing=framing)
    frame = framing.frame(PAYLOAD)  # placed at its position by the append
    return (lambda i: seg.append(frame)), seg.close


def segment(directory):
    store = SegmentStore.open(directory)
    seg = store.segment("s", create=True)
    return (lambda i: seg.append([PAYLOAD], [(i % 1000, i)])), store.close


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
        Variant("raw chain (1 pwrite, 1 fdatasync)", raw_chain),
        Variant("RollingSegment.append", rolling),
        Variant("Segment.append", segment),
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
        ("RollingSegment.append / raw chain", "RollingSegment.append", "raw chain (1 pwrite, 1 fdatasync)"),
        ("Segment.append / raw chain", "Segment.append", "raw chain (1 pwrite, 1 fdatasync)"),
        ("RollingSegment.append / sqlite3", "RollingSegment.append", "sqlite3 one-key txn (FULL)"),
        ("RollingSegment.append / LMDB", "RollingSegment.append", "LMDB one-key txn (sync)"),
        ("Segment.append / sqlite3", "Segment.append", "sqlite3 one-key txn (FULL)"),
        ("Segment.append / LMDB", "Segment.append", "LMDB one-key txn (sync)"),
    ]
    by_name = {v.name: v for v in variants}
    print("ratios of throughput (1 / median latency; and by mean latency):")
    for label, top, bottom in ratios:
        mean_ratio = sum(by_name[bottom].latencies) / sum(by_name[top].latencies)
        print(f"  {label:<42}{median[bottom] / median[top]:>9.2f}x{mean_ratio:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
