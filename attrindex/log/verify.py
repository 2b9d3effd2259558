"""Reading every committed byte of a segment log: what ``verify`` reports and ``repair`` cuts.

``scan_log`` walks every chunk batch by batch (header and payload checksums), steps over gaps
recorded by earlier repairs, finds where each damaged range ends (``DamagedRange``: what a repair
turns into a gap) and checks the chunk index files and gap markers. ``resume_offset`` finds the
record offset a log whose damaged tail was cut may continue from: above every offset the damaged
bytes could have held.
"""

from __future__ import annotations

import attrs

from storage_adapters.rolling import chunk_name

from ..damage import Damage
from ..errors import CorruptDataError
from .batch.decode import decode_attribute_updates
from .batch.header import BATCH_HEADER_SIZE, BATCH_MAGIC, BatchHeader, check_batch, claimed_size, read_header
from ..layout import GAP_DIR, INDEX_DIR, LOG_DIR
from .segment_log import SegmentLog
from .sparse_index import decode_chunk_index

#: Most records one stored byte can stand for: zstd's densest block (4 bytes -> 128 KiB) packs
#: fewer than 2**15 one-byte records per byte, and every record takes at least one payload byte.
RECORDS_PER_BYTE_BOUND = 1 << 17
#: Most bytes a last chunk cut short can have lost past its rolling size: one append that began
#: below it (a batch is at most 4 GiB; a group of batches past the first is at most a few MiB).
MAX_APPEND_BYTES = 1 << 33


@attrs.frozen
class DamagedRange:
    """Damaged log bytes with no valid batch among them, and the record offsets they could hold.

    ``pieces`` are the damaged byte ranges it is made of (each within one chunk; recorded gaps and
    replacement holes between them are not part of it). The records it held had offsets from
    ``first_offset`` (the next offset after the last valid batch before it; 0 if none) up to
    ``next_offset``, the base offset of the first valid batch after it, exclusive: offsets only
    grow along the log. ``next_offset`` is None when no valid batch follows: the log's damaged tail.
    """

    start: int
    end: int
    first_offset: int
    next_offset: int | None
    pieces: tuple[tuple[int, int], ...]


@attrs.frozen
class LogScan:
    """What ``scan_log`` found."""

    damage: list[Damage]  #: every damaged range of the log, its index files and gap markers
    batches: int  #: valid batches read
    records: int  #: records in them
    bytes: int  #: log bytes read
    gaps: int  #: recorded gaps stepped over
    index_files: int  #: chunk index files checked
    first_damage: int | None  #: log byte of the first damaged batch (None: none)
    offset_at_damage: int | None  #: the record offset the first damaged batch would have started at
    damaged: tuple[DamagedRange, ...] = ()  #: the damaged log ranges, in order
    next_offset: int | None = None  #: the next offset after the last valid batch (None: none was read)
    batches_after_damage: int = 0  #: valid batches read after the first damaged one


def _chunk_where(log: SegmentLog, start: int) -> str:
    return f"{log.segment}/{LOG_DIR} chunk {chunk_name(start)}"


def _whole_batch(buf: bytes, i: int, position: int) -> BatchHeader | None:
    """The header of a whole batch at ``buf[i]`` whose header and payload checksums hold, else None."""
    try:
        header = read_header(buf, i, position=position)
        if header is not None:
            check_batch(buf, i, header, position=position)
        return header
    except CorruptDataError:
        return None


def _frames_to(buf: bytes, i: int, position: int, stops: set[int], floor: int) -> bool:
    """Whether batch headers whose own checksums hold (for the log byte each lies at: ``buf[0]``
    is log byte ``position``), with offsets that never go back (from ``floor``), lead from
    ``buf[i]`` exactly to the end of ``buf`` or to a position in ``stops``."""
    while i < len(buf) and i not in stops:  # bounded: i moves forward by a header's size (> 0)
        try:
            header = read_header(buf, i, position=position, partial=True)
        except CorruptDataError:
            return False
        if header is None or i + header.size > len(buf) or header.base_offset < floor:
            return False
        floor, i = header.next_offset, i + header.size
    return True


