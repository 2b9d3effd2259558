"""Request counters: how many storage requests of each kind a backend has made, and the bytes moved.

On S3 every request is billed, so these are the numbers behind the bill (docs/cost.md). S3 counts
the HTTP requests really sent (retries included), from botocore's ``before-send`` event; local disk
and memory count the operations that stand in for them (a listing is a LIST, an existence or size
check a HEAD, a create, marker or in-place append a PUT, a ranged read a GET, each deleted file a
DELETE).
"""

from __future__ import annotations

import threading

import attrs

#: The request kinds counted, in the order S3 bills them (PUT, COPY, POST, LIST at one price; GET, HEAD at another).
KINDS = ("PUT", "GET", "LIST", "HEAD", "DELETE")


@attrs.frozen
class RequestCounters:
    """A snapshot of requests by kind and bytes moved. Subtracting two snapshots gives what happened between."""

    put: int = 0
    get: int = 0
    list: int = 0
    head: int = 0
    delete: int = 0
    bytes_read: int = 0  #: payload bytes received by reads (GET)
    bytes_written: int = 0  #: payload bytes sent by writes (PUT)

    @property
    def total(self) -> int:
        """All requests, of every kind."""
        return self.put + self.get + self.list + self.head + self.delete

    def __sub__(self, other: "RequestCounters") -> "RequestCounters":
        return RequestCounters(**{f: getattr(self, f) - getattr(other, f) for f in _FIELDS})

    def __add__(self, other: "RequestCounters") -> "RequestCounters":
        return RequestCounters(**{f: getattr(self, f) + getattr(other, f) for f in _FIELDS})

    def by_kind(self) -> dict[str, int]:
        """``{"PUT": n, "GET": n, ...}`` (the kinds of ``KINDS``)."""
        return {kind: getattr(self, kind.lower()) for kind in KINDS}


_FIELDS = tuple(f.name for f in attrs.fields(RequestCounters))
_KEYS = {kind: kind.lower() for kind in KINDS}


class RequestCounter:
    """The live, thread-safe counter a backend increments; ``snapshot()`` freezes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_FIELDS, 0)

    def count(self, kind: str, *, n: int = 1, read: int = 0, written: int = 0) -> None:
        """Record ``n`` requests of ``kind`` (one of ``KINDS``) that moved ``read``/``written`` bytes."""
        counts = self._counts
        with self._lock:
            counts[_KEYS.get(kind) or kind.lower()] += n
            if read:
                counts["bytes_read"] += read
            if written:
                counts["bytes_written"] += written

    def add_bytes(self, *, read: int = 0, written: int = 0) -> None:
        """Record payload bytes of a request already counted."""
        with self._lock:
            self._counts["bytes_read"] += read
            self._counts["bytes_written"] += written

    def snapshot(self) -> RequestCounters:
        with self._lock:
            return RequestCounters(**self._counts)
