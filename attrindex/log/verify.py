"""Reading every committed byte of a segment log: what ``verify`` reports and ``repair`` cuts.

``scan_log`` walks every chunk batch by batch (header and payload checksums), steps over gaps
recorded by earlier repairs, resynchronises after damage at the next valid batch, and checks the
chunk index files and gap markers. ``resume_offset`` finds the record offset a repaired log may
continue from: above every offset the damaged bytes could have held.
"""

from __future__ import annotations

import attrs

from storage_adapters.rolling import chunk_name

from ..damage import Damage
from ..errors import CorruptDataError
from .batch import BATCH_HEADER_SIZE, BATCH_MAGIC, check_batch, decode_attribute_updates, read_header
from .segment_log import GAP_DIR, INDEX_DIR, LOG_DIR, SegmentLog
from .sparse_index import decode_chunk_index

#: Most records one stored byte can stand for: zstd's densest block (4 bytes -> 128 KiB) packs
#: fewer than 2**15 one-byte records per byte, and every record takes at least one payload byte.
RECORDS_PER_BYTE_BOUND = 1 << 17


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


def _chunk_where(log: SegmentLog, start: int) -> str:
    return f"{log.segment}/{LOG_DIR} chunk {chunk_name(start)}"


def _next_valid(buf: bytes, pos: int, position: int) -> int:
    """Position in ``buf`` of the next whole valid batch after ``pos`` (``len(buf)`` if none)."""
    i = buf.find(BATCH_MAGIC, pos + 1)
    while i != -1:  # bounded: every lap moves i forward
        try:
            header = read_header(buf, i, position=position)
            if header is not None:
                check_batch(buf, i, header, position=position)
                return i
        except CorruptDataError:
            pass
        i = buf.find(BATCH_MAGIC, i + 1)
    return len(buf)


def scan_log(log: SegmentLog) -> LogScan:
    """Read every committed byte of ``log`` and report each damaged range."""
    log.bytes.refresh()
    gaps = log.gaps()
    damage: list[Damage] = []
    position = start = log.bytes.start_offset
    next_offset = None
    first_damage = offset_at_damage = None
    batches = records = read = used_gaps = 0
    for chunk in log.bytes.chunks():
        if position >= chunk.end:
            continue
        low = max(chunk.start, start)
        try:  # a replacement chunk's hole (after its stored bytes) holds nothing to check
            buf = log.bytes.read(low, max(low, min(chunk.end, chunk.stored_end)) - low)
        except CorruptDataError as exc:  # the storage itself says the chunk is damaged (short, say)
            damage.append(Damage(_chunk_where(log, chunk.start), position, chunk.end, str(exc)))
            if first_damage is None:
                first_damage, offset_at_damage = position, next_offset if next_offset is not None else 0
            position = chunk.end
            continue
        read += len(buf)
        pos = position - low
        while pos < len(buf):  # bounded: every lap moves pos forward
            at = low + pos
            if at in gaps:  # cut off by a repair, valid or not
                used_gaps += 1
                pos = gaps[at] - low
                continue
            try:
                header = read_header(buf, pos, position=low, segment=log.segment)
                if header is None:
                    raise CorruptDataError(f"a batch runs past byte {chunk.end}, the end of its chunk")
                check_batch(buf, pos, header, position=low, segment=log.segment)
                # decodes the updates and length-checks every record column (decompressing)
                decode_attribute_updates(buf, pos, header, position=low, segment=log.segment, verify=False)
                if next_offset is not None and header.base_offset < next_offset:
                    raise CorruptDataError(f"base offset {header.base_offset} is below the previous batch's "
                                           f"next offset {next_offset}")
            except CorruptDataError as exc:
                end = min([_next_valid(buf, pos, low)] + [g - low for g in gaps if at < g < low + len(buf)])
                damage.append(Damage(_chunk_where(log, chunk.start), at, low + end, str(exc)))
                if first_damage is None:
                    first_damage, offset_at_damage = at, next_offset if next_offset is not None else 0
                pos = end
                continue
            if next_offset is None and first_damage is None:
                next_offset = header.base_offset
            batches, records = batches + 1, records + header.record_count
            next_offset = header.next_offset
            pos += header.size
        position = low + pos if chunk.stored_end > low + pos else chunk.end
    damage += _check_gaps(log, gaps)
    index_damage, index_files = _check_index_files(log)
    return LogScan(damage + index_damage, batches, records, read, used_gaps, index_files, first_damage,
                   offset_at_damage)


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
    byte, and the result is then an upper bound, not exact.
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
    if unknown <= 0:
        return best, True
    return best + unknown * RECORDS_PER_BYTE_BOUND, False


__all__ = ["LogScan", "RECORDS_PER_BYTE_BOUND", "resume_offset", "scan_log"]
