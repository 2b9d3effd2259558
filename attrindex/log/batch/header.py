"""The record batch header: its layout and limits, ``BatchHeader``, and reading, checking and
sealing a header (its checksum is seeded with the byte position the batch lies at). No I/O.

The 64 bytes, little-endian (docs/format.md, "Header (64 bytes)")::

    0   4s   magic b"AIXB"
    4   u16  format version (3)
    6   u16  flags: bits 0-2 codec, bit 3 keys column, bit 4 timestamps column, bit 5 headers column,
              bit 6 tombstones column
    8   u32  size of the whole batch, header included
    12  u32  record count
    16  u32  attribute update count
    20  u32  payload length before compression
    24  i64  base offset (logical offset of the first record)
    32  i64  first timestamp (the first record's; the append timestamp if there are no records)
    40  i64  max timestamp
    48  u64  batch id (random, fixed per append call: a writer recognises its own batch)
    56  u32  CRC-32 of the stored (possibly compressed) payload
    60  u32  CRC-32 of bytes 0..59, seeded with the batch's byte position in its segment
"""

from __future__ import annotations

import struct

import attrs

from ... import checksum
from ...errors import CorruptDataError, InvalidInputError
from .compression import Codec

__all__ = [
    "BATCH_HEADER_SIZE",
    "BATCH_MAGIC",
    "BATCH_VERSION",
    "BatchHeader",
    "check_batch",
    "check_position",
    "check_span",
    "claimed_size",
    "corruption_at",
    "peek_header",
    "read_header",
    "seal_header",
]


BATCH_MAGIC = b"AIXB"
BATCH_VERSION = 3  # 1 (no batch id) and 2 (checksum not seeded with the position) were never released
HEADER_STRUCT = struct.Struct("<4sHHIIIIqqqQII")
BATCH_HEADER_SIZE = HEADER_STRUCT.size  # 64
CHECKED_HEADER = BATCH_HEADER_SIZE - 4  # the header checksum covers the bytes before it
U64 = struct.Struct("<Q")  #: a byte position, as it seeds the header checksum
U32 = struct.Struct("<I")  #: the header checksum

_CODEC_MASK = 0x07
FLAG_KEYS = 0x08
FLAG_TIMESTAMPS = 0x10
FLAG_HEADERS = 0x20
FLAG_TOMBSTONES = 0x40  #: a column of one byte per record: 1 = tombstone (value None)
_MAX_CODEC = max(Codec)
_KNOWN_FLAGS = _CODEC_MASK | FLAG_KEYS | FLAG_TIMESTAMPS | FLAG_HEADERS | FLAG_TOMBSTONES

MAX_RECORDS = (1 << 31) - 1
U32_MAX = (1 << 32) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
U64_MASK = (1 << 64) - 1
KEY_SIZE = 16
UPDATE_SIZE = KEY_SIZE + 8 + 1  # key, i64 value, removed flag


@attrs.frozen
class BatchHeader:
    """A decoded batch header. ``size`` counts the whole batch, header included."""

    size: int
    base_offset: int
    record_count: int
    attribute_count: int
    first_timestamp: int
    max_timestamp: int
    codec: Codec
    # Beyond the fields above, what the payload readers need (defaulted, so that code building a
    # header from the seven fields above still works; such a header cannot verify a payload).
    payload_size: int = 0  # payload length before compression
    payload_crc: int = 0  # CRC-32 of the stored payload
    flags: int = 0  # the raw header flags (codec and which optional columns are present)
    batch_id: int = 0  # random per append call, kept across its retries (see ``new_batch_id``)

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.record_count - 1


def corruption_at(segment: str | None, offset: int):
    """``corrupt(what)``: the ``CorruptDataError`` for a batch of ``segment`` at log byte ``offset``."""
    where = f"segment {segment!r}: " if segment is not None else ""

    def corrupt(what: str) -> CorruptDataError:
        return CorruptDataError(f"{where}record batch at offset {offset}: {what}", segment=segment, offset=offset)

    return corrupt


