"""Explicit repair of a B+tree: roll back to the newest version whose footer and live pages verify.

Nothing is overwritten: the kept version's footer is appended again, re-encoded at its new offset, so
it becomes the tail, and the report says exactly what was lost. The copy's ``update_length`` spans
the abandoned bytes too, so the chain of updates leads from it straight to the kept version and a
verification after the repair passes (its footer's kind, a copy, tells verification so).
"""

from __future__ import annotations

import logging

import attrs

from storage_adapters import RollingSegment
from storage_adapters.errors import CorruptDataError

from ..damage import Damage
from .footer import COPY, EMPTY, FOOTER_SIZE
from .verify import Version, check_tree, survey_chain

log = logging.getLogger("attrindex.btree")


@attrs.frozen
class IndexRepairReport:
    """What ``repair`` did. ``rolled_back`` is False when the newest version was intact."""

    rolled_back: bool
    kept_footer_offset: int  #: where the kept version's footer was found (-1: the empty initial version)
    lost_start: int  #: the bytes [lost_start, lost_end) no longer count (the dropped updates)
    lost_end: int
    updates_dropped: int  #: updates after the kept version (an undecodable tail footer counts as one)
    entries_before: int | None  #: the newest footer's entry count (None if it did not decode)
    entries_after: int
    checkpoint: int | None  #: the kept version's log checkpoint (None if it has none)
    damage: list[Damage] = attrs.field(factory=list)  #: what verification found before the repair


def repair_index(segment: RollingSegment) -> IndexRepairReport:
    """Make the newest intact version of the index in ``segment`` its tail (see the module doc).

    Raises ``CorruptDataError`` when no intact version remains (its pages were truncated): the index
    must then be rebuilt from its source. Concurrent writers must be stopped first; an append race
    is reported as ``BadOffsetError`` and nothing is written.
    """
    segment.refresh()
    survey = survey_chain(segment)
    newest = survey.versions[0] if survey.versions else None
    entries_before = newest.footer.entry_count if newest is not None and survey.tail_intact else None
    for dropped, version in enumerate(_candidates(survey)):
        if version.footer.root_length and check_tree(segment, version)[3]:
            continue
        updates_dropped = dropped + (0 if survey.tail_intact else 1)
        checkpoint = None if version.footer.checkpoint < 0 else version.footer.checkpoint
        kept_end = version.offset + FOOTER_SIZE if version.offset >= 0 else 0
        if updates_dropped == 0:
            return IndexRepairReport(False, version.offset, survey.length, survey.length, 0, entries_before,
                                     version.footer.entry_count, checkpoint, survey.damage)
        span = survey.length + FOOTER_SIZE - kept_end
        # The field is a u32: past 4 GiB of abandoned bytes the copy is a plain footer-only update,
        # and verification reports those bytes until compaction truncates them.
        footer = attrs.evolve(version.footer, update_length=span if span < 1 << 32 else FOOTER_SIZE, kind=COPY)
        if version.offset < 0:  # the empty initial version: its truncation offset is its own footer
            footer = attrs.evolve(footer, min_offset=survey.length)
        segment.append(footer.encode(survey.length), expected_offset=survey.length)
        report = IndexRepairReport(True, version.offset, kept_end, survey.length, updates_dropped, entries_before,
                                   version.footer.entry_count, checkpoint, survey.damage)
        log.warning("segment %r: B+tree repaired by rolling back to the version whose footer is at offset %d: "
                    "%d update(s) dropped, bytes [%d, %d) no longer count, entries %s -> %d",
                    segment.name, version.offset, updates_dropped, kept_end, survey.length,
                    "unknown" if entries_before is None else entries_before, version.footer.entry_count)
        return report
    raise CorruptDataError(
        f"segment {segment.name!r}: no intact version of the B+tree remains in [{survey.start}, {survey.length}) "
        "(the pages of every older version were truncated); the index must be rebuilt from its source "
        "(a segment's attributes are rebuilt from its log)",
        segment=segment.name,
        offset=survey.start,
    )


def _candidates(survey):
    """The versions to try, newest first; the empty initial version last if nothing was truncated."""
    yield from survey.versions
    if survey.start == 0:
        yield Version(-1, EMPTY)
