"""How an update of the B+tree is laid out: the copy-on-write rewrite of the pages it touches.

``Rewrite.plan`` merges a sorted batch into the leaves it reaches, rewrites their paths to the root
and whatever the compaction policy relocates, and lays the new pages out in append order
(children before parents, the root last, then the footer) in an ``UpdateBuilder``. It reads
pages through the function it is given and appends nothing itself: a builder with ``flush``
hands full pieces to the caller (``BTreeIndex._append_piece``).
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence

from ..keys import MIN_KEY
from .compaction import TreeShape
from .footer import FOOTER_SIZE, Footer
from .page import IndexPage, LeafPage, encode_index, encode_leaf

# Small batches per leaf are inserted by bisection; larger ones merged through a dict.
_BISECT_MERGE_LIMIT = 32


class UpdateBuilder:
    """Serialises the pages of one update, assigning offsets as it goes.

    With ``flush``, the pages are handed over in pieces as they fill: once ``piece_size`` bytes
    are buffered, ``flush(data, offset)`` appends them (ended by a piece's footer) and returns
    the offset that follows. What is left, with the root and the update's footer, is the final
    append. ``pages`` keeps the decoded pages of the final append, to cache after the commit (those
    of earlier pieces are dropped as they go), so memory stays within about one piece."""

    def __init__(self, base: int, flush: Callable[[bytearray, int], int] | None = None, piece_size: int = 0):
        self.base = base  #: the offset of ``buffer[0]``
        self.buffer = bytearray()
        self.pages: dict[int, tuple[LeafPage | IndexPage, int]] = {}  # offset -> (page, length)
        self.retired: list[int] = []
        self.live_delta = 0
        self.page_delta = 0
        self.entry_delta = 0
        self.relocated = 0
        self.pieces = 0  #: pieces appended so far
        self.piece_bytes = 0  #: their bytes, footers included
        self._flush = flush
        self._piece_size = piece_size

    def retire(self, offset: int, length: int) -> None:
        self.retired.append(offset)
        self.live_delta -= length
        self.page_delta -= 1

    def page(self, offset: int) -> LeafPage | IndexPage | None:
        """A page this update wrote, if it is still held (``None``: read it from storage)."""
        held = self.pages.get(offset)
        return held[0] if held is not None else None

    def leaf(self, keys: list[bytes], values: list[int]) -> tuple[int, int, int]:
        offset = self.base + len(self.buffer)
        data = encode_leaf(keys, values, offset)
        return self._add(offset, data, LeafPage(keys, values)) + (offset,)

    def index(self, keys: list[bytes], offsets: list[int], lengths: list[int], mins: list[int]) -> tuple[int, int, int]:
        offset = self.base + len(self.buffer)
        keys = [MIN_KEY, *keys[1:]]
        data = encode_index(keys, offsets, lengths, mins, offset)
        return self._add(offset, data, IndexPage(keys, offsets, lengths, mins)) + (min(mins),)

    def _add(self, offset: int, data: bytes, page: LeafPage | IndexPage) -> tuple[int, int]:
        self.buffer += data
        self.pages[offset] = (page, len(data))
        self.live_delta += len(data)
        self.page_delta += 1
        if self._flush is not None and len(self.buffer) >= self._piece_size:
            self._hand_over()
        return offset, len(data)

    def _hand_over(self) -> None:
        """Append the buffered pages as a piece (their decoded pages are let go)."""
        start = self.base
        end = self._flush(self.buffer, start)  # type: ignore[misc]
        self.pieces += 1
        self.piece_bytes += end - start
        self.base, self.buffer, self.pages = end, bytearray(), {}


def split_sizes(count: int, capacity: int, appending: bool) -> list[int]:
    """Entries per page when ``count`` entries must fit pages of ``capacity``.

    Growth at the right edge (ascending inserts) fills pages completely and leaves the remainder
    last; anything else is spread evenly, as a plain B+tree split would.
    """
    if count <= capacity:
        return [count]
    if appending:
        full, rest = divmod(count, capacity)
        return [capacity] * full + ([rest] if rest else [])
    pages = -(-count // capacity)
    base, extra = divmod(count, pages)
    return [base + 1] * extra + [base] * (pages - extra)


def merge_leaf(keys: list[bytes], values: list[int], ukeys: Sequence[bytes], uvalues: Sequence[int | None]) -> tuple[list[bytes], list[int], bool]:
    """Apply sorted updates to a leaf's entries; returns new lists and whether they only appended."""
    if not ukeys:
        return keys, values, False
    if not keys or ukeys[0] > keys[-1]:
        if None in uvalues:
            ukeys = [k for k, v in zip(ukeys, uvalues) if v is not None]
            uvalues = [v for v in uvalues if v is not None]
        return [*keys, *ukeys], [*values, *uvalues], True
    if len(ukeys) <= _BISECT_MERGE_LIMIT:
        keys, values, low = list(keys), list(values), 0
        for key, value in zip(ukeys, uvalues):
            i = bisect.bisect_left(keys, key, low)
            if i < len(keys) and keys[i] == key:
                if value is None:
                    del keys[i], values[i]
                else:
                    values[i] = value
            elif value is not None:
                keys.insert(i, key)
                values.insert(i, value)
            low = i
        return keys, values, False
    merged = dict(zip(keys, values))
    for key, value in zip(ukeys, uvalues):
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    new_keys = sorted(merged)
    return new_keys, [merged[k] for k in new_keys], False


class Rewrite:
    """Plans updates over pages read by ``read_page(offset, length)`` (the tree's, through its page
    cache), with the compaction ``policy`` and the tree's page geometry."""

    def __init__(self, read_page: Callable[[int, int], LeafPage | IndexPage], policy, page_size: int,
                 leaf_capacity: int, index_capacity: int):
        self._read_page = read_page
        self.policy = policy
        self.page_size = page_size
        self.leaf_capacity = leaf_capacity
        self.index_capacity = index_capacity

    def plan(self, footer: Footer, length: int, keys: Sequence[bytes], values: Sequence[int | None],
             checkpoint: int | None, *, flush: Callable[[bytearray, int], int] | None = None,
             piece_size: int = 0) -> tuple[UpdateBuilder, Footer] | None:
        """The pages and footer of an update of the version ``footer`` (the segment ``length``
        bytes long) that applies ``keys[i] -> values[i]`` (sorted, unique; ``None`` removes) with
        ``checkpoint`` (``None``: unchanged), ``None`` if it would change nothing. Pages beyond
        ``piece_size`` go to ``flush`` as they fill (``UpdateBuilder``); the builder holds the
        rest, footer included, to append at ``builder.base``."""
        shape = TreeShape(length, footer.min_offset, footer.live_bytes, self.page_size, footer.update_length)
        relocate_below = self.policy.threshold(shape) if footer.root_length else 0
        unchanged_checkpoint = checkpoint in (None, footer.checkpoint)
        if not keys and relocate_below <= footer.min_offset and unchanged_checkpoint:
            return None
        builder = UpdateBuilder(length, flush, piece_size)
        if footer.root_length:
            pointers = self._rewrite(builder, footer.root_offset, footer.root_length, keys, values, 0, len(keys), relocate_below)
            height = footer.height
        else:
            new_keys, new_values, _ = merge_leaf([], [], keys, values)
            if not new_keys and unchanged_checkpoint:
                return None  # removing keys from an empty tree changes nothing
            pointers = self._leaves(builder, new_keys, new_values, True)
            builder.entry_delta = len(new_keys)
            height = 1
        root, height = self._root(builder, pointers, height)
        footer_offset = builder.base + len(builder.buffer)
        new_footer = Footer(
            root_offset=root[1] if root else 0,
            root_length=root[2] if root else 0,
            height=height if root else 0,
            entry_count=footer.entry_count + builder.entry_delta,
            page_count=footer.page_count + builder.page_delta,
            live_bytes=footer.live_bytes + builder.live_delta,
            min_offset=root[3] if root else footer_offset,
            checkpoint=footer.checkpoint if checkpoint is None else checkpoint,
            update_length=len(builder.buffer) + FOOTER_SIZE,
        )
        builder.buffer += new_footer.encode(footer_offset)
        return builder, new_footer

    def _root(self, builder: UpdateBuilder, pointers: list[tuple], height: int) -> tuple[tuple | None, int]:
        """Stack index pages over ``pointers`` until one root remains; collapse single-child roots."""
        while len(pointers) > 1:
            columns = list(zip(*pointers))
            pointers = self._indexes(builder, *map(list, columns), False)
            height += 1
        if not pointers:
            return None, 0
        root = pointers[0]
        while height > 1:
            page = builder.page(root[1]) or self._read_page(root[1], root[2])
            if len(page) != 1:
                break
            # A root with one child is replaced by that child: the tree gets shorter.
            builder.retire(root[1], root[2])
            root = (MIN_KEY, page.offsets[0], page.lengths[0], page.min_offsets[0])
            height -= 1
        return root, height

    def _rewrite(self, builder: UpdateBuilder, offset: int, length: int, keys, values, lo: int, hi: int, relocate_below: int) -> list[tuple]:
        """Rewrite the page at ``offset`` with updates ``[lo, hi)``; returns its replacement pointers."""
        page = self._read_page(offset, length)
        builder.retire(offset, length)
        if offset < relocate_below and lo == hi:
            builder.relocated += 1
        if page.is_leaf:
            new_keys, new_values, appending = merge_leaf(page.keys, page.values, keys[lo:hi], values[lo:hi])
            builder.entry_delta += len(new_keys) - len(page.keys)
            return self._leaves(builder, new_keys, new_values, appending)
        bounds, count = page.keys, len(page.keys)
        visits: dict[int, tuple[int, int]] = {}
        while lo < hi:
            i = bisect.bisect_right(bounds, keys[lo]) - 1
            end = bisect.bisect_left(keys, bounds[i + 1], lo, hi) if i + 1 < count else hi
            visits[i] = (lo, end)
            lo = end
        if relocate_below and min(page.min_offsets) < relocate_below:
            for i, low in enumerate(page.min_offsets):
                if low < relocate_below and i not in visits:
                    visits[i] = (hi, hi)
        new_keys, new_offsets, new_lengths, new_mins = [], [], [], []
        copied = 0
        appending = False
        for i in sorted(visits):
            new_keys += bounds[copied:i]
            new_offsets += page.offsets[copied:i]
            new_lengths += page.lengths[copied:i]
            new_mins += page.min_offsets[copied:i]
            replaced = self._rewrite(builder, page.offsets[i], page.lengths[i], keys, values, *visits[i], relocate_below)
            for n, pointer in enumerate(replaced):
                new_keys.append(bounds[i] if n == 0 else pointer[0])
                new_offsets.append(pointer[1])
                new_lengths.append(pointer[2])
                new_mins.append(pointer[3])
            appending = i == count - 1 and len(replaced) > 1
            copied = i + 1
        new_keys += bounds[copied:]
        new_offsets += page.offsets[copied:]
        new_lengths += page.lengths[copied:]
        new_mins += page.min_offsets[copied:]
        return self._indexes(builder, new_keys, new_offsets, new_lengths, new_mins, appending)

    def _leaves(self, builder: UpdateBuilder, keys: list[bytes], values: list[int], appending: bool) -> list[tuple]:
        pointers, at = [], 0
        if not keys:
            return []
        for size in split_sizes(len(keys), self.leaf_capacity, appending):
            chunk_keys = keys[at:at + size]
            pointers.append((chunk_keys[0], *builder.leaf(chunk_keys, values[at:at + size])))
            at += size
        return pointers

    def _indexes(self, builder: UpdateBuilder, keys, offsets, lengths, mins, appending: bool) -> list[tuple]:
        pointers, at = [], 0
        if not keys:
            return []
        for size in split_sizes(len(keys), self.index_capacity, appending):
            end = at + size
            pointers.append((keys[at], *builder.index(keys[at:end], offsets[at:end], lengths[at:end], mins[at:end])))
            at = end
        return pointers


__all__ = ["Rewrite", "UpdateBuilder", "merge_leaf", "split_sizes"]
