"""Key-based log compaction: cleaning throughput next to a raw read of the same bytes.

    python -m sims.logcompaction.run [--records 1000000] [--keys 10000] [--value-size 100]
                                     [--batch 1000] [--rolling-size 8MiB] [--dir DIR]
                                     [--out sims/out/logcompaction] [--profile]

One process, one local disk (a temp dir under --dir). A segment with cleanup_policy="compact" gets
--records records of --value-size random bytes, each keyed by one of --keys keys drawn at random,
appended --batch per append. Then, in this order and in the same run:

  raw read:      every stored log byte read sequentially in 1 MiB windows straight from the chunk
                 files (no parsing): the reference the cleaner is compared with;
  floors:        the sealed chunks read again with every batch's CRC-32 checked, then also with
                 each batch's keys cut and put in a dict (key -> offset): what any verifying
                 cleaner must do, without rewrite or switch (lower bounds for the ratio);
  replay before: a fresh handle reads every record from offset 0 (decoding included);
  compact:       Segment.compact(min_lag_ms=0): the cleaner reads the same bytes once to build
                 the key map, reads again only the batches holding survivors, writes those;
  replay after:  a fresh handle reads the compacted log from its start.

The replay after compaction is checked against a model (dict key -> last value): every key's last
record read holds its last value, offsets ascend, and the cleaned chunks hold one record per key.
Prints a table with ratios (cleaning MB/s over raw read MB/s: target >= 0.5) and writes
results.csv. --repeat N raw-reads and compacts N copies of the log and reports the best of each
(the machine is shared: compare within one run). --breakdown times the cleaner's steps (wall
clock, ns per record). --profile runs the first compaction under cProfile and writes
profile-compact.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import datetime
import io
import os
import platform
import pstats
import random
import shutil
import sys
import tempfile
import time

from attrindex import Record, SegmentStore
from sims.segments.run import check

MIB = 1 << 20


def parse_size(text: str) -> int:
    from attrindex.cli_options import parse_size as parse

    return parse(text)


def write_log(store, records: int, keys: int, value_size: int, batch: int, seed: int = 7) -> dict:
    """Append the records; return the model: key -> last value."""
    rng = random.Random(seed)
    names = [b"user-%08d" % i for i in range(keys)]
    seg = store.segment("changelog", create=True, cleanup_policy="compact")
    model: dict[bytes, bytes] = {}
    stamp = int(time.time() * 1000) - 3_600_000
    written = 0
    while written < records:
        n = min(batch, records - written)
        chosen = [names[rng.randrange(keys)] for _ in range(n)]
        values = [rng.randbytes(value_size) for _ in range(n)]
        seg.append([Record(v, k) for v, k in zip(values, chosen)], timestamp=stamp)
        model.update(zip(chosen, values))
        written += n
    seg.flush()
    return model


def raw_read(store) -> tuple[int, float]:
    """Read every stored log byte in 1 MiB windows, straight from the chunk files."""
    storage = store.storage
    chunks = _log_chunks(storage)
    started = time.perf_counter()
    total = 0
    for name, size in chunks:
        path = f"changelog/_log.seg/{name}"
        position = 0
        while position < size:
            piece = storage.read(path, position, min(size, position + MIB))
            total += len(piece)
            position += len(piece)
    return total, time.perf_counter() - started


def _log_chunks(storage) -> list[tuple[str, int]]:
    """``(name, committed length)`` of the changelog's log chunks (a chunk file on local disk is
    longer: zeros follow its frames)."""
    from attrindex.log.framing import LOG_FRAMING
    from storage_adapters import RollingSegment

    with RollingSegment(storage, "changelog/_log", framing=LOG_FRAMING) as segment:
        return [(c.name, c.stored) for c in segment.chunks()]


def floors(store) -> tuple[float, float]:
    """Lower bounds for any cleaner that verifies what it reads, on the same chunk files and in the
    same 1 MiB windows as ``raw_read``: ``(read + CRC-32 of every batch, that + the key map)``,
    in seconds. The second cuts each batch's keys (``uniform_keys``) and updates a dict of key ->
    offset, and nothing else: no rewrite, no switch, no framework around it."""
    from attrindex.log.batch.chain import iter_batches
    from attrindex.log.batch.decode import uniform_keys

    storage = store.storage
    chunks = _log_chunks(storage)
    out = []
    for with_map in (False, True):
        latest: dict = {}
        started = time.perf_counter()
        for name, size in chunks[:-1]:  # the chunks no longer appended to: what the cleaner cleans
            path = f"changelog/_log.seg/{name}"
            data = storage.read(path, 0, size)
            for pos, header in iter_batches(data, position=int(name[:20]), verify=True):  # named by its start
                if with_map and header.record_count:
                    keys, _dead = uniform_keys(data, pos, header, verify=False)
                    base = header.base_offset
                    latest.update(zip(keys, range(base, base + len(keys))))
        out.append(time.perf_counter() - started)
    return out[0], out[1]


def replay(url: str, rolling: int) -> tuple[list, float]:
    """A fresh handle reads every record from offset 0; ``(records, seconds)``."""
    started = time.perf_counter()
    with SegmentStore.open(url, log_rolling_size=rolling) as store:
        seg = store.segment("changelog")
        out, offset = [], seg.start_offset
        while True:
            got = seg.read(offset, 100_000, max_bytes=64 * MIB)
            if not got:
                break
            out.extend(got)
            offset = got[-1].offset + 1
    return out, time.perf_counter() - started


def stored_bytes(seg) -> int:
    """Bytes the log stores (holes left by compaction are not stored)."""
    start = seg._log.start_position
    return sum(getattr(c, "stored", c.length) - max(0, start - c.start) for c in seg._log.bytes.chunks()
               if c.end > start)


def verify(records: list, model: dict, cleaned_end: int) -> None:
    offsets = [r.offset for r in records]
    check(offsets == sorted(set(offsets)), "offsets do not ascend")
    last: dict[bytes, bytes] = {}
    cleaned_keys: list[bytes] = []
    for r in records:
        last[r.key] = r.value
        if r.offset < cleaned_end:
            cleaned_keys.append(r.key)
    check(last == model, "a key's last record does not hold its last value")
    check(len(cleaned_keys) == len(set(cleaned_keys)), "a key survives twice in the cleaned chunks")


class Breakdown:
    """Wall time per step of the cleaner, by wrapping its functions with timers (a few hundred
    nanoseconds per call, on about a thousand calls): where the compaction time goes, unprofiled.
    The key map pass's read and checksum time is what ``_fill`` spends outside the key steps."""

    STEPS = [  # (label, owner, attribute)
        ("key map pass (read, CRC, keys, map)", "LogCleaner", "_fill"),
        ("  keys cut (uniform_keys)", "module", "uniform_keys"),
        ("  keys decoded (decode_keys)", "module", "decode_keys"),
        ("  map update (OffsetMap.add)", "OffsetMap", "add"),
        ("rewrite pass (read + re-encode survivors)", "LogCleaner", "_clean_span"),
        ("  rewrite_batch", "module", "rewrite_batch"),
        ("switch (replace_range: check, write, delete)", "LogCleaner", "_replace"),
    ]

    def __init__(self):
        from attrindex.log import cleaner

        self.seconds = {label: 0.0 for label, _o, _a in self.STEPS}
        self._undo = []
        for label, owner, attribute in self.STEPS:
            target = cleaner if owner == "module" else getattr(cleaner, owner)
            original = getattr(target, attribute)
            setattr(target, attribute, self._timed(label, original))
            self._undo.append((target, attribute, original))

    def _timed(self, label, function):
        seconds = self.seconds

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - started
        return timed

    def restore(self) -> None:
        for target, attribute, original in reversed(self._undo):
            setattr(target, attribute, original)

    def rows(self, total_s: float, records: int) -> list[tuple[str, str, str]]:
        return [(label, f"{s:.3f} s", f"{s / total_s:5.1%}, {s / records * 1e9:,.0f} ns/record")
                for label, s in self.seconds.items()]


