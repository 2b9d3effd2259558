"""Segments through the public API: appends, reads, attributes, conditional appends, reopening."""

from __future__ import annotations

import threading
import uuid

import pytest

from attrindex import AttributeUpdate, Record, SegmentStore, UpdateType
from attrindex.errors import (
    BadOffsetError,
    ConditionalUpdateError,
    InvalidInputError,
    RecordTruncatedError,
    SegmentNotFoundError,
    StorageError,
)
from attrindex.log.batch.compression import available_codecs


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture
def store(storage_url):
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options) as opened:
        yield opened


def reopen(storage_url, **options) -> SegmentStore:
    url, storage_options = storage_url
    return SegmentStore.open(url, storage_options=storage_options, **options)


def test_append_and_read_records(store):
    seg = store.segment("orders-0", create=True)
    first = seg.append([b"v1", Record(value=b"v2", key=b"k", timestamp=5, headers=[("h", b"x")])], timestamp=3)
    second = seg.append([b"v3"], timestamp=7)
    assert (first.first_offset, first.last_offset, second.first_offset, second.last_offset) == (0, 1, 2, 2)
    records = seg.read(0)
    assert [(r.offset, r.value, r.key, r.timestamp, r.headers) for r in records] == [
        (0, b"v1", None, 3, ()),
        (1, b"v2", b"k", 5, (("h", b"x"),)),
        (2, b"v3", None, 7, ()),
    ]
    assert [r.offset for r in seg.read(1, max_records=1)] == [1]
    assert seg.read(3) == []  # after the last
    assert (seg.start_offset, seg.next_offset) == (0, 3)


def test_missing_segment_and_bad_names(store):
    with pytest.raises(SegmentNotFoundError, match="nope"):
        store.segment("nope")
    for bad in ("", "a/_x", "_hidden", "a//b", "x.seg"):
        with pytest.raises(InvalidInputError):
            store.segment(bad, create=True)
    store.segment("a/b", create=True)
    store.segment("a", create=True)
    assert store.segments() == ["a", "a/b"]


def test_bad_input_is_rejected_before_anything_changes(store):
    seg = store.segment("s", create=True)
    with pytest.raises(InvalidInputError, match="nothing to append"):
        seg.append([])
    with pytest.raises(InvalidInputError):
        seg.append(["text is not bytes"])
    with pytest.raises(InvalidInputError):
        seg.append([b"x"], [AttributeUpdate(key(1), UpdateType.ACCUMULATE, value=None)])
    with pytest.raises(InvalidInputError):
        seg.append([b"x"], expected_offset=-1)
    with pytest.raises(InvalidInputError):
        seg.read(-1)
    assert seg.next_offset == 0


def test_reopen_sees_records_and_attributes(storage_url):
    with reopen(storage_url) as store:
        seg = store.segment("s", create=True)
        for i in range(20):
            seg.append([b"r%d" % i], [(key(i % 5), i)])
    with reopen(storage_url) as store:
        seg = store.segment("s")
        assert seg.next_offset == 20
        assert [r.value for r in seg.read(0, 100)] == [b"r%d" % i for i in range(20)]
        assert seg.get_attributes([key(i) for i in range(6)]) == [15, 16, 17, 18, 19, None]


def test_reopen_replays_the_log_after_the_checkpoint(storage_url):
    """Updates not yet merged into the B+tree come back from the log (no close = a crash)."""
    store = reopen(storage_url)
    seg = store.segment("s", create=True)
    seg.append([b"a"], [(key(1), 1), (key(2), 2)])
    seg.flush()
    seg.append([b"b"], [(key(2), None), (key(3), 3)])  # not flushed
    checkpoint = seg.stats().attribute_checkpoint
    with reopen(storage_url) as again:
        seg2 = again.segment("s")
        assert seg2.stats().attribute_checkpoint == checkpoint
        assert seg2.stats().pending_attributes == 2
        assert seg2.get_attributes([key(1), key(2), key(3)]) == [1, None, 3]
        assert list(seg2.attributes()) == [(key(1), 1), (key(3), 3)]


