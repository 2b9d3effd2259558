"""Replaying the log's attribute updates into an overlay: how every path builds tier 1.

A B+tree version covers the log up to its checkpoint; tier 1 holds the updates of the batches
after it. Every path that builds tier 1 is here, log positions in, an overlay and the checkpoint
it starts from out. They read through the ``SegmentLog`` and tree they are given (no I/O of their
own) and check the same two things: that the log still holds everything after the checkpoint
(another handle's retention may have merged and cut meanwhile) and that the checkpoint is not
past the log's end (lost commits).

* ``open_at_checkpoint``: an eager open, the log's view opened at the tree's checkpoint and
  scanned to its end with the ``replaying`` visitor;
* ``adopt_tree``: a lazy load, a tree opened after the log's view moved on;
* ``from_newest_tree``: a rebuild after another handle's merge or cut;
* ``for_merge``: the merge worker's replay of ``[checkpoint, at)``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .errors import CorruptDataError, RetriesExhaustedError, StorageError, TruncatedError
from .log.batch.decode import decode_attribute_updates
from .log.batch.header import BatchHeader
from .log.segment_log import BatchVisitor, SegmentLog
from .overlay import AttributeOverlay

MAX_TREE_REFRESH_ATTEMPTS = 10  #: tree versions looked at before a replay gives up on other handles' cuts

_log = logging.getLogger("attrindex.segment")


def replaying(overlay: AttributeOverlay, since: int, segment: str,
              applied: Callable[[], None] | None = None) -> BatchVisitor:
    """The visitor that applies to ``overlay`` the attribute updates of each batch at log byte
    ``since`` or later (earlier ones are in the tree), folding its recent part when due (``AttributeOverlay.fold_due``)
    and calling ``applied()`` after each apply (an owner whose overlay is published republishes
    there after a fold)."""
    def replay(position: int, header: BatchHeader, buf: bytes, pos: int) -> None:
        if header.attribute_count and position >= since:
            keys, values = decode_attribute_updates(buf, pos, header, position=position - pos, segment=segment)
            overlay.apply(keys, values)
            if overlay.fold_due:  # (memory: tier 1 in compact columns)
                overlay.fold()
            if applied is not None:
                applied()
    return replay


def replay_range(log: SegmentLog, since: int, until: int) -> tuple[AttributeOverlay, int]:
    """``(overlay, batches replayed)``: a new overlay holding the attribute updates of the batches
    of ``log`` in ``[since, until)``, which must be batch boundaries of its current view
    (checkpoints and freeze positions are). Built aside: a failed read leaves nothing half-applied."""
    overlay = AttributeOverlay()
    replay, count = replaying(overlay, since, log.segment), 0
    for position, header, buf, pos in log.batches(since, until):
        replay(position, header, buf, pos)
        count += 1
    return overlay, count


def lost_between_error(log: SegmentLog, checkpoint: int) -> CorruptDataError:
    return CorruptDataError(
        f"segment {log.segment!r}: the attribute index covers the log up to byte {checkpoint}, but the log "
        f"starts at {log.start_position}: attribute updates in between are lost",
        segment=log.segment, offset=checkpoint)


def beyond_log_error(log: SegmentLog, checkpoint: int) -> CorruptDataError:
    return CorruptDataError(
        f"segment {log.segment!r}: the attribute index covers the log up to byte {checkpoint}, beyond the "
        f"log's committed length {log.bytes.length}: committed log data was lost. The segment "
        f"refuses appends until repaired: see SegmentStore.verify_segment / repair_segment",
        segment=log.segment, offset=log.bytes.length)


def open_at_checkpoint(log: SegmentLog, tree: Any, overlay: AttributeOverlay, applied: Callable[[], None]) -> int:
    """Open the log's view at ``tree``'s checkpoint and replay everything after it into
    ``overlay`` (cleared first); return the batches replayed. ``TruncatedError`` when retention
    elsewhere removed what was being replayed and the tree moved on (the caller reads the tree
    again and retries)."""
    checkpoint = tree.checkpoint or 0
    overlay.clear()
    resyncs = log.resyncs
    log.open_at(checkpoint)
    # Checked on the view open_at just listed, not an older one: another handle may have merged
    # past this tree version and truncated the log below its new checkpoint since the tree was
    # read, and open_at would then start at the log's new start, silently skipping the updates
    # in between (they are in the newer tree version only).
    if checkpoint < log.start_position:
        tree.refresh()
        if (tree.checkpoint or 0) != checkpoint:
            raise TruncatedError(log.segment, checkpoint, 0, log.start_position, log.bytes.length)
        if log.bytes.length > log.start_position:
            raise lost_between_error(log, checkpoint)
    replayed = log.catch_up(replaying(overlay, checkpoint, log.segment, applied), refresh=False)
    if log.resyncs != resyncs or any(c.generation and c.end > checkpoint for c in log.bytes.chunks()):
        # Chunks above this tree version's checkpoint were rewritten (log compaction drops the
        # attribute updates of batches below its limit, a newer tree checkpoint) since the tree
        # was read: the replay may have missed updates only a newer tree version holds.
        tree.refresh()
        if (tree.checkpoint or 0) != checkpoint:
            raise TruncatedError(log.segment, checkpoint, 0, log.start_position, log.bytes.length)
    if checkpoint > log.bytes.length:
        raise beyond_log_error(log, checkpoint)
    _log.debug("segment %r: opened at log byte %d; replayed %d batches after the attribute checkpoint %d",
               log.segment, log.position, replayed, checkpoint)
    return replayed


def adopt_tree(log: SegmentLog, tree: Any) -> tuple[AttributeOverlay, int]:
    """For a tree opened after the log's view (a lazy load): the checks of ``open_at_checkpoint``,
    then ``(overlay, batches)`` replayed between its checkpoint and the log's CURRENT position
    (readers moved it since the log's open)."""
    for _attempt in range(MAX_TREE_REFRESH_ATTEMPTS):
        checkpoint = tree.checkpoint or 0
        if checkpoint > log.position:  # others merged past this view: look at the log's tail
            log.catch_up(None)
        if not (checkpoint < log.start_position and log.bytes.length > log.start_position):
            break
        # The log's view is newer than the tree: retention elsewhere merged first, then cut.
        tree.refresh()
        if (tree.checkpoint or 0) == checkpoint:
            raise lost_between_error(log, checkpoint)
    else:
        raise RetriesExhaustedError(f"segment {log.segment!r}: retention in another handle kept moving the log's start "
                                    f"while the attributes were loaded ({MAX_TREE_REFRESH_ATTEMPTS} tries)")
    if checkpoint > log.bytes.length:
        raise beyond_log_error(log, checkpoint)
    return replay_range(log, max(checkpoint, log.start_position), log.position)


def from_newest_tree(log: SegmentLog, tree: Any) -> tuple[AttributeOverlay, int]:
    """``(overlay, checkpoint)``: the log's updates between the newest version of ``tree`` that
    covers the log's start and the log's position, and that version's checkpoint (a rebuild of
    tier 1 after another handle merged further or cut the log).

    The checks of ``adopt_tree``: a log cut past the newest version's checkpoint, with batches
    after the cut, lost the updates in between (``CorruptDataError``: every handle merges before
    it cuts, so a version covering the cut exists unless something was lost). Newer versions that
    keep coming without covering the log's start (``MAX_TREE_REFRESH_ATTEMPTS``) raise
    ``RetriesExhaustedError``: replaying from the log's start over such a version would lose the
    updates between its checkpoint and the cut."""
    for _attempt in range(MAX_TREE_REFRESH_ATTEMPTS):
        checkpoint = tree.checkpoint or 0
        if checkpoint >= log.start_position or log.bytes.length <= log.start_position:
            break
        tree.refresh()
        if (tree.checkpoint or 0) == checkpoint:
            raise lost_between_error(log, checkpoint)
    else:
        if (tree.checkpoint or 0) < log.start_position < log.bytes.length:
            raise RetriesExhaustedError(
                f"segment {log.segment!r}: other handles kept merging and cutting the log while tier 1 was "
                f"rebuilt: {MAX_TREE_REFRESH_ATTEMPTS} tree versions in a row did not cover the log's start; "
                "try again")
    checkpoint = tree.checkpoint or 0
    rebuilt, _batches = replay_range(log, max(checkpoint, log.start_position), log.position)
    return rebuilt, checkpoint


def for_merge(log: SegmentLog, since: int, at: int) -> AttributeOverlay:
    """The merge worker's replay: the updates of the log's batches in ``[since, at)`` (the tree's
    checkpoint and the frozen overlay's position: batch boundaries), the log's view opened at
    ``since`` first."""
    log.open_at(since)
    if since < log.start_position:
        raise StorageError(f"segment {log.segment!r}: the log starts at byte {log.start_position}, after the tree's "
                           f"checkpoint {since}: the updates in between are not in the log")
    return replay_range(log, since, at)[0]


__all__ = ["adopt_tree", "for_merge", "from_newest_tree", "open_at_checkpoint", "replay_range", "replaying"]
