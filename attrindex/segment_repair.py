"""Explicit verification and repair of a segment: its log, chunk index files, gaps and attributes.

Both work from storage alone, so they work on a segment that ``SegmentStore.segment`` refuses to
open. ``verify_segment`` reads every committed byte and reports every damaged range.
``repair_segment`` gives up only the damaged bytes: each damaged range becomes a gap that readers
step over, and every intact batch after it is kept (its offsets are above every offset the damaged
bytes could have held). A damaged tail (no valid batch after it) is cut: a record-less batch is
appended whose base offset lies above every offset the damaged bytes could have held, so no
acknowledged offset is ever reused. The attributes are made consistent with the kept batches
(rebuilt from the log when the tree covers damaged bytes or is itself damaged; the log is the
source of truth). Stop the segment's writers first.
"""

from __future__ import annotations

import logging
import time
import threading
from typing import Any

import attrs

from storage_adapters import ChunkStorage, RollingSegment

from .tree_index import TreeIndex
from .damage import Damage
from .errors import BadOffsetError, CorruptDataError, RetriesExhaustedError, StorageError, TruncatedError
from .log.batch.encode import encode_batch
from .log.batch.header import read_header
from .layout import INDEX_DIR, attributes_name
from .log.segment_log import SegmentLog
from .log.verify import RECORDS_PER_BYTE_BOUND, LogScan, resume_offset, scan_log
from .attribute_state import AttributeState
from .options import SegmentOptions

_log = logging.getLogger("attrindex.segment")


@attrs.frozen
class SegmentVerifyReport:
    """What ``SegmentStore.verify_segment`` checked and every damaged range it found."""

    segment: str
    damage: list[Damage]  #: log chunks, chunk index files, gap markers and the attribute index
    batches: int  #: valid record batches read
    records: int  #: records in them
    log_bytes: int  #: log bytes read
    gaps: int  #: gaps recorded by earlier repairs, stepped over
    index_files: int  #: chunk index files checked
    attributes: Any  #: the attribute index's ``VerifyReport`` (None if it could not be read)

    @property
    def ok(self) -> bool:
        """No damage was found."""
        return not self.damage


@attrs.frozen
class LostRange:
    """Damaged log bytes ``[start, end)`` a repair gave up (stepped over as gaps from then on), and
    the record offsets ``offsets`` they could have held: no record will ever be read or written at
    one of them. ``exact`` False: the range's end is a safe upper bound (a damaged tail whose
    headers could not all be read), and some of those offsets may never have held a record."""

    start: int
    end: int
    offsets: range
    exact: bool = True


@attrs.frozen
class SegmentRepairReport:
    """What ``SegmentStore.repair_segment`` did. The offsets in ``lost_offsets`` are gone for good;
    every other record is kept."""

    segment: str
    damage: list[Damage]  #: what verification found before the repair
    cut_at: int | None  #: log byte where the damaged tail was cut (None: the log's tail was intact)
    lost_bytes: int  #: committed log bytes given up (kept on storage, stepped over as gaps)
    first_lost_offset: int | None  #: first record offset lost (None: none)
    resume_offset: int | None  #: the next record gets this offset (None: no batch was given up)
    resume_exact: bool  #: False: ``resume_offset`` is a safe upper bound (damaged headers)
    index_files_deleted: int  #: chunk index files deleted (derived data, rebuilt on use)
    attributes_rebuilt: bool  #: the attribute index was rebuilt from the log
    attributes: str  #: what happened to the attributes, and why
    lost: tuple[LostRange, ...] = ()  #: every damaged range given up, in log order
    kept_after_damage: int = 0  #: intact batches after the first damaged one, all kept

    @property
    def lost_offsets(self) -> tuple[range, ...]:
        """The record offsets the repair gave up, one range per damaged range, in order (empty:
        none). With ``resume_exact`` False some of the last range's may never have held a record."""
        return tuple(r.offsets for r in self.lost)

    @property
    def repaired(self) -> bool:
        """Whether anything was changed."""
        return bool(self.lost) or self.index_files_deleted > 0 or self.attributes_rebuilt


MAX_VERIFY_ATTEMPTS = 5


def _open_log(storage: ChunkStorage, name: str, options: SegmentOptions) -> SegmentLog:
    return SegmentLog(storage, name, rolling_size=options.log_rolling_size,
                      index_interval_bytes=options.index_interval_bytes)