def test_attribute_scans_merge_tier1_over_the_tree(store):
    seg = store.segment("s", create=True)
    seg.update_attributes([(key(i), i) for i in range(0, 40, 2)])
    seg.flush()
    assert seg.stats().pending_attributes == 0
    seg.update_attributes([(key(4), None), (key(5), 55), (key(6), 66)])
    assert dict(seg.attributes(key(3), key(9))) == {key(5): 55, key(6): 66, key(8): 8}
    expected = {key(i): i for i in range(0, 40, 2)}
    expected.update({key(5): 55, key(6): 66})
    del expected[key(4)]
    assert dict(seg.attributes()) == expected
    assert [k for k, _ in seg.attributes()] == sorted(expected)


def test_attribute_only_append_keeps_offsets(store):
    seg = store.segment("s", create=True)
    seg.append([b"a"])
    result = seg.update_attributes([(key(1), 7)])
    assert (result.first_offset, result.last_offset, result.record_count) == (1, 0, 0)
    assert seg.append([b"b"]).first_offset == 1
    assert [r.value for r in seg.read(0)] == [b"a", b"b"]


# -- conditional appends -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "update_type, value, compare, start, passes, result",
    [
        (UpdateType.REPLACE, 5, None, None, True, 5),
        (UpdateType.REPLACE, None, None, 3, True, None),
        (UpdateType.REPLACE_IF_GREATER, 5, None, None, True, 5),
        (UpdateType.REPLACE_IF_GREATER, 5, None, 4, True, 5),
        (UpdateType.REPLACE_IF_GREATER, 5, None, 5, False, 5),
        (UpdateType.REPLACE_IF_GREATER, 5, None, 6, False, 6),
        (UpdateType.REPLACE_IF_EQUALS, 5, 4, 4, True, 5),
        (UpdateType.REPLACE_IF_EQUALS, 5, 4, 3, False, 3),
        (UpdateType.REPLACE_IF_EQUALS, 5, 4, None, False, None),
        (UpdateType.REPLACE_IF_EQUALS, 5, None, None, True, 5),
        (UpdateType.REPLACE_IF_EQUALS, 5, None, 1, False, 1),
        (UpdateType.REPLACE_IF_EQUALS, None, 4, 4, True, None),
        (UpdateType.ACCUMULATE, 5, None, None, True, 5),
        (UpdateType.ACCUMULATE, 5, None, 2, True, 7),
        (UpdateType.ACCUMULATE, 1, None, (1 << 63) - 1, False, (1 << 63) - 1),
        (UpdateType.NONE, 5, None, None, True, 5),
        (UpdateType.NONE, 5, None, 3, False, 3),
    ],
)
@pytest.mark.parametrize("flushed", [False, True], ids=["tier1", "btree"])
def test_conditional_append_semantics(store, update_type, value, compare, start, passes, result, flushed):
    """Each row of the semantics table, with the current value in tier 1 or in the B+tree."""
    seg = store.segment("s", create=True)
    if start is not None:
        seg.update_attributes([(key(1), start)])
    if flushed:
        seg.flush()
    before = seg.next_offset
    update = AttributeUpdate(key(1), update_type, value=value, compare=compare)
    if passes:
        appended = seg.append([b"x"], [update])
        assert appended.first_offset == before
    else:
        with pytest.raises(ConditionalUpdateError) as caught:
            seg.append([b"x"], [update])
        (failure,) = caught.value.failures
        assert failure.current == start
        assert seg.next_offset == before  # nothing appended
        assert seg.read(before) == []
    assert seg.get_attribute(key(1)) == result


def test_failed_append_names_every_failure_and_retry_is_not_double_counted(store):
    seg = store.segment("s", create=True)
    seg.update_attributes([(key(1), 10), (key(2), 20)])
    request = [
        AttributeUpdate(key(3), UpdateType.ACCUMULATE, value=5),
        AttributeUpdate(key(1), UpdateType.REPLACE_IF_EQUALS, value=11, compare=9),
        AttributeUpdate(key(2), UpdateType.NONE, value=1),
    ]
    with pytest.raises(ConditionalUpdateError) as caught:
        seg.append([b"x"], request)
    assert [(f.update.key, f.current) for f in caught.value.failures] == [(key(1), 10), (key(2), 20)]
    assert seg.get_attribute(key(3)) is None
    fixed = [request[0], AttributeUpdate(key(1), UpdateType.REPLACE_IF_EQUALS, value=11, compare=10)]
    seg.append([b"x"], fixed)
    assert seg.get_attributes([key(1), key(3)]) == [11, 5]
    with pytest.raises(ConditionalUpdateError):
        seg.append([b"y"], fixed)  # the same request again: compare no longer holds
    assert seg.get_attribute(key(3)) == 5  # and the accumulate did not apply twice


