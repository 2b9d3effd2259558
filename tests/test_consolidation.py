"""Consolidation (issue 12): runs of small log chunks merged into large ones by an atomic switch.

On S3 a segment written by many appends is one object per append; consolidated, it is read with
about one GET per 8 MiB, and a record by offset with one GET once the chunks are known. Requests
are counted by a small ``ChunkStorage`` wrapper (one ``read`` is one ranged GET on S3). A writer
and a tailing reader in other processes go on while the parent consolidates: the reader sees
every record once, in order.
"""

from __future__ import annotations

import collections
import math
import multiprocessing

import pytest

from attrindex import SegmentStore
from attrindex.cli import main
from attrindex.errors import InvalidInputError
from attrindex.segment import Segment, SegmentOptions
from storage_adapters import ChunkStorage, open_storage

from . import layout_workers as workers


class CountingStorage(ChunkStorage):
    """Delegates to ``inner``, counting calls by operation and bytes read per path fragment."""

    def __init__(self, inner: ChunkStorage):
        super().__init__(inner.url)
        self.inner, self.calls = inner, collections.Counter()
        self.appendable = inner.appendable
        self.deletion_grace = inner.deletion_grace

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def list_files(self, directory):
        self.calls["LIST"] += 1
        return self.inner.list_files(directory)

    def read(self, path, start, end):
        self.calls["GET " + ("log" if "_log.seg" in path else "other")] += 1
        return self.inner.read(path, start, end)

    def exists(self, path):
        self.calls["HEAD"] += 1
        return self.inner.exists(path)

    def create(self, path, data):
        self.calls["PUT"] += 1
        return self.inner.create(path, data)

    def put_marker(self, path):
        self.calls["PUT"] += 1
        return self.inner.put_marker(path)

    def delete(self, paths):
        self.calls["DELETE"] += 1
        return self.inner.delete(paths)

    def remove_directory(self, directory):
        return self.inner.remove_directory(directory)


def _read_all(seg) -> list:
    out, offset = [], seg.start_offset
    for _ in range(100_000):
        got = seg.read(offset, max_records=100_000)
        if not got:
            return out
        out += got
        offset = got[-1].offset + 1
    raise AssertionError("read never reached the end")


def test_consolidated_s3_log_reads_with_one_get_per_8_mib(s3_options):
    from .conftest import make_s3_url

    url = make_s3_url(s3_options)
    store = SegmentStore.open(url, storage_options=s3_options, log_rolling_size=32 << 20)
    seg = store.segment("big", create=True)
    value = bytes(range(256)) * 800  # 200 KiB records, 2 per append: ~400 KiB objects
    appends = 25
    for i in range(appends):
        seg.append([value, value[:-1] + bytes([i])])
    log_bytes = seg.stats().log_bytes

    def counted_handle():
        storage = CountingStorage(open_storage(url, **s3_options))
        return storage, Segment(storage, "big", SegmentOptions(log_rolling_size=32 << 20))

    storage, before = counted_handle()
    opened = dict(storage.calls)
    records = _read_all(before)
    gets_before = storage.calls["GET log"]
    assert len(records) == 2 * appends and gets_before >= appends

    assert seg.consolidate() == 1
    assert seg.stats().log_chunks == 2  # the merged run and the last chunk (never merged)
    storage, after = counted_handle()
    opened = dict(storage.calls)
    assert [(r.offset, r.value) for r in _read_all(after)] == [(r.offset, r.value) for r in records]
    gets_after = storage.calls["GET log"] - opened.get("GET log", 0)
    assert gets_after <= math.ceil(log_bytes / (8 << 20)) + 1, (gets_after, log_bytes)
    print(f"\nsequential read of {log_bytes / 2**20:.1f} MiB: {gets_before} GETs before consolidation, "
          f"{gets_after} after ({gets_before / gets_after:.0f}x fewer)")

    # A record by offset: one GET once the chunks (and their index files) are known.
    after.read(30, max_records=1)
    for offset in (7, 29, 48):
        known = storage.calls["GET log"] + storage.calls["GET other"]
        got = after.read(offset, max_records=1)
        assert got[0].offset == offset
        assert storage.calls["GET log"] + storage.calls["GET other"] - known <= 1


def test_consolidation_on_local_disk_merges_only_small_chunks(tmp_path, capsys):
    store = SegmentStore.open(str(tmp_path / "s"), log_rolling_size=600)
    seg = store.segment("s", create=True)
    for i in range(40):
        seg.append([b"%03d" % i * 20])
    chunks = seg.stats().log_chunks
    assert chunks > 4
    with pytest.raises(InvalidInputError):
        seg.consolidate(0)
    assert seg.consolidate(600) == 0  # chunks already grow to the rolling size in place
    assert main(["segment", "consolidate", str(tmp_path / "s"), "s", "--target-size", "10000"]) == 0
    assert "merged 1 runs" in capsys.readouterr().out
    assert SegmentStore.open(str(tmp_path / "s")).segment("s").stats().log_chunks == 2
    assert [r.value for r in SegmentStore.open(str(tmp_path / "s")).segment("s").read(0, 100)] == [
        b"%03d" % i * 20 for i in range(40)]