def read_header(buf, pos: int = 0, *, position: int = 0, segment: str | None = None,
                partial: bool = False) -> BatchHeader | None:
    """The header of the batch at ``buf[pos]``, or None if that batch is not all in ``buf`` yet
    (with ``partial``, only the header must be: for callers that need just its fields).

    ``position`` is the segment byte position of ``buf[0]``: the header checksum is seeded with
    ``position + pos``, so a batch sealed for another position is invalid here. Raises
    ``CorruptDataError`` (offset ``position + pos``) when the bytes there are not a batch header:
    a wrong magic or version, a checksum mismatch (damage, or a batch not written at this
    position) or impossible fields. Fewer than a header's worth of bytes count as incomplete only
    if they start like the magic (a torn header always does), so short garbage at the end of a log
    is reported too.
    """
    if pos < 0:
        raise InvalidInputError(f"position must be >= 0, got {pos}")
    available = len(buf) - pos
    if available < BATCH_HEADER_SIZE:
        if available > 0:
            start = bytes(buf[pos : pos + min(available, len(BATCH_MAGIC))])
            if not BATCH_MAGIC.startswith(start):
                raise corruption_at(segment, position + pos)(f"bad magic {start!r} in a {available}-byte tail")
        return None
    (magic, version, flags, size, count, update_count, payload_size,
     base_offset, first_ts, max_ts, batch_id, payload_crc, header_crc) = HEADER_STRUCT.unpack_from(buf, pos)
    if magic != BATCH_MAGIC:
        raise corruption_at(segment, position + pos)(f"bad magic {magic!r}")
    if version != BATCH_VERSION:  # before the checksum, which older versions seeded differently
        raise corruption_at(segment, position + pos)(_version_problem(version))
    if type(position) is not int or position < 0:
        raise InvalidInputError(f"position must be an int >= 0, got {position!r:.60}")
    seed = checksum.crc32(U64.pack(position + pos))
    if checksum.crc32(memoryview(buf)[pos : pos + CHECKED_HEADER], seed) != header_crc:
        raise corruption_at(segment, position + pos)(
            f"header checksum mismatch (damaged bytes, or a batch not written at byte {position + pos})")
    problem = _header_problem(version, flags, size, count, update_count, payload_size, base_offset, first_ts, max_ts)
    if problem:
        raise corruption_at(segment, position + pos)(problem)
    if size > available and not partial:
        return None
    codec = Codec(flags & _CODEC_MASK)
    return BatchHeader(
        size, base_offset, count, update_count, first_ts, max_ts, codec, payload_size, payload_crc, flags, batch_id
    )


def peek_header(buf, pos: int = 0) -> BatchHeader:
    """The header of the whole batch at ``buf[pos]`` whatever position it is sealed for: its
    fields are checked (``InvalidInputError``), its checksum is not. For batches held in memory
    between a checked read (or their encoding) and their placement, such as the pieces a cleaner
    moves; bytes read from storage are checked with ``read_header``."""
    if pos < 0 or len(buf) - pos < BATCH_HEADER_SIZE:
        raise InvalidInputError(f"peek_header: no whole batch header at {pos} in {len(buf)} bytes")
    (magic, version, flags, size, count, update_count, payload_size,
     base_offset, first_ts, max_ts, batch_id, payload_crc, _crc) = HEADER_STRUCT.unpack_from(buf, pos)
    problem = (f"bad magic {magic!r}" if magic != BATCH_MAGIC else
               _header_problem(version, flags, size, count, update_count, payload_size, base_offset, first_ts, max_ts))
    if not problem and size > len(buf) - pos:
        problem = f"the batch of {size} bytes is not all in the buffer"
    if problem:
        raise InvalidInputError(f"peek_header: the bytes at {pos} are not a whole batch: {problem}")
    return BatchHeader(size, base_offset, count, update_count, first_ts, max_ts, Codec(flags & _CODEC_MASK),
                       payload_size, payload_crc, flags, batch_id)


def _version_problem(version: int) -> str:
    if 0 < version < BATCH_VERSION:
        return (f"format version {version}, written by a development version before 0.1.0: this attrindex reads "
                f"format version {BATCH_VERSION} only (there is no migration)")
    return f"unknown format version {version} (this attrindex reads format version {BATCH_VERSION})"