def test_expected_offset(store):
    seg = store.segment("s", create=True)
    seg.append([b"a"], expected_offset=0)
    with pytest.raises(BadOffsetError):
        seg.append([b"b"], expected_offset=0)
    with pytest.raises(BadOffsetError):
        seg.append([b"b"], expected_offset=5)
    assert seg.append([b"b"], expected_offset=1).first_offset == 1


def test_stale_handle_catches_up_and_revalidates(storage_url):
    """Two handles on one segment: each append checks the true state, whatever the handle saw."""
    with reopen(storage_url) as one, reopen(storage_url) as two:
        a = one.segment("s", create=True)
        b = two.segment("s")
        a.append([b"a0"], [AttributeUpdate(key(1), UpdateType.NONE, value=1)])
        with pytest.raises(ConditionalUpdateError):  # b has not seen a's append yet
            b.append([b"b0"], [AttributeUpdate(key(1), UpdateType.NONE, value=2)])
        assert b.append([b"b1"], [AttributeUpdate(key(1), UpdateType.ACCUMULATE, value=1)], expected_offset=1).first_offset == 1
        a.append([b"a1"], [AttributeUpdate(key(1), UpdateType.ACCUMULATE, value=1)])
        b.refresh()
        assert a.get_attribute(key(1)) == b.get_attribute(key(1)) == 3
        assert [r.value for r in b.read(0)] == [b"a0", b"b1", b"a1"]


@pytest.mark.parametrize("codec", ["none", "gzip"])
def test_a_stale_handle_resends_its_batch_renumbered(storage_url, codec):
    """A lost append race whose updates resolve the same again is resent by renumbering the encoded
    batch (rebase_batch), not by encoding it again: offsets, records and attributes come out right."""
    with reopen(storage_url, codec=codec) as one, reopen(storage_url, codec=codec) as two:
        a = one.segment("s", create=True)
        b = two.segment("s")
        b.refresh()
        a.append([b"a0", b"a1"], [(key(1), 10)])
        result = b.append([Record(b"b0", b"k", 5), b"b1"], [(key(2), 20)])  # b still thinks offset 0 is next
        assert (result.first_offset, result.last_offset) == (2, 3)
        a.refresh()
        assert [(r.value, r.offset) for r in a.read(0)] == [(b"a0", 0), (b"a1", 1), (b"b0", 2), (b"b1", 3)]
        assert a.read(2)[0].key == b"k" and a.read(2)[0].timestamp == 5
        assert a.get_attributes([key(1), key(2)]) == [10, 20]
    with reopen(storage_url) as again:  # and the log verifies from storage
        assert [r.value for r in again.segment("s").read(0)] == [b"a0", b"a1", b"b0", b"b1"]


def test_racing_threads_one_winner_per_round(storage_url):
    """Threads with their own handles race REPLACE_IF_EQUALS on one key: one winner per value."""
    stores = [reopen(storage_url) for _ in range(3)]
    stores[0].segment("s", create=True)
    wins: list[tuple[int, int]] = []

    def run(i: int) -> None:
        seg = stores[i].segment("s")
        for _ in range(6):
            while True:
                current = seg.get_attribute(key(0))
                try:
                    seg.append([b"%d" % i], [AttributeUpdate(key(0), UpdateType.REPLACE_IF_EQUALS, value=(current or 0) + 1, compare=current)])
                    wins.append((i, (current or 0) + 1))
                    break
                except ConditionalUpdateError:
                    continue

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(v for _, v in wins) == list(range(1, 19))
    seg = stores[0].segment("s")
    seg.refresh()
    assert seg.get_attribute(key(0)) == 18 and seg.next_offset == 18
    for s in stores:
        s.close()


@pytest.mark.parametrize("codec", sorted(c.name.lower() for c in available_codecs()))
def test_codecs(storage_url, codec):
    with reopen(storage_url, codec=codec) as store:
        seg = store.segment("s", create=True)
        seg.append([b"x" * 300, b"y" * 5], [(key(1), 1)])
        seg.append([b"z"], codec="none")
    with reopen(storage_url) as store:
        assert [r.value for r in store.segment("s").read(0)] == [b"x" * 300, b"y" * 5, b"z"]


