"""Explicit verification and repair of a segment: its log, chunk index files, gaps and attributes.

Both work from storage alone, so they work on a segment that ``SegmentStore.segment`` refuses to
open. ``verify_segment`` reads every committed byte and reports every damaged range.
``repair_segment`` cuts the log at the first damaged batch: it appends a record-less batch whose
base offset lies above every offset the damaged bytes could have held (so no acknowledged offset
is ever reused), records the damaged bytes as gaps that readers step over, and makes the
attributes consistent with the kept log (rebuilt from the log when the tree covers cut-off bytes
or is itself damaged; the log is the source of truth). Stop the segment's writers first.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs

from storage_adapters import ChunkStorage, RollingSegment
from storage_adapters.rolling import chunk_name

from .tree_index import TreeIndex
from .damage import Damage
from .errors import BadOffsetError, CorruptDataError, StorageError, TruncatedError
from .log.batch import encode_batch
from .log.segment_log import INDEX_DIR, SegmentLog
from .log.verify import scan_log, resume_offset
from .segment import ATTRIBUTES_NAME, Segment, SegmentOptions

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
class SegmentRepairReport:
    """What ``SegmentStore.repair_segment`` did. Offsets ``lost_offsets`` are gone for good."""

    segment: str
    damage: list[Damage]  #: what verification found before the repair
    cut_at: int | None  #: log byte where the log was cut (None: the log was not cut)
    lost_bytes: int  #: committed log bytes cut off (kept on storage, stepped over as gaps)
    first_lost_offset: int | None  #: first record offset lost (None: none)
    resume_offset: int | None  #: the next record gets this offset (None: the log was not cut)
    resume_exact: bool  #: False: ``resume_offset`` is a safe upper bound (damaged headers)
    index_files_deleted: int  #: chunk index files deleted (derived data, rebuilt on use)
    attributes_rebuilt: bool  #: the attribute index was rebuilt from the log
    attributes: str  #: what happened to the attributes, and why
    recommitted_bytes: int = 0  #: whole batches after the committed end whose lost commit records were written again

    @property
    def lost_offsets(self) -> range:
        """Every record offset the repair gave up: no record will ever be read or written there.
        With ``resume_exact`` False some of them may never have held a record."""
        if self.first_lost_offset is None or self.resume_offset is None:
            return range(0)
        return range(self.first_lost_offset, self.resume_offset)

    @property
    def repaired(self) -> bool:
        """Whether anything was changed."""
        return (self.cut_at is not None or self.index_files_deleted > 0 or self.attributes_rebuilt
                or self.recommitted_bytes > 0)


VERIFY_ATTEMPTS = 5


def _open_log(storage: ChunkStorage, name: str, options: SegmentOptions) -> SegmentLog:
    return SegmentLog(storage, name, rolling_size=options.log_rolling_size,
                      index_interval_bytes=options.index_interval_bytes)


def _tree_name(name: str, tree_name: str | None) -> str:
    """Where segment ``name``'s attribute B+tree lives (see ``Segment``'s ``tree_name``)."""
    return f"{name}/{ATTRIBUTES_NAME}" if tree_name is None else tree_name


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
    for _attempt in range(VERIFY_ATTEMPTS):
        try:
            return _verify_once(storage, name, options, tree_name)
        except TruncatedError:  # retention removed what was being read: look again
            continue
    raise StorageError(f"segment {name!r}: retention changed the log under verification {VERIFY_ATTEMPTS} times; "
                       "verify it when its writers are idle")


def _verify_once(storage: ChunkStorage, name: str, options: SegmentOptions, tree_name: str | None) -> SegmentVerifyReport:
    # Read before the log: a merge covers only committed bytes, so it cannot pass the length read later.
    covered_before = _readable_checkpoint(storage, name, options, tree_name)
    log = _open_log(storage, name, options)
    try:
        scan = scan_log(log)
        start, length = log.bytes.start_offset, log.bytes.length
        lost = log.lost_commits(covered_before)
    finally:
        log.close()
    if lost is not None:
        position, data = lost
        scan.damage.append(Damage(f"{name}/_log", position, position + len(data),
                                  "whole record batches after the committed end: their commit records were lost"))
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
    """Cut the log at its first damaged batch (if any) and make the attributes consistent with it.

    ``tree_name`` as for ``verify_segment``. ``rebuild_attributes=False`` never rebuilds the
    B+tree from the log (the plain index's tree holds what was merged before its WAL began, so
    the log is not its whole source); it is rolled back or kept instead. Raises ``StorageError`` if another writer appended
    meanwhile (stop writers, run it again).
    """
    covered = _readable_checkpoint(storage, name, options, tree_name)
    log = _open_log(storage, name, options)
    try:
        recommitted = _recommit(log, covered)
        scan = scan_log(log)
        log_start, length = log.bytes.start_offset, log.bytes.length
        cut, first_lost, resume, exact = scan.first_damage, None, None, True
        if cut is not None:
            first_lost = scan.offset_at_damage or 0
            resume, exact = resume_offset(log, cut, first_lost)
            _cut(log, cut, length, resume)
        deleted = _delete_index_files(log, scan.damage, cut)
    finally:
        log.close()
    attribute_damage = _verify_attributes(storage, name, options, tree_name)[1]
    rebuilt, attributes = _repair_attributes(storage, name, options, cut, log_start, length,
                                             bool(attribute_damage), tree_name, rebuild_attributes)
    report = SegmentRepairReport(name, scan.damage + attribute_damage, cut, 0 if cut is None else length - cut,
                                 first_lost, resume, exact, deleted, rebuilt, attributes, recommitted)
    if report.repaired:
        _log.warning("segment %r repaired: %s", name, describe_repair(report))
    return report


def _recommit(log: SegmentLog, covered: int) -> int:
    """Commit again the whole batches found after the committed end (lost commit records): the
    same bytes appended at the same place, so the data is kept. Returns the bytes recommitted."""
    lost = log.lost_commits(covered)
    if lost is None:
        return 0
    position, data = lost
    log.bytes.append(data, expected_offset=position)
    _log.warning("segment %r: %d bytes of whole batches after the committed end %d had lost their commit "
                 "records; committed them again", log.segment, len(data), position)
    return len(data)


def _cut(log: SegmentLog, cut: int, length: int, resume: int) -> None:
    """Continue the log after ``length`` at offset ``resume`` and mark ``[cut, length)`` as gaps."""
    empty = encode_batch(resume, [], timestamp=int(time.time() * 1000))
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


def _delete_index_files(log: SegmentLog, damage: list[Damage], cut: int | None) -> int:
    """Delete damaged chunk index files and those of chunks the cut runs through (derived data)."""
    doomed = {d.where for d in damage if f"/{INDEX_DIR}/" in d.where}
    if cut is not None:
        doomed |= {f"{log.segment}/{INDEX_DIR}/{chunk_name(c.start)}" for c in log.bytes.chunks() if c.end > cut}
    existing = {f"{log.segment}/{INDEX_DIR}/{n}" for n in log.storage.list_files(f"{log.segment}/{INDEX_DIR}")}
    doomed &= existing
    log.storage.delete(sorted(doomed))
    return len(doomed)


def _repair_attributes(storage: ChunkStorage, name: str, options: SegmentOptions, cut: int | None,
                       log_start: int, length: int, damaged: bool, tree_name: str | None = None,
                       rebuild: bool = True) -> tuple[bool, str]:
    """Make the attributes consistent with the kept log; return (rebuilt, explanation)."""
    checkpoint = None if damaged else _checkpoint(storage, name, options, tree_name)
    kept_end = length if cut is None else cut
    beyond_cut = checkpoint is not None and checkpoint > kept_end
    if not damaged and not beyond_cut:
        return False, f"kept: they cover the log up to byte {checkpoint or 0}, within the kept log"
    why = ("the attribute index is damaged" if damaged else
           f"the attribute index covers the log up to byte {checkpoint}, beyond the kept log's end at {kept_end}")
    if (log_start > 0 or not rebuild) and damaged:
        rolled = _roll_back_index(storage, name, log_start, tree_name)
        if rolled is not None:
            return False, f"{why}: {rolled}"
    if not rebuild:
        return False, (f"{why}: kept, the log is not its whole source (an update of a cut-off batch that was "
                       f"merged before may remain)" if not damaged else f"{why}: no intact version is left")
    if log_start > 0:
        return False, (f"{why}, but retention removed the log below byte {log_start}, so the attributes cannot "
                       f"be rebuilt from it; the index's values up to its checkpoint are kept"
                       + (" (updates from cut-off batches may remain in it)" if beyond_cut else ""))
    RollingSegment(storage, _tree_name(name, tree_name)).delete()
    segment = Segment(storage, name, options, tree_name=tree_name)  # an empty index: the whole log is replayed
    try:
        keys = segment.stats().pending_attributes
        segment.flush()
    finally:
        segment.close()
    return True, f"{why}: rebuilt from the whole log ({keys} keys)"


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
    if report.recommitted_bytes:
        parts.append(f"{report.recommitted_bytes} bytes of whole batches whose commit records were lost committed "
                     "again (nothing lost)")
    if report.cut_at is not None:
        lost = report.lost_offsets
        bound = "" if report.resume_exact else " (an upper bound: some damaged headers could not be read)"
        offsets = f"offsets {lost.start}..{lost.stop - 1} lost" if lost else "no offsets lost"
        parts.append(f"log cut at byte {report.cut_at} ({report.lost_bytes} bytes); {offsets}; appends resume "
                     f"at offset {report.resume_offset}{bound}")
    if report.index_files_deleted:
        parts.append(f"{report.index_files_deleted} chunk index files deleted (rebuilt on use)")
    parts.append(f"attributes {report.attributes}")
    return "; ".join(parts)


__all__ = ["SegmentRepairReport", "SegmentVerifyReport", "describe_repair", "repair_segment", "verify_segment"]