def _tree_name(name: str, tree_name: str | None) -> str:
    """Where segment ``name``'s attribute B+tree lives (see ``Segment``'s ``tree_name``)."""
    return attributes_name(name) if tree_name is None else tree_name


def _verify_attributes(storage: ChunkStorage, name: str, options: SegmentOptions,
                       tree_name: str | None = None) -> tuple[Any, list[Damage]]:
    """The attribute index's verification: its report (or None) and its damage."""
    where = _tree_name(name, tree_name)
    try:
        report = TreeIndex.verify_at(storage, where)  # works without opening the index
    except CorruptDataError as exc:
        offset = exc.offset if exc.offset is not None else 0
        return None, [Damage(where, offset, offset, str(exc))]
    return report, list(report.damage)


def _checkpoint(storage: ChunkStorage, name: str, options: SegmentOptions, tree_name: str | None = None) -> int | None:
    index = TreeIndex(storage, _tree_name(name, tree_name), **options.attribute_options)
    try:
        return index.checkpoint
    finally:
        index.close()


def _readable_checkpoint(storage: ChunkStorage, name: str, options: SegmentOptions, tree_name: str | None = None) -> int:
    """The attribute checkpoint, or 0 if the index is damaged (its repair is decided later)."""
    try:
        return _checkpoint(storage, name, options, tree_name) or 0
    except CorruptDataError:
        return 0


def verify_segment(storage: ChunkStorage, name: str, options: SegmentOptions, *,
                   tree_name: str | None = None) -> SegmentVerifyReport:
    """Read every committed byte of segment ``name`` and report every damaged range.

    ``tree_name``: where its attribute B+tree lives, as given to ``Segment`` (default ``NAME/_attributes``).

    Safe beside writers: retention that cuts what is being read makes it look again (bounded), and
    the checkpoint is compared with the log so that a merge or retention meanwhile is no damage.
    """
    for _attempt in range(MAX_VERIFY_ATTEMPTS):
        try:
            return _verify_once(storage, name, options, tree_name)
        except TruncatedError:  # retention removed what was being read: look again
            continue
    raise RetriesExhaustedError(f"segment {name!r}: retention changed the log under verification {MAX_VERIFY_ATTEMPTS} times; "
                                "verify it when its writers are idle")


def _verify_once(storage: ChunkStorage, name: str, options: SegmentOptions, tree_name: str | None) -> SegmentVerifyReport:
    # Read before the log: a merge covers only committed bytes, so it cannot pass the length read later.
    covered_before = _readable_checkpoint(storage, name, options, tree_name)
    log = _open_log(storage, name, options)
    try:
        scan = scan_log(log)
        start, length = log.start_position, log.bytes.length
    finally:
        log.close()
    attributes, damage = _verify_attributes(storage, name, options, tree_name)
    if not damage:
        # Read after the log: retention merges before it truncates, so it cannot pass this checkpoint.
        covered_after = _checkpoint(storage, name, options, tree_name) or 0
        if covered_after < start < length or covered_before > length:
            checkpoint = covered_before if covered_before > length else covered_after
            damage.append(Damage(_tree_name(name, tree_name), checkpoint, checkpoint,
                                 f"the attributes cover the log up to byte {checkpoint}, the log holds bytes "
                                 f"[{start}, {length})"))
    return SegmentVerifyReport(name, scan.damage + damage, scan.batches, scan.records, scan.bytes, scan.gaps,
                               scan.index_files, attributes)


def repair_segment(storage: ChunkStorage, name: str, options: SegmentOptions, *,
                   tree_name: str | None = None, rebuild_attributes: bool = True) -> SegmentRepairReport:
    """Turn every damaged range of the log into a gap, keeping every intact batch; cut a damaged
    tail above every offset it could have held; make the attributes consistent with the kept batches.

    ``tree_name`` as for ``verify_segment``. ``rebuild_attributes=False`` never rebuilds the
    B+tree from the log (the plain index's tree holds what was merged before its WAL began, so
    the log is not its whole source); it is rolled back or kept instead. Raises ``StorageError`` if another writer appended
    meanwhile (stop writers, run it again).
    """
    covered = _readable_checkpoint(storage, name, options, tree_name)
    log = _open_log(storage, name, options)
    try:
        scan = scan_log(log)
        log_start, length = log.start_position, log.bytes.length
        lost, cut = _give_up(log, scan, length)
        if cut is None and covered > length:
            lost, cut = lost + (_give_up_after_the_end(log, scan, length, covered),), length
        deleted = _delete_index_files(log, scan.damage, lost)
    finally:
        log.close()
    attribute_damage = _verify_attributes(storage, name, options, tree_name)[1]
    rebuilt, attributes = _repair_attributes(storage, name, options, scan.first_damage, log_start, length,
                                             bool(attribute_damage), tree_name, rebuild_attributes)
    resume = None if not lost else lost[-1].offsets.stop if cut is not None else scan.next_offset
    report = SegmentRepairReport(name, scan.damage + attribute_damage, cut, sum(r.end - r.start for r in lost),
                                 lost[0].offsets.start if lost else None, resume, all(r.exact for r in lost),
                                 deleted, rebuilt, attributes, lost, scan.batches_after_damage)
    if report.repaired:
        _log.warning("segment %r repaired: %s", name, describe_repair(report))
    return report


