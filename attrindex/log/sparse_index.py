"""Sparse offset and time indexes of one log chunk, the builder that makes them, and their file.

Like Kafka's segment indexes, they are sparse: an entry is added only after more than
``interval_bytes`` of batches since the previous one, so a lookup gives a place to *start scanning*
from, never the exact batch. Everything here is in memory; the caller does the I/O.

Two invariants make every lookup safe (the scan from the returned position never misses its target):

* Offset entry ``(O, P)``: every batch holding a record with offset ``>= O``, and every batch whose
  base offset is ``>= O`` (record-less batches included), lies at or after relative position ``P``.
* Time entry ``(T, O)`` (Kafka's meaning): ``T`` is the largest timestamp seen up to the moment the
  entry was written and ``O`` the base offset of the first batch that reached it, so every record
  before offset ``O`` has a timestamp ``< T``.

File layout of an encoded chunk index (little-endian; 100 + 16·(n + m) bytes)::

    0    8  magic b"AIXCKIDX"
    8    u16 format version (1)
    10   u16 reserved, 0
    12   u32 index interval in bytes
    16   u64 chunk start (byte position of the chunk in the log)
    24   u64 size (bytes of whole batches covered)
    32   u64 records end (end of the last batch holding records; 0 if none)
    40   i64 base offset
    48   i64 next offset
    56   i64 first timestamp         (-2**63 if no records)
    64   i64 max timestamp           (-2**63 if no records)
    72   i64 offset of max timestamp (base offset of the first batch reaching it; -1 if no records)
    80   u64 batch count
    88   u32 offset entry count n
    92   u32 time entry count m
    96   n x (i64 record offset, u64 relative byte position)
         m x (i64 timestamp, i64 record offset)
    end  u32 CRC-32 of every byte before it
"""

from __future__ import annotations

import operator
import struct
import zlib
from bisect import bisect_left, bisect_right
from itertools import islice

import attrs

from attrindex.errors import CorruptDataError, InvalidInputError

ENTRY_SIZE = 16  #: bytes of one entry in either index (two 64-bit fields)
WARM_ENTRIES = 8192 // ENTRY_SIZE  #: Kafka's warm section: the entries of the index's last 8 KiB
DEFAULT_MAX_ENTRIES = 1 << 20
DEFAULT_INTERVAL_BYTES = 4096
NO_TIMESTAMP = -1  #: timestamp part of ``TimeIndex.lookup`` when no entry applies (Kafka's value)
MIN_TIMESTAMP = -(1 << 63)  #: ``ChunkSummary.max_timestamp`` of a chunk without records
_I64_MAX = (1 << 63) - 1
_U32_MAX = (1 << 32) - 1

MAGIC = b"AIXCKIDX"
VERSION = 1
_HEADER = struct.Struct("<8sHHIQQQqqqqqQII")
HEADER_SIZE = _HEADER.size  # 96
_CRC = struct.Struct("<I")


class InvalidIndexEntryError(InvalidInputError):
    """An index entry or a batch out of order: not after the previous one, or below the base offset."""


class IndexFullError(InvalidInputError):
    """An index already holds its ``max_entries`` entries."""


class CorruptIndexError(CorruptDataError):
    """An encoded chunk index failed verification; rebuild it from the chunk's data.

    ``offset`` is the start of the chunk the index describes.
    """


def _floor_slot(keys: list[int], target: int) -> int:
    """Slot of the largest key ``<= target`` in ascending ``keys``; -1 if there is none.

    Kafka's warm-section search: lookups mostly target recent entries, so when the target is in the
    last ``WARM_ENTRIES`` entries only those are searched (in Kafka, the pages likely in cache).
    The answer is the same as a bisection of the whole list.
    """
    n = len(keys)
    if not n:
        return -1
    first_warm = max(0, n - 1 - WARM_ENTRIES)
    if target >= keys[first_warm]:
        return bisect_right(keys, target, first_warm, n) - 1
    # keys[first_warm] > target, so the floor lies strictly before it.
    return bisect_right(keys, target, 0, first_warm) - 1


