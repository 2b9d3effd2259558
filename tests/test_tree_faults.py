"""The B+tree under faults: damaged footers and pages, bounded loops, readers during another process's
compaction, failed truncations, verify and repair."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import attrs
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attrindex import tree_index as tree_index_module
from attrindex.tree_index import TreeIndex
from attrindex.btree.runs import RunPolicy
from attrindex.btree import tree as btree
from attrindex.btree.footer import FOOTER_SIZE, Footer
from attrindex.btree.page import encode_index
from attrindex.errors import (
    AttrIndexError,
    BadOffsetError,
    CorruptDataError,
    OutcomeUnknownError,
    RetriesExhaustedError,
    StorageError,
    StorageFullError,
    TruncatedError,
)
from storage_adapters import RollingSegment, open_storage
from storage_adapters.faults import FaultyStorage

from attrindex.btree.framing import TREE_FRAMING

from .conftest import make_s3_url


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture(params=["memory", "local"])
def url(request, tmp_path):
    return f"memory://tree-faults-{uuid.uuid4().hex}" if request.param == "memory" else str(tmp_path / "store")


def flip(url: str, offset: int, name: str = "attributes") -> None:
    """Flip one bit of the byte at segment ``offset``, in place, behind every handle's back."""
    storage = open_storage(url)
    segment = RollingSegment(storage, name, framing=TREE_FRAMING)
    chunk = next(c for c in segment.chunks() if c.start <= offset < c.end)
    path = f"{name}.seg/{chunk.name}"
    if url.startswith("memory://"):
        buffer = storage.fs.store[storage._abs(path)].getbuffer()
        buffer[offset - chunk.start] ^= 0x10
        del buffer
    else:
        with open(os.path.join(url, path), "r+b") as f:
            f.seek(offset - chunk.start)
            byte = f.read(1)[0]
            f.seek(offset - chunk.start)
            f.write(bytes([byte ^ 0x10]))


