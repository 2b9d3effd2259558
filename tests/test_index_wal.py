"""AttributeIndex's write path: updates go to a write-ahead log (a segment log), are served from its
overlay and merged into the B+tree (``TreeIndex``) in large sorted batches.

A dict model under updates, merges, bulk loads and reopens; a child process SIGKILLed right after
updates return; lost acknowledgements and failed appends on the WAL, and faults in the truncation
of its merged part; a tree without its WAL; verify and repair of a damaged WAL and of a damaged
tree whose updates the WAL still holds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from attrindex import AttributeIndex
from attrindex import overlay as overlay_module
from attrindex.errors import CorruptDataError, InvalidInputError, MergeBacklogError, OutcomeUnknownError, StorageError
from attrindex.tree_index import TreeIndex
from attrindex.btree.footer import FOOTER_SIZE
from attrindex.btree.framing import TREE_FRAMING
from storage_adapters import RollingSegment, open_storage
from storage_adapters.faults import FaultyStorage

# Merges of more than two pages are written in pieces.
SMALL = dict(page_size=256, rolling_size=2048, wal_rolling_size=1024, merge_keys=12, piece_size=512)


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def wal_batches(index: AttributeIndex) -> int:
    """Attribute batches in the WAL from its start (as verify reads them)."""
    return index.verify().wal.batches


# -- a dict model ----------------------------------------------------------------------------------
KEYS = st.integers(0, 60)
VALUES = st.one_of(st.none(), st.integers(-(1 << 63), (1 << 63) - 1))


class IndexWithWal(RuleBasedStateMachine):
    """The index against a dict: every read matches after any mix of updates, merges (small
    ``merge_keys`` makes them frequent), bulk loads, flushes and close + reopen."""

    def __init__(self) -> None:
        super().__init__()
        self.url = f"memory://wal-model-{uuid.uuid4().hex}"
        self.index = AttributeIndex.open(self.url, **SMALL)
        self.model: dict[bytes, int] = {}
        self.abandoned: list[AttributeIndex] = []

    def _apply(self, pairs) -> None:
        for key, value in pairs:
            if value is None:
                self.model.pop(k(key), None)
            else:
                self.model[k(key)] = value

    @rule(pairs=st.lists(st.tuples(KEYS, VALUES), max_size=20))
    def update(self, pairs):
        written = self.index.update(pairs)
        assert written == bool(pairs)
        self._apply(pairs)

    @rule(pairs=st.lists(st.tuples(KEYS, VALUES), max_size=40))
    def bulk_load(self, pairs):
        self._apply(pairs)
        assert self.index.bulk_load(pairs) == len(self.model)
        assert self.index.stats().pending_keys == 0

    @rule()
    def flush(self):
        self.index.flush()
        assert self.index.stats().pending_keys == 0
        assert self.index.verify().entries == len(self.model)  # the tree holds everything now

    @rule()
    def reopen(self):
        self.index.close()
        self.index = AttributeIndex.open(self.url, **SMALL)

    @rule()
    def abandon_and_reopen(self):
        # Like a process that stopped without close: the new handle replays the WAL while the
        # old one's merge thread may still merge what it froze (checkpoints keep them ordered).
        self.abandoned.append(self.index)
        self.index = AttributeIndex.open(self.url, **SMALL)

    @rule(keys=st.lists(KEYS, max_size=10))
    def get_many(self, keys):
        assert self.index.get_many(keys) == [self.model.get(k(i)) for i in keys]

    @rule(key=KEYS)
    def get(self, key):
        assert self.index.get(key) == self.model.get(k(key))
        assert (key in self.index) == (k(key) in self.model)

    @rule(low=KEYS, high=KEYS)
    def items(self, low, high):
        expected = sorted((key, v) for key, v in self.model.items() if k(low) <= key < k(high))
        assert list(self.index.items(low, high)) == expected


    @invariant()
    def length_is_exact(self):
        stats = self.index.stats()  # the tree's entries and the pending keys, apart (no lookups)
        assert len(self.index) == len(self.model) <= stats.entry_count + stats.pending_keys
        if not stats.pending_keys:
            assert stats.entry_count == len(self.model)

    def teardown(self) -> None:
        for index in self.abandoned + [self.index]:
            index.close()


def test_the_index_matches_a_dict_through_merges_bulk_loads_and_reopens():
    run_state_machine_as_test(IndexWithWal, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_the_index_matches_a_dict_with_tier_1_folded_into_columns(monkeypatch):
    """The same model with tier 1's recent part folded into compact columns every few keys, so
    reads, scans, ``len``, merges, reopens (the replay folds too) and bulk loads meet both parts."""
    monkeypatch.setattr(overlay_module, "FOLD_KEYS", 3)
    run_state_machine_as_test(IndexWithWal, settings=settings(
        max_examples=15, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


# -- the write path --------------------------------------------------------------------------------
def test_an_update_is_one_wal_append_served_at_once_and_merged_later(tmp_path):
    index = AttributeIndex.open(str(tmp_path), merge_keys=1000)
    assert index.update({i: i for i in range(100)}) is True
    assert index.update({}) is False  # nothing written
    stats = index.stats()
    assert (stats.pending_keys, stats.entry_count, stats.height, stats.updates_written) == (100, 0, 0, 1)
    assert len(index) == 100  # exact: the pending keys looked up in the tree
    assert stats.wal_bytes > 0 and stats.storage_bytes >= stats.wal_bytes
    assert index.get_many(range(100)) == list(range(100)) and index.checkpoint is None
    assert wal_batches(index) == 1
    index.flush()  # one sorted merge into the tree, at the WAL's position
    stats = index.stats()
    assert (stats.pending_keys, stats.entry_count, stats.height) == (0, 100, 1)
    assert index.checkpoint == index._log.position
    index.update({i: None for i in range(0, 100, 2)} | {1000: 1})  # removals and an insert pending
    assert len(index) == 51 and index.verify().entries == 100  # exact; the tree merges later
    index.close()
    assert len(AttributeIndex.open(str(tmp_path), mode="r")) == 51


def test_stats_report_bytes_written_per_logical_byte(tmp_path):
    index = AttributeIndex.open(str(tmp_path), merge_keys=100_000, merge_process=False)
    index.update({k(i): i for i in range(300)})
    index.update({k(i): None for i in range(0, 300, 3)})  # removals are key updates too
    index.update_sorted([k(i) for i in range(1000, 1100)], list(range(100)))
    stats = index.stats()
    assert stats.logical_bytes == 500 * 24 and stats.bytes_written == 0 and stats.wal_bytes_written > 0
    assert stats.write_amplification == stats.wal_bytes_written / stats.logical_bytes
    index.flush()  # one merge into the tree
    index.bulk_load([(k(i), -i) for i in range(2000, 2050)])  # 50 pairs, after an empty WAL batch
    index.bulk_load([(k(i), -i) for i in range(3000, 3100)], spill_bytes=1000)  # 100 pairs in runs on disk
    stats = index.stats()
    assert stats.logical_bytes == 650 * 24
    assert stats.wal_bytes_written == index.checkpoint  # every WAL byte is this handle's, all covered
    assert 0 < stats.bytes_written == stats.length  # this handle wrote every byte of the tree
    assert stats.write_amplification == (stats.wal_bytes_written + stats.bytes_written) / stats.logical_bytes > 1
    index.close()
    with AttributeIndex.open(str(tmp_path)) as reopened:  # the counters are this handle's
        stats = reopened.stats()
        assert (stats.logical_bytes, stats.wal_bytes_written, stats.bytes_written, stats.write_amplification) == (0, 0, 0, 0.0)


def test_stats_and_repr_look_up_no_pending_key_and_len_one_each(tmp_path, monkeypatch):
    from attrindex.btree.tree import BTreeIndex

    looked_up = []
    for name in ("get", "get_many"):
        original = getattr(BTreeIndex, name)

        def counting(self, keys, _original=original, _name=name):
            looked_up.extend([keys] if _name == "get" else keys)
            return _original(self, keys)

        monkeypatch.setattr(BTreeIndex, name, counting)
    index = AttributeIndex.open(str(tmp_path), merge_keys=100_000, merge_process=False)
    index.update({k(i): i for i in range(100)})
    index.flush()
    index.update({k(i): None for i in range(0, 40)} | {k(i): i for i in range(1000, 1500)})  # 540 pending
    looked_up.clear()
    stats = index.stats()
    assert (stats.entry_count, stats.pending_keys) == (100, 540)
    assert repr(index).endswith("'attributes', tree_entries=100, pending_keys=540)")
    assert looked_up == []
    assert len(index) == 560 and sorted(looked_up) == sorted([k(i) for i in range(0, 40)] + [k(i) for i in range(1000, 1500)])
    index.close()


def test_a_merge_happens_once_merge_keys_are_pending(tmp_path):
    index = AttributeIndex.open(str(tmp_path), merge_keys=50)
    index.update({i: i for i in range(49)})
    assert index.stats().pending_keys == 49
    index.update({49: 49})  # the 50th pending key: merged into the tree after the durable append
    deadline = time.monotonic() + 20  # by the background merge thread
    while index.stats().pending_keys and time.monotonic() < deadline:
        time.sleep(0.005)
    assert index.stats().pending_keys == 0 and index.verify().entries == 50


def test_a_merge_larger_than_a_piece_is_written_in_pieces_by_the_merge_worker(tmp_path):
    index = AttributeIndex.open(str(tmp_path), page_size=4096, piece_size=16384, compaction=False, merge_keys=10_000)
    expected = {}
    for n in range(8):
        batch = {k(i): n * 100_000 + i for i in range(n, 12_000, 5)}
        index.update(batch)
        expected.update(batch)
    deadline = time.monotonic() + 120  # the background merge, in the worker: 10,000+ keys pending
    while not index._attributes.runner.merges and time.monotonic() < deadline:
        time.sleep(0.01)
    worker = index._attributes.runner.worker
    assert worker is not None and worker.starts == 1 and index._attributes.runner.merges == 1
    assert index.verify().updates > 10  # the pieces' footers, then the merge's own
    index.flush()  # the updates that arrived after the merge began
    report = index.verify()
    assert report.ok and report.entries == len(expected)
    index.close()
    reader = AttributeIndex.open(str(tmp_path), mode="r")
    assert reader.stats().pending_keys == 0
    assert dict(reader.items()) == expected


def test_reopening_replays_the_wal_after_the_trees_checkpoint(tmp_path):
    index = AttributeIndex.open(str(tmp_path), merge_keys=1000)
    index.update({i: i for i in range(10)})
    index.flush()
    index.update({i: -i for i in range(5, 15)})
    # Abandoned without close (like a crash): its last update is only in the WAL.
    reopened = AttributeIndex.open(str(tmp_path), mode="r")
    assert reopened.stats().pending_keys == 10 and reopened.verify().entries == 10
    assert reopened.get_many(range(15)) == [0, 1, 2, 3, 4] + [-i for i in range(5, 15)]
    assert len(reopened) == 15


def test_a_read_only_handle_writes_nothing_not_even_a_merge(tmp_path):
    with AttributeIndex.open(str(tmp_path), merge_keys=1000) as index:
        index.update({1: 1})
        index._attributes._wrote = False  # leave the update in the WAL only, as a killed writer would
    before = {path: os.path.getsize(os.path.join(d, path)) for d, _, files in os.walk(tmp_path) for path in files}
    with AttributeIndex.open(str(tmp_path), mode="r") as reader:
        assert reader.get(1) == 1 and reader.stats().pending_keys == 1
        for call in (lambda: reader.update({2: 2}), reader.flush, lambda: reader.bulk_load({2: 2}), reader.repair):
            with pytest.raises(InvalidInputError, match="read-only"):
                call()
    after = {path: os.path.getsize(os.path.join(d, path)) for d, _, files in os.walk(tmp_path) for path in files}
    assert after == before


def test_refresh_sees_updates_and_merges_of_another_handle(tmp_path):
    a, b = AttributeIndex.open(str(tmp_path)), AttributeIndex.open(str(tmp_path))
    a.update({1: 1})
    assert b.get(1) is None
    b.refresh()
    assert b.get(1) == 1
    b.update({2: 2})  # b is current, a is not: a's append loses the race, catches up and retries
    a.update({3: 3, 2: 20})
    a.flush()  # a's merge moves the tree's checkpoint past what b has seen
    b.refresh()
    assert b.get_many([1, 2, 3]) == [1, 20, 3] and len(b) == 3
    assert AttributeIndex.open(str(tmp_path)).get_many([1, 2, 3]) == [1, 20, 3]


def test_checkpoints_of_another_log_are_refused():
    index = AttributeIndex.open(f"memory://wal-cp-{uuid.uuid4().hex}")
    for call in (lambda: index.update({1: 1}, checkpoint=5), lambda: index.update_sorted([k(1)], [1], checkpoint=5)):
        with pytest.raises(InvalidInputError, match="checkpoint"):
            call()
    assert len(index) == 0 and wal_batches(index) == 0


def test_update_sorted_takes_canonical_input_only():
    index = AttributeIndex.open(f"memory://wal-sorted-{uuid.uuid4().hex}")
    assert index.update_sorted([k(1), k(2)], [5, None]) is True and index.get_many([1, 2]) == [5, None]
    for keys, values in (([1], [1]), ([k(1)], [1.5]), ([k(1), k(1)], [1, 2]), ([k(1)], [])):
        with pytest.raises(InvalidInputError):
            index.update_sorted(keys, values)
    assert wal_batches(index) == 1


def test_bulk_load_is_ordered_between_earlier_and_later_updates(tmp_path):
    index = AttributeIndex.open(str(tmp_path), **SMALL)
    index.update({i: -1 for i in range(10)})  # pending in the WAL: merged before the load
    assert index.bulk_load(((i, i) for i in range(5, 500)), progress=lambda done, total: None) == 500
    index.update({7: 70})  # after the load: replayed over it
    assert index.get_many([0, 5, 7, 499]) == [-1, 5, 70, 499]
    index._attributes._wrote = False  # no merge on close: reopening must replay the later update only
    index.close()
    reopened = AttributeIndex.open(str(tmp_path), **SMALL)
    assert reopened.get_many([0, 5, 7, 499]) == [-1, 5, 70, 499] and len(reopened) == 500
    assert reopened.verify().ok


def test_a_load_from_columns_is_ordered_between_earlier_and_later_updates(tmp_path):
    import numpy as np

    index = AttributeIndex.open(str(tmp_path), **SMALL)
    index.update({i: -1 for i in range(10)})  # pending in the WAL: merged before the load
    words = np.zeros((495, 2), np.uint64)
    words[:, 1] = np.arange(5, 500)  # keys 5..499 as (high, low) words
    assert index.bulk_load_columns([(words[:200], np.arange(5, 205)), (words[200:], np.arange(205, 500))]) == 500
    index.update({7: 70})  # after the load: replayed over it
    assert index.get_many([0, 5, 7, 499]) == [-1, 5, 70, 499]
    index._attributes._wrote = False  # no merge on close: reopening must replay the later update only
    index.close()
    reopened = AttributeIndex.open(str(tmp_path), **SMALL)
    assert reopened.get_many([0, 5, 7, 499]) == [-1, 5, 70, 499] and len(reopened) == 500
    assert reopened.verify().ok


def test_a_bad_chunk_of_columns_writes_nothing():
    import numpy as np

    index = AttributeIndex.open(f"memory://wal-columns-bad-{uuid.uuid4().hex}", merge_keys=1000)
    index.update({1: 1})
    before = index.verify().wal.log_bytes
    with pytest.raises(InvalidInputError, match="chunk 1"):
        index.bulk_load_columns([(np.zeros((1, 2), np.uint64), [5]), (np.zeros((2, 2), np.uint64), [1.5, 2.5])])
    assert index.verify().wal.log_bytes == before and index.stats().pending_keys == 1  # no flush, no batch


def test_bad_options_are_refused_before_anything_is_created(tmp_path):
    for bad in (dict(merge_keys=0), dict(wal_rolling_size="4MiB"), dict(merge_seconds=-1), dict(page_size=3)):
        with pytest.raises((InvalidInputError, ValueError)):
            AttributeIndex.open(str(tmp_path / "x"), **bad)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").rglob("*"))


# -- crashes and faults ----------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import sys
    from attrindex import AttributeIndex
    index = AttributeIndex.open(sys.argv[1], page_size=1024, merge_keys=400, wal_rolling_size=1 << 14)
    batch = int(sys.argv[2])
    while True:
        index.update({(batch * 37 + i) % 3000: batch for i in range(40)})
        print(batch, flush=True)
        batch += 1
""")


