"""``EventWriter``: exactly-once writes of events to a stream of segments.

Each segment keeps, as an attribute keyed by the writer id, the number of the last event this
writer appended there. The writer numbers its events per segment (1, 2, ... in write order) and
sends each batch with ``REPLACE_IF_EQUALS(writer id, value=last number, compare=previous)``, in
the same atomic append as the events. After a lost acknowledgement, a timeout or a restart, the
condition fails with the true last number: everything up to it is acknowledged, the rest is
resent. A restarted writer must replay the same events in the same order (as a retried Spark
task does); events its earlier life already wrote are skipped.

Beside the number, each segment keeps a 64-bit digest of this writer's events there (payloads and
routing keys, in order), updated in the same conditional append. A resumed writer digests the
events it skips and compares once it has numbered as many as are stored, so a reused writer id
that sends *different* events raises ``WriterConflictError`` instead of dropping them.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import logging
import operator
import threading
import time
import uuid
import zlib
from typing import Any

import attrs

from .conditional import AttributeUpdate, UpdateType
from .errors import (
    AttrIndexError,
    ConditionalUpdateError,
    CorruptDataError,
    InvalidInputError,
    MergeBacklogError,
    RetriesExhaustedError,
    WriterConflictError,
)
from .keys import to_key
from .log.batch.records import Record, check_timestamps, normalize_headers
from .store import SegmentStore, check_segment_count, validate_name

_PERMANENT = (InvalidInputError, ConditionalUpdateError, CorruptDataError)
#: Raised at once, not resent (docs/retries.md: each failure is retried by the one layer that can
#: settle it). ``MergeBacklogError``: the segment refused the append before writing anything, after
#: its own bounded wait for room (back-pressure). ``RetriesExhaustedError``: a loop below retried
#: its race or request to its bound. A resend would only run those loops again; the events stay
#: queued, and a later flush resends them with their conditions (exactly once).
_SETTLED_BELOW = (MergeBacklogError, RetriesExhaustedError)
_DIGEST_NAME = "attrindex.EventWriter/digest"  #: derives a writer's digest key from its id
_log = logging.getLogger("attrindex.writer")
_REPLAY_FEED = 4096  #: skipped events are digested in groups of this many
_PAYLOAD, _ROUTING_KEY = operator.itemgetter(0), operator.itemgetter(1)
MAX_FLUSHERS = 4  #: background flusher threads of a lingering writer (at most one per segment)
QUEUE_BATCHES = 4  #: a lingering writer's write blocks while a segment queues this many full batches
_WAIT_SLICE = 1.0  #: waits for the flushers are made of bounded slices (errors and closing end them)


class _EventDigest:
    """A digest of a writer's events 1..n on one segment: their payloads and routing keys.

    Fed in any grouping (a batch, one skipped event...), it gives the same value for the same
    events: each column (payload lengths, payload bytes, key lengths, key bytes) is hashed as one
    stream, never per batch, and the four digests together determine the events.
    """

    __slots__ = ("_streams",)

    def __init__(self, streams: tuple | None = None):
        self._streams = streams or tuple(hashlib.sha256() for _ in range(4))  # SHA-NI: about twice blake2b here

    def copy(self) -> "_EventDigest":
        return _EventDigest(tuple(h.copy() for h in self._streams))

    def update(self, records: "list | _Run") -> "_EventDigest":
        """Add events (``Record``-shaped tuples: payload, routing key, ..., or a ``_Run`` of
        columns) in order; returns self."""
        if type(records) is _Run:
            return self._update_columns(records)
        payloads = list(map(_PAYLOAD, records))
        keys = list(map(_ROUTING_KEY, records))
        if None in keys:
            key_lengths = array.array("q", [-1 if k is None else len(k) for k in keys])
            keys = [k for k in keys if k is not None]
        else:
            key_lengths = array.array("q", map(len, keys))
        payload_lengths, payload_bytes, key_length_stream, key_bytes = self._streams
        payload_lengths.update(array.array("q", map(len, payloads)))
        payload_bytes.update(b"".join(payloads))
        key_length_stream.update(key_lengths)
        key_bytes.update(b"".join(keys))
        return self

    def _update_columns(self, run: "_Run") -> "_EventDigest":
        """``update`` for events as columns: the same four streams, from the Arrow buffers."""
        import numpy as np

        from .log.columnar import binary_blob, binary_lengths

        payload_lengths, payload_bytes, key_length_stream, key_bytes = self._streams
        payload_lengths.update(binary_lengths(run.values).astype(np.int64))  # as array("q"): native int64
        payload_bytes.update(binary_blob(run.values))
        if run.keys is None:
            key_length_stream.update(np.full(len(run), -1, np.int64))
        else:
            key_lengths = binary_lengths(run.keys).astype(np.int64)
            if run.keys.null_count:
                key_lengths[~np.asarray(run.keys.is_valid())] = -1
            key_length_stream.update(key_lengths)
            key_bytes.update(binary_blob(run.keys))
        return self

    def value(self) -> int:
        """The digest as a signed 64-bit int (an attribute value)."""
        final = hashlib.sha256(b"".join(h.digest() for h in self._streams)).digest()[:8]
        return int.from_bytes(final, "big", signed=True)


class _Run:
    """Events of one segment as Arrow columns (``EventWriter.write_arrow``): payloads (binary),
    routing keys (binary, null: none) or ``None``, timestamps (int64 ms, null: when sent) or ``None``."""

    __slots__ = ("values", "keys", "timestamps")

    def __init__(self, values, keys, timestamps):
        self.values, self.keys, self.timestamps = values, keys, timestamps

    def __len__(self) -> int:
        return len(self.values)

    def slice(self, start: int, length: int) -> "_Run":
        return _Run(*(None if c is None else c.slice(start, length) for c in (self.values, self.keys, self.timestamps)))

    def take(self, indices) -> "_Run":
        return _Run(*(None if c is None else c.take(indices) for c in (self.values, self.keys, self.timestamps)))

    @property
    def nbytes(self) -> int:
        """The payloads' bytes."""
        from .log.columnar import binary_lengths

        return int(binary_lengths(self.values).sum())

    def records(self) -> list:
        from .log.columnar import arrow_records

        return arrow_records(self.values, self.keys, self.timestamps)

    @staticmethod
    def concat(runs: list) -> "_Run":
        import pyarrow as pa

        def column(index: int, kind):
            parts = [r.values if index == 0 else r.keys if index == 1 else r.timestamps for r in runs]
            if all(p is None for p in parts):
                return None
            return pa.concat_arrays([pa.nulls(len(r), kind) if p is None else p for r, p in zip(runs, parts)])

        return _Run(column(0, pa.binary()), column(1, pa.binary()), column(2, pa.int64()))


