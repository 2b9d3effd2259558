"""Encoding record batches: records and attribute updates to a sealed batch and its header,
renumbering an encoded batch (``rebase_batch``), and the random batch ids. No I/O."""

from __future__ import annotations

import array
import os
import random
import struct
import sys

from ... import checksum
from ...errors import InvalidInputError
from ..varint import encode_lengths
from .compression import Codec, codec_for, compress_payload
from .header import (BATCH_HEADER_SIZE, BATCH_MAGIC, BATCH_VERSION, CHECKED_HEADER, FLAG_HEADERS, FLAG_KEYS,
                     FLAG_TIMESTAMPS, FLAG_TOMBSTONES, HEADER_STRUCT, I64_MAX, I64_MIN, KEY_SIZE, MAX_RECORDS,
                     U32, U32_MAX, U64, U64_MASK, BatchHeader, check_position, seal_header)
from .records import check_i64, normalize_records

__all__ = ["encode_batch", "encode_batch_with_header", "encode_updates", "new_batch_id", "rebase_batch",
           "zigzag_delta"]

_BIG_ENDIAN = sys.byteorder == "big"


def encode_updates(attribute_updates) -> tuple[int, list[bytes]]:
    """``(count, pieces)``: ``(keys, values)`` attribute updates as a batch stores them (``InvalidInputError``
    for bad input, before anything is written)."""
    try:
        keys, values = attribute_updates
    except (TypeError, ValueError):
        raise InvalidInputError("attribute_updates must be a pair (keys, values)") from None
    keys, values = list(keys), list(values)
    n = len(keys)
    if len(values) != n:
        raise InvalidInputError(f"attribute_updates has {n} keys but {len(values)} values")
    if n == 0:
        return 0, []
    try:
        key_blob = b"".join(keys)
    except TypeError:
        raise InvalidInputError("attribute update keys must be 16-byte bytes objects") from None
    if len(key_blob) != KEY_SIZE * n or set(map(len, keys)) != {KEY_SIZE}:
        raise InvalidInputError(f"attribute update keys must be {KEY_SIZE} bytes each")
    if None in values:
        removed = bytes(v is None for v in values)
        values = [0 if v is None else v for v in values]
    else:
        removed = bytes(n)
    try:
        column = array.array("q", values)
    except (TypeError, OverflowError):
        bad = next((v for v in values if type(v) is not int or not I64_MIN <= v <= I64_MAX), None)
        raise InvalidInputError(
            f"attribute update values must be ints in the signed 64-bit range or None, got {bad!r:.60}"
        ) from None
    if _BIG_ENDIAN:
        column.byteswap()
    return n, [key_blob, column.tobytes(), removed]


def encode_batch(
    base_offset: int,
    records,
    *,
    timestamp: int,
    attribute_updates=((), ()),
    codec: Codec | str | int | None = Codec.NONE,
    batch_id: int | None = None,
    position: int = 0,
) -> bytes:
    """One batch holding ``records`` and ``attribute_updates`` (see ``encode_batch_with_header``)."""
    return encode_batch_with_header(base_offset, records, timestamp=timestamp, attribute_updates=attribute_updates,
                                    codec=codec, batch_id=batch_id, position=position)[0]