def test_a_writer_killed_right_after_updates_return_loses_none_of_them(tmp_path):
    directory = str(tmp_path / "index")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    model: dict[int, int] = {}
    start = 0
    for attempt in range(3):
        child = subprocess.Popen([sys.executable, "-c", CHILD, directory, str(start)], stdout=subprocess.PIPE,
                                 text=True, env=env)
        seen = []
        deadline = time.monotonic() + 20
        while len(seen) < 15 + 10 * attempt and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            seen.append(int(line))
        child.send_signal(signal.SIGKILL)
        seen += [int(line) for line in child.stdout.read().split()]
        child.wait()
        assert seen, "the child returned no update before it was killed"
        for batch in seen:
            model.update({(batch * 37 + i) % 3000: batch for i in range(40)})
        index = AttributeIndex.open(directory, page_size=1024)
        keys = sorted(model)
        stored = index.get_many(keys)
        # Every update that returned is there; the one in flight may have landed after them.
        in_flight = seen[-1] + 1
        assert all(v == model[key] or v == in_flight for key, v in zip(keys, stored)), f"attempt {attempt}"
        assert index.verify().ok
        model = {key: v for key, v in zip(keys, stored)} | {
            key: v for key, v in zip(range(3000), index.get_many(range(3000))) if v is not None}
        index.close()
        start = in_flight + 1


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_lost_acknowledgement_on_the_wal_append_is_settled_without_a_duplicate(backend, tmp_path):
    url = f"memory://wal-ack-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)
    storage = FaultyStorage(open_storage(url), seed=1)
    index = AttributeIndex(storage, page_size=256, merge_keys=1000)
    index.update({1: 1})
    storage.script("lost_ack", path_contains="_wal/_log.seg")
    try:
        index.update({2: 2, 1: None})  # written, but the answer was lost: read back, recognised
    except OutcomeUnknownError:
        pytest.fail("a lost acknowledgement that storage can settle must not be an unknown outcome")
    assert [i.kind for i in storage.injected] == ["lost_ack"]
    assert index.get_many([1, 2]) == [None, 2] and len(index) == 1
    assert wal_batches(index) == 2  # the batch once, never twice
    reopened = AttributeIndex(open_storage(url), page_size=256)
    assert reopened.get_many([1, 2]) == [None, 2] and wal_batches(reopened) == 2


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_failed_wal_append_raises_and_changes_nothing(backend, tmp_path):
    url = f"memory://wal-fail-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)
    storage = FaultyStorage(open_storage(url), seed=2)
    index = AttributeIndex(storage, page_size=256, merge_keys=1000)
    index.update({1: 1})
    storage.script("fail_before", op="append" if storage.appendable else "create", path_contains="_wal/_log.seg")
    with pytest.raises(StorageError):
        index.update({1: 5, 2: 2})
    assert index.get_many([1, 2]) == [1, None] and len(index) == 1
    assert AttributeIndex(open_storage(url), page_size=256).get_many([1, 2]) == [1, None]
    index.update({2: 2})  # the handle goes on
    assert AttributeIndex(open_storage(url), page_size=256).get_many([1, 2]) == [1, 2]


