"""The segment log over replaced chunks: holes are walked like gaps, offsets continue from the next
batch's base offset, index files follow the chunk names, and a handle whose position lies in a
chunk replaced under it resumes at the first record it has not consumed.

A hypothesis model (the list of surviving offsets) checks reads by offset, readers and timestamps
after random appends and compactions that drop whole batches (what the cleaner writes)."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attrindex import SegmentStore
from attrindex.errors import InvalidInputError, LayoutConflictError
from attrindex.log.batch.chain import place_batches
from attrindex.log.batch.encode import encode_batch
from attrindex.layout import INDEX_DIR, LOG_DIR


def _store(url, options, rolling=600):
    return SegmentStore.open(url, storage_options=options, log_rolling_size=rolling)


def _fill(seg, batches, per_batch=3):
    for b in range(batches):
        seg.append([b"v%d-%d" % (b, i) for i in range(per_batch)], timestamp=1000 + b)


def _drain(reader):
    out = []
    for _ in range(10_000):
        got = reader.read_batch(max_records=1000, timeout=0)
        if not got:
            return out
        out += got
    raise AssertionError("the reader never ran dry")


def _sealed(log):
    return [c for c in log.bytes.chunks()[:-1] if c.start >= log.start_position]


def _compact(log, chunks, keep):
    """Replace ``chunks`` by the batches of theirs that ``keep(header)`` keeps (a cleaner's output:
    a record-less batch at the first base offset anchors the chunk's base when its first is dropped)."""
    start, end = chunks[0].start, chunks[-1].end
    batches = [(h, bytes(buf[pos:pos + h.size])) for _at, h, buf, pos in log.batches(start, end)]
    kept = [data for h, data in batches if keep(h)]
    if batches and not keep(batches[0][0]):
        kept.insert(0, encode_batch(batches[0][0].base_offset, [], timestamp=0))
    log.replace_range(start, end, place_batches(b"".join(kept), start))  # moved: sealed for where they land
    return kept


@pytest.mark.parametrize("backend", ["memory", "local", "s3"])
def test_compacted_chunks_read_with_gaps_in_offsets(storage_url):
    url, options = storage_url
    store = _store(url, options)
    seg = store.segment("s", create=True)
    _fill(seg, 30)
    log = seg._log
    sealed = _sealed(log)
    assert len(sealed) >= 3
    dropped = set()

    def keep(header):
        if header.base_offset % 2:
            return True
        dropped.update(range(header.base_offset, header.next_offset))
        return False

    with seg._lock:
        _compact(log, sealed[:3], keep)
    assert log.bytes.holes()
    survivors = [o for o in range(90) if o not in dropped]
    fresh = _store(url, options).segment("s")
    got = fresh.read(0, max_records=1000)
    assert [r.offset for r in got] == survivors
    assert all(r.value == b"v%d-%d" % (r.offset // 3, r.offset % 3) for r in got)
    first_dropped = min(dropped)
    assert fresh.read(first_dropped, max_records=1)[0].offset == min(o for o in survivors if o > first_dropped)
    assert [r.offset for r in _drain(fresh.reader(offset=0))] == survivors
    # Index files follow the chunk names: the replacement's is there, the replaced ones' are gone.
    index = fresh._log.storage.list_files(f"s/{INDEX_DIR}")
    names = {c.name for c in fresh._log.bytes.chunks()}
    assert set(index) <= names
    assert fresh.offset_for_timestamp(1000) == survivors[0]
    report = _store(url, options).verify_segment("s")  # holes are no damage; the new index file checks
    assert report.ok, report.damage
    seg.append([b"after"])  # appends go on at the end
    assert fresh.read(90)[0].value == b"after" if fresh.refresh() is None else False


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_handle_inside_a_replaced_chunk_resumes_without_repeating(storage_url):
    url, options = storage_url
    store = _store(url, options)
    writer = store.segment("s", create=True)
    _fill(writer, 10)
    tail = _store(url, options).segment("s")  # its position: inside the chunk being appended to
    reader = tail.reader(offset=0)
    first = _drain(reader)
    _fill(writer, 14)
    log = writer._log
    sealed = _sealed(log)
    inside = [c for c in sealed if c.start < tail._log.position <= c.end]
    run = sealed[:sealed.index(inside[0]) + 2]  # the chunk it stands in (or ends) and the next, merged
    before = tail._log.resyncs
    dropped = set()

    def keep(h):
        if h.base_offset % 9 == 3:
            dropped.update(range(h.base_offset, h.next_offset))
            return False
        return True
    with writer._lock:
        _compact(log, run, keep)  # drop some batches
    assert any(o >= 30 for o in dropped)
    writer.append([b"new"])
    tail.refresh()
    assert tail._log.resyncs == before + 1  # it stood inside the new chunk: moved to a batch start
    rest = _drain(reader)
    seen = [r.offset for r in first + rest]
    assert seen == sorted(set(seen))  # in order, none twice
    assert seen[:len(first)] == list(range(30)) and seen[-1] == 72
    assert [r.offset for r in rest] == [o for o in range(30, 73) if o not in dropped]
    fresh = _store(url, options).segment("s")
    assert [r.offset for r in fresh.read(30, max_records=1000)] == [r.offset for r in rest]


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_consolidated_log_reads_the_same(storage_url):
    url, options = storage_url
    store = _store(url, options, rolling=200)
    seg = store.segment("s", create=True)
    _fill(seg, 40)
    before = [(r.offset, r.value) for r in seg.read(0, max_records=1000)]
    n_before = len(seg._log.bytes.chunks())
    assert seg._log.bytes.consolidate(1 << 20) >= 1
    fresh = _store(url, options, rolling=200).segment("s")
    assert len(fresh._log.bytes.chunks()) < n_before
    assert [(r.offset, r.value) for r in fresh.read(0, max_records=1000)] == before
    assert [(r.offset, r.value) for r in seg.read(0, max_records=1000)] == before
    assert [r.offset for r in fresh.read(57, max_records=2)] == [57, 58]


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_bad_replacement_data_is_refused_before_anything_is_written(storage_url):
    url, options = storage_url
    seg = _store(url, options).segment("s", create=True)
    _fill(seg, 20)
    log = seg._log
    sealed = _sealed(log)
    start, end = sealed[0].start, sealed[1].end
    batches = [bytes(buf[pos:pos + h.size]) for _at, h, buf, pos in log.batches(start, end)]
    files = sorted(log.storage.list_files(f"s/{LOG_DIR}.seg"))
    for bad in (b"garbage", batches[0][:-1], batches[0] + batches[1][:30], batches[1] + batches[0],
                batches[0][:10] + b"x" + batches[0][11:],
                place_batches(batches[0], start + 1), place_batches(batches[0], 0) if start else batches[1]):
        with pytest.raises(InvalidInputError):
            log.replace_range(start, end, bad)
    assert sorted(log.storage.list_files(f"s/{LOG_DIR}.seg")) == files
    other = _store(url, options).segment("s")
    log.replace_range(start, end, batches[0])
    with pytest.raises(LayoutConflictError):
        other._log.replace_range(start, end, batches[0])  # its view has the old chunk


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(["append", "compact", "consolidate", "reopen"]),
                                st.integers(0, 1000)), min_size=3, max_size=14))
