"""Progressive compaction policies: which old pages an update also relocates to the tail.

Every index entry records the smallest offset in its child's subtree, so the pages stored below any
offset ``T`` can be found by descending only into children whose minimum is below ``T``. An update
relocates (rewrites at the tail) every live page below the threshold the policy returns, then the
storage is truncated at the new root's minimum offset.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class TreeShape:
    """What a policy may look at: the tree's state before the update."""

    length: int  # bytes ever appended to the index segment
    min_offset: int  # smallest offset of a live page
    live_bytes: int  # bytes of the pages reachable from the root
    page_size: int
    last_update: int = 0  # bytes of the previous update: an estimate of what this one appends


class NoCompaction:
    """Relocate and truncate nothing: the storage only grows (Pravega's baseline, for experiments)."""

    name = "none"
    truncates = False

    def threshold(self, shape: TreeShape) -> int:
        return 0


class OnePagePolicy:
    """Pravega's policy: relocate exactly the page with the smallest offset (and its path)."""

    name = "pravega"
    truncates = True

    def threshold(self, shape: TreeShape) -> int:
        return shape.min_offset + 1


@attrs.frozen
class BoundedPolicy:
    """Keep ``(length - min_offset) / live_bytes`` near ``target_ratio`` after every update.

    The update about to be written will add about as many bytes as the previous one, so every live
    page stored below ``length + last_update - target_ratio * live_bytes`` is relocated: the head of
    the storage is swept as fast as garbage accumulates, and nothing moves while the retained bytes
    are within the target. One update sweeps at most ``max(max_sweep_pages pages, max_sweep_updates
    updates)`` worth of offsets, so no single update stalls on a large relocation.
    """

    target_ratio: float = 1.45
    max_sweep_pages: int = 16
    max_sweep_updates: int = 4
    name = "bounded"
    truncates = True

    def threshold(self, shape: TreeShape) -> int:
        wanted = shape.length + shape.last_update - int(self.target_ratio * shape.live_bytes)
        sweep = max(self.max_sweep_pages * shape.page_size, self.max_sweep_updates * shape.last_update)
        return min(max(wanted, 0), shape.min_offset + sweep)


def policy_for(compaction: bool | str | object) -> NoCompaction | OnePagePolicy | BoundedPolicy:
    """``True``/"bounded" (default), ``False``/"none", "pravega", or a policy object."""
    if compaction is True or compaction == "bounded":
        return BoundedPolicy()
    if compaction is False or compaction == "none":
        return NoCompaction()
    if compaction == "pravega":
        return OnePagePolicy()
    if hasattr(compaction, "threshold"):
        return compaction  # type: ignore[return-value]
    from ..errors import InvalidInputError

    raise InvalidInputError(f"compaction must be True, False, 'bounded', 'pravega' or 'none', got {compaction!r}")
