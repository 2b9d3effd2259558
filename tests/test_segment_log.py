"""The segment log: recovery (Kafka's tests), index rebuilds, retention and readers (Tkrzw's tests)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

from attrindex import Record, SegmentStore
from attrindex.errors import CorruptDataError, RecordTruncatedError
from attrindex.log.batch.chain import iter_batches
from attrindex.log.framing import LOG_FRAMING
from attrindex.log.sparse_index import decode_chunk_index

SMALL = {"log_rolling_size": 2048, "index_interval_bytes": 256}


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def chunk_files(root, name="s"):
    directory = os.path.join(root, name, "_log.seg")
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.isdigit())


def index_files(root, name="s"):
    directory = os.path.join(root, name, "_index")
    return sorted(os.path.join(directory, f) for f in os.listdir(directory)) if os.path.isdir(directory) else []


# -- recovery --------------------------------------------------------------------------------------
@pytest.mark.parametrize("run", range(10))
def test_garbage_below_the_committed_length_is_corruption_until_repaired(tmp_path, run):
    """Kafka's testRecoveryWithCorruptMessage under the commit protocol: committed bytes are never
    a torn tail. Garbage from a random batch to the end is CorruptDataError on open naming the
    byte; an explicit repair cuts there, says which offsets are lost, and appends resume above
    every offset the garbage could have held (none is reused); reads step over the gap."""
    rng = random.Random(run)
    root = str(tmp_path / "store")
    with SegmentStore.open(root) as store:
        seg = store.segment("s", create=True)
        for i in range(100):
            seg.append([b"record-%d" % i], [(key(i), i)], timestamp=i)
    (chunk,) = chunk_files(root)
    data = open(chunk, "rb").read()
    data = data[:LOG_FRAMING.chain_end(data, 0)]  # the frames (zeros follow them in the file)
    positions = [pos for pos, _header in iter_batches(data)]  # the first chunk starts at log byte 0
    assert len(positions) == 100
    cut = rng.randrange(100)
    with open(chunk, "r+b") as f:  # garbage no crash leaves: damage, not a torn write
        f.seek(positions[cut])
        f.write(rng.randbytes(len(data) - positions[cut]))
    with SegmentStore.open(root) as store:
        with pytest.raises(CorruptDataError) as caught:
            store.segment("s")
        assert caught.value.offset == positions[cut] and "00000000000000000000" in str(caught.value)
        report = store.verify_segment("s")
        assert not report.ok and report.damage[0].start == positions[cut] and report.batches == cut
        repair = store.repair_segment("s")
        assert (repair.cut_at, repair.first_lost_offset) == (positions[cut], cut)
        assert repair.resume_offset >= 100 and [r.start for r in repair.lost_offsets] == [cut]
        resume = repair.resume_offset
        seg = store.segment("s")
        assert [r.offset for r in seg.read(0, 1000)] == list(range(cut))
        assert seg.next_offset == resume
        assert seg.append([b"after"], timestamp=500).first_offset == resume
        assert seg.append([b"after-2"], timestamp=501).first_offset == resume + 1
        assert store.verify_segment("s").ok
    with SegmentStore.open(root) as store:
        seg = store.segment("s")
        records = seg.read(0, 1000)
        assert [r.offset for r in records] == list(range(cut)) + [resume, resume + 1]  # the read crosses the gap
        assert [r.value for r in records[cut:]] == [b"after", b"after-2"]
        assert seg.read(cut, 1)[0].value == b"after"  # reading from a lost offset gives the next record
        assert seg.offset_for_timestamp(500) == resume
        assert seg.get_attributes([key(i) for i in range(100)]) == [i if i < cut else None for i in range(100)]


def test_garbage_inside_the_log_is_an_error_naming_its_place(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root, **SMALL) as store:
        seg = store.segment("s", create=True)
        for i in range(100):
            seg.append([b"x" * 100])
    first = chunk_files(root)[0]
    data = bytearray(open(first, "rb").read())
    positions = [pos for pos, _header in iter_batches(bytes(data[:LOG_FRAMING.chain_end(bytes(data), 0)]))]  # the first chunk: log byte 0
    data[positions[2] + 60] ^= 0xFF  # inside the payload of the third batch
    open(first, "wb").write(data)
    with SegmentStore.open(root, **SMALL) as store:
        seg = store.segment("s")
        with pytest.raises(CorruptDataError) as caught:
            seg.read(0, 1000)
        assert caught.value.offset == positions[2]


def test_a_corrupt_or_missing_index_is_rebuilt(tmp_path):
    """Kafka's testRecoveryFixesCorruptIndex / testIndexRebuild, for offset and time lookups."""
    root = str(tmp_path / "store")
    with SegmentStore.open(root, **SMALL) as store:
        seg = store.segment("s", create=True)
        for i in range(300):
            seg.append([b"v%03d" % i + b"." * 90], timestamp=1000 + 10 * i)
    indexes = index_files(root)
    assert len(indexes) >= 5
    open(indexes[1], "r+b").write(b"garbage!")
    os.remove(indexes[3])
    with open(indexes[2], "ab") as f:
        f.write(b"\0")
    with SegmentStore.open(root, **SMALL) as store:
        seg = store.segment("s")
        for offset in range(0, 300, 7):
            assert seg.read(offset, 1)[0].value.startswith(b"v%03d" % offset)
        for ts in (999, 1000, 1005, 1500, 2000, 3990, 3991):
            expected = next((i for i in range(300) if 1000 + 10 * i >= ts), None)
            assert seg.offset_for_timestamp(ts) == expected
    rebuilt = index_files(root)
    assert rebuilt == indexes
    for path in rebuilt:  # every index file is valid again
        start = int(os.path.basename(path))
        decode_chunk_index(open(path, "rb").read(), chunk_start=start)