def test_a_failed_merge_never_fails_the_durable_update(tmp_path):
    storage = FaultyStorage(open_storage(str(tmp_path)), seed=3)
    index = AttributeIndex(storage, page_size=256, merge_keys=1)
    storage.script("enospc", path_contains="attributes.seg")
    assert index.update({1: 1}) is True  # durable in the WAL; the background merge after it fails
    deadline = time.monotonic() + 20
    while not any(i.kind == "enospc" for i in storage.injected) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert any(i.kind == "enospc" for i in storage.injected)
    assert index.get(1) == 1  # (the merge thread retries it: pending or merged by now)
    assert AttributeIndex(open_storage(str(tmp_path)), page_size=256).get(1) == 1  # replayed from the WAL
    index.flush()  # the merge retried by hand succeeds now
    assert index.stats().pending_keys == 0 and index.verify().entries == 1


def test_updates_over_max_pending_bytes_are_refused_while_merges_keep_failing(tmp_path):
    """The overlay's memory stays bounded by ``max_pending_bytes`` when the tree cannot be written
    (a full disk for the tree's chunks): updates are refused with ``MergeBacklogError``, nothing
    written, instead of piling up in memory; when room comes back they go on."""
    storage = FaultyStorage(open_storage(str(tmp_path)), seed=4)
    index = AttributeIndex(storage, page_size=256, merge_keys=10, max_pending_bytes=3_000)
    storage.script("enospc", op="append", path_contains="attributes.seg", times=1_000_000)
    done = 0
    with pytest.raises(MergeBacklogError) as refused:
        for n in range(10_000):
            index.update({n: n})
            done += 1
    assert done < 10_000 and "StorageFullError" in str(refused.value)
    assert index.stats().pending_keys < 50  # bounded (~20 keys fill 3,000 bytes), not ~10,000
    assert index.get(done) is None and index.get_many(range(done)) == list(range(done))
    storage.enabled = False
    index.update({done: done})  # the retry makes room again (the update waits for it)
    index.flush()
    assert index.stats().pending_keys == 0 and index.verify().entries == done + 1
    index.close()
    assert AttributeIndex(open_storage(str(tmp_path)), page_size=256).get_many(range(done + 1)) == list(range(done + 1))