def _check_base_and_size(base_offset: int, max_entries: int) -> None:
    if not 0 <= base_offset <= _I64_MAX:
        raise InvalidInputError(f"base offset must be in [0, 2**63), got {base_offset!r}")
    if max_entries < 0:
        raise InvalidInputError(f"max_entries must be >= 0, got {max_entries!r}")


class _SparseIndex:
    """A sparse index as two parallel columns: sorted keys (what lookups floor on) and values.

    Subclasses name the columns; both share search, copying, equality and truncation.
    """

    __slots__ = ("_base_offset", "max_entries", "_keys", "_values")

    def __init__(self, base_offset: int, max_entries: int = DEFAULT_MAX_ENTRIES):
        _check_base_and_size(base_offset, max_entries)
        self._base_offset = base_offset
        self.max_entries = max_entries
        self._keys: list[int] = []
        self._values: list[int] = []

    @property
    def base_offset(self) -> int:
        """Record offset of the chunk's first batch: the fallback of every lookup."""
        return self._base_offset

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def is_full(self) -> bool:
        return len(self._keys) >= self.max_entries

    @property
    def entries(self) -> list[tuple[int, int]]:
        """The entries as pairs, in ascending order (a copy)."""
        return list(zip(self._keys, self._values))

    def entry(self, n: int) -> tuple[int, int]:
        """The ``n``-th entry."""
        return self._keys[n], self._values[n]

    def _truncate(self, offsets: list[int], offset: int) -> None:
        """Drop every entry whose offset (in column ``offsets``) is ``>= offset``."""
        slot = bisect_left(offsets, offset)
        del self._keys[slot:], self._values[slot:]

    def copy(self):
        clone = type(self)(self._base_offset, self.max_entries)
        clone._keys, clone._values = self._keys.copy(), self._values.copy()
        return clone

    def __eq__(self, other: object) -> bool:
        # Capacity is not content: a decoded index equals the one that was encoded.
        if type(other) is not type(self):
            return NotImplemented
        return (self._base_offset, self._keys, self._values) == (other._base_offset, other._keys, other._values)

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_offset={self._base_offset}, entries={len(self._keys)})"


class OffsetIndex(_SparseIndex):
    """Sparse map record offset -> byte position relative to the chunk start.

    Offsets ascend strictly, positions never decrease. ``lookup`` floors; with no entry at or below
    the target it falls back to ``(base_offset, 0)``, the chunk's start.
    """

    __slots__ = ()

    @property
    def last_offset(self) -> int:
        """Offset of the last entry (``base_offset`` if empty)."""
        return self._keys[-1] if self._keys else self._base_offset

    @property
    def last_position(self) -> int:
        """Position of the last entry (0 if empty)."""
        return self._values[-1] if self._values else 0

    @property
    def offsets(self) -> tuple[int, ...]:
        """Entry offsets, ascending (a copy)."""
        return tuple(self._keys)

    @property
    def positions(self) -> tuple[int, ...]:
        """Entry positions, in entry order (a copy)."""
        return tuple(self._values)

    def append(self, offset: int, position: int) -> None:
        """Add an entry after the last one.

        ``IndexFullError`` if full; ``InvalidIndexEntryError`` if ``offset`` is not above the last
        entry's (or is below ``base_offset``) or ``position`` is below the last entry's.
        """
        if self.is_full:
            raise IndexFullError(f"offset index is full ({len(self._keys)} entries)")
        if self._keys and offset <= self._keys[-1]:
            raise InvalidIndexEntryError(
                f"offset {offset} is not above the last index entry's offset {self._keys[-1]}")
        if not self._base_offset <= offset <= _I64_MAX:
            raise InvalidIndexEntryError(f"offset {offset} is outside [base offset {self._base_offset}, 2**63)")
        if not self.last_position <= position <= _I64_MAX:
            raise InvalidIndexEntryError(
                f"position {position} is below the last index entry's position {self.last_position} "
                f"or not a 63-bit value")
        self._keys.append(offset)
        self._values.append(position)

    def lookup(self, offset: int) -> tuple[int, int]:
        """The entry with the largest offset ``<= offset``, or ``(base_offset, 0)`` if none."""
        slot = _floor_slot(self._keys, offset)
        if slot < 0:
            return self._base_offset, 0
        return self._keys[slot], self._values[slot]

    def truncate_to(self, offset: int) -> None:
        """Drop every entry whose offset is ``>= offset`` (Kafka's ``truncateTo``)."""
        self._truncate(self._keys, offset)