def test_stats_and_uuid_keys(store):
    seg = store.segment("s", create=True)
    writer = uuid.uuid4()
    seg.append([b"a", b"b"], [(writer, 2)], timestamp=1000)
    stats = seg.stats()
    assert (stats.next_offset, stats.start_offset, stats.max_timestamp, stats.pending_attributes) == (2, 0, 1000, 1)
    assert seg.get_attribute(writer) == 2


def test_a_deleted_segment_leaves_nothing_that_a_new_one_of_its_name_would_see(storage_url):
    store = reopen(storage_url, log_rolling_size=300)
    seg = store.segment("s", create=True, cleanup_policy="compact")
    nested = store.segment("s/0", create=True)
    nested.append([b"nested"])
    for i in range(20):
        seg.append([Record(b"v%d" % i + b"." * 60, b"k%d" % (i % 3))], [(key(i % 4), i)], timestamp=1)
    seg.flush()
    seg.compact(min_lag_ms=0)  # a cleaner checkpoint and cleaned chunks
    seg.apply_retention(start_offset=5)
    assert {p.split("/", 1)[0] for p in store.storage.list_files("s")} >= {"_config", "_cleaner", "_log.seg"}
    store.delete_segment("s")
    assert {p.split("/", 1)[0] for p in store.storage.list_files("s")} == {"0"}  # the nested segment stays
    with pytest.raises(SegmentNotFoundError):
        store.segment("s")
    again = store.segment("s", create=True)
    assert (again.next_offset, again.start_offset, again.read(0)) == (0, 0, [])
    assert again.cleanup_policy().cleanup_policy == "delete"  # not the deleted segment's policy
    assert again.get_attributes([key(i) for i in range(4)]) == [None] * 4
    assert again.append([b"first"]).first_offset == 0
    assert [r.value for r in store.segment("s/0").read(0)] == [b"nested"]
    store.close()


def test_a_merge_in_flight_when_its_segment_is_deleted_writes_nothing_after_the_delete():
    """The handle's background merge is inside its write to the attributes' tree when the segment
    is deleted: the delete waits for it (the handle is closed first, so no new merge starts), and
    the name made again afterwards holds nothing of the deleted segment's."""
    from storage_adapters import open_storage

    from .test_merge_latency import GatedStorage

    storage = GatedStorage(open_storage(f"memory://delete-merge-{uuid.uuid4().hex}"), blocked="_attributes")
    store = SegmentStore(storage, flush_keys=10)
    seg = store.segment("s", create=True)
    seg.append([b"r"], [(key(i), i) for i in range(20)])  # over flush_keys: the merge starts and blocks
    assert storage.entered.wait(30), "the merge never reached the tree's storage"
    deleting = threading.Thread(target=store.delete_segment, args=("s",))
    deleting.start()
    deleting.join(0.3)
    assert deleting.is_alive(), "the delete went on while a merge of the segment was writing"
    storage.gate.set()
    deleting.join(30)
    assert not deleting.is_alive()
    assert store.storage.list_files("s") == {}
    with pytest.raises(InvalidInputError, match="closed"):
        seg.append([b"after"])
    again = store.segment("s", create=True)
    assert again.get_attributes([key(i) for i in range(20)]) == [None] * 20
    assert (again.next_offset, again.read(0)) == (0, [])
    store.close()


@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_a_delete_that_fails_part_way_raises_and_can_be_done_again(storage_url, backend):
    from storage_adapters import open_storage
    from storage_adapters.faults import FaultyStorage

    url, options = storage_url
    storage = FaultyStorage(open_storage(url, **options), seed=1)
    store = SegmentStore(storage)
    seg = store.segment("s", create=True, cleanup_policy="compact")
    seg.append([Record(b"old", b"k")], [(key(1), 1)])
    seg.flush()
    storage.script("fail_before", op="remove_directory", path_contains="_log")
    with pytest.raises(StorageError):
        store.delete_segment("s")
    store.segment("s")  # still there, to be deleted again
    store.delete_segment("s")
    assert store.segment("s", create=True).read(0) == []


