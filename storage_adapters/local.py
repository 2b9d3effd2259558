"""Local-disk chunk storage: chunks appended in place, an OS lock for writers, commit records for crashes.

A chunk ``NAME`` has a sidecar ``NAME.commit``: a sequence of 16-byte commit records, each
``magic "AIcm" | committed size u64 | crc32(magic + size) u32`` (little-endian). An append writes the
data at the committed size, fdatasyncs it, then appends a commit record and fdatasyncs that. A
writer killed at any point leaves either the old record (its bytes are invisible and the next
append overwrites them) or the new one (the append is complete). A torn or garbled last record is
skipped: the newest valid record wins. A crash tears at most the newest record, so whole appends
found after the committed size mean lost commit records (damage): the layers above, which can
parse appends, detect that (``RollingSegment.uncommitted_tail``) instead of answering from an
older state, and their repair appends the same bytes again, which rewrites the record.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import struct
import zlib
from typing import Iterator

from fsspec.implementations.local import LocalFileSystem

from .base import ChunkStorage
from .errors import ChunkExistsError, CorruptDataError, StorageError, StorageFullError

COMMIT_SUFFIX = ".commit"
LOCK_NAME = ".lock"
_COMMIT_MAGIC = b"AIcm"
_COMMIT_BODY = struct.Struct("<4sQ")
COMMIT_RECORD_SIZE = _COMMIT_BODY.size + 4


def encode_commit_record(size: int) -> bytes:
    body = _COMMIT_BODY.pack(_COMMIT_MAGIC, size)
    return body + zlib.crc32(body).to_bytes(4, "little")


def decode_commit_record(record: bytes) -> int | None:
    """The committed size in a record, or ``None`` if the record is torn or garbled."""
    if len(record) != COMMIT_RECORD_SIZE:
        return None
    body, crc = record[:-4], int.from_bytes(record[-4:], "little")
    magic, size = _COMMIT_BODY.unpack(body)
    if magic != _COMMIT_MAGIC or zlib.crc32(body) != crc:
        return None
    return size


def _last_commit(fd: int) -> tuple[int, int]:
    """``(slot for the next record, committed size)`` of an open commit file."""
    slot = os.fstat(fd).st_size // COMMIT_RECORD_SIZE
    while slot > 0:
        size = decode_commit_record(os.pread(fd, COMMIT_RECORD_SIZE, (slot - 1) * COMMIT_RECORD_SIZE))
        if size is not None:
            return slot, size
        slot -= 1
    return 0, 0


def _write_all(fd: int, data: bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def os_errors(operation: str, path: str, *, missing: bool = False) -> Iterator[None]:
    """Turn an ``OSError`` into a ``StorageError`` naming ``path`` (``StorageFullError`` for ENOSPC
    and quotas); with ``missing=True`` a ``FileNotFoundError`` passes through, as the interface says."""
    try:
        yield
    except FileNotFoundError:
        if missing:
            raise
        raise StorageError(f"local storage: {operation} of {path!r}: no such file or directory") from None
    except OSError as exc:
        if exc.errno in _FULL:
            raise StorageFullError(f"local storage: {operation} of {path!r}: {exc.strerror}") from exc
        raise StorageError(f"local storage: {operation} of {path!r} failed: {exc}") from exc


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalChunkStorage(ChunkStorage):
    """Chunk files in a local directory tree; reads go through fsspec's local filesystem."""

    appendable = True

    def __init__(self, root: str, *, sync: bool = True):
        self.root = os.path.abspath(root)
        super().__init__("file://" + self.root)
        self.fs = LocalFileSystem()
        # sync=False skips every fsync: writes survive a killed process (they are in the page
        # cache) but not a power loss or an OS crash, as with Kafka's default flush policy.
        self.sync = sync

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, path)

    # -- reading -------------------------------------------------------------------------------
    def list_files(self, directory: str) -> dict[str, int]:
        base = self._abs(directory)
        found: dict[str, int] = {}
        with os_errors("listing", directory):
            self._walk(base, found)
        return found

    @staticmethod
    def _walk(base: str, found: dict[str, int]) -> None:
        def fail(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError):  # a directory deleted meanwhile is empty
                raise exc

        for dirpath, _dirnames, filenames in os.walk(base, onerror=fail):
            rel_dir = os.path.relpath(dirpath, base)
            for name in filenames:
                if name.endswith(COMMIT_SUFFIX) or name == LOCK_NAME:
                    continue
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                with contextlib.suppress(FileNotFoundError):
                    found[rel] = os.stat(os.path.join(dirpath, name)).st_size

    def read(self, path: str, start: int, end: int) -> bytes:
        with os_errors("read", path, missing=True), open(self._abs(path), "rb") as f:
            end = min(end, os.fstat(f.fileno()).st_size)  # a huge end must not become a huge buffer
            if end <= start:
                return b""
            f.seek(start)
            return f.read(end - start)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def committed_size(self, path: str) -> int:
        target = self._abs(path)
        with os_errors("committed size", path, missing=True):
            try:
                fd = os.open(target + COMMIT_SUFFIX, os.O_RDONLY)
            except FileNotFoundError:
                if not os.path.exists(target):
                    raise
                return 0  # created by a writer that died before its first commit
            try:
                return _last_commit(fd)[1]
            finally:
                os.close(fd)

    # -- writing -------------------------------------------------------------------------------
    def create(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        with os_errors("create", path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raise ChunkExistsError(path) from None
            try:
                try:
                    _write_all(fd, data, 0)
                    if self.sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if self.sync:
                    _fsync_directory(os.path.dirname(target))
            except OSError:
                # A whole file or none: a partial one would read as a short or torn object.
                with contextlib.suppress(OSError):
                    os.unlink(target)
                raise

    def put_marker(self, path: str) -> None:
        target = self._abs(path)
        with os_errors("marker", path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
            if self.sync:
                _fsync_directory(os.path.dirname(target))

    def delete(self, paths: list[str]) -> None:
        for path in paths:
            for victim in (self._abs(path), self._abs(path) + COMMIT_SUFFIX):
                with os_errors("delete", path), contextlib.suppress(FileNotFoundError):
                    os.unlink(victim)

    def remove_directory(self, directory: str) -> None:
        shutil.rmtree(self._abs(directory), ignore_errors=True)

    @contextlib.contextmanager
    def lock(self, directory: str) -> Iterator[None]:
        base = self._abs(directory)
        with os_errors("lock", directory):
            os.makedirs(base, exist_ok=True)
            fd = os.open(os.path.join(base, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with os_errors("lock", directory):
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def append(self, path: str, position: int, data: bytes) -> None:
        with os_errors("append", path):
            self._append(path, position, data)

    def _append(self, path: str, position: int, data: bytes) -> None:
        target = self._abs(path)
        created = not os.path.exists(target)
        if created and position != 0:
            raise StorageError(f"chunk {path!r} is missing; cannot append at position {position}")
        fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size < position:
                raise CorruptDataError(f"chunk {path!r} holds {size} bytes but {position} were committed")
            if size > position:
                os.ftruncate(fd, position)  # bytes of a torn append, never committed
            _write_all(fd, data, position)
            if self.sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        self._commit(path, position, position + len(data))
        if created and self.sync:
            _fsync_directory(os.path.dirname(target))

    def _commit(self, path: str, previous: int, size: int) -> None:
        fd = os.open(self._abs(path) + COMMIT_SUFFIX, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            slot, committed = _last_commit(fd)
            if committed != previous:
                raise StorageError(
                    f"chunk {path!r}: committed size is {committed}, expected {previous} "
                    "(a writer appended without holding the segment lock?)"
                )
            offset = slot * COMMIT_RECORD_SIZE
            try:
                _write_all(fd, encode_commit_record(size), offset)
                if os.fstat(fd).st_size > offset + COMMIT_RECORD_SIZE:
                    os.ftruncate(fd, offset + COMMIT_RECORD_SIZE)
                if self.sync:
                    os.fdatasync(fd)
            except OSError:
                # Not durable: take the record back so no reader counts the append as committed.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, offset)
                raise
        finally:
            os.close(fd)
