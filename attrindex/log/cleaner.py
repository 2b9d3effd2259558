"""Key-based log compaction: Kafka's log cleaner for a segment log.

For records that share a key only the latest survives; a tombstone (a record whose value is
``None``) deletes its key and is itself removed a retention time after the pass that first
cleaned it (the tombstone clock, kept in the cleaner checkpoint). Offsets never change: a cleaned batch keeps its records' offsets, and removed records are
offset gaps that readers step over (a reader at X gets the first surviving record >= X).

The module has two halves. The first does no I/O (h11-style): the bounded key map, the rule that
decides which records survive, and the rewriting of one batch into the batches of its survivors.
The second, ``LogCleaner``, reads chunks through a ``SegmentLog`` and swaps cleaned chunks in with
``RollingSegment.replace_range`` (one atomic switch per group of chunks, see docs/format.md).

A pass (Kafka's ``LogCleaner.cleanSegments``):

1. the *cleanable* chunks are the sealed ones (never the last, the one being appended to), at or
   above the log's start (a chunk truncated mid-way is left alone and its keys pinned), below the attribute checkpoint (every attribute update they carry
   is already in the B+tree), and whose newest record is older than the minimum compaction lag;
2. the *dirty* section starts at the cleaner checkpoint (``NAME/_cleaner/<20-digit offset>``, the
   first offset not yet deduplicated) and the key map is filled from there, batch by batch, until
   the cleanable chunks end or the map holds ``max_map_keys`` keys (then the pass stops at that
   batch, and the next pass goes on from it: memory stays bounded);
3. every cleanable chunk from the start up to where the map stopped is rewritten: a record
   survives if it has no key, is past the map's end, or is the latest for its key; a surviving
   tombstone is dropped once it was first cleaned ``tombstone_retention_ms`` ago, unless an
   older value of its key had to stay (a *pinned* key: see ``KeepRule``; pins are stored with the
   checkpoint, because only a pass whose key map holds the key sees that value again). The batch that starts
   the log keeps its base offset (a marker batch, or its first record), so the start offset of
   the log never moves;
4. consecutive rewritten chunks are grouped up to the rolling size and each group replaces its
   chunks by ONE chunk (``replace_range``); then the checkpoint moves to where the map stopped,
   carrying the tombstone clock and the pinned keys.

A crash anywhere leaves each group either old or new (``replace_range`` is atomic) and the
checkpoint behind or at the work done; a pass run again over cleaned chunks changes nothing but
what became removable since. Two cleaners at once are safe too: each output is a valid cleaning of
the same sealed bytes, and a switch whose chunks changed meanwhile is refused (the pass restarts).
"""

from __future__ import annotations

import array
import bisect
import hashlib
import itertools
import json
import logging
import operator
import zlib
from collections.abc import Iterator

import attrs

from storage_adapters.rolling import chunk_name

from ..layout import cleaner_dir
from ..errors import (ChunkExistsError, CorruptDataError, InvalidInputError, LayoutChangedError, LayoutConflictError,
                      RetriesExhaustedError, StorageError, TruncatedError)
from .batch.chain import place_batches
from .batch.decode import batch_columns, decode_keys, decode_records, uniform_keys
from .batch.encode import encode_batch
from .batch.header import BatchHeader, peek_header
from .batch.records import Record

_log = logging.getLogger("attrindex.cleaner")

DEFAULT_MAX_MAP_KEYS = 1_000_000  #: keys per pass: about 100 MB of Python dict (Kafka: 128 MiB of 24-byte slots)
_SHORT_KEY = 32  #: keys up to this length are map keys as they are; longer ones by a 128-bit digest
_NO_TIMESTAMP = -(1 << 63)
MAX_CLOCK_ENTRIES = 64  #: entries of the tombstone clock kept in the checkpoint
MAX_PASS_ATTEMPTS = 10  #: passes in a row that lose to another replacement or a truncation before giving up
_GAP_WORTH = 72  #: bytes a gap between two surviving runs must hold to be worth a batch header (64)

# ---------------------------------------------------------------------------------- pure logic