def test_a_local_file_that_cannot_be_deleted_fails_the_delete(tmp_path):
    """``rm`` refused (an immutable file, a read-only mount, EACCES): the delete raises instead of
    reporting success over files that a segment made again under the name would serve."""
    import subprocess

    url = str(tmp_path / "store")
    with SegmentStore.open(url) as store:
        store.segment("s", create=True).append([b"acknowledged"])
    chunk = next(p for p in (tmp_path / "store" / "s" / "_log.seg").iterdir() if p.name.isdigit())
    made_immutable = subprocess.run(["chattr", "+i", str(chunk)], capture_output=True).returncode == 0
    if not made_immutable:  # without chattr (or not root): a directory without write permission
        chunk.parent.chmod(0o500)
    try:
        with SegmentStore.open(url) as store:
            with pytest.raises(StorageError, match="delete"):
                store.delete_segment("s")
            assert [r.value for r in store.segment("s").read(0)] == [b"acknowledged"]  # reported, not hidden
    finally:
        if made_immutable:
            subprocess.run(["chattr", "-i", str(chunk)], check=True)
        else:
            chunk.parent.chmod(0o700)
    with SegmentStore.open(url) as store:
        store.delete_segment("s")
        assert store.segment("s", create=True).read(0) == []


def test_stats_of_a_handle_whose_first_chunk_another_handle_truncated_away():
    """The handle's view still lists a first chunk that another handle's retention deleted (its
    offset index never built: the open started at the attributes' checkpoint, in a later chunk):
    ``stats`` reports the new start, as ``start_offset`` does, instead of a ``TruncatedError``."""
    url = f"memory://stats-start-{uuid.uuid4().hex}"
    writer = SegmentStore.open(url, log_rolling_size=300).segment("s", create=True)
    for i in range(30):
        writer.append([b"x" * 40], [(key(i % 3), i)], timestamp=i)
    writer.flush()  # the attributes cover every batch: a new handle's open scans from the last chunk
    other = SegmentStore.open(url, log_rolling_size=300).segment("s")
    writer.apply_retention(start_offset=20)
    assert other.stats().start_offset == writer.start_offset == other.start_offset > 0


def test_read_before_start_after_retention(store):
    seg = store.segment("s", create=True)
    for i in range(10):
        seg.append([b"%d" % i])
    seg.apply_retention(start_offset=4)
    assert seg.start_offset == 4
    with pytest.raises(RecordTruncatedError) as caught:
        seg.read(2)
    assert caught.value.start_offset == 4
    assert [r.offset for r in seg.read(4)] == list(range(4, 10))


def test_a_handle_that_only_reads_writes_nothing(storage_url):
    with reopen(storage_url) as store:
        seg = store.segment("s", create=True)
        seg.append([b"a"], [(key(1), 1)])  # left in tier 1: below every flush threshold
    with reopen(storage_url) as store:
        seg = store.segment("s")
        length = seg._attributes.tree._segment.length
        assert seg.read(0)[0].value == b"a" and seg.get_attribute(key(1)) == 1
        log_length = seg._log.bytes.length
    with reopen(storage_url) as store:  # closing the reader wrote no index update, no log bytes
        seg = store.segment("s")
        assert (seg._attributes.tree._segment.length, seg._log.bytes.length) == (length, log_length)


def test_a_batch_larger_than_the_read_window(store):
    """Batches bigger than the 1 MiB scan window are read whole (a read that waits for a batch to fit the window would loop forever)."""
    seg = store.segment("s", create=True)
    seg.append([b"x" * (3 << 20)])
    seg.append([b"y"])
    assert [len(r.value) for r in seg.read(0)] == [3 << 20, 1]
    seg.refresh()
    assert seg.reader(offset=1).read(timeout=0).value == b"y"


def test_opening_scans_past_a_big_batch(storage_url):
    with reopen(storage_url) as store:
        store.segment("s", create=True).append([b"x" * (3 << 20)], [(key(1), 1)])
    with reopen(storage_url) as store:
        seg = store.segment("s")
        assert seg.next_offset == 1 and seg.get_attribute(key(1)) == 1