def claimed_size(buf, pos: int = 0) -> int | None:
    """The size field of the batch header at ``buf[pos]`` checked against nothing but the magic:
    what a header that fails its checksum still claims (None without the magic or a whole header)."""
    if len(buf) - pos < BATCH_HEADER_SIZE or bytes(buf[pos:pos + len(BATCH_MAGIC)]) != BATCH_MAGIC:
        return None
    return HEADER_STRUCT.unpack_from(buf, pos)[3]


def _header_problem(version, flags, size, count, update_count, payload_size, base_offset, first_ts, max_ts) -> str:
    if version != BATCH_VERSION:
        return _version_problem(version)
    if flags & ~_KNOWN_FLAGS or (flags & _CODEC_MASK) > _MAX_CODEC:
        return f"unknown flags {flags:#x}"
    if size < BATCH_HEADER_SIZE:
        return f"size {size} is smaller than the {BATCH_HEADER_SIZE}-byte header"
    if count > MAX_RECORDS:
        return f"record count {count} is above the limit {MAX_RECORDS}"
    if base_offset < 0 or base_offset + count > I64_MAX:
        return f"base offset {base_offset} with {count} records is out of range"
    if max_ts < first_ts:
        return f"max timestamp {max_ts} is below the first timestamp {first_ts}"
    columns = (bool(flags & FLAG_KEYS) + bool(flags & FLAG_TIMESTAMPS) + bool(flags & FLAG_HEADERS)
               + bool(flags & FLAG_TOMBSTONES))
    if count == 0 and columns:
        return "optional record columns are flagged in a batch without records"
    if flags & FLAG_TOMBSTONES and not flags & FLAG_KEYS:
        return "a batch with tombstones has no keys column (a tombstone needs a key)"
    if not flags & FLAG_TIMESTAMPS and max_ts != first_ts:
        return "timestamps differ but the batch has no timestamp column"
    smallest = count * (1 + columns) + UPDATE_SIZE * update_count  # a varint per record and column
    if payload_size < smallest or (count == 0 and payload_size != smallest):
        return f"payload of {payload_size} bytes cannot hold {count} records and {update_count} attribute updates"
    if flags & _CODEC_MASK == Codec.NONE and size - BATCH_HEADER_SIZE != payload_size:
        return f"uncompressed payload of {size - BATCH_HEADER_SIZE} bytes, but the header says {payload_size}"
    return ""


def check_batch(buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None) -> None:
    """Verify the payload checksum of the batch at ``buf[pos]`` whose header is ``header``."""
    end = pos + header.size
    if pos < 0 or end > len(buf):
        raise InvalidInputError(f"the batch at {pos} ({header.size} bytes) is not all in the buffer")
    if checksum.crc32(memoryview(buf)[pos + BATCH_HEADER_SIZE : end]) != header.payload_crc:
        raise corruption_at(segment, position + pos)("payload checksum mismatch")


def check_position(position) -> None:
    """``InvalidInputError`` unless ``position`` is a segment byte position (an int in [0, 2**64))."""
    if type(position) is not int or not 0 <= position <= U64_MASK:
        raise InvalidInputError(f"position must be an int in [0, 2**64), got {position!r:.60}")


def check_span(position, n: int) -> None:
    """``InvalidInputError`` unless ``n`` bytes from segment byte ``position`` fit below 2**64."""
    if type(position) is not int or not 0 <= position <= U64_MASK - n:
        raise InvalidInputError(f"position must be an int in [0, 2**64 - {n}) for {n} bytes, got {position!r:.60}")


def seal_header(head, position: int) -> bytes:
    """The 64-byte header made of ``head`` (the first 60 bytes of a header) and their checksum
    seeded with ``position``: the CRC-32 of ``position`` as a little-endian u64, continued over
    ``head``. Such a header is valid at segment byte ``position`` only."""
    head = bytes(head[:CHECKED_HEADER])
    return head + U32.pack(checksum.crc32(head, checksum.crc32(U64.pack(position))))