class TimeIndex(_SparseIndex):
    """Sparse map timestamp -> record offset, with Kafka's meaning.

    Entry ``(T, O)``: ``T`` is the largest timestamp seen so far when the entry was written and
    ``O`` the base offset of the first batch that reached it; every record before offset ``O`` has
    a timestamp ``< T``. Timestamps ascend strictly, offsets never decrease.
    """

    __slots__ = ()

    @property
    def last_entry(self) -> tuple[int, int]:
        """The last ``(timestamp, offset)``, or ``(NO_TIMESTAMP, base_offset)`` if empty."""
        if not self._keys:
            return NO_TIMESTAMP, self._base_offset
        return self._keys[-1], self._values[-1]

    @property
    def timestamps(self) -> tuple[int, ...]:
        return tuple(self._keys)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(self._values)

    def maybe_append(self, timestamp: int, offset: int) -> None:
        """Add ``(timestamp, offset)`` if ``timestamp`` is above the last entry's; else do nothing.

        An empty index takes any timestamp (unlike Kafka, negative timestamps are valid here).
        ``InvalidIndexEntryError`` if ``offset`` is below the last entry's or ``base_offset``, or if
        ``timestamp`` is below the last entry's (a max-so-far never decreases: a caller bug).
        ``IndexFullError`` only when an entry would be written to a full index.
        """
        if not MIN_TIMESTAMP <= timestamp <= _I64_MAX:
            raise InvalidIndexEntryError(f"timestamp {timestamp} is not a 64-bit value")
        if not self._base_offset <= offset <= _I64_MAX:
            raise InvalidIndexEntryError(f"offset {offset} is outside [base offset {self._base_offset}, 2**63)")
        if self._keys:
            if offset < self._values[-1]:
                raise InvalidIndexEntryError(
                    f"offset {offset} is below the last time index entry's offset {self._values[-1]}")
            if timestamp < self._keys[-1]:
                raise InvalidIndexEntryError(
                    f"timestamp {timestamp} is below the last time index entry's {self._keys[-1]}")
            if timestamp == self._keys[-1]:
                return  # same maximum: the entry already names the first batch that reached it
        if self.is_full:
            raise IndexFullError(f"time index is full ({len(self._keys)} entries)")
        self._keys.append(timestamp)
        self._values.append(offset)

    def lookup(self, timestamp: int) -> tuple[int, int]:
        """Where to start looking for the first record with a timestamp ``>= timestamp``.

        The entry with the largest entry timestamp ``<= timestamp``; ``(NO_TIMESTAMP, base_offset)``
        if the index is empty or ``timestamp`` is below its first entry. Safe: by the entry
        invariant, no record before the returned offset has a timestamp ``>= timestamp``.
        """
        slot = _floor_slot(self._keys, timestamp)
        if slot < 0:
            return NO_TIMESTAMP, self._base_offset
        return self._keys[slot], self._values[slot]

    def truncate_to(self, offset: int) -> None:
        """Drop every entry whose offset is ``>= offset`` (Kafka's ``truncateTo``)."""
        self._truncate(self._values, offset)