def compact_once(url: str, rolling: int, args, profile: bool):
    """Raw-read, then compact, the log at ``url``: ``(compact s, raw s, raw bytes, stats, log bytes
    before and after, dirty ratio after, breakdown or None, the two ``floors``)``."""
    with SegmentStore.open(url, log_rolling_size=rolling) as store:
        raw_bytes, raw_s = raw_read(store)
        floor_crc_s, floor_map_s = floors(store)
        seg = store.segment("changelog")
        log_before = stored_bytes(seg)
        profiler = cProfile.Profile() if profile else None
        breakdown = Breakdown() if args.breakdown and not profile else None
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        try:
            stats = seg.compact(min_lag_ms=0)
        finally:
            if profiler:
                profiler.disable()
            if breakdown:
                breakdown.restore()
        compact_s = time.perf_counter() - started
        log_after = stored_bytes(seg)
        dirty = seg.dirty_ratio()
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
        with open(os.path.join(args.out, "profile-compact.txt"), "w") as f:
            f.write(text.getvalue())
    return compact_s, raw_s, raw_bytes, stats, log_before, log_after, dirty, breakdown, floor_crc_s, floor_map_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--value-size", type=int, default=100)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--rolling-size", default="8MiB")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default="sims/out/logcompaction")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="time the cleaner's steps (wall clock)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="compact this many copies of the log (raw read before each) and report the best")
    args = parser.parse_args(argv)
    rolling = parse_size(args.rolling_size)
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="logcompaction-", dir=args.dir)
    url = os.path.join(root, "store")
    try:
        with SegmentStore.open(url, log_rolling_size=rolling) as store:
            started = time.perf_counter()
            model = write_log(store, args.records, args.keys, args.value_size, args.batch)
            write_s = time.perf_counter() - started
        before, replay_before_s = replay(url, rolling)
        check(len(before) == args.records, "the log before compaction lost records")
        del before
        runs = []  # what compact_once returns, per copy
        repeat = max(1, args.repeat)
        for r in range(repeat):  # each on a fresh copy (compaction is destructive); the last on the original
            target = url if r == repeat - 1 else os.path.join(root, f"copy-{r}")
            if target != url:
                shutil.copytree(url, target)
            runs.append(compact_once(target, rolling, args, profile=args.profile and r == 0))
            if target != url:
                shutil.rmtree(target, ignore_errors=True)
        after, replay_after_s = replay(url, rolling)
        verify(after, model, runs[-1][3].checkpoint)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for i, run in enumerate(runs):
        print(f"run {i + 1}: raw read {run[2] / MIB:,.1f} MiB in {run[1]:.3f} s, compact {run[0]:.3f} s "
              f"({run[3].bytes_before / MIB / run[0] / (run[2] / MIB / run[1]):.3f}x)")
    compact_s, _raw, raw_bytes, stats, log_before, log_after, dirty, breakdown, _c, _m = min(runs, key=lambda run: run[0])
    raw_s = min(run[1] for run in runs)
    floor_crc_s, floor_map_s = min(run[8] for run in runs), min(run[9] for run in runs)
    raw_mbs = raw_bytes / MIB / raw_s
    clean_mbs = stats.bytes_before / MIB / compact_s
    rows = [
        ("records written", f"{args.records:,} over {args.keys:,} keys, {args.value_size} B values", ""),
        ("append (durable, batch %d)" % args.batch, f"{write_s:.2f} s", f"{args.records / write_s:,.0f} records/s"),
        ("raw sequential read", f"{raw_s:.3f} s", f"{raw_mbs:,.1f} MiB/s of {raw_bytes / MIB:,.1f} MiB"),
        ("compact", f"{compact_s:.3f} s",
         f"{clean_mbs:,.1f} MiB/s, {stats.records_before / compact_s:,.0f} records/s "
         f"({stats.passes} pass(es), {stats.chunks_cleaned} chunks cleaned)"),
        ("compact / raw read", f"{clean_mbs / raw_mbs:.2f}x", "target >= 0.5x"
         + (f" (best of {len(runs)} each)" if len(runs) > 1 else "")),
        ("floor: read + CRC", f"{floor_crc_s:.3f} s",
         f"{stats.bytes_before / MIB / floor_crc_s / raw_mbs:.2f}x of the raw read: any cleaner that verifies"),
        ("floor: + key map", f"{floor_map_s:.3f} s",
         f"{stats.bytes_before / MIB / floor_map_s / raw_mbs:.2f}x of the raw read: + cut keys, dict.update"),
        ("bytes read by the cleaner", f"{stats.bytes_read / MIB:,.1f} MiB",
         f"{stats.bytes_read / max(1, stats.bytes_before):.2f}x the cleaned section; "
         f"{stats.batches_skipped:,} batches dropped unread"),
        ("compact / replay before", f"{clean_mbs / (raw_bytes / MIB / replay_before_s):.2f}x",
         "against reading (and decoding) every record of the same log"),
        ("cleaned section", f"{stats.bytes_before / MIB:,.1f} -> {stats.bytes_after / MIB:,.2f} MiB",
         f"{stats.records_before:,} -> {stats.records_after:,} records"),
        ("whole log", f"{log_before / MIB:,.1f} -> {log_after / MIB:,.2f} MiB",
         f"active chunk not cleaned; dirty ratio after {dirty:.3f}"),
        ("replay before", f"{replay_before_s:.3f} s", f"{args.records / replay_before_s:,.0f} records/s"),
        ("replay after", f"{replay_after_s:.3f} s", f"{len(after):,} records ({replay_before_s / replay_after_s:.1f}x faster)"),
    ]
    if breakdown:
        rows += [("-- cleaner steps (wall)", "", f"load average {os.getloadavg()[0]:.2f}")]
        rows += breakdown.rows(compact_s, stats.records_before)
    print(f"log compaction, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} cores"
          + (" (profiled: times inflated)" if args.profile else ""))
    for name, a, b in rows:
        print(f"  {name:28} {a:>24}  {b}")
    with open(os.path.join(args.out, "results-profiled.csv" if args.profile else "results.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["records", "keys", "value_size", "raw_bytes", "raw_s", "compact_s", "bytes_before",
                         "bytes_after", "records_before", "records_after", "log_before", "log_after",
                         "replay_before_s", "replay_after_s", "compact_over_raw"])
        writer.writerow([args.records, args.keys, args.value_size, raw_bytes, f"{raw_s:.4f}", f"{compact_s:.4f}",
                         stats.bytes_before, stats.bytes_after, stats.records_before, stats.records_after,
                         log_before, log_after, f"{replay_before_s:.4f}", f"{replay_after_s:.4f}",
                         f"{clean_mbs / raw_mbs:.3f}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
