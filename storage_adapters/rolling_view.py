"""The pure view of a rolling segment: names, chunks, what a listing says, and one handle's view.

No I/O. A ``Listing`` is built from what ``ChunkStorage.list_files`` returned for a segment's
directory and tells, on its own, which truncation offset holds, which replacements are in force
(``Layout``) and which chunks are live; a ``SegmentView`` is the chunk list, start offset and
layout one handle reads and appends through. Views are never changed in place: each method that
moves one on returns the next view (a reader that took a view keeps a consistent one), or says
what the next step must delete. docs/format.md gives the rules a listing is read by.
"""

from __future__ import annotations

import bisect
import re
from typing import Mapping

import attrs

from .errors import CorruptDataError, InvalidInputError, OffsetOutOfRangeError, StorageError, TruncatedError

DEFAULT_ROLLING_SIZE = 32 << 20
SEGMENT_SUFFIX = ".seg"
TRUNCATION_DIR = "truncation"
SWITCH_DIR = "switch"
#: a plain chunk's name: its 20-digit start offset
CHUNK_NAME = re.compile(r"\d{20}")
#: a replacement chunk's name: ``<start>-<end>.<generation>``
REPLACEMENT_NAME = re.compile(r"(\d{20})-(\d{20})\.(\d{20})")
_NAME_COMPONENT = re.compile(r"[A-Za-z0-9_=+@$-][A-Za-z0-9_.=+@$-]*")


def chunk_name(offset: int) -> str:
    """The 20-digit zero-padded name of the chunk starting at ``offset``."""
    return f"{offset:020d}"


def replacement_name(start: int, end: int, generation: int) -> str:
    """The name of the replacement chunk of generation ``generation`` covering ``[start, end)``."""
    return f"{start:020d}-{end:020d}.{generation:020d}"


def parse_replacement(name: str) -> tuple[int, int, int]:
    """``(start, end, generation)`` of a replacement chunk name."""
    match = REPLACEMENT_NAME.fullmatch(name)
    return int(match[1]), int(match[2]), int(match[3])


def validate_segment_name(name: str) -> str:
    """Return ``name`` if it is a valid segment name, else raise ``InvalidInputError``.

    Names are ``/``-separated components of letters, digits and ``_.=+@$-``; a component may not
    start with ``.`` nor end with ``.seg`` (the suffix of segment directories).
    """
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"segment name must be a non-empty string, got {name!r}")
    for component in name.split("/"):
        if not _NAME_COMPONENT.fullmatch(component) or component.endswith(SEGMENT_SUFFIX):
            raise InvalidInputError(
                f"invalid segment name {name!r}: each '/'-separated part must be letters, digits or "
                f"'_.=+@$-', not start with '.', and not end with {SEGMENT_SUFFIX!r}"
            )
    return name


@attrs.frozen
class ChunkInfo:
    """One chunk of a segment: it covers the segment's bytes ``[start, start + length)``.

    A replacement chunk (``generation > 0``) may store fewer bytes than it covers: ``stored``
    bytes from ``start`` on, then a hole up to ``end``.
    """

    start: int
    length: int
    name: str
    stored: int = attrs.field(default=attrs.Factory(lambda self: self.length, takes_self=True))
    generation: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def stored_end(self) -> int:
        """Where the chunk's stored bytes end (its hole, if any, runs from here to ``end``)."""
        return self.start + self.stored


@attrs.frozen
class Layout:
    """What one listing says about replacements (``Listing.layout``)."""

    generation: int = 0  #: the highest switch marker: never deleted; the next switch takes the one after
    #: (lower markers are deleted once no view can need them: rolling_sweep.py)
    accepted: frozenset[str] = frozenset()  #: replacement chunks in force
    losers: tuple[str, ...] = ()  #: replacements whose generation another switch took: deleted first
    retired: tuple[str, ...] = ()  #: objects nobody can see any more: any writer may delete them
    debris: tuple[str, ...] = ()  #: replacements never switched to, of generations not yet decided

    def after_their_losers(self, names) -> list[str]:
        """Of ``names`` (to delete), all but the replacements whose generation still has a loser
        listed: with its winner gone, a loser would be the only object of its generation under a
        switch marker, and would look switched in. The losers go first; the winner waits for a
        listing without them."""
        held = {parse_replacement(n)[2] for n in self.losers}
        return [n for n in names if n in self.losers or not REPLACEMENT_NAME.fullmatch(n)
                or parse_replacement(n)[2] not in held]


