"""AttributeIndex behaviour (keys and values, phases of random work, closed handles) and the
B+tree's beneath it (``TreeIndex``: compaction, recovery, caching, checkpoints). The write-ahead
log in front of the tree is tested in test_index_wal.py."""

from __future__ import annotations

import random
import threading
import uuid

import pytest

from attrindex.attribute_index import AttributeIndex
from attrindex.tree_index import TreeIndex
from attrindex.btree.page import leaf_capacity
from attrindex.errors import CorruptDataError, InvalidInputError, InvalidKeyError, InvalidValueError
from storage_adapters import RollingSegment, open_storage


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture(params=["memory", "local"])
def url(request, tmp_path):
    return f"memory://index-{uuid.uuid4().hex}" if request.param == "memory" else str(tmp_path / "store")


# -- keys and values ---------------------------------------------------------------------------
def test_key_forms_map_to_ordered_bytes():
    idx = AttributeIndex.open(f"memory://keys-{uuid.uuid4().hex}")
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    idx.update([(u, 1), (5, 2), (b"\xff" * 16, 3), (bytearray(16), 4)])
    assert idx.get(u.bytes) == 1 and idx.get(u) == 1
    assert idx.get(k(5)) == 2 and idx.get(5) == 2
    assert [key for key, _ in idx.items()] == [b"\x00" * 16, k(5), u.bytes, b"\xff" * 16]
    assert all(type(key) is bytes for key, _ in idx.items())


@pytest.mark.parametrize("bad", [b"short", b"x" * 17, -1, 1 << 128, "text", 1.5, True, None])
def test_bad_keys_are_rejected_and_change_nothing(bad):
    idx = AttributeIndex.open(f"memory://bad-{uuid.uuid4().hex}")
    idx.update({1: 10})
    with pytest.raises(InvalidKeyError) as caught:
        idx.update([(2, 20), (bad, 1)])
    assert isinstance(caught.value, ValueError)
    assert idx.get(2) is None and len(idx) == 1 and idx.stats().updates_written == 1
    with pytest.raises(InvalidKeyError):
        idx.get(bad)


@pytest.mark.parametrize("bad", [1 << 63, -(1 << 63) - 1, 1.0, "7", True, b"1"])
def test_bad_values_are_rejected_and_change_nothing(bad):
    idx = AttributeIndex.open(f"memory://bad-{uuid.uuid4().hex}")
    with pytest.raises(InvalidValueError) as caught:
        idx.update({1: 5, 2: bad})
    assert "2**63" in str(caught.value) or "int" in str(caught.value)
    assert idx.get(1) is None and len(idx) == 0


def test_extreme_values_and_last_value_wins():
    idx = AttributeIndex.open(f"memory://vals-{uuid.uuid4().hex}")
    idx.update([(1, -(1 << 63)), (2, (1 << 63) - 1), (3, 7), (3, 8), (4, 1), (4, None)])
    assert idx.get_many([1, 2, 3, 4]) == [-(1 << 63), (1 << 63) - 1, 8, None]


# -- random work in phases ---------------------------------------------------------------------
def test_ten_thousand_keys_in_phases(url):
    rng = random.Random(42)
    idx = AttributeIndex.open(url, page_size=512, rolling_size=1 << 16)
    model: dict[bytes, int] = {}
    universe = rng.sample(range(1 << 40), 10_000)

    def check(index):
        assert len(index) == len(model)
        assert list(index.items()) == sorted(model.items())
        probe = rng.sample(universe, 500) + [rng.randrange(1 << 41) for _ in range(50)]
        assert index.get_many(probe) == [model.get(k(i)) for i in probe]
        assert all(index.get(i) == model.get(k(i)) for i in probe[:100])
        assert index.verify().ok
        index.flush()  # verify counts the tree's entries: the WAL's pending updates join them
        report = index.verify()
        assert report.ok and report.entries == len(model), report.damage

    phases = [
        ("insert", universe, lambda i: rng.randrange(-(1 << 63), 1 << 63)),
        ("update", rng.sample(universe, 6000), lambda i: rng.randrange(1000)),
        ("delete", rng.sample(universe, 3500), lambda i: None),
        ("mixed", rng.sample(universe, 5000), lambda i: rng.choice([None, i])),
    ]
    for _name, keys, value in phases:
        for start in range(0, len(keys), 250):
            batch = {k(i): value(i) for i in keys[start:start + 250]}
            idx.update(batch)
            for key, v in batch.items():
                model.pop(key, None) if v is None else model.__setitem__(key, v)
        check(idx)
        check(AttributeIndex.open(url, page_size=512, rolling_size=1 << 16))
    idx.update({k(i): None for i in universe})
    reopened = AttributeIndex.open(url, page_size=512)
    assert len(reopened) == 0 and list(reopened.items()) == []
    reopened.flush()  # the removals reach the tree
    assert reopened.stats().height == 0 and reopened.verify().entries == 0


