"""Switch markers (``NAME.seg/switch/<generation>``) are deleted once no view can need them.

A marker is the commit record of its replacement and the sign, for a view of the generation
below it, that something switched. Rolling segments delete old ones after a truncation or a
switch (storage_adapters/rolling_sweep.py); these tests check that their number stays bounded
through many rolls, switches and truncations, that stale handles still append and read right,
and that a failure or a SIGKILL in the middle of the cleanup leaves a readable segment.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest

from storage_adapters import open_storage
from storage_adapters.errors import StorageError
from storage_adapters.faults import FaultyStorage
from storage_adapters.rolling import SWITCH_DIR, RollingSegment

from .conftest import make_s3_url
from .framed import frame, open_segment, overhead

ROLL = 300
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def markers(storage, name="s") -> list[int]:
    return sorted(int(n.split("/")[1]) for n in storage.list_files(f"{name}.seg") if n.startswith(SWITCH_DIR + "/"))


def payload(i: int, size: int) -> bytes:
    return (b"%07d|" % i * (size // 8 + 1))[:size]


def piece(storage, position: int, size: int) -> bytes:
    """What is appended at ``position``: a payload of ``size`` bytes (one frame on local disk)."""
    return frame(storage, payload(position, size), position)


def check_against(storage, model: bytearray, name="s") -> RollingSegment:
    """A fresh handle reads every stored byte of the model (replacements here keep all bytes)."""
    fresh = open_segment(storage, name, rolling_size=ROLL)
    assert fresh.length == len(model) and not fresh.holes()
    start = fresh.start_offset
    assert fresh.read(start, len(model) - start) == bytes(model[start:])
    return fresh


def append_and_check(seg: RollingSegment, storage, model: bytearray) -> None:
    """One more append lands at the model's end, and a fresh handle reads the whole model."""
    data = piece(seg.storage, len(model), 100)
    assert seg.append(data) == len(model)
    model += data
    check_against(storage, model)


def cycle(seg: RollingSegment, model: bytearray, rng: random.Random, *, truncate: bool = True) -> None:
    """Roll at least once and switch; then keep about two chunks (``truncate``). Without
    truncation, consolidate every sealed chunk into one (each switch supersedes the one before)."""
    for _ in range(3):
        data = piece(seg.storage, len(model), rng.randrange(60, 160))
        assert seg.append(data) == len(model)
        model += data
    sealed = [c for c in seg.chunks()[:-1] if c.start >= seg.start_offset]
    if sealed:
        start = sealed[-1 if truncate else 0].start
        seg.replace_range(start, sealed[-1].end, bytes(model[start:sealed[-1].end]))
    if truncate and len(seg.chunks()) > 2:
        seg.truncate(seg.chunks()[-2].start + 1)


def _open(kind, tmp_path, s3_options=None, **options):
    if kind == "memory":
        return open_storage(f"memory://markers-{uuid.uuid4().hex}")
    if kind == "local":
        return open_storage(str(tmp_path / "store"))
    return open_storage(make_s3_url(s3_options), **s3_options, **options)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_markers_stay_bounded_through_rolls_switches_and_truncations(kind, tmp_path):
    storage = _open(kind, tmp_path)
    seg, model, rng = open_segment(storage, "s", rolling_size=ROLL), bytearray(), random.Random(5)
    counts = []
    for _ in range(40):
        cycle(seg, model, rng)
        counts.append(len(markers(storage)))
    assert seg._handle.view.layout.generation >= 33  # about one switch per cycle
    assert max(counts[10:]) <= 6, counts  # never deleted, they were one per switch
    assert markers(storage)[-1] == seg._handle.view.layout.generation  # the top one numbers the next switch
    fresh = check_against(storage, model)
    cycle(fresh, model, rng)  # a reopened handle switches and truncates on
    check_against(storage, model)