TRUNCATION_OPTIONS = dict(page_size=256, wal_rolling_size=200, merge_keys=10**6, merge_seconds=10**6)


@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize("kind, op", [("lost_ack", "put_marker"), ("lost_ack", "delete"), ("fail_before", "delete")])
def test_a_wal_truncation_whose_answer_is_lost_or_fails_loses_and_revives_nothing(backend, kind, op, tmp_path):
    """The truncation of the merged WAL (a marker, then the deletion of the chunks below it) runs
    after a durable merge. Its marker's answer lost, its deletions' answer lost, or its deletions
    failing, several times in a row and with removals (``None``) among the merged updates: the
    merge raises nothing, and this handle, a second handle that reads and writes, and a fresh open
    all see every acknowledged update with its newest value and no removed key back (from an older
    WAL chunk or tree version)."""
    url = f"memory://wal-cut-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)
    faulty = FaultyStorage(open_storage(url), seed=1)
    a = AttributeIndex(faulty, **TRUNCATION_OPTIONS)
    keys = list(range(30))
    model: dict[int, int | None] = {}
    for round_ in range(4):
        for i in keys:
            value = None if (i + round_) % 5 == 0 else 100 * round_ + i
            a.update({i: value})  # every one acknowledged: the faults hit the truncation only
            model[i] = value
        if round_ == 1:
            faulty.script(kind, op=op, path_contains="_wal", times=3)
        a.flush()  # the merge is durable; its truncation meets the fault (never raised)
    assert faulty.pending_scripts() == 0 and faulty.injected
    want = [model[i] for i in keys]
    assert a.get_many(keys) == want
    b = AttributeIndex(open_storage(url), **TRUNCATION_OPTIONS)
    assert b.get_many(keys) == want
    more = [len(keys), len(keys) + 1]
    b.update({more[0]: 1})
    b.flush()
    a.update({more[1]: 2})
    a.refresh()
    a.flush()
    assert a.get_many(keys + more) == want + [1, 2]
    for index in (a, b):
        index.close()
    with AttributeIndex(open_storage(url), **TRUNCATION_OPTIONS) as reopened:
        assert reopened.get_many(keys + more) == want + [1, 2]
        assert len(reopened) == sum(v is not None for v in want) + 2
        assert reopened.verify().ok


