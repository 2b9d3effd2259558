"""Group commit: concurrent writers on one handle share one durable write (LevelDB's writer queue).

Each writer queues a request and waits. The writer at the head of the queue becomes the *leader*:
it takes the requests queued behind it (up to a size bound), performs them as one write (the
callback decides, request by request, what each gets: a result or its own error) and wakes the
others. A follower whose request was taken returns its own outcome without touching storage;
one that was not taken becomes the next leader. So while a write is in flight the next group
forms, and N threads cost about one durable write per group instead of N.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Sequence

__all__ = ["WriteQueue", "WriteRequest"]

_UNSET = object()


class WriteRequest:
    """One caller's request: the ``payload`` the leader's write function reads, and its outcome."""

    __slots__ = ("payload", "size", "result", "error", "done", "taken")

    def __init__(self, payload: Any, size: int):
        self.payload = payload
        self.size = size  #: estimated bytes, for the group bound
        self.result: Any = _UNSET
        self.error: BaseException | None = None
        self.done = False
        self.taken = False  #: a leader took it into a group

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        """Give this request its outcome (by the leader; the first one given stands)."""
        if self.result is _UNSET and self.error is None:
            self.result, self.error = (result, None) if error is None else (_UNSET, error)

    @property
    def settled(self) -> bool:
        return self.result is not _UNSET or self.error is not None

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class WriteQueue:
    """The queue of requests waiting for a leader; ``submit`` is the whole API."""

    def __init__(self, max_group_bytes: int, max_group_requests: int):
        self.max_group_bytes = max_group_bytes
        self.max_group_requests = max_group_requests
        self._cv = threading.Condition(threading.Lock())
        self._waiting: deque[WriteRequest] = deque()
        self.groups = 0  #: groups written (for statistics)
        self.requests = 0  #: requests written in them

    def submit(self, request: WriteRequest, write: Callable[[Sequence[WriteRequest]], None]) -> Any:
        """Queue ``request``; return its result (or raise its error) once a leader wrote it.

        ``write(group)`` runs in the leader's thread and must settle every request of the group;
        one it leaves unsettled, or all of them if it raises, get the exception it raised.
        """
        with self._cv:
            self._waiting.append(request)
            try:
                while not request.done and self._waiting[0] is not request:
                    self._cv.wait()  # woken when a leader finishes: then either done or at the head
            except BaseException:  # interrupted while waiting (KeyboardInterrupt): leave the queue,
                if not request.taken:  # unless a leader is writing it, so that no one waits on it
                    self._waiting.remove(request)
                    self._cv.notify_all()
                raise
            if request.done:
                return request.outcome()
            group = self._take_group()
        try:
            write(group)
        except BaseException as exc:  # noqa: BLE001 - handed to every member, raised in each caller
            for member in group:
                member.settle(error=exc)
        finally:
            with self._cv:
                for member in group:
                    if not member.settled:
                        member.settle(error=RuntimeError("group commit: the write left this request unsettled"))
                    self._waiting.popleft()  # the group is the head of the queue, in order
                    member.done = True
                self.groups += 1
                self.requests += len(group)
                self._cv.notify_all()
        return request.outcome()

    def _take_group(self) -> list[WriteRequest]:
        """The head requests that fit in one write (the first always does)."""
        group, size = [], 0
        for member in self._waiting:
            if group and (size + member.size > self.max_group_bytes or len(group) >= self.max_group_requests):
                break
            group.append(member)
            member.taken = True
            size += member.size
        return group