@attrs.frozen
class ChunkSummary:
    """What a chunk holds, and its sparse indexes; made by ``ChunkIndexBuilder``.

    Positions are relative to the chunk start. The indexes belong to the summary: treat them as
    read-only (the builder copies before writing to indexes it has handed out).
    """

    chunk_start: int  #: byte position of the chunk in the log
    size: int  #: bytes of whole valid batches covered, from the chunk start
    base_offset: int  #: base offset of the first batch (of a record-less one too)
    next_offset: int  #: record offset after the last record (the base offset if there are none)
    first_timestamp: int  #: max timestamp of the first batch holding records; MIN_TIMESTAMP if none
    max_timestamp: int  #: largest timestamp of any record; MIN_TIMESTAMP if none
    batch_count: int
    offset_index: OffsetIndex
    time_index: TimeIndex
    interval_bytes: int
    max_timestamp_offset: int  #: base offset of the first batch reaching max_timestamp; -1 if none
    records_end: int  #: end of the last batch holding records (0 if none): where a tail of record-less batches starts

    def locate(self, offset: int) -> int:
        """Relative byte position to start scanning from for record ``offset``.

        Every batch holding a record ``>= offset``, and every batch whose base offset is
        ``>= offset`` (record-less ones included), lies at or after it. Past the last record that is
        ``records_end``; below the base offset, 0.
        """
        if offset >= self.next_offset:
            return self.records_end
        return self.offset_index.lookup(offset)[1]

    def locate_time(self, timestamp: int) -> int:
        """Relative byte position to start scanning for the first record with a timestamp ``>= timestamp``.

        No batch before it holds such a record. If no record in the chunk qualifies:
        ``records_end``.
        """
        if timestamp > self.max_timestamp:
            return self.records_end
        return self.offset_index.lookup(self.time_index.lookup(timestamp)[1])[1]