def within(seconds: float, call):
    """Run ``call`` in a thread; fail the test if it does not finish in time (a hang)."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call} still running after {seconds} s: a hang"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# -- the newest footer -------------------------------------------------------------------------
@pytest.mark.parametrize("url", [f"memory://tree-faults-{uuid.uuid4().hex}"], ids=["memory"])
def test_damaged_newest_footer_is_corruption_on_open_and_on_reload(url):
    """Where a chunk's length is stored (memory, S3), bytes up to it are committed: a damaged
    newest footer is damage. (Local disk: the next test.)"""
    stale = TreeIndex.open(url, page_size=256)
    stale.update({k(i): 1 for i in range(100)})
    writer = TreeIndex.open(url, page_size=256)
    writer.update({k(i): 2 for i in range(100)})
    tail = writer._tree.state.footer_offset
    flip(url, tail + 30)  # inside the entry count
    with pytest.raises(CorruptDataError, match=f"newest footer at offset {tail}") as caught:
        TreeIndex.open(url, page_size=256)
    assert caught.value.offset == tail and "attributes.seg/" in str(caught.value)
    with pytest.raises(CorruptDataError, match=f"newest footer at offset {tail}"):
        stale.refresh()  # a handle that had the older version does not roll back to it either
    report = TreeIndex.verify_at(url)
    assert not report.ok
    assert any(d.start == tail and d.end == tail + FOOTER_SIZE and "newest footer" in d.reason for d in report.damage)


def test_damaged_newest_footer_on_local_disk_is_a_torn_update(tmp_path, caplog):
    """On local disk a chunk's committed end is the end of its chain of whole updates: a damaged
    newest footer with nothing valid after it cannot be told from an update torn by a crash
    (docs/decisions/0001), so the update is cut as torn: a fresh handle opens the version before
    it, verify finds nothing, and the next update zeroes the torn bytes with a warning (the
    documented newest-write rollback). A handle that had read the newer version as committed
    does not go back with it: it refuses."""
    url = str(tmp_path / "store")
    stale = TreeIndex.open(url, page_size=256)
    stale.update({k(i): 1 for i in range(100)})
    writer = TreeIndex.open(url, page_size=256)
    writer.update({k(i): 2 for i in range(100)})
    tail = writer._tree.state.footer_offset
    flip(url, tail + 30)  # inside the entry count
    reopened = TreeIndex.open(url, page_size=256)
    assert reopened.get_many([k(i) for i in range(100)]) == [1] * 100
    assert TreeIndex.verify_at(url).ok
    with pytest.raises(CorruptDataError, match="length went back"):
        writer.refresh()
    with caplog.at_level(logging.WARNING, logger="attrindex.storage"):
        stale.update({k(5): 3})
    assert any("torn write" in r.getMessage() for r in caplog.records)
    fresh = TreeIndex.open(url, page_size=256)
    assert fresh.get_many([k(4), k(5), k(6)]) == [1, 3, 1] and fresh.verify().ok


def test_damaged_tail_over_a_truncated_previous_version_raises_instead_of_hanging(url):
    # The previous footer's pages are below the truncation offset: a handle that fell back to it
    # would loop forever in get() (TruncatedError, reload, same state, ...).
    idx = TreeIndex.open(url, page_size=256, rolling_size=1024, compaction="pravega")
    step = 0
    while True:
        idx.update({k(i): step for i in range(step % 7, 300, 7)})
        step += 1
        state = idx._tree.state
        if idx._segment.start_offset == state.footer.min_offset > 0:
            break
    flip(url, state.footer_offset + 10)

    def read():
        reopened = TreeIndex.open(url, page_size=256, rolling_size=1024)
        return reopened.get(k(0))

    with pytest.raises(CorruptDataError, match="newest footer"):
        within(10, read)
    with pytest.raises(CorruptDataError, match="rebuilt from its source"):
        within(10, lambda: TreeIndex.repair_at(url))


# -- every loop bounded ------------------------------------------------------------------------
def _dangling_index(url: str) -> tuple[int, int]:
    """An index whose newest version routes to a page below the truncation offset, with a footer
    that claims otherwise (as damage could). Returns (dangling page offset, truncation offset)."""
    idx = TreeIndex.open(url, page_size=256, rolling_size=512, compaction="pravega")
    first = None
    for step in range(200):
        idx.update({k(i): step for i in range(step % 5, 200, 5)})
        if first is None:
            first = next((offset, length) for _, offset, length, page in idx._tree.pages() if page.is_leaf)
        if idx._segment.start_offset > first[0] + first[1]:
            break
    start = idx._segment.start_offset
    assert start > first[0]
    raw = RollingSegment(open_storage(url), "attributes", framing=TREE_FRAMING)
    at = raw.length
    page = encode_index([bytes(16), k(100)], [first[0], first[0]], [first[1], first[1]], [at, at], at)
    footer = Footer(at, len(page), 2, 10, 3, len(page) + 2 * first[1], at, -1, len(page) + FOOTER_SIZE)
    raw.append(page + footer.encode(at + len(page)), expected_offset=at)
    return first[0], start


def test_every_read_loop_over_a_page_that_is_gone_ends_in_corruption(url):
    dangling, start = _dangling_index(url)
    idx = TreeIndex.open(url, page_size=256, rolling_size=512, value_cache_entries=0)
    calls = {
        "get": lambda: idx.get(k(3)),
        "get_many": lambda: idx.get_many([k(i) for i in range(50)]),
        "items": lambda: list(idx.items()),
        "split_keys": lambda: idx.split_keys(8),
        "update": lambda: idx.update({k(3): 1}),
    }
    for name, call in calls.items():
        with pytest.raises(CorruptDataError, match=f"page at offset {dangling}") as caught:
            within(10, call)
        assert caught.value.offset == dangling, name
    report = idx.verify()
    assert any(d.start == dangling for d in report.damage)


def test_restarts_are_bounded_even_when_every_one_finds_a_newer_version(url):
    idx = TreeIndex.open(url, page_size=256, cache_bytes=0, value_cache_entries=0)
    idx.update({k(i): i for i in range(100)})
    tree = idx._tree
    reloads = []

    def always_gone(offset, length):
        raise TruncatedError("attributes", offset, length, offset + 1, offset + 2)

    def always_newer():  # a writer that compacts faster than any read completes
        reloads.append(1)
        tree._state = attrs.evolve(tree._state, length=tree._state.length + 1, root=None)
        return tree._state

    tree.reader.read_page, tree.reload = always_gone, always_newer
    tree._state = attrs.evolve(tree._state, root=None)
    for name, call in {"get": lambda: idx.get(1), "get_many": lambda: idx.get_many(range(50)),
                       "items": lambda: list(idx.items()), "split_keys": lambda: idx.split_keys(4)}.items():
        reloads.clear()
        with pytest.raises(RetriesExhaustedError, match="restarted 32 times"):
            within(10, call)
        assert len(reloads) == 32, name
    reloads.clear()
    with pytest.raises(RetriesExhaustedError, match="1000 times in a row"):
        within(30, lambda: idx.update({k(1): 5}))
    assert len(reloads) == 1000


def test_the_update_race_loop_is_bounded(url):
    idx = TreeIndex.open(url, page_size=256)
    idx.update({1: 1})

    def always_lose(data, expected_offset=None):
        raise BadOffsetError("attributes", expected_offset, expected_offset + 1)

    idx._segment.append = always_lose
    with pytest.raises(RetriesExhaustedError, match="lost the append race") as caught:
        within(30, lambda: idx.update({2: 2}))
    assert idx.get(2) is None


def test_the_relisting_loop_is_bounded(url):
    idx = TreeIndex.open(url, page_size=256)
    idx.update({1: 1})

    def always_racing():
        raise FileNotFoundError("a chunk vanished between listing and sizing it")

    idx._segment.refresh = always_racing
    with pytest.raises(RetriesExhaustedError, match="no consistent listing") as caught:
        within(10, idx.refresh)
    assert not isinstance(caught.value, FileNotFoundError)


# -- work after the durable point --------------------------------------------------------------
@pytest.mark.parametrize("fault", ["enospc", "fail_before", "lost_ack"])
def test_a_failed_truncation_does_not_fail_the_update_and_is_retried(url, caplog, fault):
    storage = FaultyStorage(open_storage(url), seed=1)
    idx = TreeIndex(storage, page_size=256, rolling_size=1024, compaction="pravega")
    storage.script(fault, op="put_marker", times=1000)  # every truncation fails at its marker
    with caplog.at_level(logging.WARNING, logger="attrindex.btree"):
        for step in range(60):
            assert idx.update({k(i): step for i in range(step % 9, 400, 9)})
    assert storage.injected
    if fault == "lost_ack":
        # The marker was written, only its answer lost: the storage layer reads it back and the
        # truncation counts as done, so nothing failed and nothing needs a retry.
        assert "truncating below offset" not in caplog.text and idx._segment.start_offset > 0
    else:
        assert "truncating below offset" in caplog.text
    storage.enabled = False
    idx.update({k(0): -1})  # the next update truncates: no chunk but the last lies below the live tree
    min_offset = idx._tree.state.footer.min_offset
    assert 0 < idx._segment.start_offset <= min_offset
    assert all(c.end > min_offset for c in idx._segment.chunks()[:-1])
    reopened = TreeIndex.open(url, page_size=256)
    assert reopened.get(0) == -1 and reopened.verify().ok


def test_failed_chunk_deletions_do_not_fail_the_update(url, caplog):
    storage = FaultyStorage(open_storage(url), seed=2)
    idx = TreeIndex(storage, page_size=256, rolling_size=1024, compaction="pravega")
    storage.script("fail_before", op="delete", times=1000)
    model = {}
    with caplog.at_level(logging.WARNING, logger="attrindex.btree"):
        for step in range(60):
            batch = {k(i): step for i in range(step % 9, 400, 9)}
            assert idx.update(batch)
            model.update(batch)
    assert storage.injected
    storage.enabled = False
    reopened = TreeIndex.open(url, page_size=256)
    assert dict(reopened.items()) == model and reopened.verify().ok


# -- readers during another process's compaction ------------------------------------------------
_UPDATER = textwrap.dedent("""
    import sys, time
    from attrindex.tree_index import TreeIndex
    directory, keys, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    index = TreeIndex.open(directory, page_size=256, rolling_size=2048)
    deadline, n = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        n += 1
        index.update({i: n for i in range(keys)})
    print(n)
