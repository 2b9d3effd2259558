"""Chaos: writer processes on one stream, killed at random, with dropped acknowledgements.

Afterwards every (writer, event number) is in the stream exactly once and none is missing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from attrindex import SegmentStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(url, options, writer, total, seed, progress):
    if os.path.exists(progress):
        os.unlink(progress)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workers", "chaos_writer", url, json.dumps(options), "chaos", str(writer),
         str(total), "0.05", str(seed), progress],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _lost_acks_seen(out: str) -> int:
    """The acknowledgements a killed writer's life had lost by its last flush (its ``n lost_acks``
    lines; a kill may cut the last one short)."""
    counts = [line.split() for line in out.splitlines()]
    return max((int(c[1]) for c in counts if len(c) == 2 and all(x.isdigit() for x in c)), default=0)


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
def test_writers_killed_at_random_write_every_event_exactly_once(storage_url, tmp_path):
    url, options = storage_url
    # A writer is killed only once it has flushed events: a kill while Python is still starting
    # (a loaded machine) would leave nothing to resume and prove nothing.
    progress = {w: str(tmp_path / f"progress-{w}") for w in range(3)}
    # Long enough to be killed mid-write a few times: a writer is killed within a second or two of
    # its first flush (the loop below), and writes 3,000 events on local disk for several seconds.
    writers, total = 3, (150 if "s3" in url else 3000)
    with SegmentStore.open(url, storage_options=options) as store:
        store.create_stream("chaos", 3)
    rng = random.Random(11)
    procs = {w: start(url, options, w, total, rng.randrange(10**6), progress[w]) for w in range(writers)}
    kills = skipped = lost_acks = 0
    deadline = time.monotonic() + 240
    while procs:
        assert time.monotonic() < deadline, "chaos writers did not finish in time"
        time.sleep(rng.uniform(0.05, 0.4))
        for w, proc in list(procs.items()):
            if proc.poll() is not None:
                out, err = proc.communicate()
                if proc.returncode == 0:
                    assert "done" in out, err
                    _, events_skipped, acks, _failed = out.strip().splitlines()[-1].split()
                    skipped, lost_acks = skipped + int(events_skipped), lost_acks + int(acks)
                    del procs[w]
                    continue
                assert proc.returncode == -signal.SIGKILL, f"writer {w} failed:\n{err}"
                lost_acks += _lost_acks_seen(out)
                procs[w] = start(url, options, w, total, rng.randrange(10**6), progress[w])
            elif kills < 8 and os.path.exists(progress[w]) and rng.random() < 0.4:
                proc.kill()  # mid-write, whatever it was doing
                kills += 1
    # restarts replayed, and acknowledgements were lost (the first write of every life loses its
    # own: a killed life had flushed before its kill, so this does not rest on the dice)
    assert kills >= 3 and skipped > 0 and lost_acks > 0
    seen: dict[tuple[int, int], int] = {}
    with SegmentStore.open(url, storage_options=options) as store:
        for name in store.stream_segments("chaos"):
            seg = store.segment(name)
            for record in seg.read(0, 1_000_000):
                writer, number = map(int, record.value.split(b":"))
                seen[(writer, number)] = seen.get((writer, number), 0) + 1
    duplicates = {k: v for k, v in seen.items() if v > 1}
    missing = [(w, n) for w in range(writers) for n in range(1, total + 1) if (w, n) not in seen]
    assert not duplicates and not missing