def _give_up(log: SegmentLog, scan: LogScan, length: int) -> tuple[tuple[LostRange, ...], int | None]:
    """Make gaps of the damaged ranges, cutting a damaged tail; return them and the cut (or None).

    The tail goes first: its append fails if another writer appended meanwhile, before anything
    else is written. A repair interrupted later leaves damage that the next one finds again.
    """
    lost: list[LostRange] = []
    cut: int | None = None
    tail = scan.damaged[-1] if scan.damaged and scan.damaged[-1].next_offset is None else None
    if tail is not None:
        resume, exact = resume_offset(log, tail.start, tail.first_offset)
        _cut(log, tail.start, length, resume)
        cut = tail.start
    for damaged in scan.damaged:
        if damaged is tail:
            lost.append(LostRange(tail.start, length, range(tail.first_offset, resume), exact))
            continue
        for start, end in damaged.pieces:  # each within one chunk
            log.record_gap(start, end)
        lost.append(LostRange(damaged.start, damaged.end, range(damaged.first_offset, damaged.next_offset)))
    return tuple(lost), cut


def _give_up_after_the_end(log: SegmentLog, scan: LogScan, length: int, covered: int) -> LostRange:
    """The attributes cover the log up to byte ``covered``, past its end ``length``: batches that
    were committed (a merge covers only committed bytes) are no longer part of the log. On local
    disk that is damage to the newest frames of the last chunk that was cut as a torn write. Give
    ``[length, covered)`` up and resume above every offset those bytes could hold: what a torn
    batch's intact header claimed (``SegmentLog.append_offset``), and a bound for the rest."""
    first = scan.next_offset if scan.next_offset is not None else log.next_offset
    claimed = log.append_offset
    torn = log.bytes.torn_tail
    known = length
    if claimed > log.next_offset and torn is not None:
        header = read_header(torn[1], 0, position=torn[0], partial=True)
        known = length + header.size
    unknown = covered - known
    resume = claimed + max(unknown, 0) * RECORDS_PER_BYTE_BOUND
    _cut(log, length, length, resume)
    return LostRange(length, covered, range(first, resume), unknown <= 0)


def _cut(log: SegmentLog, cut: int, length: int, resume: int) -> None:
    """Continue the log after ``length`` at offset ``resume`` and mark ``[cut, length)`` as gaps."""
    empty = encode_batch(resume, [], timestamp=int(time.time() * 1000), position=length)  # sealed for where it lands
    try:
        log.bytes.append(empty, expected_offset=length)
    except BadOffsetError:
        raise StorageError(f"segment {log.segment!r} changed during the repair (another writer appended): "
                           f"stop its writers and repair again") from None
    # One marker per chunk piece: a scan may start at any chunk start (an index, a checkpoint).
    for chunk in log.bytes.chunks():
        low, high = max(chunk.start, cut), min(chunk.end, length)
        if low < high:
            log.record_gap(low, high)


def _delete_index_files(log: SegmentLog, damage: list[Damage], lost: tuple[LostRange, ...]) -> int:
    """Delete damaged chunk index files and those of chunks holding bytes given up (derived data:
    rebuilt on use, with the gaps as record-less bytes)."""
    doomed = {d.where for d in damage if f"/{INDEX_DIR}/" in d.where}
    doomed |= {f"{log.segment}/{INDEX_DIR}/{c.name}" for c in log.bytes.chunks()
               if any(r.start < c.end and c.start < r.end for r in lost)}
    existing = {f"{log.segment}/{INDEX_DIR}/{n}" for n in log.storage.list_files(f"{log.segment}/{INDEX_DIR}")}
    doomed &= existing
    log.storage.delete(sorted(doomed))
    return len(doomed)