@pytest.mark.parametrize("backend_name", ["local", "s3"])
def test_consolidation_beside_a_writer_and_a_tailing_reader_in_other_processes(backend_name, tmp_path, request):
    if backend_name == "local":
        url, options = str(tmp_path / "store"), {}
    else:
        from .conftest import make_s3_url

        options = request.getfixturevalue("s3_options")
        url = make_s3_url(options)
    store = SegmentStore.open(url, storage_options=options, log_rolling_size=256)
    seg = store.segment("s", create=True)
    count = 200 if backend_name == "local" else 40
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=workers.append_records, args=(url, options, "s", count, 256, results)),
             ctx.Process(target=workers.tail_records, args=(url, options, "s", count, 256, 90.0, results))]
    for p in procs:
        p.start()
    merged = 0
    try:
        while any(p.is_alive() for p in procs) and merged < 1000:
            merged += seg.consolidate(2048)
        out = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
    assert out["writer"] == count, out["writer"]
    got = out["reader"]
    assert not isinstance(got, str), got
    assert [offset for offset, _value in got] == list(range(count))  # every record once, in order
    assert all(value == b"%d" % offset for offset, value in got)
    assert merged > 0
    seg.consolidate(2048)
    fresh = SegmentStore.open(url, storage_options=options).segment("s")
    assert [r.value for r in _read_all(fresh)] == [b"%d" % i for i in range(count)]


def test_a_rebuild_of_pending_attributes_takes_in_chunks_switched_under_it(tmp_path):
    """Another handle consolidates the log while this one replays it to rebuild its pending
    attribute updates (a tail reader's poll does, after its catch-up stepped over a switch): the
    replay meets replaced chunks (``LayoutChangedError``), takes in the new layout and starts over,
    instead of failing the reader's poll."""
    url = str(tmp_path / "store")
    writer = SegmentStore.open(url, log_rolling_size=256).segment("s", create=True)
    model = {}
    for i in range(60):
        writer.append([b"%d" % i], [(i % 7, i)])
        model[i % 7] = i
    other = SegmentStore.open(url, log_rolling_size=256).segment("s")
    assert other.get_attribute(0) == model[0]  # attributes loaded: the log replayed from offset 0
    log, real_batches, switched = other._log, other._log.batches, []

    def batches_after_a_switch(*args, **kwargs):
        if not switched:
            switched.append(writer.consolidate(2048))  # the chunks this replay planned are replaced
        return real_batches(*args, **kwargs)

    log.batches = batches_after_a_switch
    try:
        with other._lock:
            other._attributes._replay_from_tree(refresh_tree=True)
    finally:
        del log.batches
    assert switched and switched[0] > 0
    assert [other.get_attribute(k) for k in sorted(model)] == [model[k] for k in sorted(model)]
    assert [r.value for r in other.read(0, 100)] == [b"%d" % i for i in range(60)]


@pytest.mark.parametrize("backend", ["memory", "local"], indirect=True)
def test_a_handle_follows_consolidation_and_retention_that_a_read_of_its_own_met(storage_url):
    """A read that finds chunks gone reloads the byte stream's view on its own; every later
    lookup of the handle (start, time index, chunk list, readers) must follow that view, not
    fail for ever on the chunks it remembered (``LayoutChangedError`` on every call). (On object
    stores replaced chunks stay readable for the deletion grace: no read finds them gone.)"""
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, log_rolling_size=400) as a, \
            SegmentStore.open(url, storage_options=options, log_rolling_size=400) as b:
        writer = a.segment("u", create=True)
        for i in range(30):
            writer.append([b"%03d" % i + b"x" * 100], timestamp=1000 + i)
        follower = b.segment("u")
        assert [r.offset for r in follower.read(25, 2)] == [25, 26]
        assert writer.apply_retention(start_offset=6) > 0
        assert writer.consolidate(target_size=2000) > 0
        assert [r.offset for r in follower.read(10, 2)] == [10, 11]  # this read reloads b's view
        for _ in range(2):
            assert follower.start_offset == writer.start_offset
            assert follower.offset_for_timestamp(1012) == 12
            assert follower.chunk_offsets() == writer.chunk_offsets()
            assert follower.reader(timestamp=1011).read(timeout=5).offset == 11
