"""Merges hosted in a worker process (``merge_process``, local disk): attrindex/merge_worker.py.

The worker reads the log itself and commits the tree; the writer adopts the tree it wrote. Attacks:
the worker dies before or after committing (its answer lost), hangs, is SIGKILLed from outside;
the writer is SIGKILLed while its worker is mid-merge; readers run through the swap. After each,
a dict model of every acknowledged update must match, live and after reopening.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attrindex import SegmentStore, attribute_state, merge_runner, merge_worker
from attrindex.attribute_index import AttributeIndex
from attrindex.errors import InvalidInputError
from attrindex.value_cache import MISSING

from .merge_faults import MergeFaults, child_program_lines

WAIT = 60.0  # seconds: bound of every wait below (a loaded machine); never a timed assertion


@pytest.fixture(autouse=True)
def every_merge_in_the_worker(monkeypatch):
    monkeypatch.setattr(merge_runner, "MIN_WORKER_KEYS", 1)


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def merged_up_to_position(index: AttributeIndex) -> bool:
    state = index._attributes
    with index._lock:
        return state._frozen is None and (state.tree.checkpoint or 0) >= state._frozen_at and state.runner.merges > 0


@pytest.fixture
def merge_faults(monkeypatch, tmp_path_factory) -> MergeFaults:
    """Scripted faults for the merge workers the test starts (``tests/merge_faults.py``)."""
    return MergeFaults(monkeypatch, tmp_path_factory.mktemp("merge-faults"))


def merge_error(index: AttributeIndex) -> str | None:
    """Why the index's last merge failed (as ``Segment.stats().merge_error`` says it), or None."""
    error = index._attributes.runner.error
    return None if error is None else f"{type(error).__name__}: {error}"


def check(index: AttributeIndex, model: dict) -> None:
    keys = sorted(model)
    assert index.get_many(keys) == [model[k] for k in keys]
    assert len(index) == sum(v is not None for v in model.values())


def open_index(path, **options) -> AttributeIndex:
    return AttributeIndex.open(str(path), page_size=1024, merge_keys=options.pop("merge_keys", 200), **options)


def write(index: AttributeIndex, model: dict, rng: random.Random, calls: int, per_call: int = 100) -> None:
    for _ in range(calls):
        batch = {key(rng.randrange(2000)): rng.choice([None, rng.randrange(1 << 40)]) for _ in range(per_call)}
        index.update(batch)
        model.update(batch)


def test_merges_run_in_one_reused_worker_and_match_a_dict(tmp_path):
    index, model, rng = open_index(tmp_path), {}, random.Random(1)
    try:
        for _round in range(3):
            write(index, model, rng, 5)
            wait_for(lambda: merged_up_to_position(index), "the merge")
            check(index, model)
        worker = index._attributes.runner.worker
        assert worker is not None and worker.starts == 1 and index.stats().pending_keys < len(model)
        assert index._attributes.runner.merges >= 3 and merge_error(index) is None
        pid = worker.pid
    finally:
        index.close()
    wait_for(lambda: not _alive(pid), "the worker to exit at close")
    with open_index(tmp_path) as reopened:
        check(reopened, model)
        assert reopened.verify().ok


def test_stats_count_the_bytes_the_worker_writes(tmp_path):
    index, rng, keys = open_index(tmp_path, merge_keys=300), random.Random(2), 0
    try:
        for _call in range(12):
            batch = {key(rng.randrange(2000)): rng.choice([None, rng.randrange(1 << 40)]) for _ in range(100)}
            index.update(batch)
            keys += len(batch)
        wait_for(lambda: merged_up_to_position(index) and not index.stats().pending_keys, "the merges")
        runner = index._attributes.runner
        assert runner.worker is not None and runner.worker.starts == 1 and runner.merges >= 2
        stats = index.stats()  # every byte of the tree was written by this handle's worker
        assert 0 < stats.bytes_written == stats.length and stats.updates_written == 12
        assert stats.logical_bytes == keys * 24 and stats.wal_bytes_written == index.checkpoint
        assert stats.write_amplification == (stats.wal_bytes_written + stats.bytes_written) / stats.logical_bytes
        tree = index._attributes.tree.stats()  # the tree's own: the key updates the worker merged
        assert 0 < tree.logical_bytes <= stats.logical_bytes and tree.bytes_written == stats.bytes_written
    finally:
        index.close()


