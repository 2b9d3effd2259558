"""``RollingSegment.replace_range``: the atomic chunk switch behind consolidation and log compaction.

A hypothesis model (a ``bytearray`` plus a mask of hole bytes) drives two handles through appends,
replacements (exact bytes and shorter ones that leave holes), consolidation, truncations, reads
and reopens on every backend; then the edge cases: bad ranges refused before anything is written,
a stale handle's compare-and-swap, racing replacers of one generation, leftovers of a crash at
each step of the switch, and a reader whose chunk is replaced under it.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from storage_adapters import (
    BadOffsetError,
    HoleError,
    InvalidInputError,
    LayoutConflictError,
    OffsetOutOfRangeError,
    StorageError,
    TruncatedError,
    open_storage,
)
from storage_adapters.faults import FaultyStorage
from storage_adapters.rolling import SWITCH_DIR, TRUNCATION_DIR, replacement_name

from .conftest import make_s3_url
from .framed import frame, offsets, open_segment, pieces
from .layout_workers import assert_only_live_chunks_left

HANDLES = st.sampled_from(["a", "b"])
NAME = "stream/0"


def _runs(mask: bytearray, start: int, end: int) -> list[tuple[int, int]]:
    """Maximal runs of hole bytes (mask 1) within ``[start, end)``."""
    runs, i = [], start
    while i < end:
        if mask[i]:
            j = i
            while j < end and mask[j]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def machine_for(new_url):
    class ReplaceRangeMachine(RuleBasedStateMachine):
        @initialize(rolling=st.integers(1, 24))
        def open(self, rolling):
            url, options = new_url()
            self.storage = open_storage(url, **options)
            self.handles = {h: open_segment(self.storage, NAME, rolling_size=rolling) for h in "ab"}
            self.model = bytearray()
            self.mask = bytearray()  # 1 where a byte is a hole
            self.start = 0

        def teardown(self):
            if hasattr(self, "storage"):
                self.handles["a"].delete()

        def _truth(self):
            return open_segment(self.storage, NAME)

        @rule(h=HANDLES, data=st.binary(min_size=1, max_size=30), conditional=st.booleans())
        def append(self, h, data, conditional):
            expected = len(self.model) if conditional else None
            data = frame(self.storage, data, len(self.model))  # local disk: a frame placed where it lands
            assert self.handles[h].append(data, expected_offset=expected) == len(self.model)
            self.model += data
            self.mask += bytes(len(data))

        @rule(h=HANDLES, pick=st.data(), shorter=st.booleans(), fill=st.binary(max_size=60))
        def replace(self, h, pick, shorter, fill):
            handle = self.handles[h]
            sealed = [c for c in handle.chunks()[:-1] if c.start >= handle.start_offset]
            if not sealed:
                return
            i = pick.draw(st.integers(0, len(sealed) - 1))
            j = pick.draw(st.integers(i, min(len(sealed) - 1, i + 3)))
            if any(b.start != a.end for a, b in zip(sealed[i:j], sealed[i + 1:j + 1])):
                return  # not adjacent in this view (cannot happen, but keep the draw honest)
            start, end = sealed[i].start, sealed[j].end
            data = fill[:end - start] if shorter else bytes(self.model[start:end])
            if not shorter and any(self.mask[start:end]):
                data = data[:0]  # a range with holes has no exact bytes to copy: replace by nothing
            truth = self._truth()
            same = [c.name for c in truth.chunks() if start <= c.start < end] == [c.name for c in sealed[i:j + 1]]
            if not same or start < truth.start_offset:
                with pytest.raises(LayoutConflictError):
                    handle.replace_range(start, end, data)
                return
            handle.replace_range(start, end, data)
            self.model[start:start + len(data)] = data
            self.mask[start:start + len(data)] = bytes(len(data))
            self.mask[start + len(data):end] = b"\x01" * (end - start - len(data))

        @rule(h=HANDLES, size=st.sampled_from([None, 1, 8, 40, 1000]))
        def consolidate(self, h, size):
            self.handles[h].consolidate(size)

        @rule(h=HANDLES, pick=st.data(), length=st.integers(0, 12))
        def read(self, h, pick, length):
            offset = pick.draw(st.integers(0, len(self.model) + 5))
            handle, end = self.handles[h], offset + length
            if offset < self.start:
                with pytest.raises((TruncatedError, OffsetOutOfRangeError, HoleError)):
                    got = handle.read(offset, length)
                    # A handle that has not seen the truncation may still read the old bytes.
                    assert handle.start_offset < self.start and got == self.model[offset:end]
                    raise TruncatedError(NAME, offset, length, self.start, len(self.model))
            elif end > len(self.model):
                with pytest.raises(OffsetOutOfRangeError) as caught:
                    handle.read(offset, length)
                assert not isinstance(caught.value, TruncatedError)
            elif length and any(self.mask[offset:end]):
                with pytest.raises(HoleError) as caught:
                    handle.read(offset, length)
                hole = caught.value
                assert hole.hole_start < end and hole.hole_end > offset
                assert all(self.mask[hole.hole_start:hole.hole_end])
            else:
                assert handle.read(offset, length) == self.model[offset:end]

        @rule(h=HANDLES, data=st.data())
        def truncate(self, h, data):
            offset = data.draw(st.integers(0, len(self.model)))
            self.handles[h].truncate(offset)
            self.start = max(self.start, offset)

        @rule(h=HANDLES, rolling=st.integers(1, 24))
        def reopen(self, h, rolling):
            self.handles[h].close()
            self.handles[h] = open_segment(self.storage, NAME, rolling_size=rolling)

        @rule(h=HANDLES)
        def refresh(self, h):
            self.handles[h].refresh()

        @precondition(lambda self: hasattr(self, "storage"))
        @invariant()
        def stored_state_matches_model(self):
            fresh = self._truth()
            assert (fresh.start_offset, fresh.length) == (self.start, len(self.model))
            holes = _runs(self.mask, self.start, len(self.model))
            hole_bytes = {i for s, e in fresh.holes() for i in range(s, e)}
            assert hole_bytes == {i for s, e in holes for i in range(s, e)}
            position = self.start
            for s, e in [*holes, (len(self.model), len(self.model))]:
                assert fresh.read(position, s - position) == self.model[position:s]
                position = e
            chunks = fresh.chunks()
            assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
            assert all(c.end > self.start for c in chunks[:-1])
            files = self.storage.list_files(NAME + ".seg")
            data_files = sorted(n for n in files if not n.startswith((TRUNCATION_DIR, SWITCH_DIR)))
            assert data_files == sorted(c.name for c in chunks)

    return ReplaceRangeMachine


@pytest.mark.parametrize("backend_name", ["memory", "local", "s3"])
def test_replace_range_matches_model(backend_name, tmp_path, request):
    if backend_name == "memory":
        new_url, examples, steps = (lambda: (f"memory://replace-{uuid.uuid4().hex}", {})), 120, 40
    elif backend_name == "local":
        new_url, examples, steps = (lambda: (str(tmp_path / uuid.uuid4().hex), {})), 40, 40
    else:
        # No deletion grace: replaced chunks go at once (the invariant lists them), and appends
        # check the switch marker instead (the grace's own path is tested below).
        options = {**request.getfixturevalue("s3_options"), "deletion_grace": 0}
        bucket_url = make_s3_url(options)
        new_url, examples, steps = (lambda: (f"{bucket_url}/{uuid.uuid4().hex}", options)), 4, 15
    run_state_machine_as_test(
        machine_for(new_url),
        settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]),
    )


def _segment(storage, chunks=5, extra=0):
    """A segment of ``chunks`` appends of 10 letters each (A, B, ...), one chunk per append, and the
    bytes stored for those and for ``extra`` further letters (framed on local disk: tests/framed.py)."""
    stored = pieces(storage, [bytes([65 + i]) * 10 for i in range(chunks + extra)])
    seg = open_segment(storage, NAME, rolling_size=len(stored[0]))
    for piece in stored[:chunks]:
        seg.append(piece)
    return seg, stored


def test_bad_ranges_are_refused_before_anything_is_written(storage):
    seg, stored = _segment(storage)
    at = offsets(stored)
    before = storage.list_files(NAME + ".seg")
    for start, end, data in [(0, at[1] + 5, b""), (5, at[2], b""), (0, at[5], b""), (at[4], at[5], b""),
                             (at[1], at[1], b""), (0, at[1], b"x" * (at[1] + 1)), (-10, at[1], b""),
                             (0, at[1], "text")]:
        with pytest.raises(InvalidInputError):
            seg.replace_range(start, end, data)
    seg.truncate(at[1] + 5)
    with pytest.raises(InvalidInputError):
        seg.replace_range(at[1], at[3], b"")  # the chunk holding the start offset begins below it
    assert {n for n in storage.list_files(NAME + ".seg") if not n.startswith(TRUNCATION_DIR)} <= set(before)


def test_stale_handle_gets_a_conflict_and_changes_nothing(storage):
    a, stored = _segment(storage)
    at = offsets(stored)
    b = open_segment(storage, NAME, rolling_size=at[1])
    c = open_segment(storage, NAME, rolling_size=at[1])
    a.replace_range(0, at[2], b"short")
    with pytest.raises(LayoutConflictError):
        b.replace_range(at[1], at[3], b"x")  # b's view still has a chunk at at[1]
    with pytest.raises(LayoutConflictError):
        c.replace_range(0, at[2], b"other")  # same range, other chunks than c saw
    assert open_segment(storage, NAME).read(0, 5) == b"short"
    with pytest.raises(InvalidInputError):
        b.replace_range(at[1], at[3], b"x")  # the failed call refreshed b's view: at[1] is no boundary now
    b.replace_range(0, at[3], b"short" + stored[2])  # after a refresh it may replace the replacement
    assert [c.name for c in b.chunks()][0] == replacement_name(0, at[3], 2)
    assert open_segment(storage, NAME).read(0, 5 + len(stored[2])) == b"short" + stored[2]
    with pytest.raises(HoleError):
        a.read(0, 5 + len(stored[2]) + 1)  # a's view is stale (its chunk was replaced): it looks again and finds the hole


def test_stale_appender_after_replacement_appends_at_the_true_end(storage):
    a, stored = _segment(storage, chunks=3, extra=3)
    at = offsets(stored)
    b = open_segment(storage, NAME, rolling_size=at[1])  # sees 3 chunks; a's appends roll past its last
    a.append(stored[3])
    a.append(stored[4])
    a.replace_range(at[3], at[4], b"d")  # the chunk right after b's last one gets a new name
    with pytest.raises(BadOffsetError):
        b.append(frame(storage, b"F", at[3]), expected_offset=at[3])
    assert b.append(stored[5]) == at[5]
    fresh = open_segment(storage, NAME)
    assert fresh.read(0, at[3] + 1) == b"".join(stored[:3]) + b"d"
    assert fresh.read(at[4], at[6] - at[4]) == stored[4] + stored[5]


def test_two_handles_racing_for_one_generation(storage):
    """Both listed the same layout and write replacements of one generation: the switch marker
    decides, the loser reports a conflict (overlapping) or takes the next generation (disjoint)."""
    a, stored = _segment(storage, chunks=6)
    at = offsets(stored)
    b = open_segment(storage, NAME, rolling_size=at[1])
    # b writes its replacement object as a racer would (listed, not yet switched) ...
    storage.create(f"{NAME}.seg/{replacement_name(at[1], at[3], 1)}", b"bbb")
    # ... then a switches first with the same generation over an overlapping range.
    a.replace_range(0, at[2], b"aaa")
    assert a.read(0, 3) == b"aaa"
    with pytest.raises(LayoutConflictError):
        b.replace_range(at[1], at[3], b"bbb")
    fresh = open_segment(storage, NAME)
    assert fresh.read(0, 3) == b"aaa" and fresh.read(at[2], len(stored[2])) == stored[2]
    b.refresh()
    b.replace_range(at[3], at[5], b"disjoint")  # the stray object of the lost generation is swept
    assert not any(replacement_name(at[1], at[3], 1) in n for n in storage.list_files(NAME + ".seg"))
    assert open_segment(storage, NAME).read(at[3], 8) == b"disjoint"


def test_a_loser_whose_deletion_fails_never_takes_effect_once_its_winner_is_truncated(storage):
    """Two replacers raced for generation 1 over different ranges and the switch marker names the
    winner; the loser's object is still listed (its deletion failed, or its replacer died). A
    truncation leaves the winner wholly below the start while deleting the loser keeps failing.
    The winner stays until the loser is gone: with the loser alone under the marker, it would look
    switched in, and readers would get its bytes or a false hole."""
    _seg, stored = _segment(storage, chunks=6)
    at = offsets(stored)
    faulty = FaultyStorage(storage, seed=0, rates={})
    a = open_segment(faulty, NAME)
    d = f"{NAME}.seg"
    winner, loser = replacement_name(0, at[2], 1), replacement_name(at[1], at[4], 1)
    storage.create(f"{d}/{winner}", b"aaa")
    storage.create(f"{d}/{loser}", b"LLLLL")
    storage.create(f"{d}/{SWITCH_DIR}/{1:020d}", winner.encode())
    faulty.script("fail_before", op="delete", path_contains=loser, times=1000)
    a.refresh()
    a.truncate(at[2])  # the winner now lies wholly below the start
    assert {winner, loser} <= set(storage.list_files(d))
    assert open_segment(storage, NAME).read(at[2], at[5] - at[2]) == b"".join(stored[2:5])
    faulty.cancel_scripts()
    a.truncate(at[3])  # the loser goes now ...
    a.truncate(at[4])  # ... and then the winner
    assert not {winner, loser} & set(storage.list_files(d))
    assert open_segment(storage, NAME).read(at[4], len(stored[4])) == stored[4]


def test_lower_generation_switched_late_loses_to_an_overlapping_higher_one(storage):
    """A replacer that listed long ago and switches after a newer overlapping replacement takes
    its own back: readers see the newer one throughout, and the old chunks outside it survive."""
    a, stored = _segment(storage, chunks=6)
    at = offsets(stored)
    a.replace_range(at[1], at[3], b"new")  # generation 1
    a.replace_range(at[3], at[4], b"gen2")  # generation 2 (the highest marker is kept)
    # A slow racer's leftovers: its object and its switch marker of generation 3, over [0, at[2]).
    d = f"{NAME}.seg"
    storage.create(f"{d}/{replacement_name(0, at[2], 3)}", b"slow")
    storage.create(f"{d}/{replacement_name(at[1], at[4], 4)}", b"newest")
    storage.create(f"{d}/{SWITCH_DIR}/{4:020d}", replacement_name(at[1], at[4], 4).encode())
    storage.create(f"{d}/{SWITCH_DIR}/{3:020d}", replacement_name(0, at[2], 3).encode())
    fresh = open_segment(storage, NAME)
    assert fresh.read(0, at[1] + 6) == stored[0] + b"newest"  # generation 3 overlaps 4: not in force
    assert [(c.start, c.end) for c in fresh.chunks()][:2] == [(0, at[1]), (at[1], at[4])]


@pytest.mark.parametrize("step", ["object", "switch", "sweep"])
def test_crash_at_each_step_leaves_one_layout_and_is_cleaned(storage, step):
    """The leftovers a replacer killed after each step leaves: readers see the old layout
    (object written, never switched) or the new one (switched, old chunks not yet deleted);
    the next switch deletes them (it takes the next generation, which decides the unswitched one's)."""
    seg, stored = _segment(storage, chunks=5)
    at = offsets(stored)
    d = f"{NAME}.seg"
    storage.create(f"{d}/{replacement_name(at[1], at[3], 1)}", b"new")
    if step != "object":
        storage.create(f"{d}/{SWITCH_DIR}/{1:020d}", replacement_name(at[1], at[3], 1).encode())
    if step == "sweep":
        storage.delete([f"{d}/{at[1]:020d}"])  # killed half-way through deleting the old chunks
    fresh = open_segment(storage, NAME)
    if step == "object":
        assert fresh.read(0, at[5]) == b"".join(stored) and not fresh.holes()
    else:
        assert fresh.read(0, at[1] + 3) == stored[0] + b"new" and fresh.holes() == [(at[1] + 3, at[3])]
    fresh.replace_range(at[3], at[4], stored[3])
    assert_only_live_chunks_left(fresh)


def test_a_fence_left_alone_still_numbers_the_next_switch(storage):
    """A replacer that fenced a generation (an empty switch marker) and died before switching
    leaves, once the stray object of that generation is swept, a listing whose only marker is the
    fence: the next switch takes the generation after it (the fenced one would lose every race),
    and a poll does not take the fence for a switch since the view."""
    seg, stored = _segment(storage, chunks=5)
    at = offsets(stored)
    storage.create(f"{NAME}.seg/{SWITCH_DIR}/{1:020d}", b"")
    seg.refresh()
    assert not seg.poll()
    seg.replace_range(at[1], at[3], b"new")
    assert open_segment(storage, NAME).read(at[1], 3) == b"new"
    assert f"{SWITCH_DIR}/{2:020d}" in storage.list_files(f"{NAME}.seg")


def test_failures_before_and_after_the_switch_leave_a_layout(storage):
    """Scripted storage failures at each write of a replacement: the call raises a storage error
    and the segment reads as before or as after, never a mix."""
    _seg, stored = _segment(storage, chunks=0, extra=5)
    at = offsets(stored)
    old = b"".join(stored)

    def filled(name: str) -> None:
        plain = open_segment(storage, name, rolling_size=at[1])
        for piece in stored:
            plain.append(piece)

    for op_path in (replacement_name(at[1], at[3], 1), f"{SWITCH_DIR}/"):
        name = f"f{uuid.uuid4().hex[:8]}"
        filled(name)
        faulty = FaultyStorage(storage, seed=1)
        faulty.script("fail_before", op="create", path_contains=op_path, times=1)
        seg = open_segment(faulty, name, rolling_size=at[1])
        with pytest.raises(StorageError):
            seg.replace_range(at[1], at[3], b"new")
        assert open_segment(storage, name).read(0, at[5]) == old
        seg.replace_range(at[1], at[3], b"new")  # works once the failure has passed
        assert open_segment(storage, name).read(0, at[1] + 3) == stored[0] + b"new"
    # A lost acknowledgement of the switch marker is settled by reading it back.
    name = f"f{uuid.uuid4().hex[:8]}"
    filled(name)
    faulty = FaultyStorage(storage, seed=1)
    faulty.script("lost_ack", op="create", path_contains=f"{SWITCH_DIR}/", times=1)
    open_segment(faulty, name, rolling_size=at[1]).replace_range(at[1], at[3], b"new")
    assert open_segment(storage, name).read(0, at[1] + 3) == stored[0] + b"new"


def test_truncation_above_a_replacement_deletes_it_whole(storage):
    seg, stored = _segment(storage, chunks=6)
    at = offsets(stored)
    seg.replace_range(0, at[3], b"abc")
    seg.truncate(at[3] + 5)
    files = storage.list_files(NAME + ".seg")
    # Deleted whole (on S3 after the deletion grace: until then it waits in _doomed).
    assert not any(n.startswith("00000000000000000000") and n not in seg._handle.doomed for n in files)
    assert open_segment(storage, NAME).chunks()[0].start == at[3]
    seg.replace_range(at[4], at[5], b"")  # a whole chunk of hole
    seg.replace_range(at[4], at[5], b"")  # again: compaction runs repeatedly (generations)
    assert open_segment(storage, NAME).holes() == [(at[4], at[5])]
    seg.truncate(at[4] + 5)  # inside the hole
    assert open_segment(storage, NAME).holes() == [(at[4] + 5, at[5])]
    assert open_segment(storage, NAME).read(at[5], len(stored[5])) == stored[5]


def test_a_truncation_chosen_before_a_replacement_of_its_chunk_is_refused(storage):
    """``truncate(offset, expected=...)`` names the chunk that held ``offset`` when the caller
    chose it: if a replacement rewrote that chunk since (its bytes may have moved), nothing is
    truncated; chosen again in the new view, it is done."""
    a, stored = _segment(storage)
    at = offsets(stored)
    b = open_segment(storage, NAME, rolling_size=at[1])
    chosen = b.chunk_at(at[1]).name
    a.replace_range(0, at[3], b"packed")  # another handle packs the first three chunks meanwhile
    with pytest.raises(LayoutConflictError):
        b.truncate(at[1], expected=chosen)
    assert open_segment(storage, NAME).start_offset == 0 and open_segment(storage, NAME).read(0, 6) == b"packed"
    with pytest.raises(InvalidInputError):
        b.truncate(at[3], expected=7)
    b.truncate(at[3], expected=b.chunk_at(at[3]).name)
    b.truncate(at[2], expected="not checked: at or below the start offset, a truncation is a no-op")
    assert open_segment(storage, NAME).start_offset == at[3]
    assert open_segment(storage, NAME).read(at[3], len(stored[3])) == stored[3]


def test_poll_sees_appends_behind_a_switch(storage):
    """A tail reader's cheap poll looks for the chunk after its view's end; a switch may have
    taken that plain name away (merged into a replacement): the poll must still say yes."""
    a, stored = _segment(storage, chunks=3, extra=3)
    at = offsets(stored)
    b = open_segment(storage, NAME, rolling_size=at[1])
    assert not b.poll()
    for piece in stored[3:]:
        a.append(piece)
    a.replace_range(at[3], at[5], b"x")
    assert b.poll()
    b.refresh()
    assert not b.poll()
    if not storage.appendable and storage.deletion_grace > 0:
        b._handle.view_time -= storage.deletion_grace  # an old view on S3: the replaced names may be gone
        assert b.poll()