""")


def test_readers_during_compacting_updates_see_one_version_at_a_time(tmp_path):
    directory, keys, seconds = str(tmp_path / "store"), 96, 3.0
    TreeIndex.open(directory, page_size=256, rolling_size=2048).update({i: 0 for i in range(keys)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    child = subprocess.Popen([sys.executable, "-c", _UPDATER, directory, str(keys), str(seconds)],
                             stdout=subprocess.PIPE, text=True, env=env)
    readers = [TreeIndex.open(directory, page_size=256, rolling_size=2048),
               TreeIndex.open(directory, page_size=256, rolling_size=2048, value_cache_entries=0, cache_bytes=0)]
    reads = wrong = scans = 0
    errors: list[str] = []
    newest = [0, 0]
    try:
        while child.poll() is None:
            for n, reader in enumerate(readers):
                try:
                    reader.refresh()
                    values = reader.get_many(range(keys))
                    reads += 1
                    version = values[0]
                    if version is None or set(values) != {version} or version < newest[n]:
                        wrong += 1
                        errors.append(f"get_many: {sorted(set(values), key=str)[:4]} after version {newest[n]}")
                    else:
                        newest[n] = version
                    one = reader.get(keys - 1)
                    if one is None or one < newest[n]:
                        wrong += 1
                        errors.append(f"get: {one} after version {newest[n]}")
                    if reads % 500 == 0:  # verify while the writer compacts: no false damage
                        try:
                            report = reader.verify()
                            if not report.ok:
                                wrong += 1
                                errors.append(f"verify: {report.damage[:2]}")
                        except StorageError as error:  # allowed: "changed under verification"
                            assert "changed under verification" in str(error), error
                    if reads % 10 == 0:
                        scanned = [value for _, value in reader.items()]
                        scans += 1
                        # A scan that outlives a truncation resumes from the newer version after
                        # its last key: values never go back along the scan.
                        if len(scanned) != keys or scanned != sorted(scanned) or scanned[0] < newest[n]:
                            wrong += 1
                            errors.append(f"items: {len(scanned)} entries, values {sorted(set(scanned))[:4]}")
                except Exception as error:  # noqa: BLE001 - counted and reported
                    wrong += 1
                    errors.append(f"{type(error).__name__}: {error}")
    finally:
        updates = int(child.communicate(timeout=60)[0] or 0)
    assert child.returncode == 0
    assert reads > 50 and updates > 20, f"too little concurrency: {reads} reads, {updates} updates"
    assert wrong == 0, f"{wrong} wrong answers in {reads} reads and {scans} scans during {updates} updates: {errors[:5]}"
    final = TreeIndex.open(directory, page_size=256)
    assert final.get_many(range(keys)) == [updates] * keys and final.verify().ok


@pytest.mark.parametrize("race", ["no chunks listed", "newest chunk missed"])
def test_a_listing_that_raced_a_truncation_is_taken_again(url, race):
    # What a reader's listing can see while another process rolls to a new chunk and truncates.
    writer = TreeIndex.open(url, page_size=256, rolling_size=1024)
    reader = TreeIndex.open(url, page_size=256, rolling_size=1024)
    for n in range(1, 60):
        writer.update({k(i): n for i in range(40)})
        if n in (10, 30):
            reader.refresh()
            stale = list(reader._segment.chunks()) if n == 10 else stale  # the view of version 10
    assert stale[-1].end < reader._tree.state.length
    segment, real_refresh, raced = reader._segment, reader._segment.refresh, []

    def racing_refresh():
        real_refresh()  # the newest truncation marker, and then ...
        if len(raced) < 2:
            raced.append(1)
            view = segment._handle.view
            segment._handle.view = attrs.evolve(view, chunks=() if race == "no chunks listed" else tuple(stale))

    segment.refresh = racing_refresh
    reader.refresh()
    assert reader.get_many(range(40)) == [59] * 40 and len(reader) == 40
    assert len(raced) == 2  # both raced listings were taken again


def _reader_behind_a_truncation(url):
    """A writer and a reader on one index: the reader holds version V; the writer then updates
    (compacting) until its truncation offset passes V's oldest page. Returns (writer, reader,
    V's chunks as the reader listed them)."""
    writer = TreeIndex.open(url, page_size=256, rolling_size=1024)
    reader = TreeIndex.open(url, page_size=256, rolling_size=1024, cache_bytes=0, value_cache_entries=0)
    writer.update({k(i): 0 for i in range(40)})
    reader.refresh()
    held = reader._tree.state
    listed = tuple(reader._segment.chunks())
    for n in range(1, 200):
        writer.update({k(i): n for i in range(40)})
        if writer._segment.start_offset > held.footer.min_offset:
            break
    assert writer._segment.start_offset > held.footer.min_offset
    return writer, reader, listed


