"""The footer that ends every B+tree update: root pointer, counts, log checkpoint, checksum.

Layout (72 bytes, little-endian; see docs/format.md)::

    0   8  magic b"AIXFOOT1"
    8   u64 root offset          (0 with root length 0: the tree is empty)
    16  u32 root length
    20  u16 height               (0 empty, 1 a single leaf, ...; 0 with a root: the root is a runs page)
    22  u16 kind                 (0 an update, 1 a piece of an update in progress, 2 a repair's copy)
    24  u64 entry count
    32  u64 page count
    40  u64 live bytes           (sum of the lengths of the pages reachable from the root)
    48  u64 minimum offset       (smallest offset of a live page; the footer's own if empty): the
                                 truncation offset of this version of the tree
    56  i64 log checkpoint       (the segment-log offset this tree covers; -1 none)
    64  u32 update length        (bytes of the append this footer ends, footer included)
    68  u32 CRC-32 of (footer offset as u64) + bytes 0..68

The checksum is seeded with the footer's own offset, so bytes that merely look like a footer
elsewhere (inside a page, inside garbage) are rejected.

Every footer is a version of the tree. An update's footer ends the pages it wrote, its root last.
A piece's and a copy's footer restate an older version (its root, counts and checkpoint): a piece
ends pages that a later footer of the same update will reference (an update written in bounded
pieces), a copy ends bytes that a repair abandoned.
"""

from __future__ import annotations

import struct

import attrs

from .. import checksum

MAGIC = b"AIXFOOT1"
_LAYOUT = struct.Struct("<8sQIHHQQQQqI")
FOOTER_SIZE = _LAYOUT.size + 4  # 72
_U64 = struct.Struct("<Q")

UPDATE = 0  #: the footer of an update: the pages before it end with its root (or there are none)
PIECE = 1  #: the footer of a piece: pages of an update in progress, referenced by none yet
COPY = 2  #: a repair's copy of an older footer: the bytes before it were abandoned
KINDS = (UPDATE, PIECE, COPY)


@attrs.frozen
class Footer:
    """The durable state of a tree as of one update."""

    root_offset: int = 0
    root_length: int = 0
    height: int = 0
    entry_count: int = 0
    page_count: int = 0
    live_bytes: int = 0
    min_offset: int = 0
    checkpoint: int = -1
    update_length: int = 0
    kind: int = UPDATE

    @property
    def has_runs(self) -> bool:
        """Whether the version has sorted runs: its root is then a runs page (``runs.py``),
        which a height of 0 with a root says."""
        return self.height == 0 and self.root_length > 0

    @property
    def restates(self) -> bool:
        """Whether this footer restates an older version (a piece's or a copy's): the version
        it names is the one before it, whatever bytes precede it."""
        return self.kind != UPDATE

    def encode(self, offset: int) -> bytes:
        body = _LAYOUT.pack(
            MAGIC, self.root_offset, self.root_length, self.height, self.kind, self.entry_count,
            self.page_count, self.live_bytes, self.min_offset, self.checkpoint, self.update_length,
        )
        return body + _crc(offset, body).to_bytes(4, "little")


EMPTY = Footer()


def _crc(offset: int, body: bytes) -> int:
    return checksum.crc32(body, checksum.crc32(_U64.pack(offset)))


def decode_footer(data: bytes, offset: int) -> Footer | None:
    """The footer stored at ``offset``, or ``None`` if these bytes are not a valid one."""
    if len(data) != FOOTER_SIZE or not data.startswith(MAGIC):
        return None
    body = data[:-4]
    if _crc(offset, body) != int.from_bytes(data[-4:], "little"):
        return None
    (root_offset, root_length, height, kind, entry_count, page_count, live_bytes, min_offset, checkpoint,
     update_length) = _LAYOUT.unpack(body)[1:]
    if kind not in KINDS:
        return None
    footer = Footer(root_offset, root_length, height, entry_count, page_count, live_bytes, min_offset, checkpoint,
                    update_length, kind)
    # The root (if any) and the whole update lie before the footer.
    if footer.update_length < FOOTER_SIZE or footer.update_length > offset + FOOTER_SIZE:
        return None
    if footer.root_length and footer.root_offset + footer.root_length > offset:
        return None
    if footer.min_offset > offset:
        return None
    return footer


def find_last_footer(window: bytes, window_offset: int) -> tuple[int, Footer] | None:
    """The last valid footer that ends inside ``window`` (bytes starting at ``window_offset``)."""
    position = window.rfind(MAGIC)
    while position >= 0:
        if position + FOOTER_SIZE <= len(window):
            footer = decode_footer(window[position:position + FOOTER_SIZE], window_offset + position)
            if footer is not None:
                return window_offset + position, footer
        position = window.rfind(MAGIC, 0, position)
    return None