def test_a_worker_replay_past_the_fold_threshold_merges_the_newest_of_each_key(tmp_path):
    """The worker replays the WAL into an overlay of its own and folds its recent part into
    columns at ``FOLD_KEYS`` entries, as the writer does (tier 1's memory bound holds in the
    worker too). One background merge of more keys than that, in which updates and removals of
    keys folded earlier in the replay come later: the tree gets the newest of each."""
    from attrindex.overlay import FOLD_KEYS

    first, n = FOLD_KEYS + 10_000, FOLD_KEYS + 20_000
    index, model = open_index(tmp_path, merge_keys=n, merge_seconds=3600), {}

    def update(batch):
        index.update(batch)
        model.update(batch)

    try:
        for start in range(0, first, 20_000):
            update({key(i): i for i in range(start, min(first, start + 20_000))})
        update({key(i): (None if i % 3 else -i) for i in range(0, FOLD_KEYS, 97)})  # folded in the replay, then changed
        update({key(i): i for i in range(first, n)})  # n keys pending: the background merge starts
        wait_for(lambda: merged_up_to_position(index), "the merge")
        runner = index._attributes.runner
        assert runner.worker is not None and runner.worker.starts == 1 and runner.merges == 1
        assert merge_error(index) is None and index.stats().pending_keys == 0
        check(index, model)
    finally:
        index.close()


@pytest.mark.parametrize("fault, lands", [("exit_before_commit", False), ("exit_after_commit", True)])
def test_a_worker_dying_mid_merge_fails_no_write_and_is_replaced(tmp_path, fault, lands, merge_faults):
    index, model, rng = open_index(tmp_path), {}, random.Random(2)
    try:
        worker = index._attributes.runner.worker_for_merges()
        merge_faults.set(fault)
        write(index, model, rng, 3)
        if lands:  # the answer is lost, the tree covers the merge: that is a success
            wait_for(lambda: merged_up_to_position(index), "the merge that landed")
            assert merge_error(index) is None
        else:
            error = wait_for(lambda: merge_error(index), "the failed merge to be recorded")
            assert "MergeWorkerError" in error
        check(index, model)  # reads never noticed
        merge_faults.set(None)
        write(index, model, rng, 3)  # durable whatever the merge does
        wait_for(lambda: merged_up_to_position(index) and merge_error(index) is None, "the retried merge")
        assert worker.starts >= 2
        check(index, model)
    finally:
        index.close()
    with open_index(tmp_path) as reopened:
        check(reopened, model)


def test_a_hung_worker_is_killed_after_the_timeout(tmp_path, monkeypatch, merge_faults):
    """Hung = no progress for ``merge_hang_seconds`` (the 10-minute cap on one merge stays as it
    is: it must not be what ends the wait)."""
    monkeypatch.setattr(merge_runner, "MERGE_RETRY_MIN_SECONDS", 0.01)
    index, model, rng = open_index(tmp_path, merge_hang_seconds=0.3), {}, random.Random(3)
    try:
        worker = index._attributes.runner.worker_for_merges()
        merge_faults.set("hang")
        write(index, model, rng, 3)
        error = wait_for(lambda: merge_error(index), "the hang to be noticed")
        assert "made no progress" in error and "merge_hang_seconds=0.3" in error
        merge_faults.set(None)
        wait_for(lambda: merged_up_to_position(index), "the retried merge")
        assert worker.starts >= 2 and not index._attributes.runner.worker_disabled
        check(index, model)
    finally:
        index.close()


def test_a_worker_stopped_from_outside_is_killed_and_replaced(tmp_path, monkeypatch):
    """SIGSTOP (a debugger, a frozen cgroup, swap death): the worker lives but does nothing, at
    whatever moment it was stopped (mid-merge, or idle and then sent the next merge)."""
    monkeypatch.setattr(merge_runner, "MERGE_RETRY_MIN_SECONDS", 0.01)
    index, model, rng = open_index(tmp_path, merge_hang_seconds=0.3), {}, random.Random(10)
    stopped = []
    try:
        for _round in range(3):
            write(index, model, rng, 3)
            pid = wait_for(lambda: index._attributes.runner.worker is not None and index._attributes.runner.worker.pid, "a worker")
            time.sleep(rng.random() * 0.05)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            write(index, model, rng, 3)  # durable whatever the worker does
            wait_for(lambda: merged_up_to_position(index) and merge_error(index) is None
                     and index._attributes.runner.worker.pid not in stopped, "a merge by a new worker")
            check(index, model)
        assert not any(_alive(pid) for pid in stopped)
    finally:
        for pid in stopped:  # (only if the test failed: the index kills them)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        index.close()
    with open_index(tmp_path) as reopened:
        check(reopened, model)
        assert reopened.verify().ok


