"""Segments on local disk: tail throughput, conditional appends, durable attribute updates; one run.

    python -m sims.segments.run [--records 1000000] [--batch 1000] [--appends 2000]
                                [--keys 1000000] [--batches 300] [--parts tail,conditional,attributes]
                                [--profile] [--out sims/out/segments] [--dir DIR]

Everything runs in one process, on one disk (a temp dir under --dir, by default the system's):

  tail:        --records records of 100 bytes appended in batches of --batch (each append durable:
               data + commit record, each fdatasync'd) while a reader thread tails them. Compared
               with raw writes of the same bytes, --batch records per write(): (a) one fsync at the
               end, (b) an fdatasync per write; and with the segment on a memory:// store. The
               reader checks every record: offsets in order and a CRC of all the values.
  conditional: --appends appends of one 100-byte record each, carrying one REPLACE_IF_EQUALS
               update (value n, compare n-1; None first), one plain REPLACE pair, or no attribute;
               on local disk and on memory://.
  attributes:  --keys random 16-byte keys preloaded (one update_attributes, then flush), then
               --batches batches of 1000 random keys over them, one durable update_attributes each,
               and a final flush (timed). The same key set and batches through LMDB and sqlite3
               (sims.bench.run), preloaded the same way. Final values are checked on all three.

Prints tables with ratios and writes results.csv. --profile runs each part under cProfile instead
(times are inflated; the tables are printed but results go to results-profiled.csv) and writes
profile-*.txt with the top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import contextlib
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
import threading
import time
import zlib

from attrindex import AttributeUpdate, SegmentStore, UpdateType
from sims.bench.run import LMDB, SQLite, disk_bytes

RECORD_SIZE = 100
KEY_BATCH = 1000
PROFILE_TOP = 25


class BenchmarkError(AssertionError):
    """The benchmark read back something other than what it wrote."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise BenchmarkError(message)


