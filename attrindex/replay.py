"""Replaying the log's attribute updates into an overlay: how every path builds tier 1 (no I/O of
its own; it reads through the ``SegmentLog`` it is given).

A B+tree version covers the log up to its checkpoint; tier 1 holds the updates of the batches
after it. Opening a segment, loading its attributes lazily, rebuilding tier 1 after another
handle's cut, and the merge worker all replay with these two functions:

* ``replaying`` makes the visitor a log scan calls for each batch (``SegmentLog.catch_up``);
* ``replay_range`` replays the batches between two positions of the log's current view into a new
  overlay, built aside so that a failed read leaves nothing half-applied.
"""

from __future__ import annotations

from typing import Callable

from .log.batch.decode import decode_attribute_updates
from .log.batch.header import BatchHeader
from .log.segment_log import BatchVisitor, SegmentLog
from .overlay import AttributeOverlay


def replaying(overlay: AttributeOverlay, since: int, segment: str,
              applied: Callable[[], None] | None = None) -> BatchVisitor:
    """The visitor that applies to ``overlay`` the attribute updates of each batch at log byte
    ``since`` or later (earlier ones are in the tree), calling ``applied()`` after each apply."""
    def replay(position: int, header: BatchHeader, buf: bytes, pos: int) -> None:
        if header.attribute_count and position >= since:
            keys, values = decode_attribute_updates(buf, pos, header, position=position - pos, segment=segment)
            overlay.apply(keys, values)
            if applied is not None:
                applied()
    return replay


def replay_range(log: SegmentLog, since: int, until: int) -> tuple[AttributeOverlay, int]:
    """``(overlay, batches replayed)``: a new overlay holding the attribute updates of the batches
    of ``log`` in ``[since, until)``, which must be batch boundaries of its
    current view (checkpoints and freeze positions are)."""
    overlay = AttributeOverlay()
    replay, count = replaying(overlay, since, log.segment), 0
    for position, header, buf, pos in log.batches(since, until):
        replay(position, header, buf, pos)
        count += 1
    return overlay, count


__all__ = ["replay_range", "replaying"]
