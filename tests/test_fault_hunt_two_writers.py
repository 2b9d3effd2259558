"""Fault hunt: two writer processes on one ``AttributeIndex``, merges in their worker processes.

One ``update`` raised ``TruncatedError`` about once in 9 runs (the last session's note; no
traceback then). The path, captured here:

    update -> _write_group -> (lost the append race) _catch_up -> _replay_from_tree
           -> SegmentLog.batches -> RollingSegment.read -> TruncatedError

Writer B loses an append race and catches up. The WAL's start has moved past what B had replayed
(writer A merged and truncated), so B reads the tree's newest checkpoint C and rebuilds tier 1
from the WAL between C and its position. If A merges further and truncates the WAL past C again
in between, B's read finds C's chunk gone. Hunt bug 4's retry covered only the catch-up's scan,
not this rebuild. The rebuild now starts over from the newer tree version, which holds what was
cut (``BackgroundMerge._replay_from_tree``).

What that failure left behind was worse than the error: B's position had moved past the cut while
tier 1 kept values the tree had replaced, so B answered reads with them and its next merge wrote
them back over A's acknowledged updates. Any failure of the catch-up or the rebuild after such a
step (a storage error too) did the same. Tier 1 is now marked stale then (``_tier1_stale``):
rebuilt before any read, count or merge, which raise while it cannot be.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from attrindex import AttributeIndex
from attrindex.log import segment_log
from storage_adapters import open_storage

from . import history

ROOT = str(Path(__file__).resolve().parents[1])
N = 60
UPDATES = 1000  #: per writer process at most (they stop after 3 raced replays)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_an_update_whose_rebuild_meets_another_merge_and_truncation_goes_through(backend, tmp_path, monkeypatch):
    """The interleaving made deterministic: A's merge and WAL cut land between B's look at the
    tree (checkpoint C) and B's read of the WAL from C."""
    url = f"memory://hunt-two-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)
    options = dict(page_size=256, wal_rolling_size=200, merge_keys=10**6, merge_seconds=10**6)
    a = AttributeIndex(open_storage(url), **options)
    b = AttributeIndex(open_storage(url), **options)
    b.update({1000: 1})
    for i in range(N):
        a.update({i: i})
    a.flush()  # tree checkpoint C; the WAL below C's chunk is cut, past B's view
    for i in range(N):
        a.update({i: 100 + i})  # more WAL chunks after C
    real = segment_log.SegmentLog.batches
    raced = []

    def batches(self, start, end, *args, **kwargs):
        if self is b._log and not raced:  # B's rebuild, about to read the WAL from C
            raced.append(start)
            a.flush()  # A merges past C and cuts the WAL past it
        return real(self, start, end, *args, **kwargs)

    monkeypatch.setattr(segment_log.SegmentLog, "batches", batches)
    b.update({1001: 2})  # was: TruncatedError (nothing written)
    assert raced and a.checkpoint > raced[0]
    assert b.get_many([0, N - 1, 1000, 1001]) == [100, 100 + N - 1, 1, 2]
    monkeypatch.setattr(segment_log.SegmentLog, "batches", real)
    fresh = AttributeIndex(open_storage(url), page_size=256)
    assert fresh.get_many([0, N - 1, 1000, 1001]) == [100, 100 + N - 1, 1, 2]
    for index in (fresh, a, b):
        index.close()



def _behind_a_merged_and_cut_wal(url: str, storage):
    """Handles A and B (B on ``storage``): B set key 7 to 0, then A set it to 1, merged and cut the
    WAL past B's view, and wrote more. B's next catch-up steps over the cut and must rebuild tier 1
    from the tree (where 7 is 1): tier 1 still says 0."""
    options = dict(page_size=256, wal_rolling_size=200, merge_keys=10**6, merge_seconds=10**6)
    a = AttributeIndex(open_storage(url), **options)
    b = AttributeIndex(storage, **options)
    b.update({7: 0})
    a.update({7: 1})
    for i in range(N):
        a.update({100 + i: i})
    a.flush()
    for i in range(N):
        a.update({100 + i: 1000 + i})
    return a, b


