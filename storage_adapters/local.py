"""Local-disk chunk storage: chunks appended in place, an OS lock for writers, commit records for crashes.

Two formats of commit record exist; a chunk keeps the one it was created with (docs/storage.md,
"Crashes: the commit rule"):

* **v2 (default): one extended attribute** ``user.attrindex.commit`` on the chunk file itself:
  ``magic "AIc2" | count u8 | count committed sizes u64, newest first | crc32 u32``. An append
  writes its data, waits until the kernel has written it to the device (``sync_file_range``, no
  cache flush), replaces the attribute and ``fsync``s the file once. The attribute is journaled
  metadata, so it is never torn, and every journal commit that can make it durable starts with a
  cache flush issued after the data reached the device: a durable record implies durable data
  (ext4 and XFS). One fsync per append instead of two.
* **v1 (chunks written before, and filesystems without user xattrs): a sidecar ``NAME.commit``**,
  a sequence of 16-byte records ``magic "AIcm" | committed size u64 | crc32(magic + size) u32``:
  data fdatasync'd, then the record appended and fdatasync'd (two syncs).

A record whose size repeats the one before it is a seal (``seal``: no more appends; the next
chunk starts after it). A writer killed at any point leaves either the old record (its bytes are invisible and the next
append overwrites them) or the new one (the append is complete). A crash loses at most the newest
record, so whole appends found after the committed size mean lost records (damage): the layers
above, which can parse appends, detect that (``RollingSegment.uncommitted_tail``) instead of
answering from an older state, and their repair appends the same bytes again, which rewrites the
record.
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
import stat
import struct
import sys
import threading
import time
import weakref
import zlib
from typing import Iterator, NamedTuple

from fsspec.implementations.local import LocalFileSystem

from .base import ChunkStorage, sealed_chunk_error
from .errors import ChunkExistsError, CorruptDataError, InvalidInputError, StorageError, StorageFullError

COMMIT_SUFFIX = ".commit"
LOCK_NAME = ".lock"
_TEMP_PREFIX = ".tmp-"  #: files being created; never listed (a crash may leave one behind)
#: A temporary older than this (by its mtime) is left by a crashed ``create`` and is deleted by a
#: later ``create`` in its directory. A live create touches its file within one call; one stalled
#: longer than this (a stopped process) fails at its link with a ``StorageError``: nothing appears.
TEMP_MAX_AGE_SECONDS = 3600.0
#: A handle sweeps one directory's stale temporaries at most this often (a scan per create is waste).
TEMP_SWEEP_INTERVAL_SECONDS = 60.0
_SWEPT_MEMORY = 1024  #: directories whose last sweep a handle remembers (then it forgets them all)
COMMIT_XATTR = "user.attrindex.commit"
#: A file in a v2 chunk's fence directory, made once the chunk's first commit record is durable: a
#: chunk that has it but no record lost the record (a copy without xattrs: ``cp -r``, ``tar``
#: without ``--xattrs``), which must not pass for a chunk whose first writer died before committing.
COMMITTED_MARK = "committed"
#: How new chunks record their commits: ``"xattr"`` (v2, one fsync per append, the default where
#: the filesystem has user xattrs) or ``"sidecar"`` (v1, two fdatasyncs).
COMMIT_FORMATS = ("xattr", "sidecar")
_XATTR_MAGIC = b"AIc2"
_XATTR_HEAD = struct.Struct("<4sB")
#: Committed sizes a v2 record keeps, newest first: only the newest counts; the older ones let tests
#: and fault tools take records back the way a lost v1 record would (``drop_commit_records``).
XATTR_HISTORY = 4
_NO_XATTR = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)
_HAS_XATTR = hasattr(os, "getxattr")  # Linux only; elsewhere every chunk is v1
_FENCE = re.compile(r"\d{20}" + re.escape(COMMIT_SUFFIX))
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


def encode_commit_xattr(sizes: list[int]) -> bytes:
    """A v2 record holding ``sizes`` (committed sizes, newest first, at most ``XATTR_HISTORY``)."""
    body = _XATTR_HEAD.pack(_XATTR_MAGIC, len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)
    return body + zlib.crc32(body).to_bytes(4, "little")


def decode_commit_xattr(value: bytes) -> list[int] | None:
    """The committed sizes in a v2 record, newest first, or ``None`` if it is garbled."""
    if len(value) < _XATTR_HEAD.size + 4:
        return None
    magic, count = _XATTR_HEAD.unpack_from(value)
    if magic != _XATTR_MAGIC or not 1 <= count <= XATTR_HISTORY or len(value) != _XATTR_HEAD.size + 8 * count + 4:
        return None
    body, crc = value[:-4], int.from_bytes(value[-4:], "little")
    if zlib.crc32(body) != crc:
        return None
    return list(struct.unpack_from(f"<{count}Q", value, _XATTR_HEAD.size))


def _get_record(fd_or_path: int | str) -> bytes | None:
    """The raw v2 record of an open chunk (or a path), ``None`` if it has none."""
    if not _HAS_XATTR:
        return None
    try:
        return os.getxattr(fd_or_path, COMMIT_XATTR)
    except OSError as exc:
        if exc.errno in _NO_XATTR:
            return None
        raise


def _is_sealed(sizes: list[int]) -> bool:
    """Whether committed sizes (newest first) say the chunk is sealed: its newest commit added no
    bytes (appends always add some; ``seal`` repeats the size)."""
    return len(sizes) > 1 and sizes[0] == sizes[1]


def _xattr_committed(value: bytes) -> list[int]:
    # A garbled record counts as none: everything in the chunk is past the committed end, which the
    # layers above report as lost commit records if it holds two or more whole appends.
    return decode_commit_xattr(value) or [0]


_libc = ctypes.CDLL(None, use_errno=True)
_SYNC_FILE_RANGE = getattr(_libc, "sync_file_range", None)
if _SYNC_FILE_RANGE is not None:
    _SYNC_FILE_RANGE.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_WRITE_AND_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER


def _write_out(fd: int, position: int, length: int) -> None:
    """Return once ``[position, position + length)`` of ``fd`` has been written to the device.

    No cache flush: the ``fsync`` that makes the commit record durable flushes it (its journal
    commit starts with a flush issued after this write completed). Without ``sync_file_range``
    (not Linux) an ``fdatasync`` gives the same order at the price of a second sync.
    """
    if _SYNC_FILE_RANGE is None:
        os.fdatasync(fd)
        return
    if _SYNC_FILE_RANGE(fd, position, length, _WRITE_AND_WAIT) != 0:
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ESPIPE):
            os.fdatasync(fd)  # a filesystem or kernel without it: the same order, one sync more
            return
        raise OSError(code, os.strerror(code))


def _last_commit(fd: int) -> tuple[int, int, bool]:
    """``(slot for the next record, committed size, sealed)`` of an open commit file: sealed when
    the newest valid record repeats the size of the one before it (``seal``)."""
    slot = os.fstat(fd).st_size // COMMIT_RECORD_SIZE
    if slot >= 2:  # the usual case: the two newest records in one read
        pair = os.pread(fd, 2 * COMMIT_RECORD_SIZE, (slot - 2) * COMMIT_RECORD_SIZE)
        size = decode_commit_record(pair[COMMIT_RECORD_SIZE:])
        if size is not None:
            return slot, size, decode_commit_record(pair[:COMMIT_RECORD_SIZE]) == size
    while slot > 0:  # the newest is torn or garbled: the previous valid record wins
        size = decode_commit_record(os.pread(fd, COMMIT_RECORD_SIZE, (slot - 1) * COMMIT_RECORD_SIZE))
        if size is not None:
            before = os.pread(fd, COMMIT_RECORD_SIZE, (slot - 2) * COMMIT_RECORD_SIZE) if slot >= 2 else b""
            return slot, size, decode_commit_record(before) == size
        slot -= 1
    return 0, 0, False


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
    such an ``fsync`` waits for one slice at most. Durability is unchanged: the commit record
    still follows ``_write_out`` of the whole range."""
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
MAX_LOCK_REOPENS = 10


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _Seen(NamedTuple):
    size: int  #: bytes in the file
    record: bytes  #: its raw v2 record
    sizes: list[int]  #: the committed sizes in it, newest first