class _Pending:
    """A segment's queued events (after ``acked``) in event-number order, as pieces of one kind
    each: lists of ``Record``s (``write_many``) and ``_Run``s of columns (``write_arrow``)."""

    __slots__ = ("pieces", "count")

    def __init__(self):
        self.pieces: list = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def append(self, record: tuple) -> None:
        pieces = self.pieces
        if pieces and type(pieces[-1]) is list:
            pieces[-1].append(record)
        else:
            pieces.append([record])
        self.count += 1

    def add_run(self, run: _Run) -> None:
        self.pieces.append(run)
        self.count += len(run)

    def head(self, n: int) -> "list | _Run":
        """Up to ``n`` first events, of one kind: a list of ``Record``s or one ``_Run``."""
        if type(self.pieces[0]) is list:
            records: list = []
            for piece in self.pieces:
                if type(piece) is not list or len(records) >= n:
                    break
                records.extend(piece[: n - len(records)])
            return records
        runs, total = [], 0
        for piece in self.pieces:
            if type(piece) is list or total >= n:
                break
            piece = piece if len(piece) <= n - total else piece.slice(0, n - total)
            runs.append(piece)
            total += len(piece)
        return runs[0] if len(runs) == 1 else _Run.concat(runs)

    def prefix(self, n: int) -> list:
        """The first ``n`` events as pieces."""
        out = []
        for piece in self.pieces:
            if n <= 0:
                break
            out.append(piece if len(piece) <= n else piece[:n] if type(piece) is list else piece.slice(0, n))
            n -= len(out[-1])
        return out

    def drop(self, n: int) -> int:
        """Remove the first ``n`` events; the bytes of their payloads."""
        dropped = 0
        while n > 0:
            piece = self.pieces[0]
            if len(piece) <= n:
                self.pieces.pop(0)
                done, n = piece, n - len(piece)
            elif type(piece) is list:
                done, self.pieces[0] = piece[:n], piece[n:]
                n = 0
            else:
                done, self.pieces[0] = piece.slice(0, n), piece.slice(n, len(piece) - n)
                n = 0
            self.count -= len(done)
            dropped += sum(len(r.value) for r in done) if type(done) is list else done.nbytes
        return dropped

    def clear(self) -> None:
        self.pieces.clear()
        self.count = 0


