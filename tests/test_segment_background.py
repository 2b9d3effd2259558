"""Background merges, back-pressure, truncation of the merged log and group commit of one Segment.

A segment's tier 1 is frozen and merged into the B+tree by a background thread (never on the
append path); appends wait only when tier 1 exceeds ``max_pending_bytes``; concurrent appends
of one handle share one durable storage append. Checked against a dict model (hypothesis), under
injected faults, with child processes SIGKILLed right after calls returned, and with the
history checker over a threaded run with lost acknowledgements.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from attrindex import AttributeUpdate, SegmentStore, UpdateType
from attrindex.errors import BadOffsetError, ConditionalUpdateError, CorruptDataError, MergeBacklogError, StorageError
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage
from testkit.history import Recorder, check, fault_counts, load_history

SMALL = dict(flush_keys=3, log_rolling_size=2048, attribute_options=dict(page_size=512, rolling_size=4096))


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def wait_until(predicate, seconds: float = 20.0) -> bool:
    """Poll ``predicate`` (bounded): the merge runs in another thread."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# -- the dict model, with merges running all the time ----------------------------------------
class BackgroundModel(RuleBasedStateMachine):
    """Appends (plain and conditional), reads, scans, flushes and reopens against a dict and a
    list, while tiny thresholds make the background thread merge after almost every append."""

    def __init__(self):
        super().__init__()
        self.url = f"memory://bg-{uuid.uuid4().hex}"
        self.store = SegmentStore.open(self.url, **SMALL, flush_seconds=0.01)
        self.seg = self.store.segment("s", create=True)
        self.values: dict[bytes, int] = {}
        self.records: list[bytes] = []

    def teardown(self):
        self.store.close()

    @rule(n=st.integers(0, 3), pairs=st.dictionaries(st.integers(0, 11), st.one_of(st.none(), st.integers(-5, 5)),
                                                      max_size=4))
    def append(self, n, pairs):
        records = [b"r%d" % (len(self.records) + i) for i in range(n)]
        if not records and not pairs:
            return
        done = self.seg.append(records, [(key(k), v) for k, v in pairs.items()])
        assert done.first_offset == len(self.records)
        self.records += records
        for k, v in pairs.items():
            if v is None:
                self.values.pop(key(k), None)
            else:
                self.values[key(k)] = v

    @rule(k=st.integers(0, 11), kind=st.sampled_from(["accumulate", "create", "cas", "greater"]),
          value=st.integers(-3, 3), stale=st.booleans())
    def conditional(self, k, kind, value, stale):
        current = self.values.get(key(k))
        if kind == "accumulate":
            update, new, ok = AttributeUpdate(key(k), UpdateType.ACCUMULATE, value), (current or 0) + value, True
        elif kind == "create":
            update, new, ok = AttributeUpdate(key(k), UpdateType.NONE, value), value, current is None
        elif kind == "greater":
            update, new, ok = (AttributeUpdate(key(k), UpdateType.REPLACE_IF_GREATER, value), value,
                               current is None or value > current)
        else:
            compare = current if not stale else (current or 0) + 1
            update, new, ok = (AttributeUpdate(key(k), UpdateType.REPLACE_IF_EQUALS, value, compare=compare), value,
                               compare == current)
        if ok:
            self.seg.update_attributes([update])
            self.values[key(k)] = new
        else:
            with pytest.raises(ConditionalUpdateError):
                self.seg.update_attributes([update])

    @rule(keys=st.lists(st.integers(0, 11), max_size=5))
    def get(self, keys):
        assert self.seg.get_attributes([key(k) for k in keys]) == [self.values.get(key(k)) for k in keys]

    @rule(lo=st.integers(0, 12), span=st.integers(0, 12))
    def scan(self, lo, span):
        expected = sorted((k, v) for k, v in self.values.items() if key(lo) <= k < key(lo + span))
        assert list(self.seg.attributes(key(lo), key(lo + span))) == expected

    @rule()
    def flush(self):
        self.seg.flush()
        assert self.seg.stats().pending_attributes == 0

    @rule()
    def let_the_merge_run(self):
        time.sleep(0.005)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = SegmentStore.open(self.url, **SMALL, flush_seconds=0.01)
        self.seg = self.store.segment("s")

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def read(self, data):
        start = data.draw(st.integers(0, len(self.records) - 1))
        assert [r.value for r in self.seg.read(start, 1000)] == self.records[start:]

    @invariant()
    def no_merge_error(self):
        assert self.seg.stats().merge_error is None


TestBackgroundModel = BackgroundModel.TestCase
TestBackgroundModel.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])