class OffsetMap:
    """Key -> offset of its latest record in the dirty section, holding at most ``capacity``
    keys (Kafka's ``SkimpyOffsetMap``). Keys longer than 32 bytes are stored as a 128-bit BLAKE2b
    digest (Kafka uses MD5) so an entry stays small; shorter ones as they are (no collisions)."""

    def __init__(self, capacity: int):
        if type(capacity) is not int or capacity < 1:
            raise InvalidInputError(f"max_map_keys must be an int >= 1, got {capacity!r:.60}")
        self.capacity = capacity
        self._latest: dict[bytes, int] = {}
        self.end_offset: int | None = None  #: the offset after the last batch added

    def __len__(self) -> int:
        return len(self._latest)

    def add(self, keys: list, base_offset: int, first: int = 0, *, mapped: bool = False) -> bool:
        """Add the records ``keys[first:]`` (offsets from ``base_offset + first``); ``False``, and
        nothing added, if they might not fit (unless the map is empty: a pass always progresses).
        ``mapped``: the keys are known to be as the map stores them (no key longer than 32 bytes)."""
        keys = keys[first:] if first else keys
        if not mapped:
            keys = map_keys(keys)
        latest = self._latest
        if latest and len(latest) + len(keys) > self.capacity:
            new = sum(1 for k in set(keys) if k is not None and k not in latest)
            if len(latest) + new > self.capacity:
                return False
        start = base_offset + first
        latest.update(zip(keys, range(start, start + len(keys))))
        latest.pop(None, None)  # keyless records are not compacted
        self.end_offset = start + len(keys)
        return True

    def __contains__(self, mapped_key) -> bool:
        """Whether a key (as ``map_keys`` gives it) has a record in the mapped section."""
        return mapped_key in self._latest

    def surviving_offsets(self) -> list[int]:
        """The offsets the map keeps (one per key), ascending: a batch wholly inside the mapped
        section none of whose offsets is here has no record that survives, except keyless ones."""
        return sorted(self._latest.values())

    def latest(self, keys: list) -> list[int]:
        """The latest offset of each (already mapped) key, ``-1`` for keys not in the map."""
        return list(map(self._latest.get, keys, itertools.repeat(-1, len(keys))))


def map_keys(keys: list) -> list:
    """Keys as the offset map stores them (long ones digested)."""
    if None in keys:
        longest = max((len(k) for k in keys if k is not None), default=0)
    else:
        longest = max(map(len, keys), default=0)  # in C: the common case
    if longest > _SHORT_KEY:
        return [k if k is None or len(k) <= _SHORT_KEY else hashlib.blake2b(k, digest_size=16).digest()
                for k in keys]
    return keys


class TombstoneClock:
    """When each tombstone was first cleaned, kept in the cleaner checkpoint (not in the batches,
    so stamping a tombstone never makes a batch bigger).

    Every pass cleans the log from its start up to where its key map stopped (the new checkpoint),
    so a tombstone at offset ``o`` was first cleaned by the first pass whose end is ``> o``: the
    clock is that list of ``(end offset, time)`` entries, ascending in both. It keeps at most
    ``MAX_CLOCK_ENTRIES``; merging two neighbours keeps the later time for both ranges, which only
    makes tombstones live longer, never shorter.
    """

    def __init__(self, entries=()):
        self.entries: list[tuple[int, int]] = [(int(e), int(t)) for e, t in entries]

    def cleaned_at(self, offsets: list[int]) -> list[int | None]:
        """The first clean time of a tombstone at each offset (None: not cleaned yet)."""
        ends = [e for e, _t in self.entries]
        out = []
        for offset in offsets:
            i = bisect.bisect_right(ends, offset)
            out.append(self.entries[i][1] if i < len(ends) else None)
        return out

    def advanced(self, end: int, now_ms: int) -> "TombstoneClock":
        """The clock after a pass that cleaned everything below ``end`` at ``now_ms``."""
        entries = list(self.entries)
        if entries and end <= entries[-1][0]:
            return TombstoneClock(entries)
        now_ms = max(now_ms, entries[-1][1]) if entries else now_ms
        if entries and entries[-1][1] == now_ms:
            entries[-1] = (end, now_ms)  # passes of one compaction share a time: exact, one entry
        else:
            entries.append((end, now_ms))
        while len(entries) > MAX_CLOCK_ENTRIES:  # merge the two neighbours closest in time
            i = min(range(len(entries) - 1), key=lambda j: entries[j + 1][1] - entries[j][1])
            entries[i:i + 2] = [entries[i + 1]]
        return TombstoneClock(entries)