@pytest.mark.parametrize("grace", [0, 0.2])
def test_markers_stay_bounded_on_s3(s3_options, grace):
    # No grace: appends check the next marker after their create, the strictest case. With a
    # grace, truncated and replaced chunk names stay for it, and so do the markers they hold back.
    storage = _open("s3", None, s3_options, deletion_grace=grace)
    seg, model, rng = open_segment(storage, "s", rolling_size=ROLL), bytearray(), random.Random(6)
    for _ in range(18):
        cycle(seg, model, rng)
        time.sleep(grace / 4)
    assert seg._handle.view.layout.generation >= 14 and len(markers(storage)) <= 8, markers(storage)
    check_against(storage, model)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_markers_are_swept_by_switches_alone_once_old_chunks_are_replaced(kind, tmp_path):
    # A compacted log that is never truncated: the switches replace every plain chunk in turn.
    storage = _open(kind, tmp_path)
    seg, model, rng = open_segment(storage, "s", rolling_size=ROLL), bytearray(), random.Random(7)
    for _ in range(40):
        cycle(seg, model, rng, truncate=False)
    assert seg.start_offset == 0 and seg._handle.view.layout.generation >= 35
    assert len(markers(storage)) <= 6, markers(storage)
    check_against(storage, model)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_stale_appender_and_reader_survive_the_deletion_of_the_marker_they_would_check(kind, tmp_path):
    storage = _open(kind, tmp_path)
    model, rng = bytearray(), random.Random(8)
    stale = open_segment(storage, "s", rolling_size=ROLL)
    for _ in range(2):
        cycle(stale, model, rng)
    reader = open_segment(storage, "s", rolling_size=ROLL)
    generation = stale._handle.view.layout.generation
    busy = open_segment(storage, "s", rolling_size=ROLL)
    for _ in range(30):
        cycle(busy, model, rng)
    assert generation + 1 not in markers(storage)  # the sign the stale handles would look for
    assert reader.poll()
    reader.refresh()
    assert reader.read(reader.start_offset, 10) == bytes(model[reader.start_offset:reader.start_offset + 10])
    append_and_check(stale, storage, model)


@pytest.mark.parametrize("kind", ["memory", "local", "s3"])
def test_a_view_of_the_empty_segment_sees_the_switches_after_its_marker_was_deleted(kind, tmp_path, request):
    """A view listed while the segment was empty has no last chunk to find missing: its poll must
    still see that something was appended and switched, though ``switch/1`` is gone (a tail
    reader that opened an empty segment waited forever on that, beside consolidation). Its
    appends go on after the others' (S3 without a deletion grace: the strictest appends)."""
    s3_options = request.getfixturevalue("s3_options") if kind == "s3" else None
    storage = _open(kind, tmp_path, s3_options, deletion_grace=0) if kind == "s3" else _open(kind, tmp_path)
    empty_reader = open_segment(storage, "s", rolling_size=ROLL)
    empty_appender = open_segment(storage, "s", rolling_size=ROLL)
    assert empty_reader.length == 0 and not empty_reader.chunks()
    assert not empty_reader.poll()  # nothing yet: the listing of switch/ finds no marker either
    busy, model, rng = open_segment(storage, "s", rolling_size=ROLL), bytearray(), random.Random(10)
    for _ in range(20):
        cycle(busy, model, rng, truncate=kind == "s3")  # S3 without grace sweeps after truncations only
    assert 1 not in markers(storage) and markers(storage)[-1] > 1  # swept; the top one stays
    assert empty_reader.poll()
    empty_reader.refresh()
    start = empty_reader.start_offset
    assert empty_reader.read(start, len(model) - start) == bytes(model[start:])
    append_and_check(empty_appender, storage, model)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_failed_look_for_switches_from_an_empty_view_raises_and_the_next_poll_sees_them(kind, tmp_path):
    """The empty view's listing of the segment (or its marker check) fails: the poll raises a
    StorageError (a tail reader's read raises it), never answers "nothing new"; the next poll,
    with storage back, sees the switches."""
    inner = _open(kind, tmp_path)
    storage = FaultyStorage(inner, seed=13)
    empty_reader = open_segment(storage, "s", rolling_size=ROLL)
    busy, model, rng = open_segment(inner, "s", rolling_size=ROLL), bytearray(), random.Random(14)
    for _ in range(20):
        cycle(busy, model, rng, truncate=False)
    assert 1 not in markers(inner)
    for op, where in (("exists", SWITCH_DIR), ("list_files", None)):
        storage.script("fail_before", op=op, path_contains=where)
        with pytest.raises(StorageError):
            empty_reader.poll()
    assert storage.pending_scripts() == 0
    assert empty_reader.poll()
    empty_reader.refresh()
    assert empty_reader.read(0, len(model)) == bytes(model)


