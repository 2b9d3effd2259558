"""The ``attrindex`` data source: streams of segments as Spark tables, batch and streaming.

Writes run the protocol of ``attrindex.spark.ingest`` (exactly once per task attempt, ``writeId``
and streaming batch ids recorded in the stream's commit ledger); reads split the stream by segment
and log chunk (``attrindex.spark.scan``) and push filters on segment, offset and timestamp down.
Everything here is pickled to Spark's Python workers, so it holds only plain settings.
"""

from __future__ import annotations

import datetime
import uuid

import attrs
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    EqualTo,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    IsNotNull,
    LessThan,
    LessThanOrEqual,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from ..errors import InvalidInputError
from . import ingest
from .options import Options
from .scan import ScanBounds, ScanRange, plan_scan, scan

SOURCE = "attrindex"
EVENTS_DDL = ("segment string, offset long, timestamp timestamp, key binary, value binary, "
              "headers array<struct<key:string,value:binary>>")
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
KEEP_STREAMING_VERSIONS = 100  #: committed micro-batch ids remembered per query


# -- settings ---------------------------------------------------------------------------------
@attrs.frozen
class WriteSettings:
    target: ingest.StreamTarget
    value_column: str
    key_column: str | None
    timestamp_column: str | None
    headers_column: str | None
    write_id: str | None
    staged: bool
    faults: ingest.Faults


def write_settings(raw, schema: StructType, overwrite: bool) -> WriteSettings:
    """Parse and check a write's options against the input schema (on the driver, so mistakes
    fail the ``save()``/``start()`` call with a clear message)."""
    options = Options(raw, SOURCE)
    if overwrite:
        raise InvalidInputError(f"{SOURCE}: streams are append-only; use .mode('append'), not overwrite")
    target = _target(options)
    columns = {f.name.lower(): f for f in schema.fields}
    value = options.text("valueColumn", "value")
    _check_column(columns, value, "valueColumn", (BinaryType, StringType), "binary or string")
    key = options.text("keyColumn")
    if key:
        _check_column(columns, key, "keyColumn", (StringType, BinaryType, LongType, IntegerType, ShortType, ByteType),
                      "string, binary or an integer")
    timestamp = options.text("timestampColumn")
    if timestamp:
        _check_column(columns, timestamp, "timestampColumn", (TimestampType, TimestampNTZType, LongType),
                      "timestamp or long (ms since the epoch)")
    headers = options.text("headersColumn")
    if headers:
        _check_column(columns, headers, "headersColumn", (ArrayType,), "array<struct<key:string,value:binary>>")
    return WriteSettings(
        target=target, value_column=value, key_column=key, timestamp_column=timestamp, headers_column=headers,
        write_id=options.text("writeId"),
        staged=options.choice("commitMode", ("direct", "staged"), "direct") == "staged",
        faults=ingest.Faults(
            fail_partitions=options.int_set("testing.failPartitions"),
            fail_after_rows=options.integer("testing.failAfterRows", 1, minimum=1),
            fail_attempts=options.integer("testing.failAttempts", 1, minimum=1),
            duplicate_partitions=options.int_set("testing.duplicatePartitions"),
        ),
    )


def _target(options: Options) -> ingest.StreamTarget:
    return ingest.StreamTarget(
        url=options.required("path", "the storage URL of the store"),
        stream=options.required("stream", "the name of the stream of segments"),
        storage_options=options.storage_options(),
        segments=options.integer("segments", None, minimum=1),
        store_options=_store_options(options),
        batch_events=options.integer("batchEvents", 5000, minimum=1),
    )


def _store_options(options: Options) -> dict:
    """SegmentStore options a write may set: ``codec`` and ``logRollingSize`` (bytes per chunk)."""
    out = {}
    if options.has("codec"):
        out["codec"] = options.text("codec")
    if options.has("logRollingSize"):
        out["log_rolling_size"] = options.integer("logRollingSize", minimum=4096)
    return out


