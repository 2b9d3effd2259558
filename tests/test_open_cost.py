"""Opening a segment on S3 costs a few requests, and reads never ask for files that do not exist.

Counted on moto's server through the s3fs client (testkit/s3_requests.py). S3 segments keep no
index files, so a cold read of a sealed chunk must not ask for one.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest

from attrindex import AttributeUpdate, SegmentStore, UpdateType
from attrindex.errors import ConditionalUpdateError, CorruptDataError, InvalidInputError, RecordTruncatedError
from attrindex.segment import Segment
from attrindex.listing import ListedStorage
from tests.conftest import make_s3_url
from testkit.s3_requests import counting


@pytest.fixture
def s3_url(s3_options):
    return make_s3_url(s3_options), s3_options


def _write(url, options, appends: int, name: str = "s") -> None:
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment(name, create=True)
        for i in range(appends):
            seg.append([b"r%d" % i], [(i, i)])
        seg.flush()  # the attributes' B+tree covers the log: opening replays nothing


@pytest.mark.parametrize("appends", [1, 40])
def test_opening_an_existing_segment_lists_once_and_reads_two_objects(s3_url, appends):
    url, options = s3_url
    _write(url, options, appends)
    store = SegmentStore.open(url, storage_options=options)
    opened = store.storage.requests  # this store's own client: every request it sent
    seg = store.segment("s")
    segment_open = store.storage.requests - opened
    assert opened.by_kind() == {"PUT": 0, "GET": 0, "LIST": 0, "HEAD": 1, "DELETE": 0}  # the store marker
    # One LIST of the segment's directory (marker, log, index files, gaps, B+tree), then one GET
    # of the log's last chunk (the next offset is in it). The attributes wait until needed.
    assert segment_open.by_kind() == {"PUT": 0, "GET": 1, "LIST": 1, "HEAD": 0, "DELETE": 0}
    before = store.storage.requests
    assert seg.next_offset == appends and [r.value for r in seg.read(appends - 1, 1)] == [b"r%d" % (appends - 1)]
    assert (store.storage.requests - before).by_kind()["LIST"] == 0  # records never load the attributes
    assert not seg._attributes.loaded
    before = store.storage.requests
    assert seg.get_attribute(appends - 1) == appends - 1
    # The first attribute read opens the B+tree (a live look at its directory, its footer) and
    # replays nothing: the tree covers the log. The next reads cost what they cost eagerly.
    assert (store.storage.requests - before).by_kind() == {"PUT": 0, "GET": 2, "LIST": 1, "HEAD": 0, "DELETE": 0}
    assert seg.get_attribute(0) == 0
    store.close()


def test_cold_reads_never_ask_for_chunk_index_files_s3_segments_do_not_have(s3_url):
    url, options = s3_url
    _write(url, options, 40)  # 40 chunk objects of one batch each: no index files
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        with counting(store.storage) as log:
            records = seg.read(0, 1000)
            assert [r.value for r in records] == [b"r%d" % i for i in range(40)]
            read = log.total
            assert seg.chunk_offsets() == [(i, i + 1) for i in range(40)]
        assert not [line for line in log.lines if "/_index/" in line[1]], log.lines
        assert set(log.counts) == {"GET"}, log.lines
        # The read: each chunk once, plus one per chunk the offset search summarises (was three:
        # the missing index file, a header, the scan). Summaries of the rest: one GET per chunk.
        assert read <= 40 + 8, log.lines
        assert log.total - read <= 40, log.lines


def test_index_files_that_exist_are_still_used(tmp_path):
    """Where sealed chunks hold several batches (local disk), a fresh handle reads their index files."""
    root = str(tmp_path / "store")
    with SegmentStore.open(root, log_rolling_size=300) as store:
        seg = store.segment("s", create=True)
        for i in range(60):
            seg.append([b"record %d" % i])
    with SegmentStore.open(root, log_rolling_size=300) as store:
        seg = store.segment("s")
        storage = seg._log.storage
        read = storage.read
        paths = []
        storage.read = lambda path, start, end: (paths.append(path), read(path, start, end))[1]
        try:
            assert [r.value for r in seg.read(0, 100)] == [b"record %d" % i for i in range(60)]
            offsets = seg.chunk_offsets()
        finally:
            del storage.read
        assert offsets[0][0] == 0 and offsets[-1][1] == 60 and len(offsets) > 3
        assert [p for p in paths if "/_index/" in p], paths


def test_opening_beside_a_writer_and_retention_sees_a_consistent_segment(s3_url):
    url, options = s3_url
    with SegmentStore.open(url, storage_options=options) as store:
        store.segment("s", create=True).append([b"0"])
    stop = threading.Event()
    errors = []

    def writer():
        try:
            with SegmentStore.open(url, storage_options=options) as own:
                seg, i = own.segment("s"), 1
                while not stop.is_set():
                    seg.append([b"%d" % i])
                    i += 1
                    if i % 5 == 0:
                        seg.apply_retention(start_offset=i - 3)  # deletes chunks under the openers
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        deadline = time.monotonic() + 3
        opens = 0
        while time.monotonic() < deadline:
            with SegmentStore.open(url, storage_options=options) as store:
                seg = store.segment("s")
                start = seg.start_offset
                try:
                    records = seg.read(start, 100)
                except RecordTruncatedError:  # retention moved on since: the clear error, not a wrong answer
                    records = seg.read(seg.start_offset, 100)
                    start = records[0].offset if records else start
                values = [int(r.value) for r in records]
                assert values == list(range(start, start + len(values)))
                assert seg.next_offset >= start + len(values)
                opens += 1
    finally:
        stop.set()
        thread.join(30)
    assert errors == [] and opens >= 3


def test_listed_storage_answers_each_directory_twice_at_most_then_lives(tmp_path):
    from storage_adapters import open_storage

    inner = open_storage(f"memory://listed-{id(tmp_path)}")
    inner.put_marker("seg/_log.seg/00000000000000000000")
    listing = inner.list_files("seg")
    inner.put_marker("seg/_log.seg/00000000000000000007")  # written after the listing
    listed = ListedStorage(inner, "seg", listing)
    old = {"00000000000000000000": 0}
    assert listed.list_files("seg/_log.seg") == old
    assert listed.list_files("seg/_log.seg") == old
    assert len(listed.list_files("seg/_log.seg")) == 2  # the third look is live
    assert listed.list_files("seg/_gaps") == {}
    assert listed.list_files("other") == {}  # outside the listing: live
    with pytest.raises(FileNotFoundError):
        listed.read("seg/_log.seg/00000000000000000099", 0, 1)
    assert listed.expired  # a listed view that misses a file is stale: everything is live now
    assert len(listed.list_files("seg/_gaps/")) == 0 and len(listed.list_files("seg")) == 2
    again = ListedStorage(inner, "seg", listing)
    again.put_marker("seg/_gaps/x")
    assert again.expired and "_gaps/x" in again.list_files("seg")


@pytest.mark.parametrize("backend", ["memory", "local", "s3"], indirect=True)
def test_a_stale_handle_reads_its_start_offset_after_retention_elsewhere(storage_url):
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, log_rolling_size=64) as writer_store, \
            SegmentStore.open(url, storage_options=options, log_rolling_size=64) as stale_store:
        writer = writer_store.segment("s", create=True)
        for i in range(20):
            writer.append([b"record %d" % i])
        writer.flush()  # the B+tree covers the log: the stale handle opens at its end, never reading chunk 0
        stale = stale_store.segment("s")  # opened before the retention below: its view starts at 0
        writer.apply_retention(start_offset=12)
        assert stale.start_offset in (0, 12)  # its view, or the new one after a look: not a raw TruncatedError
        assert [r.value for r in stale.read(12, 100)] == [b"record %d" % i for i in range(12, 20)]
        stale.refresh()
        assert stale.start_offset == writer.start_offset == 12


def test_a_segment_opened_from_one_listing_keeps_its_storage_s_nature_and_counters(s3_url):
    url, options = s3_url
    _write(url, options, 2)
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        storage = seg._log.bytes.storage
        assert isinstance(storage, ListedStorage) and storage.expired  # live once the open is over
        assert storage.deletion_grace == store.storage.deletion_grace  # not the base class's default
        assert storage.exclusive_create_enforced == store.storage.exclusive_create_enforced
        seg.append([b"first"])  # loads what a first append reads: the attributes, the cleanup policy
        before = store.storage.requests
        seg.append([b"one more"])
        assert (store.storage.requests - before).by_kind() == {"PUT": 1, "GET": 0, "LIST": 0, "HEAD": 0, "DELETE": 0}
        assert seg.stats().requests == store.storage.requests  # the store's counters, nothing counted twice


# -- lazily loaded attributes (object stores) ------------------------------------------------------
def _eager(store: SegmentStore, name: str = "s") -> Segment:
    """An eagerly opened handle on the same storage: the reference a lazy one must agree with."""
    return Segment(store.storage, name, store.options)


def _state(seg: Segment, keys) -> tuple:
    return seg.next_offset, seg.get_attributes(keys), list(seg.attributes())


@pytest.mark.parametrize("flush_elsewhere", [False, True])
def test_a_lazy_handle_sees_updates_appended_by_another_handle_after_it_opened(s3_url, flush_elsewhere):
    url, options = s3_url
    _write(url, options, 5)
    with SegmentStore.open(url, storage_options=options) as mine, \
            SegmentStore.open(url, storage_options=options) as theirs:
        lazy = mine.segment("s")
        other = theirs.segment("s")
        model = {i: i for i in range(5)}
        for i in range(5, 30):
            other.append([b"r%d" % i], [(i % 7, i)])
            model[i % 7] = i
            if i == 17:
                other.update_attributes({3: None})
                model.pop(3)
        if flush_elsewhere:
            other.flush()  # the tree now covers log bytes this handle has not seen
        # A reader moves the log's position past the updates before anything loads them: the
        # load must replay up to where the log is now, not where it was opened.
        lazy.refresh()  # (what a waiting reader's poll does)
        assert len(lazy.read(0, 100)) == 30 and not lazy._attributes.loaded
        keys = list(range(40))
        expected = [model.get(k) for k in keys]
        assert lazy.get_attributes(keys) == expected
        eager = _eager(mine)
        try:
            assert _state(lazy, keys) == _state(eager, keys)
        finally:
            eager.close()


def test_a_conditional_append_right_after_a_lazy_open_checks_the_stored_values(s3_url):
    url, options = s3_url
    _write(url, options, 3)  # attributes i -> i, merged into the B+tree
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        with pytest.raises(ConditionalUpdateError):
            seg.append([b"x"], [AttributeUpdate(1, UpdateType.REPLACE_IF_EQUALS, 5, compare=7)])
        assert seg.next_offset == 3  # refused: nothing appended
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        with pytest.raises(ConditionalUpdateError):
            seg.append([b"x"], [AttributeUpdate(2, UpdateType.NONE, 9)])  # present: create-only fails
        seg.append([b"x"], [AttributeUpdate(1, UpdateType.REPLACE_IF_EQUALS, 5, compare=1)])
        assert seg.get_attribute(1) == 5 and seg.next_offset == 4


def test_accumulate_right_after_a_lazy_open_adds_to_the_stored_and_replayed_value(s3_url):
    url, options = s3_url
    _write(url, options, 3)
    with SegmentStore.open(url, storage_options=options) as store:  # an update not merged: replayed on load
        store.segment("s").append([b"y"], [AttributeUpdate(2, UpdateType.ACCUMULATE, 10)])
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        seg.append([b"z"], [AttributeUpdate(2, UpdateType.ACCUMULATE, 100)])
        assert seg.get_attribute(2) == 112
    with SegmentStore.open(url, storage_options=options) as store:
        seg, eager = store.segment("s"), _eager(store)
        try:
            assert _state(seg, range(5)) == _state(eager, range(5)) and seg.get_attribute(2) == 112
        finally:
            eager.close()


@pytest.mark.parametrize("use", ["nothing", "records", "attributes"])
def test_closing_a_read_only_lazy_handle_writes_nothing(s3_url, use):
    url, options = s3_url
    _write(url, options, 4)
    with SegmentStore.open(url, storage_options=options) as store:
        store.segment("s").append([b"unmerged"], [(9, 9)])  # a writer left an update in the log only
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        if use == "records":
            seg.read(0, 10)
        elif use == "attributes":
            assert seg.get_attribute(9) == 9
        before = store.storage.requests
        seg.close()
        spent = (store.storage.requests - before).by_kind()
        assert spent["PUT"] == spent["DELETE"] == 0, spent
        if use != "attributes":
            with pytest.raises(InvalidInputError):  # closed: the attributes are not loaded any more
                seg.get_attribute(9)
            assert not seg._attributes.loaded


@pytest.mark.parametrize("read_first", [False, True])
def test_retention_in_another_handle_before_the_lazy_load(s3_url, read_first):
    url, options = s3_url
    _write(url, options, 10)
    with SegmentStore.open(url, storage_options=options) as mine, \
            SegmentStore.open(url, storage_options=options) as theirs:
        lazy = mine.segment("s")
        other = theirs.segment("s")
        model = {i: i for i in range(10)}
        for i in range(10, 20):
            other.append([b"r%d" % i], [(i % 4, -i)])
            model[i % 4] = -i
        assert other.apply_retention(start_offset=15) > 0  # merges first, then deletes the log under 15
        other.append([b"r20"], [(100, 1)])  # after the cut: only in the log
        model[100] = 1
        if read_first:  # the log's view moves past the cut and the updates before the load
            lazy.refresh()
            assert [r.offset for r in lazy.read(15, 100)] == list(range(15, 21))
        keys = sorted(model) + [55]
        assert lazy.get_attributes(keys) == [model.get(k) for k in keys]
        assert lazy.start_offset == 15 and lazy.next_offset == 21
        lazy.append([b"mine"], [AttributeUpdate(100, UpdateType.ACCUMULATE, 1)])
        assert lazy.get_attribute(100) == 2


def test_a_lazy_handle_raises_a_checkpoint_beyond_the_log_when_attributes_are_needed(s3_url):
    url, options = s3_url
    _write(url, options, 3)
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        eager = _eager(store)  # writes a tree claiming more log than there is, as damage would
        eager._attributes.tree.update_sorted([b"\x00" * 16], [1], checkpoint=10 ** 6)
        eager.close()
        assert [r.value for r in seg.read(0, 10)] == [b"r0", b"r1", b"r2"]  # records still read
        for _ in range(2):  # raised to each caller that needs attributes, never half-loaded
            with pytest.raises(CorruptDataError):
                seg.get_attribute(1)
        with pytest.raises(CorruptDataError):
            seg.append([b"x"], [(1, 2)])
        assert not seg._attributes.loaded


@pytest.mark.parametrize("tree_ahead", [True, False])
def test_retention_elsewhere_between_the_tree_s_open_and_the_replay(s3_url, tree_ahead):
    """Another process merges and cuts the log just after the lazy load opened the B+tree: with the
    tree ahead of this handle's view, the look at the log's tail finds the cut past the tree's
    checkpoint (the tree is re-read); with the view ahead, the replay meets deleted chunks."""
    url, options = s3_url
    _write(url, options, 10)
    with SegmentStore.open(url, storage_options=options) as mine, \
            SegmentStore.open(url, storage_options=options) as theirs:
        other = theirs.segment("s")
        model = {i: i for i in range(10)}
        if not tree_ahead:
            for i in range(10, 20):  # in the log only: the lazy load replays them
                other.append([b"r%d" % i], [(i % 4, -i)])
                model[i % 4] = -i
        lazy = mine.segment("s")
        if tree_ahead:
            for i in range(10, 20):
                other.append([b"r%d" % i], [(i % 4, -i)])
                model[i % 4] = -i
            other.flush()  # the tree covers log bytes past this handle's view
        opened = lazy._attributes._open_tree

        def racing():
            tree = opened()
            for i in range(20, 30):
                other.append([b"r%d" % i], [(50 + i % 3, i)])
                model[50 + i % 3] = i
            assert other.apply_retention(start_offset=28) > 0  # merges first, then cuts the log
            return tree

        lazy._attributes._open_tree = racing
        seen = dict(model)  # as of the lazy handle's view (20 records)
        keys = sorted(model) + [50, 51, 52, 99]
        first = lazy.get_attributes(keys)
        # Its view, or (where the cut forced a newer tree) the newer state: never a mix, never a loss.
        assert first in ([seen.get(k) for k in keys], [model.get(k) for k in keys])
        lazy.refresh()
        assert lazy.get_attributes(keys) == [model.get(k) for k in keys]
        assert (lazy.start_offset, lazy.next_offset) == (28, 30)


def test_threads_needing_the_attributes_at_once_load_them_once(s3_url):
    url, options = s3_url
    _write(url, options, 6)
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        lists = collections.Counter()
        inner = store.storage.list_files
        store.storage.list_files = lambda d: (lists.update([d]), inner(d))[1]
        barrier, results, errors = threading.Barrier(6), [], []

        def work(i):
            try:
                barrier.wait(5)
                if i % 3 == 0:
                    results.append(seg.append([b"t%d" % i], [AttributeUpdate(77, UpdateType.ACCUMULATE, 1)]))
                elif i % 3 == 1:
                    results.append(seg.get_attributes(range(6)))
                else:
                    results.append(seg.read(0, 3))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        del store.storage.list_files
        assert errors == []
        assert [r for r in results if isinstance(r, list) and r and isinstance(r[0], (int, type(None)))] == \
            [list(range(6))] * 2
        assert seg.get_attribute(77) == 2
        assert sum(n for d, n in lists.items() if "_attributes" in d) == 1, lists  # one load


def test_lazy_handles_agree_with_a_model_under_random_interleavings(s3_url):
    """Several handles (each opened lazily at a random moment) append, update, flush, cut and read
    in random order; after a refresh each one's attributes are the model's."""
    import random

    url, options = s3_url
    rng = random.Random(1212)
    model: dict[int, int] = {}
    stores = [SegmentStore.open(url, storage_options=options) for _ in range(3)]
    try:
        handles = [stores[0].segment("s", create=True), None, None]
        appended = 0
        for _step in range(60):
            i = rng.randrange(3)
            if handles[i] is None:
                handles[i] = stores[i].segment("s")  # lazily, at whatever the log holds now
                continue
            seg, op, key = handles[i], rng.random(), rng.randrange(8)
            if op < 0.45:
                seg.append([b"x"], [AttributeUpdate(key, UpdateType.ACCUMULATE, 1)])
                model[key] = model.get(key, 0) + 1
                appended += 1
            elif op < 0.55:
                seg.update_attributes({key: None})
                model.pop(key, None)
            elif op < 0.65:
                seg.flush()
            elif op < 0.72 and appended > 4:
                seg.refresh()
                seg.apply_retention(start_offset=seg.next_offset - 2)
            elif op < 0.85:
                seg.refresh()
                assert seg.get_attributes(range(8)) == [model.get(k) for k in range(8)]
            else:
                seg.refresh()
                seg.read(seg.start_offset, 5)  # records only: the attributes may still wait
        for seg in handles:
            if seg is not None:
                seg.refresh()
                assert dict((int.from_bytes(k, "big"), v) for k, v in seg.attributes()) == model
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize("kind,op", [("fail_before", "read"), ("bitflip_read", "read"), ("fail_before", "list_files")])
def test_a_fault_while_loading_the_attributes_fails_that_call_and_the_next_one_loads(s3_url, kind, op):
    from storage_adapters import open_storage
    from storage_adapters.errors import StorageError
    from storage_adapters.faults import FaultyStorage

    url, options = s3_url
    _write(url, options, 4)
    with SegmentStore.open(url, storage_options=options) as store:  # an update in the log only: replayed
        store.segment("s").append([b"more"], [(2, 20)])
    faulty = FaultyStorage(open_storage(url, **options), seed=12, rates={})
    with SegmentStore(faulty) as store:
        seg = store.segment("s")
        faulty.script(kind, op=op, path_contains="_attributes")
        try:  # the right values (a flipped bit found by a checksum, then read again) or a clear error
            first = seg.get_attributes(range(4))
        except (StorageError, CorruptDataError):
            assert not seg._attributes.loaded  # nothing half-loaded: the next call loads
            assert kind == "fail_before"
        else:
            assert first == [0, 1, 20, 3] and kind == "bitflip_read"
        assert faulty.injected
        assert seg.get_attributes(range(4)) == [0, 1, 20, 3]
        seg.append([b"after"], [AttributeUpdate(2, UpdateType.ACCUMULATE, 1)])
        assert seg.get_attribute(2) == 21


def test_the_first_append_after_open_needs_no_policy_lookup(s3_url):
    """A segment with no stored cleanup policy: the open's listing says so, so once the
    attributes are loaded the first append of records is one PUT (no LIST of ``_config/``)."""
    url, options = s3_url
    _write(url, options, 2)
    with SegmentStore.open(url, storage_options=options) as store:
        seg = store.segment("s")
        seg.get_attribute(b"k" * 16)  # the lazy attribute load, on its own
        before = store.storage.requests
        seg.append([b"first"])
        assert (store.storage.requests - before).by_kind() == {"PUT": 1, "GET": 0, "LIST": 0, "HEAD": 0, "DELETE": 0}