# -- a tree without its WAL -----------------------------------------------------------------------
def test_a_tree_index_with_its_own_checkpoint_is_refused_as_an_attribute_index(tmp_path):
    with TreeIndex.open(str(tmp_path)) as tree:
        tree.update({1: 1}, checkpoint=500)
    with pytest.raises(CorruptDataError, match="position 500, but there is no write-ahead log.*TreeIndex"):
        AttributeIndex.open(str(tmp_path))
    assert TreeIndex.open(str(tmp_path)).checkpoint == 500  # still readable as what it is


def test_an_index_whose_wal_was_deleted_is_refused_with_an_error_that_names_the_wal(tmp_path):
    root = str(tmp_path)
    with AttributeIndex.open(root, page_size=256) as index:
        index.update({1: 1})
        index.flush()
    shutil.rmtree(os.path.join(root, "attributes", "_wal"))
    with pytest.raises(CorruptDataError, match="no write-ahead log at 'attributes/_wal' .deleted, or not copied"):
        AttributeIndex.open(root)


# -- verify and repair -----------------------------------------------------------------------------
def _wal_chunks(root) -> list[str]:
    directory = os.path.join(root, "attributes", "_wal", "_log.seg")
    return [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.isdigit()]


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_damaged_wal_is_reported_and_repair_gives_up_only_the_damaged_batch(tmp_path):
    root = str(tmp_path)
    index = AttributeIndex.open(root, page_size=256, merge_keys=1000)
    index.update({i: 1 for i in range(20)})
    index.flush()  # in the tree
    index.update({i: 2 for i in range(10)})  # in the WAL only (never merged: the handle is dropped)
    position = index._log.position
    index.update({20: 5})  # a later batch: the damage below is not the newest write
    chunk = _wal_chunks(root)[-1]
    _flip(chunk, position - 30)  # inside the batch of the 2s
    with pytest.raises(CorruptDataError, match="_wal"):
        AttributeIndex.open(root)
    report = AttributeIndex.verify_at(root)
    assert not report.ok and all("_wal" in d.where for d in report.damage) and report.wal is not None
    repaired = AttributeIndex.repair_at(root)
    assert not repaired.rolled_back and repaired.wal.lost_bytes > 0
    assert AttributeIndex.verify_at(root).ok
    with AttributeIndex.open(root) as reopened:
        assert reopened.get_many(range(20)) == [1] * 20  # the merged state; the damaged batch is gone
        assert reopened.get(20) == 5  # the intact batch after it is kept
        reopened.update({0: 3})
    with AttributeIndex.open(root, mode="r") as again:
        assert again.get(0) == 3 and again.verify().ok


