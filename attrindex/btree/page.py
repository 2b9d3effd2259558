"""B+tree page codec: a core that does no I/O (bytes in, page objects out, and back).

Page layout (little-endian), byte by byte in docs/format.md::

    0   u8   format version (1)
    1   u8   kind: 0 leaf, 1 index
    2   u16  reserved, 0
    4   u32  entry count n
    8   u32  CRC-32 of (page offset as u64) + bytes 0..8 + bytes 12..end
    12  n x 16 bytes   keys, ascending unsigned
    leaf:   n x i64    values
    index:  n x u64    child offsets, n x u32 child lengths, n x u64 child subtree minimum offsets

Columns (all keys, then all values) decode with one precompiled struct per column. The checksum is
seeded with the page's own offset, so a pointer to the wrong place is caught like a flipped bit.
"""

from __future__ import annotations

import functools
import struct

from storage_adapters.errors import CorruptDataError

from .. import checksum
from ..keys import KEY_SIZE, MIN_KEY

FORMAT_VERSION = 1
LEAF, INDEX = 0, 1
HEADER = struct.Struct("<BBHII")
HEADER_SIZE = HEADER.size  # 12
LEAF_ENTRY_SIZE = KEY_SIZE + 8
INDEX_ENTRY_SIZE = KEY_SIZE + 8 + 4 + 8
_U64 = struct.Struct("<Q")


@functools.lru_cache(maxsize=4096)
def column_struct(code: str, count: int) -> struct.Struct:
    """The ``struct`` of ``count`` values of ``code`` back to back (a page's key or value column)."""
    return struct.Struct(f"<{count}{code}" if code != "16s" else "<" + "16s" * count)


class LeafPage:
    """Sorted keys and their values. ``lookup`` builds a dict on first use (pages are immutable)."""

    __slots__ = ("keys", "values", "_map", "__weakref__")
    is_leaf = True

    def __init__(self, keys: list[bytes], values: list[int]):
        self.keys = keys
        self.values = values
        self._map: dict[bytes, int] | None = None

    def get(self, key: bytes) -> int | None:
        table = self._map
        if table is None:
            table = self._map = dict(zip(self.keys, self.values))
        return table.get(key)

    def __len__(self) -> int:
        return len(self.keys)


class IndexPage:
    """Child pointers: ``keys[i]`` is the lowest key routed to child ``i`` (``keys[0]`` is all zeros).

    ``children[i]``, once filled in by the tree, is a weak reference to child ``i``'s decoded page:
    a warm descent follows it without asking the page cache, while the cache alone keeps pages alive.
    """

    __slots__ = ("keys", "offsets", "lengths", "min_offsets", "children", "__weakref__")
    is_leaf = False

    def __init__(self, keys: list[bytes], offsets: list[int], lengths: list[int], min_offsets: list[int]):
        self.keys = keys
        self.offsets = offsets
        self.lengths = lengths
        self.min_offsets = min_offsets
        self.children: list | None = None

    def __len__(self) -> int:
        return len(self.keys)


def leaf_capacity(page_size: int) -> int:
    """How many entries fit in a leaf page of ``page_size`` bytes."""
    return (page_size - HEADER_SIZE) // LEAF_ENTRY_SIZE


def index_capacity(page_size: int) -> int:
    """How many child pointers fit in an index page of ``page_size`` bytes."""
    return (page_size - HEADER_SIZE) // INDEX_ENTRY_SIZE


def page_checksum(offset: int, page: bytes | bytearray | memoryview) -> int:
    """The checksum of an encoded ``page`` written at segment byte ``offset`` (docs/format.md)."""
    view = memoryview(page)
    return checksum.crc32(view[HEADER_SIZE:], checksum.crc32(view[:8], checksum.crc32(_U64.pack(offset))))


def encode_leaf(keys: list[bytes], values: list[int], offset: int) -> bytes:
    n = len(keys)
    body = bytearray(HEADER.pack(FORMAT_VERSION, LEAF, 0, n, 0))
    body += b"".join(keys)
    body += column_struct("q", n).pack(*values)
    struct.pack_into("<I", body, 8, page_checksum(offset, body))
    return bytes(body)


def encode_index(keys: list[bytes], offsets: list[int], lengths: list[int], min_offsets: list[int], offset: int) -> bytes:
    n = len(keys)
    body = bytearray(HEADER.pack(FORMAT_VERSION, INDEX, 0, n, 0))
    body += MIN_KEY  # the first key routes everything below the second
    body += b"".join(keys[1:])
    body += column_struct("Q", n).pack(*offsets)
    body += column_struct("I", n).pack(*lengths)
    body += column_struct("Q", n).pack(*min_offsets)
    struct.pack_into("<I", body, 8, page_checksum(offset, body))
    return bytes(body)


def check_page(page: bytes | memoryview, offset: int, segment: str = "?") -> tuple[int, int]:
    """Verify the page stored at ``offset`` without decoding it: ``(kind, entry count)``, or a
    ``CorruptDataError`` naming it."""

    def corrupt(what: str) -> CorruptDataError:
        return CorruptDataError(f"segment {segment!r}: B+tree page at offset {offset}: {what}", segment=segment, offset=offset)

    if len(page) < HEADER_SIZE:
        raise corrupt(f"{len(page)} bytes is shorter than a page header")
    version, kind, reserved, n, crc = HEADER.unpack_from(page)
    if page_checksum(offset, page) != crc:
        raise corrupt("checksum mismatch")
    if version != FORMAT_VERSION or reserved != 0 or kind not in (LEAF, INDEX):
        raise corrupt(f"unknown format (version {version}, kind {kind})")
    entry = LEAF_ENTRY_SIZE if kind == LEAF else INDEX_ENTRY_SIZE
    if HEADER_SIZE + n * entry != len(page):
        raise corrupt(f"{n} entries do not fill {len(page)} bytes")
    return kind, n


def decode_page(page: bytes, offset: int, segment: str = "?") -> LeafPage | IndexPage:
    """Verify and decode the page stored at ``offset``; any fault is a ``CorruptDataError`` naming it."""
    kind, n = check_page(page, offset, segment)
    keys = list(column_struct("16s", n).unpack_from(page, HEADER_SIZE))
    at = HEADER_SIZE + n * KEY_SIZE
    if kind == LEAF:
        return LeafPage(keys, list(column_struct("q", n).unpack_from(page, at)))
    offsets = list(column_struct("Q", n).unpack_from(page, at))
    lengths = list(column_struct("I", n).unpack_from(page, at + 8 * n))
    min_offsets = list(column_struct("Q", n).unpack_from(page, at + 12 * n))
    return IndexPage(keys, offsets, lengths, min_offsets)

