"""``Appender``: batches with attribute updates appended to a log and applied to its attribute state.

The leader's part of group commit (``write_queue``): concurrent appends of one handle are checked
in order against the attribute state including the ones before them in the group (conditions,
``expected_offset``), and those that pass are written as one durable compare-and-append at the
log position this handle last saw. A lost race (another writer appended first) catches up from
the log's tail and plans the group again, bounded by ``MAX_GROUP_APPEND_ATTEMPTS``. Once the write is
durable, each batch's updates go to tier 1 and each caller gets its own result or error.

Owned by ``Segment`` (records and conditional updates) and ``AttributeIndex`` (plain
replacements). Runs the leader under its owner's lock (shared with the attribute state).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import attrs

from .attribute_state import AttributeState
from .conditional import resolve_updates
from .errors import BadOffsetError, ConditionalUpdateError, RetriesExhaustedError, StorageError
from .log.batch.compression import Codec
from .log.batch.encode import encode_batch, encode_batch_with_header, new_batch_id, rebase_batch
from .log.batch.header import read_header
from .log.segment_log import SegmentLog
from .write_queue import WriteQueue, WriteRequest

MAX_GROUP_APPEND_ATTEMPTS = 10_000  #: lost compare-and-append races in a row before an append gives up
MAX_GROUP_BYTES = 4 << 20  #: about this much of concurrent appends is written as one group
MAX_GROUP_REQUESTS = 4096  #: appends in one group at most


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


@attrs.define(slots=True)
class PendingAppend:
    """One append waiting in the group-commit queue (checked arguments, its batch id)."""

    records: object  #: a list of records, or ``len``-able column records (``Segment.append_arrow``)
    updates: list | None  #: conditional updates, or None: ``replacements`` are plain REPLACEs
    replacements: tuple  #: ``(keys, values)``
    expected_offset: int | None
    stamp: int
    codec: Codec
    batch_id: int
    #: (keys, values, batch, its header or None) of the last try: a lost race needs only a rebase
    encoded: tuple | None = None


class Appender:
    """Appends of one handle to its log: group commit, conditions, lost races, tier 1."""

    def __init__(self, log: SegmentLog, state: AttributeState, lock: threading.RLock, *,
                 appended: Callable[[], None] | None = None):
        """``appended``: called under the lock after each durable write (the owner wakes its readers)."""
        self._log = log
        self._state = state
        self._lock = lock
        self._appended = appended
        self._queue = WriteQueue(MAX_GROUP_BYTES, MAX_GROUP_REQUESTS)
        self.bytes_written = 0  #: bytes of the batches this appender made durable (for statistics)
        self.keys_written = 0  #: attribute updates in those batches

    @property
    def groups(self) -> int:
        """Durable writes made (one per group)."""
        return self._queue.groups

    @property
    def requests(self) -> int:
        """Appends written in those groups."""
        return self._queue.requests

    def submit(self, pending: PendingAppend, size: int) -> AppendResult:
        """Queue ``pending`` (``size``: its estimated bytes) and return once it is durable, with
        its result or its own error (the group's leader may be this thread or another)."""
        self._state.check_open()
        return self._queue.submit(WriteRequest(pending, size), self._write_group)

    def append_replacements(self, keys: list[bytes], values: list[int | None], codec: Codec) -> AppendResult:
        """An append of plain replacements only, for input already checked: ``keys`` unique 16-byte
        ``bytes`` in any order, ``values`` int64 or ``None``. Encoded here, outside the lock, at
        the log's end as this handle last saw it: a lone writer's leader writes it unchanged."""
        stamp, batch_id = int(time.time() * 1000), new_batch_id()
        data, header = encode_batch_with_header(self._log.append_offset, (), timestamp=stamp,
                                                attribute_updates=(keys, values), codec=codec,
                                                batch_id=batch_id, position=self._log.position)
        pending = PendingAppend([], None, (keys, values), None, stamp, codec, batch_id, (keys, values, data, header))
        return self.submit(pending, len(data))

    def append_empty(self, timestamp: int) -> int:
        """Under the lock: append a batch with no records and no updates; return its byte position."""
        for _lap in _bounded_races(self._log.segment):
            data = encode_batch(self._log.append_offset, [], timestamp=timestamp)
            try:
                position = self._log.append(data, read_header(data))
            except BadOffsetError:
                self._state.catch_up()
                continue
            self.bytes_written += len(data)
            return position

    def _write_group(self, group: list[WriteRequest]) -> None:
        """The leader's part of group commit: validate the group's appends in order, write those
        that pass as one durable append, settle each request with its result or its own error."""
        state, log = self._state, self._log
        with self._lock:
            state.check_open()
            state.ensure_loaded()  # conditions read the current values; tier 1 takes the updates
            state.wait_for_room()
            state.check_open()  # (closed while waiting?)
            fresh = False  # whether the view was just caught up with the log's tail
            for _lap in _bounded_races(log.segment):
                outcome = self._plan_group(group, fresh)
                if outcome is None:  # a failure on a stale view: only the true tail can fail an append
                    state.catch_up()
                    fresh = True
                    continue
                planned, failures = outcome
                for request, error in failures:
                    request.settle(error=error)
                if not planned:
                    return
                try:
                    log.append_many([p[3] for p in planned], [p[4] for p in planned])
                except BadOffsetError:  # another writer appended first: re-validate the whole group
                    for request, _error in failures:
                        request.error = None  # unsettle: the new tail decides again
                    state.catch_up()
                    fresh = True
                    continue
                self.bytes_written += sum(len(p[3]) for p in planned)
                self.keys_written += sum(len(p[1]) for p in planned)
                for request, keys, values, _data, header in planned:  # durable: nothing below raises
                    if keys:
                        state.apply(keys, values)  # (before the settle: its caller may read at once)
                    request.settle(AppendResult(header.base_offset, header.last_offset))
                if self._appended is not None:
                    self._appended()
                state.after_durable()
                return

    def _plan_group(self, group: list[WriteRequest], fresh: bool):
        """``(planned, failures)`` for the group against the current view, or ``None`` when a
        member failed and the view may be stale. ``planned``: ``(request, keys, values, batch,
        header)`` of the members that pass, in order; ``failures``: ``(request, error)``."""
        log = self._log
        next_offset = log.append_offset
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
        values_now = self._state.values

        def current(keys: list[bytes]) -> list[int | None]:
            found = values_now(keys)
            return [earlier.get(k, v) for k, v in zip(keys, found)] if earlier else found

        for request in group:
            a: PendingAppend = request.payload
            try:
                keys, values = a.replacements if a.updates is None else resolve_updates(a.updates, current)
                if a.expected_offset is not None and a.expected_offset != next_offset:
                    raise BadOffsetError(log.segment, a.expected_offset, next_offset)
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


def _bounded_races(name: str) -> Iterator[int]:
    """Laps of an append loop: each lost race means another writer appended; give up after
    ``MAX_GROUP_APPEND_ATTEMPTS`` of them with a clear error rather than spin."""
    yield from range(MAX_GROUP_APPEND_ATTEMPTS)
    raise RetriesExhaustedError(f"segment {name!r}: an append lost the race to other writers {MAX_GROUP_APPEND_ATTEMPTS} times "
                                f"in a row; nothing of it was written")


__all__ = ["AppendResult", "Appender", "MAX_GROUP_APPEND_ATTEMPTS", "PendingAppend"]