class Listing:
    """One listing of a segment's directory (name -> stored size), parsed.

    Every backend's listing reads the chunk names no later than the switch markers (local: the
    directory before its ``switch/`` subdirectory; S3: keys in order, digits before "switch/";
    memory: one snapshot). Deleting old switch markers relies on it (rolling_sweep.py): a view of
    generation G never holds a chunk created after ``switch/<G + 1>``.
    """

    def __init__(self, files: Mapping[str, int]):
        self.files = files
        truncation, switch = TRUNCATION_DIR + "/", SWITCH_DIR + "/"
        self.plain: dict[str, int] = {}  #: plain chunk name -> start
        self.replacements: dict[str, tuple[int, int, int]] = {}  #: replacement name -> (start, end, generation)
        self.switches: dict[int, int] = {}  #: switch marker generation -> stored size (0: a fence)
        truncations = []
        for name, size in files.items():
            if CHUNK_NAME.fullmatch(name):
                self.plain[name] = int(name)
            elif name.startswith(truncation):
                if CHUNK_NAME.fullmatch(name[len(truncation):]):
                    truncations.append(int(name[len(truncation):]))
            elif name.startswith(switch):
                if CHUNK_NAME.fullmatch(name[len(switch):]):
                    self.switches[int(name[len(switch):])] = size
            elif REPLACEMENT_NAME.fullmatch(name):
                self.replacements[name] = parse_replacement(name)
        self.truncations = sorted(truncations)  #: the truncation markers' offsets, in order
        self.start_offset = self.truncations[-1] if truncations else 0  #: the largest marker's

    def contested(self) -> list[int]:
        """The generations whose switch marker must be read to tell which of several replacements
        of that generation it switched to (racing replacers: rare)."""
        counts: dict[int, int] = {}
        for _start, _end, gen in self.replacements.values():
            counts[gen] = counts.get(gen, 0) + 1
        return sorted(gen for gen, n in counts.items() if n > 1 and self.switches.get(gen))

    def layout(self, targets: Mapping[int, str | None]) -> Layout | None:
        """Decide which replacements are in force, given what the markers of ``contested()`` name
        (``None``: the marker vanished while being read: list again, and this returns ``None``).

        A replacement is in force when its switch marker exists and no replacement of a higher
        generation overlaps it (a replacer that lost such a race takes its own back). Everything
        it shadows, and replacements that lost or were never switched to, is ``retired``: no view
        uses them any more. An empty marker is a fence: it takes a generation from a replacer that
        crashed or stalled holding it, and switches nothing.
        """
        switches = {gen for gen, size in self.switches.items() if size}
        candidates: dict[int, list[str]] = {}
        for name, (_start, _end, gen) in self.replacements.items():
            candidates.setdefault(gen, []).append(name)
        top = max(self.switches, default=0)
        if not switches and not candidates:
            return Layout(top)  # nothing switched (only fences, if any): the next switch takes top + 1
        committed, debris, losers, retired = [], [], [], []
        for gen, names in candidates.items():
            chosen = names[0] if len(names) == 1 and gen in switches else None
            if len(names) > 1 and gen in switches:  # racing replacers of one generation: the marker says who won
                chosen = targets.get(gen)
                if chosen is None:
                    return None
            for n in names:
                if n == chosen:
                    committed.append(self.replacements[n])
                elif gen <= top:
                    losers.append(n)  # lost its generation, or was fenced: it can never be switched to
                else:
                    debris.append(n)  # maybe still being written: only a replacer holding the lock removes it
        accepted: list[tuple[int, int, int]] = []
        for start, end, gen in sorted(committed, key=lambda r: -r[2]):
            if _overlaps(start, end, accepted):
                retired.append(replacement_name(start, end, gen))
            else:
                accepted.append((start, end, gen))
        retired += [n for n, start in self.plain.items() if _inside(start, accepted)]
        return Layout(top, frozenset(replacement_name(*r) for r in accepted), tuple(sorted(losers)),
                      tuple(sorted(set(retired))), tuple(sorted(debris)))

    def _live(self, layout: Layout) -> list[tuple[int, int | None, str]]:
        """``(start, end or None for a plain chunk, name)`` of the chunks in force, in order,
        without those wholly below the start offset (their deletion was interrupted)."""
        replacements = sorted(parse_replacement(n) for n in layout.accepted)
        # Chunks inside a replacement's range are shadowed by it (deleted after the switch).
        live = [(start, None, chunk_name(start)) for start in sorted(self.plain.values())
                if not _inside(start, replacements)]
        live = sorted(live + [(start, end, replacement_name(start, end, gen)) for start, end, gen in replacements])
        return [entry for i, entry in enumerate(live) if i + 1 == len(live) or live[i + 1][0] > self.start_offset]

    def last_plain(self, layout: Layout) -> ChunkInfo | None:
        """The last chunk in force if it is a plain one: the one appended to, whose committed end
        an appendable backend with torn appends finds in its bytes, not in the listing."""
        live = self._live(layout)
        if not live or live[-1][1] is not None:
            return None
        return ChunkInfo(live[-1][0], 0, live[-1][2])

    def view(self, layout: Layout, segment: str, *, last_length: int | None = None,
             whole_objects: bool = False) -> SegmentView | None:
        """The view this listing shows under ``layout``, or ``None`` if the listing is
        inconsistent (it raced a truncation or a switch: list again).

        ``last_length``: the committed length of the last plain chunk if known otherwise than by
        its listed size. ``whole_objects``: chunks are written whole (object stores), so each but
        the last must hold exactly up to the next one's start (else ``CorruptDataError``).
        """
        live = self._live(layout)
        chunks = []
        for i, (start, end, name) in enumerate(live):
            if end is not None:  # a replacement: the rest of its range past its bytes is a hole
                stored = self.files[name]
                if stored > end - start:
                    raise CorruptDataError(
                        f"segment {segment!r}: replacement chunk {name} holds {stored} bytes but covers only "
                        f"{end - start}", segment=segment, offset=start)
                chunks.append(ChunkInfo(start, end - start, name, stored, parse_replacement(name)[2]))
                continue
            if i + 1 < len(live):
                length = live[i + 1][0] - start
                if whole_objects and self.files[name] != length:
                    raise CorruptDataError(
                        f"segment {segment!r}: chunk {name} (offset {start}) holds {self.files[name]} bytes but "
                        f"the next chunk starts at {start + length}", segment=segment, offset=start)
            elif last_length is not None:
                length = last_length
            else:
                length = self.files[name]
            chunks.append(ChunkInfo(start, length, name))
        if any(a.end != b.start for a, b in zip(chunks, chunks[1:])):
            return None  # a replacement listed without the chunks around it: a switch raced the listing
        length = chunks[-1].end if chunks else self.start_offset
        if self.start_offset > length or (chunks and chunks[0].start > self.start_offset):
            return None  # a new marker with old chunks, or old markers with the new chunks only
        return SegmentView(tuple(chunks), self.start_offset, tuple(self.truncations), layout)

    def dead_plain(self, first: int) -> list[str]:
        """Plain chunk names below ``first`` (the view's first chunk): dead, left by an
        interrupted deletion, another handle, or a replacement's switch."""
        return [name for name, start in self.plain.items() if start < first]

    def shows_change_since(self, generation: int, start_offset: int) -> bool:
        """Whether this listing shows any chunk, or a switch or truncation newer than a view of an
        empty segment at ``generation`` and ``start_offset``."""
        return (bool(self.plain) or any(gen > generation for gen in self.switches)
                or any(m > start_offset for m in self.truncations))


