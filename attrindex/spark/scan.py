"""Planning and running parallel scans of a stream's records (no Spark in here).

A scan is cut into ``ScanRange``s: an offset range of one segment, made of whole log chunks up to
about ``max_records`` records, so a stream of N segments with M chunks each gives up to N*M tasks.
``ScanBounds`` carries what filters narrowed: which segments, an offset range, a timestamp range.
The lower timestamp bound moves each segment's start through its time index; the rest is checked
per record, so the records returned match the bounds exactly.
"""

from __future__ import annotations

from typing import Iterator

import attrs

from ..store import SegmentStore

READ_CHUNK = 10_000  #: records fetched per read call while scanning


@attrs.frozen
class ScanRange:
    segment: str
    start: int  #: first offset
    end: int  #: offset past the last


@attrs.define
class ScanBounds:
    """Conjunction of the supported filters: segments in ``segments`` (None: all), ``offset`` in
    ``[offset_min, offset_max)`` and ``timestamp`` (ms) in ``[time_min, time_max)``."""

    segments: frozenset | None = None
    offset_min: int = 0
    offset_max: int | None = None
    time_min: int | None = None
    time_max: int | None = None

    def keep_segments(self, names) -> None:
        names = frozenset(names)
        self.segments = names if self.segments is None else self.segments & names

    def raise_offset(self, low: int) -> None:
        self.offset_min = max(self.offset_min, low)

    def lower_offset_max(self, high: int) -> None:
        self.offset_max = high if self.offset_max is None else min(self.offset_max, high)

    def raise_time(self, low: int) -> None:
        self.time_min = low if self.time_min is None else max(self.time_min, low)

    def lower_time_max(self, high: int) -> None:
        self.time_max = high if self.time_max is None else min(self.time_max, high)


def plan_scan(store: SegmentStore, names: list[str], bounds: ScanBounds, max_records: int,
              ends: dict[str, int] | None = None, starts: dict[str, int] | None = None) -> list[ScanRange]:
    """The ranges to read of segments ``names``; ``starts``/``ends`` (offsets per segment, for
    streaming micro-batches) narrow further."""
    ranges = []
    for name in names:
        if bounds.segments is not None and name not in bounds.segments:
            continue
        segment = store.segment(name)
        segment.refresh()
        first = max(bounds.offset_min, (starts or {}).get(name, 0), segment.start_offset)
        last = segment.next_offset
        if ends is not None:
            last = min(last, ends.get(name, 0))
        if bounds.offset_max is not None:
            last = min(last, bounds.offset_max)
        if bounds.time_min is not None and first < last:
            found = segment.offset_for_timestamp(bounds.time_min)
            first = last if found is None else max(first, found)
        if first >= last:
            continue
        ranges.extend(_split(name, first, last, segment.chunk_offsets(), max_records))
    return ranges


def _split(name: str, first: int, last: int, chunks: list[tuple[int, int]], max_records: int) -> list[ScanRange]:
    """Cut ``[first, last)`` at chunk boundaries into ranges of at most ``max_records`` records
    (a single chunk holding more gets a range of its own)."""
    out: list[ScanRange] = []
    start = end = first
    for _chunk_start, chunk_end in chunks:
        chunk_end = min(chunk_end, last)
        if chunk_end <= end:
            continue
        if chunk_end - start > max_records and end > start:
            out.append(ScanRange(name, start, end))  # the next chunk would overfill this range
            start = end
        end = chunk_end
        if end >= last:
            break
    end = max(end, last)
    if start < end:
        out.append(ScanRange(name, start, end))
    return out


def scan(store: SegmentStore, scan_range: ScanRange, bounds: ScanBounds) -> Iterator:
    """The records of ``scan_range`` that satisfy ``bounds`` as ``pyarrow.RecordBatch``es of
    ``attrindex.log.columnar.RECORD_SCHEMA`` (decoded column by column), each of at least
    ``READ_CHUNK`` records but the last (stored batches are joined up to that size)."""
    import pyarrow as pa

    from ..log.columnar import within_times

    segment = store.segment(scan_range.segment)
    if segment.next_offset < scan_range.end:
        segment.refresh()
    lo, hi = bounds.time_min, bounds.time_max
    pending, rows = [], 0
    for batch in segment.arrow_batches(scan_range.start, scan_range.end):
        if lo is not None or hi is not None:
            batch = within_times(batch, lo, hi)
        if batch.num_rows:
            pending.append(batch)
            rows += batch.num_rows
        if rows >= READ_CHUNK:
            yield pending[0] if len(pending) == 1 else pa.Table.from_batches(pending).combine_chunks().to_batches()[0]
            pending, rows = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else pa.Table.from_batches(pending).combine_chunks().to_batches()[0]