def _check_column(columns: dict, name: str, option: str, types: tuple, wanted: str) -> None:
    field = columns.get(name.lower())
    if field is None:
        raise InvalidInputError(f"{SOURCE}: {option} {name!r} is not a column of the DataFrame "
                                f"(columns: {', '.join(columns)})")
    if not isinstance(field.dataType, types):
        raise InvalidInputError(f"{SOURCE}: column {name!r} ({option}) has type {field.dataType.simpleString()}; "
                                f"it must be {wanted}")


class TaskMessage(WriterCommitMessage):
    """One task attempt's report, with the write it belongs to."""

    def __init__(self, report: ingest.TaskReport, token: str):
        self.report = report
        self.token = token


# -- batch write ------------------------------------------------------------------------------
class EventsWriter(DataSourceArrowWriter):
    def __init__(self, settings: WriteSettings):
        self.settings = settings
        self.token = ingest.write_token(settings.write_id)
        settings.target.prepare()  # the stream must exist (or is created with `segments`)
        with settings.target.open_store() as store:
            ledger = ingest.CommitLedger(store.storage, settings.target.stream)
            self.already_committed = settings.write_id is not None and ledger.committed(self.token, 0) is not None

    def write(self, iterator):
        return TaskMessage(_write_task(self.settings, self.token, 0, iterator, self.already_committed),
                           self.token.hex)

    def commit(self, messages):
        s = self.settings
        if self.already_committed or (s.write_id is None and not s.staged):
            return  # nothing to publish, and nothing worth remembering for an anonymous write
        ingest.commit_write(s.target, self.token, 0, [m.report for m in messages], staged=s.staged)

    def abort(self, messages):
        if self.settings.staged:
            ingest.abort_write(self.settings.target, self.token, 0, _staged_files(messages),
                               everything=self.settings.write_id is None)


def _write_task(settings: WriteSettings, token: uuid.UUID, version: int, iterator, skip: bool) -> ingest.TaskReport:
    from pyspark import TaskContext

    from .arrow import arrow_columns, event_columns

    context = TaskContext.get()
    partition, attempt = context.partitionId(), context.attemptNumber()
    if skip:
        # Read the rows all the same: a Python worker that leaves input unread is not reused,
        # and the next task (of any job) pays for a new one (its imports take seconds).
        for _batch in iterator:
            pass
        return ingest.TaskReport(partition, attempt, already_committed=True)
    s = settings
    if not s.headers_column:  # rows go to storage column by column, without a Python object per row
        batches = (arrow_columns(b, s.value_column, s.key_column, s.timestamp_column) for b in iterator)
    else:
        batches = (event_columns(b, s.value_column, s.key_column, s.timestamp_column, s.headers_column)
                   for b in iterator)
    if s.staged:
        return ingest.stage_attempt(s.target, token, version, partition, attempt, batches, s.faults)
    return ingest.write_direct(s.target, token, version, partition, attempt, batches, s.faults)


def _staged_files(messages) -> list[list]:
    return [entry for m in messages if m is not None for entry in m.report.staged]


# -- streaming write --------------------------------------------------------------------------
class EventsStreamWriter(DataSourceStreamArrowWriter):
    """Each micro-batch is a write with version = batch id; the token is the query's id (or
    ``writeId``), so a batch replayed after a restart is recognised as done."""

    def __init__(self, settings: WriteSettings):
        self.settings = settings
        settings.target.prepare()

    def write(self, iterator):
        from pyspark import TaskContext

        context = TaskContext.get()
        batch_id = int(context.getLocalProperty(BATCH_ID_PROPERTY))
        if self.settings.write_id is not None:
            token = ingest.write_token(self.settings.write_id)
        else:
            token = ingest.query_token(context.getLocalProperty(QUERY_ID_PROPERTY))
        with self.settings.target.open_store() as store:
            done = ingest.CommitLedger(store.storage, self.settings.target.stream).committed(token, batch_id)
        return TaskMessage(_write_task(self.settings, token, batch_id, iterator, done is not None), token.hex)

    def commit(self, messages, batchId):
        messages = [m for m in messages if m is not None]
        if not messages or all(m.report.already_committed for m in messages):
            return
        token = uuid.UUID(messages[0].token)
        ingest.commit_write(self.settings.target, token, batchId, [m.report for m in messages],
                            staged=self.settings.staged, keep_versions=KEEP_STREAMING_VERSIONS)

    def abort(self, messages, batchId):
        present = [m for m in messages if m is not None]
        if self.settings.staged and present:
            ingest.abort_write(self.settings.target, uuid.UUID(present[0].token), batchId,
                               _staged_files(present), everything=False)


