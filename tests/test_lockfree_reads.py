"""Lock-free reads: ``AttributeIndex.get/get_many`` and ``Segment.get_attribute(s)`` read one
published read view (overlays + the tree's recent values + the tree) without taking the handle's
lock (docs/design.md, "Reads").

The contract checked here, per key: a read never returns a value older than one that an
earlier-completed read or update showed, nor one never written; a closed handle's reads raise a
clear error. Writers give each key strictly increasing values (versions) while tiny thresholds
make the background thread freeze and merge all the time, a second handle merges and truncates
the WAL under the first one's refreshes, and a handle is closed under its readers.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest

from attrindex import AttributeIndex, SegmentStore, merge_runner, write_queue
from attrindex.errors import InvalidInputError
from attrindex.tree_index import TreeIndex
from attrindex.value_cache import MISSING, ValueCache
from storage_adapters.errors import StorageError

TINY = dict(merge_keys=8, merge_seconds=0.0, page_size=512, rolling_size=1 << 14, wal_rolling_size=4096)
KEYS_PER_WRITER = 12


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


class Versions:
    """What writers sent and what was acknowledged, and the newest value reads showed, per key.

    ``floor(k)`` taken before a read starts is the least value the read may return: the newest
    value an update-return or a completed read showed by then; ``sent[k]`` the most."""

    def __init__(self, keys: list[bytes]):
        self.lock = threading.Lock()  # the test's bookkeeping only: the index's reads take none
        self.sent = {k: 0 for k in keys}
        self.acked = {k: 0 for k in keys}
        self.seen = {k: 0 for k in keys}
        self.reads = 0
        self.errors: list[str] = []

    def floors(self, keys: list[bytes], acked: dict[bytes, int] | None = None) -> list[int]:
        """``acked``: the acknowledged values this handle is sure to have seen, where not all
        (another handle's updates are seen after a ``refresh`` that started after them)."""
        with self.lock:
            acked = self.acked if acked is None else acked
            return [max(acked[k], self.seen[k]) for k in keys]

    def check(self, what: str, keys: list[bytes], floors: list[int], values: list[int | None]) -> None:
        with self.lock:
            self.reads += 1
            for k, low, v in zip(keys, floors, values):
                got = 0 if v is None else v
                if not low <= got <= self.sent[k]:
                    self.errors.append(f"{what} of key {int.from_bytes(k, 'big')}: {got}, expected "
                                       f"{low} <= value <= {self.sent[k]}")
                self.seen[k] = max(self.seen[k], got)


def writer(index: AttributeIndex, keys: list[bytes], versions: Versions, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with versions.lock:
        version = max(versions.sent[k] for k in keys)  # (a later lap goes on from there)
    while not stop.is_set():
        version += 1
        chosen = rng.sample(keys, rng.randint(1, len(keys)))
        with versions.lock:
            for k in chosen:
                versions.sent[k] = version
        index.update({k: version for k in chosen})
        with versions.lock:
            for k in chosen:
                versions.acked[k] = max(versions.acked[k], version)


def reader(index: AttributeIndex, keys: list[bytes], versions: Versions, stop: threading.Event, seed: int,
           refresh: bool = False) -> None:
    """``refresh``: the keys are another handle's; refresh now and then (which rebuilds the
    overlay after that handle's merges and truncations of the WAL)."""
    rng = random.Random(seed)
    known = {k: 0 for k in keys} if refresh else None  # others' acknowledged values refreshed past
    while not stop.is_set():
        if known is not None and rng.random() < 0.05:
            with versions.lock:
                before = {k: versions.acked[k] for k in keys}
            index.refresh()
            known = before
        if rng.random() < 0.5:
            k = rng.choice(keys)
            floors = versions.floors([k], known)
            versions.check("get", [k], floors, [index.get(k)])
        else:
            chosen = [rng.choice(keys) for _ in range(rng.randint(1, 2 * len(keys)))]
            floors = versions.floors(chosen, known)
            versions.check("get_many", chosen, floors, index.get_many(chosen))


def run_threads(targets: list, seconds: float, stop: threading.Event, until=lambda: True) -> list[BaseException]:
    """Run ``targets`` for ``seconds``, then on until ``until()`` holds (at most 4x as long)."""
    failures: list[BaseException] = []

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # reported by the test
            failures.append(exc)
            stop.set()

    threads = [threading.Thread(target=guarded, args=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    stop.wait(seconds)
    deadline = time.monotonic() + 3 * seconds
    while not stop.is_set() and not until() and time.monotonic() < deadline:
        stop.wait(0.05)
    stop.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a thread did not stop"
    return failures


@pytest.mark.parametrize("in_worker", [False, True], ids=["merge-in-thread", "merge-in-worker-process"])
def test_threaded_reads_never_go_back_under_merges_reopen_and_another_handle(tmp_path, monkeypatch, in_worker):
    if in_worker:  # every background merge of handle a and b goes to its worker process
        monkeypatch.setattr(merge_runner, "MIN_WORKER_KEYS", 1)
    url = str(tmp_path / "idx")
    own = [key(i) for i in range(2 * KEYS_PER_WRITER)]
    other = [key(1000 + i) for i in range(KEYS_PER_WRITER)]
    versions = Versions(own + other)
    for lap in range(2):  # the second lap reopens: replay, then the same checks
        a = AttributeIndex.open(url, **TINY)
        b = AttributeIndex.open(url, **TINY)  # another handle: it merges and truncates the WAL under a
        for k in own:
            versions.seen[k] = max(versions.seen[k], a.get(k) or 0)
        stop = threading.Event()
        failures = run_threads([
            (writer, a, own[:KEYS_PER_WRITER], versions, stop, 10 * lap + 1),
            (writer, a, own[KEYS_PER_WRITER:], versions, stop, 10 * lap + 2),
            (writer, b, other, versions, stop, 10 * lap + 3),
            (reader, a, own, versions, stop, 10 * lap + 4),
            (reader, a, own, versions, stop, 10 * lap + 5),
            (reader, a, other, versions, stop, 10 * lap + 6, True),
        ], seconds=2.0, stop=stop, until=lambda: a._attributes.runner.merges >= 3)
        assert not failures, failures
        assert not versions.errors, versions.errors[:5]
        merges = a._attributes.runner.merges
        assert (a._attributes.runner.worker is not None) == in_worker  # (the merges ran where the variant says)
        b.close()
        a.close()
        assert merges >= 3, "the run should have merged many times"
    assert versions.reads > 200
    final = AttributeIndex.open(url, **TINY)
    assert final.get_many(own + other) == [versions.acked[k] or None for k in own + other]
    final.close()


def test_reads_beside_a_closing_handle_give_a_right_value_or_a_clear_error(tmp_path):
    url = str(tmp_path / "idx")
    keys = [key(i) for i in range(KEYS_PER_WRITER)]
    versions = Versions(keys)
    index = AttributeIndex.open(url, **TINY)
    stop = threading.Event()
    closed = threading.Event()  # set once close() returned: every read started after it must raise
    late_values: list[str] = []

    def closing_reader(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            after_close = closed.is_set()
            k = rng.choice(keys)
            floors = versions.floors([k])
            try:
                values = [index.get(k)] if rng.random() < 0.5 else index.get_many([k])
            except (InvalidInputError, StorageError) as exc:
                assert "closed" in str(exc), exc
                return
            if after_close:
                late_values.append(f"a read after close returned {values}")
                return
            versions.check("read", [k], floors, values)

    readers = [threading.Thread(target=closing_reader, args=(seed,), daemon=True) for seed in range(3)]
    write = threading.Thread(target=writer, args=(index, keys, versions, stop, 7), daemon=True)
    write.start()
    for t in readers:
        t.start()
    time.sleep(1.0)
    stop.set()
    write.join(30)
    index.close()  # merges what is pending while the readers go on
    closed.set()
    for t in readers:
        t.join(30)
        assert not t.is_alive(), "a reader kept reading a closed handle"
    assert not versions.errors, versions.errors[:5]
    assert not late_values, late_values
    with pytest.raises(InvalidInputError, match="closed"):
        index.get(keys[0])
    with pytest.raises(InvalidInputError, match="closed"):
        index.get_many(keys)


def test_reads_do_not_wait_for_the_handles_lock(tmp_path):
    """A read is served while another thread holds the WAL's lock (an append waiting for room,
    the end of a merge, a replay): it waits for nobody."""
    index = AttributeIndex.open(str(tmp_path / "idx"), **TINY)
    index.update({key(1): 1, key(2): 2})
    index.flush()
    index.update({key(2): 20, key(3): 3})
    segment = SegmentStore.open(f"memory://lockfree-{uuid.uuid4().hex}").segment("s", create=True)
    segment.update_attributes({key(5): 5})
    results: list = []
    locks = [index._lock, segment._lock]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait(30)
        for lock in locks:
            lock.release()

    def read() -> None:
        results.append((index.get(key(1)), index.get_many([key(1), key(2), key(3), key(4)]),
                        segment.get_attribute(key(5)), segment.get_attributes([key(5), key(6)])))

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    reading.join(10)
    done = not reading.is_alive()
    release.set()
    holder.join(10)
    reading.join(10)
    assert done, "a read waited for the handle's lock"
    assert results == [(1, [1, 20, 3, None], 5, [5, None])]
    index.close()
    segment.close()


def test_a_closed_segment_handle_raises_on_reads():
    store = SegmentStore.open(f"memory://lockfree-{uuid.uuid4().hex}")
    segment = store.segment("s", create=True)
    segment.update_attributes({key(1): 1})
    assert segment.get_attribute(key(1)) == 1
    segment.close()
    for read in (lambda: segment.get_attribute(key(1)), lambda: segment.get_attributes([key(1)]),
                 lambda: segment.get_attributes([])):
        with pytest.raises(InvalidInputError, match="closed"):
            read()


def test_a_deleted_segments_handle_raises_on_reads():
    store = SegmentStore.open(f"memory://lockfree-{uuid.uuid4().hex}")
    segment = store.segment("s", create=True)
    segment.update_attributes({key(1): 1})
    store.delete_segment("s")
    with pytest.raises(InvalidInputError, match="closed"):
        segment.get_attribute(key(1))


# -- the recent-values cache beside changes of the tree ------------------------------------------
def test_peek_never_promotes():
    cache = ValueCache(2)
    cache.put(b"a", 1)
    cache.put(b"b", 2)  # the young generation became the old one
    assert cache.peek(b"a") == (1, True) and cache.peek(b"c") == (MISSING, False)
    assert b"a" not in cache.young  # promoting is the owner's, under its lock
    assert cache.peek_many([b"a", b"c", b"b"]) == ([1, MISSING, 2], [0, 2]) and not cache.young
    assert (cache.hits, cache.misses) == (3, 2)


def test_a_value_read_from_a_version_that_was_replaced_meanwhile_is_not_cached(tmp_path):
    """A lookup reads the old version; before it caches what it read, the tree adopts a newer one
    (another writer's) and ``_external_change`` has not run yet: the fill must be refused, or a
    later read would serve the old value after a read had already served the new one."""
    url = str(tmp_path / "tree")
    ours = TreeIndex.open(url)
    ours.update({key(1): 1})
    ours._values.clear()  # (the update cached it: the lookup below must read the tree)
    theirs = TreeIndex.open(url)
    theirs.update({key(1): 2})  # a newer version ours has not adopted yet
    btree = ours._tree
    original_get = btree.get
    newer = TreeIndex.open(url)._tree.state

    def get_then_adopt(k: bytes):
        value = original_get(k)  # read from the old version
        btree._state = newer  # adopted by another thread; its _external_change is still to come
        return value

    btree.get = get_then_adopt
    assert ours.get(key(1)) == 1
    btree.get = original_get
    assert ours._values.young.get(key(1), MISSING) is MISSING  # the old value was not cached
    assert ours.get(key(1)) == 2
    for index in (ours, theirs):
        index.close()


def test_a_rebuild_of_tier1_adopts_the_tree_that_covers_another_handles_cut(tmp_path):
    """Another handle merged past this one's tree and cut the WAL below its new checkpoint, and
    this handle had already replayed past the cut: a rebuild of tier 1 (after a lost merge race,
    in ``refresh``) must adopt the newer tree first. Replaying from the WAL's start over the older
    tree lost the updates in between, and a lock-free read then went back."""
    url = str(tmp_path / "idx")
    options = dict(TINY, merge_keys=1 << 20, merge_seconds=3600, wal_rolling_size=256)  # merges only by flush; small WAL chunks
    a = AttributeIndex.open(url, **options)
    a.update({key(1): 1})
    a.flush()
    b = AttributeIndex.open(url, **options)
    a.update({key(2): 2})  # in a's tier 1 only, and in the WAL
    for i in range(20):
        b.update({key(100 + i): i})  # rolls WAL chunks
    state = a._attributes
    with a._lock:
        state.catch_up()  # a replays b's updates: its position is the WAL's end
    b.flush()  # b's tree covers everything and b cuts the WAL below its checkpoint's chunk
    with a._lock:
        state.catch_up()
        assert (state.tree.checkpoint or 0) < a._log.start_position <= a._log.position  # a's tree is stale
        state.rebuild()
    assert a.get(key(2)) == 2 and a.get_many([key(1), key(2), key(119)]) == [1, 2, 19]
    b.close()
    a.close()


def test_a_merge_does_not_cache_its_batch_over_a_newer_version_adopted_meanwhile(tmp_path):
    """A segment's merge writes its batch; before it caches the batch's values, another thread of
    the handle adopts a newer version written by another handle (a catch-up past a truncation).
    The batch's values are older than that version's: caching them would answer reads with
    values older than the tree."""
    url = str(tmp_path / "tree")
    ours, theirs = TreeIndex.open(url), TreeIndex.open(url)
    btree = ours._tree
    original_update = btree.update

    def update_then_adopt(keys, values, checkpoint=None, base=None):
        written = original_update(keys, values, checkpoint, base)
        theirs.refresh()
        theirs.update({key(1): 5}, checkpoint=20)  # newer, by another handle
        btree.reload()  # adopted by another thread of ours (its cache clear runs now)
        return written

    btree.update = update_then_adopt
    assert ours.update_sorted([key(1)], [1], checkpoint=10)
    btree.update = original_update
    assert ours.get(key(1)) == 5 and ours.get_many([key(1)]) == [5]
    for index in (ours, theirs):
        index.close()


@pytest.mark.parametrize("updates", [1, 3])
def test_an_update_is_readable_when_its_writer_is_told(monkeypatch, updates):
    # The read view skips an empty active overlay; the first update into it publishes the overlay
    # before the writer is told (the leader settles each request while it still holds the lock,
    # and a woken writer may read at once). Every read made at a settle must see that update.
    index = AttributeIndex.open(f"memory://told-{uuid.uuid4().hex}", merge_keys=10**6)
    seen = []
    settle = write_queue.WriteRequest.settle

    def settle_and_read(request, result=None, error=None):
        seen.append((index.get(key(len(seen))), index.get_many([key(len(seen))])))
        settle(request, result, error)

    monkeypatch.setattr(write_queue.WriteRequest, "settle", settle_and_read)
    try:
        for n in range(updates):
            index.update({key(n): n + 7})
        assert seen == [(n + 7, [n + 7]) for n in range(updates)]
    finally:
        monkeypatch.undo()
        index.close()