def test_a_tail_reader_of_an_empty_segment_follows_appends_and_consolidation(tmp_path):
    """The symptom: a reader opened on an empty segment, then another handle appends records
    across many small chunks and consolidates them (old switch markers deleted); the reader
    must get every record, in order, within a few polls."""
    from attrindex import SegmentStore

    url = str(tmp_path / "store")
    SegmentStore.open(url, log_rolling_size=256).segment("s", create=True)
    reader = SegmentStore.open(url, log_rolling_size=256).segment("s").reader(offset=0)
    assert reader.read_batch(timeout=0.05) == []
    writer = SegmentStore.open(url, log_rolling_size=256).segment("s")
    for i in range(200):
        writer.append([b"%d" % i])
        if i % 20 == 19:
            writer.consolidate(2048)
    assert 1 not in markers(writer._log.bytes.storage, "s/_log")  # the reader's sign is gone
    got, deadline = [], time.monotonic() + 10
    while len(got) < 200 and time.monotonic() < deadline:
        got += reader.read_batch(max_records=1000, timeout=0.5)
    assert [(r.offset, r.value) for r in got] == [(i, b"%d" % i) for i in range(200)]


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_stale_appender_whose_last_chunk_outlives_the_switches_after_it(kind, tmp_path):
    # The view's last chunk is sealed and kept (never truncated) while the chunks after it are
    # replaced again and again: a marker deleted then would let the stale handle create a plain
    # chunk inside a replacement (an acknowledged append nobody can read).
    storage = _open(kind, tmp_path)
    model, rng = bytearray(), random.Random(9)
    stale = open_segment(storage, "s", rolling_size=ROLL)
    while stale.length < ROLL:
        data = piece(storage, len(model), 100)
        stale.append(data)
        model += data
    busy = open_segment(storage, "s", rolling_size=ROLL)
    while len([c for c in busy.chunks() if c.start >= stale.length]) < 2:
        data = piece(storage, len(model), 100)
        busy.append(data)
        model += data
    after = [c for c in busy.chunks() if c.start >= stale.length]
    chunk = after[0]  # sealed: the first chunk after the stale view's last
    for _ in range(12):  # switch it again and again; each switch retires the one before
        busy.replace_range(chunk.start, chunk.end, bytes(model[chunk.start:chunk.end]))
        busy.truncate(0)  # a truncation step that moves nothing still sweeps
    append_and_check(stale, storage, model)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_failed_and_lost_deletes_during_the_sweep_leave_a_readable_segment(kind, tmp_path):
    inner = _open(kind, tmp_path)
    storage = FaultyStorage(inner, seed=11)
    seg, model, rng = open_segment(storage, "s", rolling_size=ROLL), bytearray(), random.Random(12)
    for round_ in range(40):
        # every other sweep fails before deleting, or deletes and loses its answer
        storage.script("fail_before" if round_ % 4 == 0 else "lost_ack", op="delete", times=1)
        cycle(seg, model, rng)
        check_against(inner, model)
    assert any(i.op == "delete" for i in storage.injected)
    storage.enabled = False
    for _ in range(10):
        cycle(seg, model, rng)
    assert len(markers(inner)) <= 6, markers(inner)
    check_against(inner, model)


class CrashingDeletes(FaultyStorage):
    """Every other delete of switch markers (with something else) removes only a random prefix of
    its paths, then fails: what a process killed between the unlinks (or the objects of one
    DeleteObjects) leaves behind."""

    def __init__(self, inner, *, seed: int):
        super().__init__(inner, seed=seed)
        self.sweeps, self.crashes = 0, 0

    def delete(self, paths):
        if len(paths) < 2 or not any(f"/{SWITCH_DIR}/" in p for p in paths):
            return self.inner.delete(paths)
        self.sweeps += 1
        if self.sweeps % 2:
            return self.inner.delete(paths)
        self.crashes += 1
        self.inner.delete(paths[:self._random.randrange(1, len(paths))])
        raise StorageError("injected: the process died between the deletes")


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_crash_between_the_deletes_leaves_a_readable_segment(kind, tmp_path):
    inner = _open(kind, tmp_path)
    storage = CrashingDeletes(inner, seed=15)
    model, rng = bytearray(), random.Random(16)
    for _ in range(12):  # a new handle after each crash: a restarted process knows nothing
        seg = open_segment(storage, "s", rolling_size=ROLL)
        crashes = storage.crashes
        while storage.crashes == crashes and len(model) < 200_000:
            cycle(seg, model, rng)
            check_against(inner, model)
    assert storage.crashes >= 10 and storage.sweeps >= 20
    seg = open_segment(inner, "s", rolling_size=ROLL)
    for _ in range(10):
        cycle(seg, model, rng)
    assert len(markers(inner)) <= 6, markers(inner)
    check_against(inner, model)


_CHILD = """
import random, sys
sys.path.insert(0, %r)
from storage_adapters import open_storage
from tests.framed import open_segment
from tests.test_switch_markers import ROLL, piece
storage = open_storage(sys.argv[1])
seg, rng = open_segment(storage, "s", rolling_size=ROLL), random.Random(int(sys.argv[2]))
while True:
    for _ in range(3):
        offset, size = seg.length, rng.randrange(60, 160)
        got = seg.append(piece(storage, offset, size), expected_offset=offset)
        print(got, size, flush=True)
    sealed = [c for c in seg.chunks()[:-1] if c.start >= seg.start_offset]
    if sealed:
        c = sealed[-1]
        seg.replace_range(c.start, c.end, seg.read(c.start, c.end - c.start))
    if len(seg.chunks()) > 2:
        seg.truncate(seg.chunks()[-2].start + 1)
""" % ROOT


