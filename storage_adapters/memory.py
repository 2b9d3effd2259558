"""In-process chunk storage on fsspec's memory filesystem, for tests and experiments.

``memory://name`` is shared by everything in one process (fsspec keeps one store), so reopening a
segment sees its data. Writers of one directory are serialised by a process-wide lock; a process
that dies takes the whole store with it, so there is no torn state to recover.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from fsspec.implementations.memory import MemoryFileSystem

from .base import ChunkStorage, relative_paths
from .errors import ChunkExistsError, StorageError

_LOCKS_GUARD = threading.Lock()
#: Reads (and ``MemoryFile.size``) export a file's buffer and appends grow it: a read that
#: overlapped an append made the append raise ``BufferError`` (a buffer cannot grow while
#: exported), so both take this lock (short; no I/O under it).
_BYTES_GUARD = threading.Lock()


def _size(chunk) -> int:
    with _BYTES_GUARD:
        return chunk.size
_LOCKS: dict[str, threading.RLock] = {}


#: Attribute set on a chunk's file object by ``trim`` (it lives and dies with the file).
_TRIMMED = "attrindex_trimmed"


def _directory_lock(path: str) -> threading.RLock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(path, threading.RLock())


class MemoryChunkStorage(ChunkStorage):
    """Chunks as fsspec ``MemoryFile`` objects, appended to in place."""

    appendable = True

    def __init__(self, root: str):
        self.fs = MemoryFileSystem()
        self.root = self.fs._strip_protocol(root).rstrip("/") or "/"
        super().__init__("memory://" + self.root.lstrip("/"))

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}".rstrip("/")

    # fsspec's MemoryFileSystem.info/ls scan the whole store; the store is its documented
    # backing dict, so direct look-ups keep per-append costs constant.
    def list_files(self, directory: str) -> dict[str, int]:
        base = self._abs(directory)
        # Names and file objects taken in one step: the listing is the store at one moment, as an
        # object store's is. Looking each size up by name afterwards met files that a truncation
        # beside it had deleted (``KeyError``), and skipping those could list neither the old
        # chunks nor the new ones. ``dict.copy`` makes no new tracked objects, so no garbage
        # collection (and no other thread) can run inside it; ``list(items())`` makes a tuple per
        # item and raised "dictionary changed size during iteration" when a collection ran there.
        files = [(path, f) for path, f in self.fs.store.copy().items() if path.startswith(base + "/")]
        return relative_paths(base, ((path, _size(f)) for path, f in files))

    def read(self, path: str, start: int, end: int) -> bytes:
        try:
            chunk = self.fs.store[self._abs(path)]
        except KeyError:
            raise FileNotFoundError(path) from None
        with _BYTES_GUARD:
            return bytes(chunk.getbuffer()[start:end])

    def exists(self, path: str) -> bool:
        return self._abs(path) in self.fs.store

    def size(self, path: str) -> int:
        try:
            return _size(self.fs.store[self._abs(path)])
        except KeyError:
            raise FileNotFoundError(path) from None

    def trimmed(self, path: str) -> bool:
        try:
            return getattr(self.fs.store[self._abs(path)], _TRIMMED, False)
        except KeyError:
            raise FileNotFoundError(path) from None

    def trim(self, path: str, size: int) -> None:
        """Nothing to cut (a memory chunk holds exactly what was appended): the chunk's file object
        is marked, so that writers know it was rolled past (a chunk deleted and made again is a
        new object, unmarked)."""
        chunk = self.fs.store.get(self._abs(path))
        if chunk is None:
            raise StorageError(f"chunk {path!r} is missing; cannot trim it")
        setattr(chunk, _TRIMMED, True)

    def create(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        with _directory_lock(target.rsplit("/", 1)[0]):
            if target in self.fs.store:
                raise ChunkExistsError(path)
            self.fs.pipe_file(target, bytes(data))
            # Made whole, never grown in place: as a trimmed chunk is (no zeros after a local
            # chunk made by ``create`` either), so a writer never takes it for the one to append to.
            setattr(self.fs.store[target], _TRIMMED, True)

    def put_marker(self, path: str) -> None:
        target = self._abs(path)
        if target not in self.fs.store:
            self.fs.pipe_file(target, b"")

    def delete(self, paths: list[str]) -> None:
        for path in paths:
            self.fs.store.pop(self._abs(path), None)

    def remove_directory(self, directory: str) -> None:
        base = self._abs(directory) + "/"
        for path in [p for p in self.fs.store if p.startswith(base)]:
            self.fs.store.pop(path, None)

    @contextlib.contextmanager
    def lock(self, directory: str) -> Iterator[None]:
        with _directory_lock(self._abs(directory)):
            yield

    def append(self, path: str, position: int, data: bytes, *, clear_to: int = 0) -> None:
        target = self._abs(path)
        chunk = self.fs.store.get(target)
        size = 0 if chunk is None else _size(chunk)
        if size != position:
            raise StorageError(f"chunk {path!r} holds {size} bytes; cannot append at position {position}")
        with self.fs.open(target, "ab") as chunk, _BYTES_GUARD:
            chunk.write(data)
