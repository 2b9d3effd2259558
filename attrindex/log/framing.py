"""The segment log's frames (storage_adapters/framing.py): record batches. No I/O here.

A batch is a frame when its header and its payload check out; the chain of a log chunk runs
through whole, valid batches from its start.
"""

from __future__ import annotations

from storage_adapters.errors import CorruptDataError
from storage_adapters.framing import Framing

from .batch import BATCH_HEADER_SIZE, BATCH_MAGIC, check_batch, read_header


class LogFraming(Framing):
    """Record batches as frames."""

    def place(self, data: bytes, position: int) -> bytes:
        return data

    def chain_end(self, data: bytes, position: int) -> int:
        at = 0
        while True:
            size = _batch_size(data, at, position)
            if size is None:
                return position + at
            at += size

    def may_be_torn(self, data: bytes, position: int) -> bool:
        if len(data) < BATCH_HEADER_SIZE:  # part of a header: the magic, as far as it goes
            return bytes(data[:len(BATCH_MAGIC)]) == BATCH_MAGIC[:len(data)]
        try:
            return read_header(data, 0, position=position, partial=True) is not None
        except CorruptDataError:
            return False

    def last_frame_end(self, data: bytes, position: int) -> int | None:
        at = data.rfind(BATCH_MAGIC)
        while at >= 0:
            size = _batch_size(data, at, position)
            if size is not None:
                return position + at + size
            at = data.rfind(BATCH_MAGIC, 0, at)
        return None


def _batch_size(data: bytes, at: int, position: int) -> int | None:
    try:
        header = read_header(data, at, position=position)
        if header is None:
            return None
        check_batch(data, at, header, position=position)
    except CorruptDataError:
        return None
    return header.size


def torn_claim(data: bytes, position: int) -> int | None:
    """For the bytes of a torn write found at segment position ``position``: when they start with
    a whole batch header valid for that position (its payload is what was torn), the record offset
    just past the records it claimed; else ``None``. Those offsets may have been seen by a reader
    before the crash, so the log never gives them out again."""
    try:
        header = read_header(data, 0, position=position, partial=True)
    except CorruptDataError:
        return None
    return None if header is None else header.next_offset


#: The framing of every segment log (and write-ahead log).
LOG_FRAMING = LogFraming()