class _DirectoryLock:
    """A directory's lock file kept open, and the descriptor of the chunk last appended to in it.

    ``mutex`` orders this process's threads (they share ``fd``, whose ``flock`` would not exclude
    them from each other); ``owner`` is the thread holding both; the chunk descriptor is used only
    by that thread. ``fd is None``: closed (evicted, or its file replaced): take a fresh one."""

    __slots__ = ("path", "fd", "identity", "mutex", "owner", "chunk_path", "chunk_fd", "chunk_identity", "seen",
                 "last_record")

    def __init__(self, path: str, fd: int, identity: tuple[int, int]):
        self.path, self.fd, self.identity = path, fd, identity
        self.mutex = threading.Lock()
        self.owner: int | None = None
        self.chunk_path: str | None = None
        self.chunk_fd: int | None = None
        self.chunk_identity: tuple[int, int] | None = None
        self.seen: _Seen | None = None  #: the chunk as the holder last looked at it (this hold only)
        #: (record, its sizes) this storage last wrote to the chunk: a record read back equal to it
        #: (compared byte for byte) needs no decoding
        self.last_record: tuple[bytes, list[int]] | None = None

    def close_chunk(self) -> None:
        fd, self.chunk_fd, self.chunk_path, self.chunk_identity = self.chunk_fd, None, None, None
        self.seen = self.last_record = None
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

    def __init__(self, root: str, *, sync: bool = True, commit_format: str = "xattr"):
        if commit_format not in COMMIT_FORMATS:
            raise InvalidInputError(f"commit_format must be one of {COMMIT_FORMATS}, got {commit_format!r}")
        self.root = os.path.abspath(root)
        super().__init__("file://" + self.root)
        self.fs = LocalFileSystem()
        # sync=False skips every fsync: writes survive a killed process (they are in the page
        # cache) but not a power loss or an OS crash, as with Kafka's default flush policy.
        self.sync = sync
        # The format of chunks this handle creates; a chunk keeps its format for life. "xattr"
        # falls back to "sidecar" on a filesystem without user xattrs, and with sync=False.
        self.commit_format = commit_format
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
            dirnames[:] = [d for d in dirnames if not _FENCE.fullmatch(d)]  # v2 fences hold nothing
            rel_dir = os.path.relpath(dirpath, base)
            for name in filenames:
                if name.endswith(COMMIT_SUFFIX) or name == LOCK_NAME or name.startswith(_TEMP_PREFIX):
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
        return self._committed(path)[0]

    def committed(self, path: str) -> tuple[int, bool]:
        return self._committed(path)

    def _committed(self, path: str) -> tuple[int, bool]:
        entry = self._held(path)
        if entry is not None:  # a writer's catch-up: the look its append then uses
            try:
                seen = self._open_chunk(entry, path)
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise _storage_error(exc, "committed size", path) from exc
            if seen is not None:
                sizes = seen.sizes
                return sizes[0], _is_sealed(sizes)
        target = self._abs(path)
        try:  # (no context manager: on every append's path)
            record = _get_record(target)  # a missing chunk raises FileNotFoundError here
            if record is not None:
                sizes = _xattr_committed(record)
                return sizes[0], _is_sealed(sizes)
            return _sidecar_committed(target)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _storage_error(exc, "committed size", path) from exc

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
            temporary = os.path.join(directory, f"{_TEMP_PREFIX}{os.path.basename(target)}.{secrets.token_hex(6)}")
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
                if not entry.name.startswith(_TEMP_PREFIX):
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
            for victim in (self._abs(path), self._abs(path) + COMMIT_SUFFIX):
                with os_errors("delete", path), contextlib.suppress(FileNotFoundError):
                    try:
                        os.unlink(victim)
                    except IsADirectoryError:  # the fence of a v2 chunk
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(victim, COMMITTED_MARK))
                        os.rmdir(victim)

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
        for _attempt in range(MAX_LOCK_REOPENS):
            entry = self._lock_entry(directory)
            entry.mutex.acquire()
            try:
                if entry.fd is not None and _lock_file(entry, directory):
                    entry.owner, entry.seen = threading.get_ident(), None
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
        raise StorageError(f"local storage: lock of {directory!r}: its lock file kept being replaced "
                           f"({MAX_LOCK_REOPENS} tries)")

    @staticmethod
    def _release(entry: _DirectoryLock) -> None:
        entry.owner = entry.seen = None  # other writers may change the chunk once the lock is let go
        try:
            fcntl.flock(entry.fd, fcntl.LOCK_UN)
        except OSError:
            entry.close()  # closing the only descriptor releases the lock too
        finally:
            entry.mutex.release()

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

    def append(self, path: str, position: int, data: bytes) -> None:
        try:  # (no context manager: this is on every append's path)
            entry = self._held(path)
            if entry is None or not self._append_open(entry, path, position, data):
                self._append(path, position, data)
        except OSError as exc:
            raise _storage_error(exc, "append", path) from exc

    def _held(self, path: str) -> _DirectoryLock | None:
        """The lock of ``path``'s directory if this thread holds it through this storage."""
        entry = self._locks.get(path.rpartition("/")[0])
        if entry is not None and entry.owner == threading.get_ident() and self._locks_fork == _forks[0]:
            return entry
        return None

    def _open_chunk(self, entry: _DirectoryLock, path: str) -> _Seen | None:
        """What the held lock's descriptor sees of the chunk ``path``: its ``stat`` and v2 record
        (None for a chunk without one: v1, or new). Opened, or checked to be the file the name
        leads to now (one ``stat``, which also gives the size: a chunk deleted and made again is
        another file). Kept until the lock is released or the chunk is written: no writer but the
        holder changes it meanwhile, so the catch-up's look and the append share one.
        ``FileNotFoundError`` for a missing chunk."""
        seen = entry.seen
        if seen is not None and entry.chunk_path == path:
            return seen
        st = os.stat(f"{self.root}/{path}")
        fd = entry.chunk_fd
        if fd is None or entry.chunk_path != path or entry.chunk_identity != _identity(st):
            entry.close_chunk()
            fd = os.open(f"{self.root}/{path}", os.O_RDWR | os.O_CLOEXEC)
            st = os.fstat(fd)
            entry.chunk_fd, entry.chunk_path, entry.chunk_identity = fd, path, _identity(st)
        record = _get_record(fd)
        if record is None:
            return None
        last = entry.last_record  # the record this storage wrote last: already decoded
        sizes = last[1] if last is not None and last[0] == record else _xattr_committed(record)
        entry.seen = seen = _Seen(st.st_size, record, sizes)
        return seen

    def _append_open(self, entry: _DirectoryLock, path: str, position: int, data: bytes) -> bool:
        """``append`` to an existing v2 chunk through the descriptor kept open with its
        directory's lock (held by this thread); False (nothing done) for anything else: a new
        chunk, a v1 one, one without a record yet."""
        try:
            seen = self._open_chunk(entry, path)
            if seen is None:
                return False
            fd, size, sizes = entry.chunk_fd, seen.size, seen.sizes
            entry.seen = None  # written from here on: look again next time
            _check_committed(path, sizes[0], position)
            if _is_sealed(sizes):
                raise sealed_chunk_error(path)
            if size > position:
                _refuse_unprovable_overwrite(fd, path, seen.record, size, position, data)
            self._write_at(fd, path, size, position, data)
            sizes = [position + len(data), *sizes][:XATTR_HISTORY]
            entry.last_record = None
            record = self._commit_xattr(fd, seen.record, sizes, position, len(data))
            entry.last_record = (record, sizes)
        except FileNotFoundError:
            return False  # a new chunk
        except BaseException:
            entry.close_chunk()  # whatever state it is in, the next append opens the file afresh
            raise
        return True

    def _write_at(self, fd: int, path: str, size: int, position: int, data: bytes) -> None:
        """Write ``data`` at the committed end ``position`` of a chunk file of ``size`` bytes: cut
        a torn append's bytes first; a file shorter than what was committed is damage."""
        if size < position:
            raise CorruptDataError(f"chunk {path!r} holds {size} bytes but {position} were committed")
        if size > position:
            os.ftruncate(fd, position)  # bytes of a torn append, never committed
        if self.sync and len(data) > PACED_WRITE_BYTES and _SYNC_FILE_RANGE is not None:
            _write_paced(fd, data, position)
        else:
            _write_all(fd, data, position)

    def _append(self, path: str, position: int, data: bytes) -> None:
        target = self._abs(path)
        created = not os.path.exists(target)
        if created and position != 0:
            raise StorageError(f"chunk {path!r} is missing; cannot append at position {position}")
        fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            record, xattr = self._chunk_format(target, fd)
            if xattr:
                sizes = _xattr_committed(record) if record is not None else [0]
                _check_committed(path, sizes[0], position)
                if _is_sealed(sizes):
                    raise sealed_chunk_error(path)
            size = os.fstat(fd).st_size
            if xattr and size > position:
                _refuse_unprovable_overwrite(fd, path, record, size, position, data)
            self._write_at(fd, path, size, position, data)
            if xattr:
                self._commit_xattr(fd, record, [position + len(data), *sizes][:XATTR_HISTORY], position, len(data))
                if record is None and self.sync:
                    _mark_committed(target)
            elif self.sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        if not xattr:
            self._commit(path, position, position + len(data))
        if created and self.sync:
            _fsync_directory(os.path.dirname(target))

    def _chunk_format(self, target: str, fd: int) -> tuple[bytes | None, bool]:
        """``(v2 record or None, whether the chunk uses v2)``; a chunk with neither record nor
        sidecar (new, or its first writer died) takes this handle's ``commit_format``."""
        supported = _HAS_XATTR
        try:
            if supported:
                return os.getxattr(fd, COMMIT_XATTR), True
        except OSError as exc:
            if exc.errno not in _NO_XATTR:
                raise
            supported = exc.errno == errno.ENODATA
        try:
            mode = os.stat(target + COMMIT_SUFFIX).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None:
            if stat.S_ISDIR(mode):  # never overwrite a committed chunk that lost its record
                return _refuse_lost_record(target), True
            return None, False  # a v1 sidecar file
        if self.commit_format != "xattr" or not supported or not self.sync:
            # Without syncs v2 saves nothing, and its record (metadata, committed by the journal
            # every few seconds) would run ahead of data that the page cache writes back later.
            return None, False
        # v2 from here: a directory where v1 code looks for the sidecar makes that code fail
        # (reading it is EISDIR) instead of taking the chunk for an empty one and overwriting it.
        with contextlib.suppress(FileExistsError):
            os.mkdir(target + COMMIT_SUFFIX)
        return None, True

    def _commit_xattr(self, fd: int, old: bytes | None, sizes: list[int], position: int, length: int) -> bytes:
        """Make the data durable and then the v2 record saying so, with one fsync (see the module doc);
        return the record."""
        if self.sync and length:
            _write_out(fd, position, length)  # before the record: any journal commit carrying it flushes the data
        record = encode_commit_xattr(sizes)
        os.setxattr(fd, COMMIT_XATTR, record)
        if not self.sync:
            return record
        try:
            os.fsync(fd)  # fsync, not fdatasync: an xattr is not needed to read the data, fdatasync may skip it
        except OSError:
            # Not durable: take the record back so no reader counts the append as committed.
            with contextlib.suppress(OSError):
                if old is None:
                    os.removexattr(fd, COMMIT_XATTR)
                else:
                    os.setxattr(fd, COMMIT_XATTR, old)
            raise
        return record

    def seal(self, path: str, size: int) -> None:
        """Seal the chunk ``path`` (``ChunkStorage.seal``): a commit record repeating its committed
        size, durable as an append's is (the roll creates the next chunk only after it)."""
        target = self._abs(path)
        try:
            fd = os.open(target, os.O_RDWR | os.O_CLOEXEC)
            try:
                record, xattr = self._chunk_format(target, fd)
                if xattr:
                    sizes = _xattr_committed(record) if record is not None else [0]
                    _check_committed(path, sizes[0], size)
                    if not _is_sealed(sizes):
                        self._commit_xattr(fd, record, [size, *sizes][:XATTR_HISTORY], size, 0)
            finally:
                os.close(fd)
            if not xattr:
                self._commit(path, size, size)
        except OSError as exc:
            raise _storage_error(exc, "seal", path) from exc
        finally:
            entry = self._held(path)
            if entry is not None and entry.chunk_path == path:
                entry.seen = None  # its record changed: the next look reads it again

    def _commit(self, path: str, previous: int, size: int) -> None:
        """Append the v1 record of ``size`` after the newest valid one, which must say ``previous``
        (``size == previous``: the seal; a sealed chunk takes no other)."""
        fd = os.open(self._abs(path) + COMMIT_SUFFIX, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            slot, committed, sealed = _last_commit(fd)
            _check_committed(path, committed, previous)
            if sealed:
                if size == previous:
                    return  # sealed already
                raise sealed_chunk_error(path)
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


def _check_committed(path: str, committed: int, expected: int) -> None:
    if committed != expected:
        raise StorageError(
            f"chunk {path!r}: committed size is {committed}, expected {expected} "
            "(a writer appended without holding the segment lock?)"
        )


def _refuse_lost_record(target: str) -> bytes | None:
    """For the v2 chunk ``target`` found without a record: raise if it was committed once (its
    record was lost); return the record if one appeared meanwhile (a first commit racing this
    look: the mark is made after the record, so a marked chunk shows its record if it has one)."""
    if os.path.exists(os.path.join(target + COMMIT_SUFFIX, COMMITTED_MARK)):
        record = _get_record(target)
        if record is not None:
            return record
        raise CorruptDataError(
            f"chunk {target!r} was committed but has no commit record (extended attribute {COMMIT_XATTR}): "
            f"it was copied or restored without extended attributes (cp -r, tar without --xattrs). Its "
            f"committed length is unknown, so it is refused rather than read as empty; copy the store again "
            f"from the original with xattrs (cp -a, rsync -aX, tar --xattrs), or, with no original left, "
            f"run storage_adapters.local.restore_commit_records on the copy, then verify and repair "
            f"(docs/storage.md, 'Copying a store')")
    return None


def _refuse_unprovable_overwrite(fd: int, path: str, record: bytes | None, size: int, position: int,
                                 data: bytes) -> None:
    """Before a v2 chunk's bytes past the committed end ``position`` are overwritten: they are a
    torn append only if its record is intact. A damaged record proves no end at all (it reads as
    0), so the bytes there may be acknowledged appends: writing other bytes over them is refused;
    the same bytes (a repair committing them again) are not."""
    if record is None or decode_commit_xattr(record) is not None:
        return
    stored = os.pread(fd, min(size - position, len(data)), position)
    if stored != data[:len(stored)]:
        raise CorruptDataError(
            f"chunk {path!r}: its commit record is damaged, so the {size - position} bytes stored after byte "
            f"{position} may be acknowledged appends; refusing to write other bytes over them. Verify and "
            f"repair the segment (attrindex segment verify / repair)")


def _mark_committed(target: str) -> None:
    """After a v2 chunk's first durable commit: leave ``COMMITTED_MARK`` in its fence (best effort,
    after the append is durable; a crash before it leaves the chunk as ambiguous as before)."""
    with contextlib.suppress(OSError):
        os.close(os.open(os.path.join(target + COMMIT_SUFFIX, COMMITTED_MARK), os.O_WRONLY | os.O_CREAT, 0o644))


def _sidecar_committed(target: str) -> tuple[int, bool]:
    """``(committed size, sealed)`` of a chunk without a v2 record: from its v1 sidecar's newest
    records, else ``(0, False)``."""
    try:
        fd = os.open(target + COMMIT_SUFFIX, os.O_RDONLY)
    except FileNotFoundError:
        if not os.path.exists(target):
            raise
        return 0, False  # created by a writer that died before its first commit
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            record = _refuse_lost_record(target)
            if record is not None:
                sizes = _xattr_committed(record)
                return sizes[0], _is_sealed(sizes)
            return 0, False  # the fence of a v2 chunk whose first writer died (or is still writing) before committing
        return _last_commit(fd)[1:]
    finally:
        os.close(fd)


def restore_commit_records(root: str) -> list[str]:
    """Recovery for a store copied without extended attributes, when the original is gone: give
    every committed v2 chunk under ``root`` that lost its record one saying its whole file is
    committed; return their paths. Whatever the file holds past its true committed end (a torn
    append of a crashed writer) then counts as committed, and the layers above check it: run
    ``verify`` and ``repair`` on each segment and index after this (they cut a damaged tail).
    Stop every writer first."""
    restored = []
    for dirpath, dirnames, _files in os.walk(os.path.abspath(root)):
        for fence in [d for d in dirnames if _FENCE.fullmatch(d)]:
            chunk = os.path.join(dirpath, fence[:-len(COMMIT_SUFFIX)])
            if os.path.isfile(chunk) and _get_record(chunk) is None and \
                    os.path.exists(os.path.join(dirpath, fence, COMMITTED_MARK)):
                fd = os.open(chunk, os.O_RDONLY)
                try:
                    os.setxattr(fd, COMMIT_XATTR, encode_commit_xattr([os.fstat(fd).st_size]))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                restored.append(chunk)
        dirnames[:] = [d for d in dirnames if not _FENCE.fullmatch(d)]
    return sorted(restored)


# -- fault tools: damage commit records the way a lost or garbled record would ------------------
def read_commit_record(chunk: str) -> bytes | None:
    """The raw v2 record of the chunk file ``chunk`` (an absolute path), ``None`` if it has none."""
    return _get_record(chunk)


def write_commit_record(chunk: str, value: bytes) -> None:
    """Replace the raw v2 record of ``chunk`` (no sync): for tests and the corruption fuzz."""
    os.setxattr(chunk, COMMIT_XATTR, value)


def drop_commit_records(chunk: str, records: int) -> None:
    """Lose the newest ``records`` commit records of ``chunk`` (v1: cut them off the sidecar; v2:
    take them out of the record's history), as damage would; at least one must remain."""
    value = read_commit_record(chunk)
    if value is None:
        size = os.path.getsize(chunk + COMMIT_SUFFIX)
        if size < COMMIT_RECORD_SIZE * (records + 1):
            raise ValueError(f"{chunk}: fewer than {records + 1} commit records")
        os.truncate(chunk + COMMIT_SUFFIX, size - COMMIT_RECORD_SIZE * records)
        return
    sizes = decode_commit_xattr(value) or []
    if len(sizes) < records + 1:
        raise ValueError(f"{chunk}: fewer than {records + 1} commit sizes in its record")
    write_commit_record(chunk, encode_commit_xattr(sizes[records:]))


def garble_commit_records(chunk: str, records: int) -> None:
    """Zero the newest ``records`` commit records of ``chunk`` (v2: the one record, whole)."""
    value = read_commit_record(chunk)
    if value is not None:
        write_commit_record(chunk, bytes(len(value)))
        return
    size = os.path.getsize(chunk + COMMIT_SUFFIX)
    with open(chunk + COMMIT_SUFFIX, "r+b") as f:
        f.seek(size - COMMIT_RECORD_SIZE * records)
        f.write(bytes(COMMIT_RECORD_SIZE * records))