class ChunkIndexBuilder:
    """Feeds on the batches of one chunk in order and builds its summary and sparse indexes.

    Kafka's rule: when a batch starts more than ``interval_bytes`` after the last offset entry's
    position, write an offset entry for it and a time entry (max timestamp so far, including this
    batch -> base offset of the first batch that reached it). The first batch is never indexed: the
    fallback ``(base_offset, 0)`` covers it.

    Record-less batches (attribute-only) never trigger entries, and an entry for a batch with
    records points at the start of the run of record-less batches just before it (``records_end``),
    not at the batch itself: those batches carry base offsets up to the indexed batch's (the log's
    next offset when they were written), so a reader starting at that offset must see them.
    """

    def __init__(self, chunk_start: int, interval_bytes: int = DEFAULT_INTERVAL_BYTES, *, next_offset: int = 0,
                 max_entries: int = DEFAULT_MAX_ENTRIES):
        """``next_offset``: the record offset the chunk continues from (the previous chunk's
        ``next_offset``); batches may not start below it. Reported as base and next offset while
        the chunk has no batches."""
        if not 0 <= chunk_start <= _I64_MAX:
            raise InvalidInputError(f"chunk start must be in [0, 2**63), got {chunk_start!r}")
        if not 0 <= interval_bytes <= _U32_MAX:
            raise InvalidInputError(f"interval_bytes must be in [0, 2**32), got {interval_bytes!r}")
        self._chunk_start = chunk_start
        self._interval = interval_bytes
        self._max_entries = max_entries
        self._size = 0
        self._records_end = 0
        self._batch_count = 0
        self._base_offset = next_offset
        self._next_offset = next_offset
        self._first_timestamp = MIN_TIMESTAMP
        self._max_timestamp = MIN_TIMESTAMP
        self._max_timestamp_offset = -1
        self._offset_index = OffsetIndex(next_offset, max_entries)
        self._time_index = TimeIndex(next_offset, max_entries)
        self._shared = False  # indexes handed out in a summary: copy before writing

    @classmethod
    def resume(cls, summary: ChunkSummary, *, max_entries: int | None = None) -> ChunkIndexBuilder:
        """A builder that continues ``summary`` (a chunk that keeps growing)."""
        problem = _problem(summary)
        if problem:
            raise InvalidInputError(f"cannot resume from an inconsistent chunk summary: {problem}")
        if max_entries is None:
            max_entries = summary.offset_index.max_entries
        builder = cls(summary.chunk_start, summary.interval_bytes, next_offset=summary.base_offset,
                      max_entries=max_entries)
        builder._size = summary.size
        builder._records_end = summary.records_end
        builder._batch_count = summary.batch_count
        builder._next_offset = summary.next_offset
        builder._first_timestamp = summary.first_timestamp
        builder._max_timestamp = summary.max_timestamp
        builder._max_timestamp_offset = summary.max_timestamp_offset
        builder._offset_index, builder._time_index = summary.offset_index, summary.time_index
        builder._shared = True
        if max_entries != summary.offset_index.max_entries:
            builder._own_indexes()
        return builder

    @property
    def chunk_start(self) -> int:
        return self._chunk_start

    @property
    def interval_bytes(self) -> int:
        return self._interval

    @property
    def size(self) -> int:
        """Bytes covered so far: the position the next batch must start at."""
        return self._size

    @property
    def next_offset(self) -> int:
        return self._next_offset

    @property
    def batch_count(self) -> int:
        return self._batch_count

    def _own_indexes(self) -> None:
        if self._shared:
            self._offset_index = self._offset_index.copy()
            self._time_index = self._time_index.copy()
            self._offset_index.max_entries = self._time_index.max_entries = self._max_entries
            self._shared = False

    def add(self, position: int, size: int, base_offset: int, record_count: int, max_timestamp: int) -> None:
        """Account the next batch of the chunk.

        ``position`` is relative to the chunk start and must equal ``size`` so far, and
        ``base_offset`` must be at least ``next_offset`` (``InvalidIndexEntryError`` otherwise).
        ``max_timestamp`` of a record-less batch is ignored. When an index is full, entries stop
        being added (lookups stay safe, scans get longer).
        """
        if position != self._size:
            raise InvalidIndexEntryError(
                f"batch at relative position {position}, but the chunk's batches so far cover {self._size} bytes")
        if not 0 < size <= _I64_MAX - position:
            raise InvalidInputError(f"batch size must be positive, got {size!r}")
        if record_count < 0:
            raise InvalidInputError(f"record count must be >= 0, got {record_count!r}")
        if base_offset < self._next_offset:
            raise InvalidIndexEntryError(
                f"batch base offset {base_offset} is below the chunk's next offset {self._next_offset}")
        if base_offset + record_count > _I64_MAX:
            raise InvalidInputError(f"batch offsets {base_offset} + {record_count} overflow 63 bits")
        if self._batch_count == 0 and base_offset != self._base_offset:
            # The chunk's base offset is its first batch's; the indexes are still empty.
            self._base_offset = base_offset
            self._offset_index = OffsetIndex(base_offset, self._max_entries)
            self._time_index = TimeIndex(base_offset, self._max_entries)
            self._shared = False
        if record_count:
            if not MIN_TIMESTAMP <= max_timestamp <= _I64_MAX:
                raise InvalidInputError(f"max timestamp {max_timestamp!r} is not a 64-bit value")
            # Kafka updates the max before deciding on the entry, so the entry includes this batch.
            if self._records_end == 0:
                self._first_timestamp = self._max_timestamp = max_timestamp
                self._max_timestamp_offset = base_offset
            elif max_timestamp > self._max_timestamp:
                self._max_timestamp, self._max_timestamp_offset = max_timestamp, base_offset
            # records_end == 0: nothing before this batch holds records, the fallback covers it.
            if (self._records_end and position - self._offset_index.last_position > self._interval
                    and not self._offset_index.is_full):
                self._own_indexes()
                self._offset_index.append(base_offset, self._records_end)
                if not self._time_index.is_full:
                    self._time_index.maybe_append(self._max_timestamp, self._max_timestamp_offset)
            self._records_end = position + size
            self._next_offset = base_offset + record_count
        else:
            # A record-less batch's base offset is the log's next offset when it was written.
            self._next_offset = base_offset
        self._size = position + size
        self._batch_count += 1

    def summary(self) -> ChunkSummary:
        """A snapshot of the chunk so far; later ``add`` calls do not change it."""
        self._shared = True
        return ChunkSummary(
            chunk_start=self._chunk_start,
            size=self._size,
            base_offset=self._base_offset,
            next_offset=self._next_offset,
            first_timestamp=self._first_timestamp,
            max_timestamp=self._max_timestamp,
            batch_count=self._batch_count,
            offset_index=self._offset_index,
            time_index=self._time_index,
            interval_bytes=self._interval,
            max_timestamp_offset=self._max_timestamp_offset,
            records_end=self._records_end,
        )


