"""Record batches straight to Arrow and back, column by column (numpy and pyarrow; no Record per row).

The batch payload (``batch``'s module docstring, docs/format.md) is columnar already: the values
are one blob in record order, and so are the keys and the header names and values. So a batch
becomes an Arrow ``RecordBatch`` with ``RECORD_SCHEMA`` by decoding its length columns (varints)
with numpy and pointing Arrow's binary arrays at the payload's blobs without copying them:

- ``offset``: ``base_offset + arange(n)``;
- ``timestamp`` (ms, UTC): the header's first timestamp, plus the zig-zag deltas of the
  timestamps column if there is one;
- ``key``: binary, null where a record has none; ``value``: binary, null for a tombstone;
- ``headers``: ``list<struct<key: string, value: binary>>`` (empty lists without a headers column).

``decode_arrow`` accepts a batch only if every check of the strict decoder (``decode_records``)
holds; for anything it does not recognise (a column running past its section, a varint past 64
bits, an invalid tombstone flag or UTF-8 name, ...) it lets ``decode_records`` judge the batch, so
a damaged batch raises the same ``CorruptDataError``, and an unusual valid one gives the same
rows. ``encode_arrow`` is the other direction: an Arrow table's columns to the bytes
``encode_batch`` makes of the same records, built from the columns' buffers.

Needs numpy and pyarrow (``pip install 'attrindex[arrow]'``); importing this module without them
raises ``MissingDependencyError``.
"""

from __future__ import annotations

import functools
import sys

from .. import checksum
from ..errors import InvalidInputError, MissingDependencyError

try:
    import numpy as np
    import pyarrow as pa
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise MissingDependencyError("Arrow reads need numpy and pyarrow: pip install 'attrindex[arrow]'") from exc

from .batch.compression import Codec, codec_for, compress_payload
from .batch.decode import batch_payload, decode_records
from .batch.encode import encode_updates, new_batch_id
from .batch.header import (BATCH_HEADER_SIZE, BATCH_MAGIC, BATCH_VERSION, FLAG_HEADERS, FLAG_KEYS, FLAG_TIMESTAMPS,
                           FLAG_TOMBSTONES, HEADER_STRUCT, UPDATE_SIZE, BatchHeader, corruption_at, seal_header)
from .batch.records import Record

__all__ = ["RECORD_SCHEMA", "HEADERS_TYPE", "arrow_records", "binary_lengths", "binary_blob", "check_columns", "clean_nulls",
           "constant_strings", "decode_arrow", "encode_arrow", "records_to_arrow", "empty_batch", "within_times"]

HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
TIMESTAMP_TYPE = pa.timestamp("ms", tz="UTC")
RECORD_SCHEMA = pa.schema([
    ("offset", pa.int64()),
    ("timestamp", TIMESTAMP_TYPE),
    ("key", pa.binary()),
    ("value", pa.binary()),
    ("headers", HEADERS_TYPE),
])
_INT32_MAX = (1 << 31) - 1
_BIG_ENDIAN = sys.byteorder == "big"


class _Bail(Exception):
    """The fast path does not vouch for this batch: let the strict decoder judge it."""