def test_close_never_waits_for_a_hung_worker_and_loses_nothing(tmp_path, merge_faults):
    """The worker hangs mid-merge and the hang allowance is long (10 minutes): close kills it at
    once (the WAL holds every acknowledged update) and merges in its own thread; every update
    acknowledged before and during the hang reads back, live and after reopening."""
    index, model, rng = open_index(tmp_path, merge_hang_seconds=600), {}, random.Random(11)
    worker = index._attributes.runner.worker_for_merges()
    merge_faults.set("hang")
    write(index, model, rng, 3)
    wal = index._attributes
    wait_for(lambda: wal.runner._mutex.locked() and wal._frozen is not None and worker.pid, "the merge to hang")
    pid = worker.pid
    write(index, model, rng, 3)  # acknowledged while the worker hangs
    check(index, model)
    closer = threading.Thread(target=index.close)
    closer.start()
    closer.join(WAIT)  # (10 minutes without the kill at close)
    assert not closer.is_alive(), "close waited for the hung worker"
    assert not _alive(pid) and merge_error(index) is None
    with open_index(tmp_path) as reopened:
        check(reopened, model)
        assert reopened.verify().ok
        assert reopened.stats().pending_keys == 0  # close merged everything itself


def test_close_merges_what_is_frozen_and_what_came_after_in_one_merge(tmp_path, merge_faults, monkeypatch):
    """A merge of a large tree costs about the same for more keys (dense merges rebuild it), so
    close folds the active overlay into the frozen one the killed worker was merging and merges
    them once, not twice."""
    index, model, rng = open_index(tmp_path, merge_hang_seconds=600), {}, random.Random(12)
    worker = index._attributes.runner.worker_for_merges()
    merge_faults.set("hang")
    write(index, model, rng, 3)
    wal = index._attributes
    wait_for(lambda: wal.runner._mutex.locked() and wal._frozen is not None and worker.pid, "the merge to hang")
    write(index, model, rng, 3)  # into the active overlay, over the frozen one
    merged = []
    original = merge_runner.merge_overlay
    monkeypatch.setattr(merge_runner, "merge_overlay",
                        lambda tree, overlay, at, base=None, defer_rebuild=False: merged.append(len(overlay)) or original(tree, overlay, at, base, defer_rebuild))
    index.close()
    assert merged == [len(model)]  # one merge of every key written (none was merged before)
    with open_index(tmp_path) as reopened:
        check(reopened, model)
        assert reopened.stats().pending_keys == 0


def test_flush_waits_for_a_hung_worker_only_until_it_is_found_hung(tmp_path, merge_faults):
    """``flush`` needs the merge mutex, which the merge thread holds while it waits on the worker:
    with a worker hung mid-merge, flush goes on once the hang is noticed and merges itself."""
    index, model, rng = open_index(tmp_path, merge_hang_seconds=0.3), {}, random.Random(13)
    try:
        worker = index._attributes.runner.worker_for_merges()
        merge_faults.set("hang")
        write(index, model, rng, 3)
        wal = index._attributes
        wait_for(lambda: wal.runner._mutex.locked() and wal._frozen is not None and worker.pid, "the merge to hang")
        flusher = threading.Thread(target=index.flush)
        flusher.start()
        flusher.join(WAIT)  # (10 minutes when only the cap on one merge ended the wait)
        assert not flusher.is_alive(), "flush waited for the hung worker"
        assert index.stats().pending_keys == 0
        check(index, model)
    finally:
        index.close()


def test_workers_that_hang_at_start_leave_the_merges_to_a_thread(tmp_path, monkeypatch, caplog):
    """A worker that never says it is ready (stuck before or while opening the index) is killed
    once it stops making progress, not after a minute; three in a row send merges to a thread."""
    monkeypatch.setattr(merge_worker, "WORKER_MAIN", "import time; time.sleep(3600)")
    monkeypatch.setattr(merge_worker, "_START_SECONDS", 3600.0)  # the cap must not be what ends the wait
    monkeypatch.setattr(merge_runner, "MERGE_RETRY_MIN_SECONDS", 0.01)
    with open_index(tmp_path, merge_hang_seconds=0.3) as index:
        model = {}
        write(index, model, random.Random(14), 4)
        wait_for(lambda: merged_up_to_position(index) and merge_error(index) is None, "the merge")
        assert index._attributes.runner.worker_disabled and index._attributes.runner.worker.starts == merge_worker.MAX_WORKER_START_ATTEMPTS
        check(index, model)
    assert "did not start" in caplog.text and "made no progress" in caplog.text


