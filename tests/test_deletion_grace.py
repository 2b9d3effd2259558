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

from storage_adapters import BadOffsetError, RollingSegment, chunk_name, rolling
from storage_adapters.memory import MemoryChunkStorage

GRACE = 10.0
HANDLES = st.sampled_from("ab")  # two: a stale one is more often left alone


class _Clock:
    now = 1000.0

    @classmethod
    def monotonic(cls) -> float:
        return cls.now


class ObjectMemoryStorage(MemoryChunkStorage):
    """Memory chunks written whole by an exclusive create, as on S3."""

    appendable = False
    deletion_grace = GRACE


class GraceMachine(RuleBasedStateMachine):
    @initialize()
    def open(self):
        self.storage = ObjectMemoryStorage(f"grace-{uuid.uuid4().hex}")
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
    monkeypatch.setattr(rolling, "time", _Clock)
    run_state_machine_as_test(GraceMachine, settings=settings(max_examples=200, stateful_step_count=30,
                                                              deadline=None))


def test_dead_chunks_are_deleted_once_the_grace_has_passed(monkeypatch):
    monkeypatch.setattr(rolling, "time", _Clock)
    storage = ObjectMemoryStorage(f"grace-{uuid.uuid4().hex}")
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
    monkeypatch.setattr(rolling, "time", _Clock)
    storage = ObjectMemoryStorage(f"grace-{uuid.uuid4().hex}")
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
    monkeypatch.setattr(rolling, "time", _Clock)
    storage = ObjectMemoryStorage(f"grace-{uuid.uuid4().hex}")
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