def test_appends_do_not_merge_on_the_callers_thread(tmp_path):
    """The merge into the tree happens on the background thread, not in ``append``."""
    store = SegmentStore.open(str(tmp_path / "s"), flush_keys=1)
    seg = store.segment("s", create=True)
    merging_threads = []
    inner = seg._attributes.tree.update_columns

    def spy(*args, **kwargs):
        merging_threads.append(threading.current_thread())
        return inner(*args, **kwargs)

    seg._attributes.tree.update_columns = spy
    for i in range(5):
        seg.update_attributes({key(i): i})
    assert wait_until(lambda: seg.stats().attribute_checkpoint == seg._log.position)
    assert merging_threads and threading.current_thread() not in merging_threads
    assert seg.stats().merges >= 1
    store.close()
    assert not any(t.is_alive() for t in merging_threads), "close joins the merge thread"


def test_an_idle_overlay_is_merged_after_flush_seconds_without_more_appends(tmp_path):
    with SegmentStore.open(str(tmp_path / "s"), flush_seconds=0.3) as store:
        seg = store.segment("s", create=True)
        time.sleep(0.4)  # idle longer than flush_seconds: the clock starts at the first update
        seg.update_attributes({key(1): 1})
        assert seg.stats().pending_attributes == 1
        assert wait_until(lambda: seg.stats().pending_attributes == 0, 10)  # the thread woke up by itself
        assert seg.stats().attribute_checkpoint == seg._log.position


def test_a_handle_dropped_without_close_lets_its_thread_end(tmp_path):
    import gc

    store = SegmentStore.open(str(tmp_path / "s"), flush_keys=1)
    seg = store.segment("s", create=True)
    seg.update_attributes({key(1): 1})
    thread = seg._attributes.runner._thread
    assert thread.is_alive()
    del seg, store
    gc.collect()
    assert wait_until(lambda: not thread.is_alive(), 10)
    with SegmentStore.open(str(tmp_path / "s")) as again:  # what it appended is there
        assert again.segment("s").get_attribute(key(1)) == 1


def test_read_only_handles_start_no_thread(tmp_path):
    root = str(tmp_path / "s")
    with SegmentStore.open(root) as store:
        store.segment("s", create=True).update_attributes({key(1): 1})
    before = threading.active_count()
    with SegmentStore.open(root) as store:
        seg = store.segment("s")
        assert seg.get_attribute(key(1)) == 1 and list(seg.attributes()) == [(key(1), 1)]
        assert seg._attributes.runner._thread is None and threading.active_count() == before


# -- a failing merge ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fail_before", "enospc"])
def test_a_failing_background_merge_never_fails_appends_and_is_retried(tmp_path, kind, caplog):
    root = str(tmp_path / "s")
    faulty = FaultyStorage(open_storage(root), seed=3)
    store = SegmentStore(faulty, flush_keys=1)
    seg = store.segment("s", create=True)
    faulty.script(kind, op="append", path_contains="_attributes", times=1_000_000)
    with caplog.at_level("WARNING", logger="attrindex.segment"):
        for i in range(20):
            assert seg.append([b"x%d" % i], [AttributeUpdate(key(1), UpdateType.ACCUMULATE, 1)]).first_offset == i
        assert wait_until(lambda: any("failed in the background" in r.getMessage() for r in caplog.records))
    assert any("failed in the background" in r.getMessage() for r in caplog.records)
    assert seg.get_attribute(key(1)) == 20 and seg.stats().attribute_checkpoint is None
    faulty.enabled = False  # storage recovers: the thread's retry (no flush asked) merges it all
    seg.append([b"x20"], [AttributeUpdate(key(1), UpdateType.ACCUMULATE, 1)])
    assert wait_until(lambda: seg.stats().merge_error is None and seg.stats().pending_attributes == 0)
    assert seg.stats().attribute_checkpoint == seg._log.position
    store.close()
    with SegmentStore.open(root) as again:
        seg = again.segment("s")
        assert seg.get_attribute(key(1)) == 21 and len(seg.read(0, 100)) == 21


