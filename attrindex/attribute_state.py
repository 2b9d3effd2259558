"""``AttributeState``: the attributes of one log, as the B+tree plus tier 1, with its merge.

The log is the source of truth. A B+tree version covers the log's attribute updates up to its
checkpoint; tier 1 holds those after it, in two overlays as LevelDB has a memtable and an
immutable memtable: updates go to the *active* one; when it crosses a threshold (keys, bytes,
age) it is *frozen*, covering the log up to the position at that moment, and a fresh active one
takes new updates. The merge (``merge_runner``) moves the frozen overlay into the tree with that
position as the checkpoint, in its background thread or worker process, without holding the lock
during the tree's I/O; ``flush``, ``close`` and retention drain in the calling thread. Updates
wait while tier 1 holds more than ``max_pending_bytes`` (back-pressure). With
``truncate_merged_log``, each merge is followed by deleting the log below the chunk holding the
tree's checkpoint.

The state is owned by ``Segment`` (records with attributes) and by ``AttributeIndex`` (the
key-value index, whose log is its write-ahead log). Its owner shares its lock with it: every
method documented "under the lock" is called with it held, and the log's view (``SegmentLog``)
moves only under it. Opening, following the log (``catch_up``) and rebuilding tier 1 replay the
log (``replay``). Reads take no lock: they read the published ``view`` (``read_view``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator

from .errors import InvalidInputError, LayoutChangedError, MergeBacklogError, RetriesExhaustedError, TruncatedError
from .layout import rolling_dir
from .listing import ListedStorage
from .log.segment_log import SegmentLog
from .merge_runner import BACKPRESSURE_FAILURES, MergeRunner
from .btree.columns import upsert_columns
from .overlay import AttributeOverlay, merge_scan
from .read_view import fallback_view, view_value, view_values
from . import replay
from .replay import MAX_TREE_REFRESH_ATTEMPTS, replaying

#: Merges one ``drain`` makes: what is frozen, the active overlay, and one more for each time another
#: handle's merge made this one rebuild tier 1 instead (as many as ``MAX_TREE_REFRESH_ATTEMPTS``).
MAX_DRAIN_MERGE_ATTEMPTS = 12
from .tree_index import TreeIndex

BACKPRESSURE_WAIT_SECONDS = 60.0  #: the longest an update waits for a merge to make room in tier 1
MAX_OPEN_ATTEMPTS = 10  #: opens and scans that met a concurrent retention or cut before giving up

_log = logging.getLogger("attrindex.segment")


class AttributeState:
    """The B+tree and tier 1 of one log, their lock-free read view, and their merge.

    ``lock``: the owner's lock (an ``RLock``), under which the owner moves the log's view and
    calls the methods documented "under the lock". ``caught_up``: called under the lock when a
    scan of the log's tail found batches (the owner wakes its readers)."""

    def __init__(self, log: SegmentLog, tree_name: str, options: Any, lock: threading.RLock, *,
                 caught_up: Callable[[], None] | None = None):
        self.name = log.segment
        self.tree_name = tree_name
        self.options = options
        self._log = log
        self._lock = lock
        self._caught_up = caught_up
        self._tree: TreeIndex | None = None  #: the B+tree once loaded (see ``tree``)
        self._loaded = False  #: tree opened and tier 1 replayed
        self._overlay = AttributeOverlay()  #: the active overlay
        self._frozen: AttributeOverlay | None = None  #: the overlay being merged
        self._frozen_at = 0  #: log position the frozen overlay covers up to (its merge's checkpoint)
        self._dirty_since = time.monotonic()  #: when the active overlay got its first update
        self._merged = threading.Condition(lock)  #: a merge ended (back-pressure waits on it)
        #: a catch-up stepped over log bytes tier 1 never replayed (another handle's cut) and the
        #: rebuild from the tree has not succeeded yet: tier 1 may hold values the tree has replaced,
        #: so nothing reads or merges it until one does (``catch_up``, ``settle``)
        self._stale = False
        #: The tree checkpoint tier 1 was built on: tier 1 holds the log's updates between it and
        #: the log's position. Tracked only where another handle may write a tree version that is
        #: not the log replayed up to its checkpoint (``AttributeIndex.bulk_load``: see
        #: ``track_base``); None: not tracked. See ``MergeRunner.merge``.
        self._base: int | None = None
        self._wrote = False  #: updates were applied through this handle (only writers merge on close)
        self._closed = False
        self.runner = MergeRunner(self.name, options, log.storage, tree_name)
        self.view: tuple = ()  #: what lock-free reads look at: see ``_publish``
        self._publish()

    # -- opening ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Open the tree and replay the log after its checkpoint into tier 1 (under the lock; the
        log's view is opened at the checkpoint). Retried while retention elsewhere removes what is
        being replayed."""
        tree = TreeIndex(self._log.storage, self.tree_name, **self.options.attribute_options)
        try:
            for attempt in range(MAX_OPEN_ATTEMPTS):
                try:
                    replay.open_at_checkpoint(self._log, tree, self._overlay, self._overlay_filled)
                    break
                except TruncatedError:  # retention elsewhere removed what was being replayed
                    if attempt + 1 == MAX_OPEN_ATTEMPTS:
                        raise RetriesExhaustedError(f"segment {self.name!r}: retention in another handle kept removing the "
                                                    f"log being replayed on open ({MAX_OPEN_ATTEMPTS} tries)") from None
                    tree.refresh()  # retention merged first: replay from its newer checkpoint
        except BaseException:
            tree.close()
            raise
        self._tree, self._loaded = tree, True
        self._publish()

    @property
    def loaded(self) -> bool:
        """Whether the tree is open and tier 1 replayed (a lazily opened owner loads on first use)."""
        return self._loaded

    @property
    def tree(self) -> TreeIndex:
        """The B+tree, loaded first if the owner opened lazily."""
        if not self._loaded:
            self.ensure_loaded()
        return self._tree  # type: ignore[return-value]

    def ensure_loaded(self) -> None:
        """Load the tree and tier 1 if the owner opened only the log's tail: idempotent,
        thread-safe (takes the lock, so callers holding the merge mutex keep the lock order). Its
        errors (a checkpoint beyond the log, lost commits) go to the caller that needed
        attributes; the next one retries."""
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self.check_open()  # a closed handle opens nothing
            tree = self._open_tree()
            try:
                for attempt in range(MAX_OPEN_ATTEMPTS):
                    try:
                        replayed = self._adopt_tree(tree)
                        break
                    # Retention or compaction elsewhere meanwhile. (A catch-up that resynced to its
                    # bound raises RetriesExhaustedError: passed up, not retried here.)
                    except (TruncatedError, LayoutChangedError):
                        if attempt + 1 == MAX_OPEN_ATTEMPTS:
                            raise RetriesExhaustedError(f"segment {self.name!r}: retention in another handle kept removing "
                                                        f"the log being replayed ({MAX_OPEN_ATTEMPTS} tries)") from None
                        tree.refresh()  # retention merged first: replay from its newer checkpoint
                        self._log.catch_up(None)
            except BaseException:
                tree.close()
                raise
            self._tree, self._loaded = tree, True
            self._publish()
            _log.debug("segment %r: attributes loaded at log byte %d; replayed %d batches after the checkpoint %d",
                       self.name, self._log.position, replayed, tree.checkpoint or 0)

    def _open_tree(self) -> TreeIndex:
        """The B+tree, opened from one live listing of its directory (it looks twice)."""
        storage = self._log.storage
        inner = storage.inner if isinstance(storage, ListedStorage) else storage  # (expired: the open is over)
        directory = rolling_dir(self.tree_name)
        listed = ListedStorage(inner, directory, inner.list_files(directory))
        try:
            return TreeIndex(listed, self.tree_name, **self.options.attribute_options)
        finally:
            listed.expire()  # later listings are live

    def _adopt_tree(self, tree: TreeIndex) -> int:
        """Tier 1 rebuilt for a tree opened after the log (``replay.adopt_tree``); return the batches
        replayed (published by the caller with the tree)."""
        self._overlay, replayed = replay.adopt_tree(self._log, tree)
        self._frozen = None
        self._dirty_since = time.monotonic()
        return replayed

    def track_base(self) -> None:
        """Track the tree version tier 1 was built on (under the lock, after ``open``): a merge
        then writes only over that version, and ``refresh`` rebuilds tier 1 over any other (for
        owners whose tree other handles may write without the log: ``AttributeIndex.bulk_load``)."""
        self._base = self.tree.checkpoint or 0

    # -- following the log -----------------------------------------------------------------------
    def catch_up(self) -> int:
        """Under the lock: read what other writers appended since the log's view last looked,
        replaying it into tier 1; return the batches seen.

        If another handle truncated the log past what tier 1 had replayed (retention, or
        ``truncate_merged_log`` after its merge), the updates cut are in the B+tree: refresh it
        and rebuild tier 1 from its checkpoint. So too if chunks not replayed to the end were
        replaced (log compaction drops the updates of the batches it rewrites: they are in the
        B+tree), which moved the log's position (``SegmentLog.resyncs``). If the scan fails after
        such a step, tier 1 is marked stale: rebuilt before any use (``settle``)."""
        log = self._log
        replayed, resyncs = log.position, log.resyncs
        loaded = self._loaded  # not yet: the lazy load replays from the tree up to the new position

        def stepped_over() -> bool:  # the scan moved past bytes it never replayed
            return loaded and (log.start_position > replayed or log.resyncs != resyncs)

        try:
            seen = self._scan_tail(replaying(self._overlay, 0, self.name, self._overlay_filled) if loaded else None)
        except BaseException:
            if stepped_over():  # the log's position moved past updates tier 1 lacks
                self._stale = True
                self._publish()
            raise
        if stepped_over() or self._stale:
            self._stale = True  # until the rebuild succeeds
            self._replay_from_tree(refresh_tree=True)
        if seen and self._caught_up is not None:
            self._caught_up()
        return seen

    def _scan_tail(self, visit) -> int:
        """``SegmentLog.catch_up``, listing again when another handle's truncation deleted a chunk
        between the scan's listing and its read (a merge elsewhere covers it): the scan restarts
        at the new start and ``catch_up`` rebuilds tier 1 from the tree."""
        for _attempt in range(MAX_OPEN_ATTEMPTS):
            try:
                return self._log.catch_up(visit)
            except TruncatedError:
                continue
        raise RetriesExhaustedError(f"segment {self.name!r}: other handles kept truncating the log while this handle read "
                                    f"its tail ({MAX_OPEN_ATTEMPTS} tries); try again")

    def refresh(self) -> None:
        """Under the lock, with the merge mutex held: pick up other handles' updates. The tree
        first: another handle may have merged and truncated the log below the new checkpoint,
        and what it cut is then in the tree. While the tree is still the version tier 1 was built
        on (``track_base``), catching up with the log is enough; any other version (another
        handle merged or bulk loaded, or an earlier refresh adopted it and then failed) rebuilds
        tier 1 from it: over a bulk load, tier 1's values from before it would shadow the loaded ones."""
        tree, log = self.tree, self._log
        tree.refresh()
        if (tree.checkpoint or 0) == self._base:
            seen = log.position
            self.catch_up()
            if log.start_position <= seen:  # nothing this handle had not replayed was cut
                return
        # Replay the log from the tree's newest version that covers its start (the overlay is
        # rebuilt aside). That rebuild is the one loop over tree versions (``from_newest_tree``).
        self.rebuild()

    def settle(self) -> None:
        """Under the lock: if a rebuild of tier 1 failed, rebuild it now (raises if it cannot)."""
        if self._stale:
            self.catch_up()  # (which rebuilds tier 1 while it is stale)

    def rebuild(self) -> None:
        """Under the lock: the tree covers more of the log than tier 1 had seen: catch up, replay after it."""
        self.catch_up()
        self._replay_from_tree()

    def _replay_from_tree(self, refresh_tree: bool = False) -> None:
        """Tier 1 rebuilt from the log between the tree's checkpoint and the log's position
        (``refresh_tree``: the tree's newest version read first).

        If another handle truncated the log past the checkpoint (it merged further, then cut),
        what it cut is in a newer version of the tree: adopt that first. Replaying from the log's
        start over the older version would lose the updates in between (reads went back). Such a
        cut may also land during the replay (two writers merging and truncating one log): the
        read then lists the log again and raises ``TruncatedError``; the newer tree version holds
        what was cut, so the rebuild starts over from it (bounded). Chunks switched under the
        replay (``LayoutChangedError``) are taken in by a scan of the tail before it starts over
        likewise.

        A failure leaves tier 1 as it was: whole, unless the caller marked it stale (its catch-up
        stepped over log bytes that tier 1 never replayed). Then reads and conditions rebuild
        first (raising while they cannot), and nothing stale is frozen and merged into the tree."""
        try:
            if refresh_tree:
                self.tree.refresh()
            for _attempt in range(MAX_TREE_REFRESH_ATTEMPTS):
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
                self._overlay, self._frozen, self._stale = rebuilt, None, False
                if self._base is not None:
                    self._base = base
                self._publish()  # one swap: a reader never pairs the rebuilt overlay with the old frozen one
                self._dirty_since = time.monotonic()
                return
            raise RetriesExhaustedError(f"segment {self.name!r}: other handles kept merging and truncating the log while "
                                        f"this handle rebuilt its pending attribute updates from the B+tree "
                                        f"({MAX_TREE_REFRESH_ATTEMPTS} tries); try again")
        finally:
            if self._stale:
                self._publish()  # reads rebuild first from now on, never serving the stale values

    def _replayed_from_newest_tree(self) -> tuple[AttributeOverlay, int]:
        """One try of ``_replay_from_tree`` (``replay.from_newest_tree``)."""
        return replay.from_newest_tree(self._log, self.tree)

    # -- updates ---------------------------------------------------------------------------------
    def apply(self, keys: list[bytes], values: list[int | None]) -> None:
        """Under the lock, once the batch holding these updates is durable: put them in the active
        overlay, visible to reads before the caller is told (never raises)."""
        if not len(self._overlay):
            self._dirty_since = time.monotonic()  # flush_seconds counts from here
            self.runner.wake()
        self._overlay.apply(keys, values)
        self._overlay_filled()

    def after_durable(self) -> None:
        """Under the lock, after a durable write through this handle: start the merge thread,
        freeze tier 1 if it is due. Never raises (the write is durable)."""
        self._wrote = True
        if not self.runner.started and not self.runner.stopping:
            self.runner.start(self, AttributeState._merge_lap)
        if self._frozen is None and self._merge_due():
            self._freeze()

    def wait_for_room(self) -> None:
        """Back-pressure (under the lock, before an update): while tier 1 holds more than
        ``max_pending_bytes``, wait for the merge, at most ``BACKPRESSURE_WAIT_SECONDS``; a merge
        that is slow but works then lets the update go on (logged). A merge that keeps failing
        while tier 1 is over the limit refuses the update with ``MergeBacklogError`` before
        anything is written, so memory stays bounded: ``BACKPRESSURE_FAILURES`` failures in a row
        (one recorded when the wait began counts) raise; fewer only delay the update."""
        limit, runner = self.options.max_pending_bytes, self.runner
        if self.pending_bytes() <= limit or not runner.started:
            return
        deadline = time.monotonic() + BACKPRESSURE_WAIT_SECONDS
        seen = runner.error  # each failure is a new exception object; a success clears it
        failures = 0 if seen is None else 1
        while self.pending_bytes() > limit and not runner.stopping:
            error = runner.error
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
                             "for the merge; appending anyway", self.name, self.pending_bytes(), limit,
                             BACKPRESSURE_WAIT_SECONDS)
                return
            self._merged.wait(remaining)

    def _backlog_error(self, error: BaseException) -> MergeBacklogError:
        exc = MergeBacklogError(
            f"segment {self.name!r}: refused, nothing was written: the pending attribute updates hold "
            f"{self.pending_bytes()} bytes, over max_pending_bytes ({self.options.max_pending_bytes}), and merging "
            f"them into the B+tree keeps failing ({type(error).__name__}: {error}). Every update acknowledged before "
            f"is durable in the log; retry once the cause is fixed")
        exc.__cause__ = error
        return exc

    # -- reads -----------------------------------------------------------------------------------
    def _publish(self) -> None:
        """Publish what reads look at, in ONE assignment of ``view`` (under the lock): see
        ``read_view``. Called whenever a part is replaced: a freeze, the end of a merge (after the
        tree and its recent values hold the frozen overlay's values, so a read never goes back), a
        rebuild of tier 1, the lazy load, and close (a view whose lookups raise). Updates change
        the active overlay's dicts in place: they publish only when they fill an empty one
        (``_overlay_filled``), before anyone is told of them."""
        if self._closed:
            view = fallback_view(self._closed_read, self._closed_read)
        elif not self._loaded or self._stale:  # the first read loads or rebuilds
            view = fallback_view(self._load_and_get, self._load_and_get_many)
        else:
            frozen, overlay = self._frozen, self._overlay
            view = (overlay.lookup if overlay.recent_count else None, overlay.settled,
                    None if frozen is None else frozen.lookup, None if frozen is None else frozen.settled,
                    *self._tree.lookups())  # type: ignore[union-attr]
        self.view = view

    def _overlay_filled(self) -> None:
        """After updates were applied to the active overlay (under the lock, before they are
        acknowledged): fold it when due, and publish it if the view does not show its parts (it
        skips an empty recent part; a fold replaces both)."""
        overlay = self._overlay
        if overlay.fold_due:
            overlay.fold()
        if not self._loaded:
            return  # (while opening: the open publishes when it is done)
        view = self.view
        if view[0] is not (overlay.lookup if overlay.recent_count else None) or view[1] is not overlay.settled:
            self._publish()

    def value(self, key: bytes) -> int | None:
        """The current value of a canonical key, without a lock (from one read view)."""
        return view_value(self.view, key)

    def values(self, keys: list[bytes]) -> list[int | None]:
        """The current values of canonical keys, in order, without a lock (from one read view)."""
        return view_values(self.view, keys)

    def _closed_read(self, _keys: object) -> object:
        raise InvalidInputError(f"segment {self.name!r} handle is closed")

    def _load_and_get(self, key: bytes) -> int | None:
        """A lazily opened owner's first read, or the first after a failed rebuild of tier 1: load
        or rebuild (which publishes the view; raises if it cannot)."""
        self.ensure_loaded()
        with self._lock:  # the new view is published under the lock: read it, not the old one
            self.settle()
            return view_value(self.view, key)

    def _load_and_get_many(self, keys: list[bytes]) -> list[int | None]:
        self.ensure_loaded()
        with self._lock:
            self.settle()
            return view_values(self.view, keys)

    def items(self, low: bytes | None, high: bytes | None) -> Iterator[tuple[bytes, int]]:
        """``(key, value)`` with ``low <= key < high`` ascending: tier 1 merged over the B+tree."""
        with self._lock:  # snapshots: updates and merges may follow
            self.ensure_loaded()
            self.settle()
            overlay = self._overlay.snapshot_items(low, high)
            frozen = None if self._frozen is None else self._frozen.snapshot_items(low, high)
        # The tree's scan starts later, from whatever version is current then: a merge meanwhile
        # only moves into it what the frozen snapshot holds anyway.
        tree = self.tree.items(low, high)
        return merge_scan(overlay, merge_scan(frozen, tree) if frozen is not None else tree)

    def pending_columns(self) -> tuple:
        """Under the lock: every key of tier 1 ascending with its newest value, as columns
        (``AttributeOverlay.sorted_columns``), the active overlay over the frozen one."""
        active = self._overlay.sorted_columns()
        if self._frozen is None:
            return active
        return upsert_columns(*self._frozen.sorted_columns(), *active)

    def pending_snapshot(self) -> tuple[tuple, tuple]:
        """Under the lock: ``(state, columns)``: what tier 1 and the tree depend on (the log's
        position, the tree's version, the overlays) and tier 1's entries (``pending_columns``)."""
        frozen, overlay = self._frozen, self._overlay
        state = (self._log.position, self.tree.version.footer_offset, id(overlay), len(overlay),
                 id(frozen), 0 if frozen is None else len(frozen))
        return state, self.pending_columns()

    @property
    def pending_keys(self) -> int:
        """Keys in tier 1 (both overlays: a key in both counts twice)."""
        frozen = self._frozen
        return len(self._overlay) + (0 if frozen is None else len(frozen))

    def pending_bytes(self) -> int:
        """The estimated memory of tier 1 (both overlays), against ``max_pending_bytes``."""
        frozen = self._frozen
        return self._overlay.nbytes + (0 if frozen is None else frozen.nbytes)

    # -- merging -----------------------------------------------------------------------------------
    def _merge_due(self) -> bool:
        """Whether the active overlay should be frozen and merged now (thresholds on keys, bytes
        and the age of its first update)."""
        overlay, options = self._overlay, self.options
        if len(overlay) >= options.flush_keys or overlay.nbytes >= options.flush_bytes:
            return True
        return bool(len(overlay)) and time.monotonic() - self._dirty_since >= options.flush_seconds

    def _needs_merge(self, force: bool) -> bool:
        """For ``drain``: whether there is anything to merge (``force``: the checkpoint too)."""
        position, covered = self._log.position, self.tree.checkpoint or 0
        if len(self._overlay) or covered > position:
            return True
        return covered < position and (force or position - covered >= self.options.log_rolling_size)

    def _freeze(self) -> None:
        """Hand the active overlay to the merge: it becomes the frozen one, covering the log up to
        its position; a fresh overlay takes new updates. Not while tier 1 is stale (a failed
        rebuild): merged, its old values would replace newer ones in the tree. The merge thread,
        woken, rebuilds it first (``settle``); so do ``flush`` and ``close``."""
        if self._stale:
            self.runner.wake()
            return
        self._frozen, self._frozen_at = self._overlay, self._log.position
        self._overlay = AttributeOverlay()
        self._publish()  # before the lock is let go: no update lands in an unpublished overlay
        self._dirty_since = time.monotonic()
        self.runner.wake()

    def _fold_active(self) -> None:
        """Under the lock and the merge mutex: the active overlay's entries go into the frozen one,
        which then covers the log up to its position, so one merge takes both (a dense merge costs
        the same for more keys). Readers see the same values: the active overlay shadows the
        frozen one until the view without it is published."""
        self._frozen.absorb(self._overlay)  # type: ignore[union-attr]
        self._frozen_at = self._log.position
        self._overlay = AttributeOverlay()
        self._publish()

    def _merge_once(self, background: bool = False) -> None:
        """Merge the frozen overlay into the B+tree with checkpoint = the log position at the
        freeze (merge mutex held; ``background``: by the merge thread, which may hand it to the
        worker process). Raises the merge's error after recording it."""
        with self._lock:
            frozen, at, base = self._frozen, self._frozen_at, self._base
            if frozen is None or self._closed:
                return
        runner = self.runner
        try:
            merged = runner.merge(self.tree, frozen, at, base, background)
            with self._lock:
                if not merged:  # another handle merged further: tier 1 restarts from its checkpoint
                    self.rebuild()
                elif self._frozen is frozen:  # (a rebuild meanwhile replaced it: nothing to drop)
                    # Dropped only now: the tree and its recent values hold its values already.
                    self._frozen = None
                    self._publish()
                    if self._base is not None:
                        self._base = at  # the active overlay holds the log from ``at`` on
                runner.succeeded()
                self._merged.notify_all()
        except Exception as exc:
            with self._lock:
                runner.error = exc
                self._merged.notify_all()
            raise
        _log.debug("segment %r: merged %d attribute updates into the B+tree up to log byte %d", self.name,
                   len(frozen), at)
        self._truncate_merged()

    def _truncate_merged(self) -> None:
        """With ``truncate_merged_log``: delete the log below the chunk holding the tree's
        checkpoint (``truncate_merged``). Best effort: a failure leaves more log, which is harmless."""
        if self.options.truncate_merged_log:
            truncate_merged(self._log, self._lock, lambda: self._closed, lambda: self.tree.checkpoint or 0)

    def drain(self, *, force: bool = False) -> None:
        """Merge everything tier 1 holds, in the calling thread (merge mutex held; the lock may be
        held too: retention keeps appends out between the merge and its cut): what is frozen and
        the active overlay together, in one merge (``_fold_active``). A merge that finds the tree written by another handle
        rebuilds tier 1 from it instead; the rebuilt tier 1 is merged in the next lap (bounded:
        other handles that keep merging leave the rest to the next merge). ``force``: move the
        checkpoint to the log's position even with nothing pending. Raises a merge's error."""
        self.ensure_loaded()  # a lazily opened owner: what it merges is the log after the tree
        with self._lock:
            target = self._log.position  # what this handle has seen: in the tree once drained
        for _lap in range(MAX_DRAIN_MERGE_ATTEMPTS):
            with self._lock:
                self.settle()  # (raises if tier 1 cannot be rebuilt: nothing stale is merged)
                if self._frozen is None:
                    if not self._needs_merge(force):
                        self._dirty_since = time.monotonic()
                        return
                    self._freeze()
                elif len(self._overlay):
                    self._fold_active()
            self._merge_once()
        if (self.tree.checkpoint or 0) >= target:
            return  # other handles' merges took in everything this handle had seen
        raise RetriesExhaustedError(f"segment {self.name!r}: other handles kept merging into the B+tree while this handle "
                                    f"merged its pending updates ({MAX_DRAIN_MERGE_ATTEMPTS} merges); the tree covers the log up "
                                    f"to byte {self.tree.checkpoint or 0}, not {target}. The updates are durable in "
                                    f"the log and merged later; try again")

    def flush(self) -> None:
        """Merge every update seen so far into the B+tree now (takes the merge mutex; not the lock).
        Raises the merge's error (for example ``StorageFullError``); the updates stay in tier 1
        and in the log, and a later flush or the background merge retries."""
        self.check_open()
        with self.runner.merging():
            self.check_open()
            self.drain()

    def _merge_lap(self, pause: float) -> tuple[float, float | None] | None:
        """One lap of the background merge (the runner's thread): merge the frozen overlay
        (freezing the active one if it is due), or say how long to sleep. Returns ``(pause,
        sleep)`` (``sleep`` None: until woken), or None once the state stops. A failure is
        recorded and logged, and retried after a pause (``MergeRunner.failed``)."""
        runner = self.runner
        with self._lock:
            if runner.stopping:
                return None
            now = time.monotonic()
            if now < runner.retry_at:
                return pause, runner.retry_at - now
            if self._frozen is None and self._merge_due():
                self._freeze()
            if self._frozen is None and not self._stale:
                if len(self._overlay) and self.options.flush_seconds != float("inf"):
                    return pause, max(self._dirty_since + self.options.flush_seconds - now, 0.001)
                return pause, None
        try:
            with runner.merging():
                with self._lock:
                    self.settle()
                self._merge_once(background=True)
            return 0.0, 0.0
        except Exception as exc:  # noqa: BLE001 - recorded; flush() and close() raise it
            if runner.stopping:  # (close killed the worker under this merge: close merges it itself)
                _log.debug("segment %r: the background merge ended by close: %s", self.name, exc)
                return None
            pause = runner.failed(pause)
            _log.warning("segment %r: merging attribute updates into the B+tree failed in the background "
                         "(retried in %.2f s; flush() raises it): %s", self.name, pause, exc, exc_info=True)
            return pause, 0.0

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"segment {self.name!r} handle is closed")

    def close(self, *, merge: bool = True) -> None:
        """Stop the background merge, merge what this handle wrote into the B+tree (raising the
        merge's error if it fails: the updates stay in the log, replayed on open) and release the
        tree. Takes the merge mutex and the lock: the caller holds neither. ``merge=False``:
        closed at once (reads raise from then on, no merge starts), what is pending left in the
        log; a merge already writing is waited for. The caller closes the log after."""
        with self._lock:
            if self._closed:
                return
            if not merge:
                self._closed = True
                self._publish()  # reads from now on raise
            thread = self.runner.stop()
            self._merged.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self.runner.merging(), self._lock:
            if merge and self._closed:
                return  # closed by another thread meanwhile
            try:
                if merge and self._wrote:  # a handle that only read leaves the merge to the writers
                    self.drain()
            finally:
                self._closed = True
                self._publish()
                self._merged.notify_all()
                self.runner.close()
                if self._tree is not None:  # (a lazy owner that never needed attributes has none)
                    self._tree.close()

    def stats(self) -> dict:
        """Under the lock: the state's part of its owner's stats."""
        error = self.runner.error
        return dict(pending_attributes=self.pending_keys, attribute_checkpoint=self.tree.checkpoint,
                    attributes=self.tree.stats(), merge_error=None if error is None else f"{type(error).__name__}: {error}",
                    pending_bytes=self.pending_bytes(), merges=self.runner.merges)


