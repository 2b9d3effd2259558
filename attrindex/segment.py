"""``Segment``: an append-only record log whose appends carry conditional attribute updates.

The log is the single source of truth. Every append is one record batch holding the records and
the *resolved* attribute values (the result of checking the conditions), written by one
compare-and-append at the log position this handle last saw. So the check and the write are
atomic: a writer that loses the race catches up from the log tail, re-validates and retries.

A ``Segment`` owns its parts and does the records' jobs itself: the log (``SegmentLog``), the
attribute state (``AttributeState``: the B+tree, tier 1, the read view and the merge), the
appender (``Appender``: group commit and conditions), and the poller its tail readers share.
Maintenance (retention, consolidation, key compaction and its policy) is here too: each step
takes the merge mutex and the lock in that order, so no append lands between a merge and a cut.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping  # (isinstance checks: typing.Mapping's is ~5x slower)
from typing import Any, Iterable, Iterator

import attrs

from .appender import AppendResult, Appender, PendingAppend
from .attribute_state import MAX_OPEN_ATTEMPTS, AttributeState
from .conditional import AttributeUpdate, UpdateType
from .errors import (ChunkExistsError, HoleError, InvalidInputError, LayoutChangedError, LayoutConflictError,
                     RecordTruncatedError, RetriesExhaustedError, StorageError, TruncatedError)
from .layout import attributes_name
from .keys import canonical_batch, pair_list, to_key, to_keys
from .log.batch.compression import Codec, codec_for
from .log.batch.encode import encode_batch_with_header, new_batch_id
from .log.batch.records import Record, record_list
from .log.segment_log import SegmentLog
from .log.retention import cut_log
from .log import cleanup_policy as _policy
from .log.cleaner import DEFAULT_MAX_MAP_KEYS, CompactionStats, LogCleaner
from .options import SegmentOptions
from .poller import SegmentPoller
from .reader import SegmentReader

DEFAULT_READ_BYTES = 8 << 20  # one GET per 8 MiB of a consolidated log on object stores

_log = logging.getLogger("attrindex.segment")


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


class Segment:
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
        self._lock = threading.RLock()  #: appends, catch-up, freezing and the view (shared with its parts)
        self._appended = threading.Condition(self._lock)  #: records arrived or the handle closed
        self._log = SegmentLog(storage, name, rolling_size=options.log_rolling_size,
                               index_interval_bytes=options.index_interval_bytes)
        self.tree_name = attributes_name(name) if tree_name is None else tree_name
        self._attributes = AttributeState(self._log, self.tree_name, options, self._lock,
                                          caught_up=self._appended.notify_all)
        self._appender = Appender(self._log, self._attributes, self._lock, appended=self._appended.notify_all)
        self._poller: SegmentPoller | None = None  #: made by the first reader that waits
        self._policy_cache: _policy.CleanupPolicy | None = None
        with self._lock:
            if lazy_attributes:
                self._open_tail()
            else:
                self._attributes.open()

    # -- lazy opening (object stores: docs/segments.md, "Opening") -------------------------------
    def _open_tail(self) -> None:
        """Open only the log's last chunk (its first header gives the next offset; one request on an
        object store), scanning it to the end; the attributes wait for ``AttributeState.ensure_loaded``."""
        for attempt in range(MAX_OPEN_ATTEMPTS):
            try:
                self._log.open_at(self._log.bytes.length)  # the end lies in the last chunk
                self._log.catch_up(None, refresh=False)
                return
            # Retention or a chunk switch elsewhere: look again. (A catch-up that resynced to its
            # bound raises RetriesExhaustedError: passed up, not retried here.)
            except (TruncatedError, LayoutChangedError):
                if attempt + 1 == MAX_OPEN_ATTEMPTS:
                    raise RetriesExhaustedError(f"segment {self.name!r}: other handles kept removing or replacing the log's "
                                                f"last chunk while it was opened ({MAX_OPEN_ATTEMPTS} tries)") from None

    def _catch_up(self) -> int:
        """Under ``_lock``: read what other writers appended since this handle last looked (the
        attribute state replays it into tier 1 and wakes readers); return batches seen."""
        return self._attributes.catch_up()

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
        _check_expected_offset(expected_offset)
        stamp = int(time.time() * 1000) if timestamp is None else timestamp
        chosen = self.options.codec if codec is None else codec_for(codec)
        # One batch id per call: identical bytes at an offset then mean this call.
        pending = PendingAppend(records, updates, replacements, expected_offset, stamp, chosen, new_batch_id())
        if updates is None:  # no conditions: encode here, outside the lock (bad records raise here too)
            # At the offset and position this handle last saw: for a lone writer the leader writes
            # it unchanged (SegmentLog.append_many seals it again only if the position moved).
            data, header = encode_batch_with_header(self._log.append_offset, records, timestamp=stamp,
                                                    attribute_updates=replacements, codec=chosen,
                                                    batch_id=pending.batch_id, position=self._log.position)
            pending.encoded, size = (*replacements, data, header), len(data)
        else:
            size = sum(len(r) if isinstance(r, bytes) else 64 for r in records) + 40 * len(updates)
        return self._appender.submit(pending, size)

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
        _check_expected_offset(expected_offset)
        stamp = int(time.time() * 1000) if timestamp is None else timestamp
        chosen = self.options.codec if codec is None else codec_for(codec)
        pending = PendingAppend(_ColumnRecords(values, keys, timestamps), updates, replacements, expected_offset,
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
        return self._appender.submit(pending, size)

    def update_attributes(self, updates: Iterable[AttributeUpdate | tuple] | Mapping[object, int | None],
                          expected_offset: int | None = None) -> AppendResult:
        """Apply attribute updates (conditions checked as in ``append``) with no records: a mapping
        ``{key: value or None}`` (REPLACE), ``(key, value)`` pairs or ``AttributeUpdate``s."""
        updates = updates if isinstance(updates, Mapping) else _update_list(updates)
        if not updates:
            raise InvalidInputError(f"segment {self.name!r}: no attribute updates given")
        return self.append((), updates, expected_offset)

    # -- attributes ----------------------------------------------------------------------------
    def get_attribute(self, key: object) -> int | None:
        """The value of attribute ``key`` (``None`` if absent). Takes no lock (``attrindex.read_view``)."""
        return self._attributes.value(to_key(key))

    def get_attributes(self, keys: Iterable[object]) -> list[int | None]:
        """Values of ``keys`` in input order (``None`` where absent). Takes no lock."""
        canonical = to_keys(keys)
        self._check_open()  # (no key: no lookup that would raise it)
        return self._attributes.values(canonical)

    def attributes(self, start: object = None, stop: object = None) -> Iterator[tuple[bytes, int]]:
        """``(key, value)`` with ``start <= key < stop`` ascending: tier 1 merged over the B+tree."""
        low = None if start is None else to_key(start)
        high = None if stop is None else to_key(stop)
        return self._attributes.items(low, high)

    def attribute_split_keys(self, parts: int) -> list[bytes]:
        """Keys cutting the attributes into about ``parts`` ranges for parallel scans (by the
        B+tree's pages; attributes still in tier 1 only are not weighed)."""
        with self._lock:
            self._check_open()
            return self._attributes.tree.split_keys(parts)

    def flush(self) -> None:
        """Merge every attribute update seen so far into the B+tree (one sorted batch), now.

        Raises the storage error if the merge fails (for example ``StorageFullError``); the
        updates stay in tier 1 and in the log, and a later flush or the background merge retries."""
        self._attributes.flush()

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
        raise RetriesExhaustedError(f"segment {self.name!r}: retention in another handle kept removing the first "
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
        return SegmentReader(self, start, fetch=self._read, wait=self._wait, wake=self._wake_readers)

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
                poller = self._poller = SegmentPoller(self, self._appended, self._poll_storage,
                                                      *self.options.poll_intervals())
        poller.wait(offset, timeout, cancelled)

    def _poll_storage(self) -> bool:
        """One poll for appends made elsewhere: a cheap look (one small request on object stores),
        and a catch-up only if it saw something. True if records arrived."""
        try:
            # (a view refreshed by a read may hold bytes not scanned yet: then catch up at once)
            if self._log.position >= self._log.bytes.length and not self._log.bytes.poll():
                return False
        except StorageError:
            if self.closed:  # closed while polling: the reader returns None
                return False
            raise
        with self._lock:
            if self.closed:
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
        attributes = self._attributes
        with attributes.runner.merging(), self._lock:  # rare: appends wait for the retention
            self._check_open()
            attributes.ensure_loaded()
            self._catch_up()
            # With _lock held: no append lands between the merge and the cut. The drain returns only
            # once the tree covers the log's position (else RetriesExhaustedError, nothing cut).
            attributes.drain(force=True)
            if start_offset is not None and start_offset > self._log.next_offset:
                raise InvalidInputError(f"segment {self.name!r}: start_offset {start_offset} is past the end "
                                        f"(next offset {self._log.next_offset})")
            position, deleted = cut_log(self._log, max_age_ms, max_bytes, start_offset, now,
                                        append_empty=lambda: self._appender.append_empty(now), catch_up=self._catch_up)
            if position:
                _log.info("segment %r: retention removed the log below byte %d (%d chunks)", self.name, position, deleted)
            return deleted

    # -- consolidation -------------------------------------------------------------------------
    def consolidate(self, target_size: int | None = None) -> int:
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
        self._policy_cache = _configure(self._log.storage, self.name, options)
        return self._policy_cache

    def _cached_policy(self) -> _policy.CleanupPolicy:
        policy = self._policy_cache
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
        attributes = self._attributes
        with attributes.runner.merging(), self._lock:  # as retention: no append lands between the merge and the limit
            self._check_open()
            attributes.ensure_loaded()
            self._catch_up()
            attributes.drain(force=True)  # no attribute update may live only in a batch the cleaner rewrites
            limit = attributes.tree.checkpoint or 0
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
                if not self.closed:
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
            self._attributes.ensure_loaded()
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
                append_groups=self._appender.groups,
                appends_grouped=self._appender.requests,
                requests=log.bytes.storage.requests,
                **self._attributes.stats(),
            )

    def close(self, *, merge: bool = True) -> None:
        """Stop the background merge, merge pending attribute updates into the B+tree (raising
        the merge's error if it fails: the updates stay in the log, replayed on open) and release
        the handle.

        ``merge=False``: the handle is closed at once (appends and reads raise from then on, no
        merge starts) and the pending updates are left in the log; a merge already writing is
        waited for. ``SegmentStore.delete_segment`` closes so before deleting anything."""
        try:
            self._attributes.close(merge=merge)
        finally:
            with self._lock:
                if self._attributes.closed:
                    self._appended.notify_all()
                    self._log.close()

    @property
    def closed(self) -> bool:
        return self._attributes.closed

    def _check_open(self) -> None:
        self._attributes.check_open()

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, next_offset={self._log.next_offset})"


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


def _check_expected_offset(expected_offset: object) -> None:
    if expected_offset is not None and (type(expected_offset) is not int or expected_offset < 0):
        raise InvalidInputError(f"expected_offset must be an int >= 0 or None, got {expected_offset!r}")


def _configure(storage, name: str, options: dict) -> _policy.CleanupPolicy:
    """Store ``options`` over the newest stored policy as a new version (each version is written
    once: a lost race to another process reads the new newest one and applies ``options`` over it)."""
    for _attempt in range(_policy.MAX_CONFIGURE_ATTEMPTS):
        current, version = _policy.load_policy(storage, name)
        changed = _policy.policy_from_options(options, current)
        try:
            _policy.store_policy(storage, name, changed, version + 1)
        except ChunkExistsError:
            continue  # another process configured meanwhile: apply ours over theirs
        return changed
    raise RetriesExhaustedError(f"segment {name!r}: configure lost {_policy.MAX_CONFIGURE_ATTEMPTS} races in a row "
                                "to other processes changing the policy; nothing was written")


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


__all__ = ["Segment", "SegmentStats"]
