"""``EventWriter``: exactly-once writes of events to a stream of segments.

Each segment keeps, as an attribute keyed by the writer id, the number of the last event this
writer appended there. The writer numbers its events per segment (1, 2, ... in write order) and
sends each batch with ``REPLACE_IF_EQUALS(writer id, value=last number, compare=previous)``, in
the same atomic append as the events. After a lost acknowledgement, a timeout or a restart, the
condition fails with the true last number: everything up to it is acknowledged, the rest is
resent. A restarted writer must replay the same events in the same order (as a retried Spark
task does); events its earlier life already wrote are skipped.
"""

from __future__ import annotations

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
    WriterConflictError,
)
from .keys import to_key
from .log.batch import Record
from .store import SegmentStore

_PERMANENT = (InvalidInputError, ConditionalUpdateError, CorruptDataError)


@attrs.define
class _SegmentState:
    segment: Any
    acked: int | None = None  #: last event number known to be in the segment (None: not read yet)
    numbered: int = 0  #: events numbered so far in this writer's life
    pending: list = attrs.Factory(list)  #: records after ``acked``, in event-number order
    pending_bytes: int = 0


class EventWriter:
    """Writes events to stream ``stream`` exactly once per (writer id, segment, event number).

    ``segments`` creates the stream with that many segments (or checks an existing one has it);
    without it the stream must exist. ``writer_id`` (``uuid.UUID``, its string, 16 bytes or an int)
    names the writer across restarts; a new random one is used if omitted. Events are buffered and
    sent in batches of up to ``batch_events`` events or ``batch_bytes`` bytes; ``flush()`` sends
    the rest and returns once everything written is durable.

    ``shared=True`` allows a twin: another copy of this writer (a speculative duplicate of a Spark
    task) writing the same events in the same order at the same time. Events the twin wrote first
    are skipped instead of raising ``WriterConflictError``. Without it, a segment found ahead of
    everything this writer sent means two writers share an id by mistake, and that is an error.
    """

    def __init__(self, store: SegmentStore, stream: str, segments: int | None = None, writer_id: object = None, *,
                 batch_events: int = 1000, batch_bytes: int = 1 << 20, retries: int = 8, retry_delay: float = 0.05,
                 shared: bool = False):
        if segments is not None:
            names = store.create_stream(stream, segments)
        else:
            names = store.stream_segments(stream)
        self.store = store
        self.stream = stream
        self.writer_id = _writer_uuid(writer_id)
        self._key = self.writer_id.bytes
        self._states = [_SegmentState(store.segment(n)) for n in names]
        self._round_robin = 0
        for name, value in (("batch_events", batch_events), ("batch_bytes", batch_bytes), ("retries", retries)):
            if type(value) is not int or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
        self.batch_events, self.batch_bytes = batch_events, batch_bytes
        self.retries, self.retry_delay = retries, retry_delay
        self.shared = bool(shared)
        self.events_skipped = 0  #: events a restarted writer found already written
        self.retried_appends = 0  #: appends repeated after an error or a lost acknowledgement

    def segment_for(self, routing_key: object) -> int:
        """The index of the segment a routing key maps to (a stable hash, the same in every process)."""
        return zlib.crc32(_key_bytes(routing_key)) % len(self._states)

    def write(self, payload: bytes, routing_key: object = None, *, timestamp: int | None = None,
              headers: Any = ()) -> None:
        """Queue one event. Events with a routing key go to the segment its hash picks, in order;
        events without one are spread round-robin."""
        self.write_many([payload], [routing_key], timestamps=[timestamp], headers=[headers])

    def write_many(self, payloads: list, routing_keys: list | None = None, *, timestamps: list | None = None,
                   headers: list | None = None) -> None:
        """``write`` for many events at once (lists of equal length; ``None`` items allowed in the
        keys and timestamps): the same events in the same order, with less work per event."""
        count = len(payloads)
        for name, column in (("routing_keys", routing_keys), ("timestamps", timestamps), ("headers", headers)):
            if column is not None and len(column) != count:
                raise InvalidInputError(f"{name} has {len(column)} items for {count} payloads")
        if set(map(type, payloads)) - {bytes}:
            payloads = [_payload_bytes(p) for p in payloads]
        keys = [None] * count if routing_keys is None else [
            k if k is None or type(k) is bytes else _key_bytes(k) for k in routing_keys]
        stamps = timestamps or [None] * count
        pairs = headers or [()] * count
        states, n = self._states, len(self._states)
        crc32, make = zlib.crc32, tuple.__new__  # Record(...) without its keyword-handling __new__
        for payload, key, stamp, header in zip(payloads, keys, stamps, pairs):
            if key is None:
                state = states[self._round_robin % n]
                self._round_robin += 1
            else:
                state = states[crc32(key) % n]
            if state.acked is None:
                state.acked = self._stored_number(state)
            state.numbered += 1
            if state.numbered <= state.acked:
                self.events_skipped += 1  # written by an earlier life of this writer (or its twin)
                continue
            state.pending.append(make(Record, (payload, key, stamp, tuple(header) if header else (), None)))
            state.pending_bytes += len(payload)
            if len(state.pending) >= self.batch_events or state.pending_bytes >= self.batch_bytes:
                self._send(state)

    def flush(self) -> None:
        """Send every queued event; when this returns they are all durably written exactly once."""
        for state in self._states:
            if state.pending:
                self._send(state)

    def _stored_number(self, state: _SegmentState) -> int:
        state.segment.refresh()
        return state.segment.get_attribute(self._key) or 0

    def _send(self, state: _SegmentState) -> None:
        failures = 0
        while state.pending:
            batch = state.pending[: self.batch_events]
            last = state.acked + len(batch)
            update = AttributeUpdate(self._key, UpdateType.REPLACE_IF_EQUALS, value=last, compare=state.acked or None)
            try:
                state.segment.append(batch, [update])
            except ConditionalUpdateError as exc:
                self._adopt(state, exc.failures[0].current or 0)
                continue
            except _PERMANENT:
                raise
            except (AttrIndexError, OSError):
                failures += 1  # the append may or may not have landed: the condition will tell
                if failures > self.retries:
                    raise
                self.retried_appends += 1
                time.sleep(self.retry_delay * failures)
                continue
            _acknowledge(state, last)

    def _adopt(self, state: _SegmentState, current: int) -> None:
        """The segment holds events up to ``current``: they are acknowledged, resend the rest."""
        sent = state.acked + len(state.pending)
        if self.shared and current > sent:
            # A twin got further: everything queued is written, and so are the next events up to
            # ``current``, which ``write`` will now skip as it numbers them.
            self.events_skipped += len(state.pending)
            state.pending.clear()
            state.pending_bytes = 0
            state.acked = current
            return
        if not state.acked <= current <= sent:
            raise WriterConflictError(
                f"writer {self.writer_id} on segment {state.segment.name!r}: the segment holds event number "
                f"{current}, but this writer has acknowledged {state.acked} and sent up to "
                f"{sent}: is another writer using the same id?")
        self.retried_appends += 1
        _acknowledge(state, current)

    def last_event_numbers(self) -> dict[str, int]:
        """The last event number acknowledged per segment name (read from the segments if unknown)."""
        out = {}
        for state in self._states:
            if state.acked is None:
                state.acked = self._stored_number(state)
            out[state.segment.name] = state.acked
        return out

    def close(self) -> None:
        """Flush; the store (and its segments) stay open."""
        self.flush()

    def __enter__(self) -> "EventWriter":
        return self

    def __exit__(self, exc_type, *exc_info: object) -> None:
        if exc_type is None:
            self.close()


def _acknowledge(state: _SegmentState, number: int) -> None:
    """Events up to ``number`` are in the segment: drop them from the queue."""
    done = state.pending[: number - state.acked]
    del state.pending[: len(done)]
    state.pending_bytes -= sum(len(r.value) for r in done)
    state.acked = number


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
    return uuid.UUID(bytes=to_key(writer_id))


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
