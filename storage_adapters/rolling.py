"""``RollingSegment``: one logical append-only byte stream over numbered chunks, with compare-and-append.

Layout of segment ``NAME`` (see docs/storage.md)::

    NAME.seg/00000000000000000000          chunk holding offsets [0, next chunk's start)
    NAME.seg/00000000000033554432          ... named by its 20-digit zero-padded start offset
    NAME.seg/truncation/00000000000000001234   empty marker; the largest is the start offset
    NAME.seg/<start>-<end>.<generation>    replacement chunk: holds [start, end), maybe fewer bytes
    NAME.seg/switch/<generation>           commit marker of that replacement (names it)

This module is the public face; the work is split by responsibility:

* rolling_view.py: names, ``ChunkInfo``, what a listing says, and a handle's view (no I/O);
* rolling_handle.py: a handle's listing, reads, truncation and deletions, common to all storage;
* rolling_inplace.py: the strategy of appendable storage (local disk, memory): the last chunk
  grown in place under the writers' lock, rolled into the next once full;
* rolling_objects.py: the strategy of object stores (S3): one new object per append, dead names
  kept for the deletion grace;
* rolling_replace.py: replacing a range of sealed chunks by one (consolidation, log compaction);
* rolling_sweep.py: which dead objects and old switch markers a truncation or a switch deletes.

The strategy is chosen once, when the segment is opened, by ``storage.appendable``.
"""

from __future__ import annotations

import operator

from .base import ChunkStorage
from .errors import InvalidInputError
from .framing import Framing
from .rolling_handle import MAX_READ_REFRESH_ATTEMPTS, MAX_REFRESH_ATTEMPTS, SegmentHandle
from .rolling_inplace import InPlaceHandle
from .rolling_objects import MAX_APPEND_ATTEMPTS, ObjectHandle
from .rolling_replace import MAX_REPLACE_ATTEMPTS, ChunkReplacer
from .rolling_view import (
    CHUNK_NAME,
    DEFAULT_ROLLING_SIZE,
    REPLACEMENT_NAME,
    SEGMENT_SUFFIX,
    SWITCH_DIR,
    TRUNCATION_DIR,
    ChunkInfo,
    chunk_name,
    replacement_name,
    validate_segment_name,
)

__all__ = [
    "CHUNK_NAME",
    "DEFAULT_ROLLING_SIZE",
    "MAX_APPEND_ATTEMPTS",
    "MAX_READ_REFRESH_ATTEMPTS",
    "MAX_REFRESH_ATTEMPTS",
    "MAX_REPLACE_ATTEMPTS",
    "REPLACEMENT_NAME",
    "SEGMENT_SUFFIX",
    "SWITCH_DIR",
    "TRUNCATION_DIR",
    "ChunkInfo",
    "RollingSegment",
    "chunk_name",
    "replacement_name",
    "validate_segment_name",
]


