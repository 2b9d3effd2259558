"""The ``ChunkStorage`` interface: the few file operations a rolling segment needs from a backend.

Paths are relative to the storage's root and use ``/``. Two kinds of backend exist:

* *appendable* (local disk, memory): a chunk file is appended to in place; ``lock`` serialises
  writers of one directory across threads and processes and ``trim`` cuts a chunk that stops
  growing back to its end. Where an append can tear (``torn_appends``: local disk), nothing but
  the bytes say what is committed: the segment's owner frames them (framing.py);
* *object* (S3): a chunk is written once by an exclusive ``create``, which is what makes
  compare-and-append safe there.

Errors: every method raises only ``FileNotFoundError`` (where its docstring says so),
``ChunkExistsError`` or a ``StorageError`` subclass: ``StorageFullError`` (no space; nothing was
written) and ``OutcomeUnknownError`` (a write that may or may not have happened) among them. No raw
``OSError`` or client-library error escapes a backend.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

from .requests import RequestCounter, RequestCounters


class ChunkStorage(abc.ABC):
    """A directory tree of immutable or append-only chunk files under one root URL."""

    #: True when ``append``/``lock``/``trim`` are available (chunks grow in place).
    appendable: bool = False
    #: True when an append can be left half done by a crash (local disk): a chunk's stored size
    #: then says nothing about what is committed, its frames do (framing.py). False for memory,
    #: whose appends are whole or absent, and for objects, written whole.
    torn_appends: bool = False
    #: True when a backend counts its own requests (S3 counts HTTP requests); otherwise each
    #: operation a subclass defines is counted as the request kind it stands for (``_OPERATION_KINDS``).
    counts_own_requests: bool = False
    # A wrapper (a storage with an ``inner`` ChunkStorage: fault injection, cached listings) has its
    # inner backend's capability, deletion grace and request counters unless it says otherwise.
    @property
    def exclusive_create_enforced(self) -> bool:
        """False when ``create`` may silently replace an existing file (an S3-compatible store that
        ignores ``If-None-Match``, used with ``single_writer=True``): then a read-back that finds
        other bytes than ours cannot tell "another writer's" from "ours, overwritten"."""
        inner = _inner(self)
        return True if inner is None else inner.exclusive_create_enforced

    @property
    def deletion_grace(self) -> float:
        """Object backends: seconds a chunk made dead by a truncation keeps its name before it is
        deleted, so that a handle whose view is younger than that never re-creates a deleted name
        (docs/storage.md). 0: deleted at once, and each append lists the truncation markers instead."""
        if "_deletion_grace" in self.__dict__:
            return self.__dict__["_deletion_grace"]
        inner = _inner(self)
        return 0.0 if inner is None else inner.deletion_grace

    @deletion_grace.setter
    def deletion_grace(self, seconds: float) -> None:
        self.__dict__["_deletion_grace"] = float(seconds)

    def __init__(self, url: str):
        self.url = url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.counts_own_requests:
            return
        for name, kind in _OPERATION_KINDS.items():
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_counted", False):
                setattr(cls, name, _counted(method, kind))

    # -- request counters ------------------------------------------------------------------------
    @property
    def request_counter(self) -> RequestCounter:
        """The live counter this backend increments (created on first use); a wrapper's is its inner's."""
        inner = _inner(self)
        if inner is not None:
            return inner.request_counter
        counter = self.__dict__.get("_request_counter")
        if counter is None:
            with _COUNTER_GUARD:
                counter = self.__dict__.setdefault("_request_counter", RequestCounter())
        return counter

    @property
    def requests(self) -> RequestCounters:
        """Requests made so far by this storage object, by kind, and the bytes they moved."""
        return self.request_counter.snapshot()

    # -- reading -------------------------------------------------------------------------------
    @abc.abstractmethod
    def list_files(self, directory: str) -> dict[str, int]:
        """Every file below ``directory`` (recursively) as ``{path relative to directory: size}``.

        A missing directory is empty. Sizes are raw sizes: on a backend with ``torn_appends`` a
        chunk's frames tell how much of it is committed (zeros may follow them).
        """

    @abc.abstractmethod
    def read(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file, fetched as a ranged read. Missing file: ``FileNotFoundError``."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file exists."""

    # -- writing -------------------------------------------------------------------------------
    @abc.abstractmethod
    def create(self, path: str, data: bytes) -> None:
        """Write a whole new file, durably; raise ``ChunkExistsError`` if it already exists."""

    @abc.abstractmethod
    def put_marker(self, path: str) -> None:
        """Create an empty file durably (its name is its content); an existing one is kept."""

    @abc.abstractmethod
    def delete(self, paths: list[str]) -> None:
        """Delete files (and whatever sidecar files the backend keeps for them); missing ones are ignored."""

    @abc.abstractmethod
    def remove_directory(self, directory: str) -> None:
        """Delete a directory and everything below it; a missing one is ignored."""

    # -- appendable backends only ----------------------------------------------------------------
    def lock(self, directory: str) -> contextlib.AbstractContextManager[None]:
        """Exclusive lock over the writers of ``directory``, across threads and processes."""
        raise NotImplementedError(f"{type(self).__name__} has no in-place append")

    def lock_is_held(self, directory: str) -> bool:
        """Whether a writer (any thread or process) holds ``lock(directory)`` now: a probe that
        never waits. False where no writer ever locked it, and on backends without the lock."""
        return False

    def size(self, path: str) -> int:
        """The stored size of a file (on a backend with ``torn_appends``, zeros past the committed
        end count). Missing file: ``FileNotFoundError``."""
        inner = _inner(self)
        if inner is not None:
            return inner.size(path)
        raise NotImplementedError(f"{type(self).__name__} has no in-place append")

    def trimmed(self, path: str) -> bool:
        """Whether chunk ``path`` was trimmed (``trim``): a writer rolled past it. For backends
        without ``torn_appends`` (memory), whose chunks hold no zeros after their end to say so.
        Missing chunk: ``FileNotFoundError``."""
        inner = _inner(self)
        if inner is not None:
            return inner.trimmed(path)
        raise NotImplementedError(f"{type(self).__name__} keeps no trim marks")

    def zeros_kept_after(self, end: int) -> int:
        """The fewest bytes a chunk file appended to in place keeps past the committed end of its
        frames, at chunk offset ``end``, in every state that appends and crashes leave (local
        disk: the zeros pre-written ahead, which an append writes before its own bytes). A file
        shorter than that, with bytes of a torn write after ``end``, was cut short: damage, not a
        crash (storage_adapters/tail.py). 0: nothing is kept (memory, objects)."""
        inner = _inner(self)
        return 0 if inner is None else inner.zeros_kept_after(end)

    def trim(self, path: str, size: int) -> None:
        """Cut chunk ``path`` back to ``size`` bytes, its end, durably: it will not grow again (the
        next chunk starts at ``size``). Call under ``lock``. Backends that keep nothing past a
        chunk's end do nothing."""
        inner = _inner(self)
        if inner is not None:
            inner.trim(path, size)
            return
        if not self.appendable:
            raise NotImplementedError(f"{type(self).__name__} has no in-place append")

    def append(self, path: str, position: int, data: bytes, *, clear_to: int = 0) -> None:
        """Write ``data`` at ``position`` (the chunk's committed end) durably; call under ``lock``.

        Whatever is stored from ``position`` on is not committed and is overwritten; bytes of a
        torn earlier write past the new end, up to ``clear_to``, are zeroed by the same call. The
        chunk is created if missing (then ``position`` must be 0).
        """
        raise NotImplementedError(f"{type(self).__name__} has no in-place append")

    def close(self) -> None:
        """Release what the backend holds (connections, descriptors)."""

    def __enter__(self) -> "ChunkStorage":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_COUNTER_GUARD = threading.Lock()