# -- back-pressure -----------------------------------------------------------------------------
def test_a_merge_that_keeps_failing_refuses_appends_over_max_pending_bytes(tmp_path):
    """Tier 1 over ``max_pending_bytes`` while every merge fails: the append is refused with
    ``MergeBacklogError`` before anything is written (memory stays bounded instead of growing with
    every append), every acknowledged append stays readable, and once the merge succeeds again
    appends go on."""
    root = str(tmp_path / "s")
    faulty = FaultyStorage(open_storage(root), seed=5)
    store = SegmentStore(faulty, flush_keys=1, max_pending_bytes=2_000)
    seg = store.segment("s", create=True)
    faulty.script("fail_before", op="append", path_contains="_attributes", times=1_000_000)
    acknowledged = 0
    with pytest.raises(MergeBacklogError) as refused:
        for n in range(10_000):
            seg.append([b"r%d" % n], {key(n): n})
            acknowledged += 1
    assert acknowledged < 10_000 and "keeps failing" in str(refused.value)
    assert isinstance(refused.value.__cause__, Exception) and seg.stats().merge_error is not None
    # Nothing of the refused append was written: not its record, not its attribute.
    assert seg.stats().pending_bytes <= 2_000 + 1_000
    assert len(seg.read(0, 100_000)) == acknowledged and seg.get_attribute(key(acknowledged)) is None
    with pytest.raises(MergeBacklogError):  # still failing: still refused
        seg.append([b"again"], {key(acknowledged): 1})
    assert len(seg.read(0, 100_000)) == acknowledged
    faulty.enabled = False  # the cause is fixed: the retry merges, appends go on
    assert wait_until(lambda: seg.stats().merge_error is None and seg.stats().pending_attributes == 0)
    assert seg.append([b"after"], {key(acknowledged): -1}).first_offset == acknowledged
    store.close()
    with SegmentStore.open(root) as again:
        seg = again.segment("s")
        assert seg.get_attributes([key(i) for i in range(acknowledged)]) == list(range(acknowledged))
        assert seg.get_attribute(key(acknowledged)) == -1
        assert [r.value for r in seg.read(0, 100_000)] == [b"r%d" % i for i in range(acknowledged)] + [b"after"]


def test_backpressure_blocks_appends_until_the_merge_makes_room(tmp_path):
    store = SegmentStore.open(str(tmp_path / "s"), flush_keys=10, max_pending_bytes=5_000)
    seg = store.segment("s", create=True)
    gate, entered = threading.Event(), threading.Event()
    inner = seg._attributes.tree.update_columns

    def slow_merge(*args, **kwargs):
        entered.set()
        assert gate.wait(20)
        return inner(*args, **kwargs)

    seg._attributes.tree.update_columns = slow_merge
    n = 0
    while not entered.is_set():  # fill until the thread is stuck in a merge
        seg.update_attributes({key(n): n})
        n += 1
    blocked = threading.Event()
    finished = threading.Event()

    def writer():
        nonlocal n
        while seg.stats().pending_bytes <= 5_000:
            seg.update_attributes({key(n): n})
            n += 1
        blocked.set()
        seg.update_attributes({key(n): n})  # above the limit: waits for the merge
        finished.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert blocked.wait(20)
    assert not finished.wait(0.3), f"an append above max_pending_bytes did not wait: {seg.stats()}"
    gate.set()  # the merge completes: room again
    assert finished.wait(20)
    thread.join(20)
    assert seg.get_attributes([key(i) for i in range(n + 1)]) == list(range(n + 1))
    store.close()


def test_one_failed_merge_over_max_pending_bytes_only_delays_the_append(tmp_path):
    """Back-pressure refuses an append only when the merge fails twice in a row: a merge that
    fails once and then succeeds (a transient error) makes the waiting append go on."""
    store = SegmentStore.open(str(tmp_path / "s"), flush_keys=10, max_pending_bytes=5_000)
    seg = store.segment("s", create=True)
    gate, entered, calls = threading.Event(), threading.Event(), []
    inner = seg._attributes.tree.update_columns

    def merge_failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            entered.set()
            assert gate.wait(20)
            raise StorageError("injected: one failed merge")
        return inner(*args, **kwargs)

    seg._attributes.tree.update_columns = merge_failing_once
    n = 0
    while not entered.is_set():  # fill until the thread is stuck in the merge that will fail
        seg.update_attributes({key(n): n})
        n += 1
    while seg.stats().pending_bytes <= 5_000:
        seg.update_attributes({key(n): n})
        n += 1
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(seg.update_attributes({key(n): n})))
    thread.start()
    time.sleep(0.2)
    assert not outcome, "an append above max_pending_bytes did not wait"
    gate.set()  # the merge fails once; its retry succeeds and makes room
    thread.join(20)
    assert len(outcome) == 1 and len(calls) >= 2 and seg.stats().merge_error is None
    assert seg.get_attributes([key(i) for i in range(n + 1)]) == list(range(n + 1))
    store.close()


# -- truncation of the merged log ----------------------------------------------------------------
def test_truncate_merged_log_keeps_about_one_chunk_beyond_the_tree(tmp_path):
    root = str(tmp_path / "s")
    options = dict(truncate_merged_log=True, log_rolling_size=1024, flush_keys=20)
    with SegmentStore.open(root, **options) as store:
        seg = store.segment("s", create=True)
        for i in range(400):
            seg.update_attributes({key(i % 50): i})
        seg.flush()
        stats = seg.stats()
        assert stats.log_chunks <= 2 and stats.log_bytes <= 2 * 1024 + 512
        assert seg._log.start_position <= stats.attribute_checkpoint  # never above the checkpoint
    with SegmentStore.open(root, **options) as store:
        seg = store.segment("s")
        assert seg.get_attributes([key(i) for i in range(50)]) == [350 + i for i in range(50)]