class RollingSegment:
    """An append-only byte stream stored as chunks in ``storage`` under the segment ``name``.

    ``length`` and ``start_offset`` are this handle's view as of its last ``refresh``/``append``/
    ``truncate``; ``append(..., expected_offset=...)`` always checks against the length as stored,
    so a handle that is behind gets ``BadOffsetError`` (and is refreshed), never a bad write.
    """

    def __init__(self, storage: ChunkStorage, name: str, rolling_size: int = DEFAULT_ROLLING_SIZE, *,
                 framing: Framing | None = None):
        if not isinstance(rolling_size, int) or rolling_size <= 0:
            raise InvalidInputError(f"rolling_size must be a positive int, got {rolling_size!r}")
        self.storage = storage
        #: How the owner's appends are framed (storage_adapters/framing.py): what tells the
        #: committed length of a chunk appended to in place
        self.framing = framing
        self.name = validate_segment_name(name)
        self.rolling_size = rolling_size
        strategy = InPlaceHandle if storage.appendable else ObjectHandle
        self._handle: SegmentHandle = strategy(storage, name, rolling_size, framing)
        self._replacer = ChunkReplacer(self._handle)
        self._handle.refresh()

    def __repr__(self) -> str:
        return f"RollingSegment({self.storage.url!r}, {self.name!r}, length={self.length})"

    # -- view ----------------------------------------------------------------------------------
    #: Bumped whenever the view is reloaded or cut (refresh, truncation, replacement, deletion):
    #: a layer above that keeps its own copy of ``chunks()`` compares it to know the copy is stale.
    #: (``attrgetter`` reads it without a Python call: the log reads it on every append.)
    view_changes = property(operator.attrgetter("_handle.view_changes"))

    @property
    def length(self) -> int:
        """Bytes ever appended (the offset the next append gets), as of this handle's last look."""
        return self._handle.view.length

    @property
    def start_offset(self) -> int:
        """The truncation offset: bytes below it can no longer be read."""
        return self._handle.view.start_offset

    def chunks(self) -> list[ChunkInfo]:
        """The chunks holding readable bytes, in offset order (the first may start below ``start_offset``)."""
        return list(self._handle.view.chunks)

    def chunk_at(self, position: int) -> ChunkInfo | None:
        """The chunk of this handle's view holding byte ``position`` (the last one for the end)."""
        return self._handle.view.chunk_at(position)

    def chunks_in(self, start: int, end: int) -> list[ChunkInfo]:
        """The chunks of this handle's view overlapping ``[start, end)`` (the one holding ``start`` if empty)."""
        return self._handle.view.chunks_in(start, end)

    def readable_end(self, position: int, limit: int) -> int:
        """Where the bytes readable from ``position`` on stop before ``limit``: the start of the first
        hole at or after ``position`` (``position`` itself if it lies in a hole), else ``limit``."""
        return self._handle.view.readable_end(position, limit)

    def hole_at(self, position: int) -> tuple[int, int] | None:
        """The hole ``(start, end)`` holding byte ``position`` in this handle's view, if any."""
        return self._handle.view.hole_at(position)

    def holes(self) -> list[tuple[int, int]]:
        """The holes ``(start, end)`` at or above ``start_offset`` as of this handle's view, in order:
        byte ranges that replacements left empty (reading them raises ``HoleError``)."""
        return self._handle.view.holes()

    def refresh(self) -> None:
        """Reload this handle's view from storage (appends, truncations and replacements by other handles).

        A listing taken while another process appends and truncates can mix two states (a new
        truncation marker with the old chunks, a listed chunk deleted before its size was read);
        such a view is detected and the listing retaken, at most ``MAX_REFRESH_ATTEMPTS`` times.
        """
        self._handle.refresh()

    def cut_short(self) -> bool:
        """Whether the last chunk's file is shorter than its backend keeps it past committed
        frames (``ChunkStorage.zeros_kept_after``: local disk): it was cut short behind the
        segment's back, so bytes past this view's end may be lost, and nothing tells how many.
        False on backends that keep nothing past a chunk's end, and for a segment with no chunk."""
        return self._handle.cut_short()

    @property
    def torn_tail(self) -> tuple[int, bytes] | None:
        """``(position, bytes)`` of a torn write found after the end of the last chunk by the
        latest look (local disk): not committed, and zeroed by the next append into the chunk.
        The layers above read it to keep what it claimed (a record batch's offsets) from being
        given out again."""
        tail = self._handle.tail
        if tail is None or tail.torn is None:
            return None
        return tail.torn[0], tail.torn_bytes

    def poll(self) -> bool:
        """Whether the segment may have grown since this handle's last look: ``refresh`` then.

        Cheap, for tail readers: object stores cost one small request (a 1-byte ranged read of
        the chunk the next append creates: absent means nothing was appended), never a listing;
        appendable backends stat the last chunk and look for the next (writers with a smaller
        rolling size roll sooner).
        Truncations are not looked for (a reader meets them when it reads).
        """
        handle = self._handle
        handle.check_open()
        with handle.mutex:
            return handle.poll()

    # -- appending -----------------------------------------------------------------------------
    def append(self, data: bytes, expected_offset: int | None = None) -> int:
        """Append ``data`` durably and return the offset it starts at.

        With ``expected_offset``, append only if the segment's length as stored equals it; otherwise
        raise ``BadOffsetError`` and write nothing. Without it, append at the end, whatever it is.
        """
        handle = self._handle
        handle.check_open()
        data = _as_bytes(data)
        if not data:
            raise InvalidInputError(f"segment {self.name!r}: nothing to append (empty data)")
        if expected_offset is not None and (not isinstance(expected_offset, int) or expected_offset < 0):
            raise InvalidInputError(f"expected_offset must be a non-negative int or None, got {expected_offset!r}")
        with handle.mutex:
            return handle.append(data, expected_offset)

    # -- reading -------------------------------------------------------------------------------
    def read(self, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset``; they must lie within ``[start_offset, length)``."""
        self._handle.check_open()
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            raise InvalidInputError(f"offset and length must be non-negative ints, got {offset!r}, {length!r}")
        return self._handle.read(offset, length)

    # -- truncating and deleting ---------------------------------------------------------------
    def truncate(self, offset: int, *, expected: str | None = None) -> None:
        """Make bytes below ``offset`` unreadable and delete every chunk lying wholly below it.

        The truncation offset only moves forward (a lower ``offset`` is a no-op) and survives
        reopening. The last chunk is kept even when it lies below ``offset``: it holds the length.

        ``expected``: the name of the chunk holding byte ``offset`` in the view the caller chose
        ``offset`` in. A replacement may have rewritten that chunk since, moving its bytes (log
        compaction packs what it keeps), so that ``offset`` no longer lies where the caller
        meant; then ``LayoutConflictError`` and nothing is truncated. The check runs on a fresh
        listing just before the marker is written; a replacement switched between the two is
        left for readers to settle (see docs/format.md, "Truncation inside a replaced chunk").
        """
        self._handle.check_open()
        if not isinstance(offset, int) or offset < 0:
            raise InvalidInputError(f"truncation offset must be a non-negative int, got {offset!r}")
        if expected is not None and not isinstance(expected, str):
            raise InvalidInputError(f"expected must be a chunk name or None, got {expected!r:.100}")
        self._handle.truncate(offset, expected)

    # -- replacing chunks ----------------------------------------------------------------------
    def replace_range(self, start: int, end: int, data: bytes, *, expected: list[str] | None = None) -> None:
        """Atomically replace the sealed chunks covering exactly ``[start, end)`` by one chunk holding ``data``.

        ``start`` and ``end`` must be chunk boundaries of this handle's view (``chunks()``), at or
        above ``start_offset``, and the last chunk is never replaced. ``len(data) <= end - start``;
        if shorter, ``[start + len(data), end)`` becomes a hole (reads touching it raise
        ``HoleError``; ``holes()`` lists them). Offsets never move.

        It is a compare-and-swap on the chunks in the range: ``expected``, the names of the chunks
        the caller planned with (default: those this handle's view shows now). If another handle
        or process replaced or truncated them first, ``LayoutConflictError`` and nothing changed;
        so too when the view was reloaded since the caller planned (a read or a replacement of
        this handle looks again) and the range is no longer made of those chunks. Readers and
        writers elsewhere see the old chunks or the new one, never a mix; a crash at any point
        leaves one of the two, and the leftovers are deleted by the next replacement or truncation.
        """
        self._handle.check_open()
        data = b"" if isinstance(data, (bytes, bytearray, memoryview)) and not len(data) else _as_bytes(data)
        for value, what in ((start, "start"), (end, "end")):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(f"replace_range {what} must be a non-negative int, got {value!r}")
        if end <= start or len(data) > end - start:
            raise InvalidInputError(f"segment {self.name!r}: replace_range needs start < end and at most "
                                    f"end - start bytes; got [{start}, {end}) with {len(data)} bytes")
        self._replacer.replace_range(start, end, data, expected)

    def consolidate(self, target_size: int | None = None) -> int:
        """Merge runs of small sealed chunks into chunks of up to ``target_size`` bytes (default:
        ``rolling_size``), each by one ``replace_range`` with the exact bytes; return how many
        merged chunks were written. Bytes and offsets do not change; runs that another process
        replaces meanwhile are skipped. Holds at most one merged chunk in memory."""
        self._handle.check_open()
        target = self.rolling_size if target_size is None else target_size
        if not isinstance(target, int) or isinstance(target, bool) or target <= 0:
            raise InvalidInputError(f"target_size must be a positive int or None, got {target_size!r}")
        return self._replacer.consolidate(target)

    def small_runs(self, target: int) -> list[list[ChunkInfo]]:
        """Runs of two or more adjacent sealed chunks of this view whose stored bytes fit in
        ``target``: what ``consolidate`` merges. A chunk with a hole may only end a run (the
        merged chunk keeps its hole at the end)."""
        return self._handle.view.small_runs(target)

    def delete(self) -> None:
        """Delete the segment and all its chunks; the handle then sees an empty segment."""
        handle = self._handle
        handle.check_open()
        with handle.mutex:
            self.remove(self.storage, self.name)
            handle.forget()

    @staticmethod
    def remove(storage: ChunkStorage, name: str) -> None:
        """Delete segment ``name`` of ``storage`` whole, without a handle (none can be opened on a
        damaged one): ``StorageError`` if anything stays. Handles elsewhere see it empty."""
        SegmentHandle.remove(storage, validate_segment_name(name) + SEGMENT_SUFFIX)

    def close(self) -> None:
        """Forget the handle's view; later calls raise ``StorageError``. Data is already durable."""
        self._handle.closed = True

    def __enter__(self) -> "RollingSegment":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _as_bytes(data: object) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise InvalidInputError(f"data must be bytes-like, got {type(data).__name__}")