def test_reads_match_the_surviving_offsets(steps):
    url = f"memory://logmodel-{uuid.uuid4().hex}"
    store = _store(url, {}, rolling=300)
    seg = store.segment("s", create=True)
    survivors: list[int] = []
    next_offset = 0
    for op, n in steps:
        if op == "append":
            count = 1 + n % 4
            seg.append([b"%d" % (next_offset + i) for i in range(count)], timestamp=n)
            survivors += range(next_offset, next_offset + count)
            next_offset += count
        elif op == "compact":
            sealed = _sealed(seg._log)
            if sealed:
                i = n % len(sealed)
                run = sealed[i:i + 1 + n % 3]
                gone = set()

                def keep(h, n=n, gone=gone):
                    if (h.base_offset + n) % 3 == 0:
                        gone.update(range(h.base_offset, h.next_offset))
                        return False
                    return True
                with seg._lock:
                    _compact(seg._log, run, keep)
                survivors = [o for o in survivors if o not in gone]
        elif op == "consolidate":
            seg._log.bytes.consolidate(200 + n)
        else:
            seg = _store(url, {}, rolling=300).segment("s")
        fresh = _store(url, {}, rolling=300).segment("s")
        for view in (seg, fresh):
            view.refresh()
            assert [r.offset for r in view.read(0, max_records=10_000)] == survivors
            assert all(r.value == b"%d" % r.offset for r in view.read(0, max_records=10_000))
        if survivors:
            probe = n % (next_offset + 1)
            later = [o for o in survivors if o >= probe]
            assert [r.offset for r in fresh.read(probe, max_records=1)] == later[:1]


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_stale_handle_reads_by_offset_after_a_switch(storage_url):
    """A handle whose view predates a compaction plans a read with the old chunks (their index
    files are gone): the plan meets the switch, the handle catches up and reads the survivors."""
    url, options = storage_url
    writer = _store(url, options).segment("s", create=True)
    _fill(writer, 30)
    writer.flush()  # the stale handle opens at the checkpoint: no summaries of old chunks
    stale = _store(url, options).segment("s")
    assert all(c.summary is None for c in stale._log.chunks[:-1])
    sealed = _sealed(writer._log)
    dropped = set()

    def keep(h):
        if h.base_offset % 6 == 3:
            dropped.update(range(h.base_offset, h.next_offset))
            return False
        return True
    with writer._lock:
        _compact(writer._log, sealed[1:4], keep)
    assert dropped
    for offset in sorted(dropped)[:3] + [0, 50, 89]:
        want = [o for o in range(offset, 90) if o not in dropped][:5]
        assert [r.offset for r in stale.read(offset, max_records=5)] == want