def test_writers_never_wait_long_behind_a_hung_worker(tmp_path, monkeypatch, caplog, merge_faults):
    """Back-pressure on every update (``max_pending_bytes=2000``: a write of 100 keys is over it)
    and a worker that hangs on every merge: each hang ends the wait of the updates behind it
    within ``merge_hang_seconds``, never at the back-pressure bound; after ``MAX_WORKER_MERGE_ATTEMPTS``
    hangs the merges run in the writer's process and back-pressure works again."""
    monkeypatch.setattr(merge_runner, "MERGE_RETRY_MIN_SECONDS", 0.01)
    monkeypatch.setattr(attribute_state, "BACKPRESSURE_WAIT_SECONDS", 20.0)  # what a writer would wait without
    index, model, rng = open_index(tmp_path, merge_hang_seconds=0.3, max_pending_bytes=2000), {}, random.Random(12)
    try:
        worker = index._attributes.runner.worker_for_merges()
        merge_faults.set("hang")  # read at every merge: every new worker hangs too
        wal = index._attributes
        deadline = time.monotonic() + WAIT
        while not wal.runner.worker_disabled:  # updates all along, while workers hang and are replaced
            assert time.monotonic() < deadline, "the merges never left the hanging worker"
            write(index, model, rng, 1)
            assert "appending anyway" not in caplog.text, "an update waited out the back-pressure bound"
            time.sleep(0.02)
        write(index, model, rng, 3)
        wait_for(lambda: merged_up_to_position(index) and merge_error(index) is None, "a merge in the thread")
        assert worker.starts == merge_worker.MAX_WORKER_MERGE_ATTEMPTS
        check(index, model)
    finally:
        index.close()
    assert "appending anyway" not in caplog.text  # no update waited out the back-pressure bound
    assert "kept dying or hanging" in caplog.text
    with open_index(tmp_path) as reopened:
        check(reopened, model)


def test_a_worker_killed_from_outside_at_any_moment(tmp_path, monkeypatch):
    monkeypatch.setattr(merge_runner, "MERGE_RETRY_MIN_SECONDS", 0.01)
    monkeypatch.setattr(merge_worker, "MAX_WORKER_START_ATTEMPTS", 1000)  # kills during its start too
    index, model, rng = open_index(tmp_path, merge_keys=100), {}, random.Random(4)
    try:
        for round_ in range(4):
            write(index, model, rng, 4)
            pid = wait_for(lambda: index._attributes.runner.worker is not None and index._attributes.runner.worker.pid, "a worker")
            time.sleep(rng.random() * 0.05)  # before, during or after its merge
            with contextlib.suppress(ProcessLookupError):  # (it may have been replaced meanwhile)
                os.kill(pid, signal.SIGKILL)
            check(index, model)
        write(index, model, rng, 2)
        wait_for(lambda: merged_up_to_position(index) and merge_error(index) is None, "a clean merge")
        check(index, model)
    finally:
        index.close()
    with open_index(tmp_path) as reopened:
        check(reopened, model)
        assert reopened.verify().ok


def test_readers_never_see_a_value_go_back_across_the_swap(tmp_path):
    """Each round writes generation g to the same keys, with enough noise to freeze the overlay,
    and waits for the worker's merge: the keys are then read from the tree (and cached). A value
    cache that outlived the swap would serve generation g - 1; a reader thread beside the swaps
    must see one generation per read, never older than the last it saw."""
    index, rng = open_index(tmp_path, merge_keys=300), random.Random(5)
    hot = [key(100_000 + i) for i in range(50)]
    stop, seen, problems = threading.Event(), [0], []

    def reader():
        while not stop.is_set():
            values = index.get_many(hot)
            if values[0] is not None and (len(set(values)) != 1 or values[0] < seen[0]):
                problems.append((seen[0], values))
                return
            seen[0] = values[0] or 0

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for generation in range(1, 8):
            noise = {key(rng.randrange(50_000)): generation for _ in range(300)}
            index.update({**noise, **{k: generation for k in hot}})
            wait_for(lambda: merged_up_to_position(index), "the merge")
            assert not len(index._attributes._overlay)  # so the reads below come from the tree
            if generation > 1:  # read (cached) last round: the worker's merge dropped, not kept, them
                assert index._attributes.tree._values.peek(hot[0])[0] in (MISSING, generation)
            assert index.get_many(hot) == [generation] * len(hot)
            assert index.get(hot[0]) == generation
    finally:
        stop.set()
        thread.join(WAIT)
    try:
        assert not problems
        assert index._attributes.runner.merges >= 7 and index._attributes.runner.worker.starts == 1
    finally:
        index.close()


