"""Verification of a B+tree's storage: every committed byte read, every damaged range reported.

It works from the segment alone (no ``BTreeIndex``), so it also checks an index that refuses to
open. Two passes:

* the chain of updates, walked backwards from the tail: each footer must decode, and its
  ``update_length`` leads to the footer before it, down to the truncation offset; the pages each
  update wrote (live or dead) are parsed one after the other and checked;
* the tree of the newest intact footer: every live page's checksum, key order, routing, depth and
  subtree minimum offsets, and the footer's counts.
"""

from __future__ import annotations

from typing import Callable

import attrs

from storage_adapters import RollingSegment
from storage_adapters.errors import CorruptDataError, OffsetOutOfRangeError, RetriesExhaustedError

from ..arguments import check_progress
from ..damage import Damage
from ..keys import MIN_KEY
from .footer import COPY, FOOTER_SIZE, Footer, decode_footer, find_last_footer
from .page import HEADER, HEADER_SIZE, LEAF, RUN_LEAF, IndexPage, RunLeafPage, check_page, decode_page, page_size
from .runs import TreeRef, decode_runs, read_filter
from .tree import chunk_of

_SCAN_WINDOW = 1 << 20
MAX_VERIFY_ATTEMPTS = 5  # a verification that raced a writer's truncation is run again on the new listing


@attrs.frozen
class VerifyReport:
    """What ``verify`` checked, and every damaged range it found (``ok``: none)."""

    pages: int  #: live pages of the checked version
    entries: int
    bytes: int  #: bytes of the live pages
    height: int
    damage: list[Damage] = attrs.field(factory=list)
    updates: int = 0  #: updates (footers) in the retained range whose footer decoded

    @property
    def ok(self) -> bool:
        return not self.damage


@attrs.frozen
class Version:
    """One footer found in the retained range."""

    offset: int
    footer: Footer


@attrs.frozen
class Survey:
    """The chain of updates of a segment: its versions newest first, and the damage found in it."""

    length: int
    start: int
    versions: list[Version]
    tail_intact: bool  # the bytes ending at the segment's length are a valid footer
    damage: list[Damage]


