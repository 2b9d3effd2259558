"""The compaction soak: writers, a compactor, a consolidator with retention and a tail reader race
on one compacted segment, over ``FaultyStorage``, SIGKILLed at random; the changelog checker after.

    python -m sims.faults.compaction [--local 20] [--s3 5] [--ops 60] [--s3-ops 20] [--kills 6] [--seed 0]

Each round creates a segment with cleanup policy ``compact`` or ``delete,compact`` (alternating;
the latter with ``retention_bytes``), tiny log chunks, ``min_compaction_lag_ms`` 0 and a tiny
``tombstone_retention_ms``, and runs five client processes, each its own ``SegmentStore`` over
``FaultyStorage``:

- two **writers** appending batches of 1-4 keyed records (a few hot keys, so compaction has work,
  and many cold ones, so that survivors sit around superseded records in one batch; some
  tombstones; small and big values; every record's unique id in its ``id`` header) with an
  ACCUMULATE counter, some conditional (``expected_offset``);
- a **compactor** looping ``compact(min_lag_ms=0)`` (on ``delete,compact`` it applies retention
  first);
- a **consolidator** looping ``consolidate`` and, on ``delete,compact``, ``apply_retention``;
- a **tail reader** following the segment from offset 0, restarting at the start offset on
  ``RecordTruncatedError``, looking up offsets by time now and then (on its handle, which meets
  every switch), recording every record it sees.

Every operation and sighting goes to ``testkit.history``'s JSON lines. The driver SIGKILLs a random
live client ``--kills`` times and restarts it (a writer's new life does the operations left; the
reader's resumes after the last record it recorded). Once the writers are done, a compaction (and
a retention) made progress and a consolidation ran (the driver appends hot keys while one is
missing), the others stop; the driver appends an end record,
the reader must reach it, and ``testkit.changelog_history.check_changelog`` runs over the log as
stored (read with no faults, ``verify_segment``, a fresh reader reading the same), then again after
quiet compactions that let every tombstone expire. Last, ``delete_segment`` under faults, repeated
until it succeeds, must leave no file, and the name made again is a new, empty segment. Exit code 1
on any violation.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter

from attrindex import Record, SegmentStore
from attrindex.conditional import AttributeUpdate, UpdateType
from attrindex.errors import (AttrIndexError, BadOffsetError, CorruptDataError, HoleError, RecordTruncatedError,
                              StorageError)
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage
from testkit import moto_server
from testkit.changelog_history import check_changelog
from testkit.history import Recorder, fault_counts, load_history, merge_ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEGMENT = "changelog"
ROLL = 1024  #: log chunk size: a few batches each
RETAIN = 3 * ROLL  #: retention_bytes of ``delete,compact`` rounds
TOMBSTONE_MS = 20
HOT_KEYS = [f"h{i}" for i in range(5)]  #: rewritten often: most of their records are superseded
COLD_KEYS = [f"c{i}" for i in range(30)]  #: rarely: survivors around superseded records in one batch
COUNTER, COUNTER_KEY = "c", 1
END_KEY = "__end__"
STORE_OPTIONS = {"log_rolling_size": ROLL, "poll_interval": 0.01, "flush_keys": 4,
                 "attribute_options": {"page_size": 512, "rolling_size": 4096}}
LOCAL_RATES = {"fail_before": 0.01, "lost_ack": 0.02, "latency": 0.02, "enospc": 0.005}
S3_RATES = {"fail_before": 0.01, "lost_ack": 0.03, "latency": 0.01}
READER_RATES = {"fail_before": 0.01, "latency": 0.02}
DELETE_RATES = {"fail_before": 0.2, "lost_ack": 0.2}
ROLES = ("writer", "writer", "compactor", "consolidator", "reader")
STUCK = 12  #: failed operations of one kind in a row that mean a client is stuck, not unlucky


def policy(variant: str) -> dict:
    """The segment's cleanup options for ``variant`` (``compact`` or ``delete,compact``)."""
    options = {"cleanup_policy": variant, "min_compaction_lag_ms": 0, "tombstone_retention_ms": TOMBSTONE_MS}
    if variant == "delete,compact":
        options["retention_bytes"] = RETAIN
    return options