def test_a_listing_with_a_newer_truncation_but_the_held_length_is_taken_again(url):
    """A listing can take the writer's newest truncation marker but miss its newest chunks: the
    length the reader holds, with its pages below the truncation offset. ``reload`` takes it
    again (as for a new version) and adopts the writer's version, instead of keeping the one whose
    pages are gone; a restart of a read then needs ONE reload."""
    writer, reader, listed = _reader_behind_a_truncation(url)
    segment, real_refresh, raced = reader._segment, reader._segment.refresh, []

    def racing_refresh():
        real_refresh()  # the newest truncation marker, and then the chunks of the held version
        if not raced:
            raced.append(1)
            segment._handle.view = attrs.evolve(segment._handle.view, chunks=listed)

    segment.refresh = racing_refresh
    reloads, real_reload = [], reader._tree.reload
    reader._tree.reload = lambda: reloads.append(1) or real_reload()
    assert reader.get_many(range(40)) == [writer.get(k(0))] * 40
    assert raced and len(reloads) == 1  # the read's restart: its one reload took the listing again
    assert reader._tree.state.length == writer._tree.state.length


def test_pages_of_the_newest_version_below_the_truncation_offset_are_damage_after_one_reload(url):
    """Truncated past the newest version's pages with no newer version (as damage could): a reload
    reports it (``CorruptDataError``) rather than keeping a version whose pages are gone, and a
    read's restart calls reload once, not once per listing."""
    writer = TreeIndex.open(url, page_size=256, rolling_size=1024)
    for n in range(30):
        writer.update({k(i): n for i in range(40)})
    state = writer._tree.state
    reader = TreeIndex.open(url, page_size=256, rolling_size=1024, cache_bytes=0, value_cache_entries=0)
    raw = RollingSegment(open_storage(url), "attributes", framing=TREE_FRAMING)
    raw.truncate(state.footer.min_offset + 1)  # no newer version: the oldest page is cut
    with pytest.raises(CorruptDataError, match="below the truncation offset"):
        within(10, reader.refresh)
    reloads, real_reload = [], reader._tree.reload
    reader._tree.reload = lambda: reloads.append(1) or real_reload()
    with pytest.raises(CorruptDataError):
        within(10, lambda: reader.get_many(range(40)))
    assert len(reloads) == 1