def test_a_merge_that_another_handle_overtook_rebuilds_tier1(storage_url):
    """Checkpoints only move forward: a handle whose merge comes second keeps the newer values."""
    with reopen(storage_url) as one, reopen(storage_url) as two:
        a = one.segment("s", create=True)
        b = two.segment("s")
        a.update_attributes([(key(1), 1), (key(2), 2)])
        b.refresh()  # b's tier 1 now holds key 1 = 1 and key 2 = 2
        a.update_attributes([(key(1), 10), (key(3), 3)])
        a.flush()  # the tree now covers a's whole log, past what b has seen
        b.flush()  # must not write b's older key 1 = 1 over the tree
        assert b.stats().pending_attributes == 0
        assert b.get_attributes([key(1), key(2), key(3)]) == [10, 2, 3]
    with reopen(storage_url) as again:
        assert again.segment("s").get_attributes([key(1), key(2), key(3)]) == [10, 2, 3]


def test_writers_move_the_checkpoint_once_the_log_grew_a_chunk(tmp_path):
    """Without attribute updates, a closing writer still bounds how much opening must replay."""
    root = str(tmp_path / "store")
    with SegmentStore.open(root, log_rolling_size=4096) as store:
        seg = store.segment("s", create=True)
        seg.append([b"r"], [(key(1), 1)])
        seg.flush()
        first = seg.stats().attribute_checkpoint
        seg.append([b"r" * 100])  # less than a chunk more: not worth a write
        seg.flush()
        assert seg.stats().attribute_checkpoint == first
        for _ in range(60):
            seg.append([b"r" * 100])
    with SegmentStore.open(root, log_rolling_size=4096) as store:
        seg = store.segment("s")
        assert seg.stats().attribute_checkpoint == seg._log.position > first + 4096


def _records_as_rows(records) -> list[tuple]:
    return [(r.offset, r.timestamp, r.key, r.value, [{"key": k, "value": v} for k, v in r.headers]) for r in records]


def _table_rows(table) -> list[tuple]:
    columns = [table.column(n).to_pylist() for n in ("offset", "key", "value", "headers")]
    stamps = table.column("timestamp").cast("int64").to_pylist()
    return [(o, t, k, v, h) for o, t, (k, v, h) in zip(columns[0], stamps, zip(*columns[1:]))]


def test_read_arrow_gives_the_rows_read_gives(storage_url):
    """Arrow reads across chunks, from any offset, with a limit, over offsets that compaction
    left gaps in, and after retention, agree with ``read``."""
    pytest.importorskip("pyarrow")
    with reopen(storage_url, log_rolling_size=4096) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(60):
            seg.append([Record(b"v%d-%d" % (i, j) * (1 + j), b"k%d" % (j % 4), 1000 + i * 7 + j,
                               [("n", b"%d" % j)] if i % 7 == 0 else ()) for j in range(9)], timestamp=5)
        seg.append([Record(None, b"k1")], timestamp=9)  # a tombstone: a null value
        everything = seg.read(0, 10_000)
        assert _table_rows(seg.read_arrow()) == _records_as_rows(everything)
        for offset, limit in ((0, 1), (5, 17), (300, None), (540, 1000), (541, None)):
            assert _table_rows(seg.read_arrow(offset, limit)) == _records_as_rows(seg.read(offset, limit or 10_000))
        assert sum(b.num_rows for b in seg.arrow_batches(100, 200)) == 100
        assert seg.read_arrow().schema.names == ["offset", "timestamp", "key", "value", "headers"]
        seg.compact(min_lag_ms=0)
        compacted = seg.read(0, 10_000)
        assert len(compacted) < len(everything)  # offsets now jump over gaps
        assert _table_rows(seg.read_arrow()) == _records_as_rows(compacted)
        assert _table_rows(seg.read_arrow(compacted[1].offset - 1 if compacted[1].offset > 1 else 0, 3)) == \
            _records_as_rows(seg.read(compacted[1].offset - 1 if compacted[1].offset > 1 else 0, 3))
        seg.apply_retention(start_offset=300)
        with pytest.raises(RecordTruncatedError):
            seg.read_arrow(10)
        assert _table_rows(seg.read_arrow()) == _records_as_rows(seg.read(seg.start_offset, 10_000))
        with pytest.raises(InvalidInputError):
            seg.read_arrow(-1)
        with pytest.raises(InvalidInputError):
            seg.read_arrow(0, 0)
        with pytest.raises(InvalidInputError):  # checked at the call, before any iteration
            seg.arrow_batches(0, -5)
        with pytest.raises(RecordTruncatedError):
            seg.arrow_batches(10)


