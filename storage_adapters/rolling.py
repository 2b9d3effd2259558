"""``RollingSegment``: one logical append-only byte stream over numbered chunks, with compare-and-append.

Layout of segment ``NAME`` (see docs/storage.md)::

    NAME.seg/00000000000000000000          chunk holding offsets [0, next chunk's start)
    NAME.seg/00000000000033554432          ... named by its 20-digit zero-padded start offset
    NAME.seg/truncation/00000000000000001234   empty marker; the largest is the start offset
    NAME.seg/<start>-<end>.<generation>    replacement chunk: holds [start, end), maybe fewer bytes
    NAME.seg/switch/<generation>           commit marker of that replacement (names it)

Sealed chunks can be replaced (``replace_range``: consolidation, log compaction) by ONE chunk
object covering exactly their range; if it holds fewer bytes than the range, the rest is a hole.
A replacement is visible only once its switch marker exists (one exclusive create: the atomic
switch); it then shadows the chunks inside its range, which are deleted afterwards. See
docs/format.md for the rules readers apply to a listing and for crash recovery.

Appendable backends (local disk, memory) grow the last chunk in place until it reaches
``rolling_size``, then trim it to its end (``ChunkStorage.trim``) and start the next; only a chunk
with no successor is appended to, which a writer checks under the writers' lock, whatever rolling
size other writers use. On local disk the committed end of the last chunk is the end of its chain
of frames (framing.py, tail.py): no commit record is kept. Object backends (S3) write one new object per append. Truncation
never deletes the last chunk, so the segment's length can always be recovered from its chunks alone.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import re
import threading
import time

import attrs

from .base import ChunkStorage
from .framing import Framing
from .tail import MARK_BYTES, TailLook, look_at_tail
from .errors import (
    BadOffsetError,
    ChunkExistsError,
    CorruptDataError,
    HoleError,
    InvalidInputError,
    LayoutConflictError,
    OffsetOutOfRangeError,
    OutcomeUnknownError,
    StorageError,
    TruncatedError,
)

_log = logging.getLogger("attrindex.storage")

DEFAULT_ROLLING_SIZE = 32 << 20
SEGMENT_SUFFIX = ".seg"
TRUNCATION_DIR = "truncation"
SWITCH_DIR = "switch"
_CHUNK_NAME = re.compile(r"\d{20}")
_REPLACEMENT_NAME = re.compile(r"(\d{20})-(\d{20})\.(\d{20})")
#: Bound on the attempts of one ``replace_range`` (each is one lost race for a generation).
MAX_REPLACE_ATTEMPTS = 10
_NAME_COMPONENT = re.compile(r"[A-Za-z0-9_=+@$-][A-Za-z0-9_.=+@$-]*")
#: Bound on the create attempts of one object append (each lost race or unsettled write is one).
MAX_APPEND_ATTEMPTS = 100
#: Bound on the listings one ``refresh`` takes while other processes keep changing the segment.
MAX_REFRESH_ATTEMPTS = 20
MAX_READ_REFRESHES = 10  #: listings one read takes when the chunks of its view keep vanishing


def chunk_name(offset: int) -> str:
    """The 20-digit zero-padded name of the chunk starting at ``offset``."""
    return f"{offset:020d}"


def replacement_name(start: int, end: int, generation: int) -> str:
    """The name of the replacement chunk of generation ``generation`` covering ``[start, end)``."""
    return f"{start:020d}-{end:020d}.{generation:020d}"


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
class _Layout:
    """What one listing says about replacements (see ``RollingSegment._read_layout``)."""

    generation: int = 0  #: the highest switch marker: never deleted; the next switch takes the one after
    #: (lower markers are deleted once no view can need them: ``RollingSegment._obsolete_names``)
    accepted: frozenset[str] = frozenset()  #: replacement chunks in force
    losers: tuple[str, ...] = ()  #: replacements whose generation another switch took: deleted first
    retired: tuple[str, ...] = ()  #: objects nobody can see any more: any writer may delete them
    debris: tuple[str, ...] = ()  #: replacements never switched to, of generations not yet decided


class _SweepHorizons:
    """Per segment, across the handles of this process: what deleting switch markers needs
    (``RollingSegment._obsolete_names``). A horizon ``(t, c)`` pairs the top generation ``t`` that
    one listing showed with the last chunk's start ``c`` in a listing begun after that one ended;
    any two listings of one process qualify, whichever handle took them (a cleaner opens a handle
    per pass). Bounded: the least recently used segments are forgotten (their sweep only waits)."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: key -> [top seen, monotonic time that listing had ended, horizon or None]
        self._state: dict[tuple[str, str], list] = {}

    def horizon(self, key: tuple[str, str], top: int, length: int, last_start: int | None,
                listed_at: float) -> tuple[int, int] | None:
        """Record a listing (begun at ``listed_at``, showing top generation ``top``, the segment's
        ``length`` and the last chunk's start) and return the horizon to test it against, if any."""
        ended = time.monotonic()
        with self._lock:
            state = self._state.pop(key, None) or [None, float("inf"), None]
            self._state[key] = state  # most recently used last
            if len(self._state) > self.LIMIT:
                del self._state[next(iter(self._state))]
            seen, seen_ended, horizon = state
            if horizon is not None and (top < horizon[0] or length < horizon[1]):
                horizon = None  # generations and lengths only grow: the segment was deleted and made again
            if horizon is None and seen is not None and seen <= top and listed_at > seen_ended and last_start is not None:
                horizon = (seen, last_start)
            state[:] = [top, ended, horizon]
            return horizon

    def passed(self, key: tuple[str, str], horizon: tuple[int, int]) -> None:
        """``horizon`` has passed: the next listing takes a new one."""
        with self._lock:
            state = self._state.get(key)
            if state is not None and state[2] == horizon:
                state[2] = None

    def forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._state.pop(key, None)


_SWEEPS = _SweepHorizons()


