"""Tier 1's background merge into the B+tree, for ``Segment`` (a mixin: it works on the
handle's state and locks).

Tier 1 is two overlays, as LevelDB has a memtable and an immutable memtable: appends go to the
*active* one; when it crosses a threshold (keys, bytes, age) it is *frozen*, covering the log up
to the handle's position at that moment, and a fresh active one takes new appends. A daemon
thread per writing handle merges the frozen overlay into the tree with that position as the
checkpoint, without holding the handle's lock during the tree's I/O. ``flush``, ``close`` and
retention merge in the calling thread (``_drain``). Appends wait while tier 1 exceeds
``max_pending_bytes`` (``_wait_for_room``). With ``truncate_merged_log``, each merge is followed
by truncating the log below the chunk holding the tree's checkpoint.

Lock order: ``_merge_mutex`` (one merge at a time) before ``_lock``; a caller that already holds
``_lock`` takes the mutex through ``_merging``, which never blocks the merge thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from typing import Iterator

from .btree.tree import TreeMovedError
from .errors import LayoutChangedError, MergeBacklogError, StorageError, TruncatedError
from .merge_worker import (MAX_FAILED_MERGES, MAX_FAILED_STARTS, MergeWorker, MergeWorkerError, WorkerGaveUpError,
                           WorkerStartError, worker_storage)
from .overlay import AttributeOverlay, merge_overlay
from .replay import replay_range

MERGE_RETRY_SECONDS = 5.0  #: the longest pause between retries of a failing background merge
MERGE_RETRY_MIN_SECONDS = 0.05  #: the first pause after a failed background merge (doubling up to the above)
BACKPRESSURE_WAIT_SECONDS = 60.0  #: the longest an append waits for a merge to make room in tier 1
#: Merge failures in a row that refuse an append over ``max_pending_bytes`` (``MergeBacklogError``).
#: A dying or hanging worker fails at most this many minus one before its own fallback (merging in
#: the writer's process) runs, so its failures alone never refuse an update.
BACKPRESSURE_FAILURES = max(MAX_FAILED_MERGES, MAX_FAILED_STARTS)
#: A background merge of fewer keys runs in this process even with ``merge_process`` (it is brief);
#: ``flush``, ``close`` and retention always merge in the calling thread (their caller waits anyway).
MIN_WORKER_KEYS = 10_000
_IDLE_RECHECK_SECONDS = 1.0  #: an idle merge thread looks this often whether its handle still exists
_MAX_TREE_REFRESHES = 10  #: tree refreshes before a rebuild of tier 1 when others keep truncating the log

_log = logging.getLogger("attrindex.segment")


class BackgroundMerge:
    """The merge of tier 1 into the B+tree: the part of ``Segment`` that runs beside appends."""

    #: The tree checkpoint tier 1 was built on: tier 1 holds the log's updates between it and the
    #: handle's position. Tracked only where another handle may write a tree version that is not
    #: the log replayed up to its checkpoint (``AttributeIndex.bulk_load``; the index sets it at
    #: open); None: not tracked. See ``_merge_into_tree``.
    _tier1_base: int | None = None

    # Under ``_lock``: ``_freeze``, ``_merge_due``, ``_needs_merge``. ``_merge_once`` and ``_drain``
    # run with ``_merge_mutex`` held and do the tree's I/O without ``_lock`` (unless the caller holds
    # it: retention), so appends and reads go on while a merge writes.
    def _merge_due(self) -> bool:
        """Whether the active overlay should be frozen and merged now (thresholds on keys, bytes
        and the age of its first update)."""
        overlay, options = self._overlay, self.options
        if len(overlay) >= options.flush_keys or overlay.nbytes >= options.flush_bytes:
            return True
        return bool(len(overlay)) and time.monotonic() - self._dirty_since >= options.flush_seconds

    def _needs_merge(self, force: bool) -> bool:
        """For ``flush``: whether there is anything to merge (``force``: the checkpoint too)."""
        position, covered = self._log.position, self._index.checkpoint or 0
        if len(self._overlay) or covered > position:
            return True
        return covered < position and (force or position - covered >= self.options.log_rolling_size)

    def _freeze(self) -> None:
        """Hand the active overlay to the merge: it becomes the frozen one, covering the log up to
        this handle's position; a fresh overlay takes new appends. Not while tier 1 is stale (a
        failed rebuild): merged, its old values would replace newer ones in the tree. The merge
        thread, woken, rebuilds it first (``_settle_tier1``); so do ``flush`` and ``close``."""
        if self._tier1_stale:
            self._wake.set()
            return
        self._frozen, self._frozen_at = self._overlay, self._log.position
        self._overlay = AttributeOverlay()
        self._publish_view()  # before the lock is let go: no append lands in an unpublished overlay
        self._dirty_since = time.monotonic()
        self._wake.set()

    def _pending_bytes(self) -> int:
        frozen = self._frozen
        return self._overlay.nbytes + (0 if frozen is None else frozen.nbytes)

    def _merge_once(self, background: bool = False) -> None:
        """Merge the frozen overlay into the B+tree with checkpoint = the log position at the
        freeze (``_merge_mutex`` held; ``background``: by the merge thread, which may hand it to
        the worker process). Raises the merge's error after recording it."""
        with self._lock:
            frozen, at = self._frozen, self._frozen_at
            if frozen is None or self._closed:
                return
        try:
            merged = self._merge_into_tree(frozen, at, background)
            with self._lock:
                if not merged:  # another handle merged further: tier 1 restarts from its checkpoint
                    self._rebuild_overlay()
                elif self._frozen is frozen:  # (a rebuild meanwhile replaced it: nothing to drop)
                    # Dropped only now: the tree and its recent values hold its values already.
                    self._frozen = None
                    self._publish_view()
                    if self._tier1_base is not None:
                        self._tier1_base = at  # the active overlay holds the log from ``at`` on
                self._merges += 1
                if self._merge_error is not None:
                    _log.info("segment %r: merge into the B+tree succeeded after an earlier failure", self.name)
                    self._merge_error = None
                self._merged.notify_all()
        except Exception as exc:
            with self._lock:
                self._merge_error = exc
                self._merged.notify_all()
            raise
        _log.debug("segment %r: merged %d attribute updates into the B+tree up to log byte %d", self.name,
                   len(frozen), at)
        self._truncate_merged()

    def _merge_into_tree(self, frozen: AttributeOverlay, at: int, background: bool) -> bool:
        """Merge ``frozen`` (the log up to byte ``at``) into the tree: a large background merge in
        the worker process if this handle has one (``merge_process``), else in this thread; return
        False if the tree covered more already (another handle merged further). Raises the
        merge's error."""
        worker = self._merge_worker() if background and len(frozen) >= MIN_WORKER_KEYS else None
        if worker is not None:
            try:
                return self._merge_in_worker(worker, at)
            except (WorkerStartError, WorkerGaveUpError) as exc:  # merge in this thread for good
                _log.warning("segment %r: the merge worker process could not be started or kept dying or hanging "
                             "(merging in the writer's process from now on): %s", self.name, exc)
                self._worker_disabled = True
        # Tier 1 holds the log from ``_tier1_base`` on. Merged over a newer tree version another
        # handle wrote, it is right only if that version is the log replayed up to its checkpoint,
        # as merges write; a bulk load's is not (its pairs are in no log batch), and tier 1's
        # values from before the load would replace the loaded ones. So the tree's own
        # compare-and-append checks the version (``base``): on another one, seen at once or after
        # a lost race, nothing is written and the caller rebuilds tier 1 from the newest version,
        # as when the tree covers more than ``at``. (The worker replays the log from the tree's
        # own checkpoint.)
        try:
            return merge_overlay(self._index, frozen, at, base=self._tier1_base)
        except TreeMovedError as exc:
            _log.info("segment %r: %s since the pending updates were read; rebuilding them from the tree instead "
                      "of merging them", self.name, exc)
            return False

    def _merge_worker(self) -> MergeWorker | None:
        """The worker process host of this handle's merges (``merge_process`` on local disk), or
        None (also once the handle stops: ``_abort_worker`` must see every worker there is)."""
        with self._lock:
            if self._stopping:
                return None
            if self._worker is None and self.options.merge_process and not self._worker_disabled:
                storage = worker_storage(self._log.storage)
                if storage is not None:
                    try:
                        self._worker = MergeWorker(storage, self.name, self.tree_name, self.options)
                    except WorkerStartError as exc:
                        _log.warning("segment %r: merging in the writer's process: %s", self.name, exc)
                        self._worker_disabled = True
            return None if self._worker_disabled else self._worker

    def _merge_in_worker(self, worker: MergeWorker, at: int) -> bool:
        """The worker merges the log up to ``at``; then this handle adopts the tree it wrote (a
        new footer: the page cache stays valid, the value cache is dropped as after any other
        writer's version) and checks that it covers ``at``. A worker that died after committing
        (its answer lost) is no failure. The value cache is not refreshed from the frozen overlay
        instead: a read view published during such a refresh would serve values the new version
        replaced."""
        tree = self._index
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
        covered = tree.checkpoint or 0
        if covered < at:
            raise MergeWorkerError(f"segment {self.name!r}: the merge worker reported the merge up to log byte {at}, "
                                   f"but the tree covers only {covered}")
        return covered == at

    def _abort_worker(self) -> None:
        """At close (``_stopping`` set, ``_lock`` held), before the merge thread is joined: kill the
        worker at once, so that close never waits on it (it may hang). Nothing is lost: the log
        holds every acknowledged update, the merge thread's wait ends with an error, and close
        merges what is pending in its own thread."""
        worker = self._worker
        if worker is not None:
            worker.abort()

    def _close_worker(self) -> None:
        """Stop the merge worker process, if one runs (at close, after the last merge)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def _truncate_merged(self) -> None:
        """With ``truncate_merged_log``: delete the log below the chunk holding the tree's
        checkpoint (never above it). Best effort: a failure leaves more log, which is harmless.
        ``_lock`` is held only to plan and to update the view: the durable marker and the
        deletions run beside appends (they write at the end, far above the cut)."""
        if not self.options.truncate_merged_log:
            return
        with self._lock:
            if self._closed:
                return
            covered = self._index.checkpoint or 0
            cut = max((c.start for c in self._log.bytes.chunks() if c.start <= covered), default=0)
            if cut <= self._log.start_position or cut > self._log.position:
                return
            derived = self._log.derived_below(cut)
        try:
            self._log.bytes.truncate(cut)
        except Exception as exc:  # noqa: BLE001 - the merge is done; the next one tries again
            _log.warning("segment %r: truncating the merged log below byte %d failed (retried after the "
                         "next merge): %s", self.name, cut, exc)
            return
        with self._lock:
            if not self._closed:
                self._log.forget_below(cut)
        self._log.delete_derived(derived)
        _log.debug("segment %r: truncated the merged log below byte %d", self.name, cut)

    def _drain(self, *, force: bool = False) -> None:
        """Merge everything this handle has seen, in the calling thread (``_merge_mutex`` held):
        first what is frozen, then the active overlay. A merge that finds the tree written by
        another handle rebuilds tier 1 from it instead; the rebuilt tier 1 is merged in the next
        lap (bounded: other handles that keep merging leave the rest to the next merge). Raises a
        merge's error."""
        self._ensure_attributes()  # a lazily opened handle: what it merges is the log after the tree
        for _lap in range(2 + _MAX_TREE_REFRESHES):
            with self._lock:
                self._settle_tier1()  # (raises if tier 1 cannot be rebuilt: nothing stale is merged)
                if self._frozen is None:
                    if not self._needs_merge(force):
                        self._dirty_since = time.monotonic()
                        return
                    self._freeze()
            self._merge_once()

    def flush(self) -> None:
        """Merge every attribute update seen so far into the B+tree (one sorted batch), now.

        Raises the storage error if the merge fails (for example ``StorageFullError``); the
        updates stay in tier 1 and in the log, and a later flush or the background merge retries."""
        self._check_open()
        with self._merging():
            self._check_open()
            self._drain()

    @contextlib.contextmanager
    def _merging(self) -> Iterator[None]:
        """Hold ``_merge_mutex`` (one merge at a time). A caller that holds ``_lock`` (the plain
        index's facade, retention) must not block on it outright: the merge thread may need
        ``_lock`` to finish the merge that holds it. So it waits in short laps on a condition,
        which lets go of ``_lock`` meanwhile."""
        mutex = self._merge_mutex
        if self._lock._is_owned():  # type: ignore[attr-defined]
            while not mutex.acquire(timeout=0.002):
                self._merged.wait(0.002)
        else:
            mutex.acquire()
        try:
            yield
        finally:
            mutex.release()

    def _start_merger(self) -> None:
        # The thread holds the handle only weakly between laps: a handle dropped without close()
        # is collected, and its thread ends (its updates are in the log, replayed on open).
        thread = threading.Thread(target=_merge_loop, args=(weakref.ref(self), self._wake),
                                  name=f"attrindex-merge-{self.name}", daemon=True)
        self._merger = thread
        thread.start()

    def _merger_lap(self, pause: float) -> tuple[float, float | None] | None:
        """One lap of the background merge: merge the frozen overlay (freezing the active one if
        it is due), or say how long to sleep. Returns ``(pause, sleep)`` (``sleep`` None: until
        woken), or None once the handle closes. A failure is recorded and logged, and retried
        after a pause doubling from ``MERGE_RETRY_MIN_SECONDS`` up to ``MERGE_RETRY_SECONDS``."""
        with self._lock:
            if self._stopping:
                return None
            now = time.monotonic()
            if now < self._merge_retry_at:
                return pause, self._merge_retry_at - now
            if self._frozen is None and self._merge_due():
                self._freeze()
            if self._frozen is None and not self._tier1_stale:
                if len(self._overlay) and self.options.flush_seconds != float("inf"):
                    return pause, max(self._dirty_since + self.options.flush_seconds - now, 0.001)
                return pause, None
        try:
            with self._merging():
                with self._lock:
                    self._settle_tier1()
                self._merge_once(background=True)
            return 0.0, 0.0
        except Exception as exc:  # noqa: BLE001 - recorded; flush() and close() raise it
            if self._stopping:  # (close killed the worker under this merge: close merges it itself)
                _log.debug("segment %r: the background merge ended by close: %s", self.name, exc)
                return None
            pause = min(max(2 * pause, MERGE_RETRY_MIN_SECONDS), MERGE_RETRY_SECONDS)
            self._merge_retry_at = time.monotonic() + pause
            _log.warning("segment %r: merging attribute updates into the B+tree failed in the background "
                         "(retried in %.2f s; flush() raises it): %s", self.name, pause, exc, exc_info=True)
            return pause, 0.0

    def _stop_merger(self) -> None:
        """Stop and join the merge thread (not holding ``_lock``: it may be finishing a merge)."""
        with self._lock:
            self._stopping = True
            self._abort_worker()  # the thread may be waiting on a hung worker
            self._wake.set()
            self._merged.notify_all()
            thread = self._merger
        if thread is None or thread is threading.current_thread():
            return
        if self._lock._is_owned():  # type: ignore[attr-defined]  # the thread may need _lock to finish
            with self._lock:
                while thread.is_alive():
                    self._merged.wait(0.002)
        else:
            thread.join()

    def _wait_for_room(self) -> None:
        """Back-pressure (under ``_lock``, before an append): while tier 1 holds more than
        ``max_pending_bytes``, wait for the merge, at most ``BACKPRESSURE_WAIT_SECONDS``; a merge
        that is slow but works then lets the append go on (logged). A merge that keeps failing
        while tier 1 is over the limit refuses the append with ``MergeBacklogError`` before
        anything is written, so memory stays bounded: ``BACKPRESSURE_FAILURES`` failures in a
        row (one recorded when the wait began counts) raise; fewer only delay the append."""
        limit = self.options.max_pending_bytes
        if self._pending_bytes() <= limit or self._merger is None:
            return
        deadline = time.monotonic() + BACKPRESSURE_WAIT_SECONDS
        seen = self._merge_error  # each failure is a new exception object; a success clears it
        failures = 0 if seen is None else 1
        while self._pending_bytes() > limit and not self._stopping:
            error = self._merge_error
            if error is not seen:
                seen, failures = error, (0 if error is None else failures + 1)
            if failures >= BACKPRESSURE_FAILURES:
                raise self._backlog_error(error)  # type: ignore[arg-type]
            if self._frozen is None:
                self._freeze()  # the active overlay alone is too big: merge it now
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if error is not None:
                    raise self._backlog_error(error)
                _log.warning("segment %r: tier 1 still holds %d bytes (max_pending_bytes %d) after waiting %.0f s "
                             "for the merge; appending anyway", self.name, self._pending_bytes(), limit,
                             BACKPRESSURE_WAIT_SECONDS)
                return
            self._merged.wait(remaining)

    def _backlog_error(self, error: BaseException) -> MergeBacklogError:
        exc = MergeBacklogError(
            f"segment {self.name!r}: refused, nothing was written: the pending attribute updates hold "
            f"{self._pending_bytes()} bytes, over max_pending_bytes ({self.options.max_pending_bytes}), and merging "
            f"them into the B+tree keeps failing ({type(error).__name__}: {error}). Every update acknowledged before "
            f"is durable in the log; retry once the cause is fixed")
        exc.__cause__ = error
        return exc

    def _rebuild_overlay(self) -> None:
        """The tree covers more of the log than this handle had seen: catch up, replay after it."""
        self._catch_up()
        self._replay_from_tree()

    def _settle_tier1(self) -> None:
        """Under ``_lock``: if a rebuild of tier 1 failed, rebuild it now (raises if it cannot)."""
        if self._tier1_stale:
            self._catch_up()  # (which rebuilds tier 1 while it is stale)

    def _replay_from_tree(self, refresh_tree: bool = False) -> None:
        """Tier 1 rebuilt from the log between the tree's checkpoint and this handle's position
        (``refresh_tree``: the tree's newest version read first).

        If another handle truncated the log past the checkpoint (it merged further, then cut),
        what it cut is in a newer version of the tree: adopt that first. Replaying from the log's
        start over the older version would lose the updates in between (reads went back). Such a
        cut may also land during the replay (two writers merging and truncating one WAL): the
        read then lists the log again and raises ``TruncatedError``; the newer tree version
        holds what was cut, so the rebuild starts over from it (bounded). Chunks switched under
        the replay (``LayoutChangedError``) are taken in by a scan of the tail before it starts
        over likewise.

        A failure leaves tier 1 as it was: whole, unless the caller marked it stale
        (``_tier1_stale``: its catch-up stepped over log bytes that tier 1 never replayed). Then
        reads and conditions rebuild first (raising while they cannot), and nothing stale is
        frozen and merged into the tree."""
        try:
            if refresh_tree:
                self._index.refresh()
            for _attempt in range(_MAX_TREE_REFRESHES):
                try:
                    rebuilt, base = self._replayed_from_newest_tree()
                except TruncatedError:
                    continue  # the failed read re-listed the log: its start moved past this tree version
                except LayoutChangedError:
                    # Chunks were switched under the replay (consolidation or log compaction by
                    # another process): take the new layout (the scan may also reach further; the
                    # rebuild then replays up to there) and start over.
                    self._scan_tail(None)
                    continue
                # Swapped in whole: a read that fails half-way (in the background merge, which
                # retries) must not leave tier 1 cleared or missing updates, which would let
                # conditional appends validate against stale values.
                self._overlay, self._frozen, self._tier1_stale = rebuilt, None, False
                if self._tier1_base is not None:
                    self._tier1_base = base
                self._publish_view()  # one swap: a reader never pairs the rebuilt overlay with the old frozen one
                self._dirty_since = time.monotonic()
                return
            raise StorageError(f"segment {self.name!r}: other handles kept merging and truncating the log while "
                               f"this handle rebuilt its pending attribute updates from the B+tree "
                               f"({_MAX_TREE_REFRESHES} tries); try again")
        finally:
            if self._tier1_stale:
                self._publish_view()  # reads rebuild first from now on, never serving the stale values

    def _replayed_from_newest_tree(self) -> tuple[AttributeOverlay, int]:
        """One try of ``_replay_from_tree``: a new overlay holding the log's updates between the
        newest tree version covering the log's start and this handle's position, and that
        version's checkpoint."""
        for _attempt in range(_MAX_TREE_REFRESHES):
            checkpoint = self._index.checkpoint or 0
            if checkpoint >= self._log.start_position:
                break
            self._index.refresh()
            if (self._index.checkpoint or 0) == checkpoint:
                break  # no newer version: the log cut held no updates (retention's empty batch)
        checkpoint = self._index.checkpoint or 0
        rebuilt, _batches = replay_range(self._log, max(checkpoint, self._log.start_position), self._log.position)
        return rebuilt, checkpoint


def _merge_loop(ref: "weakref.ref[BackgroundMerge]", wake: threading.Event) -> None:
    """The body of a handle's merge thread: laps of ``BackgroundMerge._merger_lap``, sleeping on ``wake``
    between them without holding the handle (at most ``_IDLE_RECHECK_SECONDS``, then it looks
    whether the handle still exists)."""
    pause = 0.0
    while True:
        wake.clear()
        segment = ref()
        if segment is None:
            return
        lap = segment._merger_lap(pause)
        del segment
        if lap is None:
            return
        pause, sleep = lap
        if sleep is None or sleep > 0:
            wake.wait(_IDLE_RECHECK_SECONDS if sleep is None else min(sleep, _IDLE_RECHECK_SECONDS))


__all__ = ["BACKPRESSURE_WAIT_SECONDS", "BackgroundMerge", "MergeWorkerError", "MERGE_RETRY_MIN_SECONDS", "MERGE_RETRY_SECONDS"]