def verify_index(segment: RollingSegment, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Read every committed byte of the index in ``segment`` and report every damaged range.

    The live tree checked is the tail footer's, or, if that footer is damaged, the newest one that
    decodes (the version ``repair`` would keep). ``progress(pages_done, pages_total)`` is called as
    live pages are checked. Raises only for storage failures, never for damage.
    """
    check_progress(progress)
    segment.refresh()
    for _ in range(MAX_VERIFY_ATTEMPTS):
        try:
            survey = survey_chain(segment)
            report = _report(segment, survey, progress)
        except OffsetOutOfRangeError:  # a writer truncated what was being read: look again
            segment.refresh()
            continue
        if report.ok:
            return report
        segment.refresh()
        if (segment.length, segment.start_offset) == (survey.length, survey.start):
            return report  # nobody wrote meanwhile: the damage is real
    # Damage seen while a writer kept compacting may be pages it freed meanwhile: not reported as such.
    raise RetriesExhaustedError(f"segment {segment.name!r}: the index changed under verification {MAX_VERIFY_ATTEMPTS} times; "
                                "verify it when its writers are idle")


def _report(segment: RollingSegment, survey: Survey, progress) -> VerifyReport:
    damage = list(survey.damage)
    if not survey.versions:
        return VerifyReport(0, 0, 0, 0, damage, 0)
    newest = survey.versions[0]
    pages, entries, size, tree_damage = check_tree(segment, newest, progress)
    # A live page damaged at rest is met by both passes: report each range once.
    unique = list(dict.fromkeys(damage + tree_damage))
    height = newest.footer.height
    if newest.footer.has_runs and not tree_damage:  # (the main tree's height, from the runs page)
        root = newest.footer
        height = decode_runs(segment.read(root.root_offset, root.root_length), root.root_offset, segment.name)[0].height
    return VerifyReport(pages, entries, size, height, unique, len(survey.versions))


def survey_chain(segment: RollingSegment) -> Survey:
    """Walk the updates in ``[start_offset, length)`` backwards from the tail footer."""
    length, start = segment.length, segment.start_offset
    versions: list[Version] = []
    damage: list[Damage] = []
    tail_intact = length == 0
    if length and length <= start:
        damage.append(_damage(segment, start, start, f"the truncation offset {start} is not below the length {length}"))
    end = length
    while end > start:
        at = end - FOOTER_SIZE
        if at < start:
            damage.append(_damage(segment, start, end, f"the footer at offset {at} lies below the truncation offset {start}"))
            break
        footer = decode_footer(segment.read(at, FOOTER_SIZE), at)
        if footer is None:
            which = "the newest footer" if end == length else "a footer"
            damage.append(_damage(segment, at, end, f"{which} at offset {at} is invalid (no valid B+tree footer ends at {end})"))
            found = _previous_footer(segment, start, at)
            if found is None:
                break
            end = found.offset + FOOTER_SIZE
            continue
        tail_intact = tail_intact or end == length
        versions.append(Version(at, footer))
        update_start = end - footer.update_length
        if not is_rollback(footer):
            # The oldest retained update may be cut by the truncation offset, which is always the
            # offset of a page (a version's minimum offset): its pages are parsed from there.
            damage += _check_update_pages(segment, max(update_start, start), at)
        end = update_start
    return Survey(length, start, versions, tail_intact, damage)


def is_rollback(footer: Footer) -> bool:
    """Whether ``footer`` was appended by a repair: the bytes of its update before it are the ones
    the repair abandoned (an update's and a piece's bytes are pages, and are checked)."""
    return footer.kind == COPY


def _previous_footer(segment: RollingSegment, start: int, before: int) -> Version | None:
    """The last valid footer that starts below ``before`` (and at or above ``start``), scanning back."""
    window_end = before
    while window_end > start:
        window_start = max(start, window_end - _SCAN_WINDOW)
        # Windows overlap by a footer so one straddling a boundary is still found.
        data = segment.read(window_start, min(before, window_end + FOOTER_SIZE) - window_start)
        found = find_last_footer(data, window_start)
        if found is not None:
            return Version(found[0], found[1])
        window_end = window_start
    return None


def _check_update_pages(segment: RollingSegment, begin: int, footer_offset: int) -> list[Damage]:
    """Parse the pages one update wrote (they fill ``[begin, footer_offset)``) and check each."""
    data = segment.read(begin, footer_offset - begin)
    view = memoryview(data)
    position = 0
    while position < len(data):
        offset = begin + position
        if len(data) - position < HEADER_SIZE:
            return [_damage(segment, offset, footer_offset, "the update's pages do not end at its footer")]
        _version, kind, _reserved, count, _crc = HEADER.unpack_from(data, position)
        size = page_size(kind, count)
        if size is None or position + size > len(data):
            return [_damage(segment, offset, footer_offset, f"B+tree page at offset {offset}: unreadable page header")]
        try:
            check_page(view[position:position + size], offset, segment.name)
        except CorruptDataError as error:
            return [_damage(segment, offset, footer_offset, str(error))]
        position += size
    return []


def check_tree(segment: RollingSegment, version: Version, progress=None) -> tuple[int, int, int, list[Damage]]:
    """Check every live page of ``version``: ``(pages, entries, bytes, damage)``. A version
    with sorted runs: its runs page, the main tree, and each run's tree and key filter."""
    footer = version.footer
    if not footer.root_length:
        return 0, 0, 0, []
    if not footer.has_runs:
        pages, entries, size, damage = _check_one(segment, TreeRef.of_footer(footer), LEAF, footer.page_count, progress)
    else:
        offset, length = footer.root_offset, footer.root_length
        try:
            main, runs = decode_runs(segment.read(offset, length), offset, segment.name)
        except (CorruptDataError, OffsetOutOfRangeError) as error:
            return 0, 0, 0, [_damage(segment, offset, offset + length, str(error))]
        pages, entries, size, damage = 1, 0, length, []
        for run in runs:
            at, n = run.filter_offset, run.filter_length
            try:
                read_filter(segment.read(at, n), at, segment.name)
                pages, size = pages + 1, size + n
            except (CorruptDataError, OffsetOutOfRangeError) as error:
                damage.append(_damage(segment, at, at + n, str(error)))
        for tree, kind in [(main, LEAF), *((run.tree, RUN_LEAF) for run in runs)]:
            if not tree.length:
                continue
            counted = _check_one(segment, tree, kind, footer.page_count, progress, pages)
            pages, entries, size = pages + counted[0], entries + counted[1], size + counted[2]
            damage += counted[3]
            if not counted[3] and counted[:3] != (tree.pages, tree.entries, tree.live_bytes):
                damage.append(_damage(segment, offset, offset + length,
                                      f"the runs page at offset {offset} counts {tree.pages} pages, {tree.entries} entries, "
                                      f"{tree.live_bytes} bytes for the tree at offset {tree.offset}, which holds "
                                      f"{counted[0]}, {counted[1]}, {counted[2]}"))
    if not damage and (pages, entries, size) != (footer.page_count, footer.entry_count, footer.live_bytes):
        damage.append(_damage(
            segment, version.offset, version.offset + FOOTER_SIZE,
            f"footer counts {footer.page_count} pages, {footer.entry_count} entries, {footer.live_bytes} bytes "
            f"but the tree holds {pages}, {entries}, {size}"))
    return pages, entries, size, damage


def _check_one(segment: RollingSegment, tree: TreeRef, leaf_kind: int, total: int, progress,
               done: int = 0) -> tuple[int, int, int, list[Damage]]:
    """Check every page of one stored tree (the main tree, or a run's with ``RUN_LEAF`` leaves):
    ``(pages, entries, bytes, damage)``; ``progress`` counts on from ``done`` of ``total``."""
    damage: list[Damage] = []
    pages = entries = size = 0
    # (offset, length, low key, high key or None, depth, expected min offset)
    stack = [(tree.offset, tree.length, MIN_KEY, None, 1, tree.min_offset)]
    while stack:
        offset, length, low, high, depth, expected_min = stack.pop()
        try:
            page = decode_page(segment.read(offset, length), offset, segment.name)
        except (CorruptDataError, OffsetOutOfRangeError) as error:
            damage.append(_damage(segment, offset, offset + length, str(error)))
            continue
        pages, size = pages + 1, size + length
        if progress is not None:
            progress(done + pages, total)
        fault = _page_fault(page, offset, low, high, depth, expected_min, tree.height)
        if not fault and page.is_leaf and (leaf_kind == RUN_LEAF) != isinstance(page, RunLeafPage):
            fault = "a run's leaf in the main tree" if leaf_kind == LEAF else "a main tree's leaf in a run"
        if fault:
            damage.append(_damage(segment, offset, offset + length, f"B+tree page at offset {offset}: {fault}"))
            continue
        if isinstance(page, IndexPage):
            keys = page.keys
            bounds = [low, *keys[1:], high]
            for i in range(len(keys)):
                stack.append((page.offsets[i], page.lengths[i], bounds[i], bounds[i + 1], depth + 1, page.min_offsets[i]))
        else:
            entries += len(page.keys)
    return pages, entries, size, damage


def _page_fault(page, offset: int, low: bytes, high: bytes | None, depth: int, expected_min: int, height: int) -> str:
    """What is wrong with a decoded page in its place in the tree ("" if nothing)."""
    keys = page.keys
    if any(a >= b for a, b in zip(keys, keys[1:])):
        return "keys are not strictly ascending"
    if isinstance(page, IndexPage):
        if len(keys) < 1 or depth >= height:
            return "index page at leaf depth or without children"
        if any(c >= offset for c in page.offsets):
            return "a child is stored after its parent"
        if min(page.min_offsets) != expected_min:
            return f"subtree minimum offset {min(page.min_offsets)} differs from {expected_min} in its parent"
        return ""
    if depth != height:
        return f"leaf at depth {depth} in a tree of height {height}"
    if expected_min != offset:
        return f"parent records minimum offset {expected_min} for this leaf"
    if keys and (keys[0] < low or (high is not None and keys[-1] >= high)):
        return "keys outside the range its parent routes to it"
    return ""


def _damage(segment: RollingSegment, start: int, end: int, reason: str) -> Damage:
    return Damage(chunk_of(segment, start), start, end, reason)
