"""Decoding record batches: a batch's payload (decompressed and checked) to records, to keys
alone (``decode_keys``, ``uniform_keys``), to located columns (``BatchColumns``, which re-encodes
runs of them) and to attribute updates. Every inconsistency is ``CorruptDataError``. No I/O."""

from __future__ import annotations

import array
import functools
import itertools
import operator
import struct
import sys

from ... import checksum
from ...errors import CorruptDataError, InvalidInputError
from ..varint import decode_varints, encode_lengths
from .compression import Codec, compress_payload, decompress_payload
from .encode import zigzag_delta
from .header import (BATCH_HEADER_SIZE, BATCH_MAGIC, BATCH_VERSION, CHECKED_HEADER, FLAG_HEADERS, FLAG_KEYS,
                     FLAG_TIMESTAMPS, FLAG_TOMBSTONES, HEADER_STRUCT, I64_MAX, I64_MIN, KEY_SIZE, U64_MASK,
                     UPDATE_SIZE, BatchHeader, corruption_at, seal_header)
from .records import Record

__all__ = ["BatchColumns", "batch_columns", "batch_payload", "decode_attribute_updates", "decode_keys",
           "decode_records", "uniform_keys"]

_BIG_ENDIAN = sys.byteorder == "big"


def batch_payload(buf, pos, header, corrupt, verify) -> tuple[bytes, int, int]:
    """The uncompressed payload as ``(data, start, end)``: ``data[start:end]`` (bytes, maybe ``buf``)."""
    end = pos + header.size
    if pos < 0 or end > len(buf):
        raise InvalidInputError(f"the batch at {pos} ({header.size} bytes) is not all in the buffer")
    start = pos + BATCH_HEADER_SIZE
    if verify and checksum.crc32(memoryview(buf)[start:end]) != header.payload_crc:
        raise corrupt("payload checksum mismatch")
    if header.codec == Codec.NONE:
        if header.payload_size != end - start:
            raise corrupt(f"uncompressed payload of {end - start} bytes, but the header says {header.payload_size}")
        if type(buf) is bytes:
            return buf, start, end
        return bytes(buf[start:end]), 0, end - start
    data = decompress_payload(header.codec, memoryview(buf)[start:end], header.payload_size, corrupt)
    return data, 0, len(data)


def _varints(data, at: int, count: int, limit: int, corrupt, what: str) -> tuple[list[int], int]:
    try:
        values, at = decode_varints(data, at, count)
    except CorruptDataError as exc:  # VarintError: truncated or overflowing
        raise corrupt(f"{what}: {exc}") from None
    if at > limit:
        raise corrupt(f"{what} run past the end of the records section")
    return values, at


def _bounds(lengths: list[int], at: int, limit: int, corrupt, what: str) -> list[int]:
    bounds = list(itertools.accumulate(lengths, initial=at))
    if bounds[-1] > limit:
        raise corrupt(f"{what} add up to {bounds[-1] - at} bytes, more than the payload holds")
    return bounds


class _Layout:
    """Where each column of a payload lies, after strict length checks (no values materialized).

    A blob column is its lengths and the bounds of its pieces (``len(lengths) + 1`` positions).
    """

    __slots__ = ("value_lengths", "value_bounds", "key_codes", "key_lengths", "key_bounds", "deltas",
                 "header_counts", "name_lengths", "name_bounds", "header_value_lengths",
                 "header_value_bounds", "tombstones", "updates_at")


