"""Reads of a segment's log by record offset and by time: finding the chunk and the byte where an
offset or a timestamp lies (through each chunk's sparse index), planning the byte ranges a read
scans, and reading the records of a plan, stepping over chunks replaced meanwhile.

``LogReads`` belongs to a ``SegmentLog`` and reads its view (its chunk list, summaries, positions
and batch walk) through the log's public members; it keeps no state but one cached lookup.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

from storage_adapters import RollingSegment

from ..errors import LayoutChangedError, RetriesExhaustedError
from .batch.decode import decode_records
from .batch.header import BatchHeader
from .batch.records import Record
from .sparse_index import ChunkSummary

__all__ = ["LogReads", "MAX_RESYNC_ATTEMPTS", "READ_WINDOW"]

#: Bytes one storage read fetches when scanning (object stores bill per request, so large: one
#: GET per 8 MiB of a consolidated log). A read for at most ``max_bytes`` fetches that much plus
#: ``_READ_SLACK`` so that the batch crossing the budget comes in the same request.
READ_WINDOW = 8 << 20
_READ_SLACK = 256 << 10
MAX_RESYNC_ATTEMPTS = 10  #: layout changes one catch-up or read follows before it gives up
Batches = Iterator[tuple[int, BatchHeader, bytes, int]]


class _Chunk(Protocol):
    start: int
    end: int
    name: str


class _Log(Protocol):
    """What a ``LogReads`` reads of the ``SegmentLog`` that owns it."""

    segment: str
    bytes: RollingSegment
    position: int
    next_offset: int

    @property
    def start_position(self) -> int: ...
    @property
    def chunks(self) -> Sequence[_Chunk]: ...
    def chunk_index(self, position: int) -> int: ...
    def summary(self, i: int) -> ChunkSummary: ...
    def header_at(self, position: int) -> BatchHeader | None: ...
    def batches(self, start: int, end: int, *, names: set[str] | None = ..., window: int = ...) -> Batches: ...


class LogReads:
    """Reads of ``log`` by offset and by time (see the module docstring)."""

    def __init__(self, log: _Log):
        self.log = log
        self._start_cache: tuple[int, int] | None = None  #: (start position, its record offset)

    # -- lookups: callers run them in the log's current view ------------------------------------
    def chunk_for_offset(self, offset: int) -> int:
        """Index of the chunk holding record ``offset`` (binary search over chunk base offsets)."""
        log = self.log
        lo, hi = log.chunk_index(log.start_position), len(log.chunks) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if log.summary(mid).base_offset <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def plan(self, offset: int) -> list[tuple[int, int, str]]:
        """Byte ranges to scan for records from ``offset`` (below ``next_offset``) on, ``(start,
        end, chunk name)``: one per chunk, the first narrowed by its sparse index."""
        log = self.log
        i = self.chunk_for_offset(offset)
        chunk, summary = log.chunks[i], log.summary(i)
        first = chunk.start + summary.locate(offset) if summary.base_offset <= offset else chunk.start
        ranges = [(max(first, log.start_position), min(chunk.end, log.position), chunk.name)]
        ranges += [(c.start, min(c.end, log.position), c.name) for c in log.chunks[i + 1:] if c.start < log.position]
        return ranges

    def batch_position(self, offset: int) -> int:
        """Byte position of the batch holding record ``offset`` (below ``next_offset``)."""
        log = self.log
        i = self.chunk_for_offset(offset)
        chunk, summary = log.chunks[i], log.summary(i)
        start = max(chunk.start + summary.locate(offset) if summary.base_offset <= offset else chunk.start,
                    log.start_position)
        for at, header, _buf, _pos in log.batches(start, log.position):
            if header.next_offset > offset:
                return at
        return log.position

    def start_offset(self) -> int:
        """Record offset of the first readable record (``next_offset`` when none is left)."""
        log = self.log
        start = log.start_position
        if start >= log.position:
            return log.next_offset
        cached = self._start_cache
        if cached is not None and cached[0] == start:
            return cached[1]
        i = log.chunk_index(start)
        if log.chunks[i].start == start:
            offset = log.summary(i).base_offset
        else:  # truncated inside a chunk, at a batch boundary
            header = log.header_at(start)
            offset = header.base_offset if header is not None else log.next_offset
        self._start_cache = (start, offset)
        return offset

    def offset_for_timestamp(self, timestamp: int) -> int | None:
        """The first record offset whose timestamp is ``>= timestamp``, or ``None`` if there is none."""
        log = self.log
        for i in range(log.chunk_index(log.start_position), len(log.chunks)):
            summary = log.summary(i)
            if summary.max_timestamp < timestamp:
                continue  # skip whole chunks by their newest timestamp
            chunk = log.chunks[i]
            start = max(chunk.start + summary.locate_time(timestamp), log.start_position)
            for at, header, buf, pos in log.batches(start, min(chunk.end, log.position)):
                if not header.record_count or header.max_timestamp < timestamp:
                    continue
                for record in decode_records(buf, pos, header, position=at - pos, segment=log.segment):
                    if record.timestamp >= timestamp:
                        return record.offset
        return None

    def chunk_summaries(self) -> list[ChunkSummary]:
        """Summaries of the readable chunks, oldest first."""
        log = self.log
        return [log.summary(i) for i in range(log.chunk_index(log.start_position), len(log.chunks))]

    # -- planned reads: safe while the log's owner appends ---------------------------------------
    def read_planned(self, ranges: list[tuple[int, int, str]], offset: int, max_records: int,
                     max_bytes: int, *, whole_batches: bool = False) -> list[Record]:
        """Records from ``offset`` on within ``ranges`` (at most ``max_records``, unless
        ``whole_batches`` asks for the last batch whole; whole batches up to about ``max_bytes``).
        Safe to run while another thread appends; chunks replaced meanwhile are read anew from
        their start (records already returned are skipped by offset)."""
        out: list[Record] = []
        budget = max_bytes
        segment = self.log.segment
        for at, header, buf, pos in self.planned_batches(ranges, offset, max_bytes):
            # planned_batches() verified the checksums already
            records = decode_records(buf, pos, header, position=at - pos, segment=segment, verify=False)
            wanted = out[-1].offset + 1 if out else offset
            if header.base_offset < wanted:
                records = records[wanted - header.base_offset:]
            out.extend(records)
            budget -= header.size
            if len(out) >= max_records or budget <= 0:
                if not whole_batches:
                    del out[max_records:]
                return out
        return out

    def planned_batches(self, ranges: list[tuple[int, int, str]], offset: int, max_bytes: int = READ_WINDOW
                        ) -> Batches:
        """The verified batches within ``ranges`` that hold records from ``offset`` on, in offset
        order, as ``(position, header, buffer, pos)``; the first may start below ``offset``.
        Reads in windows of about ``max_bytes``. Safe while another thread appends; chunks
        replaced meanwhile are read anew from their start, and batches whose records were yielded
        already are skipped by offset."""
        log = self.log
        wanted = offset
        window = min(READ_WINDOW, max_bytes) + _READ_SLACK
        pending = list(ranges)
        for _attempt in range(MAX_RESYNC_ATTEMPTS):
            try:
                while pending:
                    start, end, name = pending[0]
                    for at, header, buf, pos in log.batches(start, end, names={name}, window=window):
                        if header.next_offset <= wanted or not header.record_count:
                            continue
                        yield at, header, buf, pos
                        wanted = header.next_offset
                    pending.pop(0)
                return
            except LayoutChangedError:
                pending = self._replan(pending)
        raise RetriesExhaustedError(f"segment {log.segment!r}: log chunks were replaced under a read "
                                    f"{MAX_RESYNC_ATTEMPTS} times in a row; read again")

    def _replan(self, pending: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
        """The ranges left after a layout change, from the byte stream's new view: each chunk whole
        from its start (a replaced chunk's positions mean nothing in its replacement)."""
        limit = max(end for _start, end, _name in pending)
        log_bytes = self.log.bytes
        return [(max(c.start, log_bytes.start_offset), min(c.end, limit), c.name)
                for c in log_bytes.chunks_in(pending[0][0], limit)]
