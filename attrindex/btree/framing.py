"""The B+tree's frames (storage_adapters/framing.py): how a tree chunk's committed length is read.

A tree update is one append of pages followed by the footer that ends it (docs/format.md). Pages
and footers both carry a checksum seeded with their own offset, so an update is a frame that
names where it was written. The chain from a chunk's start runs through whole updates: pages
that check out, then a footer that checks out and whose ``update length`` covers exactly the
pages since the previous footer. Pages not yet followed by their footer are a torn update.
No I/O here.
"""

from __future__ import annotations

import struct

from storage_adapters.errors import CorruptDataError
from storage_adapters.framing import Framing

from .footer import FOOTER_SIZE, MAGIC, decode_footer
from .page import FORMAT_VERSION, HEADER_SIZE, KINDS, check_page, page_size

_HEAD = struct.Struct("<BBHI")  # version, kind, reserved, entry count


class TreeFraming(Framing):
    """Updates of pages ending in a footer. A tree encodes every update for the offset it is
    appended at (its pages point at each other by offset), so placing one changes nothing."""

    def place(self, data: bytes, position: int) -> bytes:
        return data

    def chain_end(self, data: bytes, position: int) -> int:
        view = memoryview(data)
        committed = at = 0
        while True:
            if view[at:at + len(MAGIC)] == MAGIC:
                footer = decode_footer(bytes(view[at:at + FOOTER_SIZE]), position + at)
                if footer is None or footer.update_length != at + FOOTER_SIZE - committed:
                    return position + committed
                at = committed = at + FOOTER_SIZE
                continue
            size = _page_size(view, at, position + at)
            if size is None:
                return position + committed
            at += size

    def may_be_torn(self, data: bytes, position: int) -> bool:
        # An update begins with a page (or, a footer-only update, with the footer): its header as
        # far as it goes. A page's checksum covers the whole page, so a torn one is judged by its
        # header's fields; a footer's magic.
        if bytes(data[:len(MAGIC)]) == MAGIC[:min(len(data), len(MAGIC))]:
            return True
        head = bytes(data[:4])
        return head[:1] == bytes([FORMAT_VERSION]) and (len(head) < 2 or head[1] in KINDS) and \
            head[2:4] == b"\0\0"[:max(len(head) - 2, 0)]

    def last_frame_end(self, data: bytes, position: int) -> int | None:
        at = data.rfind(MAGIC)
        while at >= 0:
            if decode_footer(bytes(data[at:at + FOOTER_SIZE]), position + at) is not None:
                return position + at + FOOTER_SIZE
            at = data.rfind(MAGIC, 0, at)
        return None


def _page_size(view: memoryview, at: int, offset: int) -> int | None:
    """The length of the valid page stored at ``view[at:]`` (offset ``offset``), else ``None``."""
    if at + HEADER_SIZE > len(view):
        return None
    version, kind, reserved, count = _HEAD.unpack_from(view, at)
    size = page_size(kind, count)
    if version != FORMAT_VERSION or reserved or size is None:
        return None
    if at + size > len(view):
        return None
    try:
        check_page(view[at:at + size], offset)
    except CorruptDataError:
        return None
    return size


#: The framing every tree segment is opened with.
TREE_FRAMING = TreeFraming()