def test_a_crash_between_merge_and_truncation_is_harmless(tmp_path, caplog):
    """The merge is durable, the truncation that follows fails (as if the process died there):
    the log keeps more than it must, nothing is lost, and a later merge truncates."""
    root = str(tmp_path / "s")
    options = dict(truncate_merged_log=True, log_rolling_size=1024, flush_keys=10**6)
    faulty = FaultyStorage(open_storage(root), seed=4)
    store = SegmentStore(faulty, **options)
    seg = store.segment("s", create=True)
    faulty.script("fail_before", op="put_marker", path_contains="truncation", times=10**6)
    for i in range(200):
        seg.update_attributes({key(i % 30): i})
    with caplog.at_level("WARNING", logger="attrindex.segment"):
        seg.flush()  # the merge succeeds; the truncation after it does not
    assert any("truncating the merged log" in r.getMessage() for r in caplog.records)
    assert seg.stats().merge_error is None and seg._log.start_position == 0 and seg.stats().log_chunks > 2
    assert seg.stats().attribute_checkpoint == seg._log.position
    # "Crash": abandon the handle, open a new store on the same files.
    with SegmentStore.open(root, **options) as again:
        fresh = again.segment("s")
        last = [max(i for i in range(200) if i % 30 == k) for k in range(30)]
        assert fresh.get_attributes([key(k) for k in range(30)]) == last
        fresh.update_attributes({key(0): -1})
        fresh.flush()  # this merge's truncation goes through
        assert fresh._log.start_position > 0
    with SegmentStore.open(root, **options) as again:
        assert again.segment("s").get_attributes([key(0), key(1)]) == [-1, 181]


def test_a_handle_behind_another_handles_truncation_catches_up_through_the_tree(tmp_path):
    """Handle B last saw the log before handle A merged and truncated past B's position: B's
    next conditional append (a lost race, then catch-up) must count what only the tree holds."""
    root = str(tmp_path / "s")
    options = dict(truncate_merged_log=True, log_rolling_size=512, flush_keys=5)
    store_a, store_b = SegmentStore.open(root, **options), SegmentStore.open(root, **options)
    a = store_a.segment("s", create=True)
    b = store_b.segment("s")
    b.update_attributes({key(1): 1})
    a.refresh()
    a.update_attributes({key(3): 7})  # only in the part of the log A will cut
    for i in range(100):
        a.append([b"a%d" % i], [AttributeUpdate(key(2), UpdateType.ACCUMULATE, 1)])
    a.flush()
    assert a._log.start_position > b._log.position  # A cut what B has not replayed
    b.append([b"b"], [AttributeUpdate(key(3), UpdateType.ACCUMULATE, 1)])
    assert b.get_attributes([key(1), key(2), key(3)]) == [1, 100, 8]
    a.refresh()
    assert a.get_attributes([key(1), key(2), key(3)]) == [1, 100, 8]
    store_a.close()
    store_b.close()
    with SegmentStore.open(root, **options) as store:
        assert store.segment("s").get_attributes([key(1), key(2), key(3)]) == [1, 100, 8]


# -- group commit --------------------------------------------------------------------------------
def _gate_first_log_append(seg):
    """Hold the next storage append of the log until the returned event is set."""
    gate, entered = threading.Event(), threading.Event()
    inner = seg._log.bytes.append

    def append(data, expected_offset=None):
        if not entered.is_set():
            entered.set()
            assert gate.wait(20)
        return inner(data, expected_offset=expected_offset)

    seg._log.bytes.append = append
    return gate, entered


