"""Counting the HTTP requests an S3 storage sends (to moto in tests), by kind.

A ``before-send`` hook on the s3fs client sees every request, retries included. Requests are
classified as S3 bills them: PUT (and POST: multi-delete), GET, LIST (a GET of a bucket with a
``list-type``/``prefix`` query), HEAD, DELETE. Only requests to ``bucket`` are counted (s3fs
shares one client between storages with the same options).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import urllib.parse
from typing import Iterator


class RequestLog:
    """Requests seen so far: ``counts`` by kind and ``lines`` (kind, path and query) in order."""

    def __init__(self, bucket: str):
        self.bucket = bucket
        self.lines: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def record(self, method: str, url: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        parts = parsed.path.lstrip("/").split("/", 1)
        if parts[0] != self.bucket:
            return
        key = urllib.parse.unquote(parts[1]) if len(parts) > 1 else ""
        query = urllib.parse.parse_qs(parsed.query)
        if method == "GET" and not key:
            kind, key = "LIST", query.get("prefix", [""])[0]
        elif method == "POST":
            kind = "DELETE" if "delete" in parsed.query else "PUT"
        else:
            kind = method
        with self._lock:
            self.lines.append((kind, key))

    @property
    def counts(self) -> collections.Counter:
        with self._lock:
            return collections.Counter(kind for kind, _ in self.lines)

    @property
    def total(self) -> int:
        with self._lock:
            return len(self.lines)

    def clear(self) -> None:
        with self._lock:
            self.lines.clear()


@contextlib.contextmanager
def counting(storage) -> Iterator[RequestLog]:
    """Count the requests ``storage`` (an ``S3ChunkStorage``) sends to its bucket meanwhile."""
    fs = storage.fs
    fs.connect()
    log = RequestLog(storage.bucket)

    def before_send(request, **_kwargs):
        log.record(request.method, request.url)
        # returning None lets the request go out unchanged

    events = fs.s3.meta.events
    events.register("before-send.s3", before_send)
    try:
        yield log
    finally:
        events.unregister("before-send.s3", before_send)