def test_reads_through_pages_the_workers_compaction_deletes(tmp_path):
    """Tiny tree chunks and no page cache: the worker's progressive compaction deletes the chunks
    under the writer's old root while a reader walks it; the reader must restart from the newer
    version and see the stable keys' values, never an error."""
    index = open_index(tmp_path, merge_keys=150, rolling_size=8192, cache_bytes=0, value_cache_entries=0)
    stable = {key(i): i for i in range(0, 3000, 3)}
    index.update(stable)
    index.flush()
    rng, stop, problems = random.Random(8), threading.Event(), []

    def reader():
        keys = sorted(stable)
        while not stop.is_set():
            try:
                if index.get_many(keys) != [stable[k] for k in keys]:
                    problems.append("wrong values")
            except Exception as exc:  # noqa: BLE001 - the test reports it
                problems.append(repr(exc))
            if problems:
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        start = index.stats().start_offset
        for _round in range(12):
            index.update({key(rng.randrange(3000) * 3 + 1): rng.randrange(100) for _ in range(200)})
            wait_for(lambda: merged_up_to_position(index), "the merge")
    finally:
        stop.set()
        thread.join(WAIT)
    try:
        assert not problems, problems
        assert index.stats().start_offset > start  # chunks under old roots were deleted meanwhile
        assert index._attributes.runner.worker.starts == 1
    finally:
        index.close()


_KILLED_WRITER = """
import sys, time
from attrindex import merge_runner
merge_runner.MIN_WORKER_KEYS = 1
from attrindex.attribute_index import AttributeIndex
index = AttributeIndex.open(sys.argv[1], page_size=1024, merge_keys=100)
worker = index._attributes.runner.worker_for_merges()  # (its merges hang: see the test)
for i in range(20):
    index.update({(j * 7 + i).to_bytes(16, "big"): i for j in range(30)})
    print("acked", i, flush=True)
while worker.pid is None:
    time.sleep(0.01)
print("worker", worker.pid, flush=True)
time.sleep(600)
"""


def test_writer_sigkilled_while_its_worker_merges(tmp_path):
    path = str(tmp_path / "index")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    script = child_program_lines(tmp_path / "merge-fault", "hang") + _KILLED_WRITER  # it stays mid-merge
    child = subprocess.Popen([sys.executable, "-c", script, path], stdout=subprocess.PIPE, text=True, env=env)
    acked, pid = [], None
    try:
        for line in child.stdout:
            word, number = line.split()
            if word == "acked":
                acked.append(int(number))
            else:
                pid = int(number)
                break
    finally:
        child.kill()
        child.wait(WAIT)
    assert pid is not None and acked == list(range(20))
    wait_for(lambda: not _alive(pid), "the orphaned worker to exit")
    model = {}
    for i in acked:
        model.update({key(j * 7 + i): i for j in range(30)})
    with AttributeIndex.open(path, page_size=1024, merge_keys=100) as reopened:
        check(reopened, model)
        reopened.update({key(1): -1})
        model[key(1)] = -1
        reopened.flush()
        check(reopened, model)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(
    st.dictionaries(st.integers(0, 400).map(key), st.none() | st.integers(-5, 5), min_size=20, max_size=60),
    st.sampled_from(["wait", "wait", "reopen"])), min_size=1, max_size=12))