def test_truncation_offset_is_the_smallest_live_offset_after_every_update(url):
    rng = random.Random(7)
    idx = TreeIndex.open(url, page_size=256, rolling_size=4096, cache_bytes=0)
    for step in range(150):
        idx.update({k(rng.randrange(2000)): rng.choice([None, step]) for _ in range(rng.choice([1, 8, 40]))})
        live = [offset for _, offset, _, _ in idx._tree.pages()]
        stats = idx.stats()
        assert stats.start_offset == min(live, default=stats.start_offset)
        # Chunks wholly below the truncation offset are gone (all but the last chunk).
        assert all(c.end > stats.start_offset for c in idx._segment.chunks()[:-1])
    stats = idx.stats()
    assert stats.storage_bytes < stats.length / 4  # compaction let most of what was written go


def test_sequential_inserts_fill_leaves(url):
    idx = TreeIndex.open(url, page_size=32768)
    for start in range(0, 50_000, 100):
        idx.update({k(i): i for i in range(start, start + 100)})
    leaves = [len(page) for _, _, _, page in idx._tree.pages() if page.is_leaf]
    fill = sum(leaves) / (len(leaves) * leaf_capacity(32768))
    assert fill >= 0.9, f"sequential inserts filled leaves to {fill:.1%}"
    assert idx.verify().entries == 50_000


def test_iterator_outlives_compaction_and_truncation(url):
    idx = TreeIndex.open(url, page_size=256, rolling_size=2048, cache_bytes=0, compaction="pravega")
    idx.update({k(i): i for i in range(0, 3000, 3)})  # the keys the iterator must see
    iterator = idx.items()
    seen = [next(iterator) for _ in range(50)]
    # Churn other keys until the pages under the iterator's snapshot are truncated away.
    first_start = idx.stats().start_offset
    step = 0
    while idx._segment.start_offset <= first_start:
        idx.update({k(3 * i + 1): step for i in range(step % 997, 1000, 97)})
        step += 1
    seen += [(key, value) for key, value in iterator if int.from_bytes(key, "big") % 3 == 0]
    assert seen == [(k(i), i) for i in range(0, 3000, 3)]


# -- recovery ----------------------------------------------------------------------------------
@pytest.mark.parametrize("url", [f"memory://index-{uuid.uuid4().hex}"], ids=["memory"])
def test_committed_bytes_after_the_newest_footer_are_corruption_not_a_rollback(url):
    # Where a chunk's length is stored (memory, S3) every committed append of an index ends with a
    # footer, so committed bytes that do not are damage: reopening must say so, not silently fall
    # back to an older footer. (Local disk: the next test.)
    idx = TreeIndex.open(url, page_size=256)
    idx.update({k(i): i for i in range(100)})
    before = sorted(idx.items())
    raw = RollingSegment(open_storage(url), "attributes")
    raw.append(b"\x00garbage" * 500)
    at = raw.append(b"AIXFOOT1" + bytes(64))  # looks like a footer, but its checksum is wrong
    with pytest.raises(CorruptDataError, match=f"newest footer at offset {at}") as caught:
        TreeIndex.open(url, page_size=256)
    assert caught.value.offset == at and "attributes.seg/00000000000000000000" in str(caught.value)
    report = TreeIndex.repair_at(url)  # explicit: the garbage no longer counts
    assert report.rolled_back and report.entries_after == 100 and report.lost_end == at + 72
    repaired = TreeIndex.open(url, page_size=256)
    assert sorted(repaired.items()) == before and repaired.verify().ok
    repaired.update({k(1000): 1})
    again = TreeIndex.open(url, page_size=256)
    assert again.get(1000) == 1 and len(again) == 101 and again.verify().ok