def _repair_attributes(storage: ChunkStorage, name: str, options: SegmentOptions, first_damage: int | None,
                       log_start: int, length: int, damaged: bool, tree_name: str | None = None,
                       rebuild: bool = True) -> tuple[bool, str]:
    """Make the attributes consistent with the kept batches; return (rebuilt, explanation).

    The tree holds the updates of the log up to its checkpoint: if that lies past the first damaged
    byte, it may hold updates of batches given up, so it is rebuilt from the kept batches. Below
    it, the tail replayed on open steps over the gaps like any reader."""
    checkpoint = None if damaged else _checkpoint(storage, name, options, tree_name)
    kept_end = length if first_damage is None else first_damage
    beyond_cut = checkpoint is not None and checkpoint > kept_end
    if not damaged and not beyond_cut:
        return False, f"kept: they cover the log up to byte {checkpoint or 0}, before any damaged byte"
    why = ("the attribute index is damaged" if damaged else
           f"the attribute index covers the log up to byte {checkpoint}, past its first damaged byte {kept_end}")
    if (log_start > 0 or not rebuild) and damaged:
        rolled = _roll_back_index(storage, name, log_start, tree_name)
        if rolled is not None:
            return False, f"{why}: {rolled}"
    if not rebuild:
        return False, (f"{why}: kept, the log is not its whole source (an update of a lost batch that was "
                       f"merged before may remain)" if not damaged else f"{why}: no intact version is left")
    if log_start > 0:
        return False, (f"{why}, but retention removed the log below byte {log_start}, so the attributes cannot "
                       f"be rebuilt from it; the index's values up to its checkpoint are kept"
                       + (" (updates from lost batches may remain in it)" if beyond_cut else ""))
    RollingSegment.remove(storage, _tree_name(name, tree_name))
    lock, log = threading.RLock(), _open_log(storage, name, options)
    attributes = AttributeState(log, _tree_name(name, tree_name), options, lock)
    try:
        with lock:
            attributes.open()  # an empty index: the whole log is replayed
            keys = attributes.pending_keys
        attributes.flush()
    finally:
        try:
            attributes.close(merge=False)
        finally:
            log.close()
    return True, f"{why}: rebuilt from the whole log, lost batches left out ({keys} keys)"


def _roll_back_index(storage: ChunkStorage, name: str, log_start: int, tree_name: str | None = None) -> str | None:
    """Roll a damaged index back to its newest intact version if the log still holds everything
    after that version's checkpoint (opening then replays it); None if that is not possible."""
    try:
        rolled = TreeIndex.repair_at(storage, _tree_name(name, tree_name))
    except CorruptDataError:
        return None  # no intact version is left
    checkpoint = rolled.checkpoint or 0
    if checkpoint < log_start:
        return None
    return (f"rolled back to its newest intact version (checkpoint at log byte {checkpoint}); the log after "
            f"it is replayed on open")


def describe_repair(report: SegmentRepairReport) -> str:
    """One line saying what a repair did (for logs and the CLI)."""
    parts = []
    for lost in report.lost:
        offsets = (f"offset {lost.offsets.start} lost" if len(lost.offsets) == 1 else
                   f"offsets {lost.offsets.start}..{lost.offsets.stop - 1} lost" if lost.offsets else "no offsets lost")
        if lost.start == report.cut_at:
            bound = "" if lost.exact else " (an upper bound: some damaged headers could not be read)"
            parts.append(f"damaged tail cut at log byte {lost.start} ({lost.end - lost.start} bytes): {offsets}; "
                         f"appends resume at offset {report.resume_offset}{bound}")
        else:
            parts.append(f"log bytes [{lost.start}, {lost.end}) damaged, now a gap: {offsets}")
    if report.lost and report.kept_after_damage:
        parts.append(f"{report.kept_after_damage} intact batches after the first damaged one kept")
    if report.index_files_deleted:
        parts.append(f"{report.index_files_deleted} chunk index files deleted (rebuilt on use)")
    parts.append(f"attributes {report.attributes}")
    return "; ".join(parts)


__all__ = ["LostRange", "SegmentRepairReport", "SegmentVerifyReport", "describe_repair", "repair_segment", "verify_segment"]