class RollingSegment:
    """An append-only byte stream stored as chunks in ``storage`` under the segment ``name``.

    ``length`` and ``start_offset`` are this handle's view as of its last ``refresh``/``append``/
    ``truncate``; ``append(..., expected_offset=...)`` always checks against the length as stored,
    so a handle that is behind gets ``BadOffsetError`` (and is refreshed), never a bad write.
    """

    def __init__(self, storage: ChunkStorage, name: str, rolling_size: int = DEFAULT_ROLLING_SIZE, *,
                 framing: Framing | None = None):
        if not isinstance(rolling_size, int) or rolling_size <= 0:
            raise InvalidInputError(f"rolling_size must be a positive int, got {rolling_size!r}")
        self.storage = storage
        #: How the owner's appends are framed (storage_adapters/framing.py): what tells the
        #: committed length of a chunk appended to in place
        self.framing = framing
        self.name = validate_segment_name(name)
        self.rolling_size = rolling_size
        self._dir = name + SEGMENT_SUFFIX
        self._mutex = threading.RLock()
        self._truncating = threading.Lock()  #: one truncation of this handle at a time (its I/O runs without _mutex)
        self._chunks: list[ChunkInfo] = []
        self._start_offset = 0
        self._markers: list[int] = []
        self._layout = _Layout()
        #: the last look at the end of the view's last chunk (backends with ``torn_appends``)
        self._tail: TailLook | None = None
        self._tail_name: str | None = None  #: the chunk ``_tail`` is about
        self._closed = False
        self._view_time = float("-inf")  #: monotonic time before the listing (or own create) behind the view
        #: bumped whenever the view is reloaded or cut (refresh, truncation, replacement, deletion):
        #: a layer above that keeps its own copy of ``chunks()`` compares it to know the copy is stale
        self.view_changes = 0
        self._doomed: dict[str, float] = {}  #: dead object chunk -> monotonic time it was known dead
        self._listed: dict[str, int] = {}  #: the files of the listing behind the view
        self._listed_at = float("-inf")  #: monotonic time before the listing behind ``_listed`` began
        self.refresh()

    def __repr__(self) -> str:
        return f"RollingSegment({self.storage.url!r}, {self.name!r}, length={self.length})"

    # -- view ----------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Bytes ever appended (the offset the next append gets), as of this handle's last look."""
        chunks = self._chunks
        return chunks[-1].end if chunks else self._start_offset

    @property
    def start_offset(self) -> int:
        """The truncation offset: bytes below it can no longer be read."""
        return self._start_offset

    def chunks(self) -> list[ChunkInfo]:
        """The chunks holding readable bytes, in offset order (the first may start below ``start_offset``)."""
        return list(self._chunks)

    def chunk_at(self, position: int) -> ChunkInfo | None:
        """The chunk of this handle's view holding byte ``position`` (the last one for the end)."""
        chunks = self._chunks
        i = bisect.bisect_right(chunks, position, key=lambda c: c.start) - 1
        return chunks[i] if i >= 0 else None

    def chunks_in(self, start: int, end: int) -> list[ChunkInfo]:
        """The chunks of this handle's view overlapping ``[start, end)`` (the one holding ``start`` if empty)."""
        chunks = self._chunks
        i = max(bisect.bisect_right(chunks, start, key=lambda c: c.start) - 1, 0)
        j = max(bisect.bisect_left(chunks, end, key=lambda c: c.start), i + 1)
        return chunks[i:j]

    def readable_end(self, position: int, limit: int) -> int:
        """Where the bytes readable from ``position`` on stop before ``limit``: the start of the first
        hole at or after ``position`` (``position`` itself if it lies in a hole), else ``limit``."""
        for chunk in self.chunks_in(position, limit):
            if chunk.stored_end < min(chunk.end, limit):
                return max(position, chunk.stored_end)
        return limit

    def hole_at(self, position: int) -> tuple[int, int] | None:
        """The hole ``(start, end)`` holding byte ``position`` in this handle's view, if any."""
        chunk = self.chunk_at(position)
        if chunk is not None and chunk.stored_end <= position < chunk.end:
            return chunk.stored_end, chunk.end
        return None

    def holes(self) -> list[tuple[int, int]]:
        """The holes ``(start, end)`` at or above ``start_offset`` as of this handle's view, in order:
        byte ranges that replacements left empty (reading them raises ``HoleError``)."""
        return [(max(c.stored_end, self._start_offset), c.end) for c in self._chunks
                if c.stored < c.length and c.end > self._start_offset]

    def refresh(self) -> None:
        """Reload this handle's view from storage (appends, truncations and replacements by other handles).

        A listing taken while another process appends and truncates can mix two states (a new
        truncation marker with the old chunks, a listed chunk deleted before its size was read);
        such a view is detected and the listing retaken, at most ``MAX_REFRESH_ATTEMPTS`` times.
        """
        self._check_open()
        with self._mutex:
            for _attempt in range(MAX_REFRESH_ATTEMPTS):
                started = time.monotonic()
                view = self._load_view()
                if view is not None:
                    known = (self._tail_name, self._tail.torn if self._tail is not None else None)
                    self._chunks, self._start_offset, self._markers, self._layout, tail = view
                    self._tail, self._tail_name = tail, (self._chunks[-1].name if tail is not None else None)
                    if tail is not None and tail.torn is not None and known != (self._tail_name, tail.torn):
                        self._say_torn_found(tail.torn)
                    self.view_changes += 1
                    self._view_time = self._listed_at = started
                    self._note_dead_objects()
                    return
                _log.info("segment %r: the listing raced an append or truncation; listing again", self.name)
        raise StorageError(
            f"segment {self.name!r}: {MAX_REFRESH_ATTEMPTS} listings in a row saw the segment change under "
            "them; no consistent view could be read"
        )

    def _say_torn_found(self, torn: tuple[int, int]) -> None:
        """Log, once per handle and torn write, what a look found after the committed end: any
        handle says it (a read-only one too), and only the next append into the chunk cuts it."""
        _log.warning("segment %r: found %d bytes of a torn write at position %d (chunk %s) after the "
                     "committed end: the newest write before a crash, never committed; not read, and cut by "
                     "the next append into the chunk (nothing is cut until then)", self.name, torn[1] - torn[0],
                     torn[0], self._tail_name)

    def _load_view(self) -> tuple[list[ChunkInfo], int, list[int], _Layout, TailLook | None] | None:
        """``(chunks, start offset, markers, layout, the look at the last chunk's end)`` from one
        listing, or ``None`` if it is inconsistent."""
        # Every backend's listing reads the chunk names no later than the switch markers (local:
        # the directory before its ``switch/`` subdirectory; S3: keys in order, digits before
        # "switch/"; memory: one snapshot). Deleting old switch markers relies on it: a view of
        # generation G then never holds a chunk created after ``switch/<G + 1>``.
        files = self._listed = self.storage.list_files(self._dir)
        markers = sorted(
            int(n[len(TRUNCATION_DIR) + 1:])
            for n in files
            if n.startswith(TRUNCATION_DIR + "/") and _CHUNK_NAME.fullmatch(n[len(TRUNCATION_DIR) + 1:])
        )
        start_offset = markers[-1] if markers else 0
        layout = self._read_layout(files)
        if layout is None:
            return None
        replacements = sorted(_parse_replacement(n) for n in layout.accepted)
        # Chunks inside a replacement's range are shadowed by it (deleted after the switch).
        live = [(start, None, chunk_name(start)) for start in sorted(int(n) for n in files if _CHUNK_NAME.fullmatch(n))
                if not _inside(start, replacements)]
        live = sorted(live + [(start, end, replacement_name(start, end, gen)) for start, end, gen in replacements])
        chunks = []
        tail = None
        for i, (start, end, name) in enumerate(live):
            last = i + 1 == len(live)
            if not last and live[i + 1][0] <= start_offset:
                continue  # wholly truncated; its deletion was interrupted
            if end is not None:  # a replacement: the rest of its range past its bytes is a hole
                chunks.append(self._replacement_info(start, end, name, files[name]))
                continue
            if not last:
                length = live[i + 1][0] - start
                self._check_object_size(start, files[name], length)
            elif self.storage.torn_appends:
                try:
                    tail = self._look(ChunkInfo(start, 0, name))
                except FileNotFoundError:
                    return None  # deleted after the listing: a truncation moved on
                length = tail.end - start
            else:
                length = files[name]
            chunks.append(ChunkInfo(start, length, name))
        if any(a.end != b.start for a, b in zip(chunks, chunks[1:])):
            return None  # a replacement listed without the chunks around it: a switch raced the listing
        length = chunks[-1].end if chunks else start_offset
        if start_offset > length or (chunks and chunks[0].start > start_offset):
            return None  # a new marker with old chunks, or old markers with the new chunks only
        return chunks, start_offset, markers, layout, tail

    def _look(self, chunk: ChunkInfo, *, locked: bool = False) -> TailLook:
        """Look at the end of ``chunk``, going on from the last look if it was at the same chunk
        (tail.py). ``FileNotFoundError`` if the chunk is gone."""
        if self.framing is None:
            raise InvalidInputError(
                f"segment {self.name!r}: a segment on {type(self.storage).__name__} needs the framing of what "
                f"is appended to it (RollingSegment(..., framing=...)): its chunks keep no commit record")
        path = f"{self._dir}/{chunk.name}"
        since = self._tail if self._tail_name == chunk.name else None
        return look_at_tail(lambda a, b: self.storage.read(path, a, b), chunk.start, self.framing,
                            since=since, locked=locked, zeros_kept=self.storage.zeros_kept_after)

    def cut_short(self) -> bool:
        """Whether the last chunk's file is shorter than its backend keeps it past committed
        frames (``ChunkStorage.zeros_kept_after``: local disk): it was cut short behind the
        segment's back, so bytes past this view's end may be lost, and nothing tells how many.
        False on backends that keep nothing past a chunk's end, and for a segment with no chunk."""
        last = self._chunks[-1] if self._chunks else None
        if last is None:
            return False
        kept = self.storage.zeros_kept_after(last.length)
        if not kept:
            return False
        try:
            size = self.storage.size(f"{self._dir}/{last.name}")
        except FileNotFoundError:
            return True
        return size < last.length + kept

    @property
    def torn_tail(self) -> tuple[int, bytes] | None:
        """``(position, bytes)`` of a torn write found after the end of the last chunk by the
        latest look (local disk): not committed, and zeroed by the next append into the chunk.
        The layers above read it to keep what it claimed (a record batch's offsets) from being
        given out again."""
        tail = self._tail
        if tail is None or tail.torn is None:
            return None
        return tail.torn[0], tail.torn_bytes

    def _replacement_info(self, start: int, end: int, name: str, stored: int) -> ChunkInfo:
        if stored > end - start:
            raise CorruptDataError(
                f"segment {self.name!r}: replacement chunk {name} holds {stored} bytes but covers only "
                f"{end - start}", segment=self.name, offset=start)
        return ChunkInfo(start, end - start, name, stored, _parse_replacement(name)[2])

    def _read_layout(self, files: dict[str, int]) -> _Layout | None:
        """Decide from a listing which replacements are in force.

        A replacement is in force when its switch marker exists and no replacement of a higher
        generation overlaps it (a replacer that lost such a race takes its own back). Everything
        it shadows, and replacements that lost or were never switched to, is ``retired``: no view
        uses them any more. ``None`` if a marker vanished while being read (list again).
        """
        markers = {int(n[len(SWITCH_DIR) + 1:]): size for n, size in files.items()
                   if n.startswith(SWITCH_DIR + "/") and _CHUNK_NAME.fullmatch(n[len(SWITCH_DIR) + 1:])}
        # An empty marker is a fence: it takes a generation from a replacer that crashed or stalled
        # holding it, and switches nothing.
        switches = {gen for gen, size in markers.items() if size}
        candidates: dict[int, list[str]] = {}
        for n in files:
            if _REPLACEMENT_NAME.fullmatch(n):
                candidates.setdefault(_parse_replacement(n)[2], []).append(n)
        if not switches and not candidates:
            return _Layout()
        top = max(markers, default=0)
        committed, debris, losers, retired = [], [], [], []
        for gen, names in candidates.items():
            chosen = names[0] if len(names) == 1 and gen in switches else None
            if len(names) > 1 and gen in switches:  # racing replacers of one generation: the marker says who won
                chosen = self._switch_target(gen)
                if chosen is None:
                    return None
            for n in names:
                if n == chosen:
                    committed.append(_parse_replacement(n))
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
        retired += [n for n in files if _CHUNK_NAME.fullmatch(n) and _inside(int(n), accepted)]
        return _Layout(top, frozenset(replacement_name(*r) for r in accepted), tuple(sorted(losers)),
                       tuple(sorted(set(retired))), tuple(sorted(debris)))

    def _switch_target(self, gen: int) -> str | None:
        """The replacement a switch marker names (read only when several share its generation)."""
        try:
            return self.storage.read(f"{self._dir}/{SWITCH_DIR}/{chunk_name(gen)}", 0, 200).decode("ascii", "replace")
        except FileNotFoundError:
            return None

    def poll(self) -> bool:
        """Whether the segment may have grown since this handle's last look: ``refresh`` then.

        Cheap, for tail readers: object stores cost one small request (a 1-byte ranged read of
        the chunk the next append creates: absent means nothing was appended), never a listing;
        appendable backends stat the last chunk and look for the next (writers with a smaller
        rolling size roll sooner).
        Truncations are not looked for (a reader meets them when it reads).
        """
        self._check_open()
        with self._mutex:
            last = self._chunks[-1] if self._chunks else None
            if self.storage.appendable and last is not None:
                try:
                    after = self.storage.read(f"{self._dir}/{last.name}", last.length, last.length + MARK_BYTES)
                except FileNotFoundError:
                    return True  # truncated and rolled past meanwhile
                if after.strip(b"\0") if self.storage.torn_appends else after:
                    return not self._is_known_torn(last, after)
                if after or not last.length:
                    return False  # pre-written zeros, or an empty chunk: where the next append goes
            try:
                self.storage.read(f"{self._dir}/{chunk_name(self.length)}", 0, 1)
            except FileNotFoundError:
                # A chunk switch (layout) may have taken the next chunk's plain name away.
                return self._switched_since_view()
            return True

    def _is_known_torn(self, last: ChunkInfo, after: bytes) -> bool:
        """Whether ``after`` (read at the end of ``last``) is the torn write the last look found."""
        tail = self._tail
        if tail is None or tail.torn is None or self._tail_name != last.name or tail.torn[0] != last.end:
            return False
        known = tail.torn_bytes[:len(after)]
        return after[:len(known)] == known and not after[len(known):].strip(b"\0")

    def _switched_since_view(self) -> bool:
        """Whether a chunk switch may have happened since this view (then ``refresh``).

        Switches are numbered one after another, so on local disk and memory one existence check
        of the next generation's marker tells (a view of an empty segment lists the markers when
        that one is absent: see below). Object stores with a deletion grace keep replaced
        chunk names for the grace, so the next chunk's name is found anyway while the view is
        younger than half of it; an older view just says yes (a listing every grace/2 at most).
        """
        if not self.storage.appendable and self.storage.deletion_grace > 0:
            return time.monotonic() - self._view_time >= self.storage.deletion_grace / 2
        generation = self._layout.generation
        if self.storage.exists(f"{self._dir}/{SWITCH_DIR}/{chunk_name(generation + 1)}"):
            return True
        if self._chunks:
            return False  # its last chunk is found missing once markers above it may go
        # A view of an empty segment has no last chunk to find missing. That is what lets old
        # markers go (``_obsolete_names``): ``switch/<g + 1>`` may be deleted while a higher one
        # (the top one, never deleted) says that something switched. And chunk ``length`` may be
        # gone already: appended to, rolled past and deleted by retention since this view. One
        # listing of the segment tells both (any chunk, a newer truncation or a newer switch).
        listed = self.storage.list_files(self._dir)
        switch = SWITCH_DIR + "/"
        truncation = TRUNCATION_DIR + "/"
        for name in listed:
            if _CHUNK_NAME.fullmatch(name):
                return True
            if name.startswith(switch) and _CHUNK_NAME.fullmatch(name[len(switch):]):
                if int(name[len(switch):]) > generation:
                    return True
            elif name.startswith(truncation) and _CHUNK_NAME.fullmatch(name[len(truncation):]):
                if int(name[len(truncation):]) > self._start_offset:
                    return True
        return False

    def _check_object_size(self, start: int, stored: int, length: int) -> None:
        # Object chunks are written whole, so each must end where the next begins.
        if not self.storage.appendable and stored != length:
            raise CorruptDataError(
                f"segment {self.name!r}: chunk {chunk_name(start)} (offset {start}) holds {stored} bytes but "
                f"the next chunk starts at {start + length}",
                segment=self.name,
                offset=start,
            )

    # -- appending -----------------------------------------------------------------------------
    def append(self, data: bytes, expected_offset: int | None = None) -> int:
        """Append ``data`` durably and return the offset it starts at.

        With ``expected_offset``, append only if the segment's length as stored equals it; otherwise
        raise ``BadOffsetError`` and write nothing. Without it, append at the end, whatever it is.
        """
        self._check_open()
        data = _as_bytes(data)
        if not data:
            raise InvalidInputError(f"segment {self.name!r}: nothing to append (empty data)")
        if expected_offset is not None and (not isinstance(expected_offset, int) or expected_offset < 0):
            raise InvalidInputError(f"expected_offset must be a non-negative int or None, got {expected_offset!r}")
        with self._mutex:
            if self.storage.appendable:
                return self._append_in_place(data, expected_offset)
            return self._append_object(data, expected_offset)

    def _append_in_place(self, data: bytes, expected_offset: int | None) -> int:
        """Under the writers' lock: catch up, compare, then append to the last chunk if it is not
        full, else trim it and start the next (docs/storage.md, "Rolling into a new chunk"). Only
        a chunk with no successor is appended to: found so under the lock, it is the segment's
        last chunk and no truncation deletes it."""
        with self.storage.lock(self._dir):
            self._catch_up()
            rolls = self._rolls()
            stored_start = self._stored_start_offset() if rolls else None
            if stored_start is not None and stored_start > self.length:
                # Another handle truncated past the end of this view: the walk from the view's last
                # chunk found no successor because it was deleted (the walk raced the deletions, or
                # started from a leftover chunk whose deletion failed). Creating the next chunk would
                # fork the log at a reused offset below the truncation; the true tail is elsewhere.
                self.refresh()
                stored_start = self._start_offset
            offset = self.length
            if expected_offset is not None and expected_offset != offset:
                raise BadOffsetError(self.name, expected_offset, offset)
            last = self._chunks[-1] if self._chunks else None
            clear_to = 0
            if rolls:
                if last is not None:
                    self._trim(last)
                last = ChunkInfo(offset, 0, chunk_name(offset))
                self._chunks.append(last)
                self._tail = self._tail_name = None
                # Rolling is rare: learn of truncations elsewhere so the old chunk can go if dead.
                self._start_offset = max(self._start_offset, stored_start or 0)
            elif self._tail is not None and self._tail.torn is not None and self._tail_name == last.name:
                torn_start, torn_end = self._tail.torn
                clear_to = torn_end - last.start
                _log.warning("segment %r: cutting %d bytes of a torn write at position %d (chunk %s): the "
                             "newest write before a crash, never committed", self.name, torn_end - torn_start,
                             torn_start, last.name)
            if self.framing is not None:
                data = self.framing.place(data, offset)
            path = f"{self._dir}/{last.name}"
            before = self._tail.mark if self._tail is not None and self._tail_name == last.name else b""
            try:
                self.storage.append(path, last.length, data, clear_to=clear_to)
            except StorageError as exc:
                self._settle_in_place(last, data, exc)  # returns only if the append is there
            self._chunks[-1] = ChunkInfo(last.start, last.length + len(data), last.name)
            if self.storage.torn_appends:
                mark = bytes(data[-MARK_BYTES:]) if len(data) >= MARK_BYTES else (before + bytes(data))[-MARK_BYTES:]
                self._tail, self._tail_name = TailLook(offset + len(data), mark=mark), last.name
        self._after_durable_append()
        return offset

    def _rolls(self) -> bool:
        """Whether the next in-place append starts a new chunk: none yet, or the last is full."""
        return not self._chunks or self._chunks[-1].length >= self.rolling_size

    def _trim(self, last: ChunkInfo) -> None:
        """Under the writers' lock, before the chunk after ``last`` is created: cut ``last`` back
        to its end, durably, so that pre-written zeros after a chunk's end say it has no successor
        (``_catch_up``). If that fails, nothing of the append was written."""
        path = f"{self._dir}/{last.name}"
        try:
            self.storage.trim(path, last.length)
            return
        except StorageError as exc:
            error = exc
        try:  # settled by reading: a trim that took effect is the same trim (it is done twice harmlessly)
            trimmed = self.storage.size(path) <= last.length
        except (StorageError, FileNotFoundError):
            trimmed = False
        if not trimmed:
            raise StorageError(f"segment {self.name!r}: the append did not happen: trimming chunk {last.name} "
                               f"before starting the next failed ({error})") from error
        _log.info("segment %r: trimming %r raised %s but it is trimmed; going on", self.name, path,
                  type(error).__name__)

    def _settle_in_place(self, last: ChunkInfo, data: bytes, error: StorageError) -> None:
        """Under the writers' lock, after ``append`` to ``last`` raised: decide by reading whether it
        happened. Committed and identical: it did (return). The chunk's end unchanged: it did not
        (raise a definite error). Anything else, or a failed read: ``OutcomeUnknownError``."""
        path = f"{self._dir}/{last.name}"
        position = last.length
        try:
            try:
                if self.storage.torn_appends:
                    self._tail = self._look(last, locked=True)
                    self._tail_name = last.name
                    end = self._tail.end - last.start
                else:
                    end = self.storage.size(path)
            except FileNotFoundError:
                end = 0
            ours = end == position + len(data) and self.storage.read(path, position, end) == data
        except (StorageError, FileNotFoundError) as exc:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: append to {path!r} failed ({error}) and reading back failed too ({exc})"
            ) from error
        if ours:
            _log.info("segment %r: append to %r raised %s but its bytes are committed; accepted",
                      self.name, path, type(error).__name__)
            return
        if end != position:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: append to {path!r} at {position} failed ({error}) and the chunk "
                f"now ends at {end}"
            ) from error
        if isinstance(error, OutcomeUnknownError):
            raise StorageError(f"segment {self.name!r}: the append did not happen ({error})") from error
        raise error

    def _catch_up(self) -> None:
        """Under the writers' lock: bring the tail of the view up to date (one small read of
        the last chunk when nothing changed) and move on to chunks that other writers started."""
        if not self._chunks:
            self.refresh()
            return
        last = self._chunks[-1]
        try:
            length, zeros_after = self._tail_length(last)
        except FileNotFoundError:  # deleted by a truncation elsewhere: no longer the last chunk
            self.refresh()
            return
        if length != last.length:
            self._chunks[-1] = last = ChunkInfo(last.start, length, last.name)
        if zeros_after:
            # Pre-written zeros follow it: never trimmed, so never rolled past (a chunk is trimmed
            # to its end before its successor is made): the segment's last chunk, which no
            # replacement takes and no truncation deletes: no switch check.
            return
        if not (last.length and self.storage.exists(f"{self._dir}/{chunk_name(last.end)}")):
            self._check_not_rolled_past(last)
            return
        if self.storage.exists(f"{self._dir}/{SWITCH_DIR}/{chunk_name(self._layout.generation + 1)}"):
            # A replacement switched since this view (replacers hold this lock too and number their
            # switches one after another here): chunks after the view's last may have new names.
            self.refresh()
            return
        # Other writers rolled past it. A new chunk starts only where a non-empty one ends (an
        # empty one ends at its own name).
        zeros_after = False
        while last.length and self.storage.exists(f"{self._dir}/{chunk_name(last.end)}"):
            last = ChunkInfo(last.end, 0, chunk_name(last.end))
            try:
                length, zeros_after = self._tail_length(last)
            except FileNotFoundError:  # rolled past and truncated away meanwhile
                self.refresh()
                return
            last = ChunkInfo(last.start, length, last.name)
            self._chunks.append(last)
        if not zeros_after:
            self._check_not_rolled_past(last)

    def _check_not_rolled_past(self, last: ChunkInfo) -> None:
        """``last`` has no successor by its plain name and no zeros after it (a memory chunk, or a
        local one trimmed by a roll): it may have been rolled past, its successor since replaced
        (the plain name goes with the switch) or truncated away. Refresh if so."""
        if self.storage.exists(f"{self._dir}/{SWITCH_DIR}/{chunk_name(self._layout.generation + 1)}"):
            self.refresh()
        elif self._stored_start_offset() > last.end:
            self.refresh()

    def _tail_length(self, chunk: ChunkInfo) -> tuple[int, bool]:
        """Under the writers' lock: ``(committed length of chunk, whether pre-written zeros follow
        it)``, kept as the view's last look (memory: its size). ``FileNotFoundError`` if gone."""
        if not self.storage.torn_appends:  # memory: a trim mark says what zeros say on local disk
            path = f"{self._dir}/{chunk.name}"
            return self.storage.size(path), not self.storage.trimmed(path)
        look = self._look(chunk, locked=True)
        self._tail, self._tail_name = look, chunk.name
        return look.end - chunk.start, look.zeros_after

    def _append_object(self, data: bytes, expected_offset: int | None) -> int:
        """One exclusive create at the viewed length: 1 PUT when the view is fresh (docs/storage.md).

        A name below the truncation offset could be free again only after its chunk was deleted,
        and dead chunks keep their names for ``storage.deletion_grace`` seconds; so a view younger
        than half of that (the other half is margin for a slow request) cannot re-create one, and an
        older view is refreshed first. With no grace (0), the truncation offset is listed after
        each create instead, and a create that landed below it is undone.
        """
        grace = self.storage.deletion_grace
        retried_unknown = False
        for _attempt in range(MAX_APPEND_ATTEMPTS):
            if grace > 0 and time.monotonic() - self._view_time >= grace / 2:
                self.refresh()  # too old to rule out a name freed by a deletion
            if expected_offset is not None and expected_offset != self.length:
                self.refresh()
                if expected_offset != self.length:
                    raise BadOffsetError(self.name, expected_offset, self.length)
            offset = self.length
            path = f"{self._dir}/{chunk_name(offset)}"
            placed = data if self.framing is None else self.framing.place(data, offset)
            sent = time.monotonic()
            try:
                self.storage.create(path, placed)
            except StorageError as exc:
                found = self._settle_object(path, placed, exc)
                if found == "absent" and isinstance(exc, OutcomeUnknownError) and not retried_unknown:
                    retried_unknown = True  # nothing is there: an exclusive create is safe to repeat
                    continue
                if found == "absent" and not isinstance(exc, ChunkExistsError):
                    if isinstance(exc, OutcomeUnknownError):
                        raise StorageError(f"segment {self.name!r}: the append did not happen ({exc})") from exc
                    raise
                if found != "ours":  # another writer's chunk, or one truncated away meanwhile
                    self.refresh()
                    if expected_offset is not None:
                        raise BadOffsetError(self.name, expected_offset, self.length) from None
                    continue
            if grace > 0 and time.monotonic() - self._view_time >= grace / 2:
                # The create was slow (a paused process, a slow network): the grace may have passed
                # before it landed, on a name a truncation or a switch had freed meanwhile.
                if not self._created_live(path, offset):
                    self._delete_quietly(path)
                    if expected_offset is not None:
                        raise BadOffsetError(self.name, expected_offset, self.length, "offset was truncated or replaced")
                    continue
                self._after_durable_append()
                return offset
            start_offset = self._start_offset
            if grace <= 0:
                start_offset = self._stored_start_offset_after_write(path)
                if start_offset > offset:
                    # A name below the truncation offset may have been freed and re-created by this
                    # (stale) handle: its offset was taken and truncated away meanwhile. Undo, report.
                    self._delete_quietly(path)
                    self.refresh()
                    if expected_offset is not None:
                        raise BadOffsetError(self.name, expected_offset, self.length, "offset was truncated")
                    continue
                if self._offset_replaced(offset):  # likewise a name freed by a chunk switch (layout)
                    self._delete_quietly(path)
                    self.refresh()
                    if expected_offset is not None:
                        raise BadOffsetError(self.name, expected_offset, self.length, "offset was replaced")
                    continue
            self._chunks.append(ChunkInfo(offset, len(data), chunk_name(offset)))
            self._start_offset = max(self._start_offset, start_offset)
            # The next name (offset + len) can only be taken by a writer that saw this chunk, which
            # did not exist before ``sent``: the view is as young as this create.
            self._view_time = max(self._view_time, sent)
            self._after_durable_append()
            return offset
        raise StorageError(
            f"segment {self.name!r}: gave up appending after {MAX_APPEND_ATTEMPTS} attempts; other writers "
            "kept taking the offset (nothing of this append was written)"
        )

    def _settle_object(self, path: str, data: bytes, error: StorageError) -> str:
        """After ``create`` raised: ``"ours"`` if the object holds exactly ``data``, ``"theirs"`` if it
        holds other bytes, ``"absent"`` if there is none; ``OutcomeUnknownError`` if it cannot be read."""
        try:
            stored = self.storage.read(path, 0, len(data) + 1)
        except FileNotFoundError:
            return "absent"
        except StorageError as exc:
            if isinstance(error, ChunkExistsError):
                raise  # a definite read error; the create itself wrote nothing of ours
            raise OutcomeUnknownError(
                f"segment {self.name!r}: create of {path!r} failed ({error}) and reading it back failed ({exc})"
            ) from error
        if stored != data:
            # Bytes that differ decide "another writer's" only if a second read agrees: a flip in
            # transit would otherwise turn our own append into a duplicate or a false failure.
            try:
                again = self.storage.read(path, 0, len(data) + 1)
            except (StorageError, FileNotFoundError) as exc:
                raise OutcomeUnknownError(
                    f"segment {self.name!r}: create of {path!r} failed ({error}) and reading it back failed ({exc})"
                ) from error
            if again != stored and again != data:
                raise OutcomeUnknownError(
                    f"segment {self.name!r}: create of {path!r} failed ({error}) and two reads of the object "
                    "disagree (damaged in transit?)") from error
            stored = again
        if stored == data:
            _log.info("segment %r: create of %r raised %s but the object holds this append; accepted",
                         self.name, path, type(error).__name__)
            return "ours"
        if not isinstance(error, ChunkExistsError) and not self.storage.exclusive_create_enforced:
            # The store may replace objects (single_writer=True on a store without conditional
            # writes): other bytes where ours may have landed can be an overwrite of ours.
            raise OutcomeUnknownError(
                f"segment {self.name!r}: create of {path!r} failed ({error}) and the object now holds other "
                "bytes: another writer may have overwritten this append (the store ignores If-None-Match and "
                "single_writer=True promised one writing process)") from error
        return "theirs"

    def _created_live(self, path: str, offset: int) -> bool:
        """After a create at ``offset`` whose view aged past half the deletion grace before it
        returned: refresh (one LIST) and say whether the new chunk is live (else it landed on a
        name freed by a truncation or a switch meanwhile, below the start offset or shadowed by a
        replacement: nobody would ever read it). A failed listing is an unknown outcome."""
        try:
            self.refresh()
        except StorageError as exc:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: {path!r} was written after a delay that may have outlasted the deletion "
                f"grace, and whether it is live could not be checked ({exc}); read the segment before appending "
                "again") from exc
        return any(c.start == offset and c.name == chunk_name(offset) for c in self._chunks)

    def _stored_start_offset_after_write(self, path: str) -> int:
        """The stored truncation offset, read after a durable create (so a failure is an unknown outcome)."""
        try:
            return self._stored_start_offset()
        except StorageError as exc:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: {path!r} was written but the truncation offset could not be "
                f"checked ({exc}); read the segment before appending again"
            ) from exc

    def _delete_quietly(self, path: str) -> None:
        try:
            self.storage.delete([path])
        except StorageError as exc:
            _log.warning("segment %r: could not delete %r written below the truncation offset: %s", self.name, path, exc)

    def _after_durable_append(self) -> None:
        """Housekeeping after the append is durable: it must never turn the append into an error."""
        self._delete_dead()

    def _drop_truncated_predecessor(self) -> None:
        """Delete the chunks before the last that lie wholly below the start offset.

        ``truncate`` keeps the last chunk; once an append starts a new one, the old one can go
        (and any whose deletion failed earlier). Object chunks with a deletion grace are only
        marked dead here and deleted once the grace has passed (``_delete_doomed_objects``).
        """
        dead = [c for c in self._chunks[:-1] if c.end <= self._start_offset]
        if dead:
            if self._defers_deletion():
                now = time.monotonic()  # the truncation is durable by now: dead since at most now
                for chunk in dead:
                    self._doomed.setdefault(chunk.name, now)
            else:
                self.storage.delete([f"{self._dir}/{c.name}" for c in dead])
            self._chunks = self._chunks[len(dead):]
            self.view_changes += 1
        self._delete_doomed_objects()

    def _defers_deletion(self) -> bool:
        return not self.storage.appendable and self.storage.deletion_grace > 0

    def _note_dead_objects(self) -> None:
        """After a listing: remember the dead object chunks it showed (left by other handles or
        processes, or by an interrupted deletion), so that this handle deletes them after the grace."""
        if not self._defers_deletion():
            return
        first = self._chunks[0].start if self._chunks else self._start_offset
        now = time.monotonic()  # the listing showed them dead: dead since before now
        for name in self._listed:
            if _CHUNK_NAME.fullmatch(name) and int(name) < first:
                self._doomed.setdefault(name, now)

    def _delete_doomed_objects(self) -> None:
        """Delete the dead object chunks whose grace has passed (one DeleteObjects request)."""
        if not self._doomed:
            return
        expired = time.monotonic() - self.storage.deletion_grace
        ripe = sorted(name for name, since in self._doomed.items() if since <= expired)
        if ripe:
            self.storage.delete([f"{self._dir}/{name}" for name in ripe])
            for name in ripe:
                del self._doomed[name]

    def _stored_start_offset(self) -> int:
        files = self.storage.list_files(f"{self._dir}/{TRUNCATION_DIR}")
        return max((int(n) for n in files if _CHUNK_NAME.fullmatch(n)), default=0)

    # -- reading -------------------------------------------------------------------------------
    def read(self, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset``; they must lie within ``[start_offset, length)``."""
        self._check_open()
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            raise InvalidInputError(f"offset and length must be non-negative ints, got {offset!r}, {length!r}")
        chunks, start_offset = self._chunks, self._start_offset
        end = offset + length
        if offset < start_offset or end > (chunks[-1].end if chunks else start_offset):
            self.refresh()
            chunks, start_offset = self._chunks, self._start_offset
            self._check_range(offset, length, chunks, start_offset)
        if length == 0:
            return b""
        try:
            return self._read_chunks(chunks, offset, end)
        except (FileNotFoundError, HoleError):
            pass
        # A chunk vanished under a stale view (truncated or replaced by another handle), or the
        # view shows a hole that a newer replacement may have changed: look again, once.
        for _attempt in range(MAX_READ_REFRESHES):
            self.refresh()
            self._check_range(offset, length, self._chunks, self._start_offset)
            try:
                return self._read_chunks(self._chunks, offset, end)
            except FileNotFoundError:
                continue  # replaced again meanwhile (compaction keeps running): bounded
        raise StorageError(f"segment {self.name!r}: a chunk holding offset {offset} kept vanishing "
                           f"({MAX_READ_REFRESHES} listings)")

    def _check_range(self, offset: int, length: int, chunks: list[ChunkInfo], start_offset: int) -> None:
        end_offset = chunks[-1].end if chunks else start_offset
        if offset < start_offset:
            raise TruncatedError(self.name, offset, length, start_offset, end_offset)
        if offset + length > end_offset:
            raise OffsetOutOfRangeError(self.name, offset, length, start_offset, end_offset)

    def _read_chunks(self, chunks: list[ChunkInfo], offset: int, end: int) -> bytes:
        pieces = []
        index = bisect.bisect_right(chunks, offset, key=lambda c: c.start) - 1
        position = offset
        while position < end:
            chunk = chunks[index]
            stop = min(chunk.end, end)
            if stop > chunk.stored_end:
                raise HoleError(self.name, chunk.stored_end, chunk.end)
            piece = self.storage.read(f"{self._dir}/{chunk.name}", position - chunk.start, stop - chunk.start)
            if len(piece) != stop - position:  # committed bytes are missing: never a short answer
                missing = position + len(piece)
                raise CorruptDataError(
                    f"segment {self.name!r}: chunk {chunk.name} is shorter than its {chunk.length} committed "
                    f"bytes: byte {missing - chunk.start} of it (segment offset {missing}) is missing",
                    segment=self.name,
                    offset=missing,
                )
            pieces.append(piece)
            position, index = stop, index + 1
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    # -- truncating and deleting ---------------------------------------------------------------
    def truncate(self, offset: int) -> None:
        """Make bytes below ``offset`` unreadable and delete every chunk lying wholly below it.

        The truncation offset only moves forward (a lower ``offset`` is a no-op) and survives
        reopening. The last chunk is kept even when it lies below ``offset``: it holds the length.
        """
        self._check_open()
        if not isinstance(offset, int) or offset < 0:
            raise InvalidInputError(f"truncation offset must be a non-negative int, got {offset!r}")
        with self._truncating:
            with self._mutex:
                self.refresh()  # rare, and only the true chunk list tells which chunk is the last
                if offset > self.length:
                    raise OffsetOutOfRangeError(self.name, offset, 0, self._start_offset, self.length)
                obsolete = self._obsolete_names()
                done = offset <= self._start_offset
            self._delete_obsolete(obsolete)
            if done:
                return
            # The marker goes first: a crash before the deletions leaves only unreachable chunks.
            # It is written without the mutex, so appends through this handle go on meanwhile
            # (they land at the end, past ``offset``; only a truncation takes the start forward).
            self._put_marker(f"{self._dir}/{TRUNCATION_DIR}/{chunk_name(offset)}")
            with self._mutex:
                self._start_offset = max(self._start_offset, offset)
                self._markers = sorted({*self._markers, offset})
                if self._defers_deletion() or not self.storage.appendable:
                    self._delete_dead()
                    self._sweep_layout()
                    return
                chunks, markers = self._dead_below_start()
                self._sweep_layout()
            self._delete_dead_unlocked(chunks, markers)

    def _dead_below_start(self) -> tuple[list[ChunkInfo], list[int]]:
        """Under the mutex: the chunks before the last lying wholly below the start, and the
        markers older than it (storage that deletes at once). Leftovers the listing showed
        below the view's first chunk (an earlier deletion failed, or its process died before it)
        went before the marker (``_obsolete_names``)."""
        return ([c for c in self._chunks[:-1] if c.end <= self._start_offset],
                [m for m in self._markers if m < self._start_offset])

    def _delete_dead_unlocked(self, chunks: list[ChunkInfo], markers: list[int]) -> None:
        """Delete what a truncation made dead without the mutex (appends go on), then drop it from
        the view. A failure is logged, not raised (the truncation holds), and the view keeps the
        chunks: later appends and truncations retry (``_drop_truncated_predecessor``)."""
        if not chunks and not markers:
            return
        try:
            self.storage.delete([f"{self._dir}/{c.name}" for c in chunks]
                                + [f"{self._dir}/{TRUNCATION_DIR}/{chunk_name(m)}" for m in markers])
        except StorageError as exc:
            _log.warning("segment %r: could not delete truncated chunks or markers (retried later): %s", self.name, exc)
            return
        gone, dropped = {c.name for c in chunks}, set(markers)
        with self._mutex:
            self._chunks = [c for c in self._chunks if c.name not in gone or c is self._chunks[-1]]
            self.view_changes += 1
            self._markers = [m for m in self._markers if m not in dropped]

    def _obsolete_names(self) -> list[str]:
        """Under the mutex, right after a ``refresh`` by a truncation or a switch: what the listing
        shows that no view will use again. Objects wholly below the view's first chunk (a
        truncation's deletion that was interrupted, a replacement truncated away), then switch
        markers (docs/format.md, "Deleting switch markers").

        A marker is the commit record of its replacement and, while a view of the generation just
        below it may still be in use, that view's only sign that something switched (appends and
        polls check ``switch/<g + 1>``). So marker ``g`` goes only when (1) a higher marker exists
        (the top one numbers the next switch), (2) no listed replacement has generation ``g``, and
        (3) ``g`` is at most ``t`` of a horizon ``(t, c)`` that has passed. The horizon
        (``_SweepHorizons``): ``t`` is the top generation an earlier listing in this process
        showed, ``c`` the last chunk's start in a listing begun after that one ended. A view of a generation ``G < t`` was listed
        before ``switch/<G + 1>`` existed (listings read chunk names before markers: see
        ``_load_view``), so its last chunk, a plain one, starts at or below ``c``. Once no plain
        chunk at or below ``c`` is listed (truncated or replaced away), that view's next append
        or poll meets its last chunk missing and lists again, marker or no marker. Object stores
        without a deletion grace check the marker after an append's create instead: there the
        truncation offset must also lie past every object at or below ``c``, so that such an
        append is undone as truncated.
        """
        files, first = self._listed, (self._chunks[0].start if self._chunks else self._start_offset)
        plain: dict[str, int] = {}  # name -> start (a truncation's hot path: no regex for plain names)
        replacements: dict[str, tuple[int, int, int]] = {}
        for n in files:
            if len(n) == 20 and n.isdigit():
                plain[n] = int(n)
            elif _REPLACEMENT_NAME.fullmatch(n):
                replacements[n] = _parse_replacement(n)
        dead = [] if self._defers_deletion() else [n for n, start in plain.items() if start < first]
        dead += [n for n, (start, end, _gen) in replacements.items() if start < first and end <= first]
        dead.sort()  # plain names on object stores with a grace keep it (``_doomed``)
        top = self._layout.generation
        horizon = _SWEEPS.horizon((self.storage.url, self._dir), top, self.length,
                                  self._chunks[-1].start if self._chunks else None, self._listed_at)
        if horizon is None:
            return dead
        horizon_gen, horizon_start = horizon
        checks_after_create = not self.storage.appendable and self.storage.deletion_grace <= 0
        lowest = min(plain.values(), default=horizon_start + 1)
        if checks_after_create:
            lowest = min([lowest] + [start for start, _end, _gen in replacements.values()])
        if lowest <= horizon_start:
            return dead  # a view of an old generation may still find its last chunk
        if checks_after_create and not self._start_offset > first:
            return dead
        _SWEEPS.passed((self.storage.url, self._dir), horizon)
        in_use = {gen for _start, _end, gen in replacements.values()}
        markers = [gen for gen in self._switch_markers(files) if gen < top and gen <= horizon_gen and gen not in in_use]
        return dead + [f"{SWITCH_DIR}/{chunk_name(gen)}" for gen in sorted(markers)]

    @staticmethod
    def _switch_markers(files: dict[str, int]) -> list[int]:
        return [int(n[len(SWITCH_DIR) + 1:]) for n in files
                if n.startswith(SWITCH_DIR + "/") and _CHUNK_NAME.fullmatch(n[len(SWITCH_DIR) + 1:])]

    def _delete_obsolete(self, names: list[str], *, locked: bool = False) -> None:
        """Delete what ``_obsolete_names`` found, in one request, under the writers' lock on
        appendable storage (``locked``: the caller holds it): an appender's catch-up, under the
        lock, then sees either its last chunk or the marker it checks, never neither. Best
        effort: leftovers wait for the next truncation or switch."""
        if not names:
            return
        guard = self.storage.lock(self._dir) if self.storage.appendable and not locked else contextlib.nullcontext()
        try:
            with guard:
                self.storage.delete([f"{self._dir}/{n}" for n in names])
        except StorageError as exc:
            _log.warning("segment %r: could not delete %d obsolete chunks or switch markers (retried later): %s",
                         self.name, len(names), exc)

    def _put_marker(self, path: str) -> None:
        """Write a truncation marker; after an error, whether it exists decides the outcome."""
        try:
            self.storage.put_marker(path)
            return
        except StorageError as exc:
            error = exc
        try:
            stored = self.storage.exists(path)
        except StorageError as exc:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: writing {path!r} failed ({error}) and checking it failed ({exc})"
            ) from error
        if stored:
            _log.info("segment %r: writing %r raised %s but the marker is stored; accepted",
                      self.name, path, type(error).__name__)
            return
        if isinstance(error, OutcomeUnknownError):
            raise StorageError(f"segment {self.name!r}: the truncation did not happen ({error})") from error
        raise error

    def _delete_dead(self) -> None:
        """After a truncation is durable: delete the chunks and markers it made dead. A failure is
        logged, not raised (the truncation holds), and retried by later appends and truncations."""
        chunks, start = self._chunks, self._start_offset
        if not ((len(chunks) > 1 and chunks[0].end <= start) or self._doomed or any(m < start for m in self._markers)):
            return  # nothing is dead (after most appends)
        try:
            self._drop_truncated_predecessor()
            old = [m for m in self._markers if m < self._start_offset]
            if old:
                self.storage.delete([f"{self._dir}/{TRUNCATION_DIR}/{chunk_name(m)}" for m in old])
            self._markers = [m for m in self._markers if m >= self._start_offset]
        except StorageError as exc:
            _log.warning("segment %r: could not delete truncated chunks or markers (retried later): %s", self.name, exc)

    # -- replacing chunks ----------------------------------------------------------------------
    def replace_range(self, start: int, end: int, data: bytes, *, expected: list[str] | None = None) -> None:
        """Atomically replace the sealed chunks covering exactly ``[start, end)`` by one chunk holding ``data``.

        ``start`` and ``end`` must be chunk boundaries of this handle's view (``chunks()``), at or
        above ``start_offset``, and the last chunk is never replaced. ``len(data) <= end - start``;
        if shorter, ``[start + len(data), end)`` becomes a hole (reads touching it raise
        ``HoleError``; ``holes()`` lists them). Offsets never move.

        It is a compare-and-swap on the chunks in the range: ``expected``, the names of the chunks
        the caller planned with (default: those this handle's view shows now). If another handle
        or process replaced or truncated them first, ``LayoutConflictError`` and nothing changed;
        so too when the view was reloaded since the caller planned (a read or a replacement of
        this handle looks again) and the range is no longer made of those chunks. Readers and
        writers elsewhere see the old chunks or the new one, never a mix; a crash at any point
        leaves one of the two, and the leftovers are deleted by the next replacement or truncation.
        """
        self._check_open()
        data = b"" if isinstance(data, (bytes, bytearray, memoryview)) and not len(data) else _as_bytes(data)
        for value, what in ((start, "start"), (end, "end")):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(f"replace_range {what} must be a non-negative int, got {value!r}")
        if end <= start or len(data) > end - start:
            raise InvalidInputError(f"segment {self.name!r}: replace_range needs start < end and at most "
                                    f"end - start bytes; got [{start}, {end}) with {len(data)} bytes")
        with self._mutex:
            if expected is None:
                expected = [c.name for c in self._sealed_run(self._chunks, self._start_offset, start, end,
                                                             InvalidInputError)]
            elif not expected or not all(isinstance(n, str) for n in expected):
                raise InvalidInputError(f"replace_range expected must be a non-empty list of chunk names, "
                                        f"got {expected!r:.100}")
            locked = self.storage.lock(self._dir) if self.storage.appendable else contextlib.nullcontext()
            with locked:
                self._replace_locked(start, end, data, expected)

    def _replace_locked(self, start: int, end: int, data: bytes, expected: list[str]) -> None:
        for _attempt in range(MAX_REPLACE_ATTEMPTS):
            self.refresh()
            run = self._sealed_run(self._chunks, self._start_offset, start, end, LayoutConflictError)
            if [c.name for c in run] != expected:
                raise LayoutConflictError(
                    f"segment {self.name!r}: the chunks in [{start}, {end}) changed since this handle looked "
                    f"(replaced by another handle: {[c.name for c in run]} instead of {expected}); nothing replaced")
            if self.storage.appendable:
                self._delete_quietly_all(self._layout.debris)  # under the lock nobody else is replacing
            gen = self._layout.generation + 1
            name = replacement_name(start, end, gen)
            if not self._write_replacement(name, data):
                self._fence(gen)  # a crashed or slower replacer holds the name: take its generation away
                continue
            if not self._switch(gen, name):
                self._delete_quietly_all([name])
                continue  # another replacement took this generation: look again
            self._confirm_switch(start, end, name)
            self._sweep_layout()
            self._delete_obsolete(self._obsolete_names(), locked=True)  # this listing: _confirm_switch's
            return
        raise LayoutConflictError(f"segment {self.name!r}: gave up replacing [{start}, {end}) after "
                                  f"{MAX_REPLACE_ATTEMPTS} lost races with other replacers; nothing replaced")

    def _sealed_run(self, chunks: list[ChunkInfo], start_offset: int, start: int, end: int,
                    error: type[StorageError] | type[InvalidInputError]) -> list[ChunkInfo]:
        """The chunks covering exactly ``[start, end)`` in a view, all sealed; else ``error``."""
        starts = [c.start for c in chunks]
        i = bisect.bisect_left(starts, start)
        j = i
        while j < len(chunks) - 1 and chunks[j].end < end:
            j += 1
        problem = None
        if start < start_offset:
            problem = f"start {start} lies below the start offset {start_offset}"
        elif i >= len(chunks) or starts[i] != start:
            problem = f"no chunk starts at {start}"
        elif j >= len(chunks) - 1 or chunks[j].end != end:
            problem = f"no sealed chunk ends at {end} (the last chunk, which is appended to, is never replaced)"
        if problem is not None:
            raise error(f"segment {self.name!r}: cannot replace [{start}, {end}): {problem}; chunks are "
                        f"{[(c.start, c.end) for c in chunks[-8:]]}{' (last 8)' if len(chunks) > 8 else ''}")
        return chunks[i:j + 1]

    def _write_replacement(self, name: str, data: bytes) -> bool:
        """Write the (still invisible) replacement object; ``False`` if another replacer holds the name."""
        path = f"{self._dir}/{name}"
        try:
            self.storage.create(path, data)
            return True
        except StorageError as exc:
            found = self._settle_object(path, data, exc)
            if found == "ours":
                return True
            if found == "theirs":
                return False
            if isinstance(exc, OutcomeUnknownError):
                raise StorageError(f"segment {self.name!r}: the replacement did not happen ({exc})") from exc
            raise

    def _switch(self, gen: int, name: str) -> bool:
        """Create the switch marker of ``gen`` naming ``name``: the atomic switch. ``False`` if
        another replacement took ``gen`` first; ``OutcomeUnknownError`` if it cannot be told."""
        path = f"{self._dir}/{SWITCH_DIR}/{chunk_name(gen)}"
        content = name.encode("ascii")
        try:
            self.storage.create(path, content)
            return True
        except StorageError as exc:
            try:
                found = self._settle_object(path, content, exc)
            except OutcomeUnknownError:
                raise OutcomeUnknownError(
                    f"segment {self.name!r}: the switch to {name} may or may not have happened ({exc}); "
                    "refresh to see which layout holds") from exc
            if found == "ours":
                return True
            if found == "theirs":
                return False
            self._delete_quietly_all([name])
            if isinstance(exc, OutcomeUnknownError):
                raise StorageError(f"segment {self.name!r}: the replacement did not happen ({exc})") from exc
            raise

    def _fence(self, gen: int) -> None:
        """Take generation ``gen`` with an empty switch marker (it switches nothing): the replacer
        holding it, if alive, then loses its switch and looks again. Losing this race is fine too."""
        try:
            self.storage.create(f"{self._dir}/{SWITCH_DIR}/{chunk_name(gen)}", b"")
        except ChunkExistsError:
            pass
        except OutcomeUnknownError as exc:
            _log.info("segment %r: fencing generation %d: %s (the next listing tells)", self.name, gen, exc)

    def _offset_replaced(self, offset: int) -> bool:
        """After creating the chunk at ``offset`` on an object store: whether a replacement in force
        covers ``offset`` (the name was free because a switch deleted it: this view was stale).

        One existence check when no switch happened since this view; switches are numbered one
        after another, so a newer one exists iff the next generation's marker does.
        """
        try:
            if not self.storage.exists(f"{self._dir}/{SWITCH_DIR}/{chunk_name(self._layout.generation + 1)}"):
                return False
            self.refresh()
        except StorageError as exc:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: the chunk at {offset} was written but whether a replacement covers it "
                f"could not be checked ({exc}); read the segment before appending again") from exc
        if any(c.start == offset and c.name == chunk_name(offset) for c in self._chunks):
            # Not replaced: keep the view up to our chunk, which the caller adds back.
            self._chunks = [c for c in self._chunks if c.end <= offset]
            self.view_changes += 1
            return False
        return True

    def _confirm_switch(self, start: int, end: int, name: str) -> None:
        """After the switch: a replacement of a higher generation that overlaps ours (a racer that
        listed before us and switched after) wins; then take ours back and report the conflict."""
        try:
            self.refresh()
        except StorageError as exc:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: switched to {name} but could not list the segment after it ({exc}); "
                "refresh to see whether the replacement holds") from exc
        if name not in self._layout.accepted:
            self._delete_quietly_all([name])  # its marker stays until a sweep: generations are never reused
            raise LayoutConflictError(
                f"segment {self.name!r}: another replacement of [{start}, {end}) switched at the same time and "
                "won; nothing of this one is visible")

    def _sweep_layout(self) -> None:
        """Delete what no view can use any more: chunks shadowed by replacements, and replacements
        that lost or were never switched to. Best effort: leftovers are harmless and the next
        replacement or truncation deletes them. Switch markers stay here: "has anything switched
        since my view" is the existence of the next generation's marker, so old ones go only once
        no view can ask that of them (``_obsolete_names``)."""
        layout = self._layout
        self._delete_quietly_all(layout.losers)  # first: with its winner gone a loser would look switched
        retired = layout.retired
        if self._defers_deletion():
            # A plain chunk name freed now could be re-created by a stale appender (1 PUT, no
            # LIST): it keeps its name for the deletion grace, like a truncated chunk.
            now = time.monotonic()
            for name in retired:
                if _CHUNK_NAME.fullmatch(name):
                    self._doomed.setdefault(name, now)
            retired = tuple(n for n in retired if not _CHUNK_NAME.fullmatch(n))
            try:
                self._delete_doomed_objects()
            except StorageError as exc:
                _log.warning("segment %r: could not delete dead chunks (retried later): %s", self.name, exc)
        self._delete_quietly_all(retired)

    def _delete_quietly_all(self, names) -> None:
        if names:
            try:
                self.storage.delete([f"{self._dir}/{n}" for n in names])
            except StorageError as exc:
                _log.warning("segment %r: could not delete %d replaced chunks or markers (retried later): %s",
                             self.name, len(names), exc)

    def compact_chunks(self, target_size: int | None = None) -> int:
        """Merge runs of small sealed chunks into chunks of up to ``target_size`` bytes (default:
        ``rolling_size``), each by one ``replace_range`` with the exact bytes; return how many
        merged chunks were written. Bytes and offsets do not change; runs that another process
        replaces meanwhile are skipped. Holds at most one merged chunk in memory."""
        self._check_open()
        target = self.rolling_size if target_size is None else target_size
        if not isinstance(target, int) or isinstance(target, bool) or target <= 0:
            raise InvalidInputError(f"target_size must be a positive int or None, got {target_size!r}")
        written = 0
        with self._mutex:
            self.refresh()
            for run in self.small_runs(target):
                start, end = run[0].start, run[-1].end
                try:
                    data = self.read(start, run[-1].stored_end - start)
                    self.replace_range(start, end, data)
                except (LayoutConflictError, FileNotFoundError) as exc:
                    _log.info("segment %r: consolidating [%d, %d) skipped: %s", self.name, start, end, exc)
                    continue
                written += 1
        return written

    def small_runs(self, target: int) -> list[list[ChunkInfo]]:
        """Runs of two or more adjacent sealed chunks of this view whose stored bytes fit in
        ``target``: what ``compact_chunks`` merges. A chunk with a hole may only end a run (the
        merged chunk keeps its hole at the end)."""
        runs: list[list[ChunkInfo]] = []
        run: list[ChunkInfo] = []
        size = 0
        for chunk in self._chunks[:-1]:
            if run and (size + chunk.stored > target or run[-1].stored < run[-1].length):
                runs.append(run)
                run, size = [], 0
            if chunk.start >= self._start_offset and chunk.stored < target:
                run.append(chunk)
                size += chunk.stored
            elif run:
                runs.append(run)
                run, size = [], 0
        runs.append(run)
        return [r for r in runs if len(r) > 1]

    def delete(self) -> None:
        """Delete the segment and all its chunks; the handle then sees an empty segment."""
        self._check_open()
        with self._mutex:
            self.remove(self.storage, self.name)
            self._chunks, self._start_offset, self._markers, self._layout = [], 0, [], _Layout()
            self.view_changes += 1
            self._tail = self._tail_name = None
            self._doomed.clear()

    @staticmethod
    def remove(storage: ChunkStorage, name: str) -> None:
        """Delete segment ``name`` of ``storage`` whole, without a handle (none can be opened on a
        damaged one): ``StorageError`` if anything stays. Handles elsewhere see it empty."""
        directory = validate_segment_name(name) + SEGMENT_SUFFIX
        storage.remove_directory(directory)
        _SWEEPS.forget((storage.url, directory))

    def close(self) -> None:
        """Forget the handle's view; later calls raise ``StorageError``. Data is already durable."""
        self._closed = True

    def __enter__(self) -> "RollingSegment":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"segment {self.name!r} handle is closed")


def _as_bytes(data: object) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise InvalidInputError(f"data must be bytes-like, got {type(data).__name__}")


def _parse_replacement(name: str) -> tuple[int, int, int]:
    """``(start, end, generation)`` of a replacement chunk name."""
    match = _REPLACEMENT_NAME.fullmatch(name)
    return int(match[1]), int(match[2]), int(match[3])


def _inside(position: int, ranges: list[tuple[int, int, int]]) -> bool:
    return any(start <= position < end for start, end, _gen in ranges)


def _overlaps(start: int, end: int, ranges: list[tuple[int, int, int]]) -> bool:
    return any(start < other_end and other_start < end for other_start, other_end, _gen in ranges)