def test_a_group_is_one_storage_append_and_failures_stay_with_their_caller(tmp_path):
    store = SegmentStore.open(str(tmp_path / "s"))
    seg = store.segment("s", create=True)
    seg.append([b"first"])
    groups_before = seg.stats().append_groups
    gate, entered = _gate_first_log_append(seg)
    outcomes: dict[str, object] = {}

    def call(name, fn):
        try:
            outcomes[name] = fn()
        except Exception as exc:  # noqa: BLE001 - each caller's own outcome is the point
            outcomes[name] = exc

    leader = threading.Thread(target=call, args=("leader", lambda: seg.append([b"lead"])))
    leader.start()
    assert entered.wait(20)  # the leader is inside storage: the others queue behind it
    members = {
        "create": lambda: seg.append([b"c"], [AttributeUpdate(key(1), UpdateType.NONE, 5)]),
        "create_again": lambda: seg.append([b"c2"], [AttributeUpdate(key(1), UpdateType.NONE, 6)]),
        "accumulate": lambda: seg.append([b"a"], [AttributeUpdate(key(1), UpdateType.ACCUMULATE, 10)]),
        "stale_offset": lambda: seg.append([b"s"], expected_offset=1),
        "cas": lambda: seg.append([b"q"], [AttributeUpdate(key(1), UpdateType.REPLACE_IF_EQUALS, 0, compare=15)]),
    }
    threads = []
    for name, fn in members.items():  # queued in this order: the group validates in it
        threads.append(threading.Thread(target=call, args=(name, fn)))
        threads[-1].start()
        assert wait_until(lambda: len(seg._appender._queue._waiting) == len(threads) + 1)
    gate.set()
    for thread in [leader, *threads]:
        thread.join(20)
    assert isinstance(outcomes["create_again"], ConditionalUpdateError)  # key 1 was created by "create"
    assert isinstance(outcomes["stale_offset"], BadOffsetError)
    offsets = {n: o.first_offset for n, o in outcomes.items() if not isinstance(o, Exception)}
    assert offsets == {"leader": 1, "create": 2, "accumulate": 3, "cas": 4}
    assert seg.stats().append_groups == groups_before + 2  # the leader's, then the five queued ones: one append
    assert seg.get_attribute(key(1)) == 0
    store.close()
    with SegmentStore.open(str(tmp_path / "s")) as again:
        seg = again.segment("s")
        assert [r.value for r in seg.read(0, 10)] == [b"first", b"lead", b"c", b"a", b"q"]
        assert seg.get_attribute(key(1)) == 0


def _grouped_appends(root: str, members: int) -> None:
    """A single append, then ``members`` appends written as one group (one storage append)."""
    with SegmentStore.open(root) as store:
        seg = store.segment("s", create=True)
        seg.append([b"single"])
        gate, entered = _gate_first_log_append(seg)
        threads = [threading.Thread(target=seg.append, args=([b"lead"],))]
        threads[0].start()
        assert entered.wait(20)
        for i in range(members):
            threads.append(threading.Thread(target=seg.append, args=([b"m%d" % i],)))
            threads[-1].start()
            assert wait_until(lambda: len(seg._appender._queue._waiting) == len(threads))
        gate.set()
        for thread in threads:
            thread.join(20)
        assert seg.stats().append_groups == 3


@pytest.mark.parametrize("torn", ["first-header", "second-payload"])
def test_a_crash_mid_group_keeps_the_whole_batches_before_the_tear(tmp_path, caplog, torn):
    """A group is one storage append: a crash tears it somewhere. The batches of the group before
    the tear are whole frames and stay (none was acknowledged; a writer that retries finds them,
    as after a lost acknowledgement); the torn one and those after it are cut with a warning, and
    a torn batch whose header was written keeps its offset from ever being given out again."""
    from attrindex.log.batch.chain import iter_batches
    from attrindex.log.batch.header import BATCH_HEADER_SIZE
    from tests.raw_chunks import committed

    root = str(tmp_path / "s")
    _grouped_appends(root, 3)
    path = os.path.join(root, "s", "_log.seg", "0" * 20)
    batches = list(iter_batches(committed(path)))
    assert [h.base_offset for _p, h in batches] == [0, 1, 2, 3, 4]  # single, lead, then the group m0..m2
    (group_at, _first), (second_at, second) = batches[2], batches[3]
    tear = group_at + 10 if torn == "first-header" else second_at + BATCH_HEADER_SIZE + 1
    with open(path, "r+b") as f:  # the group's bytes from the tear on never reached the disk
        f.seek(tear)
        f.write(bytes(second_at + second.size + batches[4][1].size - tear))
    with SegmentStore.open(root) as store, caplog.at_level("WARNING", logger="attrindex.storage"):
        seg = store.segment("s")
        kept = [b"single", b"lead"] + ([b"m0"] if torn == "second-payload" else [])
        assert [r.value for r in seg.read(0, 10)] == kept
        # a header written whole claims its offset (3: m1's): the next append goes above it
        assert seg.append([b"next"]).first_offset == (4 if torn == "second-payload" else 2)
        assert any("torn write" in r.getMessage() for r in caplog.records)  # said when cut
        assert [r.value for r in seg.read(0, 10)] == kept + [b"next"]
        assert store.verify_segment("s").ok