def _newest_wal_write_damaged(root: str) -> str:
    """An index whose writer stopped (not closed: nothing merged) after two updates, 20 keys to 1
    then 10 of them to 2, with a byte of the newest one's WAL batch flipped; its WAL chunk's path."""
    index = AttributeIndex.open(root, page_size=256, merge_keys=1000)
    index.update({i: 1 for i in range(20)})
    index.update({i: 2 for i in range(10)})  # the newest write
    position = index._log.position
    chunk = _wal_chunks(root)[-1]
    _flip(chunk, position - 30)
    return chunk


def test_a_damaged_newest_wal_batch_is_cut_as_a_torn_write(tmp_path, caplog):
    # With nothing valid after it, damage to the newest write cannot be told from a torn write
    # (docs/reliability.md, "The newest frame on local disk"): one write back, with a warning.
    root = str(tmp_path)
    _newest_wal_write_damaged(root)
    with caplog.at_level("WARNING", logger="attrindex.storage"):
        with AttributeIndex.open(root) as reopened:
            assert reopened.get_many(range(20)) == [1] * 20
            reopened.update({0: 3})
    assert "torn write" in caplog.text
    with AttributeIndex.open(root, mode="r") as again:
        assert again.get(0) == 3 and again.get(1) == 1 and again.verify().ok


def test_a_read_only_open_says_what_a_torn_wal_write_left_and_cuts_nothing(tmp_path, caplog):
    root = str(tmp_path)
    chunk = _newest_wal_write_damaged(root)
    with open(chunk, "rb") as f:
        before = f.read()
    with caplog.at_level("WARNING", logger="attrindex.storage"):
        with AttributeIndex.open(root, mode="r") as reader:
            assert reader.get_many(range(20)) == [1] * 20  # one write back, as a writer would cut it
    assert any("torn write" in r.getMessage() and "nothing is cut" in r.getMessage() for r in caplog.records)
    with open(chunk, "rb") as f:
        assert f.read() == before


