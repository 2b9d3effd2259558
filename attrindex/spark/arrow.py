"""Arrow record batches to and from attrindex's records and attribute pairs.

Spark hands Python data sources Arrow batches and takes Arrow batches back; converting whole
columns here (one ``to_pylist`` per column, casts in Arrow) is what keeps the Python per-row work
small.
"""

from __future__ import annotations

import uuid
from typing import Sequence

import attrs

import pyarrow as pa
import pyarrow.compute as pc

from ..errors import InvalidInputError, InvalidKeyError
from ..keys import to_key
from .ingest import EventColumns

HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
EVENT_SCHEMA = pa.schema([
    ("segment", pa.string()),
    ("offset", pa.int64()),
    ("timestamp", pa.timestamp("us", tz="UTC")),
    ("key", pa.binary()),
    ("value", pa.binary()),
    ("headers", HEADERS_TYPE),
])
ATTRIBUTE_SCHEMA = pa.schema([("key", pa.binary()), ("value", pa.int64())])


def event_columns(batch: pa.RecordBatch, value: str, key: str | None, timestamp: str | None,
                  headers: str | None) -> EventColumns:
    """The events of one batch of input rows (column names as the write options gave them)."""
    values = column_named(batch, value)
    if values.null_count:
        raise InvalidInputError(f"the value column {value!r} holds nulls; every event needs a payload")
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        values = values.cast(pa.binary())
    return EventColumns(
        values=values.to_pylist(),
        keys=_routing_keys(column_named(batch, key)) if key else None,
        timestamps=_millis(column_named(batch, timestamp)) if timestamp else None,
        headers=[tuple((h["key"], h["value"] or b"") for h in row) if row else () for row in
                 column_named(batch, headers).to_pylist()] if headers else None,
    )


@attrs.frozen
class ArrowColumns:
    """Rows of events as Arrow columns, for writes that route and encode them column by column
    (``EventWriter.write_arrow``, staged batches): binary payloads without nulls, binary routing keys (null: none) or ``None``,
    int64 ms timestamps (null: the batch's time) or ``None``. No headers."""

    values: pa.Array
    keys: pa.Array | None = None
    timestamps: pa.Array | None = None

    def __len__(self) -> int:
        return len(self.values)

    def head(self, n: int) -> "ArrowColumns":
        """The first ``n`` rows."""
        return ArrowColumns(*(None if c is None else c.slice(0, n) for c in (self.values, self.keys, self.timestamps)))

    def encode(self, start: int, stop: int, timestamp: int) -> bytes:
        """Rows ``start..stop-1`` as one record batch (``encode_batch``'s bytes), numbered from 0;
        rows without a timestamp get ``timestamp``."""
        from ..log.columnar import encode_arrow

        n = stop - start
        return encode_arrow(self.values.slice(start, n), None if self.keys is None else self.keys.slice(start, n),
                            None if self.timestamps is None else self.timestamps.slice(start, n), timestamp=timestamp)


def arrow_columns(batch: pa.RecordBatch, value: str, key: str | None, timestamp: str | None) -> ArrowColumns:
    """The events of one batch of input rows as ``ArrowColumns``: the columns ``event_columns``
    reads, converted in Arrow (routing keys as the bytes the writer hashes: strings as UTF-8,
    integers as their decimal text)."""
    values = column_named(batch, value)
    if values.null_count:
        raise InvalidInputError(f"the value column {value!r} holds nulls; every event needs a payload")
    keys = stamps = None
    if key:
        keys = column_named(batch, key)
        if pa.types.is_integer(keys.type):
            keys = keys.cast(pa.string())
        keys = keys.cast(pa.binary())
    if timestamp:
        stamps = column_named(batch, timestamp)
        if pa.types.is_timestamp(stamps.type):
            stamps = pc.cast(stamps, pa.timestamp("ms"), safe=False)
        stamps = stamps.cast(pa.int64())
    return ArrowColumns(values.cast(pa.binary()), keys, stamps)


def column_named(batch: pa.RecordBatch, name: str) -> pa.Array:
    index = batch.schema.get_field_index(name)
    if index < 0:  # Spark's column names are case-insensitive by default
        matches = [i for i, f in enumerate(batch.schema) if f.name.lower() == name.lower()]
        if len(matches) != 1:
            raise InvalidInputError(f"no column {name!r} in {batch.schema.names}")
        index = matches[0]
    return batch.column(index)


def _routing_keys(column: pa.Array) -> list:
    """Routing keys as the writer hashes them: strings as their UTF-8 bytes (cast in Arrow, no
    ``str`` objects), binary as is, integers as ints (the writer hashes their decimal text)."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.cast(pa.binary())
    return column.to_pylist()


def _millis(column: pa.Array) -> list:
    if pa.types.is_timestamp(column.type):
        column = pc.cast(column, pa.timestamp("ms"), safe=False).cast(pa.int64())
    return column.to_pylist()


def events_batch(segment: str, batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch of records of ``segment`` (``attrindex.log.columnar.RECORD_SCHEMA``) as a batch of
    ``EVENT_SCHEMA`` rows: the segment's name in front, timestamps in microseconds. Column
    operations only; the values' bytes are not copied."""
    from ..log.columnar import constant_strings

    return pa.RecordBatch.from_arrays([
        constant_strings(segment, batch.num_rows),
        batch.column(0),
        batch.column(1).cast(EVENT_SCHEMA.field("timestamp").type),
        batch.column(2),
        batch.column(3),
        batch.column(4),
    ], schema=EVENT_SCHEMA)


def attribute_keys(column: pa.Array, name: str = "key") -> list:
    """Canonical 16-byte keys of a key column (16-byte binary, UUID strings, or ints >= 0);
    nulls stay ``None``."""
    kind = column.type
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
        convert = to_key
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        convert = _uuid_key
    elif pa.types.is_integer(kind):
        convert = to_key
    else:
        raise InvalidInputError(f"the key column {name!r} has type {kind}; use 16-byte binary, UUID strings or ints >= 0")
    keys = column.to_pylist()
    try:
        return [None if k is None else convert(k) for k in keys]
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"column {name!r}: {exc}") from None


def _uuid_key(text: str) -> bytes:
    try:
        return uuid.UUID(text).bytes
    except ValueError:
        raise InvalidKeyError(f"string key {text!r} is not a UUID") from None


def attribute_values(column: pa.Array, name: str = "value") -> list:
    """A value column as ints (``None`` where null: remove)."""
    if not pa.types.is_integer(column.type):
        raise InvalidInputError(f"the value column {name!r} has type {column.type}; it must be an integer (long)")
    if pa.types.is_uint64(column.type):
        try:
            column = column.cast(pa.int64())
        except pa.ArrowInvalid:
            raise InvalidInputError(f"the value column {name!r} holds values past 2**63 - 1") from None
    return column.to_pylist()


def attributes_batch(pairs: Sequence[tuple[bytes, int]]) -> pa.RecordBatch:
    keys, values = zip(*pairs) if pairs else ((), ())
    return pa.RecordBatch.from_arrays([pa.array(keys, pa.binary()), pa.array(values, pa.int64())],
                                      schema=ATTRIBUTE_SCHEMA)
