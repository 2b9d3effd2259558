"""The merge of tier 1 into the B+tree, hosted in a worker process (local disk only).

Why a process: the merge is pure-Python CPU work (about 1 s per 250k keys). In the writer's
process it holds the GIL, and every ``update`` returning from a ``write``/``fsync`` waits for it
up to the switch interval, many times per call: p99 of ``update`` rose from ~5 ms to 50-100 ms
while a merge ran. In a worker process the merge has its own interpreter and the writer's merge
thread only waits on a pipe.

The log is the source of truth, so the parent sends no data: only the log position ``at`` that
the frozen overlay covers. The worker refreshes its own view of the tree, replays the log from
the tree's checkpoint up to ``at`` into an overlay (the same replay an opening handle does) and
merges it with ``segment_merge.merge_overlay``, the one merge function the in-thread host uses
too; then it answers with the tree's checkpoint. The parent re-reads the tree's footer
(``TreeIndex.refresh``: pages are immutable at their offsets, so its page cache stays valid; the
value cache is dropped because the tree changed under it) and drops the frozen overlay.

Failure rules (docs/design.md, "Write path"):

* the worker dies or hangs mid-merge: the parent kills it, reads the tree, and if the tree covers
  ``at`` the merge landed (only its answer was lost); otherwise the merge failed and is retried
  by the background loop (``stats().merge_error`` says why). A durable write is never failed;
  pages a killed worker half-wrote are an uncommitted tail, as after any crash.
* the parent dies: the worker notices within ``_PARENT_POLL_SECONDS`` (its parent changes) or at
  once when idle (its request pipe ends), and exits without finishing. Even a worker that did
  finish would be harmless: tree updates are compare-and-append with checkpoints that only move
  forward, so a new opener's merge and a stale worker's merge cannot undo each other.
* only the parent truncates the log, after its own view of the tree covers the cut.

The worker is started with ``subprocess`` (``python -c``, calling ``main``), not
``multiprocessing``: spawn would re-import the user's ``__main__``, and a script without a main
guard would run again in the child (fork is no option in a process with threads).
"""

from __future__ import annotations

import logging
import os
import pickle
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from storage_adapters.local import LocalChunkStorage

from .errors import StorageError

MERGE_WORKER_TIMEOUT = 600.0  #: the longest the parent waits for one merge's answer before killing the worker
_START_TIMEOUT = 60.0  #: the longest a new worker may take to say it is ready
#: The worker writes tree pages back in slices this big (local storage's ``PACED_WRITE_BYTES``, in
#: the worker's process only): a WAL ``fsync`` of the writer waits behind at most one slice.
WORKER_PACED_WRITE_BYTES = 256 << 10
MAX_FAILED_STARTS = 3  #: workers in a row that failed to start before merges stay in the writer's process
_PARENT_POLL_SECONDS = 0.1  #: how often a worker looks whether its parent still lives
_FRAME = struct.Struct(">I")
# (not ``-m attrindex.merge_worker``: the package imports this module before runpy would run it)
_WORKER_MAIN = "import sys; from attrindex.merge_worker import main; sys.exit(main(sys.argv[1:]))"

_log = logging.getLogger("attrindex.segment")


class MergeWorkerError(StorageError):
    """A merge in the worker process failed, or the worker died or hung (it is restarted for the
    next merge). The updates stay in tier 1 and in the log; the background merge retries."""


class WorkerStartError(MergeWorkerError):
    """``MAX_FAILED_STARTS`` worker processes in a row failed to start (or to open the index)."""


def worker_storage(storage: object) -> LocalChunkStorage | None:
    """The local storage a worker can open again by itself, or None (memory, object stores and
    wrapped storages merge in the writer's process)."""
    return storage if type(storage) is LocalChunkStorage else None


