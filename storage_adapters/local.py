"""Local-disk chunk storage: chunks appended in place, an OS lock for writers, no commit record.

A chunk file holds exactly the bytes appended to it, then zeros: an append writes its bytes at the
end of its owner's chain of frames (storage_adapters/framing.py) and makes them durable with one
``fdatasync``. Nothing else records what is committed: the owner reads that from the frames, so a
chunk copied by any tool (``cp -r``, ``tar``, ``rsync``, ``zip``) is the same chunk.

A chunk is pre-written with zeros ahead of its end (``PREWRITE_BYTES`` at most at a time, in the
same call as the append that needs them), so that most appends overwrite allocated, initialised
blocks of a file whose size does not change: with ``sync=True`` their ``fdatasync`` flushes data
only, with no journal commit. Zeros after a chunk's end also say that no writer rolled past it. A chunk that stops growing is trimmed back to its end (``trim``).
docs/storage.md, "Crashes: the chain of frames", has the rules for torn writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import sys
import threading
import time
import weakref
from typing import Iterator

from fsspec.implementations.local import LocalFileSystem

from .base import ChunkStorage
from .errors import ChunkExistsError, CorruptDataError, OutcomeUnknownError, RetriesExhaustedError, StorageError, StorageFullError

LOCK_NAME = ".lock"
TEMP_PREFIX = ".tmp-"  #: files being created; never listed (a crash may leave one behind)
#: A temporary older than this (by its mtime) is left by a crashed ``create`` and is deleted by a
#: later ``create`` in its directory. A live create touches its file within one call; one stalled
#: longer than this (a stopped process) fails at its link with a ``StorageError``: nothing appears.
TEMP_MAX_AGE_SECONDS = 3600.0
#: A handle sweeps one directory's stale temporaries at most this often (a scan per create is waste).
TEMP_SWEEP_INTERVAL_SECONDS = 60.0
_SWEPT_MEMORY = 1024  #: directories whose last sweep a handle remembers (then it forgets them all)
#: Zeros are written ahead of a chunk's end as far as its end again, at least
#: ``MIN_PREWRITE_BYTES`` and at most ``PREWRITE_BYTES``, whenever an append comes within a quarter
#: of that of the pre-written end: a small segment stays small, and in a big chunk about one append
#: in every ``3/4 * PREWRITE_BYTES`` of appended bytes pays a journal commit for the file's new size.
PREWRITE_BYTES = 1 << 20
MIN_PREWRITE_BYTES = 16 << 10
_ZEROS = bytes(PREWRITE_BYTES)
#: Names the commit records of the formats before the chain of frames used (a sidecar file or
#: the directory beside a chunk whose record was an extended attribute): a store holding one is
#: refused (``list_files``), never read with its commit records ignored.
_OLD_COMMIT_RECORD = re.compile(r"\d{20}\.commit")


_libc = ctypes.CDLL(None, use_errno=True)
_SYNC_FILE_RANGE = getattr(_libc, "sync_file_range", None)
if _SYNC_FILE_RANGE is not None:
    _SYNC_FILE_RANGE.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_WRITE_AND_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER


def _write_out(fd: int, position: int, length: int) -> None:
    """Return once ``[position, position + length)`` of ``fd`` has been written to the device
    (no cache flush: the ``fdatasync`` that ends the append flushes it). Without
    ``sync_file_range`` (not Linux) nothing is done: pacing is an optimisation only."""
    if _SYNC_FILE_RANGE is None:
        return
    if _SYNC_FILE_RANGE(fd, position, length, _WRITE_AND_WAIT) != 0:
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ESPIPE):
            return
        raise OSError(code, os.strerror(code))


def _write_all(fd: int, data: bytes, position: int) -> None:
    written = os.pwrite(fd, data, position)
    if written == len(data):  # the usual case: one call, no view
        return
    view = memoryview(data)[written:]
    position += written
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


#: A durable append bigger than this (a B+tree merge writes megabytes) is written and written back
#: to the device a slice at a time (see ``_write_paced``).
PACED_WRITE_BYTES = 1 << 20


def _write_paced(fd: int, data: bytes, position: int) -> None:
    """Write ``data`` in slices of ``PACED_WRITE_BYTES``, each written back to the device before
    the next is written. Written in one go, megabytes of dirty pages sit in the device queue
    and every ``fsync`` of another file meanwhile (the write-ahead log's, on the path of an
    update) waits behind them: ext4 commits its journal only after the data it orders. Paced,
    such an ``fsync`` waits for one slice at most. Durability is unchanged: the append's own
    ``fdatasync`` still follows the whole range."""
    view = memoryview(data)
    for start in range(0, len(view), PACED_WRITE_BYTES):
        piece = view[start:start + PACED_WRITE_BYTES]
        _write_all(fd, piece, position + start)  # type: ignore[arg-type]
        _write_out(fd, position + start, len(piece))


_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def os_errors(operation: str, path: str, *, missing: bool = False) -> Iterator[None]:
    """Turn an ``OSError`` into a ``StorageError`` naming ``path`` (``StorageFullError`` for ENOSPC
    and quotas); with ``missing=True`` a ``FileNotFoundError`` passes through, as the interface says."""
    try:
        yield
    except OSError as exc:
        raise _storage_error(exc, operation, path, missing) from (None if isinstance(exc, FileNotFoundError) else exc)


def _storage_error(exc: OSError, operation: str, path: str, missing: bool = False) -> BaseException:
    """What ``os_errors`` raises for ``exc`` (for hot paths that catch it without a context manager)."""
    if isinstance(exc, FileNotFoundError):
        if missing:
            return exc
        return StorageError(f"local storage: {operation} of {path!r}: no such file or directory")
    if exc.errno in _FULL:
        return StorageFullError(f"local storage: {operation} of {path!r}: {exc.strerror}")
    return StorageError(f"local storage: {operation} of {path!r} failed: {exc}")


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Bumped in a forked child: its inherited descriptors share the parent's open files, and so its
# locks (``flock`` does not exclude holders of one open file from each other); it opens its own.
_forks = [0]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))

#: Lock files a storage keeps open (one per directory appended to); beyond it idle ones are closed.
MAX_OPEN_LOCKS = 64
#: Times a lock is retried when its lock file was replaced under it (the directory removed and made again).
MAX_LOCK_ATTEMPTS = 10


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _prewrite_step(end: int) -> int:
    """How many zeros an append pre-writes ahead of a chunk's end ``end`` when they run low: as
    far as the chunk's end again, ``MIN_PREWRITE_BYTES`` to ``PREWRITE_BYTES``."""
    return min(max(end, MIN_PREWRITE_BYTES), PREWRITE_BYTES)


