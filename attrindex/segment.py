"""``Segment``: an append-only record log whose appends carry conditional attribute updates.

The log is the single source of truth. Every append is one record batch holding the records and
the *resolved* attribute values (the result of checking the conditions), written by one
compare-and-append at the log position this handle last saw. So the check and the write are
atomic: a writer that loses the race catches up from the log tail, re-validates and retries.

Attribute state = the B+tree (a checkpoint of the state up to a log position, stored in its
footer) + tier 1, sorted overlays of the values in the log after that position. Tier 1 is merged
into the tree in large sorted batches by a background thread (``attrindex.segment_merge``);
opening a segment reads the tree's footer and replays the log after its checkpoint. Concurrent
appends of one handle are group-committed (``attrindex.write_queue``): one storage append each
group, each call keeping its own batch, result and errors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping  # (isinstance checks: typing.Mapping's is ~5x slower)
from itertools import compress, repeat
from operator import is_
from typing import Any, Iterable, Iterator

import attrs

from storage_adapters.rolling import SEGMENT_SUFFIX

from .tree_index import TreeIndex
from .conditional import AttributeUpdate, UpdateType, resolve_updates
from .errors import (BadOffsetError, ChunkExistsError, ConditionalUpdateError, CorruptDataError, HoleError,
                     InvalidInputError, LayoutChangedError, LayoutConflictError, RecordTruncatedError, StorageError,
                     TruncatedError)
from .keys import canonical_batch, pair_list, to_key, to_keys
from .log.batch.compression import Codec, codec_for
from .log.batch.encode import encode_batch, encode_batch_with_header, new_batch_id, rebase_batch
from .log.batch.header import read_header
from .log.batch.records import Record, record_list
from .log.segment_log import DEFAULT_INDEX_INTERVAL_BYTES, DEFAULT_LOG_ROLLING_SIZE, SegmentLog
from .log.retention import plan_retention
from .log import cleanup_policy as _policy
from .log.cleaner import DEFAULT_MAX_MAP_KEYS, CompactionStats, LogCleaner
from .listing import ListedStorage
from .merge_worker import DEFAULT_HANG_SECONDS
from .overlay import AttributeOverlay, merge_scan, probe_many
from .poller import SegmentPoller
from .replay import replay_range, replaying
from .reader import SegmentReader
from .segment_merge import BACKPRESSURE_WAIT_SECONDS, MERGE_RETRY_MIN_SECONDS, MERGE_RETRY_SECONDS, BackgroundMerge
from .value_cache import MISSING, ValueCache
from .write_queue import WriteQueue, WriteRequest

ATTRIBUTES_NAME = "_attributes"
DEFAULT_FLUSH_KEYS = 250_000
DEFAULT_FLUSH_BYTES = 64 << 20
DEFAULT_FLUSH_SECONDS = 30.0
DEFAULT_READ_BYTES = 8 << 20  # one GET per 8 MiB of a consolidated log on object stores
DEFAULT_MIN_POLL_INTERVAL = 0.05  #: a tail reader's first poll after records came
DEFAULT_MAX_POLL_INTERVAL = 1.0  #: ... backing off to this: an idle reader costs 1 request/s
MAX_OPEN_ATTEMPTS = 10  #: opens that met a concurrent retention before giving up
MAX_APPEND_RACES = 10_000  #: lost compare-and-append races in a row before an append gives up
DEFAULT_MAX_PENDING_BYTES = 256 << 20
MAX_GROUP_BYTES = 4 << 20  #: about this much of concurrent appends is written as one group
MAX_GROUP_REQUESTS = 4096  #: appends in one group at most

_log = logging.getLogger("attrindex.segment")

# The recent values of a read view that holds nothing (a closed handle's, or one whose attributes
# are not loaded yet): every key falls through to the view's tree lookups, which raise or load.
_NO_VALUES = ValueCache(0)  # capacity 0: never holds a value


@attrs.frozen
class AppendResult:
    """Where an append landed: the offsets of its first and last records.

    An append of attribute updates only has no records: ``first_offset == last_offset + 1``, the
    offset the next record will get.
    """

    first_offset: int
    last_offset: int

    @property
    def record_count(self) -> int:
        return self.last_offset - self.first_offset + 1


@attrs.frozen
class SegmentOptions:
    """Tuning of a segment handle (all have defaults; see ``SegmentStore.open``)."""

    log_rolling_size: int = DEFAULT_LOG_ROLLING_SIZE
    index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES
    codec: Codec = attrs.field(default=Codec.NONE, converter=codec_for)
    flush_keys: int = DEFAULT_FLUSH_KEYS
    flush_bytes: int = DEFAULT_FLUSH_BYTES
    flush_seconds: float = DEFAULT_FLUSH_SECONDS
    poll_interval: float | None = None  #: if set: a fixed interval (min = max = it), the old behaviour
    attribute_options: dict = attrs.field(factory=dict)
    #: Appends wait (back-pressure) while tier 1 (the overlay being filled plus the one being
    #: merged) holds more than this many bytes, until the background merge makes room.
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    #: After each merge, delete the log below the chunk holding the B+tree's checkpoint (records
    #: there are lost: for logs kept only as a write-ahead log of the attributes).
    truncate_merged_log: bool = False
    min_poll_interval: float = DEFAULT_MIN_POLL_INTERVAL
    max_poll_interval: float = DEFAULT_MAX_POLL_INTERVAL
    #: Merge tier 1 into the B+tree in a worker process (local disk only; elsewhere in a thread):
    #: the merge's CPU then never holds this process's GIL, so appends keep their latency. The
    #: worker replays the log itself, which assumes no log compaction rewrites batches meanwhile
    #: (so segments default to the thread; ``AttributeIndex`` turns it on).
    merge_process: bool = False
    #: With ``merge_process``: a worker that makes no progress (no CPU time, no read or write of its
    #: merging thread) this many seconds is hung: it is killed and the merge retried, so appends
    #: waiting for room in tier 1 wait about this long at most behind it (``attrindex.merge_worker``).
    merge_hang_seconds: float = DEFAULT_HANG_SECONDS

    def poll_intervals(self) -> tuple[float, float]:
        """``(min, max)`` seconds between a waiting reader's polls for other handles' appends."""
        if self.poll_interval is not None:
            return self.poll_interval, self.poll_interval
        return self.min_poll_interval, self.max_poll_interval


@attrs.frozen
class SegmentStats:
    """A snapshot of a segment's log and attribute state, as this handle sees it."""

    name: str
    start_offset: int
    next_offset: int
    #: bytes the log's chunks hold in storage: the stored length of every chunk in this handle's
    #: view, counted whole (a chunk the truncation offset cuts through is still stored whole), and
    #: nothing for holes (the empty tail of a replacement chunk that log compaction left)
    log_bytes: int
    log_chunks: int
    max_timestamp: int | None
    pending_attributes: int  #: keys in tier 1 not yet merged into the B+tree
    attribute_checkpoint: int | None  #: log byte position the B+tree covers
    attributes: Any  #: ``IndexStats`` of the B+tree
    merge_error: str | None = None  #: why the last merge of tier 1 after an append failed (None: it did not)
    pending_bytes: int = 0  #: estimated memory of tier 1 (both overlays), against ``max_pending_bytes``
    merges: int = 0  #: merges of tier 1 into the B+tree this handle made
    append_groups: int = 0  #: durable writes of appends made by this handle (group commit: one per group)
    appends_grouped: int = 0  #: appends written in those groups
    #: requests made so far through the storage this segment is on (shared by its store), by kind
    requests: Any = None


