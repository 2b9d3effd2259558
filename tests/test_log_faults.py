"""Faults in a segment's log and attributes: committed data is never a torn tail, damage is reported
by position until an explicit repair, no acknowledged offset is ever reused, and work after the
durable point of an append never fails it."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

from attrindex import SegmentStore
from attrindex.conditional import AttributeUpdate, UpdateType
from attrindex.errors import CorruptDataError
from attrindex.log.batch.chain import iter_batches
from attrindex.log.batch.header import BATCH_HEADER_SIZE
from tests.raw_chunks import committed, committed_chunks, committed_length

SMALL = {"log_rolling_size": 2048, "index_interval_bytes": 256}
COUNTER = (1).to_bytes(16, "big")


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def files(root: str, name: str, part: str) -> list[str]:
    directory = os.path.join(root, name, part)
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.isdigit())


def start_of(chunk: str) -> int:
    """The log byte position a chunk starts at (its name, or a path to it): what its batches are
    sealed for."""
    return int(os.path.basename(chunk)[:20])


def flip(path: str, at: int, bit: int = 0x10) -> None:
    with open(path, "r+b") as f:  # in place: the chunk's length is unchanged
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ bit]))


def increment(seg, i: int):
    return seg.append([b"rec-%d" % i], [AttributeUpdate(COUNTER, UpdateType.ACCUMULATE, value=1)], timestamp=i)


def fill_counter(root: str, count: int = 100, **options) -> None:
    with SegmentStore.open(root, **options) as store:
        seg = store.segment("s", create=True)
        for i in range(count):
            increment(seg, i)


# -- committed data is never a torn tail -----------------------------------------------------------
def test_a_bit_flip_in_the_middle_of_the_last_chunk_is_corruption_not_a_torn_tail(tmp_path):
    """Not cut as a torn tail: that would roll the counter back to about half and let the next
    append reuse the offsets of the lost records."""
    root = str(tmp_path / "store")
    fill_counter(root)
    last = files(root, "s", "_log.seg")[-1]
    flip(last, committed_length(last) // 2)
    with SegmentStore.open(root) as store:
        with pytest.raises(CorruptDataError) as caught:
            store.segment("s")
        message = str(caught.value)
        assert "segment 's'" in message and "chunk 00000000000000000000" in message
        assert caught.value.offset is not None and f"log byte {caught.value.offset}" in message
        with pytest.raises(CorruptDataError):  # it stays refused: no append can reuse an offset
            store.segment("s")


def test_damage_at_the_very_end_of_the_last_chunk_once_merged_is_corruption_on_open_and_on_read(tmp_path):
    """The newest batch of the last chunk damaged after the attributes merged it: the log alone
    would take it for a torn write, but the attributes prove it was committed, so opening refuses
    and a handle that had read it as committed reports it."""
    root = str(tmp_path / "store")
    fill_counter(root, 30, **SMALL)  # closed: the attributes cover every batch
    with SegmentStore.open(root, **SMALL) as store:
        reader = store.segment("s")  # opened before the damage: its reads still verify
        last = files(root, "s", "_log.seg")[-1]
        data = committed(last)
        final = [pos for pos, _header in iter_batches(data, position=start_of(last))][-1]
        flip(last, len(data) - 1)  # the last byte of the last batch's payload
        chunk_start = int(os.path.basename(last))
        with pytest.raises(CorruptDataError) as caught:
            reader.read(0, 1000)
        assert caught.value.offset == chunk_start + final
    with SegmentStore.open(root, **SMALL) as store:
        with pytest.raises(CorruptDataError, match=f"beyond the log's committed length {chunk_start + final}"):
            store.segment("s")
        assert not store.verify_segment("s").ok


def _with_an_unmerged_newest_batch(tmp_path) -> tuple[str, str, bytes, int]:
    """A counter segment of 30 increments and then a record no merge covers: ``(root, the last
    chunk's path, its committed bytes, where its newest batch starts in them)``."""
    root = str(tmp_path / "store")
    fill_counter(root, 30, **SMALL)
    with SegmentStore.open(root, **SMALL) as store:
        store.segment("s").append([b"plain-30"], timestamp=30)  # no attribute update: nothing merges it
    last = files(root, "s", "_log.seg")[-1]
    data = committed(last)
    return root, last, data, [pos for pos, _header in iter_batches(data, position=start_of(last))][-1]


def test_damage_to_the_newest_unmerged_batch_is_cut_as_a_torn_write(tmp_path, caplog):
    """The newest batch of the last chunk damaged in its payload before anything merged it,
    nothing valid after it: on local disk that cannot be told from a write torn by a crash
    (docs/decisions/0001), so it is cut as one, with a warning, never an error, and the offsets
    its intact header claimed are never given out again."""
    root, last, data, final = _with_an_unmerged_newest_batch(tmp_path)
    flip(last, len(data) - 1)
    chunk_start = start_of(last)
    with SegmentStore.open(root, **SMALL) as store, caplog.at_level("WARNING", logger="attrindex.storage"):
        assert store.verify_segment("s").ok  # a torn write is no damage
        seg = store.segment("s")
        assert [r.offset for r in seg.read(0, 1000)] == list(range(30))
        assert seg.stats().log_bytes == chunk_start + final
        assert seg.get_attribute(COUNTER) == 30
        assert increment(seg, 31).first_offset == 31  # offset 30, claimed by the torn header, is skipped
        assert any(f"torn write at position {chunk_start + final}" in r.getMessage() for r in caplog.records)
        assert [r.offset for r in seg.read(0, 1000)] == list(range(30)) + [31]
        assert store.verify_segment("s").ok
    with SegmentStore.open(root, **SMALL) as store:  # the torn bytes were zeroed by the append
        seg = store.segment("s")
        assert [r.offset for r in seg.read(0, 1000)] == list(range(30)) + [31]
        assert seg.get_attribute(COUNTER) == 31


def test_a_damaged_header_of_the_newest_batch_is_damage_not_a_torn_write(tmp_path):
    """A torn write begins as the batch it was begins (a killed writer leaves a prefix; a power
    loss keeps or loses whole sectors), so a newest batch whose header fails its checksum is
    damage: reported on open, and repair gives the batch up above every offset it could hold."""
    root, last, _data, final = _with_an_unmerged_newest_batch(tmp_path)
    flip(last, final + 30)
    chunk_start = start_of(last)
    with SegmentStore.open(root, **SMALL) as store:
        with pytest.raises(CorruptDataError) as caught:
            store.segment("s")
        assert caught.value.offset == chunk_start + final
        assert not store.verify_segment("s").ok
        repair = store.repair_segment("s")
        assert repair.first_lost_offset == 30 and repair.resume_offset >= 31
        seg = store.segment("s")
        assert [r.offset for r in seg.read(0, 1000)] == list(range(30))
        assert increment(seg, 31).first_offset == repair.resume_offset


@pytest.mark.parametrize("where", ["first", "older", "newest"])
def test_a_last_chunk_cut_short_is_damage_never_a_rollback(tmp_path, caplog, where):
    """The log's last chunk truncated inside one of its batches (the first, one with acknowledged
    batches after it, the newest), nothing merged past the cut: what is left looks like a torn
    write, but a torn write never makes the file shorter than the zeros the storage keeps after
    the chain's end, so it is reported (cut as torn, the batches after the cut would be lost with
    no error), and repair gives the batch at the cut up."""
    root = str(tmp_path / "store")
    with SegmentStore.open(root, **SMALL) as store:
        store.segment("s", create=True)
    # A writer that dies after its appends were acknowledged: no close, so no merge covers them.
    writer = (f"import os; from attrindex import SegmentStore\n"
              f"seg = SegmentStore.open({root!r}, **{SMALL!r}).segment('s')\n"
              f"for i in range(40): seg.append([b'rec-%d' % i], timestamp=i)\n"
              f"os._exit(0)")
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    last = files(root, "s", "_log.seg")[-1]
    batches = list(iter_batches(committed(last), position=start_of(last)))
    assert len(batches) > 5
    at, header = batches[{"first": 0, "older": -4, "newest": -1}[where]]
    os.truncate(last, at + BATCH_HEADER_SIZE + 3)  # the header and part of the payload are left
    with SegmentStore.open(root, **SMALL) as store, caplog.at_level("WARNING", logger="attrindex.storage"):
        with pytest.raises(CorruptDataError) as caught:
            store.segment("s")
        assert caught.value.offset == start_of(last) + at
        assert not store.verify_segment("s").ok
        assert not any("torn write" in r.getMessage() for r in caplog.records)
        repair = store.repair_segment("s")
        assert repair.first_lost_offset == header.base_offset
        # What lay past the cut is gone with no trace of how many records it held: the resume is
        # a bound, above every offset given out (40 were acknowledged), never one of theirs.
        assert not repair.resume_exact and repair.resume_offset >= 40
        seg = store.segment("s")
        assert [r.value for r in seg.read(0, 1000)] == [b"rec-%d" % i for i in range(header.base_offset)]
        assert seg.append([b"after the repair"]).first_offset == repair.resume_offset


@pytest.mark.parametrize("kind", ["payload", "header", "chunk"])
def test_the_newest_batches_damaged_after_a_merge_are_given_up_and_never_reused(tmp_path, kind):
    """On local disk, the newest batch (or the whole last chunk) damaged after the attributes
    merged it: the log alone would cut it as a torn write, but the attributes' checkpoint proves
    those bytes were committed, so opening refuses. Repair gives those batches up as lost (they
    are reported, with their offsets) and resumes above every offset they could have held: no
    acknowledged offset is given out again, whatever is left of the damaged headers."""
    root = str(tmp_path / "store")
    fill_counter(root, 30, **SMALL)  # closed: the attributes cover every batch
    last = files(root, "s", "_log.seg")[-1]
    data = committed(last)
    batches = list(iter_batches(data, position=start_of(last)))
    if kind == "chunk":
        with open(last, "r+b") as f:
            f.write(bytes(b ^ 0x5A for b in data))
        lost = [h.base_offset for _p, h in batches]
    else:
        at = batches[-1][0]
        flip(last, at + (BATCH_HEADER_SIZE + 3 if kind == "payload" else 30))
        lost = [29]
    kept = [i for i in range(30) if i not in lost]
    with SegmentStore.open(root, **SMALL) as store:
        with pytest.raises(CorruptDataError):
            store.segment("s")
        repair = store.repair_segment("s")
        # A damaged tail's range is a bound of up to RECORDS_PER_BYTE_BOUND offsets per lost byte
        # (hundreds of millions): asked by membership, never listed.
        def given_up(offset: int) -> bool:
            return any(offset in r for r in repair.lost_offsets)

        assert all(map(given_up, lost)) and not any(map(given_up, kept)), repair
        assert repair.resume_offset is not None and repair.resume_offset >= 30, repair
        seg = store.segment("s")
        assert [r.offset for r in seg.read(0, 1000)] == kept
        assert increment(seg, 30).first_offset >= 30  # never an acknowledged offset
        assert store.verify_segment("s").ok


# -- verify and repair -----------------------------------------------------------------------------
def test_verify_reports_every_damaged_range_and_repair_gives_up_only_those(tmp_path):
    root = str(tmp_path / "store")
    fill_counter(root, 300, **SMALL)
    chunks = files(root, "s", "_log.seg")
    assert len(chunks) > 8
    damaged = [chunks[2], chunks[5]]
    positions = []
    for path in damaged:
        data = open(path, "rb").read()
        pos = [p for p, _h in iter_batches(data, position=start_of(path))][3]
        flip(path, pos + BATCH_HEADER_SIZE + 2)  # a payload byte: the header still tells the offsets
        positions.append(int(os.path.basename(path)) + pos)
    with SegmentStore.open(root, **SMALL) as store:
        report = store.verify_segment("s")
        assert [d.start for d in report.damage] == positions
        assert all("_log chunk" in d.where and "payload checksum" in d.reason for d in report.damage)
        assert not report.ok and report.records == 298
        with pytest.raises(CorruptDataError):
            store.segment("s").read(0, 1000)
        repair = store.repair_segment("s")
        assert repair.cut_at is None and repair.resume_exact and repair.resume_offset == 300
        lost = [o for r in repair.lost_offsets for o in r]
        assert len(lost) == 2 and [r.start for r in repair.lost] == positions  # one batch each, nothing else
        assert repair.first_lost_offset == lost[0] and repair.kept_after_damage == 299 - lost[0] - 1
        kept = [i for i in range(300) if i not in lost]
        seg = store.segment("s")
        assert seg.next_offset == 300
        assert [int(r.value.split(b"-")[1]) for r in seg.read(0, 1000)] == kept
        assert [r.offset for r in seg.read(0, 1000)] == kept
        for offset in (0, lost[0] - 1, lost[0], lost[1], 299):  # reads from every side of each gap
            assert seg.read(offset, 1)[0].offset == (offset if offset not in lost else offset + 1)
        assert seg.offset_for_timestamp(lost[1]) == lost[1] + 1
        # rebuilt from the kept batches: the counter is the value the last kept one wrote
        assert seg.get_attribute(COUNTER) == 300 and repair.attributes_rebuilt
        assert increment(seg, 300).first_offset == 300
        assert store.verify_segment("s").ok
    with SegmentStore.open(root, **SMALL) as store:  # reopened: the gaps stay
        seg = store.segment("s")
        assert [r.offset for r in seg.read(0, 1000)] == kept + [300]
        assert seg.get_attribute(COUNTER) == 301
        assert increment(seg, 301).first_offset == 301
        assert store.repair_segment("s").repaired is False


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_a_damaged_header_resumes_above_a_safe_bound(storage_url):
    """Where a chunk's length is stored (memory, S3), a damaged last batch is damage: repair cuts
    it and, its header unreadable, resumes above a bound on the offsets it could have held."""
    from storage_adapters import open_storage

    root, _options = storage_url
    fill_counter(root, 20)
    storage = open_storage(root)
    ((name, start, data),) = committed_chunks(storage, "s/_log")
    last = [p for p, _h in iter_batches(data, position=start)][-1]
    rot(storage, f"s/_log.seg/{name}", last + 30)  # inside the last header: its offsets cannot be trusted
    with SegmentStore.open(root) as store:
        repair = store.repair_segment("s")
        assert not repair.resume_exact and repair.first_lost_offset == 19
        assert repair.resume_offset > 19 and repair.lost_offsets == (range(19, repair.resume_offset),)
        seg = store.segment("s")
        assert increment(seg, 20).first_offset == repair.resume_offset
        assert seg.get_attribute(COUNTER) == 20


def test_repair_keeps_the_attributes_when_retention_removed_the_log_start(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root, **SMALL) as store:
        seg = store.segment("s", create=True)
        for i in range(200):
            increment(seg, i)
        seg.apply_retention(start_offset=100)
        for i in range(200, 220):
            increment(seg, i)
    last = files(root, "s", "_log.seg")[-1]
    at, header = list(iter_batches(committed(last), position=start_of(last)))[-2]  # below the newest batch: damage, not a torn write
    flip(last, at + BATCH_HEADER_SIZE + 1)
    with SegmentStore.open(root, **SMALL) as store:
        with pytest.raises(CorruptDataError):
            store.segment("s").read(0, 1000)
        repair = store.repair_segment("s")
        assert not repair.attributes_rebuilt and "cannot be rebuilt" in repair.attributes
        assert repair.lost_offsets == (range(header.base_offset, header.base_offset + 1),)
        seg = store.segment("s")
        assert seg.get_attribute(COUNTER) == 220  # the tree's values up to its checkpoint
        assert increment(seg, 220).first_offset == 220


def test_a_damaged_attribute_index_is_rebuilt_from_the_log(tmp_path):
    root = str(tmp_path / "store")
    with SegmentStore.open(root) as store:
        seg = store.segment("s", create=True)
        for i in range(50):
            seg.append([b"r"], [(key(i), i * 7)])
    (index_chunk,) = files(root, "s", "_attributes.seg")
    flip(index_chunk, 40)  # inside the first page
    with SegmentStore.open(root) as store:
        report = store.verify_segment("s")
        assert not report.ok and all("_attributes" in d.where for d in report.damage)
        repair = store.repair_segment("s")
        assert repair.cut_at is None and repair.attributes_rebuilt and "rebuilt from the whole log" in repair.attributes
        seg = store.segment("s")
        assert seg.get_attributes([key(i) for i in range(50)]) == [i * 7 for i in range(50)]
        assert store.verify_segment("s").ok


def test_a_damaged_chunk_index_file_is_reported_and_deleted(tmp_path):
    root = str(tmp_path / "store")
    fill_counter(root, 300, **SMALL)
    indexes = sorted(os.listdir(os.path.join(root, "s", "_index")))
    path = os.path.join(root, "s", "_index", indexes[1])
    flip(path, 20)
    with SegmentStore.open(root, **SMALL) as store:
        report = store.verify_segment("s")
        assert [d.where for d in report.damage] == [f"s/_index/{indexes[1]}"]
        repair = store.repair_segment("s")
        assert repair.index_files_deleted == 1 and repair.cut_at is None
        assert store.verify_segment("s").ok
        assert len(store.segment("s").read(0, 1000)) == 300


def test_verify_and_repair_of_a_missing_segment_say_so(tmp_path):
    from attrindex.errors import SegmentNotFoundError

    with SegmentStore.open(str(tmp_path / "store")) as store:
        with pytest.raises(SegmentNotFoundError):
            store.verify_segment("nope")
        with pytest.raises(SegmentNotFoundError):
            store.repair_segment("nope")


def damage(path: str, rng: random.Random, size: int) -> tuple[int, int]:
    """One random kind of damage to the first ``size`` bytes of a stored file, keeping its size: a
    bit flip, a zeroed range or random bytes. Returns the damaged byte range of the file."""
    at = rng.randrange(size)
    kind = rng.choice(["flip", "zero", "random"])
    if kind == "flip":
        flip(path, at, 1 << rng.randrange(8))
        return at, at + 1
    length = rng.randint(1, min(300, size - at))
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(length)
        new = bytes(length) if kind == "zero" else rng.randbytes(length)
        if new == old:
            new = bytes(b ^ 0xFF for b in old)
        f.seek(at)
        f.write(new)
    return at, at + length


@pytest.mark.parametrize("run", range(6))
def test_random_damage_in_the_log_never_reuses_an_acknowledged_offset(tmp_path, run):
    """Damage a random place of the log below its newest batch: it is reported, reads raise, and
    after repair exactly the batches the damage touched are lost (every other record is intact
    and kept), the attributes are those the kept batches wrote, and no new append gets an offset
    an earlier append was acknowledged with. (Damage reaching the newest batch of the last chunk:
    test_damage_to_the_newest_unmerged_batch_is_cut_as_a_torn_write and the tests after it.)"""
    rng = random.Random(run)
    root = str(tmp_path / "store")
    fill_counter(root, 150, **SMALL)
    chunks = files(root, "s", "_log.seg")
    path = rng.choice(chunks)
    data = committed(path)
    newest = [p for p, _h in iter_batches(data, position=start_of(path))][-1]
    low, high = damage(path, rng, newest if path == chunks[-1] else len(data))
    touched = {h.base_offset for p, h in iter_batches(data, position=start_of(path)) if p < high and low < p + h.size}
    with SegmentStore.open(root, **SMALL) as store:
        assert not store.verify_segment("s").ok  # every byte of a batch is under a checksum
        with pytest.raises(CorruptDataError):
            store.segment("s").read(0, 1000)
        repair = store.repair_segment("s")
        lost = {o for r in repair.lost_offsets for o in r}
        assert repair.resume_offset >= 150 and lost & set(range(150)) == touched
        assert repair.cut_at is None  # valid batches follow the damage: nothing is cut
        seg = store.segment("s")
        assert increment(seg, 150).first_offset == repair.resume_offset
        records = seg.read(0, 1000)
        kept = [i for i in range(150) if i not in touched]
        assert [int(r.value.split(b"-")[1]) for r in records] == kept + [150]
        assert [r.offset for r in records] == kept + [repair.resume_offset]
        assert seg.get_attribute(COUNTER) == kept[-1] + 2  # what the last kept batch wrote, plus one
        assert store.verify_segment("s").ok


# -- work after the durable point never fails an append ------------------------------------------
@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_failed_merge_after_a_durable_append_never_fails_it(storage_url, caplog):
    """ENOSPC on the attribute index's writes (a full disk) while an append merges tier 1: the
    append returns (its batch is durable), the record is there exactly once, stats() shows the
    error, flush() raises it, and a later flush succeeds once there is room again."""
    from storage_adapters import open_storage
    from storage_adapters.errors import StorageFullError
    from storage_adapters.faults import FaultyStorage

    url, options = storage_url
    faulty = FaultyStorage(open_storage(url, **options), seed=1)
    store = SegmentStore(faulty, flush_keys=1)  # every append merges tier 1 into the B+tree
    seg = store.segment("s", create=True)
    increment(seg, 0)
    faulty.script("enospc", path_contains="_attributes", times=1_000_000)
    with caplog.at_level("WARNING", logger="attrindex.segment"):
        assert increment(seg, 1).first_offset == 1  # durable, so it returns
        deadline = time.monotonic() + 20  # the merge runs in the background
        while (not any("merging attribute updates" in r.getMessage() for r in caplog.records)
               and time.monotonic() < deadline):
            time.sleep(0.01)
    assert any("merging attribute updates" in r.getMessage() for r in caplog.records)
    assert faulty.injected and all(i.kind == "enospc" for i in faulty.injected)
    assert "StorageFullError" in seg.stats().merge_error
    assert increment(seg, 2).first_offset == 2  # appends go on while the merge fails
    with pytest.raises(StorageFullError):
        seg.flush()  # here the merge is what was asked
    assert seg.get_attribute(COUNTER) == 3
    faulty.enabled = False  # room again
    seg.flush()
    assert seg.stats().merge_error is None and seg.stats().pending_attributes == 0
    store.close()
    with SegmentStore.open(url, storage_options=options) as fresh:
        seg = fresh.segment("s")
        assert [r.value for r in seg.read(0, 100)] == [b"rec-0", b"rec-1", b"rec-2"]
        assert seg.get_attribute(COUNTER) == 3


def test_close_raises_a_merge_that_still_fails(tmp_path):
    from storage_adapters import open_storage
    from storage_adapters.errors import StorageFullError
    from storage_adapters.faults import FaultyStorage

    root = str(tmp_path / "store")
    faulty = FaultyStorage(open_storage(root), seed=2)
    seg = SegmentStore(faulty, flush_keys=1).segment("s", create=True)
    faulty.script("enospc", path_contains="_attributes", times=1_000_000)
    increment(seg, 0)
    with pytest.raises(StorageFullError):
        seg.close()
    assert seg.closed
    with SegmentStore.open(root) as store:  # the log has it: replayed on open
        assert store.segment("s").get_attribute(COUNTER) == 1


# -- a batch recognises itself ---------------------------------------------------------------------
def test_lost_acknowledgements_on_log_appends_neither_duplicate_nor_fail(storage_url):
    """Every log write's response is lost (the write happened), for two writers racing on the
    same segment: each append returns once, offsets are contiguous, no record is duplicated and
    the ACCUMULATE total is exact."""
    import threading

    from storage_adapters import open_storage
    from storage_adapters.faults import FaultyStorage

    url, options = storage_url
    per_writer, writers = 12, 2
    stores, faults = [], []
    for seed in range(writers):
        faulty = FaultyStorage(open_storage(url, **options), seed=seed)
        stores.append(SegmentStore(faulty, log_rolling_size=1024))
        faults.append(faulty)
    stores[0].segment("s", create=True)
    for faulty in faults:
        faulty.script("lost_ack", path_contains="_log.seg/0", times=1_000_000)
    results: dict[int, list[int]] = {}

    def write(w: int) -> None:
        seg = stores[w].segment("s")
        results[w] = [seg.append([b"w%d-%d" % (w, i)], [AttributeUpdate(COUNTER, UpdateType.ACCUMULATE, value=1)],
                                 timestamp=i).first_offset for i in range(per_writer)]

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(o for offsets in results.values() for o in offsets) == list(range(writers * per_writer))
    assert sum(1 for f in faults for i in f.injected if i.kind == "lost_ack") >= writers * per_writer
    for faulty, store in zip(faults, stores):
        faulty.enabled = False
        store.close()
    with SegmentStore.open(url, storage_options=options) as fresh:
        seg = fresh.segment("s")
        records = seg.read(0, 1000)
        assert [r.offset for r in records] == list(range(writers * per_writer))
        by_value = {r.value: r.offset for r in records}
        assert len(by_value) == len(records)  # no record twice
        for w, offsets in results.items():  # each acknowledged offset holds that append's record
            assert [by_value[b"w%d-%d" % (w, i)] for i in range(per_writer)] == offsets
        assert seg.get_attribute(COUNTER) == writers * per_writer


def test_every_append_call_has_its_own_batch_id_kept_across_a_lost_race(tmp_path):
    """Two handles append identical content: their batches differ by id, so reading back after a
    lost acknowledgement can only match the same call; a call that lost a race keeps its id."""
    from attrindex.log.batch.header import read_header

    root = str(tmp_path / "store")
    with SegmentStore.open(root) as one, SegmentStore.open(root) as two:
        first, second = one.segment("s", create=True), two.segment("s")
        first.append([b"same"], [(key(1), 5)], timestamp=9)
        second.append([b"same"], [(key(1), 5)], timestamp=9)  # lost the race once: rebased and retried
        first.append([b"same"], [(key(1), 5)], timestamp=9)
    (chunk,) = files(root, "s", "_log.seg")
    data = committed(chunk)
    headers = [h for _pos, h in iter_batches(data, position=start_of(chunk))]
    assert [h.base_offset for h in headers] == [0, 1, 2]
    assert len({h.batch_id for h in headers}) == 3
    bodies = {data[p + BATCH_HEADER_SIZE:p + h.size] for p, h in iter_batches(data, position=start_of(chunk))}
    assert len(bodies) == 1  # the payloads are identical: only the id tells the calls apart
    assert all(read_header(data, p, position=start_of(chunk)).batch_id == h.batch_id
               for p, h in iter_batches(data, position=start_of(chunk)))


def rot(storage, path: str, at: int) -> None:
    """Bit rot: rewrite a stored file with one bit flipped (same size, behind the store's back)."""
    data = bytearray(storage.read(path, 0, 1 << 30))
    data[at] ^= 0x04
    if storage.appendable and not storage.url.startswith("memory"):
        with open(storage._abs(path), "r+b") as f:
            f.write(data)
    else:
        storage.fs.pipe_file(storage._abs(path), bytes(data))


def test_verify_and_repair_on_every_backend(storage_url):
    """Objects (S3: one per append) and appendable chunks alike: the damaged batch is reported by
    position, the repair gives up that batch only and appends resume above every offset."""
    from storage_adapters import open_storage

    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, log_rolling_size=1024) as store:
        seg = store.segment("s", create=True)
        for i in range(20):
            increment(seg, i)
    storage = open_storage(url, **options)
    chunks = sorted(n for n in storage.list_files("s/_log.seg") if n.isdigit())
    victim = chunks[len(chunks) // 2]
    rot(storage, f"s/_log.seg/{victim}", BATCH_HEADER_SIZE + 3)  # the first batch's payload
    with SegmentStore.open(url, storage_options=options, log_rolling_size=1024) as store:
        report = store.verify_segment("s")
        assert [d.start for d in report.damage] == [int(victim)]
        with pytest.raises(CorruptDataError):
            store.segment("s").read(0, 100)
        repair = store.repair_segment("s")
        lost = repair.first_lost_offset
        assert repair.lost_offsets == (range(lost, lost + 1),) and repair.cut_at is None
        assert repair.resume_exact and repair.resume_offset == 20 and repair.kept_after_damage == 19 - lost
        seg = store.segment("s")
        kept = [i for i in range(20) if i != lost]
        assert [r.offset for r in seg.read(0, 100)] == kept
        assert increment(seg, 20).first_offset == 20
        assert seg.get_attribute(COUNTER) == 21  # what the last kept batch wrote, plus one
        assert store.verify_segment("s").ok
    with SegmentStore.open(url, storage_options=options, log_rolling_size=1024) as store:
        seg = store.segment("s")
        assert [r.offset for r in seg.read(0, 100)] == kept + [20]
        assert seg.get_attribute(COUNTER) == 21


def rewrite(storage, path: str, start: int, new: bytes) -> None:
    """Overwrite stored bytes ``[start, start + len(new))`` of a file (same size, behind the store's back)."""
    data = bytearray(storage.read(path, 0, 1 << 30))
    data[start:start + len(new)] = new
    if storage.appendable and not storage.url.startswith("memory"):
        with open(storage._abs(path), "r+b") as f:
            f.write(data)
    else:
        storage.fs.pipe_file(storage._abs(path), bytes(data))


LATEST = key(999)  #: every batch writes its offset here: the value a repaired log shows is the last kept one's


@pytest.mark.parametrize("backend,where", [(backend, where) for backend in ("memory", "local", "s3")
                                           for where in ("middle", "last") if (backend, where) != ("local", "last")],
                         indirect=["backend"])
@pytest.mark.parametrize("kind", ["payload", "header", "chunk"])
def test_repair_gives_up_only_the_damaged_batches(storage_url, where, kind):
    """One flipped byte in the 5th of 10 one-append objects on S3 loses offset 4 only, never 4-9:
    exactly the damaged batches are lost: a batch whose payload is damaged (its
    header tells its extent), whose header is damaged (batches resume at the next one that frames
    the rest of its chunk), or a whole chunk (on S3 one append's object) of garbage. Intact batches
    after the damage are kept, readers step over the gap, the attributes are those the kept batches
    wrote, appends continue above every offset; a damaged last batch is a tail, and is cut (where
    the chunk's length is stored; on local disk the newest batch's damage is a tail the chain of
    frames ends before: test_damage_to_the_newest_unmerged_batch_is_cut_as_a_torn_write)."""
    from storage_adapters import open_storage

    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, **SMALL) as store:
        seg = store.segment("s", create=True)
        for i in range(30):
            seg.append([b"rec-%d" % i], [AttributeUpdate(key(i), UpdateType.REPLACE, value=i),
                                         AttributeUpdate(LATEST, UpdateType.REPLACE, value=i)], timestamp=1000 + i)
    storage = open_storage(url, **options)
    spans = []  # (chunk name, byte in it, size, offset) of every batch
    for name, start, data in committed_chunks(storage, "s/_log"):
        spans += [(name, p, h.size, h.base_offset) for p, h in iter_batches(data, position=start)]
    assert [offset for *_rest, offset in spans] == list(range(30))
    victim = spans[14 if where == "middle" else 29]
    name, at, size, _offset = victim
    path = f"s/_log.seg/{name}"
    if kind == "payload":
        rewrite(storage, path, at + BATCH_HEADER_SIZE + 3, b"\xff")
        touched = [victim]
    elif kind == "header":
        rewrite(storage, path, at + 30, b"\xff\x00")
        touched = [victim]
    else:
        touched = [span for span in spans if span[0] == name]
        whole = dict((n, d) for n, _start, d in committed_chunks(storage, "s/_log"))[name]
        rewrite(storage, path, 0, bytes(b ^ 0x5A for b in whole))
    lost = [offset for *_rest, offset in touched]
    kept = [i for i in range(30) if i not in lost]
    with SegmentStore.open(url, storage_options=options, **SMALL) as store:
        report = store.verify_segment("s")
        assert [(d.start, d.end) for d in report.damage] == [(int(name) + touched[0][1], int(name) + touched[-1][1] + touched[-1][2])]
        assert report.records == len(kept)
        repair = store.repair_segment("s")
        assert [r.offsets.start for r in repair.lost] == [lost[0]]
        assert repair.kept_after_damage == 29 - lost[-1]
        if where == "middle":
            assert repair.lost_offsets == (range(lost[0], lost[-1] + 1),) and repair.cut_at is None
            assert repair.resume_offset == 30 and repair.resume_exact
        else:  # the damaged tail is cut: appends resume above every offset it could have held
            assert repair.cut_at == int(name) + touched[0][1] and repair.resume_offset >= 30
            assert repair.resume_exact == (kind == "payload")  # its header told its offsets
        assert repair.attributes_rebuilt  # the tree had merged the damaged batches' updates
        seg = store.segment("s")
        assert [r.value for r in seg.read(0, 100)] == [b"rec-%d" % i for i in kept]
        assert [r.offset for r in seg.read(0, 100)] == kept
        after = next((i for i in kept if i > lost[-1]), None)
        for offset in lost:  # reading from a lost offset gives the next kept record
            got = seg.read(offset, 1)
            assert (got[0].offset if got else None) == after
        assert seg.offset_for_timestamp(1000 + lost[0]) == after
        assert seg.get_attributes([key(i) for i in range(30)]) == [None if i in lost else i for i in range(30)]
        assert seg.get_attribute(LATEST) == kept[-1]
        resume = repair.resume_offset
        assert seg.append([b"next"], [(LATEST, 100)], timestamp=2000).first_offset == resume
        assert store.verify_segment("s").ok
    with SegmentStore.open(url, storage_options=options, **SMALL) as store:  # reopened: the sparse indexes are rebuilt
        seg = store.segment("s")
        assert [r.offset for r in seg.read(0, 100)] == kept + [resume]
        for offset in kept:
            assert seg.read(offset, 1)[0].value == b"rec-%d" % offset
        assert seg.offset_for_timestamp(2000) == resume and seg.get_attribute(LATEST) == 100
        assert seg.append([b"then"]).first_offset == resume + 1
        assert store.repair_segment("s").repaired is False


