"""``InPlaceHandle``: the strategy of appendable storage (local disk, memory): chunks grown in place.

Appends grow the last chunk in place under the writers' lock (``ChunkStorage.lock``) until it
reaches ``rolling_size``, then trim it to its end (``ChunkStorage.trim``) and start the next; only
a chunk with no successor is appended to, which a writer checks under the lock, whatever rolling
size other writers use (docs/storage.md, "Rolling into a new chunk"). Where appends can tear
(``torn_appends``: local disk) the committed end of the last chunk is the end of its chain of
frames (framing.py, tail.py): no commit record is kept, and a torn write past it is cut by the
next append into the chunk. Truncation never deletes the last chunk, so the segment's length can
always be recovered from its chunks alone.
"""

from __future__ import annotations

import contextlib
import logging

from .errors import BadOffsetError, InvalidInputError, OutcomeUnknownError, StorageError
from .rolling_handle import SegmentHandle
from .rolling_view import ChunkInfo, chunk_name
from .tail import MARK_BYTES, TailLook, look_at_tail

_log = logging.getLogger("attrindex.storage")


class InPlaceHandle(SegmentHandle):
    """A segment handle on appendable storage: appends grow the last chunk in place."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tail: TailLook | None = None  #: the last look at the end of the view's last chunk
        self.tail_name: str | None = None  #: the chunk ``tail`` is about

    # -- appending -----------------------------------------------------------------------------
    def append(self, data: bytes, expected_offset: int | None) -> int:
        """Under the writers' lock: catch up, compare, then append to the last chunk if it is not
        full, else trim it and start the next. Only a chunk with no successor is appended to:
        found so under the lock, it is the segment's last chunk and no truncation deletes it."""
        with self.storage.lock(self.directory):
            self.catch_up()
            view = self.view
            rolls = not view.chunks or view.chunks[-1].length >= self.rolling_size  # none yet, or the last is full
            stored_start = self.stored_start_offset() if rolls else None
            if stored_start is not None and stored_start > view.length:
                # Another handle truncated past the end of this view: the walk from the view's last
                # chunk found no successor because it was deleted (the walk raced the deletions, or
                # started from a leftover chunk whose deletion failed). Creating the next chunk would
                # fork the log at a reused offset below the truncation; the true tail is elsewhere.
                self.refresh()
                view = self.view
                stored_start = view.start_offset
            offset = view.length
            if expected_offset is not None and expected_offset != offset:
                raise BadOffsetError(self.name, expected_offset, offset)
            last = view.chunks[-1] if view.chunks else None
            tail = self.tail
            clear_to = 0
            if rolls:
                if last is not None:
                    self.trim(last)
                last = ChunkInfo(offset, 0, chunk_name(offset))
                # Rolling is rare: learn of truncations elsewhere so the old chunk can go if dead.
                self.view = view.appended(last, stored_start or 0)
                self.tail = self.tail_name = tail = None
            elif tail is not None and tail.torn is not None and self.tail_name == last.name:
                torn_start, torn_end = tail.torn
                clear_to = torn_end - last.start
                _log.warning("segment %r: cutting %d bytes of a torn write at position %d (chunk %s): the "
                             "newest write before a crash, never committed", self.name, torn_end - torn_start,
                             torn_start, last.name)
            if self.framing is not None:
                data = self.framing.place(data, offset)
            path = f"{self.directory}/{last.name}"
            before = tail.mark if tail is not None and self.tail_name == last.name else b""
            try:
                self.storage.append(path, last.length, data, clear_to=clear_to)
            except StorageError as exc:
                self.settle_append(last, data, exc)  # returns only if the append is there
            self.view = self.view.with_last(ChunkInfo(last.start, last.length + len(data), last.name))
            if self.storage.torn_appends:
                mark = bytes(data[-MARK_BYTES:]) if len(data) >= MARK_BYTES else (before + bytes(data))[-MARK_BYTES:]
                self.tail, self.tail_name = TailLook(offset + len(data), mark=mark), last.name
        self.delete_dead()
        return offset

    def trim(self, last: ChunkInfo) -> None:
        """Under the writers' lock, before the chunk after ``last`` is created: cut ``last`` back
        to its end, durably, so that pre-written zeros after a chunk's end say it has no successor
        (``catch_up``). If that fails, nothing of the append was written."""
        path = self.path(last.name)
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

    def settle_append(self, last: ChunkInfo, data: bytes, error: StorageError) -> None:
        """Under the writers' lock, after ``append`` to ``last`` raised: decide by reading whether it
        happened. Committed and identical: it did (return). The chunk's end unchanged: it did not
        (raise a definite error). Anything else, or a failed read: ``OutcomeUnknownError``."""
        path = self.path(last.name)
        position = last.length
        try:
            try:
                if self.storage.torn_appends:
                    self.tail = self.look(last, locked=True)
                    self.tail_name = last.name
                    end = self.tail.end - last.start
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

    def catch_up(self) -> None:
        """Under the writers' lock: bring the tail of the view up to date (one small read of
        the last chunk when nothing changed) and move on to chunks that other writers started."""
        chunks = self.view.chunks
        if not chunks:
            self.refresh()
            return
        last = chunks[-1]
        try:
            length, zeros_after = self.tail_length(last)
        except FileNotFoundError:  # deleted by a truncation elsewhere: no longer the last chunk
            self.refresh()
            return
        if length != last.length:
            last = ChunkInfo(last.start, length, last.name)
            self.view = self.view.with_last(last)
        if zeros_after:
            # Pre-written zeros follow it: never trimmed, so never rolled past (a chunk is trimmed
            # to its end before its successor is made): the segment's last chunk, which no
            # replacement takes and no truncation deletes: no switch check.
            return
        if not (last.length and self.storage.exists(self.path(chunk_name(last.end)))):
            self.check_not_rolled_past(last)
            return
        if self.next_switch_exists():
            # A replacement switched since this view (replacers hold this lock too and number their
            # switches one after another here): chunks after the view's last may have new names.
            self.refresh()
            return
        # Other writers rolled past it. A new chunk starts only where a non-empty one ends (an
        # empty one ends at its own name).
        zeros_after = False
        while last.length and self.storage.exists(self.path(chunk_name(last.end))):
            last = ChunkInfo(last.end, 0, chunk_name(last.end))
            try:
                length, zeros_after = self.tail_length(last)
            except FileNotFoundError:  # rolled past and truncated away meanwhile
                self.refresh()
                return
            last = ChunkInfo(last.start, length, last.name)
            self.view = self.view.appended(last)
        if not zeros_after:
            self.check_not_rolled_past(last)

    def check_not_rolled_past(self, last: ChunkInfo) -> None:
        """``last`` has no successor by its plain name and no zeros after it (a memory chunk, or a
        local one trimmed by a roll): it may have been rolled past, its successor since replaced
        (the plain name goes with the switch) or truncated away. Refresh if so."""
        if self.next_switch_exists():
            self.refresh()
        elif self.stored_start_offset() > last.end:
            self.refresh()

    def tail_length(self, chunk: ChunkInfo) -> tuple[int, bool]:
        """Under the writers' lock: ``(committed length of chunk, whether pre-written zeros follow
        it)``, kept as the view's last look (memory: its size). ``FileNotFoundError`` if gone."""
        if not self.storage.torn_appends:  # memory: a trim mark says what zeros say on local disk
            path = self.path(chunk.name)
            return self.storage.size(path), not self.storage.trimmed(path)
        look = self.look(chunk, locked=True)
        self.tail, self.tail_name = look, chunk.name
        return look.end - chunk.start, look.zeros_after

    # -- the tail of the last chunk ------------------------------------------------------------
    def look(self, chunk: ChunkInfo, *, locked: bool = False) -> TailLook:
        """Look at the end of ``chunk``, going on from the last look if it was at the same chunk
        (tail.py). ``FileNotFoundError`` if the chunk is gone."""
        if self.framing is None:
            raise InvalidInputError(
                f"segment {self.name!r}: a segment on {type(self.storage).__name__} needs the framing of what "
                f"is appended to it (RollingSegment(..., framing=...)): its chunks keep no commit record")
        path = f"{self.directory}/{chunk.name}"
        since = self.tail if self.tail_name == chunk.name else None
        return look_at_tail(lambda a, b: self.storage.read(path, a, b), chunk.start, self.framing,
                            since=since, locked=locked, zeros_kept=self.storage.zeros_kept_after)

    def measure_last(self, chunk: ChunkInfo) -> tuple[int | None, TailLook | None]:
        if not self.storage.torn_appends:
            return None, None  # memory: the listed size is the committed length
        look = self.look(chunk)
        return look.end - chunk.start, look

    def view_loaded(self, look: TailLook | None) -> None:
        known = (self.tail_name, self.tail.torn if self.tail is not None else None)
        self.tail, self.tail_name = look, (self.view.chunks[-1].name if look is not None else None)
        if look is not None and look.torn is not None and known != (self.tail_name, look.torn):
            self.say_torn_found(look.torn)

    def say_torn_found(self, torn: tuple[int, int]) -> None:
        """Log, once per handle and torn write, what a look found after the committed end: any
        handle says it (a read-only one too), and only the next append into the chunk cuts it.

        Bytes past the end are also what a writer's append in progress looks like from another
        handle. So while a writer holds the lock this says so at DEBUG only (that writer cuts a
        torn write itself, with a WARNING); with the lock free, a second look tells an append
        that finished meanwhile from a write torn by a crash."""
        if self.storage.lock_is_held(self.directory):
            _log.debug("segment %r: %d bytes past the committed end at position %d (chunk %s) while a writer "
                       "holds the lock: its append in progress, or a torn write it will cut; not read",
                       self.name, torn[1] - torn[0], torn[0], self.tail_name)
            return
        try:
            again = self.look(self.view.chunks[-1])
        except FileNotFoundError:
            return  # rolled past and deleted meanwhile: whatever it held is gone
        if again.torn != torn:
            return  # committed meanwhile (or cut by a writer)
        _log.warning("segment %r: found %d bytes of a torn write at position %d (chunk %s) after the "
                     "committed end: the newest write before a crash, never committed; not read, and cut by "
                     "the next append into the chunk (nothing is cut until then)", self.name, torn[1] - torn[0],
                     torn[0], self.tail_name)

    def cut_short(self) -> bool:
        last = self.view.chunks[-1] if self.view.chunks else None
        if last is None:
            return False
        kept = self.storage.zeros_kept_after(last.length)
        if not kept:
            return False
        try:
            size = self.storage.size(self.path(last.name))
        except FileNotFoundError:
            return True
        return size < last.length + kept

    def poll(self) -> bool:
        """Stat the last chunk (one small read past its end) and look for the next (writers with
        a smaller rolling size roll sooner)."""
        last = self.view.chunks[-1] if self.view.chunks else None
        if last is not None:
            try:
                after = self.storage.read(self.path(last.name), last.length, last.length + MARK_BYTES)
            except FileNotFoundError:
                return True  # truncated and rolled past meanwhile
            if after.strip(b"\0") if self.storage.torn_appends else after:
                return not self.is_known_torn(last, after)
            if after or not last.length:
                return False  # pre-written zeros, or an empty chunk: where the next append goes
        return self.poll_next_name()

    def is_known_torn(self, last: ChunkInfo, after: bytes) -> bool:
        """Whether ``after`` (read at the end of ``last``) is the torn write the last look found."""
        tail = self.tail
        if tail is None or tail.torn is None or self.tail_name != last.name or tail.torn[0] != last.end:
            return False
        known = tail.torn_bytes[:len(after)]
        return after[:len(known)] == known and not after[len(known):].strip(b"\0")

    # -- housekeeping --------------------------------------------------------------------------
    def writers_lock(self) -> contextlib.AbstractContextManager[None]:
        return self.storage.lock(self.directory)

    def clear_debris(self, names: tuple[str, ...]) -> None:
        self.delete_quietly(names)  # under the lock nobody else is replacing

    def dead_after_truncation(self) -> tuple[list[ChunkInfo], list[int]]:
        # Leftovers the listing showed below the view's first chunk (an earlier deletion failed,
        # or its process died before it) went before the marker (``obsolete_names``).
        return self.view.dead_chunks(), self.view.dead_markers()

    def forget(self) -> None:
        super().forget()
        self.tail = self.tail_name = None