def test_damage_below_a_group_is_corruption_not_a_torn_write(tmp_path):
    """A flipped byte in the batch before a group: whole frames follow it, so it is damage below
    committed data (reported), never cut as a torn write."""
    from attrindex.log.batch.chain import iter_batches
    from attrindex.log.batch.header import BATCH_HEADER_SIZE
    from tests.raw_chunks import committed

    root = str(tmp_path / "s")
    _grouped_appends(root, 3)
    path = os.path.join(root, "s", "_log.seg", "0" * 20)
    lead_at = list(iter_batches(committed(path)))[1][0]
    with open(path, "r+b") as f:
        f.seek(lead_at + BATCH_HEADER_SIZE)
        byte = f.read(1)[0]
        f.seek(lead_at + BATCH_HEADER_SIZE)
        f.write(bytes([byte ^ 0x40]))
    with SegmentStore.open(root) as store:
        with pytest.raises(CorruptDataError, match="invalid record batch"):
            store.segment("s").read(0, 10)
        assert [d.start for d in store.verify_segment("s").damage] == [lead_at]


def test_concurrent_appends_share_storage_appends(tmp_path):
    store = SegmentStore.open(str(tmp_path / "s"))
    seg = store.segment("s", create=True)
    counter = AttributeUpdate(key(9), UpdateType.ACCUMULATE, 1)
    results: list = []

    def writer(w):
        for i in range(40):
            results.append((w, i, seg.append([b"%d:%d" % (w, i)], [counter]).first_offset))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    stats = seg.stats()
    assert sorted(o for _, _, o in results) == list(range(320))
    assert stats.appends_grouped == 320 and stats.append_groups < 320  # some were grouped
    records = {r.offset: r.value for r in seg.read(0, 1000)}
    assert all(records[o] == b"%d:%d" % (w, i) for w, i, o in results)
    assert seg.get_attribute(key(9)) == 320
    store.close()