def _varints(u8, at: int, count: int, limit: int):
    """``count`` varints from ``u8[at]`` (not past ``limit``) and the position after: a uint8 view
    of the bytes when every varint is one byte (the common case, no copy), else uint64."""
    if count == 0:
        return _NO_VALUES, at
    if at + count > limit:
        raise _Bail
    head = u8[at:at + count]
    if int(head.max()) < 0x80:  # every varint one byte
        return head, at + count
    for span in (3 * count, 10 * count):  # most columns hold varints of up to three bytes
        window = u8[at:min(limit, at + span)]
        ends = np.flatnonzero(window < 0x80)
        if ends.size >= count or window.size < span:
            break
    if ends.size < count:
        raise _Bail
    ends = ends[:count]
    starts = np.empty(count, np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    widths = ends - starts + 1
    widest = int(widths.max())
    if widest > 10:
        raise _Bail
    if widest == 10 and int(window[ends[widths == 10]].max()) > 1:
        raise _Bail  # bits beyond 64
    kind = np.uint32 if widest <= 4 else np.uint64  # 28 bits fit in 32: half the memory traffic
    values = (window[starts] & 0x7F).astype(kind)
    for k in range(1, widest):  # byte k of each varint; a shorter one's is masked out
        piece = (window[np.minimum(starts + k, ends)] & 0x7F).astype(kind)
        piece *= widths > k
        values |= piece << kind(7 * k)
    return values.astype(np.uint64, copy=False), at + int(ends[-1]) + 1


_NO_VALUES = np.zeros(0, np.uint8)


def _offsets(lengths) -> "np.ndarray":
    """Arrow's int32 offsets (``n + 1``) of pieces of ``lengths`` bytes."""
    out = np.empty(lengths.size + 1, np.int32)
    out[0] = 0
    if lengths.dtype == np.uint8 and lengths.size <= _INT32_MAX // 255:
        np.cumsum(lengths, dtype=np.int32, out=out[1:])  # cannot pass 2**31 - 1
        return out
    if lengths.size and int(lengths.max()) > _INT32_MAX:
        raise _Bail
    wide = np.cumsum(lengths, dtype=np.int64)
    if wide.size and wide[-1] > _INT32_MAX:
        raise _Bail
    out[1:] = wide
    return out


def _binary(buffer, start: int, offsets, valid=None, kind=None) -> "pa.Array":
    """A binary (or ``kind``) array over ``buffer[start:]`` cut at ``offsets``, nulls where not ``valid``."""
    n = offsets.size - 1
    data = buffer.slice(start, int(offsets[-1]))
    bitmap, nulls = None, 0
    if valid is not None:
        nulls = n - int(np.count_nonzero(valid))
        if nulls:
            bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(kind or pa.binary(), n, [bitmap, pa.py_buffer(offsets), data], null_count=nulls)


def decode_arrow(buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None,
                 verify: bool = True, buffer=None) -> "pa.RecordBatch":
    """The records of the batch at ``buf[pos]`` as a ``RECORD_SCHEMA`` record batch.

    With ``verify`` the payload checksum is checked first. Any inconsistency in the payload is the
    ``CorruptDataError`` ``decode_records`` raises. ``buffer`` may give ``pa.py_buffer(buf)``
    (made once for the many batches of one read); the arrays share their bytes with ``buf``.
    """
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    if data is not buf or buffer is None:
        buffer = pa.py_buffer(data)
    try:
        return _fast(data, buffer, start, end, header)
    except _Bail:
        records = decode_records(buf, pos, header, position=position, segment=segment, verify=False)
        return records_to_arrow(records)


def _fast(data, buffer, start: int, end: int, header: BatchHeader) -> "pa.RecordBatch":
    n, flags = header.record_count, header.flags
    updates_at = end - UPDATE_SIZE * header.attribute_count
    if updates_at < start:
        raise _Bail
    if n == 0:
        if updates_at != start:
            raise _Bail
        return empty_batch()
    u8 = np.frombuffer(data, np.uint8)
    lengths, at = _varints(u8, start, n, updates_at)
    value_offsets = _offsets(lengths)
    values_at = at
    at += int(value_offsets[-1])
    if at > updates_at:
        raise _Bail
    key_codes = key_offsets = None
    if flags & FLAG_KEYS:
        key_codes, at = _varints(u8, at, n, updates_at)
        if int(key_codes.min()) > 0:  # every record has a key: its length is its code - 1
            has_key = None
            key_offsets = _offsets(key_codes - key_codes.dtype.type(1))
        else:
            has_key = key_codes != 0
            key_offsets = _offsets(np.where(has_key, key_codes - key_codes.dtype.type(1), 0).astype(key_codes.dtype))
        keys_at = at
        at += int(key_offsets[-1])
        if at > updates_at:
            raise _Bail
    deltas = None
    if flags & FLAG_TIMESTAMPS:
        deltas, at = _varints(u8, at, n, updates_at)
    header_parts = None
    if flags & FLAG_HEADERS:
        counts, at = _varints(u8, at, n, updates_at)
        total = int(counts.sum())
        if 2 * total > updates_at - at:
            raise _Bail
        name_lengths, at = _varints(u8, at, total, updates_at)
        value_lengths, at = _varints(u8, at, total, updates_at)
        name_offsets, header_value_offsets = _offsets(name_lengths), _offsets(value_lengths)
        names_at = at
        header_values_at = at + int(name_offsets[-1])
        at = header_values_at + int(header_value_offsets[-1])
        if at > updates_at:
            raise _Bail
        header_parts = (counts, name_offsets, names_at, header_value_offsets, header_values_at)
    tombstones = None
    if flags & FLAG_TOMBSTONES:
        if at + n > updates_at:
            raise _Bail
        tombstones = u8[at:at + n]
        at += n
        if int(tombstones.max()) > 1:
            raise _Bail
        dead = tombstones == 1
        if (lengths[dead] != 0).any() or (key_codes[dead] == 0).any():
            raise _Bail
    if at != updates_at:
        raise _Bail

    offsets = pa.array(np.arange(header.base_offset, header.base_offset + n, dtype=np.int64))
    if deltas is None:
        stamps = np.full(n, header.first_timestamp, np.int64)
    else:
        deltas = deltas.astype(np.uint64, copy=False)
        signed = (deltas >> np.uint64(1)) ^ (np.uint64(0) - (deltas & np.uint64(1)))
        stamps = signed.view(np.int64) + np.int64(header.first_timestamp)  # wraps as the encoder's deltas do
        if int(deltas[0]) != 0 or int(stamps.max()) != header.max_timestamp:
            raise _Bail
    timestamps = pa.Array.from_buffers(TIMESTAMP_TYPE, n, [None, pa.py_buffer(stamps)])
    keys = (pa.nulls(n, pa.binary()) if key_codes is None
            else _binary(buffer, keys_at, key_offsets, has_key))
    values = _binary(buffer, values_at, value_offsets, None if tombstones is None else tombstones == 0)
    if header_parts is None:
        headers = _no_headers(n)
    else:
        counts, name_offsets, names_at, header_value_offsets, header_values_at = header_parts
        names = _binary(buffer, names_at, name_offsets, kind=pa.string())
        try:
            names.validate(full=True)  # names must be UTF-8, as decode_records requires
        except pa.ArrowInvalid:
            raise _Bail from None
        pairs = pa.StructArray.from_arrays([names, _binary(buffer, header_values_at, header_value_offsets)],
                                           fields=list(HEADERS_TYPE.value_type))
        headers = pa.ListArray.from_arrays(pa.array(_offsets(counts)), pairs, type=HEADERS_TYPE)
    return pa.RecordBatch.from_arrays([offsets, timestamps, keys, values, headers], schema=RECORD_SCHEMA)


_EMPTY_PAIRS = pa.array([], HEADERS_TYPE.value_type)
_zero_offsets = pa.py_buffer(bytes(4 * 8193))


def _no_headers(n: int) -> "pa.Array":
    """A headers column of ``n`` empty lists (its offsets all 0, a shared zeroed buffer)."""
    global _zero_offsets
    zeros = _zero_offsets
    if zeros.size < 4 * (n + 1):
        zeros = _zero_offsets = pa.py_buffer(bytes(4 * (n + 1)))
    return pa.Array.from_buffers(HEADERS_TYPE, n, [None, zeros], children=[_EMPTY_PAIRS])


def empty_batch() -> "pa.RecordBatch":
    """A ``RECORD_SCHEMA`` batch without rows."""
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in RECORD_SCHEMA], schema=RECORD_SCHEMA)