def _fd_link(fd: int) -> str | None:
    """The path the kernel gives the file open on ``fd`` (Linux's ``/proc/self/fd``: it ends with
    `` (deleted)`` once the file has no name, and follows a rename), or ``None`` if unknown."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


class _DirectoryLock:
    """A directory's lock file kept open, and the descriptor of the chunk last appended to in it.

    ``mutex`` orders this process's threads (they share ``fd``, whose ``flock`` would not exclude
    them from each other); ``owner`` is the thread holding both; the chunk descriptor is used only
    by that thread. ``fd is None``: closed (evicted, or its file replaced): take a fresh one."""

    __slots__ = ("path", "fd", "identity", "mutex", "owner", "chunk_path", "chunk_fd", "chunk_identity",
                 "chunk_size", "chunk_link")

    def __init__(self, path: str, fd: int, identity: tuple[int, int]):
        self.path, self.fd, self.identity = path, fd, identity
        self.mutex = threading.Lock()
        self.owner: int | None = None
        self.chunk_path: str | None = None
        self.chunk_fd: int | None = None
        self.chunk_identity: tuple[int, int] | None = None
        #: the chunk file's size as the holder last saw it (this hold only: ``None`` to look again)
        self.chunk_size: int | None = None
        #: where the kernel says the chunk descriptor's file is (``_fd_link``), when it was opened
        self.chunk_link: str | None = None

    def close_chunk(self) -> None:
        fd, self.chunk_fd, self.chunk_path, self.chunk_identity = self.chunk_fd, None, None, None
        self.chunk_size = self.chunk_link = None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        self.close_chunk()
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _lock_file(entry: _DirectoryLock, directory: str) -> bool:
    """``flock`` the entry's file (its mutex held); False, and unlocked again, if its name no
    longer leads to that file."""
    try:  # (no context manager: this is on every append's path)
        fcntl.flock(entry.fd, fcntl.LOCK_EX)  # type: ignore[arg-type]
        try:
            same = _identity(os.stat(entry.path)) == entry.identity
        except FileNotFoundError:
            same = False
        except BaseException:
            fcntl.flock(entry.fd, fcntl.LOCK_UN)  # type: ignore[arg-type]
            raise
        if not same:
            fcntl.flock(entry.fd, fcntl.LOCK_UN)  # type: ignore[arg-type]
        return same
    except OSError as exc:
        raise _storage_error(exc, "lock", directory) from exc


class _Held:
    """``with storage.lock(directory):`` (a class, not a generator: it is on every append's path)."""

    __slots__ = ("storage", "directory", "entry")

    def __init__(self, storage: "LocalChunkStorage", directory: str):
        self.storage, self.directory, self.entry = storage, directory, None

    def __enter__(self) -> None:
        self.entry = self.storage._acquire(self.directory)

    def __exit__(self, *exc_info: object) -> None:
        self.storage._release(self.entry)


def _close_locks(locks: dict[str, _DirectoryLock]) -> None:
    """A storage was collected: close what it kept open (nothing can hold its locks any more)."""
    for entry in locks.values():
        entry.close()
    locks.clear()


class LocalChunkStorage(ChunkStorage):
    """Chunk files in a local directory tree; reads go through fsspec's local filesystem."""

    appendable = True
    torn_appends = True

    def __init__(self, root: str, *, sync: bool = True):
        self.root = os.path.abspath(root)
        super().__init__("file://" + self.root)
        self.fs = LocalFileSystem()
        # sync=False skips every fsync: writes survive a killed process (they are in the page
        # cache) but not a power loss or an OS crash, as with Kafka's default flush policy.
        self.sync = sync
        self._swept: dict[str, float] = {}  #: directory -> monotonic time of its last temporaries sweep
        # Open lock files (and the chunk each last appended to), by directory: see ``lock``.
        self._locks: dict[str, _DirectoryLock] = {}
        self._locks_guard = threading.Lock()
        self._locks_fork = _forks[0]
        self._finalizer = weakref.finalize(self, _close_locks, self._locks)

    def _abs(self, path: str) -> str:
        if path[:1] == "/":
            return os.path.join(self.root, path)
        return f"{self.root}/{path}"  # os.path.join's result for a relative path, without its checks

    def file_path(self, path: str) -> str:
        """The file behind the storage path ``path`` (for tools that act on the file itself)."""
        return self._abs(path)

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

        for dirpath, dirnames, filenames in os.walk(base, onerror=fail):
            for name in (*dirnames, *filenames):
                if _OLD_COMMIT_RECORD.fullmatch(name):
                    raise _old_format(os.path.join(dirpath, name))
            rel_dir = os.path.relpath(dirpath, base)
            for name in filenames:
                if name == LOCK_NAME or name.startswith(TEMP_PREFIX):
                    continue
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                with contextlib.suppress(FileNotFoundError):
                    found[rel] = os.stat(os.path.join(dirpath, name)).st_size

    def read(self, path: str, start: int, end: int) -> bytes:
        entry = self._held(path)
        if entry is not None:  # a writer's look at its chunk: through the descriptor kept with the lock
            try:
                fd, size = self._open_chunk(entry, path, create=False)
                end = min(end, size)
                return os.pread(fd, end - start, start) if end > start else b""
            except FileNotFoundError:
                raise
            except OSError as exc:
                entry.close_chunk()
                raise _storage_error(exc, "read", path) from exc
        with os_errors("read", path, missing=True), open(self._abs(path), "rb") as f:
            end = min(end, os.fstat(f.fileno()).st_size)  # a huge end must not become a huge buffer
            if end <= start:
                return b""
            f.seek(start)
            return f.read(end - start)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def size(self, path: str) -> int:
        with os_errors("size", path, missing=True):
            return os.stat(self._abs(path)).st_size

    # -- writing -------------------------------------------------------------------------------
    def create(self, path: str, data: bytes) -> None:
        """Create ``path`` holding ``data``, whole or not at all, even for readers in other processes.

        The bytes go to a temporary file in the same directory first (synced), which is then
        linked to the name: the link fails if the name exists (the exclusive create) and makes
        the whole file appear at once, so no reader (a verify beside a writer) ever sees a
        short file, and a crash leaves no partial file under the name, only a temporary one
        that listings skip and a later create in the directory deletes once it is older than
        ``TEMP_MAX_AGE_SECONDS``.
        """
        target = self._abs(path)
        directory = os.path.dirname(target)
        with os_errors("create", path):
            os.makedirs(directory, exist_ok=True)
            if os.path.lexists(target):
                raise ChunkExistsError(path)
            temporary = os.path.join(directory, f"{TEMP_PREFIX}{os.path.basename(target)}.{secrets.token_hex(6)}")
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                try:
                    _write_all(fd, data, 0)
                    if self.sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    os.link(temporary, target)
                except FileExistsError:
                    raise ChunkExistsError(path) from None
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            if self.sync:
                _fsync_directory(directory)
        self._sweep_temporaries(directory)

    def _sweep_temporaries(self, directory: str) -> None:
        """Delete temporaries of crashed creates in ``directory`` (older than ``TEMP_MAX_AGE_SECONDS``),
        at most once per ``TEMP_SWEEP_INTERVAL_SECONDS`` per handle. Best effort: after the create."""
        now = time.monotonic()
        if now - self._swept.get(directory, -TEMP_SWEEP_INTERVAL_SECONDS) < TEMP_SWEEP_INTERVAL_SECONDS:
            return
        if len(self._swept) >= _SWEPT_MEMORY:
            self._swept.clear()
        self._swept[directory] = now
        cutoff = time.time() - TEMP_MAX_AGE_SECONDS
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                if not entry.name.startswith(TEMP_PREFIX):
                    continue
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)

    def put_marker(self, path: str) -> None:
        target = self._abs(path)
        with os_errors("marker", path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
            if self.sync:
                _fsync_directory(os.path.dirname(target))

    def delete(self, paths: list[str]) -> None:
        for path in paths:
            self._let_go(path)
            with os_errors("delete", path), contextlib.suppress(FileNotFoundError):
                os.unlink(self._abs(path))

    def remove_directory(self, directory: str) -> None:
        with self._locks_guard:  # its lock files go: close the ones kept open that nobody holds
            prefix = directory.rstrip("/") + "/"
            for name in [n for n in self._locks if n == directory or n.startswith(prefix)]:
                self._close_if_idle(name)
        def refuse(_function, path, exc) -> None:
            if not isinstance(exc, FileNotFoundError):  # gone already: that is what was asked
                raise _storage_error(exc, "delete", os.path.relpath(path, self.root)) from exc

        target = self._abs(directory)
        if sys.version_info >= (3, 12):
            shutil.rmtree(target, onexc=refuse)
        else:
            shutil.rmtree(target, onerror=lambda function, path, info: refuse(function, path, info[1]))

    def _let_go(self, path: str) -> None:
        """Close the descriptor kept open on chunk ``path`` (being deleted), so that its space comes
        back now; unless another thread is appending through it (its next append notices)."""
        entry = self._locks.get(path.rpartition("/")[0])
        if entry is None or entry.chunk_path != path:
            return
        if entry.owner == threading.get_ident():
            entry.close_chunk()
        elif entry.mutex.acquire(blocking=False):
            try:
                entry.close_chunk()
            finally:
                entry.mutex.release()

    def lock(self, directory: str) -> contextlib.AbstractContextManager[None]:
        """Exclusive lock over the writers of ``directory``: an ``flock`` on its ``.lock`` file.

        The lock file stays open between appends (one descriptor per directory, at most
        ``MAX_OPEN_LOCKS`` of them), so a lock costs ``flock`` twice and one ``stat`` that checks
        the name still leads to the file locked. Threads of this process share that descriptor,
        and ``flock`` does not exclude holders of one descriptor from each other: a mutex
        orders them first."""
        return _Held(self, directory)

    def _acquire(self, directory: str) -> _DirectoryLock:
        """The directory's lock, held by this thread (``lock``)."""
        for _attempt in range(MAX_LOCK_ATTEMPTS):
            entry = self._lock_entry(directory)
            entry.mutex.acquire()
            try:
                if entry.fd is not None and _lock_file(entry, directory):
                    entry.owner, entry.chunk_size = threading.get_ident(), None
                    return entry
            except BaseException:  # (an interrupt between the flock and the return: let go of it too)
                if entry.fd is not None:
                    with contextlib.suppress(OSError):
                        fcntl.flock(entry.fd, fcntl.LOCK_UN)
                entry.mutex.release()
                raise
            # Closed meanwhile, or the directory was removed (and maybe made again) since the file
            # was opened: a lock on the old file excludes nobody who opens the new one.
            self._forget(directory, entry)
            entry.mutex.release()
        raise RetriesExhaustedError(f"local storage: lock of {directory!r}: its lock file kept being replaced "
                                    f"({MAX_LOCK_ATTEMPTS} tries)")

    @staticmethod
    def _release(entry: _DirectoryLock) -> None:
        entry.owner = entry.chunk_size = None  # other writers may change the chunk once the lock is let go
        try:
            fcntl.flock(entry.fd, fcntl.LOCK_UN)
        except OSError:
            entry.close()  # closing the only descriptor releases the lock too
        finally:
            entry.mutex.release()

    def lock_is_held(self, directory: str) -> bool:
        """A non-blocking ``flock`` of the directory's ``.lock`` file through a descriptor of its
        own (so it conflicts with this process's holders too), let go at once."""
        try:
            fd = os.open(os.path.join(self._abs(directory), LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False  # never locked
        except OSError as exc:
            raise _storage_error(exc, "lock", directory) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError as exc:
            raise _storage_error(exc, "lock", directory) from exc
        finally:
            os.close(fd)  # (closing the descriptor lets go of a lock it took)
        return False

    def _lock_entry(self, directory: str) -> _DirectoryLock:
        """The cached lock of ``directory``, opened (and the directory made) if need be."""
        locks = self._locks
        if self._locks_fork != _forks[0]:  # a forked child: its inherited descriptors share the
            locks = self._reset_locks()  # parent's locks, so they exclude nothing between the two
        entry = locks.get(directory)
        if entry is not None and entry.fd is not None:
            return entry
        base = self._abs(directory)
        path = os.path.join(base, LOCK_NAME)
        with os_errors("lock", directory):
            os.makedirs(base, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        with self._locks_guard:
            entry = locks.get(directory)
            if entry is not None and entry.fd is not None:  # another thread opened it meanwhile
                os.close(fd)
                return entry
            entry = locks[directory] = _DirectoryLock(path, fd, _identity(os.fstat(fd)))
            if len(locks) > MAX_OPEN_LOCKS:
                self._evict_locks()
        return entry

    def _forget(self, directory: str, entry: _DirectoryLock) -> None:
        """Close a lock (held by the caller's mutex) and drop it from the cache."""
        entry.close()
        with self._locks_guard:
            if self._locks.get(directory) is entry:
                del self._locks[directory]

    def _evict_locks(self) -> None:
        """Close cached locks nobody holds until the cache is back to its bound (under the guard)."""
        for directory in list(self._locks):
            if len(self._locks) <= MAX_OPEN_LOCKS // 2:
                break
            self._close_if_idle(directory)

    def _close_if_idle(self, directory: str) -> None:
        """Close and forget the cached lock of ``directory`` unless a thread holds it (under the guard)."""
        entry = self._locks[directory]
        if entry.mutex.acquire(blocking=False):
            try:
                entry.close()
                del self._locks[directory]
            finally:
                entry.mutex.release()

    def _reset_locks(self) -> dict[str, _DirectoryLock]:
        with self._locks_guard:
            for entry in self._locks.values():  # inherited: closing our copies releases nothing of the parent's
                entry.close()
            self._locks = {}
            self._locks_fork = _forks[0]
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close_locks, self._locks)
            return self._locks

    def close(self) -> None:
        """Close the cached lock files and chunk descriptors (locks held now are left alone)."""
        with self._locks_guard:
            self._evict_all()

    def _evict_all(self) -> None:
        for directory in list(self._locks):
            self._close_if_idle(directory)

    def append(self, path: str, position: int, data: bytes, *, clear_to: int = 0) -> None:
        """Write ``data`` at ``position`` of chunk ``path`` and make it durable (one ``fdatasync``);
        zero whatever the file holds from there up to ``clear_to`` (the bytes of a torn write) in
        the same write, and pre-write zeros ahead of the end when they run low (module doc).
        Call under ``lock``, with ``position`` the end of the owner's chain of frames. A new
        chunk (``position`` 0) is created, and its directory synced."""
        try:  # (no context manager: this is on every append's path)
            entry = self._held(path)
            if entry is not None:
                fd, size = self._open_chunk(entry, path, create=position == 0)
                try:
                    entry.chunk_size = self._write(fd, path, size, position, data, clear_to)
                except BaseException:
                    entry.close_chunk()  # whatever state it is in, the next append opens it afresh
                    raise
                return
            fd, size = self._open_unheld(path, position)
            try:
                self._write(fd, path, size, position, data, clear_to)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _storage_error(exc, "append", path) from exc

    def _held(self, path: str) -> _DirectoryLock | None:
        """The lock of ``path``'s directory if this thread holds it through this storage."""
        entry = self._locks.get(path.rpartition("/")[0])
        if entry is not None and entry.owner == threading.get_ident() and self._locks_fork == _forks[0]:
            return entry
        return None

    def _open_chunk(self, entry: _DirectoryLock, path: str, *, create: bool) -> tuple[int, int]:
        """``(descriptor, size)`` of chunk ``path`` through the held lock's cache: opened, or
        checked once per hold to be the file the name leads to now (a chunk deleted and made
        again is another file). The size is known from then on: only the holder writes."""
        fd, size = entry.chunk_fd, entry.chunk_size
        if fd is not None and entry.chunk_path == path:
            if size is not None:
                return fd, size
            # The descriptor's file still has the chunk's name (the kernel's path for it is the
            # one it had when opened: not " (deleted)", not moved): its size, by seeking. No
            # ``stat`` or ``fstat`` of the chunk on this path: one per append made each durable
            # one-key append 60-70 µs slower here (Linux 6.18, ext4; a ``stat`` of another file
            # costs nothing), as if querying the timestamps of a file that is being written made
            # its next write and sync do more.
            link = entry.chunk_link
            if link is not None and _fd_link(fd) == link:
                entry.chunk_size = size = os.lseek(fd, 0, os.SEEK_END)
                return fd, size
        target = f"{self.root}/{path}"
        try:
            st = os.stat(target)
        except FileNotFoundError:
            if not create:
                raise
            st = None
        if st is None or fd is None or entry.chunk_path != path or entry.chunk_identity != _identity(st):
            entry.close_chunk()
            fd, created = self._open_file(path, create=create)
            st = os.fstat(fd)
            entry.chunk_fd, entry.chunk_path, entry.chunk_identity = fd, path, _identity(st)
            entry.chunk_link = _fd_link(fd)
        entry.chunk_size = st.st_size
        return fd, st.st_size

    def _open_unheld(self, path: str, position: int) -> tuple[int, int]:
        fd, _created = self._open_file(path, create=position == 0)
        try:
            return fd, os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise

    def _open_file(self, path: str, *, create: bool) -> tuple[int, bool]:
        """Open chunk ``path`` for writing; a missing one is created (durably: its directory is
        synced) only if ``create``, else ``StorageError``."""
        target = f"{self.root}/{path}"
        try:
            return os.open(target, os.O_RDWR | os.O_CLOEXEC), False
        except FileNotFoundError:
            if not create:
                raise StorageError(f"chunk {path!r} is missing; only a new chunk (position 0) is created") from None
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if self.sync:
            try:
                _fsync_directory(os.path.dirname(target))
            except BaseException:
                os.close(fd)
                raise
        return fd, True

    def _write(self, fd: int, path: str, size: int, position: int, data: bytes, clear_to: int) -> int:
        """The write and sync of ``append``; return the file's size after it."""
        if size < position:
            raise CorruptDataError(f"chunk {path!r} holds {size} bytes, less than the {position} its frames "
                                   f"end at: cannot append there")
        end = position + len(data)
        zeros = max(clear_to - end, 0)  # a torn write's bytes past the new end, cleared with it
        step = _prewrite_step(end)
        if end + zeros > size - step // 4:
            zeros = max(zeros, step)  # zeros ahead, before the append's sync
        if zeros:  # first: the file is long enough before any of the append's bytes are in it
            _write_zeros(fd, end, zeros)
        if self.sync and len(data) > PACED_WRITE_BYTES and _SYNC_FILE_RANGE is not None:
            _write_paced(fd, data, position)
        else:
            _write_all(fd, data, position)
        if self.sync:
            try:
                os.fdatasync(fd)
            except OSError as exc:
                self._take_back(fd, path, position, len(data), exc)
        return max(size, end + zeros)

    @staticmethod
    def _take_back(fd: int, path: str, position: int, length: int, error: OSError) -> None:
        """After a failed ``fdatasync``: the bytes may or may not be on the device, and the page
        cache may have given up on them. Zero them, so that no reader takes them for committed
        frames, and raise: ``StorageError`` if that worked (the append did not happen),
        ``OutcomeUnknownError`` if not."""
        try:
            _write_zeros(fd, position, length)
        except OSError as again:
            raise OutcomeUnknownError(
                f"local storage: append to {path!r}: fdatasync failed ({error}) and zeroing the bytes "
                f"again failed too ({again}): the append may or may not have happened") from error
        raise _storage_error(error, "append (fdatasync)", path) from error

    def zeros_kept_after(self, end: int) -> int:
        """A quarter of the pre-write step at ``end``: a completed append leaves at least that many
        zeros after its end (``_write``), and an append writes the zeros ahead that it needs before
        its own bytes, so no crash leaves its bytes at the end of a file they made longer (a new
        chunk's too: its zeros are written first)."""
        return _prewrite_step(end) // 4

    def trim(self, path: str, size: int) -> None:
        """Cut the chunk ``path`` back to ``size`` bytes (its end: the zeros pre-written past it
        go), durably; call under ``lock`` when the chunk will not grow again (the next chunk
        starts at ``size``). A chunk no longer than ``size`` is left alone."""
        entry = self._held(path)
        if entry is not None and entry.chunk_path == path:
            entry.close_chunk()
        try:
            fd = os.open(self._abs(path), os.O_RDWR | os.O_CLOEXEC)
            try:
                if os.fstat(fd).st_size > size:
                    os.ftruncate(fd, size)
                    if self.sync:
                        os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _storage_error(exc, "trim", path) from exc


def _write_zeros(fd: int, position: int, length: int) -> None:
    while length > 0:
        piece = min(length, PREWRITE_BYTES)
        _write_all(fd, _ZEROS[:piece], position)
        position, length = position + piece, length - piece


def _old_format(path: str) -> CorruptDataError:
    return CorruptDataError(
        f"{path!r} is a commit record of a store written by an attrindex development version before "
        f"0.1.0's chain-of-frames format (commit records in extended attributes or sidecar files). "
        f"That format is not read and there is no migration: write the data again with this version")

