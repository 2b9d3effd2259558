"""``SegmentPoller``: one poller per segment handle, shared by every reader waiting at its tail.

Appends made through the handle wake its readers at once. Appends made by other handles and
processes can only be found by asking storage, which on an object store is billed per request;
so the readers of one handle do not each poll: whichever waiting reader finds a poll due makes
it, on behalf of all, and wakes the others when it is done. There is no thread of its own, so
nothing is left running after a close.

Polls back off exponentially while nothing comes: ``min_interval``, twice that, ... up to
``max_interval``, and start over at ``min_interval`` as soon as records arrive (found by a poll
or appended through the handle). A record appended elsewhere is therefore seen within
``max_interval`` plus one poll; an idle reader costs one poll per ``max_interval``.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol


class Pollable(Protocol):
    """What a poller needs from a segment handle."""

    @property
    def next_offset(self) -> int: ...

    @property
    def closed(self) -> bool: ...


class SegmentPoller:
    """Shared backoff state of the polls of one segment handle (see the module docstring)."""

    def __init__(self, segment: Pollable, appended: threading.Condition, poll: Callable[[], bool],
                 min_interval: float, max_interval: float):
        """``appended``: the segment's condition, notified on appends through it and on close;
        ``poll()``: one look for appends made elsewhere (cheap), catching up; True if records came."""
        self._segment = segment
        self._cond = appended
        self._poll = poll
        self.min_interval = min_interval
        self.max_interval = max_interval
        self._interval = min_interval  #: the wait after the next empty poll grows from this
        self._known = segment.next_offset  #: next offset when the backoff was last reset
        self._next_poll = time.monotonic() + min_interval
        self._polling = False  #: a reader is polling now (the others wait for its result)
        self.polls = 0  #: polls made so far (each is one small storage request on object stores)

    @property
    def interval(self) -> float:
        """The current wait between polls."""
        return self._interval

    def wait(self, offset: int, timeout: float, cancelled: threading.Event | None = None) -> None:
        """Return once record ``offset`` may be readable, the segment is closed, ``cancelled`` is
        set, or ``timeout`` seconds have passed; polls storage when a poll is due meanwhile.

        Bounded: each lap returns, waits a positive time towards the deadline, or makes one poll.
        A poll's storage error is raised here (the next due poll is made by whoever waits then).
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                if self._ready(offset, cancelled):
                    return
                now = time.monotonic()
                if now >= deadline:
                    return
                if self._polling or now < self._next_poll:
                    until = deadline if self._polling else min(deadline, self._next_poll)
                    self._cond.wait(until - now)
                    continue
                self._polling = True
            found = False
            try:
                found = self._poll()
            finally:
                with self._cond:
                    self._polling = False
                    self.polls += 1
                    self._schedule(found)
                    self._cond.notify_all()

    def _ready(self, offset: int, cancelled: threading.Event | None) -> bool:
        """Under the condition: whether the wait is over; resets the backoff when records came."""
        segment = self._segment
        if segment.closed or (cancelled is not None and cancelled.is_set()):
            return True
        current = segment.next_offset
        if current != self._known:  # records arrived (this handle's appends, or a poll): poll soon again
            self._known = current
            self._interval = self.min_interval
            self._next_poll = min(self._next_poll, time.monotonic() + self.min_interval)
        return current > offset

    def _schedule(self, found: bool) -> None:
        self._interval = self.min_interval if found else min(self._interval * 2, self.max_interval)
        self._next_poll = time.monotonic() + self._interval


__all__ = ["SegmentPoller"]