class Profiles:
    """cProfile per section when enabled (one profile per thread: cProfile sees only its own)."""

    def __init__(self, enabled: bool, out: str):
        self.enabled, self.out = enabled, out
        self.done: dict[str, cProfile.Profile] = {}  # a label entered again adds to its profile

    @contextlib.contextmanager
    def section(self, label: str):
        if not self.enabled:
            yield
            return
        profile = self.done.setdefault(label, cProfile.Profile())
        profile.enable()
        try:
            yield
        finally:
            profile.disable()

    def report(self) -> None:
        for label, profile in self.done.items():
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text).strip_dirs().sort_stats("cumulative")
            text.write(f"=== {label}: top {PROFILE_TOP} by cumulative time\n")
            stats.print_stats(PROFILE_TOP)
            text.write(f"=== {label}: top {PROFILE_TOP // 2} by own time\n")
            stats.sort_stats("tottime").print_stats(PROFILE_TOP // 2)
            path = os.path.join(self.out, f"profile-{label}.txt")
            with open(path, "w") as handle:
                handle.write(text.getvalue())
            profile.dump_stats(os.path.join(self.out, f"profile-{label}.prof"))
            print(text.getvalue())
            print(f"wrote {path}")


# -- 1. tail throughput ------------------------------------------------------------------------
def make_payloads(count: int) -> list[bytes]:
    """``count`` distinct 100-byte records: the big-endian index, then 92 bytes of random filler."""
    rng = random.Random(3)
    pool = rng.randbytes((RECORD_SIZE - 8) * 1024)
    filler = [pool[i * (RECORD_SIZE - 8):(i + 1) * (RECORD_SIZE - 8)] for i in range(1024)]
    return [i.to_bytes(8, "big") + filler[i & 1023] for i in range(count)]


def raw_write(path: str, payloads: list[bytes], batch: int, sync_each: bool) -> float:
    """Seconds to write the payloads, ``batch`` per write() (the join counted): one fsync at the end,
    or an fdatasync after every write."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(payloads), batch):
            data = b"".join(payloads[i:i + batch])
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync_each:
                os.fdatasync(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    check(os.path.getsize(path) == len(payloads) * RECORD_SIZE, f"raw write of {path} is short")
    os.remove(path)
    return seconds


def tail_run(url: str, payloads: list[bytes], batch: int, expected_crc: int, profiles: Profiles, label: str,
             tail: bool = True, storage_options: dict | None = None) -> dict:
    """Append the payloads in batches while a reader thread tails them; check what it read.
    Without ``tail``, nobody reads while the writer runs; the log is read back after, untimed."""
    store = SegmentStore.open(url, storage_options=storage_options)
    seg = store.segment("bench", create=True)
    reader = seg.reader(offset=0)
    total = len(payloads)
    state: dict = {}

    def read_all() -> None:
        got, crc = 0, 0
        try:
            with profiles.section(f"tail-{label}-reader"):
                while got < total:
                    records = reader.read_batch(4096, timeout=60)
                    if not records:
                        raise BenchmarkError(f"reader: no record at offset {got} within 60 s")
                    first, last = records[0].offset, records[-1].offset
                    if first != got or last != got + len(records) - 1:
                        raise BenchmarkError(f"reader: expected offsets {got}..{got + len(records) - 1}, got {first}..{last}")
                    crc = zlib.crc32(b"".join([r.value for r in records]), crc)
                    got += len(records)
            state["done"] = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            state["error"] = exc
        state["count"], state["crc"], state["last_offset"] = got, crc, got - 1

    thread = threading.Thread(target=read_all, name="tail-reader")
    if tail:
        thread.start()
    start = time.perf_counter()
    try:
        with profiles.section(f"tail-{label}-writer"):
            for i in range(0, total, batch):
                result = seg.append(payloads[i:i + batch])
                check(result.first_offset == i, f"append landed at {result.first_offset}, expected {i}")
        writer_done = time.perf_counter()
        if not tail:
            read_all()
        else:
            thread.join()
    finally:
        if thread.is_alive():
            reader.cancel()
            thread.join()
    if "error" in state:
        raise state["error"]
    check(state["count"] == total, f"reader got {state['count']} records, expected {total}")
    check(state["last_offset"] == total - 1, f"reader's last offset {state['last_offset']}, expected {total - 1}")
    check(state["crc"] == expected_crc, "reader's records differ from what was appended (CRC of the values)")
    stats = seg.stats()
    check(stats.next_offset == total, f"segment next_offset {stats.next_offset}, expected {total}")
    row = {"writer_s": writer_done - start, "total_s": (state["done"] if tail else writer_done) - start,
           "log_bytes": stats.log_bytes, "log_chunks": stats.log_chunks}
    store.delete_segment("bench")
    store.close()
    return row


def bench_tail(args, work: str, profiles: Profiles) -> list[dict]:
    payloads = make_payloads(args.records)
    mb = len(payloads) * RECORD_SIZE / 1e6
    expected_crc = zlib.crc32(b"".join(payloads))
    rows = []
    print(f"tail: {len(payloads):,} records of {RECORD_SIZE} bytes ({mb:.0f} MB), batches of {args.batch:,}", flush=True)
    for variant, sync_each in (("raw write, one fsync at end", False), ("raw write, fdatasync per write", True)):
        seconds = raw_write(os.path.join(work, "raw.bin"), payloads, args.batch, sync_each)
        rows.append({"part": "tail", "variant": variant, "writer_s": seconds, "total_s": seconds})
    memory = f"memory://attrindex-segments-bench-{os.getpid()}"
    local, nosync = os.path.join(work, "tail"), {"sync": False}
    for variant, label, url, tail, options in (
            ("segment, local disk", "local", local, True, None),
            ("segment, local disk, sync=false", "local-nosync", local, True, nosync),
            ("segment, memory://", "memory", memory, True, None),
            ("segment, local disk, no reader", "local-alone", local, False, None),
            ("segment, local disk, sync=false, no reader", "local-nosync-alone", local, False, nosync),
            ("segment, memory://, no reader", "memory-alone", memory, False, None)):
        print(f"  {variant} ...", flush=True)
        row = tail_run(url, payloads, args.batch, expected_crc, profiles, label, tail, options)
        rows.append({"part": "tail", "variant": variant, "tail_reader": tail, **row})
        shutil.rmtree(os.path.join(work, "tail"), ignore_errors=True)
    for row in rows:
        row["records"] = len(payloads)
        row["payload_mb_per_s"] = mb / row["writer_s"]
        if row.get("tail_reader"):
            row["reader_records_per_s"] = len(payloads) / row["total_s"]
    return rows


# -- 2. conditional appends --------------------------------------------------------------------
CONDITIONAL_KINDS = ("REPLACE_IF_EQUALS", "REPLACE pair", "no attribute")
ROUND = 100  # appends per variant in turn, so that disk latency drifts hit every variant alike


def conditional_run(url: str, appends: int, profiles: Profiles, where: str) -> dict[str, float]:
    """Seconds per variant: ``appends`` single-record appends each, in interleaved rounds of ROUND,
    each variant on its own segment of one store."""
    store = SegmentStore.open(url)
    key = bytes(range(16))
    payload = make_payloads(1)[0]
    segments = {kind: store.segment(f"cond-{i}", create=True) for i, kind in enumerate(CONDITIONAL_KINDS)}
    seconds = dict.fromkeys(CONDITIONAL_KINDS, 0.0)
    for first in range(1, appends + 1, ROUND):
        last = min(first + ROUND, appends + 1)
        for kind, seg in segments.items():
            with profiles.section(f"conditional-{where}-{kind.split()[0].lower()}"):
                start = time.perf_counter()
                if kind == "REPLACE_IF_EQUALS":
                    for n in range(first, last):
                        seg.append([payload], attribute_updates=[
                            AttributeUpdate(key, UpdateType.REPLACE_IF_EQUALS, value=n, compare=n - 1 if n > 1 else None)])
                elif kind == "REPLACE pair":
                    for n in range(first, last):
                        seg.append([payload], attribute_updates=[(key, n)])
                else:
                    for _ in range(first, last):
                        seg.append([payload])
                seconds[kind] += time.perf_counter() - start
    for i, (kind, seg) in enumerate(segments.items()):
        check(seg.next_offset == appends, f"{kind}: next_offset {seg.next_offset}, expected {appends}")
        if kind != "no attribute":
            value = seg.get_attributes([key])[0]
            check(value == appends, f"{kind}: attribute is {value}, expected {appends}")
        store.delete_segment(f"cond-{i}")
    store.close()
    return seconds


def bench_conditional(args, work: str, profiles: Profiles) -> list[dict]:
    print(f"conditional: {args.appends:,} appends of one {RECORD_SIZE}-byte record each, per variant", flush=True)
    rows = {kind: {"part": "conditional", "variant": kind, "appends": args.appends} for kind in CONDITIONAL_KINDS}
    for where, url in (("local", os.path.join(work, "cond")), ("memory", f"memory://attrindex-cond-{os.getpid()}")):
        for kind, seconds in conditional_run(url, args.appends, profiles, where).items():
            rows[kind][f"{where}_s"] = seconds
            rows[kind][f"{where}_appends_per_s"] = args.appends / seconds
        shutil.rmtree(os.path.join(work, "cond"), ignore_errors=True)
    return list(rows.values())


# -- 3. durable attribute updates --------------------------------------------------------------
def expected_values(pairs, batches, probe) -> list[int]:
    final = dict(pairs)
    for batch in batches:
        final.update(batch)
    return [final[k] for k in probe]


def attributes_segment(path: str, pairs, batches, probe, expected, profiles: Profiles) -> dict:
    store = SegmentStore.open(path)
    seg = store.segment("attrs", create=True)
    start = time.perf_counter()
    with profiles.section("attributes-preload"):
        seg.update_attributes(pairs)
        seg.flush()
    load_s = time.perf_counter() - start
    before = seg.stats()
    latencies = []
    clock = time.perf_counter
    start = clock()
    with profiles.section("attributes-updates"):
        for batch in batches:
            began = clock()
            seg.update_attributes(batch)
            latencies.append(clock() - began)
        began = clock()
        seg.flush()
        final_flush_s = clock() - began
    seconds = clock() - start
    after = seg.stats()
    check(after.pending_attributes == 0, f"{after.pending_attributes} attributes still pending after flush")
    got = seg.get_attributes(probe)
    check(got == expected, "attrindex: values read back differ from the updates")
    latencies.sort()
    row = {"load_s": load_s, "update_s": seconds, "final_flush_s": final_flush_s,
           "batch_median_ms": latencies[len(latencies) // 2] * 1e3, "batch_max_ms": latencies[-1] * 1e3,
           "batches_over_100ms": sum(t > 0.1 for t in latencies),
           "tree_flushes": after.attributes.updates_written - before.attributes.updates_written,
           "tree_bytes_written": after.attributes.bytes_written - before.attributes.bytes_written,
           "log_bytes_written": after.log_bytes - before.log_bytes,
           "size_after_updates": disk_bytes(path)}
    store.close()
    return row


def attributes_peer(engine, pairs, batches, probe, expected) -> dict:
    start = time.perf_counter()
    engine.load(pairs)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    for batch in batches:
        engine.update(batch)
    seconds = time.perf_counter() - start
    if isinstance(engine, LMDB):
        with engine.env.begin() as txn:
            got = [int.from_bytes(txn.get(k), "little", signed=True) for k in probe]
    else:
        got = [engine.db.execute("SELECT v FROM t WHERE k=?", (k,)).fetchone()[0] for k in probe]
    check(got == expected, f"{engine.name}: values read back differ from the updates")
    return {"load_s": load_s, "update_s": seconds, "size_after_updates": engine.size()}


def bench_attributes(args, work: str, profiles: Profiles) -> list[dict]:
    rng = random.Random(1)
    keys = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(args.keys)]
    pairs = [(k, rng.randrange(-(1 << 63), 1 << 63)) for k in keys]
    batches = [[(rng.choice(keys), rng.randrange(1 << 40)) for _ in range(KEY_BATCH)] for _ in range(args.batches)]
    probe = rng.sample(keys, min(len(keys), 20_000))
    expected = expected_values(pairs, batches, probe)
    print(f"attributes: {args.keys:,} keys preloaded, then {args.batches} durable batches of {KEY_BATCH:,}", flush=True)
    rows = []
    for label in ("attrindex", "lmdb", "sqlite3"):
        directory = os.path.join(work, label)
        print(f"  {label} ...", flush=True)
        if label == "attrindex":
            row = attributes_segment(directory, pairs, batches, probe, expected, profiles)
        else:
            try:
                engine = (LMDB if label == "lmdb" else SQLite)(directory)
            except ImportError:
                print(f"  {label}: not installed, skipped")
                continue
            row = attributes_peer(engine, pairs, batches, probe, expected)
        row.update(part="attributes", variant=label, keys=args.keys, updates=len(batches) * KEY_BATCH,
                   load_keys_per_s=args.keys / row["load_s"], keys_per_s=len(batches) * KEY_BATCH / row["update_s"])
        rows.append(row)
        shutil.rmtree(directory, ignore_errors=True)
    return rows


# -- reporting ---------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def report_tail(rows: list[dict]) -> None:
    by = {r["variant"]: r for r in rows}
    raw_a, raw_b = by["raw write, one fsync at end"], by["raw write, fdatasync per write"]
    print(f"\n1. tail throughput: {rows[0]['records']:,} records of {RECORD_SIZE} bytes\n")
    head = (f"{'variant':<34}{'writer s':>10}{'total s':>10}{'MB/s':>9}{'reader rec/s':>14}"
            f"{'vs raw (a)':>12}{'vs raw (b)':>12}")
    print(head)
    print("-" * len(head))
    for r in rows:
        tailed = r.get("tail_reader", False)
        total = f"{r['total_s']:>10.2f}" if tailed else f"{'':>10}"
        reader = f"{r['reader_records_per_s']:>14,.0f}" if tailed else f"{'':>14}"
        print(f"{r['variant']:<34}{r['writer_s']:>10.2f}{total}{r['payload_mb_per_s']:>9.1f}{reader}"
              f"{r['payload_mb_per_s'] / raw_a['payload_mb_per_s']:>11.2f}x{r['payload_mb_per_s'] / raw_b['payload_mb_per_s']:>11.2f}x")
    print("  (a) write() per batch, one fsync at the end; (b) write() + fdatasync per batch (a segment append's durability);")
    print("  no reader: the same appends with no tail reader running (the log is read back and checked after, untimed)")
    seg = by["segment, local disk"]
    print(f"  target: total <= 2 s: {seg['total_s']:.2f} s, {verdict(seg['total_s'] <= 2)}; "
          f"MB/s >= half of raw: {seg['payload_mb_per_s'] / raw_a['payload_mb_per_s']:.2f}x of (a), {verdict(seg['payload_mb_per_s'] >= raw_a['payload_mb_per_s'] / 2)}; "
          f"{seg['payload_mb_per_s'] / raw_b['payload_mb_per_s']:.2f}x of (b), {verdict(seg['payload_mb_per_s'] >= raw_b['payload_mb_per_s'] / 2)}")


def report_conditional(rows: list[dict]) -> None:
    by = {r["variant"]: r for r in rows}
    plain = by["no attribute"]
    print(f"\n2. appends of one {RECORD_SIZE}-byte record each: {rows[0]['appends']:,} appends per variant, "
          f"the variants taking turns every {ROUND}\n")
    head = f"{'attribute update':<20}{'local /s':>11}{'us each':>10}{'memory /s':>12}{'us each':>10}{'local vs none':>15}{'memory vs none':>16}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['variant']:<20}{r['local_appends_per_s']:>11,.0f}{1e6 / r['local_appends_per_s']:>10.0f}"
              f"{r['memory_appends_per_s']:>12,.0f}{1e6 / r['memory_appends_per_s']:>10.0f}"
              f"{r['local_appends_per_s'] / plain['local_appends_per_s']:>14.2f}x"
              f"{r['memory_appends_per_s'] / plain['memory_appends_per_s']:>15.2f}x")


def report_attributes(rows: list[dict]) -> None:
    by = {r["variant"]: r for r in rows}
    ours = by["attrindex"]
    print(f"\n3. durable attribute updates: {ours['keys']:,} keys preloaded, {ours['updates']:,} updates "
          f"in batches of {KEY_BATCH:,}, final flush included\n")
    names = [n for n in ("attrindex", "sqlite3", "lmdb") if n in by]
    head = f"{'metric':<30}" + "".join(f"{n:>13}" for n in names) + "".join(f"{'vs ' + n:>12}" for n in names[1:])
    print(head)
    print("-" * len(head))
    for label, field, higher in (("updates (keys/s)", "keys_per_s", True), ("preload (keys/s)", "load_keys_per_s", True),
                                 ("size after updates (MiB)", "size_after_updates", False)):
        scale = 1 / 2**20 if field.startswith("size") else 1
        values = [by[n][field] * scale for n in names]
        ratios = [(values[0] / v if higher else v / values[0]) for v in values[1:]]
        print(f"{label:<30}" + "".join(f"{v:>13,.1f}" for v in values) + "".join(f"{x:>11.2f}x" for x in ratios))
    print("  (ratios: >1 means attrindex is better)")
    print(f"  attrindex wrote {ours['log_bytes_written'] / 2**20:.1f} MiB of log and {ours['tree_bytes_written'] / 2**20:.1f} MiB "
          f"of B+tree in {ours['tree_flushes']} tree flush(es); one update_attributes: median "
          f"{ours['batch_median_ms']:.1f} ms, max {ours['batch_max_ms']:.0f} ms ({ours['batches_over_100ms']} over 100 ms); final flush {ours['final_flush_s']:.2f} s")
    if "lmdb" in by:
        ratio = ours["keys_per_s"] / by["lmdb"]["keys_per_s"]
        print(f"  target: attrindex >= 2x LMDB: {ratio:.2f}x, {verdict(ratio >= 2)}")


def write_csv(path: str, rows: list[dict]) -> None:
    fields = ["part", "variant"] + sorted({f for r in rows for f in r} - {"part", "variant"})
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fields)
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000, help="records of the tail run")
    parser.add_argument("--batch", type=int, default=1000, help="records per append in the tail run")
    parser.add_argument("--appends", type=int, default=2000, help="single-record appends per variant")
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys preloaded for the attribute run")
    parser.add_argument("--batches", type=int, default=1000, help="durable batches of 1000 attribute updates")
    parser.add_argument("--parts", default="tail,conditional,attributes")
    parser.add_argument("--profile", action="store_true", help="run under cProfile; write profile-*.txt")
    parser.add_argument("--out", default="sims/out/segments")
    parser.add_argument("--dir", default=None, help="where the data goes (default: a temp dir)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"tail", "conditional", "attributes"}
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="attrindex-segments-", dir=args.dir)
    print(f"{datetime.date.today()}: {os.cpu_count()} cpus, Python {platform.python_version()} "
          f"({platform.python_implementation()}), {platform.system()} {platform.release()}; data in {work}"
          + ("; PROFILING (times inflated)" if args.profile else ""))
    profiles = Profiles(args.profile, args.out)
    benches = {"tail": (bench_tail, report_tail), "conditional": (bench_conditional, report_conditional),
               "attributes": (bench_attributes, report_attributes)}
    results = {}
    try:
        for part in parts:
            results[part] = benches[part][0](args, work, profiles)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for part in parts:
        benches[part][1](results[part])
    profiles.report()
    path = os.path.join(args.out, "results-profiled.csv" if args.profile else "results.csv")
    write_csv(path, [r for part in parts for r in results[part]])
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
