"""The pure view of a rolling segment (storage_adapters/rolling_view.py) as a state machine.

A model keeps the chunk list a handle should see (start, end, stored bytes, name, generation), the
start offset and the switch markers; a dict stands for the segment's directory listing. Rules grow
the last chunk, roll to a new one, truncate, drop dead chunks, replace a range of sealed chunks
(a replacement and its switch marker), fence a generation, leave debris of replacers that never
switched, and sweep what a layout retired. The view moves on through its own methods; after each
change of the listing it is rebuilt by ``Listing`` and must match the model, and its answers
(chunk at, holes, readable ends, sealed runs, ranges) must match brute-force ones from the model.
No storage is touched.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from storage_adapters.errors import (
    CorruptDataError,
    InvalidInputError,
    LayoutConflictError,
    OffsetOutOfRangeError,
    TruncatedError,
)
from storage_adapters.rolling_view import (
    SWITCH_DIR,
    TRUNCATION_DIR,
    ChunkInfo,
    Listing,
    SegmentView,
    chunk_name,
    replacement_name,
)

SIZES = st.integers(1, 6)


class ViewMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.files: dict[str, int] = {}  # the segment's directory: name -> stored size
        self.model: list[ChunkInfo] = []  # the chunks a handle should see, in order
        self.start = 0
        self.top = 0  # the highest switch generation
        self.named: dict[int, str] = {}  # switch generation -> the replacement it names ("" for a fence)
        self.view = SegmentView()

    @property
    def length(self) -> int:
        return self.model[-1].end if self.model else self.start

    def sealed(self) -> list[int]:
        return [i for i, c in enumerate(self.model[:-1]) if c.start >= self.start]

    def listed(self, files: dict[str, int] | None = None, **options) -> SegmentView | None:
        listing = Listing(dict(self.files if files is None else files))
        layout = listing.layout({gen: self.named.get(gen) for gen in listing.contested()})
        assert layout is not None and layout.generation == self.top
        return listing.view(layout, "s", **options)

    # -- the segment changes -------------------------------------------------------------------
    @precondition(lambda self: self.model)
    @rule(n=SIZES)
    def grow(self, n):
        last = self.model[-1]
        grown = ChunkInfo(last.start, last.length + n, last.name)
        self.model[-1] = grown
        self.files[last.name] += n
        self.view = self.view.with_last(grown)

    @precondition(lambda self: not self.model or self.model[-1].length)
    @rule(n=st.integers(0, 6))
    def roll(self, n):
        chunk = ChunkInfo(self.length, n, chunk_name(self.length))
        self.model.append(chunk)
        self.files[chunk.name] = n
        self.view = self.view.appended(chunk, self.start)

    @rule(data=st.data())
    def truncate(self, data):
        offset = data.draw(st.integers(self.start, self.length))
        self.files[f"{TRUNCATION_DIR}/{chunk_name(offset)}"] = 0
        self.start = max(self.start, offset)
        self.view = self.view.truncated(offset)

    @rule()
    def drop_dead(self):
        """What a truncation deletes, after the losers of every generation (as a sweep does first:
        with its winner gone, a loser would look switched)."""
        listing = Listing(dict(self.files))
        for name in listing.layout({gen: self.named.get(gen) for gen in listing.contested()}).losers:
            del self.files[name]
        dead, markers = self.view.dead_chunks(), self.view.dead_markers()
        assert dead == [c for c in self.model[:-1] if c.end <= self.start]
        assert markers == sorted(int(n[-20:]) for n in self.files
                                 if n.startswith(TRUNCATION_DIR) and int(n[-20:]) < self.start)
        assert self.view.has_dead() == bool(dead or markers)
        for chunk in dead:
            del self.files[chunk.name]
            self.model.remove(chunk)
        for marker in markers:
            del self.files[f"{TRUNCATION_DIR}/{chunk_name(marker)}"]
        self.view = self.view.without({c.name for c in dead}, set(markers))
        assert not self.view.has_dead()

    @precondition(lambda self: self.sealed())
    @rule(data=st.data())
    def replace(self, data):
        i = data.draw(st.sampled_from(self.sealed()))
        j = data.draw(st.integers(i, len(self.model) - 2))
        start, end = self.model[i].start, self.model[j].end
        run = self.view.sealed_run("s", start, end, LayoutConflictError)
        assert run == self.model[i:j + 1]
        stored = data.draw(st.integers(0, end - start))
        gen = self.top = self.top + 1
        name = self.named[gen] = replacement_name(start, end, gen)
        self.files[name] = stored
        self.files[f"{SWITCH_DIR}/{chunk_name(gen)}"] = len(name)
        self.model[i:j + 1] = [ChunkInfo(start, end - start, name, stored, gen)]
        self.relist()  # a replacer lists again after its switch

    @rule()
    def fence(self):
        gen = self.top = self.top + 1
        self.named[gen] = ""
        self.files[f"{SWITCH_DIR}/{chunk_name(gen)}"] = 0

    @precondition(lambda self: self.model)
    @rule(data=st.data(), ahead=st.integers(1, 3))
    def debris(self, data, ahead):
        """A replacer that wrote its chunk and never switched (crashed, or still at work)."""
        i = data.draw(st.integers(0, len(self.model) - 1))
        j = data.draw(st.integers(i, len(self.model) - 1))
        self.files[replacement_name(self.model[i].start, self.model[j].end + 1, self.top + ahead)] = 1

    @rule()
    def sweep(self):
        listing = Listing(dict(self.files))
        layout = listing.layout({gen: self.named.get(gen) for gen in listing.contested()})
        for name in layout.losers + layout.retired:
            assert name not in {c.name for c in self.model}
            del self.files[name]
        self.relist()

    @rule()
    def relist(self):
        live = [c for i, c in enumerate(self.model) if i + 1 == len(self.model) or c.end > self.start]
        view = self.listed(whole_objects=True)
        assert view is not None and list(view.chunks) == live
        assert (view.start_offset, view.length) == (self.start, self.length)
        last = live[-1] if live else None
        if last is not None and last.generation == 0:
            assert self.listed(last_length=last.length) == view
        self.model, self.view = live, view

    # -- inconsistent and damaged listings -----------------------------------------------------
    def after_replacements(self) -> list[ChunkInfo]:
        """Live plain chunks, not the last, that follow a replacement."""
        return [b for a, b in zip(self.model, self.model[1:-1]) if a.generation and not b.generation and b.end > self.start]

    @precondition(lambda self: self.after_replacements())
    @rule(data=st.data())
    def a_listing_without_the_chunk_after_a_replacement_is_inconsistent(self, data):
        """It raced a switch: the chunks around a replacement must meet it."""
        gone = data.draw(st.sampled_from(self.after_replacements()))
        assert self.listed({n: s for n, s in self.files.items() if n != gone.name}) is None

    @precondition(lambda self: self.model)
    @rule()
    def a_listing_with_a_marker_past_the_end_is_inconsistent(self):
        """It raced a truncation and a roll: the new marker with the old chunks."""
        assert self.listed({**self.files, f"{TRUNCATION_DIR}/{chunk_name(self.length + 1)}": 0}) is None

    @precondition(lambda self: any(c.generation == 0 for c in self.model[:-1] if c.end > self.start))
    @rule(data=st.data())
    def a_sealed_object_of_the_wrong_size_is_corrupt(self, data):
        chunk = data.draw(st.sampled_from([c for c in self.model[:-1] if c.generation == 0 and c.end > self.start]))
        files = {**self.files, chunk.name: chunk.length + 1}
        assert self.listed(files) is not None  # appendable storage: chunks are trimmed, sizes not checked
        with pytest.raises(CorruptDataError):
            self.listed(files, whole_objects=True)

    # -- the view's answers --------------------------------------------------------------------
    @rule(data=st.data())
    def check_range(self, data):
        offset = data.draw(st.integers(0, self.length + 2))
        n = data.draw(st.integers(0, 4))
        if offset < self.start:
            with pytest.raises(TruncatedError):
                self.view.check_range("s", offset, n)
        elif offset + n > self.length:
            with pytest.raises(OffsetOutOfRangeError):
                self.view.check_range("s", offset, n)
        else:
            self.view.check_range("s", offset, n)

    @rule(data=st.data())
    def a_range_that_is_not_a_sealed_run_is_refused(self, data):
        start = data.draw(st.integers(0, self.length))
        end = data.draw(st.integers(start + 1, self.length + 2))
        starts = {c.start: i for i, c in enumerate(self.model)}
        ends = {c.end: i for i, c in enumerate(self.model[:-1])}
        ok = start >= self.start and start in starts and end in ends and starts[start] <= ends[end]
        if ok:
            assert self.view.sealed_run("s", start, end, InvalidInputError) == self.model[starts[start]:ends[end] + 1]
        else:
            with pytest.raises(InvalidInputError):
                self.view.sealed_run("s", start, end, InvalidInputError)

    @invariant()
    def the_view_matches_the_model(self):
        view = self.view
        assert list(view.chunks) == self.model
        assert (view.start_offset, view.length) == (self.start, self.length)
        assert all(a.end == b.start for a, b in zip(view.chunks, view.chunks[1:]))
        holes = [(max(c.stored_end, self.start), c.end) for c in self.model if c.stored < c.length and c.end > self.start]
        assert view.holes() == holes
        for position in sorted({p for c in self.model for p in (c.start, c.stored_end, c.end - 1, c.end)
                                if view.first_start <= p <= self.length}):
            holding = [c for c in self.model if c.start <= position < c.end] or self.model[-1:]
            assert view.chunk_at(position) == (holding[0] if holding else None)
            hole = [(c.stored_end, c.end) for c in self.model if c.stored_end <= position < c.end]
            assert view.hole_at(position) == (hole[0] if hole else None)
            first_hole = min([max(position, c.stored_end) for c in self.model
                              if c.end > position and c.stored_end < min(c.end, self.length)], default=self.length)
            assert view.readable_end(position, self.length) == first_hole

    @invariant()
    def small_runs_are_mergeable(self):
        for target in (1, 4, 12):
            for run in self.view.small_runs(target):
                assert len(run) > 1 and all(a.end == b.start for a, b in zip(run, run[1:]))
                assert run[-1].name != self.view.chunks[-1].name and run[0].start >= self.start
                assert sum(c.stored for c in run) <= target
                assert all(c.stored == c.length for c in run[:-1])  # a hole only at the end


def test_the_view_follows_its_listing():
    run_state_machine_as_test(ViewMachine, settings=settings(max_examples=200, stateful_step_count=30,
                                                             deadline=None))


def test_an_empty_listing_is_an_empty_view():
    listing = Listing({})
    view = listing.view(listing.layout({}), "s")
    assert view == SegmentView() and view.length == 0 and view.chunk_at(0) is None and listing.last_plain(view.layout) is None


def test_racing_replacers_of_one_generation_are_decided_by_the_marker():
    files = {chunk_name(0): 4, chunk_name(4): 4, chunk_name(8): 1,
             replacement_name(0, 4, 1): 2, replacement_name(0, 8, 1): 3, f"{SWITCH_DIR}/{chunk_name(1)}": 40}
    listing = Listing(files)
    assert listing.contested() == [1]
    assert listing.layout({1: None}) is None  # the marker vanished while being read: list again
    layout = listing.layout({1: replacement_name(0, 8, 1)})
    assert layout.accepted == {replacement_name(0, 8, 1)} and layout.losers == (replacement_name(0, 4, 1),)
    assert [c.name for c in listing.view(layout, "s").chunks] == [replacement_name(0, 8, 1), chunk_name(8)]


def test_a_replacement_holding_more_than_its_range_is_corrupt():
    files = {chunk_name(0): 4, chunk_name(4): 1, replacement_name(0, 4, 1): 5, f"{SWITCH_DIR}/{chunk_name(1)}": 40}
    listing = Listing(files)
    with pytest.raises(CorruptDataError, match="holds 5 bytes but covers only 4"):
        listing.view(listing.layout({}), "s")