# -- reads ---------------------------------------------------------------------------------------
def test_reads_across_chunks_and_at_the_edges(tmp_path):
    with SegmentStore.open(str(tmp_path / "store"), **SMALL) as store:
        seg = store.segment("s", create=True)
        for i in range(0, 500, 5):
            seg.append([b"%d" % j for j in range(i, i + 5)])
        assert len(chunk_files(str(tmp_path / "store"))) > 3
        for offset in (0, 1, 4, 5, 123, 499):
            assert [r.offset for r in seg.read(offset, 3)] == list(range(offset, min(offset + 3, 500)))
        assert [int(r.value) for r in seg.read(0, 1000)] == list(range(500))
        assert seg.read(500) == [] and seg.read(10_000) == []


# -- retention -------------------------------------------------------------------------------------
def fill(seg, count, *, start_ts=0):
    for i in range(count):
        seg.append([b"r" * 100], timestamp=start_ts + i)


def test_retention_by_age_keeps_the_newest_chunk(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root, **SMALL) as store:
        seg = store.segment("s", create=True)
        fill(seg, 100)
        chunks = len(chunk_files(root))
        newest = chunk_files(root)[-1]
        assert seg.apply_retention(max_age_ms=1000, now_ms=50) == 0  # nothing is that old
        assert seg.apply_retention(max_age_ms=0, now_ms=10**12) == chunks - 1
        assert chunk_files(root) == [newest]
        remaining = seg.read(seg.start_offset, 1000)
        assert remaining[-1].offset == 99 and remaining[0].offset == seg.start_offset > 0
        assert seg.append([b"more"]).first_offset == 100


def test_retention_by_age_stops_at_the_first_young_chunk(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root, **SMALL) as store:
        seg = store.segment("s", create=True)
        fill(seg, 100)
        summaries = seg._log.chunk_summaries()
        threshold = summaries[2].max_timestamp  # chunks 0 and 1 are older, 2 is not
        deleted = seg.apply_retention(max_age_ms=100, now_ms=threshold + 100)
        assert deleted == 2
        assert seg.start_offset == summaries[2].base_offset


def test_retention_by_size_and_by_start_offset(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root, **SMALL) as store:
        seg = store.segment("s", create=True)
        fill(seg, 100)
        total = seg.stats().log_bytes
        seg.apply_retention(max_bytes=total // 2)
        assert total // 2 <= seg.stats().log_bytes < total // 2 + SMALL["log_rolling_size"] + 200
        start = seg.start_offset
        seg.apply_retention(start_offset=start + 3)  # inside a chunk: the batch holding it
        assert seg.start_offset == start + 3
        with pytest.raises(RecordTruncatedError):
            seg.read(start + 2)
        assert seg.read(start + 3, 1)[0].offset == start + 3
        seg.apply_retention(start_offset=100)
        assert seg.start_offset == 100 and seg.read(100) == []
        assert len(chunk_files(root)) == 1
    with SegmentStore.open(root, **SMALL) as store:
        seg = store.segment("s")
        assert (seg.start_offset, seg.next_offset) == (100, 100)


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_retention_elsewhere_inside_the_chunk_this_handle_stood_in(storage_url):
    """Another handle appends to the chunk this handle was scanning and cuts inside it, past this
    handle's position (retention by start offset: the batch holding it). This handle's catch-up
    restarts at the new start: it reads, looks up offsets and times, and appends on, with the
    sparse index of that chunk right (not the one it had built up to its old position)."""
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, **SMALL) as mine, \
            SegmentStore.open(url, storage_options=options, **SMALL) as theirs:
        seg = mine.segment("s", create=True)
        for i in range(2):
            seg.append([Record(b"r%d" % i, key(i))], timestamp=1000 + i)
        other = theirs.segment("s")
        for i in range(2, 6):
            other.append([Record(b"r%d" % i, key(i))], timestamp=1000 + i)
        other.apply_retention(start_offset=4)
        seg.refresh()
        assert (seg.start_offset, seg.next_offset) == (4, 6)
        seg.append([Record(b"r6", key(6))], timestamp=1006)
        assert [r.value for r in seg.read(4, 10)] == [b"r4", b"r5", b"r6"]
        assert seg.read(5, 1)[0].offset == 5 and seg.offset_for_timestamp(1005) == 5
        other.refresh()
        assert [r.value for r in other.read(4, 10)] == [b"r4", b"r5", b"r6"]