def must_not_raise(exc: Exception) -> str:
    """A note for an error no client call may raise under these faults: anything but a storage
    error (``InvalidInputError`` from a lost race, say), and damage (none is injected)."""
    if isinstance(exc, StorageError) and not isinstance(exc, (CorruptDataError, HoleError)):
        return ""
    return f"must not raise {type(exc).__name__}: {exc}"[:300]


# ------------------------------------------------------------------------------- the clients


class Client:
    """One life of a client: its recorder, its store over ``FaultyStorage``, its stop files."""

    def __init__(self, config: dict, client: str, seed: int, rates: dict | None):
        self.config, self.client = config, client
        self.rng = random.Random(seed)
        self.tag = f"{client}.{uuid.uuid4().hex[:6]}"
        self.recorder = Recorder(os.path.join(config["history"], f"{self.tag}.jsonl"), client)
        self.faulty = FaultyStorage(open_storage(config["url"], **config["options"]), seed=seed, rates=rates,
                                    latency=0.002)
        self.store = SegmentStore(self.faulty, **STORE_OPTIONS)
        self.failures: Counter = Counter()  # failed operations in a row, per kind

    def segment(self):
        """Open the segment, retrying faults (opening is no operation of the history)."""
        for attempt in range(200):
            try:
                return self.store.segment(SEGMENT)
            except StorageError as exc:
                error = exc
                time.sleep(0.002 * min(attempt, 20))
        raise error

    def stopped(self) -> bool:
        return os.path.exists(self.config["stop"])

    def count(self, kind: str, ok: bool) -> None:
        """Count failures in a row; a client whose calls of one kind keep failing is stuck (a
        violation: faults are rare, so a handle that never recovers is a bug, not bad luck)."""
        self.failures[kind] = 0 if ok else self.failures[kind] + 1
        if self.failures[kind] == STUCK:
            self.recorder.event("violation", message=f"{STUCK} {kind} calls in a row failed: stuck")

    def operation(self, kind: str, **fields):
        return self.recorder.operation(kind, judge=must_not_raise, **fields)

    def close(self) -> None:
        try:
            self.store.close()
        except AttrIndexError:  # a close that fails under faults leaves what is durable
            pass
        self.recorder.faults(self.faulty.injected)
        self.recorder.close()


def _ops_done(history: str, client: str) -> int:
    """Appends earlier lives of ``client`` invoked (a new life does the rest)."""
    done = 0
    for path in glob.glob(os.path.join(history, f"{client}.*.jsonl")):
        with open(path, encoding="utf-8") as handle:
            done += handle.read().count('"phase":"invoke"')
    return done


def writer(config: dict, client: str, seed: int) -> None:
    """Append until ``config["ops"]`` appends of this client were invoked (over all its lives)."""
    me = Client(config, client, seed, config["rates"])
    me.faulty.script("fail_before", path_contains="_log.seg")
    me.faulty.script("lost_ack", path_contains="_log.seg")
    try:
        seg = me.segment()
        for n in range(_ops_done(config["history"], client), config["ops"]):
            ids, keys, values = [], [], []
            for i in range(me.rng.randint(1, 4)):
                ids.append(f"{me.tag}:{n}:{i}")
                keys.append(me.rng.choice(HOT_KEYS if me.rng.random() < 0.6 else COLD_KEYS))
                roll = me.rng.random()
                values.append(None if roll < 0.2 else ids[-1] + "." * 100 if roll < 0.45 else ids[-1])
            records = [Record(None if v is None else v.encode(), k.encode(), headers=(("id", i.encode()),))
                       for i, k, v in zip(ids, keys, values)]
            increment = me.rng.randint(1, 5)
            conditional = me.rng.random() < 0.3
            with me.operation("append", payloads=ids, keys=keys, values=values, increments={COUNTER: increment},
                              conditional=conditional) as out:
                if conditional:
                    seg.refresh()
                done = seg.append(records, [AttributeUpdate(COUNTER_KEY, UpdateType.ACCUMULATE, value=increment)],
                                  expected_offset=seg.next_offset if conditional else None)
                out.update(first_offset=done.first_offset, last_offset=done.last_offset)
            me.count("append", bool(out))
            time.sleep(me.rng.uniform(0, 0.01))
    finally:
        me.close()