def truncate_merged(log: SegmentLog, lock: threading.RLock, closed: Callable[[], bool],
                    covered: Callable[[], int]) -> None:
    """Delete ``log`` below the chunk holding the checkpoint ``covered()`` (never above it). The
    lock is held only to plan and to update the log's view: the durable marker and the deletions
    run beside appends (they write at the end, far above the cut). Best effort: a failure is
    logged and the next merge tries again."""
    with lock:
        if closed():
            return
        checkpoint = covered()
        holder = max((c for c in log.bytes.chunks() if c.start <= checkpoint), key=lambda c: c.start, default=None)
        cut = holder.start if holder is not None else 0
        if cut <= log.start_position or cut > log.position:
            return
        derived = log.derived_below(cut)
    try:
        log.bytes.truncate(cut, expected=holder.name)
    except Exception as exc:  # noqa: BLE001 - the merge is done; the next one tries again
        _log.warning("segment %r: truncating the merged log below byte %d failed (retried after the "
                     "next merge): %s", log.segment, cut, exc)
        return
    with lock:
        if not closed():
            log.forget_below(cut)
    log.delete_derived(derived)
    _log.debug("segment %r: truncated the merged log below byte %d", log.segment, cut)


__all__ = ["AttributeState", "BACKPRESSURE_WAIT_SECONDS", "MAX_OPEN_ATTEMPTS"]