# -- reads ------------------------------------------------------------------------------------
@attrs.frozen
class ReadSettings:
    url: str
    stream: str
    storage_options: dict
    max_records: int
    starting_time: int | None
    ending_time: int | None
    starting_offsets: str

    def open_store(self):
        from ..store import SegmentStore

        return SegmentStore.open(self.url, storage_options=dict(self.storage_options))


def read_settings(raw) -> ReadSettings:
    options = Options(raw, SOURCE)
    return ReadSettings(
        url=options.required("path", "the storage URL of the store"),
        stream=options.required("stream", "the name of the stream of segments"),
        storage_options=options.storage_options(),
        max_records=options.integer("maxRecordsPerPartition", 1_000_000, minimum=1),
        starting_time=options.integer("startingTimestamp", None),
        ending_time=options.integer("endingTimestamp", None),
        starting_offsets=options.choice("startingOffsets", ("earliest", "latest"), "earliest"),
    )


def _segment_names(settings: ReadSettings) -> list[str]:
    with settings.open_store() as store:
        return store.stream_segments(settings.stream)  # StreamNotFoundError names the stream


class _RangePartition(InputPartition):
    def __init__(self, scan_range: ScanRange):
        super().__init__(scan_range)


def _read_range(settings: ReadSettings, bounds: ScanBounds, scan_range: ScanRange):
    from .arrow import events_batch

    if scan_range is None:  # Spark reads one partition None when partitions() found nothing
        return
    with settings.open_store() as store:
        for batch in scan(store, scan_range, bounds):
            yield events_batch(scan_range.segment, batch)


class EventsReader(DataSourceReader):
    def __init__(self, settings: ReadSettings):
        self.settings = settings
        self.names = _segment_names(settings)
        self.bounds = _option_bounds(settings)

    def partitions(self):
        with self.settings.open_store() as store:
            ranges = plan_scan(store, self.names, self.bounds, self.settings.max_records)
        return [_RangePartition(r) for r in ranges]

    def read(self, partition):
        return _read_range(self.settings, self.bounds, getattr(partition, "value", None))


class FilteringEventsReader(EventsReader):
    """``EventsReader`` that takes filters on segment, offset and timestamp (Spark accepts a
    reader with ``pushFilters`` only while ``spark.sql.python.filterPushdown.enabled`` is on)."""

    def pushFilters(self, filters):
        # Spark may plan several queries with one reader (count() after a filtered query of the
        # same DataFrame): each call gets that query's complete filter list, so start afresh.
        self.bounds = _option_bounds(self.settings)
        for f in filters:
            if not _push(self.bounds, f):
                yield f


def _option_bounds(settings: ReadSettings) -> ScanBounds:
    bounds = ScanBounds()
    if settings.starting_time is not None:
        bounds.raise_time(settings.starting_time)
    if settings.ending_time is not None:
        bounds.lower_time_max(settings.ending_time)
    return bounds