def compactor(config: dict, client: str, seed: int) -> None:
    """``compact(min_lag_ms=0)`` in a loop until the stop file appears."""
    me = Client(config, client, seed, config["rates"])
    me.faulty.script("lost_ack", op="create", path_contains="_log.seg")  # a switch whose answer is lost
    me.faulty.script("fail_before", op="create", path_contains="_cleaner")
    try:
        seg = me.segment()
        while not me.stopped():
            with me.operation("compact") as out:
                stats = seg.compact(min_lag_ms=0)
                out.update(cleaned=stats.chunks_cleaned, removed=stats.records_removed,
                           tombstones=stats.tombstones_removed, kept_anyway=stats.kept_anyway,
                           retention=stats.retention_chunks_deleted, passes=stats.passes, checkpoint=stats.checkpoint)
            me.count("compact", bool(out))
            time.sleep(me.rng.uniform(0.005, 0.03))
    finally:
        me.close()


def consolidator(config: dict, client: str, seed: int) -> None:
    """``consolidate`` (and ``apply_retention`` on ``delete,compact``) until the stop file appears."""
    me = Client(config, client, seed, config["rates"])
    retains = config["variant"] == "delete,compact"
    try:
        seg = me.segment()
        while not me.stopped():
            with me.operation("consolidate") as out:
                out["merged"] = seg.consolidate(target_size=4 * ROLL)
            me.count("consolidate", bool(out))
            if retains:
                with me.operation("retention") as out:
                    out["deleted"] = seg.apply_retention(max_bytes=RETAIN)
                me.count("retention", bool(out))
            time.sleep(me.rng.uniform(0.005, 0.03))
    finally:
        me.close()


def _reader_position(history: str, client: str) -> int:
    """Where a new life of the reader goes on: after the last record an earlier life recorded."""
    position = 0
    for path in glob.glob(os.path.join(history, f"{client}.*.jsonl")):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:  # the torn last line of a killed life
                    continue
                if event["phase"] == "seen":
                    position = max(position, event["offset"] + 1)
                elif event["phase"] == "restart":
                    position = max(position, event["start"])
    return position


def tail_reader(config: dict, client: str, seed: int) -> None:
    """Follow the segment, recording every record, until the end record (named by the end file)
    is read. ``RecordTruncatedError``: go on from the start offset (recorded); a storage error:
    a new reader at the same position."""
    me = Client(config, client, seed, READER_RATES)
    position = _reader_position(config["history"], client)
    me.recorder.event("begin", position=position)
    end, waited, lookups = None, 0.0, 0
    try:
        seg = me.segment()
        reader = seg.reader(offset=position)
        while end is None or position <= end:
            if end is None and os.path.exists(config["end"]):
                with open(config["end"], encoding="utf-8") as handle:
                    end = int(handle.read())
            try:
                record = reader.read(timeout=0.2)
            except RecordTruncatedError:
                start = _start_offset(me, seg)
                me.recorder.event("restart", at=position, start=start)
                position, reader = start, seg.reader(offset=start)
                continue
            except StorageError as exc:
                if must_not_raise(exc):
                    me.recorder.event("violation", message=must_not_raise(exc))
                me.count("read", False)
                reader = seg.reader(offset=position)
                continue
            if record is None:
                waited += 0.2
                if end is not None and waited > 60:
                    me.recorder.event("violation", message=f"waited 60 s at {position} for the end record at {end}")
                    return
                continue
            waited = 0.0
            me.count("read", True)
            headers = dict(record.headers)
            me.recorder.event("seen", offset=record.offset, id=headers["id"].decode(), key=record.key.decode(),
                              value=None if record.value is None else record.value.decode())
            position = record.offset + 1
            if me.rng.random() < 0.015:  # fall behind now and then: compaction and retention overtake it
                time.sleep(me.rng.uniform(0.3, 2.0))
            lookups += 1
            if lookups % 5 == 0:  # a time lookup on the handle whose reads met every switch
                with me.operation("lookup", timestamp=record.timestamp) as out:
                    out["offset"] = seg.offset_for_timestamp(record.timestamp)
                me.count("lookup", bool(out))
    finally:
        me.close()