class Segment(BackgroundMerge):
    """One segment: records with offsets 0, 1, 2, ... and attributes (16-byte key -> int64).

    Get one from ``SegmentStore.segment``. Every method is safe to call from several threads;
    several handles and processes may append to one segment (compare-and-append serialises them).
    Reads see this handle's view, which moves with its own appends and with ``refresh()``.
    """

    def __init__(self, storage, name: str, options: SegmentOptions, *, tree_name: str | None = None,
                 lazy_attributes: bool = False):
        """``tree_name``: the segment name of the attributes' B+tree (default ``NAME/_attributes``;
        the plain ``AttributeIndex`` keeps its tree at its own name and this log as its WAL).
        ``lazy_attributes``: open only the log's tail now (its last chunk: the next offset) and load
        the attribute state (the B+tree's footer, the log replayed after its checkpoint) when
        first needed; ``SegmentStore`` asks for it on object stores, where each is a request."""
        self.name = name
        self.options = options
        self._lock = threading.RLock()
        self._appended = threading.Condition(self._lock)
        self._log = SegmentLog(storage, name, rolling_size=options.log_rolling_size,
                               index_interval_bytes=options.index_interval_bytes)
        self.tree_name = f"{name}/{ATTRIBUTES_NAME}" if tree_name is None else tree_name
        self._tree: TreeIndex | None = None  #: the attributes' B+tree once loaded (see ``_index``)
        self._attributes_loaded = False  #: tree opened and tier 1 replayed (``_ensure_attributes``)
        # Tier 1 is two overlays (LevelDB's memtable and immutable memtable): appends go to the
        # active one; a full one is frozen and merged into the B+tree by a background thread while
        # a fresh active one takes new appends. Reads look in active, then frozen, then the tree.
        self._overlay = AttributeOverlay()
        self._frozen: AttributeOverlay | None = None
        self._frozen_at = 0  #: log position the frozen overlay covers up to (its merge's checkpoint)
        self._dirty_since = time.monotonic()  #: when the active overlay got its first update
        self._merged = threading.Condition(self._lock)  #: a merge ended (back-pressure waits on it)
        self._wake = threading.Event()  #: wakes the merge thread (an event: a wake-up is never missed)
        self._merge_retry_at = 0.0  #: after a failed background merge, the thread waits until then
        self._merge_mutex = threading.Lock()  #: one merge at a time; taken before ``_lock``, never inside it
        self._merger: threading.Thread | None = None  #: started by the first append
        self._stopping = False
        self._merges = 0
        self._merge_error: BaseException | None = None  #: the last failed merge (None after a success)
        #: a catch-up stepped over log bytes tier 1 never replayed (another handle's cut) and the
        #: rebuild from the tree has not succeeded yet: tier 1 may hold values the tree has replaced,
        #: so nothing reads or merges it until one does (``_catch_up``, ``_settle_tier1``)
        self._tier1_stale = False
        self._worker = None  #: the merge worker process host (``merge_process``), made by the first merge
        self._worker_disabled = False  #: no worker process could be started: merges run in this process
        self._queue = WriteQueue(MAX_GROUP_BYTES, MAX_GROUP_REQUESTS)
        self._wrote = False  #: whether this handle appended (only writers merge tier 1 on close)
        self._closed = False
        self._poller: SegmentPoller | None = None  #: made by the first reader that waits
        self._view: tuple = ()  #: what lock-free reads look at: see ``_publish_view``
        with self._lock:
            if lazy_attributes:
                self._open_tail()
                self._publish_view()
                return
            self._tree = TreeIndex(storage, self.tree_name, **options.attribute_options)
            for attempt in range(MAX_OPEN_ATTEMPTS):
                try:
                    self._open()
                    break
                except TruncatedError:  # retention elsewhere removed what was being replayed
                    if attempt + 1 == MAX_OPEN_ATTEMPTS:
                        raise StorageError(f"segment {self.name!r}: retention in another handle kept removing the "
                                           f"log being replayed on open ({MAX_OPEN_ATTEMPTS} tries)") from None
                    self._tree.refresh()  # retention merged first: replay from its newer checkpoint
            self._attributes_loaded = True
            self._publish_view()

    # -- opening and catching up ---------------------------------------------------------------
    @property
    def _index(self) -> TreeIndex:
        """The attributes' B+tree, loaded first if this handle opened lazily."""
        if not self._attributes_loaded:
            self._ensure_attributes()
        return self._tree  # type: ignore[return-value]

    def _open(self) -> None:
        """Read the tree's checkpoint and replay the log after it into tier 1."""
        checkpoint = self._tree.checkpoint or 0  # type: ignore[union-attr]
        self._overlay.clear()
        resyncs = self._log.resyncs
        self._log.open_at(checkpoint)
        # Checked on the view open_at just listed, not an older one: another handle may have merged
        # past this tree version and truncated the log below its new checkpoint since the tree was
        # read, and open_at would then start at the log's new start, silently skipping the updates
        # in between (they are in the newer tree version only).
        if checkpoint < self._log.start_position:
            self._tree.refresh()  # type: ignore[union-attr]
            if (self._tree.checkpoint or 0) != checkpoint:  # type: ignore[union-attr]
                raise TruncatedError(self.name, checkpoint, 0, self._log.start_position, self._log.bytes.length)
            if self._log.bytes.length > self._log.start_position:
                raise self._lost_between_error(checkpoint)
        replayed = self._log.catch_up(self._replayer(checkpoint), refresh=False)
        if self._log.resyncs != resyncs or any(c.generation and c.end > checkpoint for c in self._log.bytes.chunks()):
            # Chunks above this tree version's checkpoint were rewritten (log compaction drops the
            # attribute updates of batches below its limit, a newer tree checkpoint) since the tree
            # was read: the replay may have missed updates only a newer tree version holds.
            self._tree.refresh()  # type: ignore[union-attr]
            if (self._tree.checkpoint or 0) != checkpoint:  # type: ignore[union-attr]
                raise TruncatedError(self.name, checkpoint, 0, self._log.start_position, self._log.bytes.length)
        if checkpoint > self._log.bytes.length:
            raise self._beyond_log_error(checkpoint)
        _log.debug("segment %r: opened at log byte %d; replayed %d batches after the attribute checkpoint %d",
                   self.name, self._log.position, replayed, checkpoint)

    def _lost_between_error(self, checkpoint: int) -> CorruptDataError:
        return CorruptDataError(
            f"segment {self.name!r}: the attribute index covers the log up to byte {checkpoint}, but the log "
            f"starts at {self._log.start_position}: attribute updates in between are lost",
            segment=self.name, offset=checkpoint)

    def _beyond_log_error(self, checkpoint: int) -> CorruptDataError:
        return CorruptDataError(
            f"segment {self.name!r}: the attribute index covers the log up to byte {checkpoint}, beyond the "
            f"log's committed length {self._log.bytes.length}: committed log data was lost. The segment "
            f"refuses appends until repaired: see SegmentStore.verify_segment / repair_segment",
            segment=self.name, offset=self._log.bytes.length)

    # -- lazy opening (object stores: docs/segments.md, "Opening") -------------------------------
    def _open_tail(self) -> None:
        """Open only the log's last chunk (its first header gives the next offset; one request on an
        object store), scanning it to the end; the attributes wait for ``_ensure_attributes``."""
        for attempt in range(MAX_OPEN_ATTEMPTS):
            try:
                self._log.open_at(self._log.bytes.length)  # the end lies in the last chunk
                self._log.catch_up(None, refresh=False)
                return
            except (TruncatedError, LayoutChangedError):  # retention or a chunk switch elsewhere: look again
                if attempt + 1 == MAX_OPEN_ATTEMPTS:
                    raise StorageError(f"segment {self.name!r}: other handles kept removing or replacing the log's "
                                       f"last chunk while it was opened ({MAX_OPEN_ATTEMPTS} tries)") from None

    def _ensure_attributes(self) -> None:
        """Load the attribute state if this handle opened lazily: idempotent, thread-safe (takes
        ``_lock``, so callers holding ``_merge_mutex`` keep the lock order). Its errors (a checkpoint
        beyond the log, lost commits) go to the caller that needed attributes; the next one retries."""
        if self._attributes_loaded:
            return
        with self._lock:
            if self._attributes_loaded:
                return
            self._check_open()  # a closed handle opens nothing
            tree = self._open_tree()
            try:
                for attempt in range(MAX_OPEN_ATTEMPTS):
                    try:
                        replayed = self._adopt_tree(tree)
                        break
                    except (TruncatedError, LayoutChangedError):  # retention or compaction elsewhere meanwhile
                        if attempt + 1 == MAX_OPEN_ATTEMPTS:
                            raise StorageError(f"segment {self.name!r}: retention in another handle kept removing "
                                               f"the log being replayed ({MAX_OPEN_ATTEMPTS} tries)") from None
                        tree.refresh()  # retention merged first: replay from its newer checkpoint
                        self._log.catch_up(None)
            except BaseException:
                tree.close()
                raise
            self._tree, self._attributes_loaded = tree, True
            self._publish_view()
            _log.debug("segment %r: attributes loaded at log byte %d; replayed %d batches after the checkpoint %d",
                       self.name, self._log.position, replayed, tree.checkpoint or 0)

    def _open_tree(self) -> TreeIndex:
        """The attributes' B+tree, opened from one live listing of its directory (it looks twice)."""
        storage = self._log.storage
        inner = storage.inner if isinstance(storage, ListedStorage) else storage  # (expired: the open is over)
        directory = self.tree_name + SEGMENT_SUFFIX
        listed = ListedStorage(inner, directory, inner.list_files(directory))
        try:
            return TreeIndex(listed, self.tree_name, **self.options.attribute_options)
        finally:
            listed.expire()  # later listings are live

    def _adopt_tree(self, tree: TreeIndex) -> int:
        """The checks of ``_open`` for a tree opened after the log, then tier 1 rebuilt from the log
        between its checkpoint and this handle's CURRENT position (readers moved it since the
        open); return the batches replayed."""
        log = self._log
        for _attempt in range(MAX_OPEN_ATTEMPTS):
            checkpoint = tree.checkpoint or 0
            if checkpoint > log.position:  # others merged past this handle's view: look at the log's tail
                log.catch_up(None)
            if not (checkpoint < log.start_position and log.bytes.length > log.start_position):
                break
            # The log's view is newer than the tree: retention elsewhere merged first, then cut.
            tree.refresh()
            if (tree.checkpoint or 0) == checkpoint:
                raise self._lost_between_error(checkpoint)
        else:
            raise StorageError(f"segment {self.name!r}: retention in another handle kept moving the log's start "
                               f"while the attributes were loaded ({MAX_OPEN_ATTEMPTS} tries)")
        if checkpoint > log.bytes.length:
            raise self._beyond_log_error(checkpoint)
        rebuilt, replayed = replay_range(log, max(checkpoint, log.start_position), log.position)
        self._overlay, self._frozen = rebuilt, None  # published by the caller with the tree
        self._dirty_since = time.monotonic()
        return replayed

    def _replayer(self, since: int):
        """The visitor that replays the log's batches from ``since`` into tier 1 as it is scanned."""
        return replaying(self._overlay, since, self.name, self._overlay_filled)

    def _catch_up(self) -> int:
        """Read what other writers appended since this handle last looked; return batches seen.

        If another handle truncated the log past what this one had replayed (retention, or
        ``truncate_merged_log`` after its merge), the updates cut are in the B+tree: refresh it
        and rebuild tier 1 from its checkpoint. So too if chunks this handle had not replayed to the
        end were replaced (log compaction drops the updates of the batches it rewrites: they are in
        the B+tree), which moved the log's position (``SegmentLog.resyncs``). If the scan fails
        after such a step, tier 1 is marked stale (``_tier1_stale``): rebuilt before any use."""
        replayed, resyncs = self._log.position, self._log.resyncs
        loaded = self._attributes_loaded  # not yet: the lazy load replays from the tree up to the new position

        def stepped_over() -> bool:  # the scan moved past bytes it never replayed
            return loaded and (self._log.start_position > replayed or self._log.resyncs != resyncs)

        try:
            seen = self._scan_tail(self._replayer(0) if loaded else None)
        except BaseException:
            if stepped_over():  # this handle's position moved past updates tier 1 lacks
                self._tier1_stale = True
                self._publish_view()
            raise
        if stepped_over() or self._tier1_stale:
            self._tier1_stale = True  # until the rebuild succeeds
            self._replay_from_tree(refresh_tree=True)
        if seen:
            self._appended.notify_all()
        return seen

    def _scan_tail(self, visit) -> int:
        """``SegmentLog.catch_up``, listing again when another handle's truncation deleted a chunk
        between the scan's listing and its read (a merge elsewhere covers it): the scan restarts
        at the new start and ``_catch_up`` rebuilds tier 1 from the tree. (A writer that lost an
        append race failed its update with this ``TruncatedError`` once.)"""
        for _attempt in range(MAX_OPEN_ATTEMPTS):
            try:
                return self._log.catch_up(visit)
            except TruncatedError:
                continue
        raise StorageError(f"segment {self.name!r}: other handles kept truncating the log while this handle read "
                           f"its tail ({MAX_OPEN_ATTEMPTS} tries); try again")

    def refresh(self) -> None:
        """Catch up with appends made through other handles or processes."""
        with self._lock:
            self._check_open()
            self._catch_up()

    # -- appending -----------------------------------------------------------------------------
    def append(self, records: Iterable[bytes | Record] = (), attribute_updates: Iterable[AttributeUpdate | tuple] = (),
               expected_offset: int | None = None, *, timestamp: int | None = None,
               codec: str | Codec | None = None) -> AppendResult:
        """Append records and attribute updates atomically, as one durable batch.

        ``records``: ``bytes`` values or ``Record``s (key, timestamp, headers). ``attribute_updates``:
        ``AttributeUpdate``s (or ``(key, value)`` pairs meaning REPLACE), checked against the true
        current values and applied in order. ``expected_offset``: append only if the segment's next
        offset is this (``BadOffsetError`` otherwise). ``timestamp`` (ms) is given to records
        without one (default: now). If a condition fails, ``ConditionalUpdateError`` names every
        failed update and its current value; nothing is appended and nothing changes.

        Returns if and only if the batch is durable. Appends from several threads of this handle
        are grouped (group commit): each is checked in turn against the state including the ones
        before it in the group, keeps its own batch (and its own errors), and the group is written
        as one durable storage append. Merging attribute updates into the B+tree runs in a
        background thread and never fails an append (see ``stats().merge_error``); an append waits
        only while tier 1 holds more than ``max_pending_bytes`` (back-pressure, bounded by
        ``BACKPRESSURE_WAIT_SECONDS``). The batch carries a random id, kept by every retry of this
        call, so that a write whose acknowledgement was lost is recognised by reading it back,
        never written twice. ``OutcomeUnknownError`` means storage could not settle whether the
        batch was written (``refresh()`` and read to find out); ``CorruptDataError`` means the log
        is damaged: it refuses appends until ``SegmentStore.repair_segment``.
        """
        records = record_list(records)
        self._check_compactable(records)
        updates, replacements = _split_updates(attribute_updates)
        if not records and not updates and not replacements[0]:
            raise InvalidInputError(f"segment {self.name!r}: nothing to append (no records and no attribute updates)")
        if expected_offset is not None and (type(expected_offset) is not int or expected_offset < 0):
            raise InvalidInputError(f"expected_offset must be an int >= 0 or None, got {expected_offset!r}")
        stamp = int(time.time() * 1000) if timestamp is None else timestamp
        chosen = self.options.codec if codec is None else codec_for(codec)
        # One batch id per call: identical bytes at an offset then mean this call.
        pending = _PendingAppend(records, updates, replacements, expected_offset, stamp, chosen, new_batch_id())
        if updates is None:  # no conditions: encode here, outside the lock (bad records raise here too)
            # At the offset and position this handle last saw: for a lone writer the leader writes
            # it unchanged (SegmentLog.append_many seals it again only if the position moved).
            data, header = encode_batch_with_header(self._log.append_offset, records, timestamp=stamp,
                                                    attribute_updates=replacements, codec=chosen,
                                                    batch_id=pending.batch_id, position=self._log.position)
            pending.encoded, size = (*replacements, data, header), len(data)
        else:
            size = sum(len(r) if isinstance(r, bytes) else 64 for r in records) + 40 * len(updates)
        self._check_open()
        return self._queue.submit(WriteRequest(pending, size), self._write_group)

    def append_arrow(self, values, keys=None, timestamps=None,
                     attribute_updates: Iterable[AttributeUpdate | tuple] = (), expected_offset: int | None = None, *,
                     timestamp: int | None = None, codec: str | Codec | None = None) -> AppendResult:
        """``append`` for records given as Arrow columns, encoded column by column (no ``Record`` per
        row): ``values`` a ``pyarrow`` binary array without nulls, ``keys`` a binary array (null: no
        key) or ``None``, ``timestamps`` int64 ms (Arrow or numpy; a null gets ``timestamp``) or
        ``None``. No headers or tombstones (``append`` takes those). The batch written, its
        conditions and its guarantees are those of ``append`` with the same records and updates.
        Needs numpy and pyarrow (``pip install 'attrindex[arrow]'``)."""
        from .log.columnar import check_columns, encode_arrow

        values, keys, timestamps = check_columns(values, keys, timestamps)
        if not len(values):
            return self.append((), attribute_updates, expected_offset, timestamp=timestamp, codec=codec)
        if self._cached_policy().compacts and (keys is None or keys.null_count):
            raise InvalidInputError(
                f"segment {self.name!r} has cleanup_policy {self._cached_policy().cleanup_policy!r}: a record has "
                f"no key (compaction keeps the latest record per key); nothing was appended")
        updates, replacements = _split_updates(attribute_updates)
        if expected_offset is not None and (type(expected_offset) is not int or expected_offset < 0):
            raise InvalidInputError(f"expected_offset must be an int >= 0 or None, got {expected_offset!r}")
        stamp = int(time.time() * 1000) if timestamp is None else timestamp
        chosen = self.options.codec if codec is None else codec_for(codec)
        pending = _PendingAppend(_ColumnRecords(values, keys, timestamps), updates, replacements, expected_offset,
                                 stamp, chosen, new_batch_id())
        outcome = replacements if updates is None else _foreseen(updates)
        if outcome is not None:
            # Encoded here, outside the lock, with the attribute values the updates will set if
            # they pass; the group's leader renumbers it (a rebase). Should the values resolved
            # differ, the leader encodes the records again with those (``_ColumnRecords``).
            data = encode_arrow(values, keys, timestamps, timestamp=stamp, base_offset=self._log.append_offset,
                                codec=chosen, batch_id=pending.batch_id, attribute_updates=outcome)
            pending.encoded, size = (*outcome, data, None), len(data)
        else:
            size = len(values.buffers()[2] or b"") + 40 * len(updates)
        self._check_open()
        return self._queue.submit(WriteRequest(pending, size), self._write_group)

    def _append_replacements(self, keys: list[bytes], values: list[int | None]) -> AppendResult:
        """``append((), (keys, values))`` for input already checked (``AttributeIndex.update``):
        ``keys`` unique 16-byte ``bytes`` in any order, ``values`` int64 or ``None``; REPLACE semantics."""
        stamp, batch_id = int(time.time() * 1000), new_batch_id()
        data, header = encode_batch_with_header(self._log.append_offset, (), timestamp=stamp,
                                                attribute_updates=(keys, values), codec=self.options.codec,
                                                batch_id=batch_id, position=self._log.position)
        pending = _PendingAppend([], None, (keys, values), None, stamp, self.options.codec, batch_id,
                                 (keys, values, data, header))
        self._check_open()
        return self._queue.submit(WriteRequest(pending, len(data)), self._write_group)

    def _write_group(self, group: list[WriteRequest]) -> None:
        """The leader's part of group commit: validate the group's appends in order, write those
        that pass as one durable append, settle each request with its result or its own error."""
        with self._lock:
            self._check_open()
            self._ensure_attributes()  # conditions read the current values; tier 1 takes the updates
            self._wait_for_room()
            self._check_open()  # (closed while waiting?)
            fresh = False  # whether the view was just caught up with the log's tail
            for _lap in _bounded_races(self.name):
                outcome = self._plan_group(group, fresh)
                if outcome is None:  # a failure on a stale view: only the true tail can fail an append
                    self._catch_up()
                    fresh = True
                    continue
                planned, failures = outcome
                for request, error in failures:
                    request.settle(error=error)
                if not planned:
                    return
                try:
                    self._log.append_many([p[3] for p in planned], [p[4] for p in planned])
                except BadOffsetError:  # another writer appended first: re-validate the whole group
                    for request, _error in failures:
                        request.error = None  # unsettle: the new tail decides again
                    self._catch_up()
                    fresh = True
                    continue
                was_empty = not len(self._overlay)
                for request, keys, values, _data, header in planned:  # durable: nothing below raises
                    if keys:
                        self._overlay.apply(keys, values)
                        self._overlay_filled()  # (before the settle: its caller may read at once)
                    request.settle(AppendResult(header.base_offset, header.last_offset))
                if was_empty and len(self._overlay):  # flush_seconds counts from here
                    self._dirty_since = time.monotonic()
                    self._wake.set()
                self._after_durable()
                return

    def _plan_group(self, group: list[WriteRequest], fresh: bool):
        """``(planned, failures)`` for the group against the current view, or ``None`` when a
        member failed and the view may be stale. ``planned``: ``(request, keys, values, batch,
        header)`` of the members that pass, in order; ``failures``: ``(request, error)``."""
        next_offset = self._log.append_offset
        if len(group) == 1:
            # A lone writer's usual append (an index update): no conditions, encoded at this end
            # with its own random id. Written as encoded, nothing to check or rebase.
            lone = group[0].payload
            encoded = lone.encoded
            if lone.updates is None and lone.expected_offset is None and encoded is not None and \
                    encoded[3] is not None and encoded[3].base_offset == next_offset:
                return [(group[0], *encoded)], []
        planned, failures = [], []
        earlier: dict[bytes, int | None] = {}  # values set by earlier members of the group

        def current(keys: list[bytes]) -> list[int | None]:
            found = self._current_values(keys)
            return [earlier.get(k, v) for k, v in zip(keys, found)] if earlier else found

        for request in group:
            a: _PendingAppend = request.payload
            try:
                keys, values = a.replacements if a.updates is None else resolve_updates(a.updates, current)
                if a.expected_offset is not None and a.expected_offset != next_offset:
                    raise BadOffsetError(self.name, a.expected_offset, next_offset)
            except (ConditionalUpdateError, BadOffsetError) as exc:
                if not fresh:
                    return None
                failures.append((request, exc))
                continue
            batch_id = a.batch_id
            encoded = a.encoded
            if encoded is not None and encoded[0] == keys and encoded[1] == values:
                header = encoded[3]
                if header is None or header.base_offset != next_offset or header.batch_id != batch_id:
                    data = rebase_batch(encoded[2], next_offset, batch_id)  # encoded before, or a lost race
                    header = read_header(data)
                    a.encoded = (keys, values, data, header)
                else:
                    data = encoded[2]  # as encoded (a lone attribute batch, the WAL's usual case)
            else:
                try:
                    data, header = encode_batch_with_header(next_offset, a.records, timestamp=a.stamp,
                                                            attribute_updates=(keys, values), codec=a.codec,
                                                            batch_id=batch_id)
                except Exception as exc:  # noqa: BLE001 - bad records fail their own append only
                    failures.append((request, exc))
                    continue
                a.encoded = (keys, values, data, header)
            planned.append((request, keys, values, data, header))
            next_offset = header.next_offset
            if keys:
                earlier.update(zip(keys, values))
        return planned, failures

    def _after_durable(self) -> None:
        """After a durable write: wake readers, start the merge thread, freeze tier 1 if it is due.
        Never raises (the write is durable)."""
        self._wrote = True
        self._appended.notify_all()
        if self._merger is None and not self._stopping:
            self._start_merger()
        if self._frozen is None and self._merge_due():
            self._freeze()

    def update_attributes(self, updates: Iterable[AttributeUpdate | tuple] | Mapping[object, int | None],
                          expected_offset: int | None = None) -> AppendResult:
        """Apply attribute updates (conditions checked as in ``append``) with no records: a mapping
        ``{key: value or None}`` (REPLACE), ``(key, value)`` pairs or ``AttributeUpdate``s."""
        updates = updates if isinstance(updates, Mapping) else _update_list(updates)
        if not updates:
            raise InvalidInputError(f"segment {self.name!r}: no attribute updates given")
        return self.append((), updates, expected_offset)

    # -- the read view: lock-free reads (docs/design.md, "Reads") --------------------------------
    def _publish_view(self) -> None:
        """Publish what reads look at, in ONE attribute assignment (under ``_lock``): the tuple
        ``(active overlay's lookup table or None while it is empty, frozen overlay's or None, the
        tree's recent values, tree get, tree get_many)``. Readers take no lock: they read ``_view`` once and probe its
        parts in that order, so they never see the active overlay of one state with the frozen
        one of another. Called whenever a part is replaced: a freeze, the end of a merge (after
        the tree and its recent values hold the frozen overlay's values, so a read never goes
        back), a rebuild of tier 1, the attributes' lazy load, and close (a view whose lookups
        raise). Appends change the active overlay's dicts in place: they publish only when they
        fill an empty one (``_overlay_filled``), before anyone is told of them."""
        if self._closed:
            view = (None, None, _NO_VALUES, self._closed_read, self._closed_read)
        elif not self._attributes_loaded or self._tier1_stale:  # the first read loads or rebuilds
            view = (None, None, _NO_VALUES, self._load_and_get, self._load_and_get_many)
        else:
            tree, frozen = self._tree, self._frozen
            overlay = self._overlay  # empty: None, so reads skip it (the read-mostly case)
            view = (overlay.lookup if len(overlay) else None, None if frozen is None else frozen.lookup,
                    tree._values,  # type: ignore[union-attr]
                    tree._get_uncached, tree._get_many_canonical)  # type: ignore[union-attr]
        self._view = view

    def _overlay_filled(self) -> None:
        """After updates were applied to the active overlay (under ``_lock``): publish it if the
        view skips it as empty. Called before the updates are acknowledged or returned."""
        if self._attributes_loaded and self._view[0] is None and len(self._overlay):
            self._publish_view()  # (not while opening: the open publishes when it is done)

    def _current_value(self, key: bytes) -> int | None:
        """The current value of one canonical key, without a lock: from one read view, the active
        overlay, the frozen one being merged, the tree's recent values, then the tree (the hot
        path: dict probes, no lists)."""
        active, frozen, recent, tree_get, _tree_get_many = self._view
        if active is not None:  # the overlay's lookup table (``AttributeOverlay.lookup``)
            value = active[key[-2]].get(key, MISSING)
            if value is not MISSING:
                return value  # type: ignore[return-value]
        if frozen is not None:
            value = frozen[key[-2]].get(key, MISSING)
            if value is not MISSING:
                return value  # type: ignore[return-value]
        value = recent.young.get(key, MISSING)
        if value is MISSING:
            return tree_get(key)
        recent.hits += 1
        return value  # type: ignore[return-value]

    def _current_values(self, keys: list[bytes]) -> list[int | None]:
        """``_current_value`` for each canonical key, in order, from one read view; the keys no
        overlay holds go to the tree as one ``get_many``. Every step is one C-level call (``map``,
        ``compress``): no Python loop per key."""
        active, frozen, _recent, _tree_get, tree_get_many = self._view
        if active is None:  # an empty overlay: nothing to probe
            if frozen is None:
                return list(tree_get_many(keys))
            found: list[object] = [MISSING] * len(keys)
            missing = keys
        else:
            found = probe_many(active, keys)
            missing = list(compress(keys, map(is_, found, repeat(MISSING))))
            if not missing:
                return found  # type: ignore[return-value]
        if frozen is None:
            fill = dict(zip(missing, tree_get_many(missing)))
        else:
            older = probe_many(frozen, missing)
            still = list(compress(missing, map(is_, older, repeat(MISSING))))
            stored = dict(zip(still, tree_get_many(still))) if still else {}
            fill = dict(zip(missing, map(stored.get, missing, older)))
        # A key is in ``fill`` exactly where the overlay had no entry: elsewhere the overlay's value.
        return list(map(fill.get, keys, found))  # type: ignore[arg-type]

    def _closed_read(self, _keys: object) -> object:
        raise InvalidInputError(f"segment {self.name!r} handle is closed")

    def _load_and_get(self, key: bytes) -> int | None:
        """A lazily opened handle's first read, or the first after a failed rebuild of tier 1:
        load the attributes or rebuild tier 1 (which publishes their view; raises if it cannot)."""
        self._ensure_attributes()
        with self._lock:  # the new view is published under the lock: read it, not the old one
            self._settle_tier1()
            return self._current_value(key)

    def _load_and_get_many(self, keys: list[bytes]) -> list[int | None]:
        self._ensure_attributes()
        with self._lock:
            self._settle_tier1()
            return self._current_values(keys)

    def _pending_items(self) -> tuple[list[bytes], list[int | None]]:
        """Tier 1 (under ``_lock``): every pending key ascending with its newest value (``None``
        for a removal), the active overlay over the frozen one."""
        if self._frozen is None:
            return self._overlay.sorted_items()
        merged = dict(zip(*self._frozen.sorted_items()))
        merged.update(zip(*self._overlay.sorted_items()))
        keys = sorted(merged)
        return keys, [merged[k] for k in keys]

    # -- attributes ----------------------------------------------------------------------------
    def get_attribute(self, key: object) -> int | None:
        """The value of attribute ``key`` (``None`` if absent). Takes no lock (see ``_publish_view``)."""
        return self._current_value(to_key(key))

    def get_attributes(self, keys: Iterable[object]) -> list[int | None]:
        """Values of ``keys`` in input order (``None`` where absent). Takes no lock."""
        canonical = to_keys(keys)
        self._check_open()  # (no key: no lookup that would raise it)
        return self._current_values(canonical)

    def attributes(self, start: object = None, stop: object = None) -> Iterator[tuple[bytes, int]]:
        """``(key, value)`` with ``start <= key < stop`` ascending: tier 1 merged over the B+tree."""
        low = None if start is None else to_key(start)
        high = None if stop is None else to_key(stop)
        with self._lock:  # snapshots: appends and merges may follow
            self._ensure_attributes()
            self._settle_tier1()
            overlay = list(self._overlay.items(low, high))
            frozen = [] if self._frozen is None else list(self._frozen.items(low, high))
        # The tree's scan starts later, from whatever version is current then: a merge meanwhile
        # only moves into it what the frozen snapshot holds anyway.
        tree = self._index.items(low, high)
        return merge_scan(iter(overlay), merge_scan(iter(frozen), tree) if frozen else tree)

    def attribute_split_keys(self, parts: int) -> list[bytes]:
        """Keys cutting the attributes into about ``parts`` ranges for parallel scans (by the
        B+tree's pages; attributes still in tier 1 only are not weighed)."""
        with self._lock:
            self._check_open()
            return self._index.split_keys(parts)

    # -- reading records -----------------------------------------------------------------------
    @property
    def next_offset(self) -> int:
        """The offset the next record will get (as of this handle's last look): past the offsets
        of a torn batch at the end of the log too, which are never given out again."""
        return self._log.append_offset

    @property
    def start_offset(self) -> int:
        """The offset of the first record still stored (retention moves it forward)."""
        with self._lock:
            return self._start_offset()

    def _start_offset(self) -> int:
        """Under ``_lock``: the log's start offset, looked for again (bounded) while other handles'
        retention deletes the chunk this view names first."""
        for _attempt in range(MAX_OPEN_ATTEMPTS):
            try:
                return self._log.start_offset
            except TruncatedError:  # another handle's retention deleted the chunk it names: look again
                self._catch_up()
        raise StorageError(f"segment {self.name!r}: retention in another handle kept removing the first "
                           f"chunk while its start offset was read ({MAX_OPEN_ATTEMPTS} tries)")

    def read(self, offset: int, max_records: int = 1000, *, max_bytes: int = DEFAULT_READ_BYTES) -> list[Record]:
        """Records from ``offset`` on, at most ``max_records`` (fewer at the end; ``[]`` past it).

        An offset below ``start_offset`` (removed by retention) raises ``RecordTruncatedError``.
        """
        if type(offset) is not int or offset < 0:
            raise InvalidInputError(f"offset must be an int >= 0, got {offset!r}")
        if type(max_records) is not int or max_records < 1:
            raise InvalidInputError(f"max_records must be an int >= 1, got {max_records!r}")
        if type(max_bytes) is not int or max_bytes < 1:
            raise InvalidInputError(f"max_bytes must be an int >= 1, got {max_bytes!r:.60}")
        return self._read(offset, max_records, max_bytes, whole_batches=False)

    def _read(self, offset: int, max_records: int, max_bytes: int, *, whole_batches: bool) -> list[Record]:
        """``read`` without argument checks; ``whole_batches`` (for readers) keeps the last batch
        whole, so the next read starts at a batch boundary instead of decoding it again."""
        try:
            with self._lock:  # only to plan: the reads and decoding run without it, beside appends
                self._check_open()
                start = self._log.start_offset
                if offset < start:
                    raise RecordTruncatedError(self.name, offset, start)
                try:
                    ranges = self._log.plan_read(offset)
                except LayoutChangedError:  # chunks switched under the plan (consolidation elsewhere)
                    self._catch_up()
                    ranges = self._log.plan_read(offset)
            return self._log.read_planned(ranges, offset, max_records, max_bytes, whole_batches=whole_batches)
        except TruncatedError:  # another handle's retention deleted the chunk under this stale view
            with self._lock:
                self._catch_up()
                raise RecordTruncatedError(self.name, offset, self._log.start_offset) from None

    def arrow_batches(self, offset: int | None = None, end: int | None = None) -> Iterator[Any]:
        """The records in ``[offset, end)`` as ``pyarrow.RecordBatch``es of
        ``attrindex.log.columnar.RECORD_SCHEMA`` (offset, timestamp, key, value, headers), one per
        stored batch, decoded column by column without a Python object per record.

        ``offset`` defaults to ``start_offset`` and ``end`` to ``next_offset`` as of this call;
        records appended later are not included. The arguments are checked and the read planned
        here; an offset below ``start_offset`` raises ``RecordTruncatedError`` now, or while
        iterating if retention removes the records meanwhile. Needs numpy and pyarrow (the
        ``arrow`` extra).
        """
        from .log.columnar import decode_arrow

        if offset is not None and (type(offset) is not int or offset < 0):
            raise InvalidInputError(f"offset must be an int >= 0 or None, got {offset!r:.60}")
        if end is not None and (type(end) is not int or end < 0):
            raise InvalidInputError(f"end must be an int >= 0 or None, got {end!r:.60}")
        with self._lock:  # only to plan: the reads and decoding run without it, beside appends
            self._check_open()
            start = self._log.start_offset
            offset = start if offset is None else offset
            if offset < start:
                raise RecordTruncatedError(self.name, offset, start)
            stop = self._log.next_offset if end is None else min(end, self._log.next_offset)
            if offset >= stop:
                return iter(())
            try:
                ranges = self._log.plan_read(offset)
            except LayoutChangedError:
                self._catch_up()
                ranges = self._log.plan_read(offset)
        return self._planned_arrow_batches(ranges, offset, stop, decode_arrow)

    def _planned_arrow_batches(self, ranges, offset: int, stop: int, decode_arrow) -> Iterator[Any]:
        from .log.columnar import pa

        last, shared = None, None
        try:
            for at, header, buf, pos in self._log.planned_batches(ranges, offset, DEFAULT_READ_BYTES):
                if header.base_offset >= stop:
                    return
                if buf is not last:
                    last, shared = buf, pa.py_buffer(buf) if type(buf) is bytes else None
                batch = decode_arrow(buf, pos, header, position=at - pos, segment=self.name, verify=False,
                                     buffer=shared)
                skip, keep = max(0, offset - header.base_offset), min(header.record_count, stop - header.base_offset)
                yield batch if skip == 0 and keep == header.record_count else batch.slice(skip, keep - skip)
        except TruncatedError:  # another handle's retention deleted the chunk under this stale view
            with self._lock:
                self._catch_up()
                raise RecordTruncatedError(self.name, offset, self._log.start_offset) from None

    def read_arrow(self, offset: int | None = None, max_records: int | None = None) -> Any:
        """The records from ``offset`` (default ``start_offset``) to the end as of this call, at most
        ``max_records`` of them, as a ``pyarrow.Table`` (see ``arrow_batches``). For pandas:
        ``segment.read_arrow().to_pandas()``; Polars: ``polars.from_arrow(...)``."""
        from .log.columnar import RECORD_SCHEMA, pa

        if max_records is not None and (type(max_records) is not int or max_records < 1):
            raise InvalidInputError(f"max_records must be an int >= 1 or None, got {max_records!r:.60}")
        batches, rows = [], 0
        for batch in self.arrow_batches(offset):
            if max_records is not None and rows + batch.num_rows >= max_records:
                batches.append(batch.slice(0, max_records - rows))
                break
            batches.append(batch)
            rows += batch.num_rows
        return pa.Table.from_batches(batches, schema=RECORD_SCHEMA)

    def reader(self, offset: int | None = None, timestamp: int | None = None) -> SegmentReader:
        """A reader from ``offset``, or from the first record with timestamp ``>= timestamp``, or
        (neither given) from the first record still stored. It follows the tail as records come."""
        if offset is not None and timestamp is not None:
            raise InvalidInputError("give a reader an offset or a timestamp, not both")
        if offset is not None and (type(offset) is not int or offset < 0):
            raise InvalidInputError(f"offset must be an int >= 0 or None, got {offset!r:.60}")
        if timestamp is not None and type(timestamp) is not int:
            raise InvalidInputError(f"timestamp must be an int (ms) or None, got {timestamp!r:.60}")
        with self._lock:
            self._check_open()
            if timestamp is not None:
                found = self._log.offset_for_timestamp(timestamp)
                start = self._log.next_offset if found is None else found
            else:
                start = self._log.start_offset if offset is None else offset
        return SegmentReader(self, start)

    def offset_for_timestamp(self, timestamp: int) -> int | None:
        """The first offset whose record timestamp is ``>= timestamp``, or ``None`` if none is."""
        if type(timestamp) is not int:
            raise InvalidInputError(f"timestamp must be an int (ms), got {timestamp!r}")
        with self._lock:
            return self._log.offset_for_timestamp(timestamp)

    def chunk_offsets(self) -> list[tuple[int, int]]:
        """``(first offset, next offset)`` of the records in each stored log chunk, oldest first
        (chunks without records left out): the units a parallel reader splits work by."""
        with self._lock:
            self._check_open()
            start = self._log.start_offset
            spans = [(max(s.base_offset, start), s.next_offset) for s in self._log.chunk_summaries()]
        return [(first, end) for first, end in spans if end > first]

    def _wait(self, offset: int, timeout: float, cancelled: threading.Event | None = None) -> None:
        """Wait until a record at ``offset`` may exist (an append here, or a poll finding one),
        the handle closes, ``cancelled`` is set, or ``timeout`` passes. Every reader of this
        handle shares one poller (attrindex/poller.py)."""
        with self._lock:
            poller = self._poller
            if poller is None:
                poller = self._poller = SegmentPoller(self, *self.options.poll_intervals())
        poller.wait(offset, timeout, cancelled)

    def _poll_storage(self) -> bool:
        """One poll for appends made elsewhere: a cheap look (one small request on object stores),
        and a catch-up only if it saw something. True if records arrived."""
        try:
            # (a view refreshed by a read may hold bytes not scanned yet: then catch up at once)
            if self._log.position >= self._log.bytes.length and not self._log.bytes.poll():
                return False
        except StorageError:
            if self._closed:  # closed while polling: the reader returns None
                return False
            raise
        with self._lock:
            if self._closed:
                return False
            before = self._log.next_offset
            self._catch_up()
            return self._log.next_offset != before

    def _wake_readers(self) -> None:
        with self._lock:
            self._appended.notify_all()

    # -- retention -----------------------------------------------------------------------------
    def apply_retention(self, max_age_ms: int | None = None, max_bytes: int | None = None,
                        start_offset: int | None = None, *, now_ms: int | None = None) -> int:
        """Delete old records; return how many chunks were deleted (see docs/user-guide.md).

        ``max_age_ms``: chunks whose newest record is older; ``max_bytes``: the oldest chunks while
        the log exceeds it; ``start_offset``: records below it (whole chunks, then the batch holding
        it). The chunk being appended to is never deleted, and attribute updates are merged into
        the B+tree first, so no update lives only in deleted log data.
        """
        for name, value in (("max_age_ms", max_age_ms), ("max_bytes", max_bytes), ("start_offset", start_offset)):
            if value is not None and (type(value) is not int or value < 0):
                raise InvalidInputError(f"{name} must be an int >= 0 or None, got {value!r}")
        now = int(time.time() * 1000) if now_ms is None else now_ms
        with self._merging(), self._lock:  # rare: appends wait for the retention
            self._check_open()
            self._ensure_attributes()
            self._catch_up()
            self._drain(force=True)  # with _lock held: no append lands between the merge and the cut
            if start_offset is not None and start_offset > self._log.next_offset:
                raise InvalidInputError(f"segment {self.name!r}: start_offset {start_offset} is past the end "
                                        f"(next offset {self._log.next_offset})")
            position, deleted = plan_retention(self._log, max_age_ms, max_bytes, start_offset, now)
            if position >= self._log.position > self._log.start_position:
                # Nothing readable would be left, and with it the next offset: keep an empty batch
                # that records it (Kafka rolls a new segment for the same reason).
                position = self._append_empty_batch(now)
            if position > self._log.start_position:
                self._log.truncate_at(position)
                _log.info("segment %r: retention removed the log below byte %d (%d chunks)", self.name, position, deleted)
            return deleted

    # -- consolidation -------------------------------------------------------------------------
    def compact_chunks(self, target_size: int | None = None) -> int:
        """Merge runs of small sealed log chunks into chunks of up to ``target_size`` bytes (default:
        ``log_rolling_size``); return how many merged chunks were written.

        Object stores make one chunk per append; merged, a log is read with one request per
        8 MiB instead of one per append. Bytes, offsets and positions do not change; each merge is
        an atomic switch (``RollingSegment.replace_range``) that readers and writers in other
        processes survive, and runs that another process changes meanwhile are skipped. On local
        disk chunks already grow in place to the rolling size: there it merges only small ones.
        """
        if target_size is not None and (type(target_size) is not int or target_size <= 0):
            raise InvalidInputError(f"target_size must be an int > 0 or None, got {target_size!r}")
        target = self.options.log_rolling_size if target_size is None else target_size
        with self._lock:
            self._check_open()
            self._catch_up()
            runs = self._log.bytes.small_runs(target)
        merged = 0
        for run in runs:
            start, end = run[0].start, run[-1].end
            try:
                data = self._log.bytes.read(start, run[-1].stored_end - start)  # without the lock: appends go on
                with self._lock:
                    self._check_open()
                    self._log.replace_range(start, end, data, expected=[c.name for c in run])
                merged += 1
            except (LayoutConflictError, HoleError, TruncatedError, InvalidInputError) as exc:
                # Changed meanwhile (compaction, retention elsewhere) or holding repaired gaps.
                _log.info("segment %r: log chunks [%d, %d) not merged: %s", self.name, start, end, exc)
        if merged:
            _log.info("segment %r: merged %d runs of small log chunks (target %d bytes)", self.name, merged, target)
        return merged

    def _append_empty_batch(self, timestamp: int) -> int:
        """Append a batch with no records and no updates; return its byte position."""
        for _lap in _bounded_races(self.name):
            data = encode_batch(self._log.append_offset, [], timestamp=timestamp)
            try:
                return self._log.append(data, read_header(data))
            except BadOffsetError:
                self._catch_up()

    # -- compaction (attrindex.log.cleaner; docs/segments.md, "Compaction") -----------------------
    def cleanup_policy(self) -> _policy.CleanupPolicy:
        """The segment's cleanup policy as stored (read afresh: another process may change it)."""
        policy, _version = _policy.load_policy(self._log.storage, self.name)
        self._policy_cache = policy
        return policy

    def configure(self, **options: Any) -> _policy.CleanupPolicy:
        """Change the cleanup policy (``cleanup_policy``, ``min_compaction_lag_ms``,
        ``tombstone_retention_ms``, ``retention_ms``, ``retention_bytes``); the others keep their
        values. Stored as a new version (never overwriting one); returns the new policy.

        Switching to a compacting policy does not touch records already stored: keyless ones are
        kept by the cleaner; only appends from then on must carry keys.
        """
        if not options:
            raise InvalidInputError(f"segment {self.name!r}: configure() needs at least one option")
        storage = self._log.storage
        for _attempt in range(_policy.MAX_CONFIGURE_RACES):
            current, version = _policy.load_policy(storage, self.name)
            changed = _policy.policy_from_options(options, current)
            try:
                _policy.store_policy(storage, self.name, changed, version + 1)
            except ChunkExistsError:
                continue  # another process configured meanwhile: apply ours over theirs
            self._policy_cache = changed
            return changed
        raise StorageError(f"segment {self.name!r}: configure lost {_policy.MAX_CONFIGURE_RACES} races in a row "
                           "to other processes changing the policy; nothing was written")

    def _cached_policy(self) -> _policy.CleanupPolicy:
        policy = getattr(self, "_policy_cache", None)
        return self.cleanup_policy() if policy is None else policy

    def _check_compactable(self, records: list) -> None:
        """A compacting segment refuses keyless records (as Kafka does) and a keyless tombstone is
        refused anywhere (by the encoder): both before anything is written."""
        if records and self._cached_policy().compacts:
            for i, record in enumerate(records):
                if not isinstance(record, Record) or record.key is None:
                    raise InvalidInputError(
                        f"segment {self.name!r} has cleanup_policy {self._cached_policy().cleanup_policy!r}: "
                        f"record {i} has no key (compaction keeps the latest record per key); nothing was appended")

    def compact(self, min_lag_ms: int | None = None, tombstone_retention_ms: int | None = None, *,
                now_ms: int | None = None, max_map_keys: int = DEFAULT_MAX_MAP_KEYS) -> CompactionStats:
        """Key-based compaction (Kafka's log cleaner): for each key keep only its latest record.

        Cleans the sealed chunks (never the one being appended to) whose records are all older
        than ``min_lag_ms`` (default: the policy's ``min_compaction_lag_ms``); a tombstone (value
        ``None``) is removed once it was first cleaned ``tombstone_retention_ms`` ago (default: the
        policy's). Offsets never change: removed records become gaps that reads step over.
        Attribute updates are merged into the B+tree first. On a ``delete,compact`` segment the
        policy's ``retention_ms``/``retention_bytes`` are applied first. Incremental (a cleaner
        checkpoint) with a key map of at most ``max_map_keys`` keys per pass. Requires a policy
        that compacts (``InvalidInputError`` otherwise: see ``configure``).
        """
        for name, value in (("min_lag_ms", min_lag_ms), ("tombstone_retention_ms", tombstone_retention_ms),
                            ("now_ms", now_ms)):
            if value is not None and (type(value) is not int or value < 0):
                raise InvalidInputError(f"{name} must be an int >= 0 or None, got {value!r:.60}")
        if type(max_map_keys) is not int or max_map_keys < 1:
            raise InvalidInputError(f"max_map_keys must be an int >= 1, got {max_map_keys!r:.60}")
        started = time.monotonic()
        self._check_open()
        policy = self.cleanup_policy()
        if not policy.compacts:
            raise InvalidInputError(f"segment {self.name!r} has cleanup_policy {policy.cleanup_policy!r}: nothing to "
                                    f"compact (configure(cleanup_policy='compact') first)")
        now = int(time.time() * 1000) if now_ms is None else now_ms
        deleted = 0
        if policy.deletes and (policy.retention_ms is not None or policy.retention_bytes is not None):
            deleted = self.apply_retention(policy.retention_ms, policy.retention_bytes, now_ms=now)
        with self._merge_mutex, self._lock:  # as retention: no append lands between the merge and the limit
            self._check_open()
            self._ensure_attributes()
            self._catch_up()
            self._drain(force=True)  # no attribute update may live only in a batch the cleaner rewrites
            limit = self._index.checkpoint or 0
        cleaner = LogCleaner(self._cleaner_log(), limit=limit, now_ms=now,
                             min_lag_ms=policy.min_compaction_lag_ms if min_lag_ms is None else min_lag_ms,
                             tombstone_retention_ms=(policy.tombstone_retention_ms if tombstone_retention_ms is None
                                                     else tombstone_retention_ms),
                             max_map_keys=max_map_keys)
        try:
            checkpoint = cleaner.run()
        finally:
            cleaner.log.close()
            with self._lock:
                if not self._closed:
                    self._catch_up()  # this handle's view of the rewritten chunks is stale
        _log.info("segment %r: compacted %d -> %d records in %d chunks", self.name, cleaner.records_before,
                  cleaner.records_after, cleaner.chunks_cleaned)
        return cleaner.stats(checkpoint, time.monotonic() - started, deleted)

    def dirty_ratio(self) -> float:
        """Kafka's dirty ratio: the share of the stored log bytes after the cleaner checkpoint
        (not yet deduplicated); 0.0 for an empty log."""
        self._check_open()
        log = self._cleaner_log()
        try:
            clean, dirty = LogCleaner(log, limit=0, min_lag_ms=0, tombstone_retention_ms=0, now_ms=0).dirty_bytes()
        finally:
            log.close()
        return dirty / (clean + dirty) if clean + dirty else 0.0

    def _cleaner_log(self) -> SegmentLog:
        """A log view of its own for the cleaner: it runs beside this handle's appends and reads."""
        return SegmentLog(self._log.storage, self.name, rolling_size=self.options.log_rolling_size,
                          index_interval_bytes=self.options.index_interval_bytes)

    # -- inspection and lifecycle --------------------------------------------------------------
    def stats(self) -> SegmentStats:
        """Offsets, sizes and attribute state of this segment."""
        with self._lock:
            self._check_open()
            self._ensure_attributes()
            log = self._log
            start_offset = self._start_offset()  # (first: it may move the view on)
            chunks = log.bytes.chunks()
            stored = sum(c.stored for c in chunks)  # a hole holds nothing; a cut first chunk is still whole
            return SegmentStats(
                name=self.name,
                start_offset=start_offset,
                next_offset=log.next_offset,
                log_bytes=stored,
                log_chunks=len(chunks),
                max_timestamp=None if log.max_timestamp == -(1 << 63) else log.max_timestamp,
                pending_attributes=len(self._overlay) + (0 if self._frozen is None else len(self._frozen)),
                attribute_checkpoint=self._index.checkpoint,
                attributes=self._index.stats(),
                merge_error=None if self._merge_error is None else f"{type(self._merge_error).__name__}: {self._merge_error}",
                pending_bytes=self._pending_bytes(),
                merges=self._merges,
                append_groups=self._queue.groups,
                appends_grouped=self._queue.requests,
                requests=log.bytes.storage.requests,
            )

    def close(self, *, merge: bool = True) -> None:
        """Stop the background merge, merge pending attribute updates into the B+tree (raising
        the merge's error if it fails: the updates stay in the log, replayed on open) and release
        the handle.

        ``merge=False``: the handle is closed at once (appends and reads raise from then on, no
        merge starts) and the pending updates are left in the log; a merge already writing is
        waited for. ``SegmentStore.delete_segment`` closes so before deleting anything."""
        with self._lock:
            if self._closed:
                return
            if not merge:
                self._closed = True
                self._publish_view()  # reads from now on raise
        self._stop_merger()
        with self._merging(), self._lock:
            if merge and self._closed:
                return  # closed by another thread meanwhile
            try:
                if merge and self._wrote:  # a handle that only read leaves the merge to the writers
                    self._drain()
            finally:
                self._closed = True
                self._publish_view()
                self._appended.notify_all()
                self._merged.notify_all()
                self._log.close()
                self._close_worker()
                if self._tree is not None:  # (a lazy handle that never needed attributes has none)
                    self._tree.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"segment {self.name!r} handle is closed")

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, next_offset={self._log.next_offset})"