def test_append_arrow_writes_what_append_writes(store):
    """Records given as Arrow columns: the same records, offsets, attributes and condition
    failures as ``append`` with the same records; bad columns refused before anything is written."""
    pa = pytest.importorskip("pyarrow")
    import numpy as np

    rows = [(b"v%d" % i * (i % 3), None if i % 5 == 0 else b"k%d" % (i % 4), None if i % 7 == 0 else 1000 + i)
            for i in range(50)]
    by_rows, by_columns = store.segment("rows", create=True), store.segment("columns", create=True)
    attr = uuid.uuid4().bytes
    for seg, kind in ((by_rows, "rows"), (by_columns, "columns")):
        for first, update in ((0, AttributeUpdate(attr, UpdateType.REPLACE_IF_EQUALS, value=1, compare=None)),
                              (25, AttributeUpdate(attr, UpdateType.ACCUMULATE, value=5))):  # foreseen, then not
            part = rows[first:first + 25]
            if kind == "rows":
                seg.append([Record(v, k, t) for v, k, t in part], [update], timestamp=7)
            else:
                values, keys, stamps = zip(*part)
                seg.append_arrow(pa.array(values, pa.binary()), pa.array(keys, pa.binary()),
                                 pa.array(stamps, pa.int64()), [update], timestamp=7)
        stale = [AttributeUpdate(attr, UpdateType.REPLACE_IF_EQUALS, value=9, compare=1)]  # it is 6 now
        with pytest.raises(ConditionalUpdateError):
            if kind == "rows":
                seg.append([b"x"], stale)
            else:
                seg.append_arrow(pa.array([b"x"], pa.binary()), attribute_updates=stale)
    assert by_columns.read(0, 100) == by_rows.read(0, 100)
    assert by_columns.get_attributes([attr]) == by_rows.get_attributes([attr]) == [6]
    by_columns.append_arrow(pa.array([b"a", b"b"], pa.large_binary()), timestamps=np.array([1, 2], np.int64))
    assert [(r.value, r.timestamp) for r in by_columns.read(50, 10)] == [(b"a", 1), (b"b", 2)]
    for bad, message in (((pa.array([b"a", None], pa.binary()),), "must not be null"),
                         ((pa.array(["a"]),), "binary array"),
                         ((pa.array([b"a"], pa.binary()), pa.array([b"k", b"k"], pa.binary())), "keys has 2 items"),
                         ((pa.array([b"a"], pa.binary()), None, pa.array([1.5])), "int64")):
        with pytest.raises(InvalidInputError, match=message):
            by_columns.append_arrow(*bad)
    compacting = store.segment("compacting", create=True, cleanup_policy="compact")
    assert compacting.cleanup_policy().compacts
    with pytest.raises(InvalidInputError, match="no key"):
        compacting.append_arrow(pa.array([b"a", b"b"], pa.binary()), pa.array([b"k", None], pa.binary()))
    assert by_columns.next_offset == 52 and compacting.next_offset == 0


def test_a_reader_reads_arrow_batches_and_waits_at_the_tail(store):
    pytest.importorskip("pyarrow")
    seg = store.segment("s", create=True)
    for i in range(5):
        seg.append([b"%d-%d" % (i, j) for j in range(10)], timestamp=i)
    reader = seg.reader(offset=3)
    first = reader.read_arrow(max_records=20)
    assert first.column("offset").to_pylist() == list(range(3, 23)) and reader.position == 23
    assert reader.read().offset == 23  # record reads and Arrow reads share the position
    assert reader.read_arrow(max_records=5).column("offset").to_pylist() == list(range(24, 29))
    assert reader.read_arrow(timeout=0).column("value").to_pylist() == [b"%d-%d" % divmod(o, 10) for o in range(29, 50)]
    assert reader.read_arrow(timeout=0).num_rows == 0  # at the tail: nothing within the timeout
    appended = threading.Event()

    def append_later():
        appended.wait(10)
        seg.append([b"late"], timestamp=9)

    thread = threading.Thread(target=append_later)
    thread.start()
    appended.set()
    late = reader.read_arrow(timeout=60)  # woken by the append, long before the timeout
    thread.join()
    assert late.column("value").to_pylist() == [b"late"] and late.column("offset").to_pylist() == [50]
    reader.cancel()
    assert reader.read_arrow().num_rows == 0
