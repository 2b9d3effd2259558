"""Arrow reads of a stream's segments without Spark: ``scan_stream`` and its ``StreamScanner``.

::

    from attrindex import SegmentStore
    from attrindex.arrow import scan_stream

    with SegmentStore.open(url) as store:
        table = scan_stream(store, "events", start_time=1767225600000).to_table()

The records are decoded column by column into Arrow (``Segment.arrow_batches``), so pandas
(``to_pandas()``), Polars (``polars.from_arrow(table)``) and DuckDB (``duckdb.sql("... FROM
reader")`` over ``to_reader()``) read them at Arrow speed. Needs numpy and pyarrow (the ``arrow``
extra).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator

from .errors import InvalidInputError
from .log.columnar import RECORD_SCHEMA, constant_strings, pa, within_times
from .store import SegmentStore

__all__ = ["STREAM_SCHEMA", "StreamScanner", "scan_stream"]

#: A stream's records: the segment's name, then ``RECORD_SCHEMA``'s columns.
STREAM_SCHEMA = pa.schema([pa.field("segment", pa.string()), *RECORD_SCHEMA])


class StreamScanner:
    """The records of some of a stream's segments within a time range (``pyarrow.dataset``'s
    scanner, for a stream): ``to_batches``, ``to_reader``, ``to_table``, ``to_pandas``,
    ``count_rows``. Each call reads what is stored when it starts. Made by ``scan_stream``."""

    def __init__(self, store: SegmentStore, segments: list[str], start_time: int | None, end_time: int | None,
                 columns: list[str] | None):
        self.store = store
        self.segments = segments
        self.start_time = start_time
        self.end_time = end_time
        self.schema = STREAM_SCHEMA if columns is None else pa.schema([STREAM_SCHEMA.field(c) for c in columns])
        self._columns = columns

    def to_batches(self) -> Iterator[Any]:
        """``pyarrow.RecordBatch``es of ``schema``: segment by segment, in offset order within each
        (one per stored batch of records, without rows outside the time range)."""
        for name in self.segments:
            yield from self._segment_batches(name)

    def _segment_batches(self, name: str) -> Iterator[Any]:
        segment = self.store.segment(name)
        segment.refresh()
        start = None
        if self.start_time is not None:
            start = segment.offset_for_timestamp(self.start_time)
            if start is None:  # nothing that late
                return
            start = max(start, segment.start_offset)
        for batch in segment.arrow_batches(start):
            if self.start_time is not None or self.end_time is not None:
                batch = within_times(batch, self.start_time, self.end_time)
            if not batch.num_rows:
                continue
            whole = pa.RecordBatch.from_arrays([constant_strings(name, batch.num_rows), *batch.columns],
                                               schema=STREAM_SCHEMA)
            yield whole if self._columns is None else whole.select(self._columns)

    def to_reader(self) -> Any:
        """A ``pyarrow.RecordBatchReader`` over ``to_batches`` (DuckDB and Polars take it)."""
        return pa.RecordBatchReader.from_batches(self.schema, self.to_batches())

    def to_table(self, *, use_threads: bool = True) -> Any:
        """Every record as one ``pyarrow.Table``, rows in ``to_batches`` order. With
        ``use_threads`` (as ``pyarrow.parquet.read_table``) up to one segment per CPU is read at
        once: file reads, checksums and much of the decoding run outside the GIL."""
        if type(use_threads) is not bool:
            raise InvalidInputError(f"use_threads must be True or False, got {use_threads!r:.60}")
        if not use_threads or len(self.segments) < 2 or (os.cpu_count() or 1) < 2:
            return pa.Table.from_batches(list(self.to_batches()), schema=self.schema)
        pool = ThreadPoolExecutor(min(len(self.segments), os.cpu_count() or 1), thread_name_prefix="attrindex-scan")
        try:
            parts = list(pool.map(lambda name: list(self._segment_batches(name)), self.segments))
        finally:
            pool.shutdown(cancel_futures=True)
        return pa.Table.from_batches([batch for part in parts for batch in part], schema=self.schema)

    def to_pandas(self, **options: Any) -> Any:
        """``to_table().to_pandas(**options)`` (needs pandas)."""
        return self.to_table().to_pandas(**options)

    def count_rows(self) -> int:
        """How many records ``to_batches`` gives."""
        return sum(batch.num_rows for batch in self.to_batches())


def scan_stream(store: SegmentStore, stream: str, *, segments: Iterable[str] | None = None,
                start_time: int | None = None, end_time: int | None = None,
                columns: Iterable[str] | None = None) -> StreamScanner:
    """A scanner over the records of stream ``stream`` in ``store``.

    ``segments`` keeps only those of the stream's segments (names as ``store.stream_segments``
    gives them); ``start_time``/``end_time`` (ms since the epoch) keep records with ``start_time
    <= timestamp < end_time`` (the time index finds where to start); ``columns`` picks columns of
    ``STREAM_SCHEMA``. A missing stream raises ``StreamNotFoundError``; bad arguments
    ``InvalidInputError``, before anything is read.
    """
    names = store.stream_segments(stream)
    if segments is not None:
        if isinstance(segments, str):
            raise InvalidInputError("segments must be a list of segment names, not a str")
        wanted = list(segments)
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise InvalidInputError(f"segments {unknown} are not segments of stream {stream!r} ({names})")
        names = [n for n in names if n in set(wanted)]
    for value, what in ((start_time, "start_time"), (end_time, "end_time")):
        if value is not None and type(value) is not int:
            raise InvalidInputError(f"{what} must be an int (ms since the epoch) or None, got {value!r:.60}")
    if columns is not None:
        if isinstance(columns, str):
            raise InvalidInputError("columns must be a list of column names, not a str")
        columns = list(columns)
        unknown = [c for c in columns if c not in STREAM_SCHEMA.names]
        if unknown or not columns:
            raise InvalidInputError(f"columns must be some of {STREAM_SCHEMA.names}, got {columns}")
    return StreamScanner(store, names, start_time, end_time, columns)