@attrs.define(slots=True)
class _PendingAppend:
    """One ``append`` call waiting in the group-commit queue (checked arguments, its batch id)."""

    records: list
    updates: list | None
    replacements: tuple
    expected_offset: int | None
    stamp: int
    codec: Codec
    batch_id: int
    #: (keys, values, batch, its header or None) of the last try: a lost race needs only a rebase
    encoded: tuple | None = None


class _ColumnRecords:
    """The records of an ``append_arrow``, made into ``Record``s only if an append needs them
    (its attribute updates resolved to other values than foreseen)."""

    def __init__(self, values, keys, timestamps):
        self.columns = (values, keys, timestamps)

    def __len__(self) -> int:
        return len(self.columns[0])

    def __iter__(self) -> Iterator[Record]:
        from .log.columnar import arrow_records

        return iter(arrow_records(*self.columns))


def _foreseen(updates: list[AttributeUpdate]) -> tuple[list[bytes], list[int | None]] | None:
    """``resolve_updates``' result if every update passes, when that does not depend on the current
    values (no ``ACCUMULATE``): sorted keys, and each key's last value; else ``None``."""
    final: dict[bytes, int | None] = {}
    for update in updates:
        if update.update_type is UpdateType.ACCUMULATE:
            return None
        final[update.key] = update.value
    keys = sorted(final)
    return keys, [final[k] for k in keys]