def _start_offset(me: Client, seg) -> int:
    for _attempt in range(200):
        try:
            return seg.start_offset
        except StorageError as exc:
            if must_not_raise(exc):
                me.recorder.event("violation", message=must_not_raise(exc))
    raise StorageError("start_offset failed 200 times in a row")


ROLE_RUNNERS = {"writer": writer, "compactor": compactor, "consolidator": consolidator, "reader": tail_reader}


# ------------------------------------------------------------------------------- the driver


def _plain_store(url: str, options: dict) -> SegmentStore:
    return SegmentStore.open(url, storage_options=options, **STORE_OPTIONS)


def _start(config_path: str, role: str, client: str, seed: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sims.faults.compaction", "--role", role, config_path, client, str(seed)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})


def _progress(history: str, retains: bool) -> list[str]:
    """What has not happened yet of: a compaction that cleaned, a consolidation that ran (a merge
    needs small chunks side by side, which a compactor that keeps up may never leave), (a retention
    that deleted)."""
    ops = merge_ops(load_history(history))
    done = {op.kind: True for op in ops if op.status == "ok" and (
        op.kind == "consolidate" or op.result.get("cleaned") or op.result.get("deleted"))}
    if any(op.status == "ok" and op.result.get("retention") for op in ops):
        done["retention"] = True
    wanted = ["compact", "consolidate"] + (["retention"] if retains else [])
    return [kind for kind in wanted if kind not in done]


def top_up(url: str, options: dict, recorder: Recorder, n: int) -> None:
    """Append a batch of hot keys (no faults) for a compaction, consolidation or retention still
    waited for: retention may have removed every superseded record before a compaction ran."""
    ids = [f"driver:{n}:{i}" for i in range(4)]
    keys, values = [HOT_KEYS[i % len(HOT_KEYS)] for i in range(4)], [i + "." * 100 for i in ids]
    with _plain_store(url, options) as store, recorder.operation("append", payloads=ids, keys=keys,
                                                                   values=values) as out:
        done = store.segment(SEGMENT).append([Record(v.encode(), k.encode(), headers=(("id", i.encode()),))
                                              for i, k, v in zip(ids, keys, values)])
        out.update(first_offset=done.first_offset, last_offset=done.last_offset)


def final_state(url: str, options: dict) -> dict:
    """The log as stored, read with no faults by a fresh handle; ``verify_segment`` and a fresh
    tail reader from the start must agree with it (else the state carries a ``mismatch``)."""
    with _plain_store(url, options) as store:
        seg = store.segment(SEGMENT)
        records, offset = [], seg.start_offset
        while True:
            batch = seg.read(offset, 1000)
            if not batch:
                break
            records += [[r.offset, dict(r.headers)["id"].decode(), r.key.decode(),
                         None if r.value is None else r.value.decode()] for r in batch]
            offset = batch[-1].offset + 1
        start, counter = seg.start_offset, seg.get_attribute(COUNTER_KEY)
        report = store.verify_segment(SEGMENT)
    problems = [] if report.ok else [f"verify_segment: {report}"[:500]]
    with _plain_store(url, options) as store:
        reader, again = store.segment(SEGMENT).reader(), []
        while True:
            record = reader.read(timeout=0)
            if record is None:
                break
            again.append(record.offset)
    if again != [r[0] for r in records]:
        problems.append(f"a fresh reader read offsets {again[:10]}..., a read loop {[r[0] for r in records][:10]}...")
    return {"records": records, "start_offset": start, "attributes": {COUNTER: counter}, "problems": problems}


def _quiet_compaction(url: str, options: dict, retains: bool) -> dict:
    """With nothing else running: compact until every tombstone expired, merge, retain."""
    with _plain_store(url, options) as store:
        seg = store.segment(SEGMENT)
        for _ in range(3):
            seg.compact(min_lag_ms=0, tombstone_retention_ms=0)
        seg.consolidate(target_size=4 * ROLL)
        if retains:
            seg.apply_retention(max_bytes=RETAIN)
    return final_state(url, options)


def _delete_under_faults(url: str, options: dict, seed: int) -> tuple[int, list[str]]:
    """``delete_segment`` over ``FaultyStorage`` until it succeeds; then nothing may be left and
    the name made again is a new, empty segment. Returns the attempts and any violations."""
    faulty = FaultyStorage(open_storage(url, **options), seed=seed, rates=DELETE_RATES)
    problems, attempts = [], 0
    with SegmentStore(faulty, **STORE_OPTIONS) as store:
        for attempts in range(1, 101):
            try:
                store.delete_segment(SEGMENT)
                break
            except StorageError as exc:
                if must_not_raise(exc):
                    problems.append(f"delete_segment: {must_not_raise(exc)}")
        else:
            problems.append("delete_segment did not succeed in 100 attempts")
    with _plain_store(url, options) as store:
        left = sorted(store.storage.list_files(SEGMENT))
        if left or store.exists(SEGMENT):
            problems.append(f"delete_segment left {left[:10]} (exists: {store.exists(SEGMENT)})")
        seg = store.segment(SEGMENT, create=True)
        if seg.next_offset or seg.read(0) or seg.cleanup_policy().compacts or seg.get_attribute(COUNTER_KEY):
            problems.append("the segment made again after delete_segment is not new and empty")
    return attempts, problems


def run_round(url: str, options: dict, scratch: str, *, seed: int, variant: str, ops: int, kills: int,
              rates: dict, deadline: float = 240.0) -> dict:
    """One round (see the module doc); returns its figures and ``violations``."""
    rng = random.Random(seed)
    history = os.path.join(scratch, "history")
    os.makedirs(history)
    config = {"url": url, "options": options, "history": history, "ops": ops, "rates": rates, "variant": variant,
              "stop": os.path.join(scratch, "stop"), "end": os.path.join(scratch, "end")}
    config_path = os.path.join(scratch, "config.json")
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    with _plain_store(url, options) as store:
        store.segment(SEGMENT, create=True, **policy(variant))
    clients = {f"{role[0]}{i}": role for i, role in enumerate(ROLES)}  # w0 w1 c2 c3 r4
    procs = {client: _start(config_path, role, client, rng.randrange(10**9)) for client, role in clients.items()}
    killed: Counter = Counter()
    violations: list[str] = []
    stop_at = time.monotonic() + deadline
    retains = variant == "delete,compact"

    def reap(client: str) -> None:
        proc = procs[client]
        _out, err = proc.communicate()
        if proc.returncode == -signal.SIGKILL:
            procs[client] = _start(config_path, clients[client], client, rng.randrange(10**9))
        elif proc.returncode != 0:
            violations.append(f"client {client} ({clients[client]}) exited {proc.returncode}:\n{err[-2000:]}")
            del procs[client]
        else:
            if "Traceback" in err:  # a background thread's exception (a merge, a poll) is no quiet event
                violations.append(f"client {client} ({clients[client]}) printed:\n{err[-2000:]}")
            del procs[client]

    recorder, topped = Recorder(os.path.join(history, "driver.jsonl"), "driver"), 0
    hook, threading.excepthook = threading.excepthook, lambda args: violations.append(
        f"driver thread {args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")
    try:
        phase = "run"
        while True:
            if time.monotonic() > stop_at:
                violations.append(f"round did not finish within {deadline} s (phase {phase}, running "
                                  f"{sorted(procs)}, missing progress {_progress(history, retains)})")
                for client, proc in procs.items():  # where each one is: faulthandler's stacks on SIGUSR1
                    proc.send_signal(signal.SIGUSR1)
                time.sleep(2)
                for client, proc in procs.items():
                    proc.kill()
                    violations.append(f"client {client} ({clients[client]}) at the deadline:\n"
                                      f"{proc.communicate()[1][-6000:]}")
                procs.clear()
                break
            time.sleep(rng.uniform(0.05, 0.3))
            for client in [c for c, p in procs.items() if p.poll() is not None]:
                reap(client)
            if phase == "run":
                live = [c for c in procs if procs[c].poll() is None]
                if sum(killed.values()) < kills and live and rng.random() < 0.5:
                    victim = rng.choice(live)
                    procs[victim].send_signal(signal.SIGKILL)
                    killed[clients[victim]] += 1
                    continue
                writing = any(clients[c] == "writer" for c in procs)
                if not writing and sum(killed.values()) >= kills:
                    if not _progress(history, retains):
                        phase = "stop"
                        open(config["stop"], "w").close()
                    else:  # retention may have removed the work: more superseded records, more bytes
                        top_up(url, options, recorder, topped)
                        topped += 1
            elif phase == "stop" and not any(clients[c] in ("compactor", "consolidator") for c in procs):
                with _plain_store(url, options) as store:  # the end record, which the reader must reach
                    seg = store.segment(SEGMENT)
                    with recorder.operation("append", payloads=["end"], keys=[END_KEY], values=["end"]) as out:
                        done = seg.append([Record(b"end", END_KEY.encode(), headers=(("id", b"end"),))])
                        out.update(first_offset=done.first_offset, last_offset=done.last_offset)
                with open(config["end"] + ".tmp", "w", encoding="utf-8") as handle:
                    handle.write(str(done.first_offset))
                os.rename(config["end"] + ".tmp", config["end"])
                phase = "end"
            elif phase == "end" and not procs:
                break
    finally:
        recorder.close()
        for proc in procs.values():
            proc.kill()
            proc.wait()
    events = load_history(history)
    figures = {"kills": sum(killed.values()), "top_ups": topped,
               **{f"kills_{role}": n for role, n in killed.items()}}
    try:
        _judge_round(url, options, seed, retains, events, figures, violations)
    except Exception as exc:  # noqa: BLE001 - reading, compacting or deleting with no faults must work
        violations.append(f"judging the round: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}")
        figures["violations"] = violations
    finally:
        threading.excepthook = hook
    return figures


def _judge_round(url: str, options: dict, seed: int, retains: bool, events: list[dict], figures: dict,
                 violations: list[str]) -> None:
    if not any(v.startswith("client ") for v in violations):  # (after a deadline: to see what else is wrong)
        for stage, state in (("concurrent", final_state(url, options)),
                             ("quiet", _quiet_compaction(url, options, retains))):
            result = check_changelog(events, state)
            violations += [f"{stage}: {v}" for v in state["problems"] + result.violations]
            figures[f"stored_{stage}"] = result.records_stored
            figures[f"tombstones_expired_{stage}"] = result.tombstones_expired
        figures.update(appends_ok=result.ok, appends_failed=result.failed, appends_unknown=result.unknown,
                       records_written=result.records_written, reader_seen=result.reader_seen,
                       reader_restarts=result.reader_restarts, unjudged_keys=result.unjudged_keys)
        attempts, problems = _delete_under_faults(url, options, seed)
        figures["delete_attempts"] = attempts
        violations += problems
    ops_done = merge_ops(events)
    for kind, field in (("compact", "cleaned"), ("consolidate", "merged"), ("retention", "deleted")):
        mine = [op for op in ops_done if op.kind == kind]
        figures[f"{kind}_calls"] = len(mine)
        figures[f"{kind}_effective"] = sum(1 for op in mine if op.status == "ok" and op.result.get(field))
        figures[f"{kind}_failed"] = sum(1 for op in mine if op.status != "ok")
    figures["compact_retention"] = sum(1 for op in ops_done if op.kind == "compact" and op.result.get("retention"))
    figures["records_compacted"] = sum(op.result.get("removed", 0) for op in ops_done if op.kind == "compact")
    figures["kept_anyway"] = sum(op.result.get("kept_anyway", 0) for op in ops_done if op.kind == "compact")
    figures["lookups"] = sum(1 for op in ops_done if op.kind == "lookup")
    figures.update({f"fault_{k}": v for k, v in fault_counts(events).items()})
    figures["violations"] = violations


# ------------------------------------------------------------------------------- the soak


TOTALS = ("rounds", "kills", "kills_writer", "kills_compactor", "kills_consolidator", "kills_reader", "top_ups",
          "appends_ok", "appends_failed", "appends_unknown", "records_written", "stored_quiet",
          "compact_calls", "compact_effective", "compact_failed", "records_compacted", "kept_anyway",
          "consolidate_calls", "consolidate_effective", "retention_effective", "compact_retention",
          "tombstones_expired_concurrent", "tombstones_expired_quiet", "reader_seen", "reader_restarts", "lookups",
          "unjudged_keys", "delete_attempts", "fault_fail_before", "fault_lost_ack", "fault_enospc",
          "violations")


def soak(backend: str, rounds: int, ops: int, kills: int, seed: int, scratch: str) -> Counter:
    """``rounds`` rounds on ``backend`` (``local`` or ``s3``), variants alternating; totals."""
    from tqdm import tqdm

    totals: Counter = Counter()
    with contextlib.ExitStack() as stack:
        options = stack.enter_context(moto_server.running()) if backend == "s3" else {}
        for n in tqdm(range(rounds), desc=f"compaction soak ({backend})", unit="round"):
            variant = ("compact", "delete,compact")[n % 2]
            where = os.path.join(scratch, f"{backend}-{n}")
            os.makedirs(where)
            url = moto_server.make_s3_url(options) if backend == "s3" else os.path.join(where, "store")
            figures = run_round(url, options, where, seed=seed + n, variant=variant, ops=ops, kills=kills,
                                rates=S3_RATES if backend == "s3" else LOCAL_RATES)
            violations = figures.pop("violations")
            totals.update({k: v for k, v in figures.items() if isinstance(v, int)})
            totals["rounds"] += 1
            totals["violations"] += len(violations)
            for violation in violations[:5]:
                tqdm.write(f"round {n} ({variant}, seed {seed + n}): {violation}")
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", type=int, default=20, help="rounds on local disk (default 20)")
    parser.add_argument("--s3", type=int, default=5, help="rounds on S3 (moto on 127.0.0.1; default 5)")
    parser.add_argument("--ops", type=int, default=60, help="appends per writer per round on local disk (default 60)")
    parser.add_argument("--s3-ops", type=int, default=20, help="appends per writer per round on S3 (default 20)")
    parser.add_argument("--kills", type=int, default=6, help="SIGKILLs per round (default 6)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    failed = False
    with tempfile.TemporaryDirectory(prefix="attrindex-compaction-") as scratch:
        for backend, rounds in (("local", args.local), ("s3", args.s3)):
            if not rounds:
                continue
            ops = args.ops if backend == "local" else args.s3_ops
            totals = soak(backend, rounds, ops, args.kills, args.seed, scratch)
            print(f"\ncompaction soak ({backend}, seed {args.seed}, {ops} appends per writer, "
                  f"{args.kills} kills per round)")
            for name in TOTALS:
                print(f"  {name:<32}{totals[name]:>10,}")
            failed |= bool(totals["violations"])
    print(f"\n{'FAILED' if failed else 'passed'} in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks where a late client is
        _role, config_file, client_name, client_seed = sys.argv[2:6]
        with open(config_file, encoding="utf-8") as config_handle:
            ROLE_RUNNERS[_role](json.load(config_handle), client_name, int(client_seed))
    else:
        sys.exit(main())