# -- verify and repair -------------------------------------------------------------------------
def _versions(url: str, count: int, **options) -> TreeIndex:
    idx = TreeIndex.open(url, page_size=256, **options)
    for n in range(1, count + 1):
        idx.update({k(i): n * 1000 + i for i in range(0, 120, n)})
    return idx


def test_verify_reports_every_damaged_range(url):
    idx = _versions(url, 6, compaction=False)
    dead_page = 0  # the first update's first leaf: rewritten by the second update
    live_leaf = max(offset for _, offset, _, page in idx._tree.pages() if page.is_leaf)
    assert idx.verify().ok
    flip(url, dead_page + 20)
    flip(url, live_leaf + 14)
    report = TreeIndex.verify_at(url)
    assert not report.ok
    starts = sorted(d.start for d in report.damage)
    assert dead_page in starts and live_leaf in starts, report.damage
    assert all(d.where.startswith("attributes.seg/") and d.end > d.start for d in report.damage)


def test_verify_reports_a_damaged_footer_in_the_middle_of_the_chain(url):
    idx = _versions(url, 4, compaction=False)
    newest = idx._tree.state.footer
    middle = idx._tree.state.length - newest.update_length - FOOTER_SIZE  # the previous update's footer
    flip(url, middle + 12)
    report = TreeIndex.verify_at(url)
    assert [(d.start, d.end) for d in report.damage] == [(middle, middle + FOOTER_SIZE)], report.damage
    assert report.entries == len(idx) and report.updates == 3  # the other three footers chain


def test_repair_rolls_back_to_the_newest_intact_version_and_says_what_was_lost(url, caplog):
    idx = _versions(url, 4, compaction=False)
    state = idx._tree.state
    before = TreeIndex.open(url, page_size=256)
    previous_end = state.length - state.footer.update_length
    # The version before the last: what a rollback of one update must give back.
    expected = {k(i): 3000 + i for i in range(0, 120, 3)}
    for i in range(0, 120, 2):
        expected.setdefault(k(i), 2000 + i)
    for i in range(120):
        expected.setdefault(k(i), 1000 + i)
    previous_items = sorted(expected.items())
    assert idx.repair().rolled_back is False  # intact: nothing to do
    flip(url, state.footer.root_offset + 20)  # the newest root: only the last version is damaged
    with caplog.at_level(logging.WARNING, logger="attrindex.btree"):
        report = TreeIndex.repair_at(url)
    assert report.rolled_back and report.updates_dropped == 1
    assert (report.lost_start, report.lost_end) == (previous_end, state.length)
    assert (report.entries_before, report.entries_after) == (120, 120)
    assert "rolling back" in caplog.text
    repaired = TreeIndex.open(url, page_size=256)
    assert sorted(repaired.items()) == previous_items and repaired.verify().ok
    before.refresh()
    assert before.get_many([k(i) for i in range(120)]) == [value for _, value in previous_items]
    repaired.update({k(0): 7})
    assert TreeIndex.open(url, page_size=256).get(0) == 7 and repaired.verify().ok


def test_repair_of_a_first_update_goes_back_to_empty(url):
    idx = TreeIndex.open(url, page_size=256)
    idx.update({k(i): i for i in range(10)})
    flip(url, idx._tree.state.footer.root_offset + 20)  # its only page: the footer after it is whole
    report = TreeIndex.repair_at(url)
    assert report.rolled_back and report.kept_footer_offset == -1 and report.entries_after == 0
    assert report.entries_before == 10 and report.updates_dropped == 1  # its footer still tells
    reopened = TreeIndex.open(url, page_size=256)
    assert len(reopened) == 0 and reopened.verify().ok
    reopened.update({k(1): 1})
    assert TreeIndex.open(url).get(1) == 1


# -- bit flips in live pages -------------------------------------------------------------------
def test_a_bit_flipped_on_read_is_corruption_never_a_wrong_value(url):
    storage = FaultyStorage(open_storage(url), seed=3)
    idx = TreeIndex(storage, page_size=256)
    idx.update({k(i): i for i in range(300)})
    cold = TreeIndex(storage, page_size=256, cache_bytes=0, value_cache_entries=0)
    reads = {"get": lambda: cold.get(k(150)), "get_many": lambda: cold.get_many([k(i) for i in range(300)]),
             "items": lambda: list(cold.items()), "items from a key": lambda: list(cold.items(k(100), k(200))),
             "split_keys": lambda: cold.split_keys(4)}
    for name, read in reads.items():
        storage.script("bitflip_read", op="read", path_contains="attributes.seg/")
        with pytest.raises(CorruptDataError, match="checksum mismatch"):
            within(10, read)
        assert storage.pending_scripts() == 0, name
    assert cold.get(k(150)) == 150 and list(cold.items()) == [(k(i), i) for i in range(300)]
    # The newest footer, read on open: a bad footer is read again (as a listing that raced a
    # truncation would be), so a flip on the way is not taken for damage at rest.
    storage.script("bitflip_read", op="read", path_contains="attributes.seg/")
    opened = TreeIndex(storage, page_size=256)
    assert storage.pending_scripts() == 0 and opened.get(k(7)) == 7 and len(opened) == 300