@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize("fails", ["scan", "rebuild"])
def test_a_failed_catch_up_never_serves_or_merges_stale_values(backend, fails, tmp_path, monkeypatch):
    """B's catch-up fails after stepping over A's WAL cut: in its scan of the tail (a storage read
    error after the restart at the new start) or in the rebuild of tier 1 from the tree (twice:
    the update's and the next read's). Its update fails cleanly. Before, B's position had moved
    on while tier 1 kept 7 = 0: reads answered 0, and B's next merge wrote 0 into the tree over
    A's acknowledged 1 (lost for every handle). Now tier 1 is marked stale: reads rebuild it
    first (raising while they cannot) and nothing stale is merged."""
    from attrindex.errors import StorageError
    from storage_adapters.faults import FaultyStorage

    url = f"memory://hunt-stale-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)
    faulty = FaultyStorage(open_storage(url), seed=1)
    a, b = _behind_a_merged_and_cut_wal(url, faulty)
    rebuild_failures = []
    if fails == "scan":  # the scan after the restart at the new start (not the storage's look at its end)
        real_scan = segment_log.SegmentLog._scan_chunk
        scan_failures = []

        def scan_chunk(self, *args, **kwargs):
            if self is b._log and self.resyncs and not scan_failures:
                scan_failures.append(True)
                raise StorageError("injected: reading the WAL's tail failed")
            return real_scan(self, *args, **kwargs)

        monkeypatch.setattr(segment_log.SegmentLog, "_scan_chunk", scan_chunk)
    else:
        real = segment_log.SegmentLog.batches

        def batches(self, start, end, *args, **kwargs):
            if self is b._log and len(rebuild_failures) < 2:
                rebuild_failures.append(start)
                raise StorageError("injected: reading the WAL failed")
            return real(self, start, end, *args, **kwargs)

        monkeypatch.setattr(segment_log.SegmentLog, "batches", batches)
    with pytest.raises(StorageError):
        b.update({1001: 2})  # definite: nothing written
    assert faulty.pending_scripts() == 0
    if fails == "scan":
        assert scan_failures == [True]
    if fails == "rebuild":
        with pytest.raises(StorageError):
            b.get(7)  # the rebuild fails again: an error, never the stale 0
        assert len(rebuild_failures) == 2
    assert b.get(7) == 1 and b.get_many([7, 100, 1001]) == [1, 1000, None]
    assert len(b) == N + 1  # 7 and A's N keys
    b.update({1002: 3})
    b.flush()  # merges tier 1 as rebuilt, not the stale one
    fresh = AttributeIndex(open_storage(url), page_size=256)
    assert fresh.get_many([7, 100, 1001, 1002]) == [1, 1000, None, 3]
    for index in (fresh, a, b):
        index.close()


@pytest.mark.parametrize("where", ["scan", "rebuild"])
def test_catch_ups_that_keep_meeting_truncations_end_in_a_clear_error(where, monkeypatch):
    """Every loop is bounded: a catch-up whose scan, or whose rebuild, meets a fresh truncation
    every time gives up with a ``StorageError`` that says so (nothing written), not with the raw
    ``TruncatedError``; the handle works again once the truncations stop."""
    from attrindex import attribute_state
    from attrindex.errors import StorageError, TruncatedError

    url = f"memory://hunt-bound-{uuid.uuid4().hex}"
    a, b = _behind_a_merged_and_cut_wal(url, open_storage(url))
    calls = []

    def truncated(*_args, **_kwargs):
        calls.append(1)
        raise TruncatedError("attributes/_wal/_log", 0, 1, 1, 2)

    if where == "scan":
        monkeypatch.setattr(segment_log.SegmentLog, "catch_up", truncated)
        message = "kept truncating the log while this handle read its tail"
    else:
        monkeypatch.setattr(attribute_state.AttributeState, "_replayed_from_newest_tree", truncated)
        message = "kept merging and truncating the log while this handle rebuilt"
    with pytest.raises(StorageError, match=message) as raised:
        b.update({1001: 2})
    assert type(raised.value) is StorageError and len(calls) == 10
    monkeypatch.undo()
    assert b.get_many([7, 100, 1001]) == [1, 1000, None]
    b.update({1001: 2})
    assert b.get(1001) == 2
    for index in (a, b):
        index.close()