def test_retention_never_loses_attribute_updates(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root, flush_keys=10**9, **SMALL) as store:
        seg = store.segment("s", create=True)
        for i in range(60):
            seg.append([b"r" * 100], [(key(i), i)], timestamp=i)
        assert seg.stats().pending_attributes == 60
        seg.apply_retention(max_age_ms=0, now_ms=10**12)
        assert seg.stats().pending_attributes == 0  # merged into the B+tree before deleting
        assert seg.get_attributes([key(i) for i in range(60)]) == list(range(60))
    with SegmentStore.open(root, **SMALL) as store:
        assert store.segment("s").get_attributes([key(i) for i in range(60)]) == list(range(60))


# -- readers -------------------------------------------------------------------------------------
def test_reader_start_points_by_timestamp(tmp_path):
    """Tkrzw's reader start points: the first record at or after the timestamp, whole chunks skipped."""
    with SegmentStore.open(str(tmp_path / "store"), **SMALL) as store:
        seg = store.segment("s", create=True)
        for i in range(200):
            seg.append([b"%d" % i], timestamp=10 * i)
        for ts, expected in ((0, 0), (1, 1), (10, 1), (11, 2), (995, 100), (1990, 199)):
            assert seg.reader(timestamp=ts).read(timeout=0).offset == expected
        assert seg.reader(timestamp=1991).read(timeout=0) is None
        assert seg.offset_for_timestamp(1991) is None


def test_timestamps_out_of_order(tmp_path):
    """Timestamps need not grow: lookups find the first record at or after the time (Kafka's rule)."""
    rng = random.Random(7)
    stamps = [rng.randrange(10_000) for _ in range(400)]
    with SegmentStore.open(str(tmp_path / "store"), **SMALL) as store:
        seg = store.segment("s", create=True)
        for i in range(0, 400, 4):
            seg.append([Record(b"%d" % j, timestamp=stamps[j]) for j in range(i, i + 4)])
        for ts in [0, 1, 5000, 9999, 10_000] + rng.sample(range(10_000), 30):
            expected = next((i for i, s in enumerate(stamps) if s >= ts), None)
            assert seg.offset_for_timestamp(ts) == expected


def test_reader_times_out_and_cancel_wakes_it(tmp_path):
    with SegmentStore.open(str(tmp_path / "store")) as store:
        seg = store.segment("s", create=True)
        reader = seg.reader()
        started = time.monotonic()
        assert reader.read(timeout=0.2) is None
        assert 0.15 < time.monotonic() - started < 30  # waited its timeout, and returned
        results = []
        thread = threading.Thread(target=lambda: results.append(reader.read()))
        thread.start()
        time.sleep(0.2)
        reader.cancel()
        thread.join(timeout=5)
        assert not thread.is_alive() and results == [None]


def test_parallel_readers_each_see_every_record_in_order(tmp_path):
    """Tkrzw's Parallel test: 10 readers each receive all records, in order, while they are written."""
    with SegmentStore.open(str(tmp_path / "store"), **SMALL) as store:
        seg = store.segment("s", create=True)
        got: list[list[int]] = [[] for _ in range(10)]

        def follow(i: int) -> None:
            reader = seg.reader(offset=0)
            while len(got[i]) < 1000:
                record = reader.read(timeout=10)
                assert record is not None
                got[i].append(int(record.value))

        threads = [threading.Thread(target=follow, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for i in range(0, 1000, 10):
            seg.append([b"%d" % j for j in range(i, i + 10)])
        for t in threads:
            t.join(timeout=60)
        assert all(g == list(range(1000)) for g in got)


def test_reader_sees_records_appended_by_another_process(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root, poll_interval=0.02) as store:
        seg = store.segment("s", create=True)
        reader = seg.reader(offset=0)
        child = subprocess.Popen([sys.executable, "-m", "tests.workers", "segment_append", root, "s", "300"],
                                 cwd=os.path.dirname(os.path.dirname(__file__)))
        values = []
        while len(values) < 300:
            record = reader.read(timeout=30)
            assert record is not None, f"reader stalled after {len(values)} records"
            values.append(record.value)
        assert child.wait(timeout=30) == 0
        assert values == [b"p%d" % i for i in range(300)]


def test_start_offset_inside_a_chunk_of_big_batches(tmp_path):
    """Finding a chunk's or a truncation point's record offset needs only the batch header, however
    big the batch (batches of 10 KB here, beyond any fixed read size)."""
    root = str(tmp_path / "store")
    with SegmentStore.open(root, log_rolling_size=1 << 20) as store:
        seg = store.segment("s", create=True)
        for i in range(20):
            seg.append([b"%02d" % i + b"." * 10_000] * 2)
        seg.apply_retention(start_offset=13)
        assert seg.start_offset == 12  # the batch holding offset 13 starts at 12
    with SegmentStore.open(root, log_rolling_size=1 << 20) as store:
        seg = store.segment("s")
        assert (seg.start_offset, seg.next_offset) == (12, 40)
        assert [r.offset for r in seg.read(12, 100)] == list(range(12, 40))