def test_a_flipped_bit_in_a_live_page_is_corruption_on_every_read_that_meets_it(url):
    idx = TreeIndex.open(url, page_size=256)
    idx.update({k(i): i for i in range(300)})
    leaf = next((offset, page) for _, offset, _, page in idx._tree.pages() if page.is_leaf and len(page.keys) > 2)
    key = leaf[1].keys[1]
    flip(url, leaf[0] + 40)
    cold = TreeIndex.open(url, page_size=256, cache_bytes=0, value_cache_entries=0)
    for read in (lambda: cold.get(key), lambda: cold.get_many([key]), lambda: list(cold.items()),
                 lambda: list(cold.items(key, None))):
        with pytest.raises(CorruptDataError, match=f"offset {leaf[0]}"):
            within(10, read)


# -- any flipped bit: reported by verify, never a wrong answer, repaired to an older version -----
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_flipped_bit_anywhere_is_reported_never_answered_around_and_repair_restores_a_version(data):
    url = f"memory://tree-flip-{uuid.uuid4().hex}"
    idx = TreeIndex.open(url, page_size=256, rolling_size=2048, compaction=data.draw(st.sampled_from(["pravega", True, False])))
    model: dict[bytes, int] = {}
    versions = {-1: {}}  # footer offset -> the model as of that version
    for _ in range(data.draw(st.integers(1, 12))):
        batch = data.draw(st.dictionaries(st.integers(0, 150).map(k), st.none() | st.integers(-5, 5), min_size=1, max_size=40))
        idx.update(batch)
        for key, value in batch.items():
            model.pop(key, None) if value is None else model.__setitem__(key, value)
        versions[idx._tree.state.footer_offset] = dict(model)
    segment = idx._segment
    segment.refresh()
    assume(segment.length > 0)
    offset = data.draw(st.integers(segment.start_offset, segment.length - 1))
    flip(url, offset)

    report = TreeIndex.verify_at(url)
    assert any(d.start <= offset < d.end for d in report.damage), (offset, report.damage)
    try:  # every answer is the newest version's, or a CorruptDataError
        reader = TreeIndex.open(url, page_size=256, cache_bytes=0, value_cache_entries=0)
        for key in map(k, range(0, 151, 7)):
            try:
                assert reader.get(key) == model.get(key)
            except CorruptDataError:
                pass
        assert list(reader.items()) == sorted(model.items())
    except CorruptDataError:
        pass
    try:
        repaired = TreeIndex.repair_at(url)
    except CorruptDataError as error:
        assert "rebuilt from its source" in str(error)
        return
    after = TreeIndex.open(url, page_size=256, cache_bytes=0)
    assert dict(after.items()) == versions[repaired.kept_footer_offset]
    report = after.verify()
    # Damage in a dead page of the kept version's past stays until compaction truncates it.
    assert all(d.end <= repaired.kept_footer_offset or d.start >= repaired.lost_end for d in report.damage) or report.ok


# -- random storage faults: an update that fails did not happen ----------------------------------
def test_updates_under_random_storage_faults_are_applied_exactly_when_they_say(url):
    storage = FaultyStorage(open_storage(url), seed=1, rates={
        "fail_before": 0.03, "enospc": 0.03, "lost_ack": 0.03, "torn": 0.03, "bitflip_read": 0.02})
    idx = None
    outcomes: list[tuple[int, dict[bytes, int], str]] = []
    for n in range(1, 241):
        batch = {k((n * 7 + i) % 60): n for i in range(5)}
        try:
            if idx is None:
                idx = TreeIndex(storage, page_size=256, rolling_size=2048, cache_bytes=0, value_cache_entries=0)
            idx.update(batch)
            outcomes.append((n, batch, "ok"))
        except OutcomeUnknownError:
            outcomes.append((n, batch, "unknown"))
        except AttrIndexError as error:
            assert not isinstance(error, CorruptDataError) or storage.injected[-1].kind == "bitflip_read", error
            outcomes.append((n, batch, "failed"))
            idx = None if isinstance(error, CorruptDataError) else idx  # a flipped read: open afresh
    storage.enabled = False
    assert {o for _, _, o in outcomes} >= {"ok", "failed"} and len(storage.injected) > 20
    final = dict(TreeIndex(storage, page_size=256).items())
    for key in map(k, range(60)):
        touched = [(n, outcome) for n, batch, outcome in outcomes if key in batch]
        last_ok = max((n for n, outcome in touched if outcome == "ok"), default=None)
        allowed = {last_ok} | {n for n, outcome in touched if outcome == "unknown" and (last_ok is None or n > last_ok)}
        assert final.get(key) in allowed, (key, final.get(key), touched[-5:])
    assert TreeIndex(storage, page_size=256).verify().ok


