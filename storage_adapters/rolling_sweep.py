"""What a truncation or a switch may delete from a listing: dead objects and old switch markers.

A switch marker is the commit record of its replacement and, while a view of the generation just
below it may still be in use, that view's only sign that something switched (appends and polls
check ``switch/<g + 1>``). So marker ``g`` goes only when (1) a higher marker exists (the top one
numbers the next switch), (2) no listed replacement has generation ``g``, and (3) ``g`` is at most
``t`` of a horizon ``(t, c)`` that has passed. The horizon (``SweepHorizons``): ``t`` is the top
generation an earlier listing in this process showed, ``c`` the last chunk's start in a listing
begun after that one ended. A view of a generation ``G < t`` was listed before ``switch/<G + 1>``
existed (listings read chunk names before markers: rolling_view.Listing), so its last chunk, a
plain one, starts at or below ``c``. Once no plain chunk at or below ``c`` is listed (truncated or
replaced away), that view's next append or poll meets its last chunk missing and lists again,
marker or no marker. Object stores without a deletion grace check the marker after an append's
create instead: there the truncation offset must also lie past every object at or below ``c``,
so that such an append is undone as truncated. docs/format.md, "Deleting switch markers".
"""

from __future__ import annotations

import threading
import time

from .rolling_view import SWITCH_DIR, Listing, SegmentView, chunk_name


class SweepHorizons:
    """Per segment, across the handles of this process: the horizons that deleting switch markers
    needs. A horizon ``(t, c)`` pairs the top generation ``t`` that one listing showed with the last
    chunk's start ``c`` in a listing begun after that one ended; any two listings of one process
    qualify, whichever handle took them (a cleaner opens a handle per pass). Bounded: the least
    recently used segments are forgotten (their sweep only waits)."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: key -> [top seen, monotonic time that listing had ended, horizon or None]
        self._state: dict[tuple[str, str], list] = {}

    def horizon(self, key: tuple[str, str], top: int, length: int, last_start: int | None,
                listed_at: float) -> tuple[int, int] | None:
        """Record a listing (begun at ``listed_at``, showing top generation ``top``, the segment's
        ``length`` and the last chunk's start) and return the horizon to test it against, if any."""
        ended = time.monotonic()
        with self._lock:
            state = self._state.pop(key, None) or [None, float("inf"), None]
            self._state[key] = state  # most recently used last
            if len(self._state) > self.LIMIT:
                del self._state[next(iter(self._state))]
            seen, seen_ended, horizon = state
            if horizon is not None and (top < horizon[0] or length < horizon[1]):
                horizon = None  # generations and lengths only grow: the segment was deleted and made again
            if horizon is None and seen is not None and seen <= top and listed_at > seen_ended and last_start is not None:
                horizon = (seen, last_start)
            state[:] = [top, ended, horizon]
            return horizon

    def passed(self, key: tuple[str, str], horizon: tuple[int, int]) -> None:
        """``horizon`` has passed: the next listing takes a new one."""
        with self._lock:
            state = self._state.get(key)
            if state is not None and state[2] == horizon:
                state[2] = None

    def forget(self, key: tuple[str, str]) -> None:
        """Drop what is known of segment ``key`` (it was deleted)."""
        with self._lock:
            self._state.pop(key, None)


#: the horizons of this process
SWEEPS = SweepHorizons()


def obsolete_names(key: tuple[str, str], listing: Listing, view: SegmentView, listed_at: float, *,
                   keeps_dead_names: bool, checks_after_create: bool) -> list[str]:
    """Right after a listing taken by a truncation or a switch (``view`` is what it showed, begun
    at ``listed_at``): the names in it that no view will use again, relative to the segment's
    directory. Objects wholly below the view's first chunk (a truncation's deletion that was
    interrupted, a replacement truncated away), then switch markers (see the module's docstring).

    ``keeps_dead_names``: plain names of dead chunks keep their name for a deletion grace and are
    not listed here. ``checks_after_create``: appends check the switch marker after their create
    (object stores without a grace).
    """
    first = view.first_start
    dead = [] if keeps_dead_names else listing.dead_plain(first)
    dead += view.layout.after_their_losers(
        [n for n, (start, end, _gen) in listing.replacements.items() if start < first and end <= first])
    dead.sort()
    top = view.layout.generation
    horizon = SWEEPS.horizon(key, top, view.length, view.chunks[-1].start if view.chunks else None, listed_at)
    if horizon is None:
        return dead
    horizon_gen, horizon_start = horizon
    lowest = min(listing.plain.values(), default=horizon_start + 1)
    if checks_after_create:
        lowest = min([lowest] + [start for start, _end, _gen in listing.replacements.values()])
    if lowest <= horizon_start:
        return dead  # a view of an old generation may still find its last chunk
    if checks_after_create and not view.start_offset > first:
        return dead
    SWEEPS.passed(key, horizon)
    in_use = {gen for _start, _end, gen in listing.replacements.values()}
    markers = [gen for gen in listing.switches if gen < top and gen <= horizon_gen and gen not in in_use]
    return dead + [f"{SWITCH_DIR}/{chunk_name(gen)}" for gen in sorted(markers)]
