"""``SegmentLog``: the record log of one segment, as record batches in a ``RollingSegment``.

A batch never spans chunks: appendable backends put a whole append in the last chunk, object
stores make one object per append. Each chunk therefore holds whole batches, and gets a sparse
offset and time index (``ChunkSummary``), kept in memory for the chunk being appended to and
stored beside the data as a small checksummed file once the chunk is sealed. Index files are
derived data: a missing or corrupt one is rebuilt from the chunk.

Byte layout of segment ``NAME`` (see docs/format.md)::

    NAME/_log.seg/<20-digit byte position>   chunks of record batches (RollingSegment)
    NAME/_index/<chunk name>                 sparse index of a sealed chunk (named like the chunk)
    NAME/_gaps/<20-digit start>-<20-digit end>   damaged bytes given up by an explicit repair
    NAME/_gaps/<start>-<end>.<20-digit generation>   the same, in a replacement chunk of that generation

Chunks may be replaced (``replace_range``: consolidation, key-based compaction): byte positions
stay logical, a replacement chunk holds whole batches from its start and maybe a hole after them,
which readers step over as they step over gaps (record offsets continue from the next batch's base
offset). A handle whose position lies inside a chunk replaced under it moves to the first batch
of the new chunk it has not consumed yet (``resyncs`` counts such moves).

Committed means committed: the byte stream's length is its committed length (local disk: the end
of the chain of whole, valid batches; objects are whole), so nothing below it is a torn tail. An invalid
batch anywhere below it, the end of the last chunk included, is ``CorruptDataError`` naming the
segment, chunk and byte, on open and on read; such a segment refuses appends. Only an explicit
repair (``attrindex.segment_repair``) records a gap marker, which readers then step over. A marker names byte
positions of the chunk that held them when it was recorded (plain, or a replacement of the
generation its name gives): once a replacement of a later generation covers them (log compaction
rewrites the batches around a gap), the marker is void, since a kept batch may now start there.

A ``SegmentLog`` is the handle's view of the log (its chunk list, the append position and next
offset, the scan of the tail, appends, replacements and truncation) and owns the helpers that
are not: ``GapMarkers`` (``gaps.py``: the recorded gaps), ``IndexFiles`` (``chunk_indexes.py``:
the stored sparse indexes of sealed chunks) and ``LogReads`` (``reads.py``: reads by offset and
by time, and planned reads). This class is not thread-safe on its own; ``Segment`` serialises
writers and catch-ups.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import re
from typing import Callable, Iterator, TypeVar

import attrs

from storage_adapters import ChunkInfo, ChunkStorage, RollingSegment

from ..layout import gap_dir, index_dir, log_name
from ..errors import CorruptDataError, HoleError, InvalidInputError, LayoutChangedError, RetriesExhaustedError, StorageError
from .batch.header import BATCH_HEADER_SIZE, BatchHeader, check_batch, read_header
from .chunk_indexes import IndexFiles, index_batch, summarize_replacement
from .framing import LOG_FRAMING, torn_claim
from .gaps import GapMarkers
from .reads import MAX_RESYNC_ATTEMPTS, READ_WINDOW, LogReads
from .sparse_index import MIN_TIMESTAMP, ChunkIndexBuilder, ChunkSummary

_log = logging.getLogger("attrindex.log")
DEFAULT_LOG_ROLLING_SIZE = 16 << 20
DEFAULT_INDEX_INTERVAL_BYTES = 4096
_T = TypeVar("_T")
_ERROR_PREFIX = re.compile(r"^(segment '.*?': )?record batch at offset \d+: ")

# visitor(position, header, buffer, position of the batch in buffer) for each new batch
BatchVisitor = Callable[[int, BatchHeader, bytes, int], None]


@attrs.define
class LogChunk:
    """This handle's knowledge of one chunk: its bytes, and the valid batches scanned so far."""

    start: int
    end: int
    name: str = ""  #: the chunk's object name (a replacement has its own)
    summary: ChunkSummary | None = None  #: complete summary of a sealed chunk, once loaded
    builder: ChunkIndexBuilder | None = None  #: summary being built as the chunk is scanned


