"""B+tree page codec: a core that does no I/O (bytes in, page objects out, and back).

Page layout (little-endian), byte by byte in docs/format.md::

    0   u8   format version (1)
    1   u8   kind: 0 leaf, 1 index, 2 run leaf, 3 key filter, 4 runs
    2   u16  reserved, 0
    4   u32  entry count n
    8   u32  CRC-32 of (page offset as u64) + bytes 0..8 + bytes 12..end
    12  n x 16 bytes   keys, ascending unsigned
    leaf:   n x i64    values
    index:  n x u64    child offsets, n x u32 child lengths, n x u64 child subtree minimum offsets
    run leaf: n x i64 values, n x u8 removal flags (1: the key is removed, its value 0)
    key filter: n bytes, a run's filter (``key_filter.py``)
    runs:   the main tree's reference, then n runs' references, newest first (``runs.py``)

Run leaves, key filters and the runs page belong to a tree's sorted runs (docs/design.md, "Sorted
runs"): a version with runs has its footer point at a runs page instead of the main tree's root.

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
LEAF, INDEX, RUN_LEAF, FILTER, RUNS = 0, 1, 2, 3, 4
KINDS = (LEAF, INDEX, RUN_LEAF, FILTER, RUNS)
HEADER = struct.Struct("<BBHII")
HEADER_SIZE = HEADER.size  # 12
LEAF_ENTRY_SIZE = KEY_SIZE + 8
INDEX_ENTRY_SIZE = KEY_SIZE + 8 + 4 + 8
RUN_LEAF_ENTRY_SIZE = LEAF_ENTRY_SIZE + 1
#: A tree's reference in a runs page: root offset u64, root length u32, height u16, reserved u16,
#: entries u64, pages u64, live bytes u64, minimum offset u64.
TREE_REF = struct.Struct("<QIHHQQQQ")
#: A run's reference: its tree's, then its key filter's offset u64 and length u32, reserved u32.
RUN_REF = struct.Struct(TREE_REF.format + "QII")
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


class RunLeafPage(LeafPage):
    """A leaf of a sorted run: its values are ``None`` where the run removes the key, and
    ``find`` tells such a key from one the run does not hold."""

    __slots__ = ()

    def find(self, key: bytes, absent: object) -> object:
        """The value of ``key`` here: an int, ``None`` (removed by the run) or ``absent``."""
        table = self._map
        if table is None:
            table = self._map = dict(zip(self.keys, self.values))
        return table.get(key, absent)


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


def page_size(kind: int, count: int) -> int | None:
    """The length of a page of ``kind`` whose header counts ``count`` (``None``: no such kind)."""
    if kind == LEAF:
        return HEADER_SIZE + count * LEAF_ENTRY_SIZE
    if kind == INDEX:
        return HEADER_SIZE + count * INDEX_ENTRY_SIZE
    if kind == RUN_LEAF:
        return HEADER_SIZE + count * RUN_LEAF_ENTRY_SIZE
    if kind == FILTER:
        return HEADER_SIZE + count
    if kind == RUNS:
        return HEADER_SIZE + TREE_REF.size + count * RUN_REF.size
    return None


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
    size = page_size(kind, n)
    if version != FORMAT_VERSION or reserved != 0 or size is None:
        raise corrupt(f"unknown format (version {version}, kind {kind})")
    if size != len(page):
        raise corrupt(f"{n} entries do not fill {len(page)} bytes")
    return kind, n


def encode_run_leaf(keys: bytes, values: bytes, gone: bytes, count: int, offset: int) -> bytes:
    """A run leaf of ``count`` entries from its packed columns (keys, little-endian int64 values,
    one removal flag byte each)."""
    body = bytearray(HEADER.pack(FORMAT_VERSION, RUN_LEAF, 0, count, 0))
    body += keys
    body += values
    body += gone
    struct.pack_into("<I", body, 8, page_checksum(offset, body))
    return bytes(body)


def encode_blob(kind: int, data: bytes, offset: int) -> bytes:
    """A page of ``kind`` (``FILTER``) holding ``data`` as it is."""
    body = bytearray(HEADER.pack(FORMAT_VERSION, kind, 0, len(data), 0))
    body += data
    struct.pack_into("<I", body, 8, page_checksum(offset, body))
    return bytes(body)


def encode_runs(main: tuple, runs: list[tuple], offset: int) -> bytes:
    """The runs page: ``main`` packed as ``TREE_REF`` and each of ``runs`` as ``RUN_REF``."""
    body = bytearray(HEADER.pack(FORMAT_VERSION, RUNS, 0, len(runs), 0))
    body += TREE_REF.pack(*main)
    for run in runs:
        body += RUN_REF.pack(*run)
    struct.pack_into("<I", body, 8, page_checksum(offset, body))
    return bytes(body)


def decode_page(page: bytes, offset: int, segment: str = "?") -> LeafPage | IndexPage:
    """Verify and decode the page stored at ``offset``; any fault is a ``CorruptDataError`` naming it.
    A run leaf decodes as a ``RunLeafPage``; key filters and runs pages are not decoded here
    (``runs.py`` reads them): they are a ``CorruptDataError`` where a tree page belongs."""
    kind, n = check_page(page, offset, segment)
    if kind in (FILTER, RUNS):
        raise CorruptDataError(f"segment {segment!r}: B+tree page at offset {offset}: a {'key filter' if kind == FILTER else 'runs page'} "
                               "where a tree page belongs", segment=segment, offset=offset)
    keys = list(column_struct("16s", n).unpack_from(page, HEADER_SIZE))
    at = HEADER_SIZE + n * KEY_SIZE
    if kind == LEAF:
        return LeafPage(keys, list(column_struct("q", n).unpack_from(page, at)))
    if kind == RUN_LEAF:
        values = list(column_struct("q", n).unpack_from(page, at))
        flags = page[at + 8 * n:at + 9 * n]
        if flags.count(0) + flags.count(1) != n:
            raise CorruptDataError(f"segment {segment!r}: B+tree page at offset {offset}: a removal flag other than "
                                   "0 or 1", segment=segment, offset=offset)
        if 1 in flags:
            values = [None if gone else value for value, gone in zip(values, flags)]
        return RunLeafPage(keys, values)
    offsets = list(column_struct("Q", n).unpack_from(page, at))
    lengths = list(column_struct("I", n).unpack_from(page, at + 8 * n))
    min_offsets = list(column_struct("Q", n).unpack_from(page, at + 12 * n))
    return IndexPage(keys, offsets, lengths, min_offsets)

