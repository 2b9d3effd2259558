"""The merge of tier 1 into the B+tree, hosted in a worker process (local disk only).

Why a process: the merge is CPU work (the replay of the log into an overlay, the sort of its
keys, and the rewrite or rebuild of the tree: seconds at 10M keys). In the writer's process it
holds the GIL, and every ``update`` returning from a ``write``/``fsync`` waits for it
up to the switch interval, many times per call: p99 of ``update`` rose from ~5 ms to 50-100 ms
while a merge ran. In a worker process the merge has its own interpreter and the writer's merge
thread only waits on a pipe.

The log is the source of truth, so the parent sends no data: only the log position ``at`` that
the frozen overlay covers. The worker refreshes its own view of the tree, replays the log from
the tree's checkpoint up to ``at`` into an overlay (the same replay an opening handle does) and
merges it with ``overlay.merge_overlay``, the one merge function the in-thread host uses
too; then it answers with the tree's checkpoint, its peak RSS and what the merge wrote (key
updates, bytes, appends, relocated pages: the parent counts them in its tree's ``stats()``). The
parent re-reads the tree's footer (``TreeIndex.refresh``: pages are immutable at their offsets,
so its page cache stays valid; the value cache is dropped because the tree changed under it) and
drops the frozen overlay.

Failure rules (docs/design.md, "Write path"):

* the worker dies or hangs mid-merge: the parent kills it, reads the tree, and if the tree covers
  ``at`` the merge landed (only its answer was lost); otherwise the merge failed and is retried
  by the background loop (``stats().merge_error`` says why). A durable write is never failed;
  pages a killed worker half-wrote are an uncommitted tail, as after any crash. After
  ``MAX_WORKER_MERGE_ATTEMPTS`` merges in a row without an answer, merges stay in the writer's process.
* "hangs" means *makes no progress*, not "takes long": while it waits for an answer, the parent
  watches the worker's main thread in ``/proc`` (its CPU time and its read/write system calls,
  ``_progress``) and kills it once neither moved for ``hang_seconds`` (``merge_hang_seconds``, 5 s by
  default). A merge that works is never cut short however long it takes (up to the safety cap
  ``MERGE_WORKER_SECONDS``); one stopped, deadlocked, asleep or stuck in a system call is
  killed within seconds. The observer is the parent, not a heartbeat the worker sends: a
  heartbeat thread in the worker would keep beating while its merge sleeps or blocks, and
  would go silent while one C call (a sort of a million keys) holds the worker's GIL.
* the handle closes: ``abort`` kills the worker at once, whatever it does. Nothing is lost: the
  WAL holds every acknowledged update, and ``close`` merges what is pending in its own thread.
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
from .overlay import merge_overlay
from .replay import for_merge

#: The longest one merge may take even while the worker makes progress (a worker spinning without
#: end); a worker that makes none is killed after ``hang_seconds`` (see the module's docstring).
MERGE_WORKER_SECONDS = 600.0
_START_SECONDS = 60.0  #: the same cap for a new worker to say it is ready (it too is killed when it stalls)
DEFAULT_HANG_SECONDS = 5.0  #: ``merge_hang_seconds``: no progress this long and the worker counts as hung
MAX_WORKER_MERGE_ATTEMPTS = 3  #: merges in a row the worker died or hung in before merges stay in the writer's process
_KILL_WAIT_SECONDS = 10.0  #: the longest the parent waits for a killed worker to be reaped (one stuck in the kernel)
#: The worker writes tree pages back in slices this big (local storage's ``PACED_WRITE_BYTES``, in
#: the worker's process only): a WAL ``fsync`` of the writer waits behind at most one slice.
WORKER_PACED_WRITE_BYTES = 256 << 10
MAX_WORKER_START_ATTEMPTS = 3  #: workers in a row that failed to start before merges stay in the writer's process
_PARENT_POLL_SECONDS = 0.1  #: how often a worker looks whether its parent still lives
_FRAME = struct.Struct(">I")
#: The program a worker process runs (tests run one that wraps it with scripted faults). Not
#: ``-m attrindex.merge_worker``: the package imports this module before runpy would run it.
WORKER_MAIN = "import sys; from attrindex.merge_worker import main; sys.exit(main(sys.argv[1:]))"

_log = logging.getLogger("attrindex.segment")


class MergeWorkerError(StorageError):
    """A merge in the worker process failed, or the worker died or hung (it is restarted for the
    next merge). The updates stay in tier 1 and in the log; the background merge retries."""


class WorkerStartError(MergeWorkerError):
    """``MAX_WORKER_START_ATTEMPTS`` worker processes in a row failed to start (or to open the index)."""


class WorkerGaveUpError(MergeWorkerError):
    """``MAX_WORKER_MERGE_ATTEMPTS`` merges in a row got no answer (the worker died or hung each time): the
    segment merges in its own process from then on."""


def worker_storage(storage: object) -> LocalChunkStorage | None:
    """The local storage a worker can open again by itself, or None (memory, object stores and
    wrapped storages merge in the writer's process)."""
    return storage if type(storage) is LocalChunkStorage else None


class MergeWorker:
    """The parent's handle on one worker process (started on first use, restarted after a failure).

    Not thread-safe: the segment calls it with its ``_merge_mutex`` held."""

    def __init__(self, storage: LocalChunkStorage, wal_name: str, tree_name: str, options: Any):
        self._spec = dict(root=storage.root, sync=storage.sync,
                          wal_name=wal_name, tree_name=tree_name, log_rolling_size=options.log_rolling_size,
                          index_interval_bytes=options.index_interval_bytes,
                          attribute_options=dict(options.attribute_options))
        try:  # (a compaction policy object, say, may not cross to another process)
            pickle.dumps(self._spec)
        except Exception as exc:  # noqa: BLE001 - any reason is one: this index cannot use a worker
            raise WorkerStartError(f"the index's options cannot be sent to a merge worker: {exc}") from exc
        self.hang_seconds = float(getattr(options, "merge_hang_seconds", DEFAULT_HANG_SECONDS))
        self._process: subprocess.Popen | None = None
        self._aborted = False  #: ``abort`` was called (the handle closes): no worker is started again
        self.starts = 0  #: worker processes started so far
        self.peak_rss = 0  #: the largest peak resident set size a worker reported (bytes)
        #: what the last merge wrote, as the worker reported it: key updates, bytes, appends,
        #: relocated pages (``TreeIndex.count_written_elsewhere``); zeros before an answer
        self.last_written: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._failed_starts = 0  #: in a row
        self._failed_merges = 0  #: merges in a row that got no answer (the worker died or hung)

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None when none runs)."""
        process = self._process
        return None if process is None else process.pid

    def merge(self, at: int) -> int:
        """Have the worker merge the log up to byte ``at`` into the tree; return what it reports.
        ``MergeWorkerError`` if it fails, dies or hangs (no progress for ``hang_seconds``, or no
        answer within ``MERGE_WORKER_SECONDS``; then it is killed); ``WorkerGaveUpError`` when
        that was the ``MAX_WORKER_MERGE_ATTEMPTS``-th merge in a row without an answer."""
        process = self._running()
        try:
            _send(process.stdin, ("merge", at))
            answer = self._answer(process, MERGE_WORKER_SECONDS)
        except (OSError, EOFError, ValueError, pickle.UnpicklingError, TimeoutError) as exc:
            code = self._kill()
            self._failed_merges += 1
            error = WorkerGaveUpError if self._failed_merges >= MAX_WORKER_MERGE_ATTEMPTS else MergeWorkerError
            raise error(f"the merge worker (exit status {code}) gave no answer for the merge up to log byte {at} "
                        f"({self._failed_merges} in a row): {type(exc).__name__}: {exc}") from None
        self._failed_merges = 0
        if answer[0] != "ok":
            raise MergeWorkerError(f"the merge worker failed to merge up to log byte {at}: {answer[1]}")
        checkpoint, peak_rss, written = answer[1]
        self.peak_rss = max(self.peak_rss, peak_rss)
        self.last_written = written
        return checkpoint

    def _answer(self, process: subprocess.Popen, cap: float) -> tuple:
        """The worker's next answer. Waits as long as the worker makes progress (at most ``cap``
        seconds in all); ``TimeoutError`` once its main thread used no CPU and made no read or
        write for ``hang_seconds``, or at the cap; ``EOFError`` if it exits."""
        fd, hang = process.stdout.fileno(), self.hang_seconds
        poll = min(hang / 4, 1.0)  # so a stall is seen within a quarter of the allowance
        now = time.monotonic()
        deadline, last, moved_at = now + cap, _progress(process.pid), now
        while not select.select([fd], [], [], max(0.0, min(poll, deadline - now)))[0]:
            now, seen = time.monotonic(), _progress(process.pid)
            if seen is None or seen != last:  # (None: this system shows no progress; only the cap holds)
                last, moved_at = seen, now
            elif now - moved_at >= hang:
                raise TimeoutError(f"the worker made no progress for {now - moved_at:.1f} s (no CPU time, no read or "
                                   f"write: stopped, asleep or stuck; merge_hang_seconds={hang:g})")
            if now >= deadline:
                raise TimeoutError(f"no answer within {cap:g} s")
        return _receive(process.stdout, time.monotonic() + hang)  # the frame is on its way: one write

    def _running(self) -> subprocess.Popen:
        process = self._process
        if process is not None and process.poll() is None:
            return process
        self._kill()
        if self._aborted:
            raise MergeWorkerError("the handle is closing: no merge worker is started")
        try:
            process = self._start()
        except MergeWorkerError as exc:
            self._failed_starts += 1
            if self._failed_starts >= MAX_WORKER_START_ATTEMPTS:
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
            process = subprocess.Popen([sys.executable, "-c", WORKER_MAIN, str(os.getpid())],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as exc:
            raise MergeWorkerError(f"the merge worker could not be started: {exc}") from exc
        self._process, self.starts = process, self.starts + 1
        if self._aborted:  # (``abort`` ran while it started: it may have missed this process)
            self._kill()
            raise MergeWorkerError("the handle is closing: no merge worker is started")
        try:
            _send(process.stdin, ("open", self._spec))
            answer = self._answer(process, _START_SECONDS)
        except (OSError, EOFError, ValueError, pickle.UnpicklingError, TimeoutError) as exc:
            code = self._kill()
            raise MergeWorkerError(f"the merge worker did not start (exit status {code}): {exc}") from None
        if answer[0] != "ok":
            self._kill()
            raise MergeWorkerError(f"the merge worker could not open the index: {answer[1]}")
        return process

    def _kill(self) -> int | None:
        """Stop the worker at once (it may be mid-merge: what it half-wrote is never referenced).
        Its exit status, or None (none ran, or it was not reaped within ``_KILL_WAIT_SECONDS``:
        stuck in the kernel, it dies when the kernel lets it; ``subprocess`` reaps it later)."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.kill()
        try:
            return process.wait(timeout=_KILL_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            _log.warning("the killed merge worker (pid %d) has not exited after %.0f s; not waiting for it",
                         process.pid, _KILL_WAIT_SECONDS)
            return None
        finally:
            for pipe in (process.stdin, process.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass

    def abort(self) -> None:
        """Kill the worker now, whatever it does, and start none again (the handle closes). Safe
        to call from any thread, also while another waits in ``merge``: that wait ends at once
        (the pipe ends) with ``MergeWorkerError``. Loses nothing: the log holds every update."""
        self._aborted = True
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()

    def close(self) -> None:
        """Ask the worker to exit (it is idle: the caller holds the merge mutex); kill it if it lingers."""
        process = self._process
        if process is None:
            return
        try:
            _send(process.stdin, ("stop",))
            process.wait(timeout=min(5.0, self.hang_seconds))
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self._kill()


def _progress(pid: int) -> tuple[int, ...] | None:
    """What the worker's main thread has done so far (Linux ``/proc``: its CPU clock ticks, then
    its read and write system calls), or None where the system does not say. Two equal samples
    mean it did nothing in between. The main thread alone: the worker's parent watcher wakes
    every ``_PARENT_POLL_SECONDS`` (no read or write, microseconds of CPU) and must not count."""
    task = f"/proc/{pid}/task/{pid}/"
    try:
        with open(task + "stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    except (OSError, IndexError, ValueError):
        return None
    try:
        with open(task + "io", "rb") as f:
            calls = [int(line.split()[1]) for line in f if line.startswith((b"syscr", b"syscw"))]
    except (OSError, IndexError, ValueError):  # (io may be hidden by the kernel's ptrace rules)
        calls = []
    return (ticks, *calls)


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

        self.storage = LocalChunkStorage(spec["root"], sync=spec["sync"])
        options = dict(spec["attribute_options"], value_cache_entries=0)  # the parent serves the reads
        self.tree = TreeIndex(self.storage, spec["tree_name"], **options)
        self.log = SegmentLog(self.storage, spec["wal_name"], rolling_size=spec["log_rolling_size"],
                              index_interval_bytes=spec["index_interval_bytes"])

    def merge(self, at: int) -> tuple[int, tuple[int, int, int, int]]:
        """Merge the log up to ``at`` into the tree: the checkpoint the tree covers then, and what
        this merge wrote (key updates, bytes, appends, relocated pages)."""
        tree = self.tree
        tree.refresh()
        covered = tree.checkpoint or 0
        if covered >= at:
            return covered, (0, 0, 0, 0)  # merged already (a retry after a lost answer, or another handle)
        before = _written(tree)
        merge_overlay(tree, for_merge(self.log, covered, at), at)
        after = _written(tree)
        return tree.checkpoint or 0, tuple(a - b for a, b in zip(after, before))  # type: ignore[return-value]


def _written(tree) -> tuple[int, int, int, int]:
    """What ``tree`` (a ``TreeIndex``) wrote so far: key updates, bytes, appends, relocated pages."""
    from .tree_index import LOGICAL_BYTES_PER_KEY

    stats = tree.stats()
    return (stats.logical_bytes // LOGICAL_BYTES_PER_KEY, stats.bytes_written, stats.updates_written,
            stats.pages_relocated)


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
        if request[0] == "stop":
            return 0
        try:
            if request[0] == "open":
                host = _Host(request[1])
                answer: tuple = ("ok", None)
            else:
                checkpoint, written = host.merge(request[1])
                answer = ("ok", (checkpoint, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, written))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which retries
            answer = ("error", f"{type(exc).__name__}: {exc}")
        try:
            _send(answers, answer)
        except BrokenPipeError:
            # The parent is gone (killed, or it killed this worker's pipe): nobody to answer.
            # Exit at once, with no traceback and no second failed flush at interpreter exit.
            os._exit(0)