def test_a_batch_stored_inside_a_damaged_batch_is_not_taken_for_one(tmp_path):
    """A record whose value is an encoded batch (offsets that would fit), ending where its damaged
    batch ends: after damage to that batch's header it looks like the next batch, and framing alone
    would take it for one and answer its record. The damaged header's own size claim says it lies
    inside the damaged batch, so it is given up with it."""
    from attrindex.log.batch.encode import encode_batch

    root = str(tmp_path / "store")
    with SegmentStore.open(root) as store:
        seg = store.segment("s", create=True)
        for i in range(10):
            value = encode_batch(5, [b"fake"], timestamp=5) if i == 5 else b"rec-%d" % i
            seg.append([value], timestamp=i)
    (chunk,) = files(root, "s", "_log.seg")
    at = [p for p, _h in iter_batches(committed(chunk), position=start_of(chunk))][5]
    flip(chunk, at + 30)  # the header's base offset: its checksum fails, its size field is intact
    with SegmentStore.open(root) as store:
        repair = store.repair_segment("s")
        assert repair.lost_offsets == (range(5, 6),) and repair.cut_at is None
        values = [r.value for r in store.segment("s").read(0, 100)]
        assert values == [b"rec-%d" % i for i in range(10) if i != 5]


def test_log_compaction_after_a_repair_keeps_every_kept_record(storage_url):
    """A gap marker names byte positions of the chunk it was recorded in. Compaction rewrites that
    chunk's kept batches back to back, so one of them may start where the gap started (here: the
    batch after the damaged one moves up to its place); the marker is void in the new chunk, and
    that batch is read, not stepped over as a gap."""
    from storage_adapters import open_storage

    from attrindex.log.batch.records import Record

    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, **SMALL) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(60):  # unique keys but one, rewritten later: compaction drops its first value
            seg.append([Record(key=b"k%d" % (15 if i == 40 else i), value=b"v%d" % i)], timestamp=i)
    storage = open_storage(url, **options)
    spans = [(name, p) for name, start, data in committed_chunks(storage, "s/_log") for p, _h in iter_batches(data, position=start)]
    name, at = spans[10]
    rot(storage, f"s/_log.seg/{name}", at + BATCH_HEADER_SIZE + 3)
    with SegmentStore.open(url, storage_options=options, **SMALL) as store:
        assert store.repair_segment("s").lost_offsets == (range(10, 11),)
        seg = store.segment("s")
        expected = [(i, b"v%d" % i) for i in range(60) if i not in (10, 15)]
        assert seg.compact(min_lag_ms=0).chunks_cleaned >= 1
        assert [(r.offset, r.value) for r in seg.read(0, 100)] == expected
        assert store.verify_segment("s").ok
    with SegmentStore.open(url, storage_options=options, **SMALL) as store:
        assert [(r.offset, r.value) for r in store.segment("s").read(0, 100)] == expected


