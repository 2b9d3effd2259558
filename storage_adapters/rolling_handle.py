"""``SegmentHandle``: one handle's view of a rolling segment and the I/O every strategy shares.

A handle lists the segment (``refresh``: rolling_view.Listing makes the view), reads through its
view, truncates the head, deletes what truncations and switches left dead, and settles ambiguous
creates by reading. How it appends, polls, and when dead chunks may go depends on the storage:
a subclass per strategy, chosen once when the segment is opened —
``rolling_inplace.InPlaceHandle`` (appendable storage: local disk, memory) and
``rolling_objects.ObjectHandle`` (object stores: one new object per append). Replacing chunks is
rolling_replace.py's. The public face of all of it is ``rolling.RollingSegment``.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from typing import Any

from .base import ChunkStorage
from .errors import (
    ChunkExistsError,
    CorruptDataError,
    HoleError,
    LayoutConflictError,
    OffsetOutOfRangeError,
    OutcomeUnknownError,
    RetriesExhaustedError,
    StorageError,
)
from .framing import Framing
from .rolling_sweep import SWEEPS, obsolete_names
from .rolling_view import (
    CHUNK_NAME,
    SEGMENT_SUFFIX,
    SWITCH_DIR,
    TRUNCATION_DIR,
    ChunkInfo,
    Listing,
    SegmentView,
    chunk_name,
)
from .tail import TailLook

_log = logging.getLogger("attrindex.storage")

#: Bound on the listings one ``refresh`` takes while other processes keep changing the segment.
MAX_REFRESH_ATTEMPTS = 20
MAX_READ_REFRESH_ATTEMPTS = 10  #: listings one read takes when the chunks of its view keep vanishing


class SegmentHandle:
    """The state of one handle on segment ``name`` of ``storage`` and the I/O all strategies share.

    ``view`` is the handle's view as of its last ``refresh``/``append``/``truncate`` (a
    ``SegmentView``: replaced whole, never changed in place, so a reader that took it reads a
    consistent one). ``mutex`` (an ``RLock``) orders the handle's threads; ``truncating`` lets one
    truncation of the handle run its I/O without ``mutex``.
    """

    #: chunks are written whole, so each but the last ends where the next begins (object stores)
    whole_objects = False
    #: the last look at the end of the view's last chunk, on storage where appends can tear
    #: (rolling_inplace.py); its ``torn`` is a torn write found after the committed end
    tail: TailLook | None = None

    def __init__(self, storage: ChunkStorage, name: str, rolling_size: int, framing: Framing | None):
        self.storage = storage
        self.name = name
        self.rolling_size = rolling_size
        self.framing = framing
        self.directory = name + SEGMENT_SUFFIX
        self.mutex = threading.RLock()
        self.truncating = threading.Lock()  #: one truncation of this handle at a time (its I/O runs without mutex)
        self.view = SegmentView()
        self.closed = False
        self.view_time = float("-inf")  #: monotonic time before the listing (or own create) behind the view
        #: bumped whenever the view is reloaded or cut (refresh, truncation, replacement, deletion):
        #: a layer above that keeps its own copy of the chunk list compares it to know the copy is stale
        self.view_changes = 0
        self.listing = Listing({})  #: the listing behind the view
        self.listed_at = float("-inf")  #: monotonic time before the listing behind ``listing`` began

    def path(self, name: str) -> str:
        """The storage path of ``name`` (a chunk, ``truncation/...``, ``switch/...``) in the segment."""
        return f"{self.directory}/{name}"

    def check_open(self) -> None:
        if self.closed:
            raise StorageError(f"segment {self.name!r} handle is closed")

    # -- the strategy's part -------------------------------------------------------------------
    def append(self, data: bytes, expected_offset: int | None) -> int:
        """Under ``mutex``: append ``data`` (input already checked) and return its offset."""
        raise NotImplementedError

    def poll(self) -> bool:
        """Under ``mutex``: whether the segment may have grown since the view."""
        raise NotImplementedError

    def measure_last(self, chunk: ChunkInfo) -> tuple[int | None, Any]:
        """While loading a view: the committed length of its last chunk, a plain one, when the
        listing's size does not tell it (``None``: the size does), and what the look found, handed
        back to ``view_loaded``. ``FileNotFoundError`` if it is gone."""
        return None, None

    def view_loaded(self, look: Any) -> None:
        """After ``refresh`` took a new view: adopt what ``measure_last`` found."""

    def writers_lock(self) -> contextlib.AbstractContextManager[None]:
        """What appends and replacements of the segment hold (a directory lock, or nothing)."""
        return contextlib.nullcontext()

    def clear_debris(self, names: tuple[str, ...]) -> None:
        """Under ``writers_lock``, before a replacement: delete replacements never switched to, if
        that lock keeps every other replacer out (else leave them: one may still be written)."""

    def dead_after_truncation(self) -> tuple[list[ChunkInfo], list[int]]:
        """Under ``mutex``, after a truncation marker: delete or schedule what it made dead, and
        return what is still to be deleted once ``mutex`` is released (appends go on meanwhile)."""
        self.delete_dead()
        return [], []

    def discard_chunks(self, dead: list[ChunkInfo]) -> None:
        """Delete the dead chunks ``dead`` (or keep their names for a grace first)."""
        self.storage.delete([self.path(c.name) for c in dead])

    def retire_now(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """Of ``names`` that a layout retired, those to delete now (the rest wait for a grace)."""
        return names

    def keeps_dead_names(self) -> bool:
        """Whether dead plain chunks keep their names for a deletion grace."""
        return False

    def checks_after_create(self) -> bool:
        """Whether an append checks the truncation offset and the next switch marker after its create."""
        return False

    def cut_short(self) -> bool:
        """Whether the last chunk is shorter than its backend keeps it past committed frames."""
        return False

    # -- the view ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Reload the view from storage; retaken while listings are inconsistent, at most
        ``MAX_REFRESH_ATTEMPTS`` times (``StorageError`` then)."""
        self.check_open()
        with self.mutex:
            for _attempt in range(MAX_REFRESH_ATTEMPTS):
                started = time.monotonic()
                loaded = self.load_view()
                if loaded is not None:
                    self.view, look = loaded
                    self.view_changes += 1
                    self.view_time = self.listed_at = started
                    self.view_loaded(look)
                    return
                _log.info("segment %r: the listing raced an append or truncation; listing again", self.name)
        raise RetriesExhaustedError(
            f"segment {self.name!r}: {MAX_REFRESH_ATTEMPTS} listings in a row saw the segment change under "
            "them; no consistent view could be read"
        )

    def load_view(self) -> tuple[SegmentView, Any] | None:
        """``(view, the look at the last chunk's end)`` from one listing, or ``None`` if it is inconsistent."""
        listing = self.listing = Listing(self.storage.list_files(self.directory))
        layout = listing.layout({gen: self.switch_target(gen) for gen in listing.contested()})
        if layout is None:
            return None  # a marker vanished while being read
        last, last_length, look = listing.last_plain(layout), None, None
        if last is not None:
            try:
                last_length, look = self.measure_last(last)
            except FileNotFoundError:
                return None  # deleted after the listing: a truncation moved on
        view = listing.view(layout, self.name, last_length=last_length, whole_objects=self.whole_objects)
        return None if view is None else (view, look)

    def switch_target(self, gen: int) -> str | None:
        """The replacement a switch marker names (read only when several share its generation)."""
        try:
            return self.storage.read(self.path(f"{SWITCH_DIR}/{chunk_name(gen)}"), 0, 200).decode("ascii", "replace")
        except FileNotFoundError:
            return None

    def next_switch_exists(self) -> bool:
        """Whether the switch after the view's generation happened (switches are numbered one
        after another: one existence check)."""
        return self.storage.exists(self.path(f"{SWITCH_DIR}/{chunk_name(self.view.layout.generation + 1)}"))

    def switched_since_view(self) -> bool:
        """Whether a chunk switch may have happened since this view (then ``refresh``).

        One existence check of the next generation's marker tells (a view of an empty segment
        lists the segment when that one is absent: see below).
        """
        if self.next_switch_exists():
            return True
        if self.view.chunks:
            return False  # its last chunk is found missing once markers above it may go
        # A view of an empty segment has no last chunk to find missing. That is what lets old
        # markers go (rolling_sweep.py): ``switch/<g + 1>`` may be deleted while a higher one
        # (the top one, never deleted) says that something switched. And chunk ``length`` may be
        # gone already: appended to, rolled past and deleted by retention since this view. One
        # listing of the segment tells both (any chunk, a newer truncation or a newer switch).
        listing = Listing(self.storage.list_files(self.directory))
        return listing.shows_change_since(self.view.layout.generation, self.view.start_offset)

    def poll_next_name(self) -> bool:
        """Whether the chunk the next append creates exists (one 1-byte read), or a switch may
        have taken its name since the view."""
        try:
            self.storage.read(self.path(chunk_name(self.view.length)), 0, 1)
        except FileNotFoundError:
            return self.switched_since_view()
        return True

    def stored_start_offset(self) -> int:
        """The truncation offset as stored (one listing of the markers)."""
        files = self.storage.list_files(self.path(TRUNCATION_DIR))
        return max((int(n) for n in files if CHUNK_NAME.fullmatch(n)), default=0)

    # -- reading -------------------------------------------------------------------------------
    def read(self, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset`` (checked ints) within ``[start_offset, length)``."""
        view = self.view
        end = offset + length
        if offset < view.start_offset or end > view.length:
            self.refresh()
            view = self.view
            view.check_range(self.name, offset, length)
        if length == 0:
            return b""
        try:
            return self.read_chunks(view.chunks, offset, end)
        except (FileNotFoundError, HoleError):
            pass
        # A chunk vanished under a stale view (truncated or replaced by another handle), or the
        # view shows a hole that a newer replacement may have changed: look again, once.
        for _attempt in range(MAX_READ_REFRESH_ATTEMPTS):
            self.refresh()
            view = self.view
            view.check_range(self.name, offset, length)
            try:
                return self.read_chunks(view.chunks, offset, end)
            except FileNotFoundError:
                continue  # replaced again meanwhile (compaction keeps running): bounded
        raise RetriesExhaustedError(f"segment {self.name!r}: a chunk holding offset {offset} kept vanishing "
                                    f"({MAX_READ_REFRESH_ATTEMPTS} listings)")

    def read_chunks(self, chunks: tuple[ChunkInfo, ...], offset: int, end: int) -> bytes:
        """The bytes ``[offset, end)`` from ``chunks``; ``HoleError`` for a hole, ``CorruptDataError``
        for committed bytes missing, ``FileNotFoundError`` for a chunk gone."""
        pieces = []
        index = bisect.bisect_right(chunks, offset, key=lambda c: c.start) - 1
        position = offset
        while position < end:
            chunk = chunks[index]
            stop = min(chunk.end, end)
            if stop > chunk.stored_end:
                raise HoleError(self.name, chunk.stored_end, chunk.end)
            piece = self.storage.read(self.path(chunk.name), position - chunk.start, stop - chunk.start)
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
    def truncate(self, offset: int, expected: str | None = None) -> None:
        """Make bytes below ``offset`` (a checked int) unreadable and delete the chunks wholly below
        it, if the chunk holding ``offset`` is still ``expected`` (when given)."""
        with self.truncating:
            with self.mutex:
                self.refresh()  # rare, and only the true chunk list tells which chunk is the last
                if offset > self.view.length:
                    raise OffsetOutOfRangeError(self.name, offset, 0, self.view.start_offset, self.view.length)
                holder = self.view.chunk_at(offset)
                if expected is not None and offset > self.view.start_offset and (
                        holder is None or holder.name != expected):
                    raise LayoutConflictError(
                        f"segment {self.name!r}: byte {offset} now lies in chunk {holder.name if holder else None}, not "
                        f"{expected} (replaced by another handle since it was chosen); nothing truncated")
                obsolete = self.obsolete_names()
                done = offset <= self.view.start_offset
            self.delete_obsolete(obsolete)
            if done:
                return
            # The marker goes first: a crash before the deletions leaves only unreachable chunks.
            # It is written without the mutex, so appends through this handle go on meanwhile
            # (they land at the end, past ``offset``; only a truncation takes the start forward).
            self.put_marker(self.path(f"{TRUNCATION_DIR}/{chunk_name(offset)}"))
            with self.mutex:
                self.view = self.view.truncated(offset)
                chunks, markers = self.dead_after_truncation()
                self.sweep_layout()
            self.delete_dead_unlocked(chunks, markers)

    def put_marker(self, path: str) -> None:
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

    def delete_dead(self) -> None:
        """After an append or a truncation is durable: delete the chunks and markers a truncation
        made dead. A failure is logged, not raised (the truncation holds, and an append is never
        turned into an error), and retried by later appends and truncations."""
        view = self.view  # ``view.has_dead()``, inlined: this runs after every append
        chunks, start = view.chunks, view.start_offset
        if not ((len(chunks) > 1 and chunks[0].end <= start) or any(m < start for m in view.markers)):
            return  # nothing is dead (after most appends)
        try:
            self.drop_dead_chunks()
            old = self.view.dead_markers()
            if old:
                self.storage.delete([self.path(f"{TRUNCATION_DIR}/{chunk_name(m)}") for m in old])
                self.view = self.view.without(set(), set(old))
        except StorageError as exc:
            _log.warning("segment %r: could not delete truncated chunks or markers (retried later): %s", self.name, exc)

    def drop_dead_chunks(self) -> None:
        """Delete the chunks before the last that lie wholly below the start offset (truncation
        keeps the last chunk; once an append starts a new one, the old one can go), and drop them
        from the view."""
        dead = self.view.dead_chunks()
        if dead:
            self.discard_chunks(dead)
            self.view = self.view.without({c.name for c in dead})
            self.view_changes += 1

    def delete_dead_unlocked(self, chunks: list[ChunkInfo], markers: list[int]) -> None:
        """Delete what a truncation made dead without the mutex (appends go on), then drop it from
        the view. A failure is logged, not raised (the truncation holds), and the view keeps the
        chunks: later appends and truncations retry (``delete_dead``)."""
        if not chunks and not markers:
            return
        try:
            self.storage.delete([self.path(c.name) for c in chunks]
                                + [self.path(f"{TRUNCATION_DIR}/{chunk_name(m)}") for m in markers])
        except StorageError as exc:
            _log.warning("segment %r: could not delete truncated chunks or markers (retried later): %s", self.name, exc)
            return
        with self.mutex:
            self.view = self.view.without({c.name for c in chunks}, set(markers))
            self.view_changes += 1

    def obsolete_names(self) -> list[str]:
        """Under the mutex, right after a ``refresh`` by a truncation or a switch: what the listing
        shows that no view will use again (rolling_sweep.obsolete_names)."""
        return obsolete_names((self.storage.url, self.directory), self.listing, self.view, self.listed_at,
                              keeps_dead_names=self.keeps_dead_names(),
                              checks_after_create=self.checks_after_create())

    def delete_obsolete(self, names: list[str], *, locked: bool = False) -> None:
        """Delete what ``obsolete_names`` found, in one request, under the writers' lock
        (``locked``: the caller holds it): an appender's catch-up, under the lock, then sees either
        its last chunk or the marker it checks, never neither. Best effort: leftovers wait for the
        next truncation or switch."""
        if not names:
            return
        try:
            with contextlib.nullcontext() if locked else self.writers_lock():
                self.storage.delete([self.path(n) for n in names])
        except StorageError as exc:
            _log.warning("segment %r: could not delete %d obsolete chunks or switch markers (retried later): %s",
                         self.name, len(names), exc)

    def sweep_layout(self) -> None:
        """Delete what no view can use any more: chunks shadowed by replacements, and replacements
        that lost or were never switched to. Best effort: leftovers are harmless and the next
        replacement or truncation deletes them. Switch markers stay here: "has anything switched
        since my view" is the existence of the next generation's marker, so old ones go only once
        no view can ask that of them (``obsolete_names``)."""
        layout = self.view.layout
        retired = list(layout.retired)
        if not self.delete_quietly(layout.losers):  # first: with its winner gone a loser would look switched
            retired = layout.after_their_losers(retired)
        self.delete_quietly(self.retire_now(tuple(retired)))

    def delete_quietly(self, names, what: str = "replaced chunks or markers") -> bool:
        """Delete ``names`` of the segment, best effort (logged; retried by later sweeps); whether
        it did."""
        if names:
            try:
                self.storage.delete([self.path(n) for n in names])
            except StorageError as exc:
                _log.warning("segment %r: could not delete %d %s (retried later): %s",
                             self.name, len(names), what, exc)
                return False
        return True

    # -- settling a create ---------------------------------------------------------------------
    def settle_create(self, path: str, data: bytes, error: StorageError) -> str:
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

    # -- the whole segment ---------------------------------------------------------------------
    def forget(self) -> None:
        """After the segment was deleted: an empty view."""
        self.view = SegmentView()
        self.view_changes += 1

    @staticmethod
    def remove(storage: ChunkStorage, directory: str) -> None:
        """Delete the segment directory ``directory`` of ``storage`` whole."""
        storage.remove_directory(directory)
        SWEEPS.forget((storage.url, directory))