def encode_batch_with_header(
    base_offset: int,
    records,
    *,
    timestamp: int,
    attribute_updates=((), ()),
    codec: Codec | str | int | None = Codec.NONE,
    batch_id: int | None = None,
    position: int = 0,
) -> tuple[bytes, BatchHeader]:
    """``(batch, its header)``: the header as ``read_header`` would decode it, without decoding it
    (a writer needs both, on every append's path).

    The batch holds ``records`` (numbered from ``base_offset``) and ``attribute_updates``.

    ``records`` items are bytes-like values or ``Record``s; a record without a timestamp gets
    ``timestamp``; a ``Record`` whose value is ``None`` is a tombstone and must have a key.
    ``attribute_updates`` is ``(keys, values)``: 16-byte keys and int64 values, ``None`` meaning
    "remove". Either may be empty. ``batch_id`` (an unsigned 64-bit int; default a fresh random
    one) identifies the append call: give every encoding of one call the same id. The header is
    sealed for segment byte ``position`` (``place_batches`` seals it for another).
    """
    codec = codec_for(codec)
    check_position(position)
    batch_id = new_batch_id() if batch_id is None else _check_batch_id(batch_id)
    if type(base_offset) is not int or base_offset < 0:
        raise InvalidInputError(f"base_offset must be an int >= 0, got {base_offset!r}")
    timestamp = check_i64(timestamp, "timestamp")
    if isinstance(records, (bytes, bytearray, memoryview, str)):
        raise InvalidInputError("records must be a sequence of values or Records, not a single value")
    if not isinstance(records, (list, tuple)):
        try:
            records = list(records)
        except TypeError:
            raise InvalidInputError(f"records must be a sequence, got {type(records).__name__}") from None
    count = len(records)
    if count > MAX_RECORDS:
        raise InvalidInputError(f"a batch holds at most {MAX_RECORDS} records, got {count}")
    if base_offset + count > I64_MAX:
        raise InvalidInputError(
            f"offsets from {base_offset} for {count} records exceed the signed 64-bit range "
            "(the next offset must fit too)"
        )

    flags = int(codec)
    keys = stamps = headers = tombstones = None
    values = records
    crc = total = 0
    lengths_column = b""
    if count:
        # Fast path: plain bytes-like values. join and crc32 refuse non-buffers (Records, str,
        # ints), and the byte total catches memoryviews whose len() is not their byte count.
        try:
            lengths = list(map(len, records))
            expected = sum(lengths)
            lengths_column = encode_lengths(lengths)
            values = list(records)
            crc, total = _checksum_values(values, lengths_column, expected)
        except (TypeError, BufferError):
            expected, total = 0, -1
        if total != expected:
            values, keys, stamps, headers, tombstones = normalize_records(records, timestamp)
            lengths = list(map(len, values))
            lengths_column = encode_lengths(lengths)
            crc, total = _checksum_values(values, lengths_column, sum(lengths))
        total += len(lengths_column)
    parts: list = []  # the payload after the values
    first_ts = max_ts = timestamp
    if stamps is not None:
        first_ts, max_ts = stamps[0], max(stamps)
        if stamps.count(first_ts) == count:
            stamps = None
    if keys is not None:
        flags |= FLAG_KEYS
        parts.append(encode_lengths([0 if k is None else len(k) + 1 for k in keys]))
        parts.append(b"".join([k for k in keys if k is not None]))
    if stamps is not None:
        flags |= FLAG_TIMESTAMPS
        deltas = []
        for t in stamps:
            d = t - first_ts
            if not I64_MIN <= d <= I64_MAX:  # wrap to int64; the reader wraps back
                d = ((d - I64_MIN) & U64_MASK) + I64_MIN
            deltas.append((d << 1) ^ (d >> 63))
        parts.append(encode_lengths(deltas))
    if headers is not None:
        flags |= FLAG_HEADERS
        pairs = [pair for record_headers in headers for pair in record_headers]
        names = [name.encode("utf-8") for name, _ in pairs]
        header_values = [value for _, value in pairs]
        parts.append(encode_lengths(list(map(len, headers))))
        parts.append(encode_lengths(list(map(len, names))))
        parts.append(encode_lengths(list(map(len, header_values))))
        parts.append(b"".join(names))
        parts.append(b"".join(header_values))
    if tombstones is not None:
        flags |= FLAG_TOMBSTONES
        parts.append(bytes(tombstones))
    update_count, update_parts = encode_updates(attribute_updates)
    parts.extend(update_parts)

    pieces = [lengths_column, *values, *parts] if count else parts
    if codec == Codec.NONE:
        # no intermediate payload object: the pieces are copied once, into the batch itself
        for part in parts:
            crc = checksum.crc32(part, crc)
            total += len(part)
        payload_size = stored_size = total
    else:
        payload = b"".join(pieces)
        payload_size = len(payload)
        pieces = [compress_payload(codec, payload)]
        stored_size = len(pieces[0])
        crc = checksum.crc32(pieces[0])
    size = BATCH_HEADER_SIZE + stored_size
    if payload_size > U32_MAX or size > U32_MAX:
        raise InvalidInputError(f"a batch must stay below 4 GiB, this one would be {max(size, payload_size)} bytes")
    header = HEADER_STRUCT.pack(
        BATCH_MAGIC, BATCH_VERSION, flags, size, count, update_count, payload_size,
        base_offset, first_ts, max_ts, batch_id, crc, 0,
    )[:CHECKED_HEADER]
    data = b"".join([header, U32.pack(checksum.crc32(header, checksum.crc32(U64.pack(position)))), *pieces])
    return data, BatchHeader(size, base_offset, count, update_count, first_ts, max_ts, codec, payload_size, crc, flags,
                             batch_id)