def _layout(data, start: int, end: int, header: BatchHeader, corrupt) -> _Layout:
    count, flags = header.record_count, header.flags
    layout = _Layout()
    updates_at = end - UPDATE_SIZE * header.attribute_count
    if updates_at < start:
        raise corrupt("payload is too short for its attribute updates")
    layout.updates_at = updates_at
    layout.key_codes = layout.deltas = layout.header_counts = layout.tombstones = None
    at = start
    lengths, at = _varints(data, at, count, updates_at, corrupt, "value lengths")
    layout.value_lengths = lengths
    layout.value_bounds = bounds = _bounds(lengths, at, updates_at, corrupt, "value lengths")
    at = bounds[-1]
    if flags & FLAG_KEYS:
        codes, at = _varints(data, at, count, updates_at, corrupt, "key lengths")
        layout.key_codes = codes
        # key length + 1 (0: no key); subtracted in C when every record has a key
        layout.key_lengths = lengths = (list(map((1).__rsub__, codes)) if 0 not in codes
                                        else [c - 1 if c else 0 for c in codes])
        layout.key_bounds = bounds = _bounds(lengths, at, updates_at, corrupt, "key lengths")
        at = bounds[-1]
    if flags & FLAG_TIMESTAMPS:
        layout.deltas, at = _varints(data, at, count, updates_at, corrupt, "timestamp deltas")
    if flags & FLAG_HEADERS:
        counts, at = _varints(data, at, count, updates_at, corrupt, "header counts")
        total = sum(counts)
        if 2 * total > updates_at - at:  # each header takes at least two length bytes
            raise corrupt(f"{total} headers cannot fit in the payload")
        layout.header_counts = counts
        layout.name_lengths, at = _varints(data, at, total, updates_at, corrupt, "header name lengths")
        layout.header_value_lengths, at = _varints(data, at, total, updates_at, corrupt, "header value lengths")
        layout.name_bounds = bounds = _bounds(layout.name_lengths, at, updates_at, corrupt, "header name lengths")
        layout.header_value_bounds = bounds = _bounds(
            layout.header_value_lengths, bounds[-1], updates_at, corrupt, "header value lengths"
        )
        at = bounds[-1]
    if flags & FLAG_TOMBSTONES:
        at = _tombstone_column(data, at, updates_at, layout, corrupt)
    if at != updates_at:
        raise corrupt(f"{updates_at - at} unexpected bytes after the record columns")
    return layout


def _tombstone_column(data, at: int, limit: int, layout: _Layout, corrupt) -> int:
    """Read the tombstone flags (one byte per record) at ``at``; return the position after them."""
    count = len(layout.value_lengths)
    flags = bytes(data[at : at + count])
    if at + count > limit:
        raise corrupt("the tombstones column runs past the end of the records section")
    if flags.translate(None, b"\x00\x01"):
        raise corrupt("a tombstone flag is neither 0 nor 1")
    for i in itertools.compress(range(count), flags):
        if layout.value_lengths[i] or not layout.key_codes[i]:
            raise corrupt(f"tombstone {i} has a value or no key")
    layout.tombstones = flags
    return at + count


_CUT_RUN = 1024  # pieces per precompiled struct when cutting equal-length pieces


@functools.lru_cache(maxsize=64)
def _equal_pieces(length: int, count: int) -> struct.Struct:
    return struct.Struct(f"{length}s" * count)


def _cut(data, at: int, length: int, count: int) -> list[bytes]:
    """``count`` consecutive pieces of ``length`` bytes from ``data[at]``, cut in C by struct."""
    if count <= _CUT_RUN:
        return list(_equal_pieces(length, count).unpack_from(data, at))
    out: list[bytes] = []
    run = _equal_pieces(length, _CUT_RUN)
    step = length * _CUT_RUN
    full, rest = divmod(count, _CUT_RUN)
    for _ in range(full):
        out.extend(run.unpack_from(data, at))
        at += step
    if rest:
        out.extend(_equal_pieces(length, rest).unpack_from(data, at))
    return out


def _slices(data, bounds: list[int], lengths: list[int]) -> list[bytes]:
    """``data[bounds[i]:bounds[i + 1]]`` for each ``i`` (``lengths[i]`` bytes), as bytes."""
    count = len(lengths)
    if count > 1 and lengths.count(lengths[0]) == count:
        return _cut(data, bounds[0], lengths[0], count)
    return list(map(data.__getitem__, map(slice, bounds, itertools.islice(bounds, 1, None))))