def test_an_append_that_keeps_losing_races_gives_up_with_a_clear_error(tmp_path, monkeypatch):
    import attrindex.appender
    from attrindex.errors import StorageError

    root = str(tmp_path / "store")
    with SegmentStore.open(root) as one, SegmentStore.open(root) as two:
        stale, other = one.segment("s", create=True), two.segment("s")
        other.append([b"first"])  # the stale handle's next compare-and-append loses
        monkeypatch.setattr(attrindex.appender, "MAX_GROUP_APPEND_ATTEMPTS", 1)
        with pytest.raises(StorageError, match="lost the race"):
            stale.append([b"mine"])
        monkeypatch.setattr(attrindex.appender, "MAX_GROUP_APPEND_ATTEMPTS", 10_000)
        assert stale.append([b"mine"]).first_offset == 1
        assert [r.value for r in stale.read(0)] == [b"first", b"mine"]


def test_store_close_closes_every_handle_even_if_a_merge_fails(tmp_path):
    from storage_adapters import open_storage
    from storage_adapters.errors import StorageFullError
    from storage_adapters.faults import FaultyStorage

    faulty = FaultyStorage(open_storage(str(tmp_path / "store")), seed=4)
    store = SegmentStore(faulty)
    first, second = store.segment("a", create=True), store.segment("b", create=True)
    first.append([b"x"], [(key(1), 1)])
    second.append([b"y"], [(key(2), 2)])
    faulty.script("enospc", path_contains="a/_attributes", times=1_000_000)
    with pytest.raises(StorageFullError):
        store.close()
    assert first.closed and second.closed


