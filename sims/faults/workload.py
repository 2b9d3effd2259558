"""Concurrent clients under injected storage faults, recorded for the history checker.

A *client* opens its own ``SegmentStore`` over ``FaultyStorage`` and runs a random mix of
operations on one segment, recording each in ``testkit.history``'s format:

- ``append``: records with unique payloads plus an ACCUMULATE increment of counter ``c``;
- ``append`` with a compare-and-set: records plus REPLACE_IF_EQUALS on key ``cas`` (compare = the
  value the client last read, value unique to this client and operation);
- ``read``: ``c`` after a refresh (a fresh read), or the records from an offset;
- ``events`` (``event_client``): ``EventWriter`` writes, one op per flush, resent in full by a
  restarted life of the same writer id (the writer's exactly-once promise).

Clients run as threads (``run_threads``) or child processes (``python -m sims.faults.workload``),
which ``kill_loop`` SIGKILLs at random and restarts. ``final_state`` reads what is stored, with no
faults, for ``testkit.history.check``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

from attrindex import EventWriter, SegmentStore
from attrindex.conditional import AttributeUpdate, UpdateType
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage
from testkit.history import Recorder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COUNTER, CAS = "c", "cas"
KEYS = {COUNTER: 1, CAS: 2}  #: history names of the attributes -> their keys in the segment
SEGMENT, STREAM = "hist", "events"
DEFAULT_RATES = {"fail_before": 0.01, "lost_ack": 0.02, "latency": 0.02}
STORE_OPTIONS = {"log_rolling_size": 4096, "flush_keys": 2, "poll_interval": 0.01,
                 "attribute_options": {"page_size": 512, "rolling_size": 4096}}


def faulty_store(url: str, options: dict, seed: int, rates: dict | None) -> tuple[SegmentStore, FaultyStorage]:
    """A store over ``FaultyStorage`` with small chunks and frequent merges (so faults hit them)."""
    faulty = FaultyStorage(open_storage(url, **options), seed=seed, rates=rates, latency=0.002)
    if rates:
        # Every client meets both kinds at least once on a log write, whatever the random schedule
        # draws (how many calls a client makes varies with thread timing and kills).
        faulty.script("fail_before", path_contains="_log.seg")
        faulty.script("lost_ack", path_contains="_log.seg")
    return SegmentStore(faulty, **STORE_OPTIONS), faulty


def prepare(url: str, options: dict, stream_segments: int = 2) -> None:
    """Create the segment and the stream the clients use (no faults)."""
    with SegmentStore.open(url, storage_options=options, **STORE_OPTIONS) as store:
        store.segment(SEGMENT, create=True)
        store.create_stream(STREAM, stream_segments)


def segment_client(url: str, options: dict, history_dir: str, client: str, ops: int, seed: int,
                   rates: dict | None = DEFAULT_RATES) -> None:
    """Run ``ops`` random operations on the segment as ``client``, recording each."""
    rng = random.Random(seed)
    tag = f"{client}.{uuid.uuid4().hex[:6]}"  # payloads unique across lives of the same client
    recorder = Recorder(os.path.join(history_dir, f"{tag}.jsonl"), client)  # a file per life: a torn line ends it
    store, faulty = faulty_store(url, options, seed, rates)
    last_cas = None
    try:
        seg = _open_segment(store, recorder)
        for n in range(ops):
            roll = rng.random()
            if roll < 0.15:
                with recorder.operation("read", counter=COUNTER, fresh=True) as out:
                    seg.refresh()
                    out["value"] = seg.get_attribute(KEYS[COUNTER])
            elif roll < 0.2:
                with recorder.operation("read") as out:
                    start = rng.randrange(max(1, seg.next_offset))
                    out["records"] = [[r.offset, r.value.decode()] for r in seg.read(start, 20)]
            elif roll < 0.4:
                with recorder.operation("read", cas=True) as out:
                    seg.refresh()
                    out["value"] = last_cas = seg.get_attribute(KEYS[CAS])
                value = (abs(hash(tag)) % 10**6) * 10**6 + n
                payloads = [f"{tag}:{n}"]
                with recorder.operation("append", payloads=payloads, cas=[CAS, last_cas, value]) as out:
                    update = AttributeUpdate(KEYS[CAS], UpdateType.REPLACE_IF_EQUALS, value=value, compare=last_cas)
                    done = seg.append([p.encode() for p in payloads], [update])
                    out.update(first_offset=done.first_offset, last_offset=done.last_offset)
            else:
                increment = rng.randint(1, 5)
                payloads = [f"{tag}:{n}:{i}" for i in range(rng.randint(1, 3))]
                with recorder.operation("append", payloads=payloads, increments={COUNTER: increment}) as out:
                    done = seg.append([p.encode() for p in payloads],
                                      [AttributeUpdate(KEYS[COUNTER], UpdateType.ACCUMULATE, value=increment)])
                    out.update(first_offset=done.first_offset, last_offset=done.last_offset)
    finally:
        try:
            store.close()
        except Exception:  # noqa: BLE001 - a close that fails under faults leaves what is durable
            pass
        recorder.faults(faulty.injected)
        recorder.close()


def _open_segment(store: SegmentStore, recorder: Recorder):
    """Open the segment, retrying faults on the way (opening is not an operation of the history)."""
    for attempt in range(50):
        try:
            return store.segment(SEGMENT)
        except Exception as exc:  # noqa: BLE001
            error = exc
            time.sleep(0.01 * attempt)
    raise error


def event_client(url: str, options: dict, history_dir: str, client: str, events: int, seed: int,
                 rates: dict | None = DEFAULT_RATES) -> None:
    """Write events ``client:1`` ... ``client:events`` exactly once through an ``EventWriter``
    whose id depends only on ``client``: a restarted life resends them all, in the same order."""
    rng = random.Random(seed)
    recorder = Recorder(os.path.join(history_dir, f"{client}-events-{uuid.uuid4().hex[:6]}.jsonl"), client)
    store, faulty = faulty_store(url, options, seed, rates)
    writer_id = uuid.uuid5(uuid.NAMESPACE_URL, client)
    try:
        writer = None
        with recorder.operation("open"):
            writer = EventWriter(store, STREAM, writer_id=writer_id, batch_events=4, retries=50, retry_delay=0.001)
        n = 1
        while writer is not None and n <= events:
            payloads = [f"{client}:{k}" for k in range(n, min(events, n + rng.randint(1, 6)) + 1)]
            with recorder.operation("events", queued=True, payloads=payloads):
                for p in payloads:
                    writer.write(p.encode(), routing_key=p.encode())
                writer.flush()
            n += len(payloads)
    finally:
        recorder.faults(faulty.injected)
        recorder.close()


def run_threads(url: str, options: dict, history_dir: str, clients: int, ops: int, seed: int,
                rates: dict | None = DEFAULT_RATES, events: int = 0) -> None:
    """``clients`` segment clients (and as many event writers if ``events``) as threads."""
    threads = [threading.Thread(target=segment_client, args=(url, options, history_dir, f"t{i}", ops, seed + i, rates))
               for i in range(clients)]
    if events:
        threads += [threading.Thread(target=event_client,
                                     args=(url, options, history_dir, f"w{i}", events, seed + 100 + i, rates))
                    for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a client thread hung"


def start_process(url: str, options: dict, history_dir: str, role: str, client: str, count: int, seed: int,
                  rates: dict | None) -> subprocess.Popen:
    """A client in a child process (``role``: ``segment`` or ``events``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "sims.faults.workload", role, url, json.dumps(options), history_dir, client,
         str(count), str(seed), json.dumps(rates)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )


def kill_loop(url: str, options: dict, history_dir: str, processes: int, count: int, seed: int,
              rates: dict | None = DEFAULT_RATES, kills: int = 3, deadline: float = 60.0,
              roles: tuple[str, ...] = ("segment", "events")) -> int:
    """Run ``processes`` client processes (roles alternating), SIGKILL them at random up to
    ``kills`` times, restarting each killed one (a new life of the same client); return the kills."""
    rng = random.Random(seed)
    specs = {f"p{i}": roles[i % len(roles)] for i in range(processes)}

    def start(client: str) -> subprocess.Popen:
        return start_process(url, options, history_dir, specs[client], client, count, rng.randrange(10**9), rates)

    procs = {client: start(client) for client in specs}
    done_kills, stop_at = 0, time.monotonic() + deadline
    while procs:
        if time.monotonic() > stop_at:
            for proc in procs.values():
                proc.kill()
                proc.wait()
            raise AssertionError(f"client processes did not finish within {deadline} s: {sorted(procs)}")
        time.sleep(rng.uniform(0.05, 0.3))
        for client, proc in list(procs.items()):
            if proc.poll() is not None:
                _out, err = proc.communicate()
                if proc.returncode == -signal.SIGKILL:
                    procs[client] = start(client)
                    continue
                assert proc.returncode == 0, f"client {client} failed:\n{err[-3000:]}"
                del procs[client]
            elif done_kills < kills and rng.random() < 0.3:
                proc.kill()
                done_kills += 1
    return done_kills


def final_state(url: str, options: dict, streams: tuple[str, ...] = (STREAM,), segment: bool = True) -> dict:
    """What is stored, read with no faults: the segment's records and attributes, and the records
    of ``streams`` (offsets made unique per stream segment)."""
    records, attributes = [], {}
    with SegmentStore.open(url, storage_options=options, **STORE_OPTIONS) as store:
        if segment:
            seg = store.segment(SEGMENT)
            records = _all_records(seg)
            attributes = dict(zip(KEYS, seg.get_attributes(list(KEYS.values()))))
        number = 0
        for stream in streams:
            for name in store.stream_segments(stream):
                number += 1
                records += [[number << 40 | offset, value] for offset, value in _all_records(store.segment(name))]
    return {"records": records, "attributes": attributes}


def _all_records(seg) -> list[list]:
    out, offset = [], seg.start_offset
    while True:
        batch = seg.read(offset, 1000)
        if not batch:
            return out
        out += [[r.offset, r.value.decode()] for r in batch]
        offset = batch[-1].offset + 1


if __name__ == "__main__":
    role, url, options_json, history_dir, client, count, seed, rates_json = sys.argv[1:9]
    run = segment_client if role == "segment" else event_client
    run(url, json.loads(options_json), history_dir, client, int(count), int(seed), json.loads(rates_json))