@attrs.define
class KeepRule:
    """What decides survival in one pass: the key map, the time, the tombstone retention and clock.

    ``pinned`` holds the keys of which an older record is knowingly left in the log (a batch whose
    rewrite would not be smaller, the log's first record): their tombstones must not expire, or
    the older value would come back. Such a record looks like the latest of its key to every later
    pass whose key map does not hold the key, so the pins outlive the pass: they are stored with the
    checkpoint and come back as ``pinned``, except those of keys in this pass's map (the pass
    visits every older record of those again and pins what it keeps). ``held`` are keys pinned for
    this pass only: those of a partly truncated chunk, pinned again by every pass that meets it.
    """

    offsets: OffsetMap
    now_ms: int
    tombstone_retention_ms: int
    clock: TombstoneClock
    pinned: set = attrs.Factory(set)
    kept_anyway: int = 0  #: records kept although the rule would remove them (pinned cases)
    held: set = attrs.Factory(set)

    @classmethod
    def carrying(cls, offsets: OffsetMap, now_ms: int, tombstone_retention_ms: int, clock: TombstoneClock,
                 pins) -> "KeepRule":
        """The rule of a pass that starts from a checkpoint's ``pins``: those of keys in the map go
        (the pass judges their older records again), the others stay."""
        return cls(offsets, now_ms, tombstone_retention_ms, clock, {k for k in pins if k not in offsets})

    def survivors(self, keys: list, tombstones: bytes | None, base_offset: int) -> tuple[list[int], set[int]]:
        """Indexes of the records of a batch that survive, and those of the tombstones that expire.

        A record survives if it has no key, or no later record of its key is in the map (records
        past the map's end are later than everything in it). A surviving tombstone expires once it
        was first cleaned ``tombstone_retention_ms`` ago (Kafka's delete horizon).
        """
        n = len(keys)
        mapped = map_keys(keys)
        latest = self.offsets.latest(mapped)
        kept = list(itertools.compress(range(n), map(operator.ge, range(base_offset, base_offset + n), latest)))
        if tombstones is None or not any(tombstones):
            return kept, set()
        dead = [i for i in kept if tombstones[i]]
        times = self.clock.cleaned_at([base_offset + i for i in dead])
        horizon = self.now_ms - self.tombstone_retention_ms
        expired = {i for i, t in zip(dead, times)
                   if t is not None and t <= horizon and mapped[i] not in self.pinned and mapped[i] not in self.held}
        if not expired:
            return kept, expired
        return [i for i in kept if i not in expired], expired

    def pin(self, keys: list, *, for_this_pass: bool = False) -> None:
        (self.held if for_this_pass else self.pinned).update(k for k in map_keys(keys) if k is not None)

    def keep_anyway(self, keys: list, tombstones: bytes | None, indexes) -> None:
        """Records ``indexes`` of a batch stay although the rule would remove them: pin the keys of
        those with values (a kept tombstone cannot bring anything back)."""
        indexes = list(indexes)
        self.kept_anyway += len(indexes)
        self.pin([keys[i] for i in indexes if tombstones is None or not tombstones[i]])


def rewrite_batch(buf, pos: int, header: BatchHeader, rule: KeepRule, *, segment: str | None = None,
                  position: int = 0, keep_first: bool = False) -> tuple[list[bytes], int, int]:
    """The batch at ``buf[pos]`` cleaned: ``(pieces, records kept, tombstones expired)``.

    ``pieces`` are batches to write in its place: the batch itself when every record survives,
    nothing when none does (a record-less batch, attribute updates only, goes too: the cleaner runs
    below the attribute checkpoint), else one batch per run of consecutive survivors, each keeping
    its records' offsets, timestamps, keys, headers, the codec and the batch id. Pieces are sealed
    for where the batch was read or for position 0: ``place_batches`` seals them where they land.
    If those would take more bytes than the batch (tiny records split into many runs), the batch
    stays as it is and its keys are pinned (see ``KeepRule``). ``keep_first`` keeps the first record whatever the
    rule says (pinning its key): the batch that starts the log keeps its base offset, so the log's
    start offset does not move (compaction is not retention).
    """
    n = header.record_count
    if n == 0:
        return [], 0, 0
    keys, tombstones = decode_keys(buf, pos, header, position=position, segment=segment, verify=False)
    kept, expired = rule.survivors(keys, tombstones, header.base_offset)
    if keep_first and (not kept or kept[0] != 0):
        kept.insert(0, 0)
        rule.keep_anyway(keys, tombstones, [0])
        expired.discard(0)
    original = bytes(buf[pos:pos + header.size])
    if len(kept) == n:
        return [original], n, 0
    if not kept:
        return [], 0, len(expired)
    columns = batch_columns(buf, pos, header, position=position, segment=segment, verify=False)
    kept = _join_small_gaps(kept, columns.record_sizes(), keys, tombstones, rule, expired)
    if columns.has_headers:
        records = decode_records(buf, pos, header, position=position, segment=segment, verify=False)
        pieces = []
        for run in _runs(kept):
            chosen = [records[i] for i in run]
            pieces.append(encode_batch(chosen[0].offset, [Record(r.value, r.key, r.timestamp, r.headers)
                                                          for r in chosen],
                                       timestamp=chosen[0].timestamp, codec=header.codec, batch_id=header.batch_id))
    else:  # the same bytes, cut from the columns without a Record per record
        pieces = columns.encode_runs([(run[0], run[-1] + 1) for run in _runs(kept)])
    if sum(map(len, pieces)) > header.size:  # timestamps or compression of the runs took more
        rule.keep_anyway(keys, tombstones, [i for i in range(n) if i not in set(kept)])
        return [original], n, 0
    return pieces, len(kept), len(expired)