def _bounded_races(name: str) -> Iterator[int]:
    """Laps of an append loop: each lost race means another writer appended; give up after
    ``MAX_APPEND_RACES`` of them with a clear error rather than spin."""
    yield from range(MAX_APPEND_RACES)
    raise StorageError(f"segment {name!r}: an append lost the race to other writers {MAX_APPEND_RACES} times "
                       f"in a row; nothing of it was written")


def _split_updates(given) -> tuple[list[AttributeUpdate] | None, tuple[list[bytes], list[int | None]]]:
    """``(conditional updates, None)``, or ``(None, (keys, values))`` when every update is a plain
    replacement: ``(key, value)`` pairs or a mapping. Those need no current values, and are
    validated at C speed (bulk writers send thousands per append)."""
    if isinstance(given, Mapping):
        batch = canonical_batch(given)
    else:
        items = _update_list(given)
        if not items:
            return None, ([], [])
        types = set(map(type, items))
        if AttributeUpdate in types:
            return [u if isinstance(u, AttributeUpdate) else _pair_update(u) for u in items], ([], [])
        if types != {tuple} or set(map(len, items)) != {2}:
            raise InvalidInputError("attribute updates must be AttributeUpdates, (key, value) pairs or a mapping")
        batch = canonical_batch(items)
    keys = sorted(batch)
    return None, (keys, list(map(batch.__getitem__, keys)))


def _update_list(given: object) -> list:
    """Attribute updates given as an iterable, as a list (``InvalidInputError`` for anything else)."""
    if isinstance(given, list):
        return given
    if isinstance(given, AttributeUpdate):
        raise InvalidInputError("attribute updates must be a list: wrap a single AttributeUpdate in [...]")
    return pair_list(given, "attribute updates")


def _pair_update(update: object) -> AttributeUpdate:
    if isinstance(update, tuple) and len(update) == 2:
        return AttributeUpdate(update[0], value=update[1])
    raise InvalidInputError(f"an attribute update must be an AttributeUpdate or a (key, value) pair, got {update!r}")


__all__ = ["AppendResult", "BACKPRESSURE_WAIT_SECONDS", "MERGE_RETRY_MIN_SECONDS", "MERGE_RETRY_SECONDS", "Segment",
           "SegmentOptions", "SegmentStats"]