def test_bytes_no_crash_leaves_after_the_newest_footer_on_local_disk_are_damage(tmp_path):
    # On local disk a chunk's committed end is the end of its chain of whole updates (pages, then
    # the footer that covers them). Bytes after the newest footer that do not begin as an update
    # begins (a page header, a footer) are no torn write: they are damage, reported on open, and
    # repair rolls the index back to the newest intact version (docs/decisions/0001).
    from attrindex.btree.framing import TREE_FRAMING

    url = str(tmp_path / "store")
    idx = TreeIndex.open(url, page_size=256)
    idx.update({k(i): i for i in range(100)})
    before = sorted(idx.items())
    raw = RollingSegment(open_storage(url), "attributes", framing=TREE_FRAMING)
    end = raw.length
    raw.append(b"garbage\x00" * 500)
    raw.append(b"AIXFOOT1" + bytes(64))  # looks like a footer, but its checksum is wrong
    with pytest.raises(CorruptDataError, match="newest footer"):
        TreeIndex.open(url, page_size=256)
    assert not TreeIndex.verify_at(url).ok
    report = TreeIndex.repair_at(url)
    assert report.rolled_back and report.entries_after == 100 and report.lost_start == end
    repaired = TreeIndex.open(url, page_size=256)
    assert sorted(repaired.items()) == before and repaired.verify().ok
    repaired.update({k(1000): 1})
    again = TreeIndex.open(url, page_size=256)
    assert again.get(1000) == 1 and len(again) == 101 and again.verify().ok