class MergeWorker:
    """The parent's handle on one worker process (started on first use, restarted after a failure).

    Not thread-safe: the segment calls it with its ``_merge_mutex`` held."""

    def __init__(self, storage: LocalChunkStorage, wal_name: str, tree_name: str, options: Any):
        self._spec = dict(root=storage.root, sync=storage.sync, commit_format=storage.commit_format,
                          wal_name=wal_name, tree_name=tree_name, log_rolling_size=options.log_rolling_size,
                          index_interval_bytes=options.index_interval_bytes,
                          attribute_options=dict(options.attribute_options))
        try:  # (a compaction policy object, say, may not cross to another process)
            pickle.dumps(self._spec)
        except Exception as exc:  # noqa: BLE001 - any reason is one: this index cannot use a worker
            raise WorkerStartError(f"the index's options cannot be sent to a merge worker: {exc}") from exc
        self._process: subprocess.Popen | None = None
        self.starts = 0  #: worker processes started so far
        self.peak_rss = 0  #: the largest peak resident set size a worker reported (bytes)
        self._failed_starts = 0  #: in a row
        self.fault: str | None = None  #: tests only: "exit_before_commit", "exit_after_commit" or "hang"

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None when none runs)."""
        return None if self._process is None else self._process.pid

    def merge(self, at: int, timeout: float | None = None) -> int:
        """Have the worker merge the log up to byte ``at`` into the tree; return what it reports.
        ``MergeWorkerError`` if it fails, dies or does not answer in ``timeout`` seconds (default
        ``MERGE_WORKER_TIMEOUT``; then it is killed)."""
        timeout = MERGE_WORKER_TIMEOUT if timeout is None else timeout
        process = self._running()
        try:
            _send(process.stdin, ("merge", at, self.fault))
            answer = _receive(process.stdout, time.monotonic() + timeout)
        except (OSError, EOFError, ValueError, pickle.UnpicklingError, TimeoutError) as exc:
            code = self._kill()
            raise MergeWorkerError(f"the merge worker (exit status {code}) gave no answer for the merge up to "
                                   f"log byte {at}: {type(exc).__name__}: {exc}") from None
        if answer[0] != "ok":
            raise MergeWorkerError(f"the merge worker failed to merge up to log byte {at}: {answer[1]}")
        checkpoint, peak_rss = answer[1]
        self.peak_rss = max(self.peak_rss, peak_rss)
        return checkpoint

    def _running(self) -> subprocess.Popen:
        process = self._process
        if process is not None and process.poll() is None:
            return process
        self._kill()
        try:
            process = self._start()
        except MergeWorkerError as exc:
            self._failed_starts += 1
            if self._failed_starts >= MAX_FAILED_STARTS:
                raise WorkerStartError(f"{self._failed_starts} merge workers in a row failed to start; the last: "
                                       f"{exc}") from exc
            raise
        self._failed_starts = 0
        return process

    def _start(self) -> subprocess.Popen:
        """A new worker process, ready (it opened the index), or ``MergeWorkerError``."""
        if not sys.executable:
            raise MergeWorkerError("no Python executable to start the merge worker with (sys.executable is empty)")
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory holding attrindex
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            process = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, str(os.getpid())],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as exc:
            raise MergeWorkerError(f"the merge worker could not be started: {exc}") from exc
        self._process, self.starts = process, self.starts + 1
        try:
            _send(process.stdin, ("open", self._spec))
            answer = _receive(process.stdout, time.monotonic() + _START_TIMEOUT)
        except (OSError, EOFError, ValueError, pickle.UnpicklingError, TimeoutError) as exc:
            code = self._kill()
            raise MergeWorkerError(f"the merge worker did not start (exit status {code}): {exc}") from None
        if answer[0] != "ok":
            self._kill()
            raise MergeWorkerError(f"the merge worker could not open the index: {answer[1]}")
        return process

    def _kill(self) -> int | None:
        """Stop the worker at once (it may be mid-merge: what it half-wrote is never referenced)."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.kill()
        try:
            return process.wait(timeout=10)
        finally:
            for pipe in (process.stdin, process.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass

    def close(self) -> None:
        """Ask the worker to exit (it is idle: the caller holds the merge mutex); kill it if it lingers."""
        process = self._process
        if process is None:
            return
        try:
            _send(process.stdin, ("stop",))
            process.wait(timeout=5)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self._kill()


# -- framing: a 4-byte length, then a pickle (both ends are this module; nothing else is read) ---
def _send(pipe, message: tuple) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(_FRAME.pack(len(data)) + data)
    pipe.flush()


def _receive(pipe, deadline: float | None) -> tuple:
    size = _FRAME.unpack(_read_exact(pipe, _FRAME.size, deadline))[0]
    return pickle.loads(_read_exact(pipe, size, deadline))


def _read_exact(pipe, n: int, deadline: float | None) -> bytes:
    fd, parts, got = pipe.fileno(), [], 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError(f"no answer within the timeout ({got} of {n} bytes)")
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError("the pipe ended (the other process exited)")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


# -- the worker process ------------------------------------------------------------------------
class _Host:
    """The worker's side: the storage, its own tree handle and log view, opened once."""

    def __init__(self, spec: dict):
        from storage_adapters import local

        from .log.segment_log import SegmentLog
        from .tree_index import TreeIndex

        local.PACED_WRITE_BYTES = WORKER_PACED_WRITE_BYTES  # this process writes nothing but merges

        self.storage = LocalChunkStorage(spec["root"], sync=spec["sync"], commit_format=spec["commit_format"])
        options = dict(spec["attribute_options"], value_cache_entries=0)  # the parent serves the reads
        self.tree = TreeIndex(self.storage, spec["tree_name"], **options)
        self.log = SegmentLog(self.storage, spec["wal_name"], rolling_size=spec["log_rolling_size"],
                              index_interval_bytes=spec["index_interval_bytes"])

    def merge(self, at: int, fault: str | None) -> int:
        from .segment_merge import merge_overlay

        self.tree.refresh()
        covered = self.tree.checkpoint or 0
        if covered >= at:
            return covered  # merged already (a retry after a lost answer, or another handle)
        overlay = replay_log(self.log, covered, at)
        if fault == "exit_before_commit":
            os._exit(17)
        if fault == "hang":
            time.sleep(3600)
        merge_overlay(self.tree, overlay, at)
        if fault == "exit_after_commit":
            os._exit(18)
        return self.tree.checkpoint or 0


def replay_log(log, since: int, at: int):
    """The attribute updates of the log's batches in ``[since, at)`` as an overlay (``since`` and
    ``at`` are batch boundaries: checkpoints and freeze positions are)."""
    from .log.batch import decode_attribute_updates
    from .overlay import AttributeOverlay

    log.open_at(since)
    if since < log.start_position:
        raise StorageError(f"segment {log.segment!r}: the log starts at byte {log.start_position}, after the tree's "
                           f"checkpoint {since}: the updates in between are not in the log")
    overlay = AttributeOverlay()
    for position, header, buf, pos in log.batches(since, at):
        if header.attribute_count:
            keys, values = decode_attribute_updates(buf, pos, header, position=position - pos, segment=log.segment)
            overlay.apply(keys, values)
    return overlay


def _watch_parent(parent: int) -> None:
    """Exit as soon as the parent process is gone (reparented): never merge for a dead writer."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(_PARENT_POLL_SECONDS)


def main(argv: list[str]) -> int:
    parent = int(argv[0])
    requests, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the answers
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    host = None
    while True:
        try:
            request = _receive(requests, None)
        except EOFError:
            return 0  # the parent closed the pipe (or died)
        try:
            if request[0] == "stop":
                return 0
            if request[0] == "open":
                host = _Host(request[1])
                _send(answers, ("ok", None))
            else:
                checkpoint = host.merge(request[1], request[2])
                _send(answers, ("ok", (checkpoint, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which retries
            _send(answers, ("error", f"{type(exc).__name__}: {exc}"))

