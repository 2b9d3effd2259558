"""The deletion grace of object chunks against a model, under any interleaving of stale handles,
truncations and elapsed time: an append is never acknowledged below the truncation offset (a freed
chunk name re-created by a stale handle), and the stored bytes always equal the model's.

The store is ``MemoryChunkStorage`` in object mode (exclusive creates, no in-place appends, the same
code paths as S3, which tests/test_s3_requests.py runs on moto); time is a fake monotonic clock that
the test moves, so a grace of 10 "seconds" costs nothing.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from storage_adapters import BadOffsetError, RollingSegment, chunk_name, rolling_handle, rolling_objects, rolling_sweep
from storage_adapters.faults import FaultyStorage

from .object_memory import ObjectMemoryStorage

GRACE = 10.0
HANDLES = st.sampled_from("ab")  # two: a stale one is more often left alone


class _Clock:
    now = 1000.0

    @classmethod
    def monotonic(cls) -> float:
        return cls.now


def _fake_clock(monkeypatch) -> None:
    """Every module of the rolling segment that reads the monotonic clock reads ``_Clock``."""
    for module in (rolling_handle, rolling_objects, rolling_sweep):
        monkeypatch.setattr(module, "time", _Clock)


class GraceMachine(RuleBasedStateMachine):
    @initialize()
    def open(self):
        self.storage = ObjectMemoryStorage(f"grace-{uuid.uuid4().hex}", deletion_grace=GRACE)
        self.handles = {h: RollingSegment(self.storage, "s") for h in "ab"}
        self.model = bytearray()
        self.start = 0

    @rule(h=HANDLES, size=st.integers(1, 4), conditional=st.booleans())
    def append(self, h, size, conditional):
        data = bytes([len(self.model) % 251]) * size
        handle = self.handles[h]
        if conditional:
            try:
                offset = handle.append(data, expected_offset=handle.length)
            except BadOffsetError:
                return  # a stale view: refused, nothing written
        else:
            offset = handle.append(data)
        assert offset == len(self.model) >= self.start  # never a freed name below the truncation
        self.model += data

    @rule(h=HANDLES, data=st.data())
    def truncate(self, h, data):
        offset = data.draw(st.integers(self.start, len(self.model)))
        self.handles[h].truncate(offset)
        self.start = max(self.start, offset)

    @rule(h=HANDLES)
    def refresh(self, h):
        self.handles[h].refresh()

    @rule(seconds=st.sampled_from([GRACE / 2 - 0.5, GRACE / 2 + 0.5, GRACE, 2 * GRACE]))
    def wait(self, seconds):
        _Clock.now += seconds

    @invariant()
    def stored_state_matches_model(self):
        if not hasattr(self, "storage"):
            return
        fresh = RollingSegment(self.storage, "s")
        assert (fresh.start_offset, fresh.length) == (self.start, len(self.model))
        assert fresh.read(self.start, len(self.model) - self.start) == bytes(self.model[self.start:])
        # Dead names only ever lie below the live chunks (kept for the grace, then deleted).
        first = fresh.chunks()[0].start if fresh.chunks() else self.start
        stored = [int(n) for n in self.storage.list_files("s.seg") if "/" not in n]
        assert all(n < first or n in {c.start for c in fresh.chunks()} for n in stored)


def test_stale_handles_never_append_below_the_truncation(monkeypatch):
    _fake_clock(monkeypatch)
    run_state_machine_as_test(GraceMachine, settings=settings(max_examples=200, stateful_step_count=30,
                                                              deadline=None))


def test_dead_chunks_are_deleted_once_the_grace_has_passed(monkeypatch):
    _fake_clock(monkeypatch)
    storage = ObjectMemoryStorage(f"grace-{uuid.uuid4().hex}", deletion_grace=GRACE)
    seg = RollingSegment(storage, "s")
    for piece in (b"aa", b"bb", b"cc"):
        seg.append(piece)
    seg.truncate(4)
    _Clock.now += GRACE - 1
    seg.append(b"dd")
    assert chunk_name(0) in storage.list_files("s.seg")  # still within the grace
    _Clock.now += 1
    seg.append(b"ee")
    assert sorted(n for n in storage.list_files("s.seg") if "/" not in n) == [chunk_name(4), chunk_name(6), chunk_name(8)]


@pytest.mark.parametrize("age, requests", [(GRACE / 2 - 0.5, {"PUT": 1}), (GRACE / 2, {"LIST": 1, "PUT": 1})])
def test_a_view_is_refreshed_before_an_append_once_half_the_grace_has_passed(monkeypatch, age, requests):
    _fake_clock(monkeypatch)
    storage = ObjectMemoryStorage(f"grace-{uuid.uuid4().hex}", deletion_grace=GRACE)
    seg = RollingSegment(storage, "s")
    seg.append(b"aa")
    _Clock.now += age
    before = storage.requests
    seg.append(b"bb")
    spent = {kind: n for kind, n in (storage.requests - before).by_kind().items() if n}
    assert spent == requests


@pytest.mark.parametrize("waited", [GRACE, 1.5 * GRACE, 3 * GRACE])
def test_a_stale_handle_never_recreates_a_name_freed_after_the_grace(monkeypatch, waited):
    """The hazard itself: the stale handle's next name (2) is taken, truncated away and, once the grace
    has passed, deleted. Its view is then at least as old as the grace, so it refreshes first."""
    _fake_clock(monkeypatch)
    storage = ObjectMemoryStorage(f"grace-{uuid.uuid4().hex}", deletion_grace=GRACE)
    stale, owner = RollingSegment(storage, "s"), RollingSegment(storage, "s")
    owner.append(b"a")
    owner.append(b"b")
    stale.refresh()  # its length: 2
    owner.append(b"c")
    owner.append(b"d")
    owner.truncate(4)
    _Clock.now += waited
    owner.append(b"e")  # deletes the dead chunks: the names 0..3 are free
    assert chunk_name(2) not in storage.list_files("s.seg")
    assert stale.append(b"X") == 5
    assert RollingSegment(storage, "s").read(4, 2) == b"eX"


# -- a create delayed past the grace -------------------------------------------------------------
class _DelayedCreate(FaultyStorage):
    """A handle's view of ``inner`` whose next chunk create is delayed (a GC pause, a slow network):
    ``meanwhile`` runs first, standing for what the rest of the world does while the PUT is on its
    way. No fault is injected otherwise."""

    def __init__(self, inner, meanwhile):
        super().__init__(inner, seed=0)
        self.meanwhile = meanwhile

    def create(self, path, data):
        if self.meanwhile is not None and "/" not in path.split(".seg/", 1)[1]:
            hook, self.meanwhile = self.meanwhile, None
            hook()
        super().create(path, data)


def _object_storage(request, store: str):
    if store == "memory":
        return ObjectMemoryStorage(f"grace-{uuid.uuid4().hex}", deletion_grace=GRACE)
    from storage_adapters import open_storage

    from .conftest import make_s3_url

    options = request.getfixturevalue("s3_options")
    return open_storage(make_s3_url(options), **options, deletion_grace=GRACE)


@pytest.mark.parametrize("store", ["memory", "s3"])
@pytest.mark.parametrize("conditional", [False, True])
def test_a_create_delayed_past_the_grace_is_never_acknowledged_at_a_dead_name(monkeypatch, request, store,
                                                                               conditional):
    """The stale handle's view is young when its PUT is sent; while the PUT is delayed, its next name
    (2) is taken, truncated away and, the grace having passed, deleted; then the PUT lands on the
    freed name. The append is made again at the end (or refused as a conditional one), never
    acknowledged at the dead name."""
    _fake_clock(monkeypatch)
    storage = _object_storage(request, store)
    owner = RollingSegment(storage, "s")
    owner.append(b"a")
    owner.append(b"b")

    def meanwhile():
        owner.append(b"c")  # takes the stale handle's next name
        owner.append(b"d")
        owner.truncate(4)
        _Clock.now += GRACE
        owner.append(b"e")  # the grace has passed: deletes the dead chunks, name 2 is free again
        assert chunk_name(2) not in storage.list_files("s.seg")

    stale = RollingSegment(_DelayedCreate(storage, meanwhile), "s")  # its view: length 2, just taken
    if conditional:
        with pytest.raises(BadOffsetError):
            stale.append(b"X", expected_offset=2)
        expected = b"e"
    else:
        assert stale.append(b"X") == 5
        expected = b"eX"
    fresh = RollingSegment(storage, "s")
    assert (fresh.start_offset, fresh.length, fresh.read(4, len(expected))) == (4, 4 + len(expected), expected)
    assert chunk_name(2) not in storage.list_files("s.seg")  # the create at the dead name was undone


@pytest.mark.parametrize("store", ["memory", "s3"])
@pytest.mark.parametrize("delay, requests", [(GRACE / 2 - 0.5, {"PUT": 1}), (GRACE / 2, {"PUT": 1, "LIST": 1})])
def test_a_create_is_checked_only_when_its_view_aged_past_half_the_grace_meanwhile(monkeypatch, request, store,
                                                                                delay, requests):
    """The cost of the check: none while the view is younger than half the grace when the PUT
    returns (the normal append stays one PUT), one LIST (a refresh) once it is not."""
    _fake_clock(monkeypatch)
    storage = _object_storage(request, store)
    seg = RollingSegment(storage, "s")
    seg.append(b"aa")

    def meanwhile():
        _Clock.now += delay

    slow = RollingSegment(_DelayedCreate(storage, meanwhile), "s")
    before = storage.requests
    assert slow.append(b"bb") == 2
    spent = {kind: n for kind, n in (storage.requests - before).by_kind().items() if n}
    assert spent == requests
    assert RollingSegment(storage, "s").read(0, 4) == b"aabb"
