"""Batches back to back, as a segment stores them: iterating the complete ones in a buffer,
finding where the chain of valid ones ends (or the last valid one anywhere), and sealing them
for the byte position where they land. No I/O."""

from __future__ import annotations

import struct
from collections.abc import Iterator

from ... import checksum
from ...errors import InvalidInputError
from .header import (BATCH_HEADER_SIZE, BATCH_MAGIC, BATCH_VERSION, CHECKED_HEADER, U32, U64, BatchHeader,
                     check_batch, check_span, read_header)

__all__ = ["chain_end", "iter_batches", "last_batch_end", "place_batches"]


_PREFIX = struct.Struct("<4sHHI")  # magic, version, flags, size
_FRAME = struct.Struct("<4sH2xI44xII")  # magic, version, size, payload CRC, header CRC


def iter_batches(
    buf, pos: int = 0, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> Iterator[tuple[int, BatchHeader]]:
    """Yield ``(pos, header)`` for each complete batch from ``buf[pos]``; stop at an incomplete tail.

    Raises ``CorruptDataError`` at the first invalid batch (with ``verify``, payload checksums too).
    """
    while True:
        header = read_header(buf, pos, position=position, segment=segment)
        if header is None:
            return
        if verify:
            check_batch(buf, pos, header, position=position, segment=segment)
        yield pos, header
        pos += header.size


def chain_end(data, position: int) -> int:
    """The segment byte position where the chain of whole, valid batches from ``data[0]`` (which
    lies at segment byte ``position``) ends: ``position`` itself when the first is not one.

    A batch counts when its magic and version are right, its header checksum holds for the byte
    it lies at (seeded with that position), its size is at least a header and all its bytes are
    there, and its payload checksum holds; the chain stops at the first that is not, whatever the
    bytes (zeros are never a batch). Torn writes, stale bytes and batches written for another
    position fail these; the other header fields are left to the readers (``read_header``), so a
    batch whose checksums hold but whose fields do not is reported as damage where it is read,
    never cut as a torn tail. Never raises for any bytes."""
    n = len(data)
    check_span(position, n)
    view = memoryview(data)
    crc32, pack, unpack = checksum.crc32, U64.pack, _FRAME.unpack_from
    at = 0
    while n - at >= BATCH_HEADER_SIZE:  # bounded: ``at`` moves by a size of at least a header
        magic, version, size, payload_crc, header_crc = unpack(data, at)
        if (magic != BATCH_MAGIC or version != BATCH_VERSION or not BATCH_HEADER_SIZE <= size <= n - at
                or crc32(view[at:at + CHECKED_HEADER], crc32(pack(position + at))) != header_crc
                or crc32(view[at + BATCH_HEADER_SIZE:at + size]) != payload_crc):
            break
        at += size
    return position + at


def last_batch_end(data, position: int) -> int | None:
    """The segment byte position where the last whole, valid batch anywhere in ``data`` (which
    starts at segment byte ``position``) ends, or ``None`` when there is none: each occurrence of
    the magic is tried from the last one back, as ``chain_end`` checks a batch, for the byte it
    lies at. Never raises for any bytes."""
    check_span(position, len(data))
    data = data if type(data) is bytes else bytes(data)
    view = memoryview(data)
    at = data.rfind(BATCH_MAGIC)
    while at >= 0:  # bounded: every lap moves ``at`` back
        # A valid batch found later would have been returned: the chain from here holds one at most.
        end = chain_end(view[at:], position + at)
        if end > position + at:
            return end
        at = data.rfind(BATCH_MAGIC, 0, at)
    return None


def place_batches(data, position: int) -> bytes:
    """``data`` (one or more whole batches back to back) as stored at segment byte ``position``:
    each header's checksum seeded with where that batch lands (``position`` plus its place in
    ``data``); nothing else changes. ``data`` itself comes back (no copy) when every header is
    sealed for its place already.

    The headers may have been sealed for any position, so their old checksums cannot be checked:
    only their magic, version and sizes are (``InvalidInputError``). Place batches that were just
    encoded, or read and verified; stored bytes are checked with ``read_header``.
    """
    n = len(data)
    check_span(position, n)
    if type(data) is bytes and n >= BATCH_HEADER_SIZE:  # one batch (the usual append): no loop, no view
        magic, version, _flags, size = _PREFIX.unpack_from(data)
        if size == n and magic == BATCH_MAGIC and version == BATCH_VERSION:
            crc = checksum.crc32(data[:CHECKED_HEADER], checksum.crc32(U64.pack(position)))
            if crc == U32.unpack_from(data, CHECKED_HEADER)[0]:
                return data
            return b"".join([data[:CHECKED_HEADER], U32.pack(crc), data[BATCH_HEADER_SIZE:]])
    crc32, pack, view = checksum.crc32, U64.pack, memoryview(data)
    at, moved = 0, []
    while at < n:
        if n - at < BATCH_HEADER_SIZE:
            raise InvalidInputError(f"place_batches: the {n - at} bytes at {at} are not a whole batch")
        magic, version, _flags, size = _PREFIX.unpack_from(data, at)
        if magic != BATCH_MAGIC or version != BATCH_VERSION or not BATCH_HEADER_SIZE <= size <= n - at:
            raise InvalidInputError(f"place_batches: the bytes at {at} are not a whole version {BATCH_VERSION} "
                                    f"batch (magic {magic!r}, version {version}, size {size}, {n - at} bytes left)")
        crc = crc32(view[at:at + CHECKED_HEADER], crc32(pack(position + at)))
        if crc != U32.unpack_from(data, at + CHECKED_HEADER)[0]:
            moved.append((at, crc))
        at += size
    if not moved:
        return data if type(data) is bytes else bytes(data)
    pieces, done = [], 0
    for at, crc in moved:
        pieces += [view[done:at + CHECKED_HEADER], U32.pack(crc)]
        done = at + BATCH_HEADER_SIZE
    pieces.append(view[done:])
    return b"".join(pieces)