def test_groups_of_two_handles_racing_revalidate_and_count_exactly(tmp_path):
    """Two handles (as two processes would), four threads each: groups lose compare-and-append
    races to the other handle and are validated again from the new tail; every ACCUMULATE counts
    once and every record is stored once."""
    root = str(tmp_path / "s")
    stores = [SegmentStore.open(root, flush_keys=7) for _ in range(2)]
    handles = [stores[0].segment("s", create=True), stores[1].segment("s")]
    done: list[tuple[bytes, int]] = []

    def writer(h, w):
        for i in range(25):
            payload = b"%d-%d-%d" % (h, w, i)
            result = handles[h].append([payload], [AttributeUpdate(key(5), UpdateType.ACCUMULATE, 3)])
            done.append((payload, result.first_offset))

    threads = [threading.Thread(target=writer, args=(h, w)) for h in range(2) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sum(s.segment("s").stats().append_groups for s in stores) < 200  # some grouped
    for store in stores:
        store.close()
    with SegmentStore.open(root) as store:
        seg = store.segment("s")
        stored = {r.offset: r.value for r in seg.read(0, 1000)}
        assert len(stored) == 200 and all(stored[o] == p for p, o in done)
        assert seg.get_attribute(key(5)) == 600


def test_lone_unconditional_appends_of_two_handles_lose_races_and_land_once(tmp_path):
    """The lone-append path (no conditions, no expected offset: written as encoded, no planning)
    meets the other handle's appends: its batch was encoded at a stale end, or its write loses
    the compare-and-append. Either way it is rebased on the true tail; each record is stored once,
    at the offset its call returned, and the last REPLACE of each key wins."""
    root = str(tmp_path / "s")
    stores = [SegmentStore.open(root, flush_keys=50) for _ in range(2)]
    handles = [stores[0].segment("s", create=True), stores[1].segment("s")]
    done: list[tuple[bytes, int]] = []

    def writer(h):
        for i in range(60):
            payload = b"%d-%d" % (h, i)
            result = handles[h].append([payload], [(key(h), i), (key(7), h * 1000 + i)])
            done.append((payload, result.first_offset))

    threads = [threading.Thread(target=writer, args=(h,)) for h in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for store in stores:
        store.close()
    with SegmentStore.open(root) as store:
        seg = store.segment("s")
        records = seg.read(0, 1000)
        assert sorted(r.offset for r in records) == list(range(120))
        stored = {r.offset: r.value for r in records}
        assert all(stored[offset] == payload for payload, offset in done)
        assert seg.get_attribute(key(0)) == 59 and seg.get_attribute(key(1)) == 59
        last = max(done, key=lambda d: d[1])[0]  # the last record's writer set key 7 last
        h, i = map(int, last.split(b"-"))
        assert seg.get_attribute(key(7)) == h * 1000 + i


def test_the_write_queue_bounds_groups_and_hands_a_failed_write_to_each_member():
    from attrindex.write_queue import WriteQueue, WriteRequest

    queue = WriteQueue(max_group_bytes=1000, max_group_requests=3)
    gate, groups = threading.Event(), []

    def write(group):
        groups.append([r.payload for r in group])
        if len(groups) == 1:
            assert gate.wait(20)  # the first leader holds on: the rest queue behind it
        if any(r.payload == "boom" for r in group):
            raise OSError("the write failed")
        for r in group:
            r.settle(r.payload.upper())

    outcomes = {}

    def call(payload, size=10):
        try:
            outcomes[payload] = queue.submit(WriteRequest(payload, size), write)
        except OSError as exc:
            outcomes[payload] = exc

    first = threading.Thread(target=call, args=("lead",))
    first.start()
    assert wait_until(lambda: groups)
    threads = []
    for payload, size in (("a", 10), ("boom", 10), ("b", 10), ("c", 10), ("big", 2000)):
        threads.append(threading.Thread(target=call, args=(payload, size)))
        threads[-1].start()
        assert wait_until(lambda: len(queue._waiting) == len(threads) + 1)
    gate.set()
    for thread in [first, *threads]:
        thread.join(20)
    assert groups == [["lead"], ["a", "boom", "b"], ["c"], ["big"]]  # 3 at most; bytes bound "big" alone
    assert outcomes["lead"] == "LEAD" and outcomes["c"] == "C" and outcomes["big"] == "BIG"
    assert all(isinstance(outcomes[p], OSError) for p in ("a", "boom", "b"))
    assert not queue._waiting


def test_the_new_options_are_checked_before_anything_is_opened():
    from attrindex.errors import InvalidInputError

    for bad in (dict(max_pending_bytes=0), dict(max_pending_bytes=1.5), dict(truncate_merged_log=1),
                dict(truncate_merged_log="yes")):
        with pytest.raises(InvalidInputError, match=next(iter(bad))):
            SegmentStore.open(f"memory://opts-{uuid.uuid4().hex}", **bad)


def group_writer(directory: str, threads: int, truncate: str = "") -> None:
    """Child process: ``threads`` threads append to one handle (one record and an ACCUMULATE of
    counter key 7 each), printing ``payload offset`` after each return. ``truncate``: with
    ``truncate_merged_log`` and small chunks, so kills land between merges and truncations."""
    options = dict(truncate_merged_log=True, log_rolling_size=1024) if truncate else {}
    store = SegmentStore.open(directory, flush_keys=5, **options)
    seg = store.segment("g")
    lock = threading.Lock()

    def run(w):
        for i in range(10**9):
            payload = f"{os.getpid()}-{w}-{i}"
            done = seg.append([payload.encode()], [AttributeUpdate(key(7), UpdateType.ACCUMULATE, 1),
                                                   AttributeUpdate(key(100 + i % 50), value=i)])  # merges often
            with lock:
                os.write(1, f"{payload} {done.first_offset}\n".encode())

    for w in range(threads):
        threading.Thread(target=run, args=(w,), daemon=True).start()
    time.sleep(3600)


def test_each_grouped_append_is_durable_when_it_returns_sigkill(tmp_path):
    directory = str(tmp_path / "s")
    with SegmentStore.open(directory) as store:
        store.segment("g", create=True)
    acknowledged: dict[str, int] = {}
    for life in range(3):
        child = subprocess.Popen([sys.executable, "-m", "tests.test_segment_background", "group_writer", directory,
                                  "8"], stdout=subprocess.PIPE, text=True)
        lines = [child.stdout.readline() for _ in range(30)]  # it runs: kill it mid-stream, soon
        time.sleep(0.05 * life)
        child.send_signal(signal.SIGKILL)
        lines += child.stdout.read().splitlines()
        child.wait()
        acknowledged.update((p, int(o)) for p, o in (line.split() for line in lines if line.strip().count(" ") == 1))
        with SegmentStore.open(directory) as store:
            seg = store.segment("g")
            stored = {r.value.decode(): r.offset for r in seg.read(0, 10**6)}
            assert all(stored.get(p) == o for p, o in acknowledged.items()), f"life {life}: an ack was lost"
            assert len(stored) == seg.next_offset  # no duplicates, no holes
            assert (seg.get_attribute(key(7)) or 0) == len(stored)
    assert len(acknowledged) > 50


def test_kills_beside_merges_and_truncations_of_the_merged_log_lose_nothing(tmp_path):
    """SIGKILLed while its merge thread merges and truncates (truncate_merged_log): every
    acknowledged increment is in the counter, at most one in-flight append per thread more, and
    the segment opens every time (a kill between merge and truncation is harmless)."""
    directory = str(tmp_path / "s")
    options = dict(truncate_merged_log=True, log_rolling_size=1024, flush_keys=5)
    with SegmentStore.open(directory, **options) as store:
        store.segment("g", create=True)
    acknowledged: set[str] = set()
    for life in range(3):
        child = subprocess.Popen([sys.executable, "-m", "tests.test_segment_background", "group_writer", directory,
                                  "4", "truncate"], stdout=subprocess.PIPE, text=True)
        lines = [child.stdout.readline() for _ in range(60 + 40 * life)]
        child.send_signal(signal.SIGKILL)
        lines += child.stdout.read().splitlines()
        child.wait()
        acknowledged |= {line.split()[0] for line in lines if line.strip().count(" ") == 1}
        with SegmentStore.open(directory, **options) as store:
            seg = store.segment("g")
            counter = seg.get_attribute(key(7)) or 0
            assert len(acknowledged) <= counter <= len(acknowledged) + 4 * (life + 1), f"life {life}"
            assert counter == seg.next_offset  # one record per increment: none lost, none twice
            assert seg._log.start_position > 0  # the merged log was truncated
    assert len(acknowledged) >= 240


# -- the history checker over one shared handle, with lost acknowledgements ---------------------
def test_threads_on_one_handle_under_lost_acks_pass_the_history_checker(tmp_path):
    directory, history = str(tmp_path / "s"), str(tmp_path / "history")
    os.makedirs(history)
    faulty = FaultyStorage(open_storage(directory), seed=11, rates={"lost_ack": 0.05, "fail_before": 0.02})
    faulty.script("lost_ack", path_contains="_log.seg", times=3)
    store = SegmentStore(faulty, flush_keys=3, log_rolling_size=4096,
                         attribute_options=dict(page_size=512, rolling_size=4096))
    seg = store.segment("h", create=True)

    def client(c):
        recorder = Recorder(os.path.join(history, f"t{c}.jsonl"), f"t{c}")
        last = None
        for n in range(40):
            if n % 4 == 3:
                value = c * 10_000 + n
                with recorder.operation("append", payloads=[f"t{c}:{n}"], cas=["cas", last, value]):
                    seg.append([f"t{c}:{n}".encode()],
                               [AttributeUpdate(key(2), UpdateType.REPLACE_IF_EQUALS, value, compare=last)])
                with recorder.operation("read", cas=True) as out:
                    out["value"] = last = seg.get_attribute(key(2))
            else:
                with recorder.operation("append", payloads=[f"t{c}:{n}"], increments={"c": 2}) as out:
                    done = seg.append([f"t{c}:{n}".encode()], [AttributeUpdate(key(1), UpdateType.ACCUMULATE, 2)])
                    out.update(first_offset=done.first_offset, last_offset=done.last_offset)
        recorder.faults([])
        recorder.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive()
    with open(os.path.join(history, "faults.jsonl"), "w") as handle:
        handle.write(json.dumps({"phase": "faults", "counts": {"lost_ack": len(
            [i for i in faulty.injected if i.kind == "lost_ack"])}, "client": "-", "t": 0}) + "\n")
    faulty.enabled = False
    try:
        store.close()
    except Exception:  # noqa: BLE001 - a merge that fails at close leaves what is durable
        pass
    with SegmentStore.open(directory) as again:
        seg = again.segment("h")
        final = {"records": [[r.offset, r.value.decode()] for r in seg.read(0, 10**6)],
                 "attributes": dict(zip(["c", "cas"], seg.get_attributes([key(1), key(2)])))}
    events = load_history(history)
    result = check(events, final)
    result.assert_valid()
    assert result.ok > 100 and fault_counts(events)["lost_ack"] >= 3 and seg.stats is not None
    assert result.duplicates == 0 and result.lost == 0


# -- retention beside the background merge -------------------------------------------------------
def test_retention_cooperates_with_the_background_merge(tmp_path):
    root = str(tmp_path / "s")
    options = dict(flush_keys=4, log_rolling_size=1024)
    store = SegmentStore.open(root, **options)
    seg = store.segment("s", create=True)
    stop = threading.Event()
    appended = []

    def writer(w):
        i = 0
        while not stop.is_set() and i < 300:
            seg.append([b"%d" % i], [AttributeUpdate(key(1), UpdateType.ACCUMULATE, 1), (key(100 + w), i)])
            appended.append(w)
            i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for thread in threads:
        thread.start()
    deleted = 0
    for _ in range(20):
        deleted += seg.apply_retention(max_bytes=2048)
        time.sleep(0.01)
    for thread in threads:
        thread.join(60)
    assert seg.get_attribute(key(1)) == len(appended) == 900
    store.close()
    assert deleted > 0
    with SegmentStore.open(root, **options) as again:
        seg = again.segment("s")
        assert seg.get_attributes([key(1), key(100), key(101), key(102)]) == [900, 299, 299, 299]


if __name__ == "__main__":
    if sys.argv[1] == "group_writer":
        group_writer(sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