def test_sigkill_during_switches_and_sweeps_on_local_disk(tmp_path):
    root = str(tmp_path / "store")
    acked: dict[int, int] = {}  # offset -> payload size
    rng = random.Random(13)
    for round_ in range(4):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, root, str(round_)], stdout=subprocess.PIPE, text=True)
        lines = 0
        deadline = time.monotonic() + 60
        target = rng.randrange(20, 120)
        while lines < target and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            offset, size = map(int, line.split())
            assert offset not in acked
            acked[offset] = size
            lines += 1
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        for line in child.stdout.read().splitlines():  # acknowledged before the kill landed
            offset, size = map(int, line.split())
            acked[offset] = size
        child.stdout.close()
        assert lines == target, f"round {round_}: the child stopped after {lines} appends ({child.returncode})"
        storage = open_storage(root)
        seg = open_segment(storage, "s", rolling_size=ROLL)
        for offset, size in acked.items():  # every acknowledged append above the start is there
            if offset >= seg.start_offset:
                expected = piece(storage, offset, size)
                assert seg.read(offset, len(expected)) == expected
        # at most the one append the kill cut off before its acknowledgement was printed
        end = max(o + len(piece(storage, o, s)) for o, s in acked.items())
        assert 0 <= seg.length - end < 160 + overhead(storage)
    model_rng = random.Random(14)
    model = bytearray(seg.read(seg.start_offset, seg.length - seg.start_offset))
    model[:0] = bytes(seg.start_offset)  # offsets below the start are never read
    for _ in range(10):
        cycle(seg, model, model_rng)
    assert len(markers(storage)) <= 6, markers(storage)
    check_against(storage, model)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_chunks_a_crash_left_below_the_truncation_are_deleted_by_a_later_truncation(kind, tmp_path):
    inner = _open(kind, tmp_path)
    storage = FaultyStorage(inner, seed=17)
    seg, model, rng = open_segment(storage, "s", rolling_size=ROLL), bytearray(), random.Random(18)
    for _ in range(6):
        cycle(seg, model, rng)
    storage.script("fail_before", op="delete", times=100)  # the process dies before deleting anything
    seg.truncate(seg.chunks()[-1].start)
    left = [n for n in inner.list_files("s.seg") if "/" not in n]
    storage.enabled = False
    fresh = open_segment(inner, "s", rolling_size=ROLL)  # a restarted process: the view skips them
    assert len(left) > len(fresh.chunks())
    fresh.truncate(fresh.start_offset + 1)
    kept = [n for n in inner.list_files("s.seg") if "/" not in n]
    assert sorted(kept) == sorted(c.name for c in fresh.chunks())
    check_against(inner, model)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_compacted_log_that_is_never_truncated_keeps_few_markers(kind, tmp_path):
    # The cleaner opens a log handle of its own per pass: the sweep's state is the process's.
    from attrindex import Record, SegmentStore

    url = f"memory://markers-{uuid.uuid4().hex}" if kind == "memory" else str(tmp_path / "store")
    with SegmentStore.open(url, log_rolling_size=ROLL) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        latest = {}
        for round_ in range(25):
            for i in range(6):
                key = b"k%d" % (i % 4)
                seg.append([Record(b"%d-%d" % (round_, i) + b"." * 60, key)], timestamp=1)
                latest[key] = b"%d-%d" % (round_, i) + b"." * 60
            seg.compact(min_lag_ms=0, now_ms=round_ + 10)
        switches = markers(store.storage, "s/_log")
        assert seg._log.bytes._handle.view.layout.generation >= 20  # about one switch per pass
        assert len(switches) <= 8, switches
        kept = {}
        offset = seg.start_offset
        while got := seg.read(offset, 1000):
            kept.update((r.key, r.value) for r in got)
            offset = got[-1].offset + 1
        assert kept == latest
    with SegmentStore.open(url, log_rolling_size=ROLL) as store:
        assert store.verify_segment("s").ok


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_segment_deleted_and_made_again_elsewhere_is_not_swept_by_the_old_horizon(kind, tmp_path):
    storage = _open(kind, tmp_path)
    seg, model, rng = open_segment(storage, "s", rolling_size=ROLL), bytearray(), random.Random(19)
    for _ in range(20):
        cycle(seg, model, rng)
    storage.remove_directory("s.seg")  # another process deletes the segment: this one's state is old
    seg, model = open_segment(storage, "s", rolling_size=ROLL), bytearray()
    stale = None
    for i in range(20):
        cycle(seg, model, rng)
        if i == 1:
            stale = open_segment(storage, "s", rolling_size=ROLL)  # a view of an early generation
        check_against(storage, model)
    append_and_check(stale, storage, model)