def _resync(buf: bytes, pos: int, position: int, stops: set[int], floor: int) -> int:
    """Where in ``buf`` valid batches start again after damage at ``pos`` whose extent is unknown
    (its header fails its checksum): the first whole valid batch whose offsets do not go back and
    from which batch headers frame the rest of the chunk exactly (to its end, or to a recorded gap
    in ``stops``), and that does not lie inside the size the damaged header still claims. Bytes
    inside the damaged batch that look like a batch (a record holding an encoded batch) are thus
    not taken for one: a frame from them runs into the rest of the damaged batch, or, if they end
    where it ends, they lie inside its claimed size (unless that very field was damaged too).
    ``len(buf)`` (or the first stop) if there is none: the rest of the chunk is damaged."""
    limit = min([len(buf)] + [s for s in stops if s > pos])
    claimed = claimed_size(buf, pos)
    first = pos + claimed if claimed is not None and BATCH_HEADER_SIZE <= claimed <= limit - pos else pos + 1
    i = buf.find(BATCH_MAGIC, first, limit)
    while i != -1:  # bounded: every lap moves i forward
        header = _whole_batch(buf, i, position)
        if header is not None and header.base_offset >= floor and _frames_to(buf, i, position, stops, floor):
            return i
        i = buf.find(BATCH_MAGIC, i + 1, limit)
    return limit


class _Ranges:
    """Builds ``DamagedRange``s: consecutive damaged pieces with no valid batch between them are one."""

    def __init__(self) -> None:
        self.done: list[DamagedRange] = []
        self.open: DamagedRange | None = None

    def damaged(self, start: int, end: int, first_offset: int) -> None:
        if self.open is None:
            self.open = DamagedRange(start, end, first_offset, None, ((start, end),))
        else:
            self.open = attrs.evolve(self.open, end=end, pieces=self.open.pieces + ((start, end),))

    def valid(self, base_offset: int) -> None:
        if self.open is not None:
            self.done.append(attrs.evolve(self.open, next_offset=base_offset))
            self.open = None

    def all(self) -> tuple[DamagedRange, ...]:
        return tuple(self.done + ([self.open] if self.open is not None else []))


def scan_log(log: SegmentLog) -> LogScan:
    """Read every committed byte of ``log`` and report each damaged range.

    A damaged batch whose header checksum holds spans exactly the size its header gives (and its
    offsets are known); one whose header is damaged spans up to the next batch found by
    ``_resync``, or the chunk's end. Chunk starts are batch boundaries (no batch spans chunks).
    """
    log.bytes.refresh()
    gaps = log.gaps()
    damage: list[Damage] = []
    ranges = _Ranges()
    position = start = log.start_position  # past a truncation settled inside a replaced chunk
    next_offset = None
    first_damage = offset_at_damage = None
    batches = records = read = used_gaps = after_damage = 0

    def damaged(at: int, end: int, reason: str, chunk_start: int) -> None:
        nonlocal first_damage, offset_at_damage
        damage.append(Damage(_chunk_where(log, chunk_start), at, end, reason))
        ranges.damaged(at, end, next_offset if next_offset is not None else 0)
        if first_damage is None:
            first_damage, offset_at_damage = at, next_offset if next_offset is not None else 0

    for chunk in log.bytes.chunks():
        if position >= chunk.end:
            continue
        low = max(chunk.start, start)
        try:  # a replacement chunk's hole (after its stored bytes) holds nothing to check
            buf = log.bytes.read(low, max(low, min(chunk.end, chunk.stored_end)) - low)
        except CorruptDataError as exc:  # the storage itself says the chunk is damaged (short, say)
            damaged(position, chunk.end, str(exc), chunk.start)
            position = chunk.end
            continue
        read += len(buf)
        stops = {g - low for g in gaps if low < g < low + len(buf)}
        pos = position - low
        while pos < len(buf):  # bounded: every lap moves pos forward
            at = low + pos
            if at in gaps:  # cut off by a repair, valid or not
                used_gaps += 1
                pos = gaps[at] - low
                continue
            header = None
            try:
                header = read_header(buf, pos, position=low, segment=log.segment, partial=True)
                if header is None or pos + header.size > len(buf):
                    header = None  # its size runs past the chunk: the header cannot be trusted
                    raise CorruptDataError(f"a batch runs past byte {chunk.end}, the end of its chunk")
                check_batch(buf, pos, header, position=low, segment=log.segment)
                # decodes the updates and length-checks every record column (decompressing)
                decode_attribute_updates(buf, pos, header, position=low, segment=log.segment, verify=False)
                if next_offset is not None and header.base_offset < next_offset:
                    raise CorruptDataError(f"base offset {header.base_offset} is below the previous batch's "
                                           f"next offset {next_offset}")
            except CorruptDataError as exc:
                floor = next_offset if next_offset is not None else 0
                # Its header's own checksum holds: exactly this batch is damaged; else find where batches resume.
                end = pos + header.size if header is not None else _resync(buf, pos, low, stops, floor)
                damaged(at, low + end, str(exc), chunk.start)
                if header is not None and header.base_offset >= floor:
                    next_offset = header.next_offset  # the offsets the damaged batch held
                pos = end
                continue
            ranges.valid(header.base_offset)
            if first_damage is not None:
                after_damage += 1
            batches, records = batches + 1, records + header.record_count
            next_offset = header.next_offset
            pos += header.size
        position = low + pos if chunk.stored_end > low + pos else chunk.end
    damage += _check_gaps(log, gaps)
    index_damage, index_files = _check_index_files(log)
    return LogScan(damage + index_damage, batches, records, read, used_gaps, index_files, first_damage,
                   offset_at_damage, ranges.all(), next_offset, after_damage)


