"""``ObjectHandle``: the strategy of object stores (S3, any storage that is not appendable).

Each append is one new object, written whole by an exclusive create at the viewed length: 1 PUT
when the view is fresh (docs/storage.md, "Object stores: one PUT per append, and the deletion
grace"). A name below the truncation offset could be free again only after its chunk was deleted,
and dead chunks keep their names for ``storage.deletion_grace`` seconds; so a view younger than
half of that (the other half is margin for a slow request) cannot re-create one, and an older
view is refreshed first. With no grace (0), the truncation offset is listed after each create
instead, and a create that landed below it is undone.
"""

from __future__ import annotations

import logging
import time

from .errors import BadOffsetError, ChunkExistsError, OutcomeUnknownError, RetriesExhaustedError, StorageError
from .rolling_handle import SegmentHandle
from .rolling_view import CHUNK_NAME, ChunkInfo, chunk_name

_log = logging.getLogger("attrindex.storage")

#: Bound on the create attempts of one object append (each lost race or unsettled write is one).
MAX_APPEND_ATTEMPTS = 100


class ObjectHandle(SegmentHandle):
    """A segment handle on an object store: each append creates one new chunk object."""

    whole_objects = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.doomed: dict[str, float] = {}  #: dead chunk -> monotonic time it was known dead

    # -- appending -----------------------------------------------------------------------------
    def append(self, data: bytes, expected_offset: int | None) -> int:
        """One exclusive create at the viewed length (see the module's docstring)."""
        grace = self.storage.deletion_grace
        retried_unknown = False
        for _attempt in range(MAX_APPEND_ATTEMPTS):
            if grace > 0 and time.monotonic() - self.view_time >= grace / 2:
                self.refresh()  # too old to rule out a name freed by a deletion
            if expected_offset is not None and expected_offset != self.view.length:
                self.refresh()
                if expected_offset != self.view.length:
                    raise BadOffsetError(self.name, expected_offset, self.view.length)
            offset = self.view.length
            path = self.path(chunk_name(offset))
            placed = data if self.framing is None else self.framing.place(data, offset)
            sent = time.monotonic()
            try:
                self.storage.create(path, placed)
            except StorageError as exc:
                found = self.settle_create(path, placed, exc)
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
                        raise BadOffsetError(self.name, expected_offset, self.view.length) from None
                    continue
            if grace > 0 and time.monotonic() - self.view_time >= grace / 2:
                # The create was slow (a paused process, a slow network): the grace may have passed
                # before it landed, on a name a truncation or a switch had freed meanwhile.
                if not self.created_live(path, offset):
                    self.delete_stray(path)
                    if expected_offset is not None:
                        raise BadOffsetError(self.name, expected_offset, self.view.length,
                                             "offset was truncated or replaced")
                    continue
                self.delete_dead()
                return offset
            start_offset = self.view.start_offset
            if grace <= 0:
                start_offset = self.stored_start_offset_after_write(path)
                if start_offset > offset:
                    # A name below the truncation offset may have been freed and re-created by this
                    # (stale) handle: its offset was taken and truncated away meanwhile. Undo, report.
                    self.delete_stray(path)
                    self.refresh()
                    if expected_offset is not None:
                        raise BadOffsetError(self.name, expected_offset, self.view.length, "offset was truncated")
                    continue
                if self.offset_replaced(offset):  # likewise a name freed by a chunk switch (layout)
                    self.delete_stray(path)
                    self.refresh()
                    if expected_offset is not None:
                        raise BadOffsetError(self.name, expected_offset, self.view.length, "offset was replaced")
                    continue
            self.view = self.view.appended(ChunkInfo(offset, len(data), chunk_name(offset)), start_offset)
            # The next name (offset + len) can only be taken by a writer that saw this chunk, which
            # did not exist before ``sent``: the view is as young as this create.
            self.view_time = max(self.view_time, sent)
            self.delete_dead()
            return offset
        raise RetriesExhaustedError(
            f"segment {self.name!r}: gave up appending after {MAX_APPEND_ATTEMPTS} attempts; other writers "
            "kept taking the offset (nothing of this append was written)"
        )

    def created_live(self, path: str, offset: int) -> bool:
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
        return any(c.start == offset and c.name == chunk_name(offset) for c in self.view.chunks)

    def stored_start_offset_after_write(self, path: str) -> int:
        """The stored truncation offset, read after a durable create (so a failure is an unknown outcome)."""
        try:
            return self.stored_start_offset()
        except StorageError as exc:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: {path!r} was written but the truncation offset could not be "
                f"checked ({exc}); read the segment before appending again"
            ) from exc

    def offset_replaced(self, offset: int) -> bool:
        """After creating the chunk at ``offset``: whether a replacement in force covers ``offset``
        (the name was free because a switch deleted it: this view was stale).

        One existence check when no switch happened since this view; switches are numbered one
        after another, so a newer one exists iff the next generation's marker does.
        """
        try:
            if not self.next_switch_exists():
                return False
            self.refresh()
        except StorageError as exc:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: the chunk at {offset} was written but whether a replacement covers it "
                f"could not be checked ({exc}); read the segment before appending again") from exc
        if any(c.start == offset and c.name == chunk_name(offset) for c in self.view.chunks):
            # Not replaced: keep the view up to our chunk, which the caller adds back.
            self.view = self.view.up_to(offset)
            self.view_changes += 1
            return False
        return True

    def delete_stray(self, path: str) -> None:
        """Delete a chunk this handle created where nobody would read it, best effort."""
        try:
            self.storage.delete([path])
        except StorageError as exc:
            _log.warning("segment %r: could not delete %r written below the truncation offset: %s", self.name, path, exc)

    def poll(self) -> bool:
        """One small request (a 1-byte ranged read of the chunk the next append creates: absent
        means nothing was appended), never a listing."""
        return self.poll_next_name()

    def switched_since_view(self) -> bool:
        """Object stores with a deletion grace keep replaced chunk names for the grace, so the
        next chunk's name is found anyway while the view is younger than half of it; an older view
        just says yes (a listing every grace/2 at most)."""
        if self.storage.deletion_grace > 0:
            return time.monotonic() - self.view_time >= self.storage.deletion_grace / 2
        return super().switched_since_view()

    # -- dead chunks and the deletion grace ----------------------------------------------------
    def keeps_dead_names(self) -> bool:
        return self.storage.deletion_grace > 0

    def checks_after_create(self) -> bool:
        return self.storage.deletion_grace <= 0

    def discard_chunks(self, dead: list[ChunkInfo]) -> None:
        """Delete ``dead`` now, or with a deletion grace, mark them dead (deleted once it passed:
        ``delete_doomed``)."""
        if not self.keeps_dead_names():
            super().discard_chunks(dead)
            return
        now = time.monotonic()  # the truncation is durable by now: dead since at most now
        for chunk in dead:
            self.doomed.setdefault(chunk.name, now)

    def drop_dead_chunks(self) -> None:
        super().drop_dead_chunks()
        self.delete_doomed()

    def delete_dead(self) -> None:
        if self.doomed and not self.view.has_dead():
            try:
                self.delete_doomed()
            except StorageError as exc:
                _log.warning("segment %r: could not delete truncated chunks or markers (retried later): %s",
                             self.name, exc)
            return
        super().delete_dead()

    def view_loaded(self, look: None) -> None:
        """Remember the dead chunks the listing showed (left by other handles or processes, or by
        an interrupted deletion), so that this handle deletes them after the grace."""
        if not self.keeps_dead_names():
            return
        now = time.monotonic()  # the listing showed them dead: dead since before now
        for name in self.listing.dead_plain(self.view.first_start):
            self.doomed.setdefault(name, now)

    def retire_now(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """A plain chunk name freed now could be re-created by a stale appender (1 PUT, no LIST):
        with a grace, it keeps its name for it, like a truncated chunk."""
        if not self.keeps_dead_names():
            return names
        now = time.monotonic()
        for name in names:
            if CHUNK_NAME.fullmatch(name):
                self.doomed.setdefault(name, now)
        try:
            self.delete_doomed()
        except StorageError as exc:
            _log.warning("segment %r: could not delete dead chunks (retried later): %s", self.name, exc)
        return tuple(n for n in names if not CHUNK_NAME.fullmatch(n))

    def delete_doomed(self) -> None:
        """Delete the dead chunks whose grace has passed (one DeleteObjects request)."""
        if not self.doomed:
            return
        expired = time.monotonic() - self.storage.deletion_grace
        ripe = sorted(name for name, since in self.doomed.items() if since <= expired)
        if ripe:
            self.storage.delete([self.path(name) for name in ripe])
            for name in ripe:
                del self.doomed[name]

    def forget(self) -> None:
        super().forget()
        self.doomed.clear()
