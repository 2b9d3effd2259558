"""``SegmentReader``: follows a segment from an offset, waiting at the tail for new records."""

from __future__ import annotations

import threading
import time
from typing import Iterator

from .arguments import check_timeout
from .errors import InvalidInputError
from .log.batch.records import Record

_FETCH_RECORDS = 4096
_FETCH_BYTES = 4 << 20
_STALL_WAIT = 0.05
_WAIT_SLICE = 60.0  #: a read without a timeout still waits in bounded slices


class SegmentReader:
    """Reads records in offset order from ``offset`` on and waits at the tail for more.

    Records appended through the same ``Segment`` wake it at once; records appended by other
    handles or processes are found by the segment's one poller, shared by all its readers, which
    backs off from ``min_poll_interval`` to ``max_poll_interval`` while nothing comes (an idle
    reader on S3 costs one small request per ``max_poll_interval``). Iterating yields records
    until ``cancel()``. Get one from ``Segment.reader``.
    """

    def __init__(self, segment, offset: int, *, fetch, wait, wake):
        """``fetch(offset, max_records, max_bytes, whole_batches=True)``, ``wait(offset, timeout,
        cancelled)`` and ``wake()`` are the segment's, given by ``Segment.reader``."""
        self.segment = segment
        self._fetch, self._wait, self._wake = fetch, wait, wake
        self.position = offset  #: the offset of the next record this reader returns
        self._buffer: list[Record] = []
        self._next = 0
        self._cancelled = threading.Event()

    def read(self, timeout: float | None = None) -> Record | None:
        """The next record; waits up to ``timeout`` seconds (forever if ``None``) for one to come.

        Returns ``None`` on timeout and once the reader is cancelled. If retention removed the
        records at ``position`` meanwhile, raises ``RecordTruncatedError``.
        """
        check_timeout(timeout)
        if self._next < len(self._buffer):
            return self._take()
        return self._wait_for(self._fetch_records, timeout)

    def _fetch_records(self) -> Record | None:
        records = self._fetch(self.position, _FETCH_RECORDS, _FETCH_BYTES, whole_batches=True)
        if not records:
            return None
        self._buffer, self._next = records, 0
        return self._take()

    def _wait_for(self, fetch, timeout: float | None):
        """``fetch()``'s first answer that is not ``None``, waiting between tries as ``read``
        describes; ``None`` on timeout, cancellation or a closed segment."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._cancelled.is_set():
            if self.segment.closed:
                return None
            found = fetch()
            if found is not None:
                return found
            remaining = _WAIT_SLICE if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self.segment.next_offset > self.position:  # readable yet read nothing (a cut gap?): no spin
                self._cancelled.wait(min(remaining, _STALL_WAIT))
                continue
            self._wait(self.position, remaining, self._cancelled)
        return None

    def read_arrow(self, max_records: int = 65536, timeout: float | None = None):
        """Up to ``max_records`` records as one ``pyarrow.RecordBatch`` (the schema of
        ``Segment.arrow_batches``), decoded column by column: what is readable now, else waits as
        ``read`` does; a batch without rows on timeout or once cancelled. Needs numpy and pyarrow."""
        from .log.columnar import empty_batch, records_to_arrow

        if type(max_records) is not int or max_records < 1:
            raise InvalidInputError(f"max_records must be an int >= 1, got {max_records!r}")
        check_timeout(timeout)
        if self._next < len(self._buffer):  # records an earlier read() fetched come first
            records = self._buffer[self._next:self._next + max_records]
            self._next += len(records)
            self.position = records[-1].offset + 1
            return records_to_arrow(records)
        found = self._wait_for(lambda: self._fetch_arrow(max_records), timeout)
        return empty_batch() if found is None else found

    def _fetch_arrow(self, max_records: int):
        from .log.columnar import pa

        batches, rows = [], 0
        for batch in self.segment.arrow_batches(self.position):
            batches.append(batch.slice(0, max_records - rows))
            rows += batches[-1].num_rows
            if rows >= max_records:
                break
        if not rows:
            return None
        out = batches[0] if len(batches) == 1 else pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
        self.position = out.column(0)[-1].as_py() + 1
        return out

    def read_batch(self, max_records: int = _FETCH_RECORDS, timeout: float | None = None) -> list[Record]:
        """Up to ``max_records`` records: what is buffered or readable now, else waits as ``read``."""
        if type(max_records) is not int or max_records < 1:
            raise InvalidInputError(f"max_records must be an int >= 1, got {max_records!r}")
        check_timeout(timeout)
        first = self.read(timeout)
        if first is None:
            return []
        out = [first]
        take = min(max_records - 1, len(self._buffer) - self._next)
        if take > 0:
            out.extend(self._buffer[self._next:self._next + take])
            self._next += take
            self.position = out[-1].offset + 1
        return out

    def _take(self) -> Record:
        record = self._buffer[self._next]
        self._next += 1
        self.position = record.offset + 1
        return record

    def cancel(self) -> None:
        """Stop the reader: a waiting ``read`` returns ``None`` now, and every later one too."""
        self._cancelled.set()
        self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __iter__(self) -> Iterator[Record]:
        while True:
            record = self.read()
            if record is None:
                return
            yield record
