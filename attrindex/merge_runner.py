"""``MergeRunner``: where and how an attribute state's merges run.

A merge moves the frozen overlay of tier 1 into the B+tree (``overlay.merge_overlay``) with the
log position it covers as the tree's checkpoint. The runner owns what hosts merges: the mutex
that allows one merge at a time, the background thread (a daemon per writing handle, holding
its state only weakly between laps), the worker process (``merge_process`` on local disk: large
background merges run there, so their CPU never holds the writer's GIL), and the record of
failures (the last error, the pause before the next try). What to freeze and when, and what a
merge's outcome does to tier 1, is the attribute state's (``attrindex.attribute_state``).

Lock order: the runner's mutex before the state's lock, never inside it. Every caller of
``merging`` holds no state lock (the public methods of ``Segment`` and ``AttributeIndex`` and the
merge thread), so the mutex is taken outright.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterator

from .btree.tree import TreeMovedError
from .merge_worker import (MAX_WORKER_MERGE_ATTEMPTS, MAX_WORKER_START_ATTEMPTS, MergeWorker, MergeWorkerError, WorkerGaveUpError,
                           WorkerStartError, worker_storage)
from .overlay import AttributeOverlay, merge_overlay

MERGE_RETRY_SECONDS = 5.0  #: the longest pause between retries of a failing background merge
MERGE_RETRY_MIN_SECONDS = 0.05  #: the first pause after a failed background merge (doubling up to the above)
#: A background merge of fewer keys runs in this process even with ``merge_process`` (it is brief);
#: ``flush``, ``close`` and retention always merge in the calling thread (their caller waits anyway).
MIN_WORKER_KEYS = 10_000
#: Merge failures in a row that refuse an append over ``max_pending_bytes`` (``MergeBacklogError``).
#: A dying or hanging worker fails at most this many minus one before its own fallback (merging in
#: the writer's process) runs, so its failures alone never refuse an update.
BACKPRESSURE_FAILURES = max(MAX_WORKER_MERGE_ATTEMPTS, MAX_WORKER_START_ATTEMPTS)
_IDLE_RECHECK_SECONDS = 1.0  #: an idle merge thread looks this often whether its state still exists

_log = logging.getLogger("attrindex.segment")


class MergeRunner:
    """Runs one attribute state's merges: one at a time, in the calling thread, the background
    thread or the worker process. Not a lock owner of the state: it is called under the state's
    rules (see the module docstring)."""

    def __init__(self, name: str, options: Any, storage: object, tree_name: str):
        self.name = name
        self._options = options
        self._storage = storage
        self._tree_name = tree_name
        self._mutex = threading.Lock()  #: one merge at a time
        self._guard = threading.Lock()  #: orders making the worker with ``stop`` (which must see it)
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  #: wakes the thread (an event: a wake-up is never missed)
        self._worker: MergeWorker | None = None  #: the worker process host, made by the first large merge
        self._worker_disabled = False  #: no worker could be started or kept working: merges stay here
        self._stopping = False
        self.merges = 0  #: merges that succeeded
        self.error: BaseException | None = None  #: the last failed merge (None after a success)
        self.retry_at = 0.0  #: after a failed background merge, the thread waits until then

    @contextlib.contextmanager
    def merging(self) -> Iterator[None]:
        """Hold the merge mutex: no other merge of this state runs meanwhile. The caller holds no
        lock of the state (the merge thread may need it to finish the merge that holds the mutex)."""
        with self._mutex:
            yield

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def started(self) -> bool:
        """Whether the background thread was started (by the first durable append)."""
        return self._thread is not None

    def merge(self, tree: Any, frozen: AttributeOverlay, at: int, base: int | None, background: bool) -> bool:
        """Merge ``frozen`` (the log up to byte ``at``) into ``tree``: a large background merge in
        the worker process if the state has one (``merge_process``), else in this thread; return
        False if the tree covered more already (another handle merged further) or is not the
        version ``base`` (tier 1 was replayed from that one). Raises the merge's error."""
        worker = self.worker_for_merges() if background and len(frozen) >= MIN_WORKER_KEYS else None
        if worker is not None:
            try:
                return self._merge_in_worker(worker, tree, at)
            except (WorkerStartError, WorkerGaveUpError) as exc:  # merge in this thread for good
                _log.warning("segment %r: the merge worker process could not be started or kept dying or hanging "
                             "(merging in the writer's process from now on): %s", self.name, exc)
                self._worker_disabled = True
        # Tier 1 holds the log from ``base`` on. Merged over a newer tree version another handle
        # wrote, it is right only if that version is the log replayed up to its checkpoint, as
        # merges write; a bulk load's is not (its pairs are in no log batch), and tier 1's values
        # from before the load would replace the loaded ones. So the tree's own compare-and-append
        # checks the version (``base``): on another one, seen at once or after a lost race,
        # nothing is written and the state rebuilds tier 1 from the newest version, as when the
        # tree covers more than ``at``. (The worker replays the log from the tree's checkpoint.)
        try:
            return merge_overlay(tree, frozen, at, base=base, defer_rebuild=not background)
        except TreeMovedError as exc:
            _log.info("segment %r: %s since the pending updates were read; rebuilding them from the tree instead "
                      "of merging them", self.name, exc)
            return False

    def failed(self, pause: float) -> float:
        """After a failed background merge: the next pause, doubling from ``MERGE_RETRY_MIN_SECONDS``
        up to ``MERGE_RETRY_SECONDS``; the thread waits that long before it tries again."""
        pause = min(max(2 * pause, MERGE_RETRY_MIN_SECONDS), MERGE_RETRY_SECONDS)
        self.retry_at = time.monotonic() + pause
        return pause

    def succeeded(self) -> None:
        self.merges += 1
        if self.error is not None:
            _log.info("segment %r: merge into the B+tree succeeded after an earlier failure", self.name)
            self.error = None

    def worker_for_merges(self) -> MergeWorker | None:
        """The worker process host (``merge_process`` on local disk), or None (also once the state
        stops: ``stop`` must see every worker there is)."""
        with self._guard:
            if self._stopping:
                return None
            if self._worker is None and self._options.merge_process and not self._worker_disabled:
                storage = worker_storage(self._storage)
                if storage is not None:
                    try:
                        self._worker = MergeWorker(storage, self.name, self._tree_name, self._options)
                    except WorkerStartError as exc:
                        _log.warning("segment %r: merging in the writer's process: %s", self.name, exc)
                        self._worker_disabled = True
            return None if self._worker_disabled else self._worker

    def _merge_in_worker(self, worker: MergeWorker, tree: Any, at: int) -> bool:
        """The worker merges the log up to ``at``; then the tree handle adopts the version it wrote
        (a new footer: the page cache stays valid, the value cache is dropped as after any other
        writer's version) and checks that it covers ``at``. A worker that died after committing
        (its answer lost) is no failure. The value cache is not refreshed from the frozen overlay
        instead: a read view published during such a refresh would serve values the new version
        replaced."""
        try:
            worker.merge(at)
        except WorkerStartError:
            raise
        except MergeWorkerError as exc:
            tree.refresh()
            if (tree.checkpoint or 0) < at:
                raise
            _log.info("segment %r: the merge worker's answer was lost, but the tree covers log byte %d: merged (%s)",
                      self.name, at, exc)
        else:
            tree.refresh()
            tree.count_written_elsewhere(*worker.last_written)
        covered = tree.checkpoint or 0
        if covered < at:
            raise MergeWorkerError(f"segment {self.name!r}: the merge worker reported the merge up to log byte {at}, "
                                   f"but the tree covers only {covered}")
        return covered == at

    @property
    def worker(self) -> MergeWorker | None:
        """The worker process host, if one was made (``merge_process``)."""
        return self._worker

    @property
    def worker_disabled(self) -> bool:
        """Whether merges stay in this process for good (no worker could start or keep working)."""
        return self._worker_disabled

    # -- the background thread -------------------------------------------------------------------
    def start(self, state: object, lap: Callable[[object, float], tuple[float, float | None] | None]) -> None:
        """Start the background thread: laps of ``lap(state, pause)`` (see ``_merge_loop``). It
        holds ``state`` only weakly between laps: a handle dropped without close is collected and
        its thread ends (its updates are in the log, replayed on open)."""
        thread = threading.Thread(target=_merge_loop, args=(weakref.ref(state), lap, self._wake),
                                  name=f"attrindex-merge-{self.name}", daemon=True)
        self._thread = thread
        thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> threading.Thread | None:
        """Stop merging in the background: no new worker, the running one killed at once (close
        never waits on it: it may hang; nothing is lost, the log holds every acknowledged update),
        the thread woken. Returns the thread for the caller to join without the state's lock."""
        with self._guard:
            self._stopping = True
            worker = self._worker
        if worker is not None:
            worker.abort()
        self._wake.set()
        return self._thread

    def close(self) -> None:
        """Stop the worker process, if one runs (at close, after the last merge)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()


def _merge_loop(ref: "weakref.ref[Any]", lap: Callable, wake: threading.Event) -> None:
    """The body of a merge thread: laps of ``lap(state, pause)``, which returns ``(pause, sleep)``
    (``sleep`` None: until woken) or None once the state stops; between laps it sleeps on ``wake``
    without holding the state (at most ``_IDLE_RECHECK_SECONDS``, then it looks whether the state
    still exists)."""
    pause = 0.0
    while True:
        wake.clear()
        state = ref()
        if state is None:
            return
        outcome = lap(state, pause)
        del state
        if outcome is None:
            return
        pause, sleep = outcome
        if sleep is None or sleep > 0:
            wake.wait(_IDLE_RECHECK_SECONDS if sleep is None else min(sleep, _IDLE_RECHECK_SECONDS))


__all__ = ["BACKPRESSURE_FAILURES", "MERGE_RETRY_MIN_SECONDS", "MERGE_RETRY_SECONDS", "MIN_WORKER_KEYS", "MergeRunner",
           "MergeWorkerError"]