def test_damaged_tail_verify_and_repair_on_s3(s3_options):
    url = make_s3_url(s3_options)
    idx = TreeIndex.open(url, storage_options=s3_options, page_size=256)
    for n in range(1, 4):
        idx.update({k(i): n for i in range(0, 60, n)})
    raw = RollingSegment(open_storage(url, **s3_options), "attributes")
    at = raw.append(b"not a footer" * 10)  # a whole object: committed, so damage, not a torn tail
    with pytest.raises(CorruptDataError, match="newest footer"):
        TreeIndex.open(url, storage_options=s3_options)
    report = TreeIndex.verify_at(url, storage_options=s3_options)
    assert [(d.start, d.end) for d in report.damage] == [(at + 120 - FOOTER_SIZE, at + 120)]
    repaired = TreeIndex.repair_at(url, storage_options=s3_options)
    assert repaired.rolled_back and repaired.updates_dropped == 1 and repaired.lost_start == at
    reopened = TreeIndex.open(url, storage_options=s3_options)
    assert reopened.get_many([k(0), k(1), k(3)]) == [3, 1, 3] and reopened.verify().ok


@pytest.mark.parametrize("fault", ["lost_ack", "torn", "fail_before"])
def test_an_update_whose_append_failed_ambiguously_is_applied_once_or_not_at_all(url, fault):
    storage = FaultyStorage(open_storage(url), seed=4)
    idx = TreeIndex(storage, page_size=256)
    idx.update({k(i): 1 for i in range(50)})
    storage.script(fault, op="append")
    try:
        idx.update({k(i): 2 for i in range(50)})
        applied = True
    except StorageError as error:
        assert not isinstance(error, OutcomeUnknownError), "read-back settles what is stored"
        applied = False
    assert storage.injected and applied == (fault == "lost_ack")
    idx.update({k(60): 3})  # the handle goes on from what is stored
    reopened = TreeIndex(storage, page_size=256)
    assert reopened.get_many([k(0), k(49), k(60)]) == [2 if applied else 1] * 2 + [3]
    report = reopened.verify()
    assert report.ok and report.updates == (3 if applied else 2)  # never twice


# -- updates in pieces -------------------------------------------------------------------------
def _lay_out(path: str, monkeypatch) -> str:
    """Make updates take ``path``: the copy-on-write rewrite of the leaves they touch, the
    rebuild of the whole tree (a dense batch: ``btree.tree.DENSE_PAGES_PER_KEY`` and
    ``DENSE_MIN_PAGES``, lowered here for small trees), or a sorted run beside a non-empty
    tree (every ``TreeIndex`` opened writes runs into a tree of one entry or more)."""
    monkeypatch.setattr(btree, "DENSE_PAGES_PER_KEY", 0 if path == "rewrite" else 1 << 30)
    monkeypatch.setattr(btree, "DENSE_MIN_PAGES", 0)
    if path == "run":
        monkeypatch.setattr(tree_index_module, "RunPolicy", lambda _entries, _share: RunPolicy(1, 1.0))
    return path


@pytest.fixture(params=["rewrite", "rebuild", "run"])
def merge_path(request, monkeypatch):
    """The three ways an update is laid out (``_lay_out``). The updates below are dense;
    "rewrite" takes them through the rewrite all the same."""
    return _lay_out(request.param, monkeypatch)


@pytest.fixture(params=["rewrite", "rebuild"])
def tree_path(request, monkeypatch):
    """The two ways an update is laid out into the main tree (``_lay_out``)."""
    return _lay_out(request.param, monkeypatch)


def test_an_update_in_pieces_that_stops_at_any_append_leaves_the_version_before_it(storage_url, merge_path):
    """Every append of an update but its last is a piece that no version references: wherever
    the update stops, the index reads and verifies as before it, and takes the next update."""
    url, options = storage_url
    storage = FaultyStorage(open_storage(url, **options), seed=1)
    idx = TreeIndex(storage, page_size=256, piece_size=2048)
    before = {k(i): i for i in range(0, 400, 2)}
    idx.update(before)
    new = {k(i): -i for i in range(0, 400, 3)}
    op = "append" if storage.appendable else "create"
    stopped = 0
    while True:
        storage.script("fail_before", op=op, after=stopped)
        try:
            idx.update(new)
        except StorageError:
            stopped += 1
            storage.cancel_scripts()
            reader = TreeIndex(open_storage(url, **options), page_size=256)
            assert dict(reader.items()) == before
            assert reader.verify().ok
            continue
        assert storage.cancel_scripts() == 1  # it made fewer appends than the script let through
        break
    assert stopped >= 3, "the update was not written in pieces"
    reader = TreeIndex(open_storage(url, **options), page_size=256)
    assert dict(reader.items()) == {**before, **new}
    report = reader.verify()
    assert report.ok and len(reader) == len({**before, **new}) and report.entries == reader.stats().entry_count