def _check_gaps(log: SegmentLog, gaps: dict[int, int]) -> list[Damage]:
    length = log.bytes.length
    return [Damage(f"{log.segment}/{GAP_DIR}/{chunk_name(s)}-{chunk_name(e)}", s, e,
                   f"gap marker reaches past the log's committed length {length}")
            for s, e in sorted(gaps.items()) if e > length]


def _check_index_files(log: SegmentLog) -> tuple[list[Damage], int]:
    """Decode every chunk index file of a stored chunk and check it covers the chunk exactly."""
    chunks = {c.name: c for c in log.bytes.chunks()[:-1] if c.start >= log.bytes.start_offset}
    sizes = {name: c.length for name, c in chunks.items()}
    damage, checked = [], 0
    for name in log.storage.list_files(f"{log.segment}/{INDEX_DIR}"):
        if name not in sizes:
            continue  # not a stored sealed chunk's: left behind by a retention or a switch, ignored on read
        start, path = chunks[name].start, f"{log.segment}/{INDEX_DIR}/{name}"
        checked += 1
        try:
            data = log.storage.read(path, 0, 1 << 30)
        except FileNotFoundError:
            continue  # deleted meanwhile (derived data)
        try:
            summary = decode_chunk_index(data, chunk_start=start, segment=log.segment)
            if summary.size != sizes[name]:
                raise CorruptDataError(f"covers {summary.size} bytes, the chunk holds {sizes[name]}")
        except CorruptDataError as exc:
            damage.append(Damage(path, 0, len(data), f"{exc} (derived data: rebuilt from the chunk)"))
    return damage, checked


def resume_offset(log: SegmentLog, start: int, first_lost: int) -> tuple[int, bool]:
    """The record offset a log cut at byte ``start`` resumes from, and whether it is exact.

    Every header in ``[start, length)`` whose own checksum holds tells its batch's offsets; the
    highest next offset among them bounds every record before it. Bytes after the last such batch
    may hold batches nobody can read: they are bounded by ``RECORDS_PER_BYTE_BOUND`` records per
    byte, and the result is then an upper bound, not exact. So is the result when the last chunk
    was cut short (``RollingSegment.cut_short``): the bytes cut off count as unknown up to the
    most the chunk could have held (its rolling size and one append after it).
    """
    best, covered = first_lost, start
    for chunk in log.bytes.chunks():
        if chunk.end <= start:
            continue
        low = max(chunk.start, start)
        try:
            buf = log.bytes.read(low, max(low, min(chunk.end, chunk.stored_end)) - low)
        except CorruptDataError:
            continue  # unreadable: its bytes stay unknown (bounded below)
        i = buf.find(BATCH_MAGIC)
        while i != -1 and len(buf) - i >= BATCH_HEADER_SIZE:  # bounded: i moves forward
            try:
                header = read_header(buf, i, position=low, partial=True)
            except CorruptDataError:
                header = None
            if header is not None:
                best = max(best, header.next_offset)
                covered = max(covered, min(low + i + header.size, chunk.end))
                if low + i + header.size >= chunk.stored_end:
                    covered = max(covered, chunk.end)  # the hole after a replacement's bytes holds nothing
            i = buf.find(BATCH_MAGIC, i + 1)
    unknown = log.bytes.length - covered
    if log.bytes.cut_short():
        last = log.bytes.chunks()[-1]
        unknown += max(log.bytes.rolling_size - last.length, 0) + MAX_APPEND_BYTES
    if unknown <= 0:
        return best, True
    return best + unknown * RECORDS_PER_BYTE_BOUND, False


__all__ = ["DamagedRange", "LogScan", "RECORDS_PER_BYTE_BOUND", "resume_offset", "scan_log"]