def _inner(storage: ChunkStorage) -> ChunkStorage | None:
    """The backend a wrapping storage passes its calls to (its ``inner`` attribute), if any."""
    inner = storage.__dict__.get("inner")
    return inner if isinstance(inner, ChunkStorage) else None

#: The request kind each ``ChunkStorage`` operation stands for, on backends that do not count
#: their own requests. ``delete`` counts one DELETE per path; ``remove_directory`` a LIST and a DELETE.
_OPERATION_KINDS = {
    "list_files": "LIST",
    "read": "GET",
    "exists": "HEAD",
    "size": "HEAD",
    "trimmed": "HEAD",
    "trim": "PUT",
    "create": "PUT",
    "put_marker": "PUT",
    "append": "PUT",
    "delete": "DELETE",
    "remove_directory": "DELETE",
}


def _counted(method: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """Wrap a backend operation so that each call counts as one request of ``kind`` (before it runs:
    a failed request was still made)."""

    name = method.__name__
    plain = name not in ("delete", "remove_directory") and kind not in ("PUT", "GET")

    if plain:  # HEAD and LIST: one count, nothing to measure (three of a local append's four calls)
        @functools.wraps(method)
        def wrapper(self: ChunkStorage, *args: Any, **kwargs: Any) -> Any:
            own = self.__dict__
            inner = own.get("inner")
            if inner is None or not isinstance(inner, ChunkStorage):  # a wrapper's inner backend counts
                (own.get("_request_counter") or self.request_counter).count(kind)
            return method(self, *args, **kwargs)

        wrapper._counted = True  # type: ignore[attr-defined]
        return wrapper

    @functools.wraps(method)
    def wrapper(self: ChunkStorage, *args: Any, **kwargs: Any) -> Any:
        # On every storage call (four per local append): plain dict lookups, no property calls.
        own = self.__dict__
        inner = own.get("inner")
        if inner is not None and isinstance(inner, ChunkStorage):  # a wrapper: the inner backend counts
            return method(self, *args, **kwargs)
        counter = own.get("_request_counter") or self.request_counter
        if name == "delete":
            paths = args[0] if args else kwargs.get("paths", [])
            counter.count("DELETE", n=len(paths))
        elif name == "remove_directory":
            counter.count("LIST")
            counter.count("DELETE")
        elif kind == "PUT":
            data = kwargs.get("data", args[-1] if args else b"")
            counter.count(kind, written=len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0)
        else:
            counter.count(kind)
        result = method(self, *args, **kwargs)
        if kind == "GET" and isinstance(result, (bytes, bytearray)):
            counter.add_bytes(read=len(result))
        return result

    wrapper._counted = True  # type: ignore[attr-defined]
    return wrapper


def relative_paths(root: str, found: Iterator[tuple[str, int]]) -> dict[str, int]:
    """Turn ``(absolute path, size)`` pairs under ``root`` into ``{relative path: size}``."""
    prefix = root.rstrip("/") + "/"
    return {path[len(prefix):]: size for path, size in found if path.startswith(prefix)}