def test_a_tree_rolled_back_by_repair_gets_its_updates_back_from_the_wal(tmp_path):
    root = str(tmp_path)
    index = AttributeIndex.open(root, page_size=256, merge_keys=1000)
    for version in range(3):
        index.update({i: version for i in range(30)})
        index.flush()
    index._attributes._wrote = False
    index.close()
    tree = RollingSegment(open_storage(root), "attributes", framing=TREE_FRAMING)
    last = tree.chunks()[-1]
    # Inside the newest update's last page (just before its footer): a valid footer follows it,
    # so it is damage, not a torn write.
    _flip(os.path.join(root, "attributes.seg", last.name), tree.length - last.start - FOOTER_SIZE - 10)
    with pytest.raises(CorruptDataError), AttributeIndex.open(root, mode="r") as damaged:
        damaged.get_many(range(30))  # the page (the root) is read: damage, reported
    assert not AttributeIndex.verify_at(root).ok
    report = AttributeIndex.repair_at(root)
    assert report.rolled_back and report.updates_dropped == 1
    with AttributeIndex.open(root) as reopened:
        values = reopened.get_many(range(30))
        if report.merged_updates_lost:  # the WAL below the newest merge was already truncated
            assert values == [1] * 30
        else:  # replayed from the WAL after the kept version's checkpoint: nothing lost
            assert values == [2] * 30
        assert reopened.verify().ok


def test_repair_through_an_open_handle_reopens_it(tmp_path):
    root = str(tmp_path)
    index = AttributeIndex.open(root, page_size=256, merge_keys=1000)
    index.update({1: 1})
    report = index.repair()
    assert not report.rolled_back and not report.wal.repaired
    assert index.get(1) == 1
    index.update({2: 2})
    assert index.get_many([1, 2]) == [1, 2]


def test_every_call_on_a_closed_index_raises():
    index = AttributeIndex.open(f"memory://wal-closed-{uuid.uuid4().hex}")
    index.close()
    for call in (lambda: index.bulk_load({1: 1}), index.flush, index.repair, lambda: index.update({1: 1}),
                 lambda: len(index), index.stats, index.refresh):
        with pytest.raises(InvalidInputError, match="closed"):
            call()


def test_the_cli_repairs_a_damaged_wal(tmp_path, capsys):
    from attrindex.cli import main

    root = str(tmp_path)
    index = AttributeIndex.open(root, merge_keys=1000)
    index.update({1: 1})
    index.update({2: 2})
    position = index._log.position
    index.update({3: 3})  # a later batch: the damage below is not the newest write
    _flip(_wal_chunks(root)[-1], position - 30)  # inside the second batch
    assert main(["index", "verify", root]) == 3
    assert "damaged: attributes/_wal" in capsys.readouterr().out
    assert main(["index", "repair", root]) == 0
    assert capsys.readouterr().out.startswith("repaired the write-ahead log: ")
    assert main(["index", "verify", root]) == 0
    assert main(["index", "verify", root]) == 0
    assert main(["index", "repair", root]) == 0
    assert "nothing was changed" in capsys.readouterr().out
    with AttributeIndex.open(root, mode="r") as reopened:
        assert reopened.get_many([1, 2]) == [1, None]


@pytest.mark.parametrize("bad", [[(1, 1), (b"short", 2)], [(1, 1.5)], 7])
def test_bulk_load_of_bad_input_writes_nothing(bad):
    index = AttributeIndex.open(f"memory://wal-bulk-bad-{uuid.uuid4().hex}", merge_keys=1000)
    index.update({1: 1})
    before = index.verify().wal.log_bytes
    with pytest.raises(InvalidInputError):
        index.bulk_load(bad)
    assert index.verify().wal.log_bytes == before and index.stats().pending_keys == 1  # no flush, no batch
    assert index.get(1) == 1


def test_len_is_exact_while_background_merges_write_the_tree():
    # Every update inserts 10 new keys, and merges run beside the reads (merge_keys=25): a count
    # taking the tree's entries from one version and its lookups from another would be off by
    # the keys of a merge (not a multiple of 10, or going back). A short switch interval makes
    # the threads interleave at fine grain, as a loaded machine does now and then.
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for _round in range(5):
            index = AttributeIndex.open(f"memory://wal-len-{uuid.uuid4().hex}", page_size=256, merge_keys=25)
            done = threading.Event()

            def writer():
                for n in range(300):
                    index.update({n * 10 + i: n for i in range(10)})
                done.set()

            thread = threading.Thread(target=writer)
            thread.start()
            seen = [0]
            while not done.is_set():
                count = len(index)
                assert count % 10 == 0 and count >= seen[-1], seen[-5:] + [count]
                seen.append(count)
            thread.join()
            assert len(index) == 3000
            index.close()
    finally:
        sys.setswitchinterval(interval)
    index = AttributeIndex.open(f"memory://wal-len-{uuid.uuid4().hex}", page_size=256, merge_keys=25)
    index.update({n: n for n in range(3000)})
    assert len(index) == 3000 and index.verify().ok
    index.bulk_load({5: 5}, progress=None)  # beside the merge thread: no deadlock
    assert len(index) == 3000 and index.get(5) == 5
    index.repair()  # closes the private segment (joins its merge thread) and reopens it
    assert len(index) == 3000
    index.close()