@attrs.define
class _SegmentState:
    segment: Any
    acked: int | None = None  #: last event number known to be in the segment (None: not read yet)
    numbered: int = 0  #: events numbered so far in this writer's life
    pending: _Pending = attrs.Factory(_Pending)  #: events after ``acked``, in event-number order
    pending_bytes: int = 0
    digest: _EventDigest = attrs.Factory(_EventDigest)  #: of events 1..``hashed``
    hashed: int = 0
    stored_digest: int | None = None  #: the digest stored with event number ``acked`` (None: ``acked`` is 0)
    replayed: list = attrs.Factory(list)  #: skipped events not digested yet (numbers ``hashed+1``...)
    since: float = 0.0  #: linger: when the oldest queued event was queued (monotonic; an upper bound)
    sending: bool = False  #: linger: a flusher is appending from this queue now


class Acknowledgement:
    """Returned by ``EventWriter.write``/``write_many``: tells when those events are durable.

    ``wait()`` returns ``True`` once every one of them is durably written exactly once (at once if
    the segment already held them). On a writer with ``linger_ms`` that is at most about
    ``linger_ms`` plus one append after the write; without linger it sends what is queued first
    (as ``flush()`` does). If a background append failed, ``wait`` raises that error.
    """

    __slots__ = ("_writer", "_marks")

    def __init__(self, writer: "EventWriter", marks: list):
        self._writer = writer
        self._marks = marks  #: (segment state, event number) pairs: durable once acked >= number

    @property
    def done(self) -> bool:
        """Whether the events are durable now (no waiting, no error raised)."""
        return all(state.acked is not None and state.acked >= number for state, number in self._marks)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the events are durable (``True``), or ``timeout`` seconds pass (``False``)."""
        return self._writer._wait_for(self._marks, timeout)


class EventWriter:
    """Writes events to stream ``stream`` exactly once per (writer id, segment, event number).

    ``segments`` creates the stream with that many segments (or checks an existing one has it);
    without it the stream must exist. ``writer_id`` (``uuid.UUID``, its string, 16 bytes or an int)
    names the writer across restarts; a new random one is used if omitted. Events are buffered and
    sent in batches of up to ``batch_events`` events or ``batch_bytes`` bytes; ``flush()`` sends
    the rest and returns once everything written is durable. A failed append is retried up to
    ``retries`` times, ``retry_delay`` seconds apart (growing linearly), except a failure the
    segment settled itself: ``MergeBacklogError`` (raised after its own wait for room: resending
    would wait again) and ``RetriesExhaustedError`` (a retry loop below reached its bound). Those
    are raised at once; the events stay queued for the next flush. Every argument is checked
    before anything is created on storage.

    A writer resumed with the same id must replay the same events in the same order: the ones
    already stored are skipped. It checks that they are the same events (a digest of payloads and
    routing keys, stored with the event number, compared when the replay reaches the stored
    number); if they are not, ``WriterConflictError`` is raised instead of dropping them. The way
    out is a new ``writer_id`` for a new sequence of events (the stored events stay; nothing else
    of the old id's is touched).

    ``shared=True`` allows a twin: another copy of this writer (a speculative duplicate of a Spark
    task) writing the same events in the same order at the same time. Events the twin wrote first
    are skipped instead of raising ``WriterConflictError``. Without it, a segment found ahead of
    everything this writer sent means two writers share an id by mistake, and that is an error.
    """

    def __init__(self, store: SegmentStore, stream: str, segments: int | None = None, writer_id: object = None, *,
                 batch_events: int = 1000, batch_bytes: int = 1 << 20, retries: int = 8, retry_delay: float = 0.05,
                 shared: bool = False, linger_ms: float | None = None):
        # Every argument first: a bad one must leave storage untouched (no stream, no segment).
        if not isinstance(store, SegmentStore):
            raise InvalidInputError(f"store must be a SegmentStore, got {type(store).__name__}")
        validate_name(stream, "stream")
        if segments is not None:
            check_segment_count(segments)
        self.writer_id = _writer_uuid(writer_id)
        for name, value in (("batch_events", batch_events), ("batch_bytes", batch_bytes), ("retries", retries)):
            if type(value) is not int or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r:.60}")
        if isinstance(retry_delay, bool) or not isinstance(retry_delay, (int, float)) or not 0 <= retry_delay <= 3600:
            raise InvalidInputError(f"retry_delay must be a number of seconds in [0, 3600], got {retry_delay!r:.60}")
        if not isinstance(shared, bool):
            raise InvalidInputError(f"shared must be True or False, got {type(shared).__name__}: {shared!r:.60}")
        if linger_ms is not None and (isinstance(linger_ms, bool) or not isinstance(linger_ms, (int, float))
                                      or not 0 <= linger_ms <= 3_600_000):
            raise InvalidInputError(f"linger_ms must be a number of milliseconds in [0, 3600000] or None, "
                                    f"got {linger_ms!r:.60}")
        names = store.create_stream(stream, segments) if segments is not None else store.stream_segments(stream)
        self.store = store
        self.stream = stream
        self._key = self.writer_id.bytes
        self._digest_key = uuid.uuid5(self.writer_id, _DIGEST_NAME).bytes
        self._states = [_SegmentState(store.segment(n)) for n in names]
        self._round_robin = 0
        self.batch_events, self.batch_bytes = batch_events, batch_bytes
        self.retries, self.retry_delay = retries, retry_delay
        self.shared = shared
        self.events_skipped = 0  #: events a restarted writer found already written
        self.retried_appends = 0  #: appends repeated after an error or a lost acknowledgement
        self.appends = 0  #: appends made (each one batch of events to one segment)
        self.linger = (linger_ms or 0) / 1000  #: seconds an event may wait for more to share its append
        self._cond = threading.Condition()  #: guards the queues when flushers run beside writes
        self._flushers: list[threading.Thread] = []
        self._error: BaseException | None = None  #: a background append that failed: raised to callers
        self._urgent = 0  #: flush() calls waiting: every queue is due now
        self._woken = False  #: a queue went from empty to not: flushers waiting idle must look again
        self._closing = False

    def segment_for(self, routing_key: object) -> int:
        """The index of the segment a routing key maps to (a stable hash, the same in every process)."""
        return zlib.crc32(_key_bytes(routing_key)) % len(self._states)

    def write(self, payload: bytes, routing_key: object = None, *, timestamp: int | None = None,
              headers: Any = ()) -> Acknowledgement:
        """Queue one event. Events with a routing key go to the segment its hash picks, in order;
        events without one are spread round-robin. ``timestamp``: ms since the epoch (an int64;
        default: when it is sent); ``headers``: ``(str, bytes)`` pairs. A bad event raises
        ``InvalidInputError`` here and is not queued. Returns an ``Acknowledgement``: its
        ``wait()`` tells when the event is durable. An error of a background append (``linger_ms``)
        is raised by the next ``write``, ``flush`` or ``wait``."""
        return self.write_many([payload], None if routing_key is None else [routing_key],
                               timestamps=None if timestamp is None else [timestamp],
                               headers=[headers] if headers else None)

    def write_many(self, payloads: list, routing_keys: list | None = None, *, timestamps: list | None = None,
                   headers: list | None = None) -> Acknowledgement:
        """``write`` for many events at once (lists of equal length; ``None`` items allowed in the
        keys and timestamps): the same events in the same order, with less work per event. Every
        event is checked first: if one is bad, none is queued. One ``Acknowledgement`` covers them all."""
        payloads = _column(payloads, "payloads")
        count = len(payloads)
        if routing_keys is not None:
            routing_keys = _column(routing_keys, "routing_keys", count)
        if timestamps is not None:
            timestamps = _column(timestamps, "timestamps", count)
        if headers is not None:
            headers = _column(headers, "headers", count)
        if set(map(type, payloads)) - {bytes}:
            payloads = [_payload_bytes(p) for p in payloads]
        keys = [None] * count if routing_keys is None else [
            k if k is None or type(k) is bytes else _key_bytes(k) for k in routing_keys]
        stamps = check_timestamps(timestamps, "timestamp") if timestamps else [None] * count
        pairs = [() if not h else normalize_headers(h, f"event {i}") for i, h in enumerate(headers)] \
            if headers and any(headers) else [()] * count
        with self._guard():
            self._raise_background_error()
            touched = self._queue(payloads, keys, stamps, pairs)
            if self.linger:
                self._after_queueing(touched)
            return Acknowledgement(self, [(state, state.numbered) for state in touched])

    def write_arrow(self, payloads, routing_keys=None, *, timestamps=None) -> Acknowledgement:
        """``write_many`` for events given as Arrow columns, routed, numbered, digested and encoded
        column by column (no Python object per event): the same events in the same order, the
        same segments and the same bytes as ``write_many`` of the same values.

        ``payloads``: a ``pyarrow`` binary (or large binary) array without nulls; ``routing_keys``:
        a binary or string array (strings hash as their UTF-8 bytes), or an integer array (as its
        decimal text), null meaning no key, or ``None``; ``timestamps``: int64 ms (an Arrow or
        numpy array; null: when sent) or ``None``. No headers (``write_many`` takes those). Every
        column is checked first: if one is bad, nothing is queued. On a writer with ``linger_ms``
        the events are queued as ``write_many`` queues them. Needs numpy and pyarrow."""
        import numpy as np
        import pyarrow as pa

        from .log.columnar import check_columns

        if routing_keys is not None and isinstance(routing_keys, (pa.Array, pa.ChunkedArray)):
            kind = routing_keys.type
            if pa.types.is_integer(kind):
                routing_keys = routing_keys.cast(pa.string())
            if pa.types.is_string(routing_keys.type) or pa.types.is_large_string(routing_keys.type):
                routing_keys = routing_keys.cast(pa.binary() if pa.types.is_string(routing_keys.type)
                                                 else pa.large_binary())
        values, keys, stamps = check_columns(payloads, routing_keys, timestamps)
        if isinstance(stamps, np.ndarray):
            stamps = pa.array(stamps, pa.int64())
        if self.linger:  # the flushers send lists of Records
            return self.write_many(values.to_pylist(), None if keys is None else keys.to_pylist(),
                                   timestamps=None if stamps is None else stamps.to_pylist())
        run = _Run(values, keys, stamps)
        targets = self._route(keys, len(run))
        with self._guard():
            self._raise_background_error()
            touched = []
            if targets is None:  # one segment
                touched.append(self._queue_run(self._states[0], run))
            else:
                order = np.argsort(targets, kind="stable")
                bounds = np.searchsorted(targets[order], np.arange(len(self._states) + 1))
                for index, state in enumerate(self._states):
                    lo, hi = int(bounds[index]), int(bounds[index + 1])
                    if lo < hi:
                        part = run if hi - lo == len(run) else run.take(pa.array(order[lo:hi]))
                        touched.append(self._queue_run(state, part))
            return Acknowledgement(self, [(state, state.numbered) for state in touched])

    def _route(self, keys, n: int):
        """The segment index of each of ``n`` events (as ``write`` routes them: the CRC-32 of
        the key, round-robin without one), or ``None`` when there is one segment."""
        import numpy as np

        count = len(self._states)
        if count == 1:
            self._round_robin += n if keys is None else keys.null_count
            return None
        if keys is None:
            targets = (self._round_robin + np.arange(n, dtype=np.int64)) % count
            self._round_robin += n
            return targets
        crc32 = zlib.crc32
        if not keys.null_count:
            return np.fromiter(map(crc32, keys.to_pylist()), np.int64, n) % count
        valid = np.asarray(keys.is_valid())
        targets = np.empty(n, np.int64)
        targets[valid] = np.fromiter(map(crc32, keys.filter(_arrow_mask(valid)).to_pylist()), np.int64) % count
        nulls = n - int(valid.sum())
        targets[~valid] = (self._round_robin + np.arange(nulls, dtype=np.int64)) % count
        self._round_robin += nulls
        return targets

    def _queue_run(self, state: _SegmentState, run: _Run) -> _SegmentState:
        """Number a segment's events given as columns and queue them (``_queue`` for a run)."""
        if state.acked is None:
            self._load(state)
        skip = min(len(run), max(0, state.acked - state.numbered))
        if skip:  # written by an earlier life of this writer (or its twin): digested one by one
            for record in run.slice(0, skip).records():
                state.numbered += 1
                self.events_skipped += 1
                self._replayed(state, record)
            run = run.slice(skip, len(run) - skip)
        if len(run):
            state.numbered += len(run)
            state.pending.add_run(run)
            state.pending_bytes += run.nbytes
            if len(state.pending) >= self.batch_events or state.pending_bytes >= self.batch_bytes:
                self._send(state)
        return state

    def _queue(self, payloads: list, keys: list, stamps: list, pairs: list) -> list[_SegmentState]:
        """Number the events and queue them per segment; returns the segments touched."""
        states, n = self._states, len(self._states)
        crc32, make = zlib.crc32, tuple.__new__  # Record(...) without its keyword-handling __new__
        touched: dict[int, _SegmentState] = {}
        lingering = bool(self.linger)
        for payload, key, stamp, header in zip(payloads, keys, stamps, pairs):
            if key is None:
                state = states[self._round_robin % n]
                self._round_robin += 1
            else:
                state = states[crc32(key) % n]
            touched[id(state)] = state
            if state.acked is None:
                self._load(state)
            record = make(Record, (payload, key, stamp, header, None))
            state.numbered += 1
            if state.numbered <= state.acked:
                self.events_skipped += 1  # written by an earlier life of this writer (or its twin)
                self._replayed(state, record)
                continue
            if not state.pending:
                state.since = time.monotonic()
                self._woken = True  # a queue that was empty: idle flushers must learn its linger deadline
            state.pending.append(record)
            state.pending_bytes += len(payload)
            if not lingering and (len(state.pending) >= self.batch_events or state.pending_bytes >= self.batch_bytes):
                self._send(state)
        return list(touched.values())

    def flush(self) -> None:
        """Send every queued event; when this returns they are all durably written exactly once.

        On a writer with ``linger_ms`` the flushers send them now (not after the linger), and
        this waits for them; an error of a background append is raised here."""
        if not self.linger:
            for state in self._states:
                if state.pending:
                    self._send(state)
            return
        with self._cond:
            self._raise_background_error()
            marks = [(state, state.numbered) for state in self._states if state.acked is not None]
            self._urgent += 1
            self._cond.notify_all()
        try:
            self._wait_for(marks, None)
        finally:
            with self._cond:
                self._urgent -= 1

    def _guard(self) -> contextlib.AbstractContextManager:
        """The queues' lock when flushers run beside the caller; no lock (one thread) without linger."""
        return self._cond if self.linger else contextlib.nullcontext()

    def _load(self, state: _SegmentState) -> None:
        """Read the stored event number and digest (one consistent view of the segment)."""
        state.segment.refresh()
        number, digest = state.segment.get_attributes([self._key, self._digest_key])
        self._check_digest_stored(state, number or 0, digest)
        state.acked, state.stored_digest = number or 0, digest

    def _check_digest_stored(self, state: _SegmentState, number: int, digest: int | None) -> None:
        """An ``EventWriter`` stores an event number with the digest of those events, in one
        append: a number without a digest was written by something else under this writer's id."""
        if number and digest is None:
            raise WriterConflictError(
                f"writer {self.writer_id} on segment {state.segment.name!r}: the segment holds event number "
                f"{number} under this writer's id but no digest of those events, so they were not written "
                f"by an EventWriter; write these events under a new writer_id")

    def _replayed(self, state: _SegmentState, record: tuple) -> None:
        """A skipped event: digest it; once the replay reaches the stored number, compare."""
        state.replayed.append(record)
        if state.numbered == state.acked or len(state.replayed) >= _REPLAY_FEED:
            state.digest.update(state.replayed)
            state.hashed += len(state.replayed)
            state.replayed.clear()
        if state.hashed == state.acked and state.digest.value() != state.stored_digest:
            raise WriterConflictError(
                f"writer {self.writer_id} on segment {state.segment.name!r}: events 1..{state.acked} resent "
                f"by this writer differ from the ones stored under its id (a reused writer id with other "
                f"events?); write new events under a new writer_id")

    def _send(self, state: _SegmentState, lock: Any = None, target: int | None = None) -> None:
        """Append the queue of ``state`` in batches until event ``target`` (default: all of it) is
        acknowledged. ``lock`` (the flushers') is held for the bookkeeping, not for the appends."""
        guard = contextlib.nullcontext() if lock is None else lock
        failures = 0
        while True:
            with guard:
                if not state.pending or (target is not None and state.acked >= target):
                    return
                batch = state.pending.head(self.batch_events)
                last = state.acked + len(batch)
                digest = state.digest.copy().update(batch)
                updates = [
                    AttributeUpdate(self._key, UpdateType.REPLACE_IF_EQUALS, value=last, compare=state.acked or None),
                    AttributeUpdate(self._digest_key, UpdateType.REPLACE_IF_EQUALS, value=digest.value(),
                                    compare=state.stored_digest),
                ]
                self.appends += 1
            try:
                if type(batch) is _Run:
                    state.segment.append_arrow(batch.values, batch.keys, batch.timestamps, updates)
                else:
                    state.segment.append(batch, updates)
            except ConditionalUpdateError as exc:
                current = {f.update.key: f.current for f in exc.failures}
                with guard:
                    self._adopt(state, current.get(self._key, state.acked) or 0,
                                current.get(self._digest_key, state.stored_digest))
                continue
            except (*_PERMANENT, *_SETTLED_BELOW):
                raise
            except (AttrIndexError, OSError):
                failures += 1  # the append may or may not have landed: the condition will tell
                if failures > self.retries:
                    raise
                self.retried_appends += 1
                time.sleep(self.retry_delay * failures)
                continue
            with guard:
                _acknowledge(state, last, digest)

    def _adopt(self, state: _SegmentState, current: int, stored_digest: int | None) -> None:
        """The segment holds events up to ``current`` (digest ``stored_digest``): they are
        acknowledged if they are this writer's, and the rest is resent."""
        self._check_digest_stored(state, current, stored_digest)
        sent = state.acked + len(state.pending)
        if self.shared and current > sent:
            # A twin got further: everything queued is written, and so are the next events up to
            # ``current``, which ``write`` will now skip (and digest) as it numbers them.
            self.events_skipped += len(state.pending)
            for piece in state.pending.pieces:
                state.digest.update(piece)
            state.hashed = sent
            state.pending.clear()
            state.pending_bytes = 0
            state.acked, state.stored_digest = current, stored_digest
            return
        if not state.acked <= current <= sent:
            raise WriterConflictError(
                f"writer {self.writer_id} on segment {state.segment.name!r}: the segment holds event number "
                f"{current}, but this writer has acknowledged {state.acked} and sent up to "
                f"{sent}: is another writer using the same id?")
        digest = state.digest.copy()
        for piece in state.pending.prefix(current - state.acked):
            digest.update(piece)
        if current and digest.value() != stored_digest:
            raise WriterConflictError(
                f"writer {self.writer_id} on segment {state.segment.name!r}: events up to {current} are stored "
                f"under this writer's id, but they are not the ones it sent: is another writer using the same id?")
        self.retried_appends += 1
        _log.info("writer %s on segment %r: events up to %d were already stored (a lost acknowledgement or an "
                  "earlier life); acknowledged, the rest is resent", self.writer_id, state.segment.name, current)
        _acknowledge(state, current, digest)

    def last_event_numbers(self) -> dict[str, int]:
        """The last event number acknowledged per segment name (read from the segments if unknown)."""
        out = {}
        with self._guard():
            for state in self._states:
                if state.acked is None:
                    self._load(state)
                out[state.segment.name] = state.acked
        return out

    # -- linger: background flushers ---------------------------------------------------------
    def _after_queueing(self, touched: list[_SegmentState]) -> None:
        """Under the lock, after queueing with linger: start the flushers, wake them for full
        batches, and hold the caller back while a queue is far ahead of them (bounded slices)."""
        if not self._flushers:
            self._start_flushers()
        if self._woken or any(self._full(state) for state in touched):
            self._woken = False
            self._cond.notify_all()
        limit = QUEUE_BATCHES * self.batch_events
        while any(len(state.pending) >= limit for state in touched):
            self._cond.wait(_WAIT_SLICE)
            self._raise_background_error()

    def _full(self, state: _SegmentState) -> bool:
        return len(state.pending) >= self.batch_events or state.pending_bytes >= self.batch_bytes

    def _start_flushers(self) -> None:
        self._closing = False
        for i in range(min(MAX_FLUSHERS, len(self._states))):
            thread = threading.Thread(target=self._flusher, name=f"attrindex-EventWriter-flusher-{i}", daemon=True)
            self._flushers.append(thread)
            thread.start()

    def _flusher(self) -> None:
        """A flusher thread: appends each queue when it is full, ``linger`` old, or flushed."""
        while True:
            with self._cond:
                state = self._next_due()
                if state is None:
                    return  # closing, or a failure stopped every flusher
                state.sending = True
                target = state.acked + len(state.pending)
                queued_at = time.monotonic()
            try:
                self._send(state, self._cond, target)
            except BaseException as exc:  # raised to the caller by the next write/flush/wait
                with self._cond:
                    self._error = self._error or exc
                    state.sending = False
                    self._cond.notify_all()
                return
            with self._cond:
                state.sending = False
                if state.pending:  # all queued after the queue was taken: none is older than that
                    state.since = queued_at
                self._cond.notify_all()

    def _next_due(self) -> _SegmentState | None:
        """Under the lock: a queue due for an append, waiting (bounded) until one is; ``None``
        when the flushers must stop (closed, or another flusher failed)."""
        while self._error is None:
            now = time.monotonic()
            soonest = None
            for state in self._states:
                if not state.pending or state.sending:
                    continue
                due = now if (self._urgent or self._closing or self._full(state)) else state.since + self.linger
                if due <= now:
                    return state
                soonest = due if soonest is None else min(soonest, due)
            if self._closing and not any(state.sending for state in self._states):
                return None
            self._cond.wait(_WAIT_SLICE if soonest is None else min(_WAIT_SLICE, soonest - now))
        return None

    def _wait_for(self, marks: list, timeout: float | None) -> bool:
        """Wait until each ``(state, number)`` has ``acked >= number``; raise a background error."""
        def reached() -> bool:
            return all(state.acked is not None and state.acked >= number for state, number in marks)
        if not self.linger:
            if not reached():
                self.flush()
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not reached():
                self._raise_background_error()
                if not self._flushers:  # nothing would send them: a closed writer
                    raise InvalidInputError("the EventWriter is closed; its unsent events were not written")
                remaining = _WAIT_SLICE if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, _WAIT_SLICE))
            return True

    def _raise_background_error(self) -> None:
        """Raise the error a background append met (every call after it, until the writer is
        replaced: the events it held are not acknowledged; resume with the same writer_id)."""
        if self._error is not None:
            raise self._error

    def _stop_flushers(self, flush: bool) -> None:
        """Stop the flusher threads (after sending everything queued if ``flush``); bounded."""
        if not self._flushers:
            return
        with self._cond:
            if flush:
                self._closing = True
            else:
                self._error = self._error or InvalidInputError("the EventWriter was closed after an error")
            self._cond.notify_all()
        for thread in self._flushers:
            thread.join()  # bounded: each append retries a bounded number of times
        self._flushers = []

    def close(self) -> None:
        """Flush and stop the background flushers; the store (and its segments) stay open.
        Raises the error of a background append if one failed."""
        try:
            if self._error is None:
                self.flush()
        finally:
            self._stop_flushers(flush=self._error is None)
        self._raise_background_error()

    def __enter__(self) -> "EventWriter":
        return self

    def __exit__(self, exc_type, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._stop_flushers(flush=False)  # the events queued are not acknowledged: nothing waits


def _acknowledge(state: _SegmentState, number: int, digest: _EventDigest) -> None:
    """Events up to ``number`` (digest ``digest``) are in the segment: drop them from the queue."""
    state.pending_bytes -= state.pending.drop(number - state.acked)
    state.acked = state.hashed = number
    state.digest, state.stored_digest = digest, digest.value()


def _arrow_mask(valid):
    """A numpy bool array as an Arrow boolean array (a filter mask)."""
    import pyarrow as pa

    return pa.array(valid, pa.bool_())


def _column(values: object, name: str, count: int | None = None) -> list | tuple:
    """A list argument of ``write_many``: a sequence (any iterable but a single value), of ``count`` items."""
    if type(values) is list and (count is None or len(values) == count):
        return values
    if isinstance(values, (str, bytes, bytearray, memoryview, dict)):
        raise InvalidInputError(f"{name} must be a list, got a single {type(values).__name__}")
    if not isinstance(values, (list, tuple)):
        try:
            values = list(values)  # type: ignore[call-overload]
        except TypeError:
            raise InvalidInputError(f"{name} must be a list, got {type(values).__name__}") from None
    if count is not None and len(values) != count:
        raise InvalidInputError(f"{name} has {len(values)} items for {count} payloads")
    return values


def _writer_uuid(writer_id: object) -> uuid.UUID:
    if writer_id is None:
        return uuid.uuid4()
    if isinstance(writer_id, uuid.UUID):
        return writer_id
    if isinstance(writer_id, str):
        try:
            return uuid.UUID(writer_id)
        except ValueError:
            raise InvalidInputError(f"writer_id string must be a UUID, got {writer_id!r}") from None
    try:
        return uuid.UUID(bytes=to_key(writer_id))
    except InvalidInputError as exc:
        raise InvalidInputError(f"writer_id: {exc}") from None


def _payload_bytes(payload: object) -> bytes:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidInputError(f"an event payload must be bytes, got {type(payload).__name__}")
    return bytes(payload)


def _key_bytes(routing_key: object) -> bytes:
    if isinstance(routing_key, str):
        return routing_key.encode()
    if isinstance(routing_key, (bytes, bytearray, memoryview)):
        return bytes(routing_key)
    if isinstance(routing_key, int) and not isinstance(routing_key, bool):
        return str(routing_key).encode()
    raise InvalidInputError(f"a routing key must be str, bytes or int, got {type(routing_key).__name__}")