@attrs.frozen
class SegmentView:
    """One handle's view of a segment: its live chunks in offset order (the first may start below
    ``start_offset``), the truncation markers it knows of, and the layout of replacements."""

    chunks: tuple[ChunkInfo, ...] = ()
    start_offset: int = 0
    markers: tuple[int, ...] = ()
    layout: Layout = Layout()

    @property
    def length(self) -> int:
        """Bytes ever appended: the offset the next append gets."""
        chunks = self.chunks
        return chunks[-1].end if chunks else self.start_offset

    @property
    def first_start(self) -> int:
        """Where the view's first chunk starts (the start offset if it has none)."""
        return self.chunks[0].start if self.chunks else self.start_offset

    # -- questions -----------------------------------------------------------------------------
    def chunk_at(self, position: int) -> ChunkInfo | None:
        """The chunk holding byte ``position`` (the last one for the end)."""
        chunks = self.chunks
        i = bisect.bisect_right(chunks, position, key=lambda c: c.start) - 1
        return chunks[i] if i >= 0 else None

    def chunks_in(self, start: int, end: int) -> list[ChunkInfo]:
        """The chunks overlapping ``[start, end)`` (the one holding ``start`` if empty)."""
        chunks = self.chunks
        i = max(bisect.bisect_right(chunks, start, key=lambda c: c.start) - 1, 0)
        j = max(bisect.bisect_left(chunks, end, key=lambda c: c.start), i + 1)
        return list(chunks[i:j])

    def readable_end(self, position: int, limit: int) -> int:
        """Where the bytes readable from ``position`` on stop before ``limit``: the start of the first
        hole at or after ``position`` (``position`` itself if it lies in a hole), else ``limit``."""
        for chunk in self.chunks_in(position, limit):
            if chunk.stored_end < min(chunk.end, limit):
                return max(position, chunk.stored_end)
        return limit

    def hole_at(self, position: int) -> tuple[int, int] | None:
        """The hole ``(start, end)`` holding byte ``position``, if any."""
        chunk = self.chunk_at(position)
        if chunk is not None and chunk.stored_end <= position < chunk.end:
            return chunk.stored_end, chunk.end
        return None

    def holes(self) -> list[tuple[int, int]]:
        """The holes ``(start, end)`` at or above ``start_offset``, in order."""
        return [(max(c.stored_end, self.start_offset), c.end) for c in self.chunks
                if c.stored < c.length and c.end > self.start_offset]

    def check_range(self, segment: str, offset: int, length: int) -> None:
        """``TruncatedError`` or ``OffsetOutOfRangeError`` unless ``[offset, offset + length)``
        lies within ``[start_offset, length)``."""
        end_offset = self.length
        if offset < self.start_offset:
            raise TruncatedError(segment, offset, length, self.start_offset, end_offset)
        if offset + length > end_offset:
            raise OffsetOutOfRangeError(segment, offset, length, self.start_offset, end_offset)

    def sealed_run(self, segment: str, start: int, end: int,
                   error: type[StorageError] | type[InvalidInputError]) -> list[ChunkInfo]:
        """The chunks covering exactly ``[start, end)``, all sealed (the last chunk, which is
        appended to, never is); else ``error``."""
        chunks = self.chunks
        starts = [c.start for c in chunks]
        i = bisect.bisect_left(starts, start)
        j = i
        while j < len(chunks) - 1 and chunks[j].end < end:
            j += 1
        problem = None
        if start < self.start_offset:
            problem = f"start {start} lies below the start offset {self.start_offset}"
        elif i >= len(chunks) or starts[i] != start:
            problem = f"no chunk starts at {start}"
        elif j >= len(chunks) - 1 or chunks[j].end != end:
            problem = f"no sealed chunk ends at {end} (the last chunk, which is appended to, is never replaced)"
        if problem is not None:
            raise error(f"segment {segment!r}: cannot replace [{start}, {end}): {problem}; chunks are "
                        f"{[(c.start, c.end) for c in chunks[-8:]]}{' (last 8)' if len(chunks) > 8 else ''}")
        return list(chunks[i:j + 1])

    def small_runs(self, target: int) -> list[list[ChunkInfo]]:
        """Runs of two or more adjacent sealed chunks at or above the start offset whose stored
        bytes fit in ``target``. A chunk with a hole may only end a run (the merged chunk keeps
        its hole at the end)."""
        runs: list[list[ChunkInfo]] = []
        run: list[ChunkInfo] = []
        size = 0
        for chunk in self.chunks[:-1]:
            if run and (size + chunk.stored > target or run[-1].stored < run[-1].length):
                runs.append(run)
                run, size = [], 0
            if chunk.start >= self.start_offset and chunk.stored < target:
                run.append(chunk)
                size += chunk.stored
            elif run:
                runs.append(run)
                run, size = [], 0
        runs.append(run)
        return [r for r in runs if len(r) > 1]

    def dead_chunks(self) -> list[ChunkInfo]:
        """The chunks before the last lying wholly below the start offset (truncation keeps the
        last chunk: it holds the length), but a replacement whose generation still has a loser
        listed (``Layout.after_their_losers``)."""
        dead = {c.name: c for c in self.chunks[:-1] if c.end <= self.start_offset}
        return [dead[n] for n in self.layout.after_their_losers(list(dead))]

    def dead_markers(self) -> list[int]:
        """The truncation markers older than the start offset."""
        return [m for m in self.markers if m < self.start_offset]

    def has_dead(self) -> bool:
        """Whether anything is dead: a chunk before the last, or a marker, below the start offset."""
        chunks, start = self.chunks, self.start_offset
        return (len(chunks) > 1 and chunks[0].end <= start) or any(m < start for m in self.markers)

    # -- the next view -------------------------------------------------------------------------
    def with_last(self, last: ChunkInfo) -> SegmentView:
        """The view with its last chunk replaced by ``last`` (the same chunk, grown)."""
        return SegmentView(self.chunks[:-1] + (last,), self.start_offset, self.markers, self.layout)

    def appended(self, chunk: ChunkInfo, start_offset: int = 0) -> SegmentView:
        """The view with ``chunk`` (starting at the view's end) after its last one, and the start
        offset at least ``start_offset``."""
        return SegmentView(self.chunks + (chunk,), max(self.start_offset, start_offset), self.markers, self.layout)

    def truncated(self, offset: int) -> SegmentView:
        """The view after a truncation marker at ``offset`` was written."""
        markers = tuple(sorted({*self.markers, offset}))
        return SegmentView(self.chunks, max(self.start_offset, offset), markers, self.layout)

    def without(self, chunks: set[str], markers: set[int] = frozenset()) -> SegmentView:
        """The view without the named chunks (the last one always stays) and markers: they were deleted."""
        last = self.chunks[-1] if self.chunks else None
        kept = tuple(c for c in self.chunks if c.name not in chunks or c is last)
        return SegmentView(kept, self.start_offset, tuple(m for m in self.markers if m not in markers), self.layout)

    def up_to(self, offset: int) -> SegmentView:
        """The view cut back to the chunks ending at or before ``offset``."""
        return SegmentView(tuple(c for c in self.chunks if c.end <= offset), self.start_offset, self.markers,
                           self.layout)


def _inside(position: int, ranges: list[tuple[int, int, int]]) -> bool:
    return any(start <= position < end for start, end, _gen in ranges)


def _overlaps(start: int, end: int, ranges: list[tuple[int, int, int]]) -> bool:
    return any(start < other_end and other_start < end for other_start, other_end, _gen in ranges)