def test_len_counted_while_a_merge_makes_its_version_current_is_exact():
    # The moment the race above needs, made to happen: a merge has made its tree version current
    # (its entry count includes the merged keys) but not yet refreshed the tree's recent-values
    # cache, which still says "absent" for those keys (a count before the merge looked them up).
    index = AttributeIndex.open(f"memory://wal-len-{uuid.uuid4().hex}", merge_keys=10**6, merge_process=False)
    index.update({n: n for n in range(10)})
    assert len(index) == 10  # looks the 10 pending keys up in the tree: absent, and cached so
    tree = index._attributes.tree._tree
    write_version, counts = tree.update_columns, []

    def write_version_then_count(*args, **kwargs):
        written = write_version(*args, **kwargs)
        counts.append(len(index))  # the new version is current; the merge has not returned
        return written

    tree.update_columns = write_version_then_count
    index.flush()
    assert counts == [10] and len(index) == 10
    index.close()


THREADED_CHILD = textwrap.dedent("""
    import sys, threading
    from attrindex import AttributeIndex
    index = AttributeIndex.open(sys.argv[1], page_size=1024, merge_keys=300, wal_rolling_size=1 << 14)
    lock = threading.Lock()

    def writer(t):
        for batch in range(10**9):
            index.update({t * 1_000_000 + batch * 5 + i: batch for i in range(5)})
            with lock:  # one line per returned update: written after it returned
                print(t, batch, flush=True)

    for t in range(4):
        threading.Thread(target=writer, args=(t,), daemon=True).start()
    threading.Event().wait()
""")


def test_updates_of_several_threads_sharing_appends_are_durable_when_each_returns(tmp_path):
    # Group commit: concurrent updates of one handle share storage appends; each call returns only
    # once its own batch is durable, so a SIGKILL right after any return loses none of them.
    directory = str(tmp_path / "index")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", THREADED_CHILD, directory], stdout=subprocess.PIPE, text=True,
                             env=env)
    returned = []
    deadline = time.monotonic() + 20
    while len(returned) < 80 and time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        returned.append(tuple(map(int, line.split())))
    child.send_signal(signal.SIGKILL)
    # The kill can cut the last line mid-print: only lines that end in a newline were written whole.
    *whole, _cut = child.stdout.read().split("\n")
    returned += [tuple(map(int, line.split())) for line in whole if line.strip()]
    child.wait()
    assert len({t for t, _ in returned}) == 4, "every thread returned updates before the kill"
    index = AttributeIndex.open(directory, page_size=1024)
    for t in range(4):
        batches = sorted(b for u, b in returned if u == t)
        assert batches == list(range(len(batches)))  # each thread's updates return in order
        keys = [t * 1_000_000 + b * 5 + i for b in batches for i in range(5)]
        assert index.get_many(keys) == [b for b in batches for _ in range(5)]
    assert index.verify().ok


def test_max_pending_bytes_reaches_the_wal_and_is_checked():
    with pytest.raises(InvalidInputError, match="max_pending_bytes"):
        AttributeIndex.open(f"memory://wal-mpb-{uuid.uuid4().hex}", max_pending_bytes=0)
    index = AttributeIndex.open(f"memory://wal-mpb-{uuid.uuid4().hex}", max_pending_bytes=4096, merge_keys=10**6)
    for n in range(20):  # far beyond 4 KiB pending: updates wait for merges instead of piling up
        index.update({n * 100 + i: i for i in range(100)})
    assert index._attributes.options.max_pending_bytes == 4096 and index.stats().pending_keys < 2000
    assert len(index) == 2000


def test_an_unsettleable_wal_append_is_an_unknown_outcome_and_never_a_duplicate(tmp_path):
    # The answer of the append is lost and storage cannot be read to settle it: the update says
    # so (OutcomeUnknownError), and once storage answers again the batch is there exactly once.
    storage = FaultyStorage(open_storage(str(tmp_path)), seed=4)
    index = AttributeIndex(storage, page_size=256, merge_keys=1000)
    index.update({1: 1})
    storage.script("lost_ack", op="append", path_contains="_wal/_log.seg")
    faulty_append = storage.append

    def append(*args, **kwargs):  # once the answer is lost, no read of the chunk works either
        try:
            faulty_append(*args, **kwargs)
        finally:
            storage.script("fail_before", op="read", path_contains="_wal/_log.seg", times=1000)

    storage.append = append
    with pytest.raises((OutcomeUnknownError, StorageError)) as caught:
        index.update({2: 2})
    assert isinstance(caught.value, OutcomeUnknownError), caught.value
    assert [i.kind for i in storage.injected][:2] == ["lost_ack", "fail_before"]
    storage.enabled = False
    reopened = AttributeIndex(open_storage(str(tmp_path)), page_size=256)
    assert reopened.get_many([1, 2]) == [1, 2] and wal_batches(reopened) == 2  # written once