@pytest.mark.parametrize("run", range(3))
def test_cycles_of_damage_and_repair_keep_every_kept_record_and_never_reuse_an_offset(tmp_path, run):
    """Append, damage a random place after the last repair, repair; three times. The model: every
    acknowledged offset is unique, the kept records are exactly the acknowledged ones outside the
    reported lost ranges, and the counter is what the last kept batch wrote (each append wrote the
    counter it read plus one)."""
    rng = random.Random(100 + run)
    root = str(tmp_path / "store")
    acknowledged: dict[int, bytes] = {}
    wrote: dict[int, int] = {}  # offset -> the counter its batch wrote
    lost: list[range] = []
    for cycle in range(3):
        with SegmentStore.open(root, **SMALL) as store:
            seg = store.segment("s", create=True)
            survivors = [o for o in wrote if not any(o in r for r in lost)]
            counter = wrote[max(survivors)] if survivors else 0
            for i in range(40):
                value = b"c%d-%d" % (cycle, i)
                offset = seg.append([value], [AttributeUpdate(COUNTER, UpdateType.ACCUMULATE, value=1)]).first_offset
                assert offset not in acknowledged
                acknowledged[offset] = value
                counter += 1
                wrote[offset] = counter
            tail_start = seg.stats().log_bytes - 40 * 60  # damage only this cycle's bytes (batches are ~100)
        path = files(root, "s", "_log.seg")[-1]
        chunk_start = int(os.path.basename(path))
        newest = [p for p, _h in iter_batches(committed(path), position=start_of(path))][-1]  # below it: damage, not a torn write
        flip(path, rng.randrange(min(max(0, tail_start - chunk_start), newest - 1), newest), 1 << rng.randrange(8))
        with SegmentStore.open(root, **SMALL) as store:
            repair = store.repair_segment("s")
            assert repair.lost
            lost.extend(repair.lost_offsets)
    with SegmentStore.open(root, **SMALL) as store:
        assert store.verify_segment("s").ok
        seg = store.segment("s")
        kept = {r.offset: r.value for r in seg.read(0, 10_000)}
        expected = {o: v for o, v in acknowledged.items() if not any(o in r for r in lost)}
        assert kept == expected
        assert seg.get_attribute(COUNTER) == wrote[max(expected)]
        assert seg.append([b"last"]).first_offset > max(acknowledged)


def test_an_open_handle_that_meets_damage_refuses_to_append(tmp_path):
    root = str(tmp_path / "store")
    one, two = SegmentStore.open(root), SegmentStore.open(root)
    stale = one.segment("s", create=True)
    increment(stale, 0)
    other = two.segment("s")
    for i in range(1, 6):
        increment(other, i)
    (chunk,) = files(root, "s", "_log.seg")
    at, _header = list(iter_batches(committed(chunk), position=start_of(chunk)))[3]
    flip(chunk, at + BATCH_HEADER_SIZE + 1)  # in a batch the stale handle has not read yet, below the newest
    before = open(chunk, "rb").read()
    for _ in range(2):  # a lost race makes it catch up, which meets the damage: every time
        with pytest.raises(CorruptDataError):
            increment(stale, 99)
    assert open(chunk, "rb").read() == before  # nothing was appended
    with pytest.raises(CorruptDataError):
        stale.refresh()
    two.close()  # this handle read its batches before the damage: its merge covers them
    with pytest.raises(CorruptDataError):
        one.close()  # the tree is ahead of it: catching up for its merge meets the damage
    assert stale.closed