def _ascending(values: list[int], strictly: bool) -> bool:
    compare = operator.lt if strictly else operator.le
    return all(map(compare, values, islice(values, 1, None)))


def _problem(s: ChunkSummary) -> str | None:
    """What makes ``s`` inconsistent (Kafka's sanity check and more), or ``None``."""
    if not isinstance(s.offset_index, OffsetIndex) or not isinstance(s.time_index, TimeIndex):
        return "indexes of the wrong type"
    for name in ("chunk_start", "size", "records_end", "base_offset", "next_offset", "batch_count"):
        if not 0 <= getattr(s, name) <= _I64_MAX:
            return f"{name} {getattr(s, name)} is not in [0, 2**63)"
    for name in ("first_timestamp", "max_timestamp", "max_timestamp_offset"):
        if not MIN_TIMESTAMP <= getattr(s, name) <= _I64_MAX:
            return f"{name} {getattr(s, name)} is not a 64-bit value"
    if not 0 <= s.interval_bytes <= _U32_MAX:
        return f"interval_bytes {s.interval_bytes} is not a 32-bit value"
    if s.records_end > s.size:
        return f"records end {s.records_end} is beyond size {s.size}"
    if s.batch_count > s.size or (s.batch_count == 0) != (s.size == 0):
        return f"{s.batch_count} batches cannot cover {s.size} bytes"
    if s.base_offset > s.next_offset:
        return f"base offset {s.base_offset} is above next offset {s.next_offset}"
    if s.records_end:
        if s.first_timestamp > s.max_timestamp:
            return f"first timestamp {s.first_timestamp} is above max timestamp {s.max_timestamp}"
        if not s.base_offset <= s.max_timestamp_offset < s.next_offset:
            return f"offset of max timestamp {s.max_timestamp_offset} is outside the chunk's records"
    elif (s.first_timestamp, s.max_timestamp, s.max_timestamp_offset) != (MIN_TIMESTAMP, MIN_TIMESTAMP, -1):
        return "timestamps recorded for a chunk without records"
    oi, ti = s.offset_index, s.time_index
    if oi.base_offset != s.base_offset or ti.base_offset != s.base_offset:
        return "index base offsets differ from the chunk's"
    offsets, positions = oi._keys, oi._values
    if len(offsets) > _U32_MAX or len(ti) > _U32_MAX:
        return "too many index entries"
    if offsets:
        if not _ascending(offsets, True) or not _ascending(positions, False):
            return "offset index entries are not ascending"
        if offsets[0] < s.base_offset or offsets[-1] >= s.next_offset:
            return "offset index entry outside the chunk's records"
        # An entry must point at or before the batch holding its offset, so before records_end.
        if positions[0] < 0 or positions[-1] >= s.records_end:
            return "offset index position beyond the chunk's records"
    timestamps, time_offsets = ti._keys, ti._values
    if timestamps:
        if not _ascending(timestamps, True) or not _ascending(time_offsets, False):
            return "time index entries are not ascending"
        if time_offsets[0] < s.base_offset or time_offsets[-1] >= s.next_offset:
            return "time index entry outside the chunk's records"
        if timestamps[-1] > s.max_timestamp:
            return "time index timestamp above the chunk's max timestamp"
    return None