def test_torn_update_past_the_committed_length_is_ignored(tmp_path):
    # A writer killed mid-update leaves the first bytes of its update after the newest footer:
    # they are not part of the index, and the next append overwrites them.
    url = str(tmp_path)
    idx = TreeIndex.open(url, page_size=256)
    idx.update({k(i): i for i in range(50)})
    idx.update({k(i): -i for i in range(50)})
    state = idx._tree.state
    last_update = idx._segment.read(state.length - state.footer.update_length, state.footer.update_length)
    chunk = idx._segment.chunks()[-1]
    with open(tmp_path / "attributes.seg" / chunk.name, "r+b") as f:  # where the next update would go
        f.seek(state.length - chunk.start)
        f.write(last_update[: len(last_update) // 2])
    reopened = TreeIndex.open(url, page_size=256)
    assert reopened.get_many(range(50)) == [-i for i in range(50)]
    reopened.update({k(60): 60})
    again = TreeIndex.open(url, page_size=256)
    assert again.get_many([0, 1, 60]) == [0, -1, 60] and again.verify().ok


def test_flipped_byte_in_a_live_page_names_the_offset(tmp_path):
    url = str(tmp_path)
    idx = TreeIndex.open(url, page_size=256)
    idx.update({k(i): i for i in range(200)})
    leaf_offset = next(offset for _, offset, _, page in idx._tree.pages() if page.is_leaf)
    chunk = idx._segment.chunks()[0]
    path = tmp_path / "attributes.seg" / chunk.name
    raw = bytearray(path.read_bytes())
    raw[leaf_offset - chunk.start + 20] ^= 0x01
    path.write_bytes(bytes(raw))
    reopened = TreeIndex.open(url, page_size=256, cache_bytes=0)
    with pytest.raises(CorruptDataError, match=f"offset {leaf_offset}") as caught:
        list(reopened.items())
    assert caught.value.offset == leaf_offset
    with pytest.raises(CorruptDataError, match=f"offset {leaf_offset}"):
        reopened.get_many(range(200))
    report = reopened.verify()
    assert not report.ok and any(d.start == leaf_offset and "checksum mismatch" in d.reason for d in report.damage)


# -- caching -----------------------------------------------------------------------------------
def test_warm_lookups_read_no_storage_and_cold_ones_do(url):
    idx = TreeIndex.open(url, page_size=1024)
    idx.update({k(i): i for i in range(2000)})
    assert all(idx.get(i) == i for i in range(2000))
    assert idx.stats().storage_reads == 0  # pages written by this handle are cached
    cold = TreeIndex.open(url, page_size=1024, value_cache_entries=0)
    assert cold.get_many(range(2000)) == list(range(2000))
    reads = cold.stats().storage_reads
    assert 0 < reads <= cold.stats().page_count
    assert all(cold.get(i) == i for i in range(0, 2000, 7))
    assert cold.stats().storage_reads == reads  # warm now
    uncached = TreeIndex.open(url, page_size=1024, cache_bytes=0, value_cache_entries=0)
    uncached.get(5)
    uncached.get(5)
    # Without a page cache every page but the root (which the handle keeps) is read each time.
    assert uncached.stats().storage_reads == 1 + 2 * (uncached.stats().height - 1)


def test_threads_missing_the_same_pages_read_each_once(url):
    idx = TreeIndex.open(url, page_size=1024)
    idx.update({k(i): i for i in range(64)})  # a root and a few leaves
    cold = TreeIndex.open(url, page_size=1024, value_cache_entries=0)
    barrier = threading.Barrier(8)
    results = []

    def reader():
        barrier.wait()
        results.append(cold.get_many(range(64)))

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [list(range(64))] * 8
    assert cold.stats().storage_reads == cold.stats().page_count


def test_refresh_sees_other_handles_updates(url):
    a, b = TreeIndex.open(url), TreeIndex.open(url)
    a.update({1: 1})
    assert b.get(1) is None
    b.refresh()
    assert b.get(1) == 1
    b.update({2: 2})  # b is current, a is not: a's next update reloads and re-applies
    a.update({3: 3})
    fresh = TreeIndex.open(url)
    assert fresh.get_many([1, 2, 3]) == [1, 2, 3]


def test_stats_fields(url):
    idx = TreeIndex.open(url, page_size=512)
    idx.update({k(i): i for i in range(500)})
    stats = idx.stats()
    assert stats.entry_count == 500 and stats.height >= 2 and stats.page_count > 1
    assert stats.length == stats.bytes_written and stats.updates_written == 1
    assert stats.live_bytes <= stats.length - stats.start_offset <= stats.storage_bytes
    assert (stats.logical_bytes, stats.wal_bytes_written) == (500 * 24, 0)  # 16-byte key + 8-byte value each
    assert stats.write_amplification == stats.bytes_written / stats.logical_bytes
    assert idx.update({}, checkpoint=5) and not idx.update({k(1): 2}, checkpoint=4)  # covered: not written
    idx.bulk_load([(k(i), None) for i in range(100)] + [(k(1000 + i), i) for i in range(20)], spill_bytes=500)  # runs on disk
    stats = idx.stats()
    assert stats.logical_bytes == 620 * 24 and stats.length == stats.bytes_written
    assert stats.write_amplification == stats.bytes_written / stats.logical_bytes


def test_bulk_update_refreshes_cached_values_without_flooding_the_cache():
    idx = TreeIndex.open(f"memory://bulk-{uuid.uuid4().hex}")
    idx.update({1: 1, 2: 2})
    assert idx.get(1) == 1 and idx.get(3) is None  # both now in the recent-values cache
    idx.update({i: -i for i in range(20_000)})  # a bulk write, beyond the tier-1 admission size
    assert idx.get(1) == -1 and idx.get(3) == -3
    assert len(idx._values) < 100


def test_compaction_off_keeps_everything_and_the_policies_differ(url):
    written = {}
    for policy in (False, "pravega", True):
        idx = TreeIndex.open(f"{url}-{policy}" if url.startswith("memory") else f"{url}/{policy}",
                                  page_size=256, rolling_size=2048, compaction=policy)
        for step in range(120):
            idx.update({k((step * 37 + i) % 500): step for i in range(5)})
        stats = idx.stats()
        written[policy] = stats
        assert idx.verify().entries == len({(step * 37 + i) % 500 for step in range(120) for i in range(5)})
    off, pravega, bounded = written[False], written["pravega"], written[True]
    assert off.storage_bytes == off.length and off.pages_relocated == 0  # the storage only grows
    assert pravega.pages_relocated > 0 and pravega.storage_bytes < off.storage_bytes
    assert (bounded.length - bounded.start_offset) / bounded.live_bytes <= 1.6


def test_unknown_compaction_policy_is_an_error():
    with pytest.raises(ValueError, match="compaction must be"):
        TreeIndex.open(f"memory://p-{uuid.uuid4().hex}", compaction="sometimes")


def test_a_writer_that_lost_a_race_does_not_serve_values_it_cached_before(url):
    a, b = TreeIndex.open(url), TreeIndex.open(url)
    a.update({1: 1})
    assert a.get(1) == 1  # now in a's recent-values cache
    b.refresh()
    b.update({1: 2})
    a.update({2: 2})  # loses the race, reloads b's update and re-applies
    assert a.get(1) == 2
    assert a.get_many([1, 2]) == [2, 2]


def test_checkpoints_only_move_forward(tmp_path):
    idx = TreeIndex.open(str(tmp_path))
    assert idx.checkpoint is None
    assert idx.update({1: 1}, checkpoint=100) is True and idx.checkpoint == 100
    assert idx.update({1: 2}, checkpoint=50) is False  # already covered: older values are not applied
    assert idx.get(1) == 1 and idx.checkpoint == 100
    assert idx.update({}, checkpoint=200) is True and idx.checkpoint == 200  # a checkpoint alone
    with pytest.raises(InvalidInputError):
        idx.update({1: 3}, checkpoint=-1)
    assert TreeIndex.open(str(tmp_path)).checkpoint == 200


# -- closed handles ------------------------------------------------------------------------------
CLOSED_KEY = b"k" * 16
CALLS_ON_A_CLOSED_INDEX = {
    "get": lambda idx: idx.get(CLOSED_KEY),
    "get_many": lambda idx: idx.get_many([CLOSED_KEY]),
    "items": lambda idx: list(idx.items()),
    "split_keys": lambda idx: idx.split_keys(2),
    "len": len,
    "in": lambda idx: CLOSED_KEY in idx,
    "stats": lambda idx: idx.stats(),
    "verify": lambda idx: idx.verify(),
    "refresh": lambda idx: idx.refresh(),
    "checkpoint": lambda idx: idx.checkpoint,
    "update": lambda idx: idx.update({CLOSED_KEY: 2}),
    "update_sorted": lambda idx: idx.update_sorted([CLOSED_KEY], [2]),
    "with": lambda idx: idx.__enter__(),
}


@pytest.mark.parametrize("call", CALLS_ON_A_CLOSED_INDEX.values(), ids=CALLS_ON_A_CLOSED_INDEX.keys())
def test_every_call_on_a_closed_index_raises(tmp_path, call):
    idx = AttributeIndex.open(str(tmp_path))
    idx.update({CLOSED_KEY: 1})
    idx.close()
    with pytest.raises(InvalidInputError, match="index handle is closed"):
        call(idx)
    idx.close()  # closing twice is harmless
    assert idx.closed and "closed" in repr(idx)
    with AttributeIndex.open(str(tmp_path)) as reopened:
        assert reopened.get(CLOSED_KEY) == 1  # the closed handle wrote nothing