# A writer process. Every merge runs in its worker process (MIN_WORKER_KEYS = 1) and truncates
# the WAL. Every other WAL replay of an update's rebuild (in the main thread: the merge thread's
# failures are retried, never an update's) is held, as a descheduled process would be, until the
# chunk where the replay starts is deleted (at most HOLD seconds): the other writer's merge and
# truncation then land inside the window, which free runs hit rarely (about 1 run in 9 in the last
# session's harness; 0 in 34 free runs of 8 s of two or three writers here). A retried replay is not
# held.
_WRITER = """
import glob, sys, threading, time
from attrindex import merge_runner
from attrindex.attribute_index import AttributeIndex
from attrindex.log import segment_log
from storage_adapters.rolling import SEGMENT_SUFFIX
from tests.history import Recorder

merge_runner.MIN_WORKER_KEYS = 1
path, client, updates, races_wanted = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
HOLD = 2.0
real, calls, raced = segment_log.SegmentLog.batches, [0], [0]

def batches(self, start, end, *args, **kwargs):
    if threading.current_thread() is threading.main_thread():  # an update's rebuild, not the merge thread's
        calls[0] += 1
    if threading.current_thread() is threading.main_thread() and calls[0] % 2:
        chunk = self.bytes.chunk_at(start)  # in this handle's view: the chunk the replay reads first
        target = f"{self.bytes.name}{SEGMENT_SUFFIX}/{chunk.name}"
        deadline = time.monotonic() + HOLD
        while time.monotonic() < deadline:
            if not self.bytes.storage.exists(target):  # deleted by the other writer's truncation
                raced[0] += 1
                break
            time.sleep(0.002)
    return real(self, start, end, *args, **kwargs)

segment_log.SegmentLog.batches = batches
index = AttributeIndex.open(path, page_size=1024, merge_keys=100, wal_rolling_size=1024)
logs = sys.argv[5]
recorder = Recorder(f"{logs}/{client}.jsonl", client)
mine = int(client[1:])
open(f"{logs}/ready-{client}", "w").close()
deadline = time.monotonic() + 120
while len(glob.glob(f"{logs}/ready-*")) < 2 and time.monotonic() < deadline:  # both write at once
    time.sleep(0.005)
for n in range(updates):
    if raced[0] >= races_wanted or glob.glob(f"{logs}/done-*"):  # never write alone
        break
    marker = (1 << 100) | (mine << 40) | n
    batch = {(mine * 100_000 + (n * 37 + j) % 3000).to_bytes(16, "big"): n for j in range(100)}
    batch[marker.to_bytes(16, "big")] = n
    # This client's sequence keys, one per 100 updates (the checker walks each chain recursively):
    # a duplicate of an older update landing after a newer one would break its chain.
    batch[(1 << 120 | mine << 16 | n // 100).to_bytes(16, "big")] = n
    cas = [f"seq-{client}-{n // 100}", n - 1 if n % 100 else None, n]
    with recorder.operation("append", payloads=[f"{marker:x}"], cas=cas):
        index.update(batch)
open(f"{logs}/done-{client}", "w").close()
recorder.close()
index.close()
print("raced", raced[0], flush=True)
"""


#: Runs of the two writers until one meets the race: a run ends when either writer has made
#: ``UPDATES`` updates. With ``HOLD`` 2 s, 0 of 6 runs ended without a raced replay on a quiet
#: machine and 2 of 6 beside two busy processes (with 1 s: 1 of 8, and a whole test of 4 runs
#: failed in a full suite on two workers); 10 runs leave a failure of about 0.33**10.
RACE_ATTEMPTS = 10


def test_two_writer_processes_with_worker_merges_never_fail_an_update(tmp_path):
    """Every run is checked in full; the test needs one run (of ``RACE_ATTEMPTS``) that raced."""
    raced = 0
    for attempt in range(RACE_ATTEMPTS):
        raced = _run_two_writers(tmp_path / f"run-{attempt}")
        if raced:
            break
    assert raced, f"no replay met a truncation in {RACE_ATTEMPTS} runs: the race was not exercised"


def _run_two_writers(base: Path) -> int:
    """Two writer processes on one index until they raced 3 times or one made ``UPDATES``
    updates; assert that no update failed or was lost; return how many replays raced."""
    path, logs = str(base / "index"), base / "history"
    logs.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    clients = ["w1", "w2"]
    children = [subprocess.Popen([sys.executable, "-c", _WRITER, path, c, str(UPDATES), "3", str(logs)], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for c in clients]
    try:
        outputs = [child.communicate(timeout=240) for child in children]
    finally:
        for child in children:  # (a child stuck past the bound: never left running)
            if child.poll() is None:
                child.kill()
                child.wait(60)
    for child, (out, err) in zip(children, outputs):
        assert child.returncode == 0, err[-3000:]
    raced = sum(int(out.split()[-1]) for out, _err in outputs)
    events = history.load_history(str(logs))
    ops = history.merge_ops(events)
    failed = [(op.id, op.status) for op in ops if op.status != history.OK]
    assert not failed, [e.get("error") for e in events if e.get("status") not in (None, history.OK)][:3]
    with AttributeIndex.open(path, page_size=1024) as index:
        markers = {int(op.fields["payloads"][0], 16) for op in ops}
        present = [m for m, v in zip(sorted(markers), index.get_many(sorted(markers))) if v is not None]
        final = {"records": [[i, f"{m:x}"] for i, m in enumerate(present)],
                 "attributes": {f"seq-{c}-{g}": index.get(1 << 120 | int(c[1:]) << 16 | g)
                                for c in clients for g in range(UPDATES // 100 + 1)}}
        report = index.verify()
    result = history.check(events, final)
    result.assert_valid()  # every acknowledged update present; each client's sequence one chain
    assert result.ok == len(ops) and report.ok, report.damage
    return raced