def test_a_writer_that_appends_between_two_pieces_makes_the_update_start_over(url, monkeypatch, merge_path):
    """The pieces of an update are appended back to back or not at all: another writer's update
    in between (built on the version the pieces restate) makes the first one start over from
    the newer version, so neither update is lost."""
    a = TreeIndex(open_storage(url), page_size=256, piece_size=1024)
    a.update({k(i): i for i in range(600)})
    b = TreeIndex(open_storage(url), page_size=256)
    assert b.get(k(0)) == b.get(k(0)) == 0  # now in b's recent values (the first read decoded the root)
    appends = []
    append = a._tree.segment.append

    def then_b_writes(data, **kwargs):
        appends.append(len(data))
        if len(appends) == 2:  # after a's first piece
            hits = b.stats().value_cache_hits
            b.refresh()  # adopts the piece's footer: the same version, so b keeps its recent values
            assert b.get(k(0)) == 0 and b.stats().value_cache_hits == hits + 1
            b.update({k(0): 1000, k(1): 1001, k(700): 700})
        return append(data, **kwargs)

    monkeypatch.setattr(a._tree.segment, "append", then_b_writes)
    a.update({k(i): -i for i in range(0, 600, 3)})
    assert len(appends) > 4  # pieces, a lost one, then all of them again
    expected = {k(i): i for i in range(600)}
    expected.update({k(1): 1001, k(700): 700})
    expected.update({k(i): -i for i in range(0, 600, 3)})  # a committed last: its k(0) wins
    reader = TreeIndex(open_storage(url), page_size=256)
    assert dict(reader.items()) == expected and reader.verify().ok


def test_verify_checks_the_pages_of_pieces_and_not_the_bytes_a_repair_abandoned(url, tree_path):
    idx = TreeIndex(open_storage(url), page_size=256, piece_size=1024, compaction=False)
    idx.update({k(i): i for i in range(300)})  # pieces, then the last append
    first_leaf = 0  # in the first piece: referenced by the tree
    assert idx.verify().ok and idx.stats().updates_written == 1
    idx.update({k(i): -i for i in range(300)})  # rewrites every leaf: the first piece is dead now
    flip(url, first_leaf + 20)
    report = TreeIndex.verify_at(url)
    assert [d.start for d in report.damage] == [first_leaf], report.damage


@pytest.mark.parametrize("fault", ["torn", "enospc", "lost_ack"])
def test_an_update_in_pieces_meeting_a_fault_at_any_append_is_applied_once_or_not_at_all(tmp_path, fault, merge_path):
    """A torn write or a full disk at any append of an update in pieces leaves the version before
    it (the torn bytes are cut); a lost acknowledgement is settled by reading back and the update
    goes on, applied once."""
    url = str(tmp_path / "store")
    storage = FaultyStorage(open_storage(url), seed=2)
    idx = TreeIndex(storage, page_size=256, piece_size=1024)
    before = {k(i): i for i in range(0, 400, 2)}
    idx.update(before)
    new = {k(i): -i for i in range(0, 400, 3)}
    hit = 0
    for after in range(8):
        storage.script(fault, op="append", after=after)
        try:
            idx.update(new)
            applied = True
        except StorageError as error:
            assert not isinstance(error, OutcomeUnknownError)
            applied = False
        injected = storage.cancel_scripts() == 0
        hit += injected
        reader = TreeIndex(open_storage(url), page_size=256)
        assert dict(reader.items()) == ({**before, **new} if applied else before)
        assert reader.verify().ok
        assert applied == (fault == "lost_ack" or not injected), (fault, after)
        if applied:
            before = {**before, **new}
            new = {key: value - 1 for key, value in new.items()}  # something to write next time
    assert hit >= 4, "the faults did not meet the pieces of the updates"


def test_a_piece_whose_outcome_stays_unknown_fails_the_update_which_is_not_applied(url, monkeypatch, merge_path):
    """The byte stream could not settle whether a piece landed: whatever it did, no footer refers
    to it, so the update is simply not applied (``StorageError``, not an unknown outcome)."""
    idx = TreeIndex(open_storage(url), page_size=256, piece_size=1024)
    before = {k(i): i for i in range(300)}
    idx.update(before)
    append, calls = idx._tree.segment.append, []

    def unsettled(data, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            append(data, **kwargs)
            raise OutcomeUnknownError("the answer was lost and reading back failed")
        return append(data, **kwargs)

    monkeypatch.setattr(idx._tree.segment, "append", unsettled)
    with pytest.raises(StorageError, match="the update was not applied") as raised:
        idx.update({k(i): -i for i in range(300)})
    assert not isinstance(raised.value, OutcomeUnknownError)
    monkeypatch.undo()
    assert dict(TreeIndex(open_storage(url), page_size=256).items()) == before
    idx.update({k(0): 5})  # the handle goes on from what is stored
    reader = TreeIndex(open_storage(url), page_size=256)
    assert dict(reader.items()) == {**before, k(0): 5} and reader.verify().ok