class SegmentLog:
    """The batches of one segment, appended by compare-and-append, with sparse indexes per chunk."""

    def __init__(self, storage: ChunkStorage, segment: str, *, rolling_size: int = DEFAULT_LOG_ROLLING_SIZE,
                 index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES):
        if not isinstance(index_interval_bytes, int) or index_interval_bytes <= 0:
            raise InvalidInputError(f"index_interval_bytes must be a positive int, got {index_interval_bytes!r}")
        self.storage = storage
        self.segment = segment
        self.interval = index_interval_bytes
        self.bytes = RollingSegment(storage, log_name(segment), rolling_size=rolling_size, framing=LOG_FRAMING)
        self.chunks: list[LogChunk] = []  #: this handle's view of the chunks (``sync_chunks``)
        #: recorded gaps: skipped even where bytes look valid, while they are in force
        self.gap_markers = GapMarkers(storage, gap_dir(segment), self.bytes)
        self.index_files = IndexFiles(storage, index_dir(segment), self.bytes, segment)
        self.reads = LogReads(self)  #: reads by offset and by time
        # Bound here rather than wrapped: they are on every read's path.
        self.read_planned = self.reads.read_planned
        self.planned_batches = self.reads.planned_batches
        self.position = 0  #: bytes scanned and valid: the append position
        self.next_offset = 0  #: record offset after the last record scanned
        self.max_timestamp = MIN_TIMESTAMP
        self.resyncs = 0  #: times ``position`` moved because the bytes under it changed (replacement, truncation)
        self._position_chunk = ""  #: name of the chunk in which ``position`` was reached
        self._prefetched: tuple[int, int, bytes] | None = None  #: (start, end, bytes) read by open_at
        self._synced_view = -1  #: ``bytes.view_changes`` when the chunk list was last aligned with it
        #: ((truncation offset, chunk holding it), where the log starts) once ``_settle_start`` ran
        self._settled_start: tuple[tuple[int, str], int] | None = None

    # -- positions and chunks ------------------------------------------------------------------
    @property
    def start_position(self) -> int:
        """The first readable byte: the truncation offset, unless it lies inside a replacement
        chunk at no valid batch (see ``_settle_start``)."""
        start = self.bytes.start_offset
        chunk = self.bytes.chunk_at(start)
        if chunk is None or chunk.start == start or not chunk.generation:
            return start  # a chunk start, or inside a plain chunk (never rewritten): a batch start
        settled = self._settled_start
        if settled is None or settled[0] != (start, chunk.name):
            self._settled_start = settled = ((start, chunk.name), self._settle_start(start, chunk))
        return settled[1]

    def _settle_start(self, start: int, chunk: ChunkInfo) -> int:
        """Where the log starts when the truncation offset ``start`` lies strictly inside the
        replacement ``chunk``: ``start`` if a valid batch begins there, else the chunk's end.

        A truncation chosen in a view older than the replacement (a retention racing a log
        compaction in another process) names a batch start of the chunks the replacement
        rewrote, and compaction packs the batches it keeps towards the chunk's start: the offset
        may then lie in the hole or inside a batch. Every handle settles it the same way, from
        the bytes alone, and only ever forward. docs/format.md, "Truncation inside a replaced
        chunk", gives the rule and what it costs."""
        if start < chunk.stored_end:
            for _at, header, _buf, _pos in self._walk(start, chunk.stored_end, {chunk.name}, 64 << 10):
                if header is not None:
                    return start
                break
        _log.info("segment %r: the truncation at log byte %d lies inside chunk %s at no batch (a replacement "
                  "rewrote the chunk after the truncation was chosen); the log starts at byte %d, the chunk's end",
                  self.segment, start, chunk.name, chunk.end)
        return chunk.end

    def sync_chunks(self) -> None:
        """Align ``chunks`` with the byte stream's view (new chunks, grown last chunk, truncation,
        replacements)."""
        self._synced_view = self.bytes.view_changes
        stored = self.bytes.chunks()
        mine = self.chunks
        if len(stored) == len(mine) and all(a.name == b.name and a.start == b.start for a, b in zip(stored, mine)):
            for info, known in zip(stored, mine):  # the usual case (after an append: the last grew)
                known.end = info.end
            return
        by_name = {c.name: c for c in self.chunks}
        chunks = []
        for info in stored:
            known = by_name.get(info.name)
            if known is None or known.start != info.start:
                known = LogChunk(info.start, info.end, info.name)
            known.end = info.end
            chunks.append(known)
        self.chunks = chunks

    def _in_current_view(self, plan: Callable[[], _T]) -> _T:
        """``plan()``, which walks the chunk list, on a list that follows the byte stream's view.

        The byte stream reloads its view by itself when a read finds a chunk gone (replaced or
        truncated by another handle), so the list is aligned first whenever that view changed,
        and ``plan`` runs again when it meets a layout change on the way (bounded)."""
        for _attempt in range(MAX_RESYNC_ATTEMPTS):
            if self.bytes.view_changes != self._synced_view:
                self.sync_chunks()
            try:
                return plan()
            except LayoutChangedError:
                if self.bytes.view_changes == self._synced_view:
                    self.bytes.refresh()  # the chunks changed, yet no read reloaded the view: look again
        raise RetriesExhaustedError(f"segment {self.segment!r}: log chunks were replaced under this handle "
                                    f"{MAX_RESYNC_ATTEMPTS} times in a row while it planned a read; try again")

    def _replaced_under_position(self) -> LogChunk | None:
        """The chunk holding ``position`` strictly inside it if ``position`` was reached in another
        chunk (which a replacement took the place of): its bytes there need not be a batch start."""
        if not self.chunks:
            return None
        chunk = self.chunks[self.chunk_index(self.position)]
        if chunk.start < self.position < chunk.end and chunk.name != self._position_chunk:
            return chunk
        return None

    def _resync(self, chunk: LogChunk) -> None:
        """``position`` lies inside ``chunk``, which replaced the chunks it was scanned in: move to
        the chunk's first batch holding offsets not consumed yet (or past it), visiting nothing."""
        target, position = self.next_offset, chunk.end
        for at, header, _buf, _pos in self.batches(chunk.start, chunk.end, names={chunk.name}):
            if header.next_offset > target:  # record-less batches at ``target`` were seen, or cleaned
                position = at
                break
        _log.info("segment %r: log chunk %s was replaced under this handle at byte %d; resuming at byte %d "
                  "(next offset %d)", self.segment, chunk.name, self.position, position, target)
        self.position, self._position_chunk = position, chunk.name
        self.resyncs += 1
        for c in self.chunks:  # builders that scanned the old bytes: summaries come from index files
            if c is chunk or c.start == position:
                c.builder = None

    def chunk_index(self, position: int) -> int:
        """Index of the chunk holding ``position`` (the last chunk for the end position)."""
        i = bisect.bisect_right(self.chunks, position, key=lambda c: c.start) - 1
        return max(i, 0)

    def _is_last(self, chunk: LogChunk) -> bool:
        return chunk is self.chunks[-1]

    # -- gaps ----------------------------------------------------------------------------------
    def gaps(self) -> dict[int, int]:
        """Every recorded gap in force in this handle's view, ``{start: end}`` (reloaded from storage)."""
        return self.gap_markers.all_in_force()

    def record_gap(self, start: int, end: int) -> None:
        """Record log bytes ``[start, end)`` (within one chunk of this handle's view) as given up by a
        repair: readers step over them while that chunk is in force."""
        self.gap_markers.record(start, end)

    def _feed_gap(self, chunk: LogChunk, start: int, end: int) -> None:
        """Account garbage bytes in a chunk's summary as a record-less batch (it holds no records)."""
        if chunk.builder is not None and end > start:
            chunk.builder.add(start - chunk.start, end - start, self.next_offset, 0, MIN_TIMESTAMP)

    # -- scanning the tail ---------------------------------------------------------------------
    def catch_up(self, visit: BatchVisitor | None = None, *, refresh: bool = True) -> int:
        """Scan batches beyond ``position``, calling ``visit`` for each; return how many were new.

        Steps over recorded gaps; any other invalid batch is ``CorruptDataError`` (nothing below
        the committed length is a torn tail). The loop ends: every lap moves ``position`` forward.
        """
        if refresh:
            self.bytes.refresh()
        seen = 0
        for _attempt in range(MAX_RESYNC_ATTEMPTS):
            try:
                self.sync_chunks()
                if self.position < self.start_position:
                    self._restart_at_start()
                replaced = self._replaced_under_position()
                if replaced is not None:
                    self._resync(replaced)
                if self.position > self.bytes.length:
                    raise self._end_went_back_error()
                while self.position < self.bytes.length:
                    chunk = self.chunks[self.chunk_index(self.position)]
                    if chunk.builder is None and chunk.start == self.position:
                        chunk.builder = ChunkIndexBuilder(chunk.start, self.interval, next_offset=self.next_offset)
                    seen, stopped = self._scan_chunk(chunk, visit, seen)
                    if stopped:
                        break
                return seen
            except LayoutChangedError:
                continue  # chunks were replaced under the scan: sync (and resync) and go on
        raise RetriesExhaustedError(f"segment {self.segment!r}: log chunks were replaced under a catch-up "
                                    f"{MAX_RESYNC_ATTEMPTS} times in a row; try again")

    def _end_went_back_error(self) -> CorruptDataError:
        """The stored log ends below ``position``, which this handle read as committed. Writers
        only move the end forward (truncation and replacements keep it), so the newest frames of
        the last chunk were damaged (and cut as a torn write) or the file was cut short. Raised rather than waited out: a writer would lose every
        compare-and-append race at this position, and a tail reader would wait for bytes it has
        read already."""
        return CorruptDataError(
            f"segment {self.segment!r}: the log's committed end is byte {self.bytes.length}, below byte "
            f"{self.position}, which this handle had read as committed: the newest batches of its last chunk were "
            f"damaged or its file was cut short (or an append it saw was taken back when its sync failed, or the "
            f"segment was deleted and made again). Nothing was written. Reopen the segment; "
            f"SegmentStore.repair_segment gives up what is lost and never reuses its offsets",
            segment=self.segment, offset=self.bytes.length)

    def _restart_at_start(self) -> None:
        """The bytes this handle stood at were truncated away (retention elsewhere): resync."""
        self.position = self.start_position
        self.resyncs += 1
        if self.chunks:
            self._position_chunk = self.chunks[self.chunk_index(self.position)].name
        header = self.header_at(self.position)
        if header is not None:
            self.next_offset = header.base_offset
        if self.chunks:
            # The chunk's builder indexed its batches up to where this handle stood, not up to the
            # new start: a fresh one where the chunk starts here, else none (its summary then
            # comes from its index file or a rebuild, as after ``_resync``).
            chunk = self.chunks[self.chunk_index(self.position)]
            chunk.builder = (ChunkIndexBuilder(chunk.start, self.interval, next_offset=self.next_offset)
                             if chunk.start == self.position else None)

    def _scan_chunk(self, chunk: LogChunk, visit: BatchVisitor | None, seen: int) -> tuple[int, bool]:
        """Scan ``chunk`` from ``position``; return (batches seen, whether scanning stopped)."""
        gaps = self.gap_markers.starts
        for at, header, buf, pos in self._walk(self.position, chunk.end):
            if header is None or (at in gaps and self.gap_markers.in_force(at) is not None):  # a gap, or corruption
                self._invalid_at(chunk, at, buf if header is None else "")
                return seen, False
            if visit is not None:
                visit(at, header, buf, pos)
            self._advance(chunk, at, header)
            seen += 1
        if not self._is_last(chunk):
            self._finish_summary(chunk)
        return seen, False

    def _advance(self, chunk: LogChunk, at: int, header: BatchHeader) -> None:
        """Move past the valid batch at ``at`` (scanned or just appended), indexing it."""
        if chunk.builder is not None:
            index_batch(chunk.builder, at, header)
        self.next_offset = header.next_offset  # a record-less batch's base is the next offset
        if header.record_count:
            self.max_timestamp = max(self.max_timestamp, header.max_timestamp)
        self.position, self._position_chunk = at + header.size, chunk.name

    @staticmethod
    def _finish_summary(chunk: LogChunk) -> None:
        """A chunk scanned to its end that no longer grows: its summary is complete."""
        if chunk.builder is not None and chunk.summary is None:
            chunk.summary, chunk.builder = chunk.builder.summary(), None

    def _walk(self, start: int, end: int, names: set[str] | None = None, window: int = READ_WINDOW
              ) -> Iterator[tuple[int, BatchHeader | None, bytes, int]]:
        """Verified batches in ``[start, end)`` read in windows, as (position, header, buffer, pos).

        Ends after yielding ``(position, None, reason, 0)`` at the first invalid or incomplete batch
        or at a hole. ``names``: the chunks the caller planned with (default: this handle's view);
        bytes read from any other chunk (replaced meanwhile) raise ``LayoutChangedError``.
        """
        if names is None:
            names = {c.name for c in self.chunks[self.chunk_index(start):self.chunk_index(max(start, end - 1)) + 1]}
        position, default_window = start, window
        while position < end:
            window_end = self.bytes.readable_end(position, min(end, position + window))
            if window_end == position:
                yield position, None, "a hole left by a chunk replacement", 0
                return
            try:
                buf = self._take_prefetched(position, window_end) or self.bytes.read(position, window_end - position)
            except HoleError as exc:  # a newer replacement than this view knew
                raise LayoutChangedError(f"segment {self.segment!r}: {exc}") from exc
            if any(c.name not in names for c in self.bytes.chunks_in(position, window_end)):
                raise LayoutChangedError(f"segment {self.segment!r}: log chunks in [{position}, {window_end}) "
                                         "were replaced during the read")
            pos = 0
            while pos < len(buf):
                try:
                    header = read_header(buf, pos, position=position, segment=self.segment)
                    if header is not None:
                        check_batch(buf, pos, header, position=position, segment=self.segment)
                except CorruptDataError as exc:
                    yield position + pos, None, str(exc), 0
                    return
                if header is None:
                    break
                yield position + pos, header, buf, pos
                pos += header.size
            if pos == 0:  # incomplete: a batch larger than the window, or a torn end
                if window_end == end or window_end < min(end, position + window):
                    yield position, None, f"a batch runs past byte {end}, the end of its chunk", 0
                    return
                window = end - position  # read the big batch whole
                continue
            position, window = position + pos, default_window

    def _invalid_at(self, chunk: LogChunk, at: int, reason: str) -> None:
        """Step over the recorded gap at ``at``, or raise: invalid committed bytes are corruption."""
        gap_end = self.gap_markers.end_at(at)
        if gap_end is None:
            raise self.corruption(at, reason)
        self._feed_gap(chunk, at, min(gap_end, chunk.end))
        self.position, self._position_chunk = gap_end, chunk.name
        if gap_end >= chunk.end and not self._is_last(chunk):
            self._finish_summary(chunk)

    def corruption(self, at: int, reason: str) -> CorruptDataError:
        """The error for an invalid batch at log byte ``at``, naming segment, chunk and byte."""
        reason = _ERROR_PREFIX.sub("", reason)
        chunk = self.chunks[self.chunk_index(at)] if self.chunks else None
        where = f"chunk {chunk.name}, byte {at - chunk.start} in it" if chunk else "no chunk"
        return CorruptDataError(
            f"segment {self.segment!r}: invalid record batch at log byte {at} ({where}) below the committed "
            f"length {self.bytes.length}: {reason}. The segment refuses appends until repaired: see "
            f"SegmentStore.verify_segment / repair_segment",
            segment=self.segment, offset=at)

    @property
    def append_offset(self) -> int:
        """The record offset the next appended batch gets: ``next_offset``, or past the offsets a
        torn batch at the end claimed (local disk: its header was written, its payload torn). A
        reader may have seen that batch before the crash, so its offsets are never given out again;
        readers still read to ``next_offset`` (the offsets skipped read as a gap)."""
        torn = self.bytes.torn_tail
        if torn is None or torn[0] != self.position:
            return self.next_offset
        claim = torn_claim(torn[1], torn[0])
        return self.next_offset if claim is None else max(self.next_offset, claim)

    # -- appending -----------------------------------------------------------------------------
    def append(self, data: bytes, header: BatchHeader) -> int:
        """Append one encoded batch at ``position`` (compare-and-append); return its byte position.

        ``BadOffsetError`` means another writer appended first: ``catch_up`` and try again. Once
        the bytes are durable nothing here raises (the bookkeeping after them does no I/O but the
        best-effort index file).
        """
        return self.append_many([data], [header])[0]

    def append_many(self, datas: list[bytes], headers: list[BatchHeader]) -> list[int]:
        """Append consecutive encoded batches (each based where the one before ends) as ONE
        compare-and-append, so they are durable together (group commit); return their positions.

        The batches may be sealed for any position: the byte stream seals them for where they
        land (its framing's ``place``, which leaves batches encoded for there as they are). They
        land in one chunk, so no batch spans chunks. Errors as for ``append``.
        """
        data = datas[0] if len(datas) == 1 else b"".join(datas)
        at = self.bytes.append(data, expected_offset=self.position)
        self.sync_chunks()
        chunk = self.chunks[-1]
        if chunk.start == at:
            chunk.builder = ChunkIndexBuilder(at, self.interval, next_offset=self.next_offset)
            if len(self.chunks) > 1:
                self._seal(self.chunks[-2])
        positions = []
        for data, header in zip(datas, headers):
            self._advance(chunk, at, header)
            positions.append(at)
            at += len(data)
        return positions

    def _seal(self, chunk: LogChunk) -> None:
        """A chunk stopped growing: keep its summary and store its index if it is worth a file."""
        self._finish_summary(chunk)
        if chunk.summary is not None and chunk.summary.batch_count > 1:
            self.index_files.store(chunk.summary, chunk.name)

    # -- summaries of sealed chunks ------------------------------------------------------------
    def summary(self, i: int) -> ChunkSummary:
        """The summary of chunk ``i``: in memory, from its index file, or rebuilt from its data."""
        chunk = self.chunks[i]
        if chunk.summary is not None:
            return chunk.summary
        if chunk.builder is not None and (self._is_last(chunk) or self.position >= chunk.end):
            return chunk.builder.summary()
        summary = self.index_files.load(chunk.name, chunk.start, chunk.end)
        if summary is None:
            summary = self._rebuild(i)
        if not self._is_last(chunk):
            chunk.summary = summary
        return summary

    def _rebuild(self, i: int) -> ChunkSummary:
        """Scan chunk ``i``, build its summary (stepping over recorded gaps), and store it if sealed."""
        chunk = self.chunks[i]
        start = max(chunk.start, self.start_position)
        limit = chunk.end if not self._is_last(chunk) else min(chunk.end, self.position)
        first = self._header_prefetching(start, min(limit, start + READ_WINDOW))
        base = first.base_offset if first is not None else self._base_before(i)
        builder = ChunkIndexBuilder(chunk.start, self.interval, next_offset=base)
        if start > chunk.start:  # truncated mid-chunk: the unreadable prefix holds no records for us
            builder.add(0, start - chunk.start, base, 0, MIN_TIMESTAMP)
        for at, header, _buf, _pos in self.batches(start, limit, builder, base):
            index_batch(builder, at, header)
        summary = builder.summary()
        if not self._is_last(chunk) and summary.batch_count > 1 and chunk.start >= self.start_position:
            self.index_files.store(summary, chunk.name)
        return summary

    def open_at(self, position: int) -> None:
        """Position the handle at the start of the chunk holding byte ``position``, ready to scan.

        Everything from there to the end is scanned by the next ``catch_up``.
        """
        self.bytes.refresh()
        self.sync_chunks()
        if not self.chunks:
            return  # nothing was ever appended
        i = self.chunk_index(max(position, self.start_position))  # the end lies in the last chunk
        chunk = self.chunks[i]
        start = max(chunk.start, self.start_position)
        self.position, self._position_chunk = start, chunk.name
        # The first window the scan will read, read now: its header gives the next offset, and
        # the scan takes the bytes from here (one request on an object store, not two).
        header = self._header_prefetching(start, min(chunk.end, start + READ_WINDOW))
        self.next_offset = header.base_offset if header is not None else self._base_before(i)
        if start == chunk.start:
            chunk.builder = ChunkIndexBuilder(chunk.start, self.interval, next_offset=self.next_offset)

    def _base_before(self, i: int) -> int:
        """Record offset at the start of chunk ``i`` when it starts with garbage (rare)."""
        return self.summary(i - 1).next_offset if i > 0 else 0

    def _header_prefetching(self, start: int, end: int) -> BatchHeader | None:
        """The header of the batch at ``start``, read with the bytes up to ``end`` that the scan
        about to start there reads first: it takes them from here (one request, not two)."""
        end = self.bytes.readable_end(start, end)  # up to a hole, if one comes first
        try:
            buf = self.bytes.read(start, end - start) if end > start else b""
        except HoleError:  # replaced meanwhile: the scan reads afresh
            buf = b""
        self._prefetched = (start, end, buf) if buf else None
        return self._header_in(buf, start)

    def _take_prefetched(self, start: int, end: int) -> bytes | None:
        """The bytes ``[start, end)`` if ``open_at`` read exactly those (once: later reads are fresh)."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[:2] == (start, end):
            return prefetched[2]
        return None

    def header_at(self, position: int) -> BatchHeader | None:
        """The header of the batch at ``position`` (one small read), or None if none is valid there."""
        end = self.bytes.readable_end(position, min(self.bytes.length, position + BATCH_HEADER_SIZE))
        if position >= end:
            return None  # at the end, or in a hole
        try:
            buf = self.bytes.read(position, end - position)
        except HoleError:
            return None
        return self._header_in(buf, position)

    def _header_in(self, buf: bytes, position: int) -> BatchHeader | None:
        """The header of the batch at the start of ``buf`` (log byte ``position``), or None."""
        if not buf:
            return None
        try:
            return read_header(buf, 0, position=position, segment=self.segment, partial=True)
        except CorruptDataError:
            return None

    # -- reading batches -----------------------------------------------------------------------
    def batches(self, start: int, end: int, builder: ChunkIndexBuilder | None = None,
                 next_offset: int = 0, *, names: set[str] | None = None,
                 window: int = READ_WINDOW) -> Iterator[tuple[int, BatchHeader, bytes, int]]:
        """Verified batches in ``[start, end)``, stepping over holes and recorded gaps (else
        ``CorruptDataError``); ``LayoutChangedError`` if chunks other than ``names`` (default: this
        handle's view) turn up, replaced meanwhile.

        ``builder``/``next_offset`` let a rebuild account for gaps as record-less bytes.
        """
        if names is None:
            names = {c.name for c in self.chunks[self.chunk_index(start):self.chunk_index(max(start, end - 1)) + 1]}
        position, gaps = start, self.gap_markers.starts
        while position < end:
            for at, header, buf, pos in self._walk(position, end, names, window):
                if header is None or (at in gaps and self.gap_markers.in_force(at) is not None):
                    gap_end = self.gap_markers.end_at(at)
                    if gap_end is None:
                        raise self.corruption(at, buf)
                    if builder is not None:
                        builder.add(at - builder.chunk_start, min(gap_end, end) - at, next_offset, 0, MIN_TIMESTAMP)
                    position = gap_end
                    break
                yield at, header, buf, pos
                next_offset = header.next_offset
                position = at + header.size

    def plan_read(self, offset: int) -> list[tuple[int, int, str]]:
        """Byte ranges to scan for records from ``offset`` on, ``(start, end, chunk name)``: one per
        chunk, the first narrowed by its sparse index. Cheap; the scan itself (``read_planned``)
        needs no lock."""
        if offset >= self.next_offset:
            return []
        return self._in_current_view(lambda: self.reads.plan(offset))

    def batch_position(self, offset: int) -> int:
        """Byte position of the batch holding record ``offset`` (``position`` if it is past the end)."""
        if offset >= self.next_offset:
            return self.position
        return self._in_current_view(lambda: self.reads.batch_position(offset))

    @property
    def start_offset(self) -> int:
        """Record offset of the first readable record (``next_offset`` when none is left)."""
        return self._in_current_view(self.reads.start_offset)

    def offset_for_timestamp(self, timestamp: int) -> int | None:
        """The first record offset whose timestamp is ``>= timestamp``, or ``None`` if there is none."""
        if self.max_timestamp < timestamp:
            return None
        return self._in_current_view(lambda: self.reads.offset_for_timestamp(timestamp))

    # -- replacing chunks ----------------------------------------------------------------------
    def replace_range(self, start: int, end: int, data: bytes, *, expected: list[str] | None = None) -> None:
        """Replace the sealed log chunks covering exactly ``[start, end)`` by one chunk holding
        ``data``: whole record batches from ``start`` on, keeping their base offsets, each sealed
        for the byte it lands at (``place_batches(data, start)``); the bytes after them up to
        ``end`` become a hole that readers step over.

        ``data`` is checked first (whole batches valid where they land, offsets rising, within the
        range); then
        ``RollingSegment.replace_range`` switches atomically if the range still holds the chunks
        ``expected`` (the names the caller planned with; default: this handle's chunk list), else
        ``LayoutConflictError``: another handle replaced or truncated them first. The new chunk's
        index file is written and the old chunks' are deleted (best effort: derived data).
        """
        data = bytes(data)
        old = [c.name for c in self.chunks if start <= c.start < end] if expected is None else list(expected)
        if not 0 <= start < end or len(data) > end - start:
            raise InvalidInputError(f"segment {self.segment!r}: replace_range needs start < end and at most "
                                    f"end - start bytes; got [{start}, {end}) with {len(data)} bytes")
        i = self.chunk_index(start)
        base = self.summary(i).base_offset if self.chunks and self.chunks[i].start == start else 0
        summary = summarize_replacement(self.segment, start, end, data, base, self.interval)
        self.bytes.replace_range(start, end, data, expected=old or None)
        self.sync_chunks()
        new = self.chunks[self.chunk_index(start)]
        new.summary = summary
        if new.start == start and summary.batch_count > 1:
            self.index_files.store(summary, new.name)
        with contextlib.suppress(StorageError):
            self.storage.delete([self.index_files.path(name) for name in old])

    # -- retention -----------------------------------------------------------------------------
    def chunk_summaries(self) -> list[ChunkSummary]:
        """Summaries of the readable chunks, oldest first."""
        return self._in_current_view(self.reads.chunk_summaries)

    def truncate_at(self, position: int) -> None:
        """Make bytes below ``position`` (a batch start of this view) unreadable, deleting the
        chunks wholly below it with their index files and gap markers. ``LayoutConflictError``,
        nothing truncated, if another handle replaced the chunk holding it since this view."""
        derived = self.derived_below(position)
        holder = self.bytes.chunk_at(position)
        self.bytes.truncate(position, expected=holder.name if holder is not None else None)
        # durable from here: what follows is housekeeping
        self.forget_below(position)
        self.delete_derived(derived)

    # A truncation in three steps, so that its owner holds its lock only for the in-memory ones:
    # ``derived_below`` (lock held), ``bytes.truncate`` (thread-safe on its own: the durable
    # marker and the chunk deletions), ``forget_below`` (lock held), ``delete_derived``.
    def derived_below(self, position: int) -> list[str]:
        """The index files and gap markers that a truncation at ``position`` makes dead (named
        before it: the chunk list forgets the chunks once they are gone)."""
        doomed = [c.name for c in self.chunks if c.end <= position and c is not self.chunks[-1]]
        return [self.index_files.path(name) for name in doomed] + self.gap_markers.paths_below(position)

    def forget_below(self, position: int) -> None:
        """After the byte stream was truncated at ``position``: drop the gaps and chunks below it."""
        self.gap_markers.forget_below(position)
        self.sync_chunks()

    def delete_derived(self, paths: list[str]) -> None:
        """Delete derived files a truncation made dead (``derived_below``), best effort."""
        try:
            # Leftovers are harmless: index files of deleted chunks are never read, gaps below the
            # start are never reached; the next truncation deletes them.
            if paths:
                self.storage.delete(paths)
        except StorageError as exc:
            _log.warning("segment %r: deleting index files or gap markers after a truncation failed (left for "
                         "later): %s", self.segment, exc)

    def close(self) -> None:
        self.bytes.close()


__all__ = ["SegmentLog"]