def _push(bounds: ScanBounds, f) -> bool:
    """Apply filter ``f`` to ``bounds``; whether it is then fully enforced by the scan."""
    column = f.attribute[0].lower() if len(f.attribute) == 1 else None
    if isinstance(f, IsNotNull):
        return column in ("segment", "offset", "timestamp")  # these columns are never null
    if not hasattr(f, "value"):
        return False
    if column == "segment" and isinstance(f, EqualTo) and isinstance(f.value, str):
        bounds.keep_segments([f.value])
    elif column == "segment" and isinstance(f, In) and all(isinstance(v, str) for v in f.value):
        bounds.keep_segments(f.value)
    elif column == "offset" and isinstance(f.value, int) and not isinstance(f.value, bool):
        return _push_range(bounds.raise_offset, bounds.lower_offset_max, f, f.value)
    elif column == "timestamp" and isinstance(f.value, datetime.datetime):
        micros = _micros(f.value)
        if micros % 1000 and isinstance(f, (EqualTo, GreaterThan, LessThanOrEqual)):
            return False  # a sub-millisecond bound: leave it to Spark
        return _push_range(bounds.raise_time, bounds.lower_time_max, f, -(-micros // 1000))
    else:
        return False
    return True


def _push_range(raise_low, lower_high, f, value: int) -> bool:
    """Turn a comparison into ``[low, high)`` bounds on an int column."""
    if isinstance(f, EqualTo):
        raise_low(value)
        lower_high(value + 1)
    elif isinstance(f, GreaterThan):
        raise_low(value + 1)
    elif isinstance(f, GreaterThanOrEqual):
        raise_low(value)
    elif isinstance(f, LessThan):
        lower_high(value)
    elif isinstance(f, LessThanOrEqual):
        lower_high(value + 1)
    else:
        return False
    return True


def _micros(value: datetime.datetime) -> int:
    if value.tzinfo is None:  # Spark gives session-local naive datetimes; Python reads them as local
        value = value.astimezone(datetime.timezone.utc)
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    return (value - epoch) // datetime.timedelta(microseconds=1)


# -- streaming read ---------------------------------------------------------------------------
class EventsStreamReader(DataSourceStreamReader):
    """Offsets are ``{segment name: next offset to read}``; a micro-batch reads ``[start, end)``
    of every segment, split by log chunk like a batch read."""

    def __init__(self, settings: ReadSettings):
        self.settings = settings
        self.names = _segment_names(settings)
        self.bounds = ScanBounds()

    def _positions(self, latest: bool) -> dict:
        with self.settings.open_store() as store:
            out = {}
            for name in self.names:
                segment = store.segment(name)
                segment.refresh()
                out[name] = segment.next_offset if latest else segment.start_offset
            return out

    def initialOffset(self):
        return self._positions(self.settings.starting_offsets == "latest")

    def latestOffset(self, start=None, limit=None):
        return self._positions(True)

    def partitions(self, start, end):
        with self.settings.open_store() as store:
            ranges = plan_scan(store, self.names, self.bounds, self.settings.max_records, ends=end, starts=start)
        return [_RangePartition(r) for r in ranges]

    def read(self, partition):
        return _read_range(self.settings, self.bounds, getattr(partition, "value", None))

    def commit(self, end):
        pass  # nothing to release: offsets live in Spark's checkpoint, records stay until retention


# -- the data source --------------------------------------------------------------------------
class EventsDataSource(DataSource):
    """``spark.read/readStream/write/writeStream.format("attrindex")``: records of a stream."""

    @classmethod
    def name(cls):
        return SOURCE

    def schema(self):
        # Spark asks for the schema at load(), before any reader exists: refuse bad storage options here.
        Options(self.options, SOURCE).storage_options()
        return EVENTS_DDL

    def reader(self, schema):
        return FilteringEventsReader(read_settings(self.options))

    def streamReader(self, schema):
        return EventsStreamReader(read_settings(self.options))

    def writer(self, schema, overwrite):
        return EventsWriter(write_settings(self.options, schema, overwrite))

    def streamWriter(self, schema, overwrite):
        return EventsStreamWriter(write_settings(self.options, schema, overwrite))


class PlainEventsDataSource(EventsDataSource):
    """``EventsDataSource`` for sessions with Python filter pushdown off: filters run in Spark."""

    def reader(self, schema):
        return EventsReader(read_settings(self.options))
