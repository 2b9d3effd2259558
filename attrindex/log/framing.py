"""The segment log's frames: record batches, as the storage layer's ``Framing`` sees them (no I/O).

A chunk appended to in place keeps no commit record: its committed length is the end of the chain
of whole, valid batches from its start (storage_adapters/framing.py). A batch is a frame because
its header checksum is seeded with the byte position it lies at (docs/format.md): a batch is valid
at that one position, so stale bytes, zeros and batches moved or copied elsewhere never pass for
one. ``LOG_FRAMING`` is what a ``SegmentLog`` (and any ``RollingSegment`` holding log batches)
gives its ``RollingSegment``.

``torn_claim`` is for the log after the storage cut a torn tail: the record offsets a torn batch
claimed (its header intact) are never given out again.
"""

from __future__ import annotations

from storage_adapters.framing import Framing

from .. import checksum
from ..errors import CorruptDataError
from .batch.chain import chain_end, last_batch_end, place_batches
from .batch.header import BATCH_HEADER_SIZE, BATCH_MAGIC, read_header

__all__ = ["LOG_FRAMING", "LogFraming", "torn_claim"]


class LogFraming(Framing):
    """Record batches as frames: ``place`` seals them for where they land, ``chain_end`` and
    ``last_frame_end`` accept a batch when its header is valid for its position and its payload
    is whole with its checksum right."""

    def place(self, data: bytes, position: int) -> bytes:
        """``data`` (whole batches back to back) sealed for segment byte ``position``
        (``place_batches``: ``data`` itself when it is sealed for there already)."""
        return place_batches(data, position)

    def chain_end(self, data: bytes, position: int) -> int:
        """The end of the whole, valid batches following each other from ``data[0]`` (segment byte
        ``position``); ``position`` when the first is not one."""
        return chain_end(data, position)

    def last_frame_end(self, data: bytes, position: int) -> int | None:
        """The end of the last whole, valid batch anywhere in ``data`` (found by its magic, then
        checked for the position it lies at), or ``None``."""
        return last_batch_end(data, position)

    def may_be_torn(self, data: bytes, position: int) -> bool:
        """Whether ``data`` can be what a crash left of a batch written at ``position``: part of a
        header that starts with the magic, or a whole header valid for ``position``."""
        if len(data) < BATCH_HEADER_SIZE:
            return bytes(data[:len(BATCH_MAGIC)]) == BATCH_MAGIC[:len(data)]
        try:
            return read_header(data, 0, position=position, partial=True) is not None
        except CorruptDataError:
            return False


LOG_FRAMING = LogFraming()


def torn_claim(data: bytes, position: int) -> int | None:
    """The record offset just past what a torn batch at the start of ``data`` (segment byte
    ``position``) claimed: its header is valid for ``position`` but its payload is not all in
    ``data`` or fails its checksum. ``None`` when ``data`` does not start with such a header (a
    whole valid batch, a damaged header, zeros, fewer than a header's bytes)."""
    try:
        header = read_header(data, 0, position=position, partial=True)
    except CorruptDataError:
        return None
    if header is None:
        return None
    if header.size <= len(data) and checksum.crc32(memoryview(data)[BATCH_HEADER_SIZE:header.size]) == header.payload_crc:
        return None
    return header.next_offset
