"""``ListedStorage``: opening a segment on an object store from ONE listing of its directory.

A segment's parts (its log, the log's chunk index files and gap markers, the attributes' B+tree)
each list their own directory when opened, some twice; on S3 each listing is a billed LIST, and a
listing of a missing directory costs s3fs three requests. ``SegmentStore.segment`` lists the
segment's whole directory once (which also tells whether its marker exists) and opens the
segment through this wrapper, which answers the parts' listings from that one listing while the
open runs, then passes everything through to the real storage.

Staleness is bounded: each directory is answered from the listing at most twice (a part that
lists again because what it saw was inconsistent, a race with another process, gets a live
listing the third time), and not at all once a write, a delete or a read of a missing file went
through the wrapper, or the open is over (``expire``). Only object stores use it: a local
listing costs nothing, and appendable chunks grow under a listing.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from storage_adapters import ChunkStorage

_SERVES = 2  #: answers per directory from the listing (the parts list twice at most when opening)


class ListedStorage(ChunkStorage):
    """``inner`` with the listings below ``root`` answered from ``listing`` until ``expire()``.

    Everything else is the inner backend's: its nature, its deletion grace, its request counters
    (a listing answered here is no request, and is not counted)."""

    counts_own_requests = True  # the inner backend counts what is really sent

    def __init__(self, inner: ChunkStorage, root: str, listing: dict[str, int]):
        super().__init__(inner.url)
        self.inner = inner
        self.appendable = inner.appendable
        self.torn_appends = inner.torn_appends
        self._root = root.rstrip("/") + "/"
        self._listing: dict[str, int] | None = listing  #: paths relative to ``root``; None: expired
        self._served: dict[str, int] = {}
        self._guard = threading.Lock()

    def expire(self) -> None:
        """From now on every call goes to the real storage."""
        with self._guard:
            self._listing = None

    @property
    def expired(self) -> bool:
        return self._listing is None

    def __getattr__(self, name: str) -> Any:  # what a backend offers beyond the interface (fs, requests...)
        return getattr(self.inner, name)

    # -- reading -------------------------------------------------------------------------------
    def list_files(self, directory: str) -> dict[str, int]:
        with self._guard:
            listing = self._listing
            prefix = directory.rstrip("/") + "/"
            if listing is not None and prefix.startswith(self._root) and self._served.get(prefix, 0) < _SERVES:
                self._served[prefix] = self._served.get(prefix, 0) + 1
                below = prefix[len(self._root):]
                return {path[len(below):]: size for path, size in listing.items() if path.startswith(below)}
        return self.inner.list_files(directory)

    def read(self, path: str, start: int, end: int) -> bytes:
        with self._expiring_if_missing():
            return self.inner.read(path, start, end)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def size(self, path: str) -> int:
        with self._expiring_if_missing():
            return self.inner.size(path)

    def trimmed(self, path: str) -> bool:
        with self._expiring_if_missing():
            return self.inner.trimmed(path)

    @contextlib.contextmanager
    def _expiring_if_missing(self):
        try:
            yield
        except FileNotFoundError:  # the listing named what is gone: it is stale
            self.expire()
            raise

    # -- writing (each ends the listing's use: it no longer shows what is stored) ----------------
    def create(self, path: str, data: bytes) -> None:
        self.expire()
        self.inner.create(path, data)

    def put_marker(self, path: str) -> None:
        self.expire()
        self.inner.put_marker(path)

    def delete(self, paths: list[str]) -> None:
        self.expire()
        self.inner.delete(paths)

    def remove_directory(self, directory: str) -> None:
        self.expire()
        self.inner.remove_directory(directory)

    def lock(self, directory: str):
        return self.inner.lock(directory)

    def trim(self, path: str, size: int) -> None:
        self.expire()
        self.inner.trim(path, size)

    def append(self, path: str, position: int, data: bytes, *, clear_to: int = 0) -> None:
        self.expire()
        self.inner.append(path, position, data, clear_to=clear_to)

    def close(self) -> None:
        """The real storage belongs to the store: closing a segment's view of it does nothing."""

    def __repr__(self) -> str:
        return repr(self.inner)


__all__ = ["ListedStorage"]
