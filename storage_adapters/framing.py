"""Frames: how the committed length of a chunk appended to in place is read from its own bytes.

A chunk on local disk keeps no commit record. Whatever its owner appends is a sequence of *frames*:
units that can be checked on their own and that name the segment position they were written at
(their checksum is seeded with it). The committed length of the last chunk of a segment is the end
of the chain of whole valid frames from its start; bytes written for another position, stale bytes
and the zeros a chunk is pre-written with never pass for a frame. docs/storage.md, "Crashes: the
chain of frames", states the rules built on it (torn tails, damage, copies).

This package never parses what the layers above store: a ``RollingSegment`` on a backend whose
appends can tear is given a ``Framing`` by its owner (the segment log: record batches; the B+tree:
pages ending in a footer). A framing does no I/O: bytes in, positions out.
"""

from __future__ import annotations

import abc
import struct
import zlib

from .errors import InvalidInputError


class Framing(abc.ABC):
    """What a segment's owner tells the storage layer about the frames it appends (no I/O).

    Every position is a segment position (a byte offset in the whole segment, not in a chunk), so
    chunks replaced by a consolidation, or a store copied elsewhere, keep their frames valid.
    """

    @abc.abstractmethod
    def place(self, data: bytes, position: int) -> bytes:
        """The bytes to store for ``data`` (one or more whole frames) appended at ``position``:
        the same frames, their checksums seeded with where each now lands. ``data`` may have been
        framed for another position (an append retried after another writer went first)."""

    @abc.abstractmethod
    def chain_end(self, data: bytes, position: int) -> int:
        """The end of the whole, valid frames that follow each other from ``data[0]`` (which lies
        at segment position ``position``): ``position`` itself when the first one is not whole or
        not valid. Zeros are never a frame."""

    @abc.abstractmethod
    def may_be_torn(self, data: bytes, position: int) -> bool:
        """Whether ``data`` (the bytes after the chain's end at ``position``, up to the last one
        that is not zero; no valid frame among them) can be what a crash left of a write there.
        A killed writer leaves a prefix of its write, and a power loss keeps or loses each sector
        whole, so what is there begins as a frame written at ``position`` begins: its marker, and
        a header that checks out once it is all there. Anything else is damage."""

    @abc.abstractmethod
    def last_frame_end(self, data: bytes, position: int) -> int | None:
        """The end of the last whole, valid frame anywhere in ``data`` (found by its marker, then
        checked for the position it lies at), or ``None`` when there is none. Used only where the
        chain stopped at bytes that are not zeros: a valid frame after them means damage below
        committed data, none means the newest write was torn."""


_CHECKED_MAGIC = b"AIXF"
_CHECKED_HEAD = struct.Struct("<4sIQI")  # magic, payload length, position, CRC-32 of the payload
_U64 = struct.Struct("<Q")


class LengthChecksumFraming(Framing):
    """A plain framing for raw ``RollingSegment`` users (tools, tests): ``frame(payload)`` wraps
    each payload as ``magic "AIXF" | u32 length | u64 position | u32 CRC-32 (seeded with the
    position) | payload``. Appends must be made of such frames."""

    header_size = _CHECKED_HEAD.size  # 20

    @staticmethod
    def frame(payload: bytes, position: int = 0) -> bytes:
        """One frame holding ``payload`` (placed at ``position``; ``place`` moves it)."""
        if len(payload) >= 1 << 32:
            raise InvalidInputError(f"a frame holds at most 4 GiB, got {len(payload)} bytes")
        return _CHECKED_HEAD.pack(_CHECKED_MAGIC, len(payload), position, _crc(position, payload)) + payload

    @staticmethod
    def payloads(data: bytes) -> list[bytes]:
        """The payloads of the whole frames in ``data`` (framed by ``frame``; not checked)."""
        found, at = [], 0
        while at + _CHECKED_HEAD.size <= len(data):
            _magic, length, _position, _crc32 = _CHECKED_HEAD.unpack_from(data, at)
            found.append(bytes(data[at + _CHECKED_HEAD.size:at + _CHECKED_HEAD.size + length]))
            at += _CHECKED_HEAD.size + length
        return found

    def place(self, data: bytes, position: int) -> bytes:
        pieces, at = [], 0
        while at < len(data):
            _magic, length, _old, _crc32 = _CHECKED_HEAD.unpack_from(data, at)
            payload = bytes(data[at + _CHECKED_HEAD.size:at + _CHECKED_HEAD.size + length])
            pieces.append(self.frame(payload, position + at))
            at += _CHECKED_HEAD.size + length
        return b"".join(pieces)

    def chain_end(self, data: bytes, position: int) -> int:
        at = 0
        while True:
            size = self._frame_size(data, at, position + at)
            if size is None:
                return position + at
            at += size

    def may_be_torn(self, data: bytes, position: int) -> bool:
        head = bytes(data[:_CHECKED_HEAD.size])
        if len(head) < _CHECKED_HEAD.size:
            stored = _U64.pack(position)  # magic, a length, the position, part of the checksum
            return head[:4] == _CHECKED_MAGIC[:len(head)] and head[8:16] == stored[:max(len(head) - 8, 0)]
        magic, _length, stored, _crc32 = _CHECKED_HEAD.unpack(head)
        return magic == _CHECKED_MAGIC and stored == position

    def last_frame_end(self, data: bytes, position: int) -> int | None:
        at = data.rfind(_CHECKED_MAGIC)
        while at >= 0:
            size = self._frame_size(data, at, position + at)
            if size is not None:
                return position + at + size
            at = data.rfind(_CHECKED_MAGIC, 0, at)
        return None

    @staticmethod
    def _frame_size(data: bytes, at: int, position: int) -> int | None:
        if at + _CHECKED_HEAD.size > len(data):
            return None
        magic, length, stored, crc = _CHECKED_HEAD.unpack_from(data, at)
        end = at + _CHECKED_HEAD.size + length
        if magic != _CHECKED_MAGIC or stored != position or end > len(data):
            return None
        if _crc(position, data[at + _CHECKED_HEAD.size:end]) != crc:
            return None
        return end - at


def _crc(position: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(_U64.pack(position)))