def _join_small_gaps(kept: list[int], sizes: list[int], keys: list, tombstones: bytes | None, rule: KeepRule,
                     expired: set[int]) -> list[int]:
    """``kept`` with the records between two runs kept too where removing them would save fewer
    bytes than the header of the extra batch it costs (so a cleaned batch never grows).
    ``sizes[i]``: the bytes of record ``i``'s value and key."""
    joined: list[int] = []
    for i in kept:
        if joined and i > joined[-1] + 1:
            gap = range(joined[-1] + 1, i)
            saved = sum(sizes[gap.start:gap.stop]) + 3 * len(gap)
            if saved < _GAP_WORTH:
                joined.extend(gap)
                rule.keep_anyway(keys, tombstones, gap)
                expired.difference_update(gap)
        joined.append(i)
    return joined


def _runs(indexes: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted indexes: ``[0, 1, 3]`` -> ``[[0, 1], [3]]``."""
    runs: list[list[int]] = []
    for i in indexes:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def empty_batch(next_offset: int, timestamp: int) -> bytes:
    """What a group whose records all went is rewritten to: a record-less batch that keeps the
    offset the group ends at (so a reader's offsets stay known, as Kafka keeps the last batch)."""
    return encode_batch(next_offset, [], timestamp=timestamp)


CHECKPOINT_FORMAT = 2


def encode_checkpoint(offset: int, clock: TombstoneClock, pins=()) -> bytes:
    """The stored cleaner checkpoint: JSON (the offset, the tombstone clock and the pinned keys in
    hex, sorted), a newline, CRC-32."""
    body = json.dumps({"format": CHECKPOINT_FORMAT, "offset": offset, "clock": clock.entries,
                       "pins": sorted(k.hex() for k in pins)}).encode()
    return body + b"\n" + f"{zlib.crc32(body):08x}".encode()


class OlderCheckpointFormat(Exception):
    """A whole checkpoint of an older format (it keeps no pins): it is not used, and the cleaner
    starts from the log's start once, which is always safe."""


def decode_checkpoint(data: bytes) -> tuple[int, TombstoneClock, frozenset[bytes]] | None:
    """A stored checkpoint ``(offset, clock, pins)``, or None if it is torn or damaged (then the
    previous one counts). ``OlderCheckpointFormat`` for a whole one of an older format;
    ``CorruptDataError`` for one of a newer format (written by a newer attrindex: cleaning on
    without its pins could bring deleted keys back)."""
    body, _, crc = data.rpartition(b"\n")
    if f"{zlib.crc32(body):08x}".encode() != crc:
        return None
    try:
        fields = json.loads(body)
        found = fields["format"]
        if type(found) is int and found > CHECKPOINT_FORMAT:
            raise CorruptDataError(f"a cleaner checkpoint of format {found}, written by a newer attrindex: this "
                                   f"version reads format {CHECKPOINT_FORMAT}; compact it with the newer version")
        if found != CHECKPOINT_FORMAT:
            raise OlderCheckpointFormat(found)
        return int(fields["offset"]), TombstoneClock(fields["clock"]), frozenset(map(bytes.fromhex, fields["pins"]))
    except (ValueError, TypeError, KeyError):
        return None


# ------------------------------------------------------------------------------------ the I/O


@attrs.frozen
class CompactionStats:
    """What one ``Segment.compact`` did. Counts cover the chunks the cleaner rewrote or walked."""

    records_before: int  #: records in the walked chunks before cleaning
    records_after: int  #: records left in them
    bytes_before: int  #: bytes of the walked chunks before (holes included)
    bytes_after: int  #: bytes stored for them after
    chunks_cleaned: int  #: chunks replaced by cleaned ones
    tombstones_removed: int  #: tombstones past their retention, removed
    passes: int = 0  #: passes run (more than one when the dirty keys outgrew the key map)
    checkpoint: int = 0  #: the cleaner checkpoint afterwards: first offset not yet deduplicated
    retention_chunks_deleted: int = 0  #: chunks deleted by retention first (``delete,compact``)
    seconds: float = 0.0
    kept_anyway: int = 0  #: superseded records (or expired tombstones) kept: see docs/segments.md
    bytes_read: int = 0  #: log bytes the cleaner read (the key map pass, then the batches it rewrote)
    batches_skipped: int = 0  #: batches dropped unread by the rewrite: every record superseded (docs/segments.md)

    @property
    def records_removed(self) -> int:
        return self.records_before - self.records_after


@attrs.frozen
class _Span:
    """A cleanable chunk: log bytes ``[start, end)`` (up to the next chunk: a hole after its data
    belongs to it) and the record offset the log continues from after it."""

    start: int
    end: int
    base_offset: int
    next_offset: int
    stored: int  #: bytes stored (a hole is not)
    name: str = ""  #: the chunk's name in the view the pass planned with


class LogCleaner:
    """Runs compaction passes over one segment log through a ``SegmentLog`` of its own.

    ``limit`` is the log byte position the attribute B+tree covers: no batch at or beyond it is
    rewritten (its attribute updates may live only in the log).
    """

    def __init__(self, log, *, limit: int, min_lag_ms: int, tombstone_retention_ms: int, now_ms: int,
                 max_map_keys: int = DEFAULT_MAX_MAP_KEYS, max_group_bytes: int | None = None):
        self.log = log
        self.limit = limit
        self.min_lag_ms = min_lag_ms
        self.tombstone_retention_ms = tombstone_retention_ms
        self.now_ms = now_ms
        self.max_map_keys = max_map_keys
        self.max_group_bytes = max_group_bytes or log.bytes.rolling_size
        self._dir = cleaner_dir(log.segment)
        self.records_before = self.records_after = self.bytes_before = self.bytes_after = 0
        self.chunks_cleaned = self.tombstones_removed = self.passes = self.kept_anyway = 0
        self.bytes_read = self.batches_skipped = 0
        # per pass: the batches the key map pass walked, by chunk start (see ``_fill``), and the
        # offsets the map keeps, ascending (a batch holding none of them has no survivor)
        self._known: dict[int, array.array] = {}
        self._surviving: list[int] = []

    # -- checkpoint ----------------------------------------------------------------------------
    def load_checkpoint(self) -> tuple[int, TombstoneClock, frozenset[bytes]]:
        """The first offset not yet deduplicated (Kafka's cleaner-offset-checkpoint), the tombstone
        clock and the pinned keys: from the newest valid checkpoint file (none: offset 0, empty
        clock, no pins)."""
        storage = self.log.storage
        names = sorted((n for n in storage.list_files(self._dir) if len(n) == 20 and n.isdigit()), reverse=True)
        for name in names:
            try:
                found = decode_checkpoint(storage.read(f"{self._dir}/{name}", 0, 1 << 20))
            except FileNotFoundError:
                continue  # deleted by a newer cleaner meanwhile
            except OlderCheckpointFormat as old:
                _log.info("segment %r: cleaner checkpoint %s is of an older format (%s): compaction starts from the "
                          "log's start once", self.log.segment, name, old)
                break
            except CorruptDataError as exc:
                raise CorruptDataError(f"segment {self.log.segment!r}: {exc}", segment=self.log.segment,
                                       offset=int(name)) from None
            if found is not None and found[0] == int(name):
                return found
            _log.warning("segment %r: cleaner checkpoint %s is damaged; using an older one", self.log.segment, name)
        return 0, TombstoneClock(), frozenset()

    def _store_checkpoint(self, offset: int, clock: TombstoneClock, pins) -> None:
        storage = self.log.storage
        try:
            storage.create(f"{self._dir}/{chunk_name(offset)}", encode_checkpoint(offset, clock, pins))
        except ChunkExistsError:
            # another cleaner got there first with the same offset: it started from the same
            # checkpoint and mapped the same records, so its clock and pins are as good
            return
        try:  # older checkpoints are harmless (the newest wins): deleting them is housekeeping
            old = [n for n in storage.list_files(self._dir) if n.isdigit() and int(n) < offset]
            if old:
                storage.delete([f"{self._dir}/{n}" for n in old])
        except StorageError as exc:
            _log.warning("segment %r: deleting old cleaner checkpoints failed (left for later): %s",
                         self.log.segment, exc)

    # -- planning ------------------------------------------------------------------------------
    def _refresh(self) -> None:
        log = self.log
        log.bytes.refresh()
        log.sync_chunks()
        log.position = log.bytes.length  # only sealed chunks are read: no scan of the tail needed

    def _spans(self) -> tuple[list[_Span], _Span | None]:
        """The cleanable chunks, oldest first (module docstring, step 1), and the first readable
        chunk if it is partly truncated (it cannot be rewritten: its start is mid-chunk)."""
        log = self.log
        chunks = log.chunks
        out, partial = [], None
        horizon = self.now_ms - self.min_lag_ms
        stored_sizes = {c.start: getattr(c, "stored", c.length) for c in log.bytes.chunks()}
        for i in range(len(chunks) - 1):  # never the last chunk
            start, end = chunks[i].start, chunks[i + 1].start
            if end <= log.start_position:
                continue
            if end > self.limit:
                break
            summary = log.summary(i)
            if summary.max_timestamp != _NO_TIMESTAMP and summary.max_timestamp > horizon:
                break  # Kafka: the first chunk newer than the lag bounds the cleanable section
            if start < log.start_position:
                partial = _Span(log.start_position, end, summary.base_offset, summary.next_offset, 0)
                continue
            stored = stored_sizes.get(start, end - start)
            out.append(_Span(start, end, summary.base_offset, summary.next_offset, stored, chunks[i].name))
        return out, partial

    def dirty_bytes(self) -> tuple[int, int]:
        """``(clean bytes, dirty bytes)`` stored in the log, split at the cleaner checkpoint: the
        chunk holding it is found by binary search, so only a few chunk summaries are read."""
        self._refresh()
        log = self.log
        first_dirty = self.load_checkpoint()[0]
        start = log.start_position
        sizes = [(c.start, getattr(c, "stored", c.length) - max(0, start - c.start))
                 for c in log.bytes.chunks() if c.end > start]
        total = sum(size for _start, size in sizes)
        if not sizes or first_dirty == 0:
            return 0, total
        i = log.reads.chunk_for_offset(first_dirty)
        if log.summary(i).next_offset > first_dirty:
            boundary = log.chunks[i].start
        else:
            boundary = log.chunks[i + 1].start if i + 1 < len(log.chunks) else log.bytes.length
        clean = sum(size for chunk_start, size in sizes if chunk_start < boundary)
        return clean, total - clean

    # -- passes --------------------------------------------------------------------------------
    def run(self, max_passes: int = 1_000_000) -> int:
        """Clean until the dirty section is done; return the checkpoint. Each pass moves the
        checkpoint forward by at least one batch, so the loop is bounded by the batches there.

        A pass that loses a race (another cleaner or a consolidation replaced the chunks first,
        retention deleted them) leaves its checkpoint and starts again from a fresh view, at most
        ``MAX_PASS_ATTEMPTS`` times in a row; the groups it did replace are valid cleanings.
        """
        lost = 0
        for _ in range(max_passes):
            self._refresh()
            first_dirty, clock, pins = self.load_checkpoint()
            try:
                done, end, pins_after = self._pass(first_dirty, clock, pins)
            except RetriesExhaustedError:
                raise  # a loop below (a replacement, a resync) retried its race to its bound
            except (LayoutConflictError, LayoutChangedError, TruncatedError) as exc:
                lost += 1
                if lost > MAX_PASS_ATTEMPTS:
                    raise RetriesExhaustedError(f"segment {self.log.segment!r}: compaction lost {lost} races in a row to "
                                                f"other cleaners or retention; the segment is intact") from exc
                _log.info("segment %r: a compaction pass lost a race (%s); starting it again", self.log.segment, exc)
                continue
            lost = 0
            if end > first_dirty:
                self._store_checkpoint(end, clock.advanced(end, self.now_ms), pins_after)
            if done:
                return max(end, first_dirty)
        raise StorageError(f"segment {self.log.segment!r}: compaction did not finish in {max_passes} passes")

    def _pass(self, first_dirty: int, clock: TombstoneClock, pins: frozenset[bytes]
              ) -> tuple[bool, int, set[bytes]]:
        """One pass; ``(whether the dirty section is done, the offset the map stopped at, the
        pinned keys afterwards)``."""
        spans, partial = self._spans()
        if not spans:
            return True, first_dirty, set(pins)
        self.passes += 1
        offsets = OffsetMap(self.max_map_keys)
        last, complete = self._fill(offsets, spans, first_dirty)
        self._surviving = offsets.surviving_offsets()
        end = offsets.end_offset if offsets.end_offset is not None else first_dirty
        if complete:
            end = max(end, spans[-1].next_offset)
        rule = KeepRule.carrying(offsets, self.now_ms, self.tombstone_retention_ms, clock, pins)
        if partial is not None:
            self._pin_all(partial, rule, for_this_pass=True)
        self._clean(spans[:last + 1], rule)
        self.kept_anyway += rule.kept_anyway
        return complete, end, rule.pinned

    def _fill(self, offsets: OffsetMap, spans: list[_Span], first_dirty: int) -> tuple[int, bool]:
        """Fill the map from ``first_dirty``; ``(index of the last span to clean, complete)``.

        Each batch's checksum is verified by the read (``SegmentLog.batches``); its keys come from
        ``uniform_keys`` (one C-level cut when every key has the same length) or ``decode_keys``.
        The batches of every chunk walked to its end are remembered (``_known``: position, size,
        base offset, record count, and whether the batch lies wholly in the mapped section with a
        key on every record: 32 bytes a batch), so the rewrite can drop a batch without a survivor
        unread. That list is bounded like the map: at most ``max_map_keys`` batches per pass;
        chunks beyond it are simply read again."""
        segment = self.log.segment
        self._known = {}
        budget = self.max_map_keys
        for n, span in enumerate(spans):
            if span.next_offset <= first_dirty:
                continue
            known = array.array("q")  # per batch: position, size, base offset, record count * 2 + droppable
            for at, header, buf, pos in self.log.batches(span.start, span.end):
                self.bytes_read += header.size
                if header.next_offset <= first_dirty or not header.record_count:
                    known.extend((at, header.size, header.base_offset, 2 * header.record_count))
                    continue
                first = max(0, first_dirty - header.base_offset)
                found = uniform_keys(buf, pos, header, position=at - pos, segment=segment, verify=False)
                if found is not None:  # one width: as the map stores them if short enough
                    keys, keyed, mapped = found[0], True, len(found[0][0]) <= _SHORT_KEY
                else:
                    keys, _dead = decode_keys(buf, pos, header, position=at - pos, segment=segment, verify=False)
                    keyed, mapped = None not in keys, False
                if not offsets.add(keys, header.base_offset, first, mapped=mapped):
                    return n, False
                known.extend((at, header.size, header.base_offset, 2 * header.record_count + (keyed and not first)))
            if len(known) // 4 <= budget:
                self._known[span.start] = known
                budget -= len(known) // 4
        return len(spans) - 1, True

    def _batches(self, span: _Span, read_first: bool) -> Iterator[tuple[int, BatchHeader | int, bytes | None, int]]:
        """The batches of ``span`` as ``SegmentLog.batches`` yields them, except that a batch the
        key map pass found wholly mapped and keyed, holding none of the surviving offsets, comes
        as ``(at, record count, None, 0)`` without being read: every record in it is superseded.
        Runs of the other batches are read (and verified) again, one range each. ``read_first``:
        the span's first batch is read whatever it holds (it may have to keep the log's start)."""
        known = self._known.get(span.start)
        if known is None:
            yield from self._read(span.start, span.end)
            return
        surviving = self._surviving
        pending: list[int] | None = None  # [start, end) of the batches still to read
        for i in range(0, len(known), 4):
            at, size, base, flags = known[i:i + 4]
            if flags & 1 and not (read_first and i == 0):
                j = bisect.bisect_left(surviving, base)
                if j == len(surviving) or surviving[j] >= base + (flags >> 1):
                    if pending:
                        yield from self._read(*pending)
                        pending = None
                    yield at, flags >> 1, None, 0
                    continue
            if pending:
                pending[1] = at + size
            else:
                pending = [at, at + size]
        if pending:
            yield from self._read(*pending)

    def _read(self, start: int, end: int) -> Iterator[tuple[int, BatchHeader, bytes, int]]:
        for batch in self.log.batches(start, end):
            self.bytes_read += batch[1].size
            yield batch

    def _pin_all(self, span: _Span, rule: KeepRule, *, for_this_pass: bool = False) -> None:
        """Pin every key of a chunk the pass cannot rewrite (its old values stay)."""
        for at, header, buf, pos in self.log.batches(span.start, span.end):
            if header.record_count:
                rule.pin(decode_keys(buf, pos, header, position=at - pos, segment=self.log.segment, verify=False)[0],
                         for_this_pass=for_this_pass)

    def _clean(self, spans: list[_Span], rule: KeepRule) -> None:
        """Rewrite ``spans`` in order, in groups up to the rolling size; replace the groups that changed."""
        group: list[tuple[_Span, list[bytes], bool]] = []
        size = 0
        for span in spans:
            pieces, changed = self._clean_start(span, rule) if span.start == self.log.start_position \
                else self._clean_span(span, rule)
            out = sum(map(len, pieces))
            if group and size + out > self.max_group_bytes:
                self._replace(group, rule)
                group, size = [], 0
            group.append((span, pieces, changed))
            size += out
        if group:
            self._replace(group, rule)

    def _clean_start(self, span: _Span, rule: KeepRule) -> tuple[list[bytes], bool]:
        """Clean the chunk that starts the log, keeping the log's start offset (compaction is not
        retention: a read at the start gets the first surviving record). If its first record goes,
        a record-less marker batch keeps the offset, or, when the cleaned chunk has no room for
        its 64 bytes, the first record stays (its key pinned: decided before any later batch)."""
        counters = (self.records_before, self.records_after, self.tombstones_removed, set(rule.pinned),
                    rule.kept_anyway, self.batches_skipped)
        pieces, changed = self._clean_span(span, rule, at_start=True)
        first = peek_header(pieces[0]).base_offset if pieces else None  # sealed where it was read, or for 0
        if first == span.base_offset:
            return pieces, changed
        marker = empty_batch(span.base_offset, self.now_ms)
        if sum(map(len, pieces)) + len(marker) <= span.end - span.start:
            return [marker, *pieces], True
        (self.records_before, self.records_after, self.tombstones_removed, rule.pinned,
         rule.kept_anyway, self.batches_skipped) = counters
        return self._clean_span(span, rule, at_start=True, keep_first=True)

    def _clean_span(self, span: _Span, rule: KeepRule, *, at_start: bool = False,
                    keep_first: bool = False) -> tuple[list[bytes], bool]:
        """The cleaned batches of one chunk and whether they differ from its batches. ``at_start``:
        a record-less batch starting the log is kept (it holds the start offset); ``keep_first``:
        so is the first record (see ``_clean_start``)."""
        pieces: list[bytes] = []
        changed = False
        segment = self.log.segment
        for at, header, buf, pos in self._batches(span, read_first=at_start):
            first, at_start = at_start, False
            if buf is None:  # every record superseded (see ``_batches``): dropped unread; ``header`` is its count
                self.records_before += header
                self.batches_skipped += 1
                changed = True
                continue
            if not header.record_count and (first or not header.attribute_count):
                if first:
                    pieces.append(bytes(buf[pos:pos + header.size]))
                continue  # an offset marker (an emptied group's, retention's): dropping it is no change
            self.records_before += header.record_count
            out, kept, expired = rewrite_batch(buf, pos, header, rule, segment=segment, position=at - pos,
                                               keep_first=first and keep_first)
            changed = changed or kept != header.record_count or len(out) != 1
            pieces.extend(out)
            self.records_after += kept
            self.tombstones_removed += expired
        return pieces, changed

    def _replace(self, group: list, rule: KeepRule) -> None:
        """Swap one group of chunks for one chunk holding their cleaned batches (if it changed)."""
        start, end = group[0][0].start, group[-1][0].end
        self.bytes_before += sum(span.stored for span, _pieces, _changed in group)
        if len(group) == 1 and not group[0][2]:
            self.bytes_after += sum(span.stored for span, _pieces, _changed in group)
            return
        pieces = [p for _span, chunk_pieces, _changed in group for p in chunk_pieces]
        if not pieces:  # everything went: keep the offset the group ends at
            pieces = [empty_batch(group[-1][0].next_offset, self.now_ms)]
        data = place_batches(b"".join(pieces), start)  # the batches move: each sealed for where it lands
        if len(data) > end - start:  # cannot happen (every batch's output is at most its size): be safe
            for span, _pieces, _changed in group:
                self._pin_all(span, rule)
            self.bytes_after += sum(span.stored for span, _pieces, _changed in group)
            return
        # atomic, and a conflict unless the range still holds the chunks this pass planned with
        self.log.replace_range(start, end, data, expected=[span.name for span, _pieces, _changed in group])
        self.chunks_cleaned += len(group)
        self.bytes_after += len(data)

    def stats(self, checkpoint: int, seconds: float, retention_deleted: int = 0) -> CompactionStats:
        return CompactionStats(self.records_before, self.records_after, self.bytes_before, self.bytes_after,
                               self.chunks_cleaned, self.tombstones_removed, self.passes, checkpoint,
                               retention_deleted, seconds, self.kept_anyway, self.bytes_read,
                               self.batches_skipped)


__all__ = ["CompactionStats", "KeepRule", "LogCleaner", "OffsetMap", "TombstoneClock",
           "rewrite_batch"]