def decode_records(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> list[Record]:
    """The records of the batch at ``buf[pos]``, with offsets, timestamps, keys and headers filled in.

    With ``verify`` (the default) the payload checksum is checked first. Any inconsistency in the
    payload is a ``CorruptDataError`` naming ``position + pos``.
    """
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    layout = _layout(data, start, end, header, corrupt)
    count = header.record_count
    if not count:
        return []
    values = _slices(data, layout.value_bounds, layout.value_lengths)
    keys = itertools.repeat(None)
    if layout.key_codes is not None:
        pieces = _slices(data, layout.key_bounds, layout.key_lengths)
        keys = [k if c else None for k, c in zip(pieces, layout.key_codes)]
    stamps = itertools.repeat(header.first_timestamp)
    if layout.deltas is not None:
        stamps = _timestamps(layout.deltas, header, corrupt)
    headers = itertools.repeat(())
    if layout.header_counts is not None:
        headers = _headers(data, layout, corrupt)
    if layout.tombstones is not None:
        values = [None if dead else v for v, dead in zip(values, layout.tombstones)]
    base = header.base_offset
    rows = zip(values, keys, stamps, headers, range(base, base + count))
    return list(map(tuple.__new__, itertools.repeat(Record), rows))


def decode_keys(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> tuple[list[bytes | None], bytes | None]:
    """``(keys, tombstone flags)`` of the batch at ``buf[pos]``, without materializing values:
    what the log cleaner needs to decide which records survive. ``keys`` has one entry per record
    (``None`` for a keyless one); the flags are one byte per record (``None``: no tombstones)."""
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    layout = _layout(data, start, end, header, corrupt)
    if layout.key_codes is None:
        return [None] * header.record_count, None
    pieces = _slices(data, layout.key_bounds, layout.key_lengths) if header.record_count else []
    if 0 in layout.key_codes:
        pieces = [k if c else None for k, c in zip(pieces, layout.key_codes)]
    return pieces, layout.tombstones


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]


def uniform_keys(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> tuple[list[bytes], bytes | None] | None:
    """``decode_keys`` for the common shape, in a few C-level calls: every record has a key and
    every key has the same length (the key-lengths column is one repeated byte), and there is no
    headers column. Returns what ``decode_keys`` would, or ``None`` for any other shape (mixed key
    widths, keyless records, headers, or bytes the strict decoder must judge): the caller then
    uses ``decode_keys``, which decodes every column and names any inconsistency.

    Checked here, in bulk: the value-lengths column (one repeated byte: its total is ``n * len``;
    else decoded and summed), the key-lengths column, the timestamp column's varints, the
    tombstone column's flags, and that the columns end exactly where the attribute updates start.
    """
    n, flags = header.record_count, header.flags
    if not n or not flags & FLAG_KEYS or flags & FLAG_HEADERS:
        return None
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    updates_at = end - UPDATE_SIZE * header.attribute_count
    if start + 2 * n > updates_at:
        return None
    first = data[start]
    if first < 0x80 and data.count(_ONE_BYTE[first], start, start + n) == n:
        lengths = None
        at = start + n + n * first  # every value length is ``first``: no varint decoding
    else:
        lengths, at = _varints(data, start, n, updates_at, corrupt, "value lengths")
        at += sum(lengths)
    if at + n > updates_at:
        return None
    code = data[at]  # key length + 1 (0: no key)
    if not 0 < code < 0x80 or data.count(_ONE_BYTE[code], at, at + n) != n:
        return None  # keyless records or mixed widths: the general path
    width = code - 1
    keys_at, at = at + n, at + n + n * width
    if flags & FLAG_TIMESTAMPS:
        if at > updates_at:
            return None
        _deltas, at = _varints(data, at, n, updates_at, corrupt, "timestamp deltas")
    tombstones = None
    if flags & FLAG_TOMBSTONES:
        tombstones = bytes(data[at:at + n])
        at += n
        if tombstones.translate(None, b"\x00\x01"):
            return None  # a flag that is neither 0 nor 1
        if 1 in tombstones and (first if lengths is None else any(itertools.compress(lengths, tombstones))):
            return None  # a tombstone with a value
    if at != updates_at:
        return None
    keys = _cut(data, keys_at, width, n) if width else [b""] * n
    return keys, tombstones


class BatchColumns:
    """The columns of one batch, located and checked (as ``decode_records`` checks them) but not
    cut into records: what the log cleaner needs to re-encode runs of surviving records without
    building a ``Record`` per record. Made by ``batch_columns``."""

    __slots__ = ("header", "data", "layout", "stamps")

    def __init__(self, header: BatchHeader, data, layout: _Layout, stamps: list[int] | None):
        self.header, self.data, self.layout, self.stamps = header, data, layout, stamps

    @property
    def has_headers(self) -> bool:
        return self.layout.header_counts is not None

    def record_sizes(self) -> list[int]:
        """Bytes of each record's value and key (a tombstone's value and a missing key count 0)."""
        layout = self.layout
        if layout.key_codes is None:
            return layout.value_lengths
        return list(map(operator.add, layout.value_lengths, layout.key_lengths))

    def encode_runs(self, runs: list[tuple[int, int]]) -> list[bytes]:
        """For each ``(start, stop)``, the batch ``encode_batch`` makes of records ``start..stop-1``
        (their offsets, timestamps, keys, tombstones; this batch's codec and batch id; no attribute
        updates), byte for byte, built from column slices, sealed for position 0 (``place_batches``
        seals them for where they land). Not for batches with headers."""
        if self.has_headers:
            raise InvalidInputError("encode_runs does not re-encode batches with a headers column")
        header, data, layout, stamps = self.header, self.data, self.layout, self.stamps
        value_lengths, value_bounds = layout.value_lengths, layout.value_bounds
        codes, tombstones = layout.key_codes, layout.tombstones
        key_bounds = layout.key_bounds if codes is not None else None  # unset without a keys column
        codec = header.codec
        out = []
        for a, b in runs:
            if not 0 <= a < b <= header.record_count:
                raise InvalidInputError(f"run [{a}, {b}) is not within the batch's {header.record_count} records")
            flags = int(codec)
            parts = [encode_lengths(value_lengths[a:b]), data[value_bounds[a]:value_bounds[b]]]
            if codes is not None and any(codes[a:b]):
                flags |= FLAG_KEYS
                parts += [encode_lengths(codes[a:b]), data[key_bounds[a]:key_bounds[b]]]
            first_ts = max_ts = header.first_timestamp
            if stamps is not None:
                run = stamps[a:b]
                first_ts, max_ts = run[0], max(run)
                if run.count(first_ts) != b - a:
                    flags |= FLAG_TIMESTAMPS
                    parts.append(encode_lengths([zigzag_delta(t, first_ts) for t in run]))
            if tombstones is not None and 1 in tombstones[a:b]:
                flags |= FLAG_TOMBSTONES
                parts.append(tombstones[a:b])
            payload = b"".join(parts)
            stored = payload if codec == Codec.NONE else compress_payload(codec, payload)
            head = HEADER_STRUCT.pack(
                BATCH_MAGIC, BATCH_VERSION, flags, BATCH_HEADER_SIZE + len(stored), b - a, 0, len(payload),
                header.base_offset + a, first_ts, max_ts, header.batch_id, checksum.crc32(stored), 0,
            )[:CHECKED_HEADER]
            out.append(b"".join([seal_header(head, 0), stored]))
        return out


def batch_columns(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> BatchColumns:
    """The columns of the batch at ``buf[pos]`` (see ``BatchColumns``), checked as strictly as
    ``decode_records`` checks them: any inconsistency is a ``CorruptDataError``."""
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    layout = _layout(data, start, end, header, corrupt)
    stamps = _timestamps(layout.deltas, header, corrupt) if layout.deltas is not None else None
    if layout.header_counts is not None:
        _headers(data, layout, corrupt)  # names must be UTF-8, as decode_records requires
    return BatchColumns(header, data, layout, stamps)


def _timestamps(deltas: list[int], header: BatchHeader, corrupt) -> list[int]:
    first = header.first_timestamp
    stamps = [first + ((u >> 1) ^ -(u & 1)) for u in deltas]
    if min(stamps) < I64_MIN or max(stamps) > I64_MAX:
        stamps = [((t - I64_MIN) & U64_MASK) + I64_MIN for t in stamps]
    if deltas[0] != 0 or max(stamps) != header.max_timestamp:
        raise corrupt("timestamp column disagrees with the header's first and max timestamps")
    return stamps


def _headers(data, layout: _Layout, corrupt) -> list[tuple]:
    raw_names = _slices(data, layout.name_bounds, layout.name_lengths)
    try:
        names = [name.decode("utf-8") for name in raw_names]
    except UnicodeDecodeError as exc:
        raise corrupt(f"a header name is not UTF-8: {exc}") from None
    pairs = list(zip(names, _slices(data, layout.header_value_bounds, layout.header_value_lengths)))
    bounds = list(itertools.accumulate(layout.header_counts, initial=0))
    return [tuple(pairs[a:b]) if a != b else () for a, b in zip(bounds, itertools.islice(bounds, 1, None))]


def decode_attribute_updates(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> tuple[list[bytes], list[int | None]]:
    """The attribute updates of the batch at ``buf[pos]``: ``(keys, values)``, None meaning removed.

    The record columns are length-checked too (not materialized), so a batch is either valid for
    every reader or ``CorruptDataError`` for all of them.
    """
    n = header.attribute_count
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    at = _layout(data, start, end, header, corrupt).updates_at
    if not n:
        return [], []
    keys = _cut(data, at, KEY_SIZE, n)
    at += KEY_SIZE * n
    column = array.array("q")
    column.frombytes(data[at : at + 8 * n])
    if _BIG_ENDIAN:
        column.byteswap()
    values: list[int | None] = column.tolist()
    removed = data[at + 8 * n : at + 9 * n]
    if removed.count(0) != n:
        if removed.translate(None, b"\x00\x01"):
            raise corrupt("an attribute update's removed flag is neither 0 nor 1")
        for i in itertools.compress(range(n), removed):
            if values[i]:
                raise corrupt(f"removed attribute update {i} carries a value")
            values[i] = None
    return keys, values
