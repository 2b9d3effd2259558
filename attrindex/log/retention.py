"""Which chunks retention deletes (Kafka's rules by start offset, total size and age), and the
cut of the log there."""

from __future__ import annotations

from typing import Callable

from ..errors import LayoutConflictError, RetriesExhaustedError
from .reads import MAX_RESYNC_ATTEMPTS

_NO_TIMESTAMP = -(1 << 63)


def cut_log(log, max_age_ms: int | None, max_bytes: int | None, start_offset: int | None, now_ms: int, *,
            append_empty: Callable[[], int], catch_up: Callable[[], object]) -> tuple[int, int]:
    """Truncate ``log`` where ``plan_retention`` says; ``(the byte position cut at, or 0 if nothing
    was cut; chunks deleted)``. The caller holds the log's writers off and has merged its attributes.

    If the cut would leave nothing readable, ``append_empty()`` first appends an empty batch that
    keeps the next offset (Kafka rolls a new segment for the same reason) and gives its position.
    If another handle's compaction rewrote the chunk holding the cut since the plan
    (``LayoutConflictError`` from ``truncate_at``), ``catch_up()`` and plan again on the new layout.
    """
    for _attempt in range(MAX_RESYNC_ATTEMPTS):
        position, deleted = plan_retention(log, max_age_ms, max_bytes, start_offset, now_ms)
        if position >= log.position > log.start_position:
            position = append_empty()
        if position <= log.start_position:
            return 0, deleted
        try:
            log.truncate_at(position)
        except LayoutConflictError:
            catch_up()
            continue
        return position, deleted
    raise RetriesExhaustedError(f"segment {log.segment!r}: compactions in other handles kept rewriting the chunk "
                                f"retention would cut ({MAX_RESYNC_ATTEMPTS} tries); nothing was removed")


def plan_retention(log, max_age_ms: int | None, max_bytes: int | None, start_offset: int | None,
                   now_ms: int) -> tuple[int, int]:
    """The byte position to truncate the log at, and how many whole chunks that deletes.

    Walks the chunks from the oldest and deletes while one of the rules selects the chunk: its
    records all lie below ``start_offset``; the log without it still holds at least ``max_bytes``;
    its newest record is older than ``max_age_ms`` (a chunk without records counts as old). It
    stops at the first chunk no rule selects, and never deletes the last chunk (it is the one
    being appended to). A ``start_offset`` inside the first kept chunk then truncates at the batch
    holding it.
    """
    summaries = log.chunk_summaries()
    if not summaries:
        return log.start_position, 0
    start = log.start_position
    total = sum(s.chunk_start + s.size - max(s.chunk_start, start) for s in summaries)
    deleted = 0
    for summary in summaries[:-1]:
        size = summary.chunk_start + summary.size - max(summary.chunk_start, start)
        below_start = start_offset is not None and summary.next_offset <= start_offset
        over_size = max_bytes is not None and total - size >= max_bytes
        too_old = max_age_ms is not None and (summary.max_timestamp == _NO_TIMESTAMP
                                              or now_ms - summary.max_timestamp > max_age_ms)
        if not (below_start or over_size or too_old):
            break
        total -= size
        deleted += 1
    if deleted:
        start = summaries[deleted].chunk_start
    if start_offset is not None:
        start = max(start, log.batch_position(start_offset))
    return start, deleted