def constant_strings(text: str, n: int) -> "pa.Array":
    """A string array of ``n`` times ``text``, built without a Python object per row (arrays of
    up to 16,384 rows are kept and given again for the same arguments: Arrow arrays are immutable)."""
    return _kept_strings(text, n) if n <= 1 << 14 else _strings(text, n)


def _strings(text: str, n: int) -> "pa.Array":
    data = text.encode("utf-8")
    if len(data) * n > _INT32_MAX:
        return pa.array([text] * n, pa.large_string()).cast(pa.string())
    offsets = (np.arange(n + 1, dtype=np.int64) * len(data)).astype(np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data * n)])


_kept_strings = functools.lru_cache(maxsize=16)(_strings)


def within_times(batch, lo: int | None, hi: int | None):
    """The rows of a ``RECORD_SCHEMA`` batch with ``lo <= timestamp < hi`` (ms; ``None``: unbounded)."""
    import pyarrow.compute as pc

    stamps = batch.column("timestamp").cast(pa.int64())
    keep = None
    if lo is not None:
        keep = pc.greater_equal(stamps, lo)
    if hi is not None:
        below = pc.less(stamps, hi)
        keep = below if keep is None else pc.and_(keep, below)
    return batch if keep is None else batch.filter(keep)


def records_to_arrow(records) -> "pa.RecordBatch":
    """``Record``s read back (offsets set) as a ``RECORD_SCHEMA`` batch, row by row: the path for
    batches the columnar decoder leaves to ``decode_records``."""
    if not records:
        return empty_batch()
    values, keys, stamps, headers, offsets = zip(*records)
    return pa.RecordBatch.from_arrays([
        pa.array(offsets, pa.int64()),
        pa.array(stamps, pa.int64()).cast(TIMESTAMP_TYPE),
        pa.array(keys, pa.binary()),
        pa.array(values, pa.binary()),
        pa.array([[{"key": k, "value": v} for k, v in h] for h in headers], HEADERS_TYPE),
    ], schema=RECORD_SCHEMA)