# Batch ids come from a generator of this module's own (a caller seeding ``random`` cannot make
# them repeat), seeded from the OS and seeded afresh in every forked child, so that processes
# never share a sequence; drawing one is no system call (it is on every append's path).
_batch_ids = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_batch_ids.seed)


def new_batch_id() -> int:
    """A random unsigned 64-bit batch id (the generator is seeded from the OS in every process,
    forked ones included, so processes never share one)."""
    return _batch_ids.getrandbits(64)


def _check_batch_id(batch_id) -> int:
    if type(batch_id) is not int or not 0 <= batch_id <= U64_MASK:
        raise InvalidInputError(f"batch_id must be an int in [0, 2**64), got {batch_id!r}")
    return batch_id


def rebase_batch(data: bytes, base_offset: int, batch_id: int | None = None, *, position: int = 0) -> bytes:
    """``data`` (a batch from ``encode_batch``) renumbered from ``base_offset``: only the header's
    base offset and checksum change (the batch id stays, unless ``batch_id`` is given), so a
    writer that lost an append race resends without encoding the records again. The header is
    sealed for ``position``."""
    check_position(position)
    if type(base_offset) is not int or not 0 <= base_offset <= I64_MAX - max(0, HEADER_STRUCT.unpack_from(data)[4]):
        raise InvalidInputError(f"base_offset must be an int >= 0 leaving room for the batch, got {base_offset!r}")
    header = bytearray(data[:CHECKED_HEADER])
    struct.pack_into("<q", header, 24, base_offset)
    if batch_id is not None:
        struct.pack_into("<Q", header, 48, _check_batch_id(batch_id))
    return b"".join([seal_header(header, position), memoryview(data)[BATCH_HEADER_SIZE:]])


_CHUNK_BYTES = 32768


def _checksum_values(values, lengths_column: bytes, expected: int) -> tuple[int, int]:
    """CRC-32 of ``lengths_column`` followed by all ``values``, and the values' byte count.

    Values are joined a few dozen kilobytes at a time: one big intermediate buffer next to the
    batch itself makes glibc trim and re-fault the heap on every call, which costs more than the
    copy. ``expected`` (the values' total ``len()``) only sizes the chunks. Raises TypeError or
    BufferError for a value that is not a contiguous buffer.
    """
    crc = checksum.crc32(lengths_column)
    total = 0
    n = len(values)
    step = max(1, (_CHUNK_BYTES * n) // max(1, expected))
    if step == 1:
        for value in values:
            view = memoryview(value)
            crc = checksum.crc32(view, crc)
            total += view.nbytes
        return crc, total
    chunks = []
    for i in range(0, n, step):
        chunk = b"".join(values[i : i + step])
        crc = checksum.crc32(chunk, crc)
        total += len(chunk)
        chunks.append(chunk)
    values[:] = chunks  # the batch is then assembled from these few chunks
    return crc, total


def zigzag_delta(t: int, first: int) -> int:
    """The timestamp column's entry for ``t`` (as ``encode_batch`` writes it)."""
    d = t - first
    if not I64_MIN <= d <= I64_MAX:  # wrap to int64; the reader wraps back
        d = ((d - I64_MIN) & U64_MASK) + I64_MIN
    return (d << 1) ^ (d >> 63)