def encode_chunk_index(summary: ChunkSummary) -> bytes:
    """The index file of a chunk (layout in the module docstring).

    ``InvalidInputError`` if the summary is inconsistent (it would not decode).
    """
    problem = _problem(summary)
    if problem:
        raise InvalidInputError(f"cannot encode chunk index of chunk {summary.chunk_start}: {problem}")
    oi, ti = summary.offset_index, summary.time_index
    n, m = len(oi), len(ti)
    header = _HEADER.pack(
        MAGIC, VERSION, 0, summary.interval_bytes, summary.chunk_start, summary.size, summary.records_end,
        summary.base_offset, summary.next_offset, summary.first_timestamp, summary.max_timestamp,
        summary.max_timestamp_offset, summary.batch_count, n, m,
    )
    # Interleave each index's two columns into 16-byte entries; positions are < 2**63, so "q"
    # writes the same bytes as "Q".
    flat = [0] * (2 * (n + m))
    flat[0:2 * n:2], flat[1:2 * n:2] = oi._keys, oi._values
    flat[2 * n::2], flat[2 * n + 1::2] = ti._keys, ti._values
    body = header + struct.pack(f"<{len(flat)}q", *flat)
    return body + _CRC.pack(zlib.crc32(body))


def decode_chunk_index(data: bytes, *, chunk_start: int, segment: str | None = None) -> ChunkSummary:
    """The summary stored by ``encode_chunk_index``, for the chunk starting at ``chunk_start``.

    ``CorruptIndexError`` on a bad magic, version, length or checksum, another chunk's index, or
    entries failing the sanity check; the caller then rebuilds the index from the chunk's data.
    """

    def corrupt(reason: str) -> CorruptIndexError:
        where = f"segment {segment!r}: " if segment is not None else ""
        return CorruptIndexError(f"{where}index of chunk {chunk_start}: {reason}", segment=segment, offset=chunk_start)

    data = bytes(data)
    if len(data) < HEADER_SIZE + _CRC.size:
        raise corrupt(f"{len(data)} bytes is too short")
    (magic, version, reserved, interval, start, size, records_end, base_offset, next_offset, first_ts, max_ts,
     max_ts_offset, batch_count, n, m) = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise corrupt(f"bad magic {magic!r}")
    # Length before checksum, so every truncation is caught without relying on the CRC.
    if len(data) != HEADER_SIZE + ENTRY_SIZE * (n + m) + _CRC.size:
        raise corrupt(f"{len(data)} bytes, but {n} + {m} entries need {HEADER_SIZE + ENTRY_SIZE * (n + m) + 4}")
    if zlib.crc32(memoryview(data)[:-_CRC.size]) != _CRC.unpack_from(data, len(data) - _CRC.size)[0]:
        raise corrupt("checksum mismatch")
    if version != VERSION or reserved != 0:
        raise corrupt(f"unsupported format version {version} (reserved {reserved})")
    if start != chunk_start:
        raise corrupt(f"the file describes the chunk at {start}")
    flat = struct.unpack_from(f"<{2 * (n + m)}q", data, HEADER_SIZE)
    if base_offset < 0:
        raise corrupt(f"negative base offset {base_offset}")
    oi = OffsetIndex(base_offset, max(DEFAULT_MAX_ENTRIES, n))
    oi._keys, oi._values = list(flat[0:2 * n:2]), list(flat[1:2 * n:2])
    ti = TimeIndex(base_offset, max(DEFAULT_MAX_ENTRIES, m))
    ti._keys, ti._values = list(flat[2 * n::2]), list(flat[2 * n + 1::2])
    summary = ChunkSummary(
        chunk_start=start, size=size, base_offset=base_offset, next_offset=next_offset, first_timestamp=first_ts,
        max_timestamp=max_ts, batch_count=batch_count, offset_index=oi, time_index=ti, interval_bytes=interval,
        max_timestamp_offset=max_ts_offset, records_end=records_end,
    )
    problem = _problem(summary)
    if problem:
        raise corrupt(problem)
    return summary


__all__ = [
    "ChunkIndexBuilder",
    "ChunkSummary",
    "CorruptIndexError",
    "DEFAULT_INTERVAL_BYTES",
    "IndexFullError",
    "InvalidIndexEntryError",
    "MIN_TIMESTAMP",
    "NO_TIMESTAMP",
    "OffsetIndex",
    "TimeIndex",
    "decode_chunk_index",
    "encode_chunk_index",
]