def test_model_with_frequent_worker_merges(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("model")
    index, model = open_index(path, merge_keys=20), {}
    try:
        for op in ops:
            if op == "wait":  # for the worker's merge, when the overlay is due for one
                wait_for(lambda: index._attributes._frozen is None, "the merge")
            elif op == "reopen":
                index.close()
                index = open_index(path, merge_keys=20)
            else:
                index.update(op)
                model.update(op)
            check(index, model)
    finally:
        index.close()
    with open_index(path) as reopened:
        check(reopened, model)


def test_workers_that_never_start_leave_the_merges_to_a_thread(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(merge_worker, "WORKER_MAIN", "import sys; sys.exit(3)")
    monkeypatch.setattr(merge_runner, "MERGE_RETRY_MIN_SECONDS", 0.01)
    with open_index(tmp_path) as index:
        model = {}
        write(index, model, random.Random(7), 4)
        wait_for(lambda: merged_up_to_position(index) and merge_error(index) is None, "the merge")
        assert index._attributes.runner.worker_disabled and index._attributes.runner.worker.starts == merge_worker.MAX_WORKER_START_ATTEMPTS
        check(index, model)
    assert "merging in the writer's process from now on" in caplog.text


def test_options_that_cannot_cross_to_a_process_keep_the_merge_in_a_thread(tmp_path):
    from attrindex.btree.compaction import OnePagePolicy

    class Unpicklable(OnePagePolicy):
        def __reduce__(self):
            raise TypeError("not picklable")

    with open_index(tmp_path, compaction=Unpicklable()) as index:
        model = {}
        write(index, model, random.Random(9), 3)
        wait_for(lambda: merged_up_to_position(index), "the merge")
        assert index._attributes.runner.worker_disabled and index._attributes.runner.worker is None
        check(index, model)


def test_merge_process_option(tmp_path):
    with pytest.raises(InvalidInputError, match="merge_process"):
        AttributeIndex.open(str(tmp_path / "a"), merge_process="yes")
    for bad in (0, -1, "5", True, float("nan")):
        with pytest.raises(InvalidInputError, match="merge_hang_seconds"):
            AttributeIndex.open(str(tmp_path / "a"), merge_hang_seconds=bad)
        with pytest.raises(InvalidInputError, match="merge_hang_seconds"):
            SegmentStore.open(str(tmp_path / "s"), merge_hang_seconds=bad)
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "s")
    with open_index(tmp_path / "b", merge_process=False) as index:  # the in-thread host
        model = {}
        write(index, model, random.Random(6), 4)
        wait_for(lambda: merged_up_to_position(index), "the merge")
        assert index._attributes.runner.worker is None
        check(index, model)
    with AttributeIndex.open("memory://merge-process", merge_keys=50) as index:  # not local: in a thread
        index.update({key(i): i for i in range(100)})
        wait_for(lambda: merged_up_to_position(index), "the merge")
        assert index._attributes.runner.worker is None and index.get(key(7)) == 7


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no reaper collected counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_segment_with_records_merges_in_the_worker_when_asked(tmp_path):
    """``SegmentOptions.merge_process``: the worker replays the record batches' attribute updates
    (records untouched); attributes and records read back, live and after reopening."""
    from attrindex import SegmentStore

    model, records = {}, []
    with SegmentStore.open(str(tmp_path), merge_process=True, flush_keys=50) as store:
        segment = store.segment("s", create=True)
        for i in range(6):
            updates = {key(i * 100 + j): i for j in range(60)}
            segment.append([f"r{i}".encode()], list(updates.items()))
            model.update(updates)
            records.append(f"r{i}".encode())
        wait_for(lambda: segment.stats().merges >= 1 and segment._attributes._frozen is None, "the merge")
        assert segment._attributes.runner.worker is not None and segment._attributes.runner.worker.starts == 1
        assert segment.get_attributes(sorted(model)) == [model[k] for k in sorted(model)]
        tree = segment.stats().attributes  # the worker's merges are counted in the segment's tree stats
        assert 0 < tree.bytes_written == tree.length and 0 < tree.logical_bytes <= 24 * len(model)
        assert tree.write_amplification == tree.bytes_written / tree.logical_bytes
    with SegmentStore.open(str(tmp_path)) as store:
        segment = store.segment("s")
        assert segment.get_attributes(sorted(model)) == [model[k] for k in sorted(model)]
        assert [r.value for r in segment.read(0)] == records


def test_a_worker_whose_parent_is_gone_exits_quietly_when_it_cannot_answer(tmp_path):
    """The parent died (or dropped the answer pipe) while the worker worked: its answer meets a
    broken pipe. It does not report that failure as a second answer into the same broken pipe
    (which would die with a BrokenPipeError traceback on stderr): it exits at once, status 0, silent."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(merge_worker.__file__))))
    worker = subprocess.Popen([sys.executable, "-c", merge_worker.WORKER_MAIN, str(os.getpid())],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    worker.stdout.close()  # nobody reads the answers any more
    merge_worker._send(worker.stdin, ("merge", 1, None))  # before "open": answered with an error
    worker.stdin.close()
    assert worker.wait(timeout=WAIT) == 0
    assert worker.stderr.read() == b""