# ------------------------------------------------------------------------------------- encoding

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_VARINT_LIMITS = [np.uint64(1) << np.uint64(7 * k) for k in range(1, 10)]


def _encode_varints(values) -> bytes:
    """The varints of ``values`` (uint64) back to back, as ``varint.encode_varints`` writes them."""
    n = values.size
    if n == 0:
        return b""
    if int(values.max()) < 0x80:
        return values.astype(np.uint8).tobytes()
    widths = np.ones(n, np.int64)
    for limit in _VARINT_LIMITS:
        widths += values >= limit
    ends = np.cumsum(widths)
    starts = ends - widths
    out = np.empty(int(ends[-1]), np.uint8)
    for k in range(int(widths.max())):
        take = widths > k
        group = ((values[take] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        group[widths[take] > k + 1] |= 0x80
        out[starts[take] + k] = group
    return out.tobytes()


def binary_lengths(array) -> "np.ndarray":
    """The byte lengths of a binary array's items (a null's as its offsets say: 0 after
    ``clean_nulls``), as uint64, without a Python object per item."""
    offsets = np.frombuffer(array.buffers()[1], np.int32, len(array) + 1, array.offset * 4)
    return np.diff(offsets).astype(np.uint64)


def binary_blob(array) -> bytes:
    """The bytes of a binary array's items back to back (nulls hold none after ``clean_nulls``)."""
    offsets = np.frombuffer(array.buffers()[1], np.int32, len(array) + 1, array.offset * 4)
    data = array.buffers()[2]
    return b"" if data is None else data.to_pybytes()[int(offsets[0]):int(offsets[-1])]


_lengths, _blob = binary_lengths, binary_blob


def clean_nulls(array) -> "pa.Array":
    """A binary array whose null items span no bytes (Arrow lets a null's slot hold bytes; the
    encoders and digests read the data buffer as the concatenation of the valid items)."""
    if not array.null_count:
        return array
    valid = np.asarray(array.is_valid())
    if not binary_lengths(array)[~valid].any():
        return array
    return pa.array(array.to_pylist(), array.type)


def _binary_column(column, what: str):
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not isinstance(column, pa.Array):
        raise InvalidInputError(f"{what} must be a pyarrow array, got {type(column).__name__}")
    if pa.types.is_large_binary(column.type):
        column = column.cast(pa.binary())
    elif not pa.types.is_binary(column.type):
        raise InvalidInputError(f"{what} must be a binary array, got {column.type} (cast strings to binary first)")
    return column


def check_columns(values, keys=None, timestamps=None) -> tuple:
    """Records given as columns, checked and in the form ``encode_arrow`` takes: ``values`` a
    binary array without nulls, ``keys`` a binary array (null: no key) or ``None``, ``timestamps``
    int64 ms as an Arrow or numpy array (null: the append's time) or ``None``; large binary is
    narrowed, chunked arrays joined. ``InvalidInputError`` says what is wrong."""
    values = _binary_column(values, "values")
    if values.null_count:
        raise InvalidInputError("values must not be null (a tombstone is a Record with value None: use append)")
    n = len(values)
    if keys is not None:
        keys = clean_nulls(_binary_column(keys, "keys"))
        if len(keys) != n:
            raise InvalidInputError(f"keys has {len(keys)} items for {n} values")
    if timestamps is not None:
        if isinstance(timestamps, pa.ChunkedArray):
            timestamps = timestamps.combine_chunks()
        if isinstance(timestamps, np.ndarray):
            if timestamps.dtype != np.int64 or timestamps.ndim != 1:
                raise InvalidInputError(f"timestamps must be int64 ms, got a numpy array of {timestamps.dtype}")
        elif not isinstance(timestamps, pa.Array) or not pa.types.is_int64(timestamps.type):
            kind = timestamps.type if isinstance(timestamps, pa.Array) else type(timestamps).__name__
            raise InvalidInputError(f"timestamps must be an int64 array of ms, got {kind}")
        if len(timestamps) != n:
            raise InvalidInputError(f"timestamps has {len(timestamps)} items for {n} values")
    return values, keys, timestamps


def arrow_records(values, keys=None, timestamps=None) -> list:
    """The ``Record``s of columns as ``encode_arrow`` takes them (row by row: for the rare paths
    that need them, such as a writer replaying events a segment holds already)."""
    n = len(values)
    key_list = [None] * n if keys is None else keys.to_pylist()
    if timestamps is None:
        stamps = [None] * n
    elif isinstance(timestamps, (pa.Array, pa.ChunkedArray)):
        stamps = timestamps.to_pylist()
    else:
        stamps = [int(t) for t in timestamps]
    return [Record(v, k, t) for v, k, t in zip(values.to_pylist(), key_list, stamps)]


def encode_arrow(values, keys=None, timestamps=None, *, timestamp: int, base_offset: int = 0,
                 codec=Codec.NONE, batch_id: int | None = None, attribute_updates=((), ())) -> bytes:
    """The batch ``encode_batch`` makes of these records, byte for byte, built from columns:
    ``values`` a binary array without nulls, ``keys`` a binary array (null: no key) or ``None``,
    ``timestamps`` int64 ms (numpy or Arrow, nulls: ``timestamp``) or ``None``, and
    ``attribute_updates`` as ``encode_batch`` takes them; no headers, no tombstones (those go
    through ``encode_batch``). The header is sealed for position 0, as ``encode_batch`` seals it
    by default (``place_batches`` seals it for where it lands)."""
    n = len(values)
    if not pa.types.is_binary(values.type) or (keys is not None and not pa.types.is_binary(keys.type)):
        raise InvalidInputError("encode_arrow takes binary values and keys (cast strings first)")
    if values.null_count:
        raise InvalidInputError("encode_arrow: values must not be null (tombstones go through encode_batch)")
    if keys is not None and len(keys) != n or timestamps is not None and len(timestamps) != n:
        raise InvalidInputError("encode_arrow: the columns must have the same length")
    if n == 0 or base_offset < 0 or base_offset + n > _I64_MAX:
        raise InvalidInputError(f"encode_arrow needs records and offsets within int64, got {n} from {base_offset}")
    if keys is not None:
        keys = clean_nulls(keys)
    codec = codec_for(codec)
    batch_id = new_batch_id() if batch_id is None else batch_id
    flags = int(codec)
    parts = [_encode_varints(_lengths(values)), _blob(values)]
    if keys is not None and keys.null_count < n:
        flags |= FLAG_KEYS
        codes = _lengths(keys) + np.uint64(1)
        if keys.null_count:
            codes[~np.asarray(keys.is_valid())] = 0
        parts += [_encode_varints(codes), _blob(keys)]
    first_ts = max_ts = timestamp
    if timestamps is not None:
        if isinstance(timestamps, (pa.Array, pa.ChunkedArray)):
            timestamps = timestamps.fill_null(timestamp).to_numpy(zero_copy_only=False)
        stamps = np.asarray(timestamps, np.int64)
        first_ts, max_ts = int(stamps[0]), int(stamps.max())
        if max_ts != first_ts or int(stamps.min()) != first_ts:
            flags |= FLAG_TIMESTAMPS
            deltas = stamps - np.int64(first_ts)  # wraps to int64, as the record encoder's deltas do
            zigzag = (deltas << np.int64(1)) ^ (deltas >> np.int64(63))
            parts.append(_encode_varints(zigzag.view(np.uint64)))
    update_count, update_parts = encode_updates(attribute_updates)
    parts.extend(update_parts)
    payload = b"".join(parts)
    stored = payload if codec == Codec.NONE else compress_payload(codec, payload)
    size = BATCH_HEADER_SIZE + len(stored)
    if len(payload) > 0xFFFFFFFF or size > 0xFFFFFFFF:
        raise InvalidInputError(f"a batch must stay below 4 GiB, this one would be {max(size, len(payload))} bytes")
    head = HEADER_STRUCT.pack(BATCH_MAGIC, BATCH_VERSION, flags, size, n, update_count, len(payload), base_offset, first_ts,
                        max_ts, batch_id, checksum.crc32(stored), 0)
    return b"".join([seal_header(head, 0), stored])
