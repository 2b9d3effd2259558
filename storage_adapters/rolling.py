"""``RollingSegment``: one logical append-only byte stream over numbered chunks, with compare-and-append.

Layout of segment ``NAME`` (see docs/storage.md)::

    NAME.seg/00000000000000000000          chunk holding offsets [0, next chunk's start)
    NAME.seg/00000000000033554432          ... named by its 20-digit zero-padded start offset
    NAME.seg/truncation/00000000000000001234   empty marker; the largest is the start offset

Appendable backends (local disk, memory) grow the last chunk in place until it reaches
``rolling_size``; object backends (S3) write one new object per append. Truncation never deletes
the last chunk, so the segment's length can always be recovered from its chunks alone.
"""

from __future__ import annotations

import bisect
import logging
import re
import threading
import time

import attrs

from .base import ChunkStorage
from .errors import (
    BadOffsetError,
    ChunkExistsError,
    CorruptDataError,
    InvalidInputError,
    OffsetOutOfRangeError,
    OutcomeUnknownError,
    StorageError,
    TruncatedError,
)

_log = logging.getLogger("attrindex.storage")

DEFAULT_ROLLING_SIZE = 32 << 20
SEGMENT_SUFFIX = ".seg"
TRUNCATION_DIR = "truncation"
_CHUNK_NAME = re.compile(r"\d{20}")
_NAME_COMPONENT = re.compile(r"[A-Za-z0-9_=+@$-][A-Za-z0-9_.=+@$-]*")
#: Bound on the create attempts of one object append (each lost race or unsettled write is one).
MAX_APPEND_ATTEMPTS = 100
#: Bound on the listings one ``refresh`` takes while other processes keep changing the segment.
MAX_UNCOMMITTED_TAIL = 64 << 20  #: bytes read after the committed end by ``uncommitted_tail``
MAX_REFRESH_ATTEMPTS = 20


def chunk_name(offset: int) -> str:
    """The 20-digit zero-padded name of the chunk starting at ``offset``."""
    return f"{offset:020d}"


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
    """One chunk of a segment: it holds the segment's bytes ``[start, start + length)``."""

    start: int
    length: int
    name: str

    @property
    def end(self) -> int:
        return self.start + self.length


class RollingSegment:
    """An append-only byte stream stored as chunks in ``storage`` under the segment ``name``.

    ``length`` and ``start_offset`` are this handle's view as of its last ``refresh``/``append``/
    ``truncate``; ``append(..., expected_offset=...)`` always checks against the length as stored,
    so a handle that is behind gets ``BadOffsetError`` (and is refreshed), never a bad write.
    """

    def __init__(self, storage: ChunkStorage, name: str, rolling_size: int = DEFAULT_ROLLING_SIZE):
        if not isinstance(rolling_size, int) or rolling_size <= 0:
            raise InvalidInputError(f"rolling_size must be a positive int, got {rolling_size!r}")
        self.storage = storage
        self.name = validate_segment_name(name)
        self.rolling_size = rolling_size
        self._dir = name + SEGMENT_SUFFIX
        self._mutex = threading.RLock()
        self._chunks: list[ChunkInfo] = []
        self._start_offset = 0
        self._markers: list[int] = []
        self._closed = False
        self._view_time = float("-inf")  #: monotonic time before the listing (or own create) behind the view
        self._doomed: dict[str, float] = {}  #: dead object chunk -> monotonic time it was known dead
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

    def refresh(self) -> None:
        """Reload this handle's view from storage (appends and truncations by other handles).

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
                    self._chunks, self._start_offset, self._markers = view
                    self._view_time = started
                    self._note_dead_objects()
                    return
                _log.info("segment %r: the listing raced an append or truncation; listing again", self.name)
        raise StorageError(
            f"segment {self.name!r}: {MAX_REFRESH_ATTEMPTS} listings in a row saw the segment change under "
            "them; no consistent view could be read"
        )

    def _load_view(self) -> tuple[list[ChunkInfo], int, list[int]] | None:
        """``(chunks, start offset, markers)`` from one listing, or ``None`` if it is inconsistent."""
        files = self._listed = self.storage.list_files(self._dir)
        starts = sorted(int(n) for n in files if _CHUNK_NAME.fullmatch(n))
        markers = sorted(
            int(n[len(TRUNCATION_DIR) + 1:])
            for n in files
            if n.startswith(TRUNCATION_DIR + "/") and _CHUNK_NAME.fullmatch(n[len(TRUNCATION_DIR) + 1:])
        )
        start_offset = markers[-1] if markers else 0
        chunks = []
        for i, start in enumerate(starts):
            if i + 1 < len(starts):
                if starts[i + 1] <= start_offset:
                    continue  # wholly truncated; its deletion was interrupted
                length = starts[i + 1] - start
                self._check_object_size(start, files[chunk_name(start)], length)
            elif self.storage.appendable:
                try:
                    length = self.storage.committed_size(f"{self._dir}/{chunk_name(start)}")
                except FileNotFoundError:
                    return None  # deleted after the listing: a truncation moved on
            else:
                length = files[chunk_name(start)]
            chunks.append(ChunkInfo(start, length, chunk_name(start)))
        length = chunks[-1].end if chunks else start_offset
        if start_offset > length or (chunks and chunks[0].start > start_offset):
            return None  # a new marker with old chunks, or old markers with the new chunks only
        return chunks, start_offset, markers

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
                    if self.storage.committed_size(f"{self._dir}/{last.name}") != last.length:
                        return True
                except FileNotFoundError:
                    return True  # truncated and rolled past meanwhile
                if not last.length:
                    return False  # an empty chunk is where the next append goes
            try:
                self.storage.read(f"{self._dir}/{chunk_name(self.length)}", 0, 1)
            except FileNotFoundError:
                return False
            return True

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
        with self.storage.lock(self._dir):
            self._catch_up()
            offset = self.length
            if expected_offset is not None and expected_offset != offset:
                raise BadOffsetError(self.name, expected_offset, offset)
            last = self._chunks[-1] if self._chunks else None
            if last is None or last.length >= self.rolling_size:
                last = ChunkInfo(offset, 0, chunk_name(offset))
                self._chunks.append(last)
                # Rolling is rare: learn of truncations elsewhere so the old chunk can go if dead.
                self._start_offset = max(self._start_offset, self._stored_start_offset())
            path = f"{self._dir}/{last.name}"
            try:
                self.storage.append(path, last.length, data)
            except StorageError as exc:
                self._settle_in_place(path, last.length, data, exc)  # returns only if the append is there
            self._chunks[-1] = ChunkInfo(last.start, last.length + len(data), last.name)
        self._after_durable_append()
        return offset

    def _settle_in_place(self, path: str, position: int, data: bytes, error: StorageError) -> None:
        """Under the writers' lock, after ``append`` raised: decide by reading whether it happened.

        Committed and identical: it did (return). Committed size unchanged: it did not (raise a
        definite error). Anything else, or a failed read: ``OutcomeUnknownError``.
        """
        try:
            try:
                committed = self.storage.committed_size(path)
            except FileNotFoundError:
                committed = 0
            ours = committed == position + len(data) and self.storage.read(path, position, committed) == data
        except (StorageError, FileNotFoundError) as exc:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: append to {path!r} failed ({error}) and reading back failed too ({exc})"
            ) from error
        if ours:
            _log.info("segment %r: append to %r raised %s but its bytes are committed; accepted",
                         self.name, path, type(error).__name__)
            return
        if committed != position:
            raise OutcomeUnknownError(
                f"segment {self.name!r}: append to {path!r} at {position} failed ({error}) and the chunk's "
                f"committed size is now {committed}"
            ) from error
        if isinstance(error, OutcomeUnknownError):
            raise StorageError(f"segment {self.name!r}: the append did not happen ({error})") from error
        raise error

    def _catch_up(self) -> None:
        """Under the writers' lock: bring the tail of the view up to date with a few stats."""
        if not self._chunks:
            self.refresh()
            return
        last = self._chunks[-1]
        try:
            length = self.storage.committed_size(f"{self._dir}/{last.name}")
        except FileNotFoundError:  # deleted by a truncation elsewhere: no longer the last chunk
            self.refresh()
            return
        self._chunks[-1] = last = ChunkInfo(last.start, length, last.name)
        # A new chunk starts only where a non-empty one ends (an empty one ends at its own name).
        while last.length and self.storage.exists(f"{self._dir}/{chunk_name(last.end)}"):
            start = last.end
            try:
                length = self.storage.committed_size(f"{self._dir}/{chunk_name(start)}")
            except FileNotFoundError:  # rolled past and truncated away meanwhile
                self.refresh()
                return
            last = ChunkInfo(start, length, chunk_name(start))
            self._chunks.append(last)

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
            sent = time.monotonic()
            try:
                self.storage.create(path, data)
            except StorageError as exc:
                found = self._settle_object(path, data, exc)
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
        except FileNotFoundError:
            pass
        self.refresh()  # a chunk vanished under a stale view: truncated by another handle
        self._check_range(offset, length, self._chunks, self._start_offset)
        try:
            return self._read_chunks(self._chunks, offset, end)
        except FileNotFoundError:
            self.refresh()
            self._check_range(offset, length, self._chunks, self._start_offset)
            raise StorageError(f"segment {self.name!r}: a chunk holding offset {offset} is missing") from None

    def uncommitted_tail(self, limit: int = MAX_UNCOMMITTED_TAIL) -> tuple[int, bytes]:
        """``(length, bytes)``: the committed length and up to ``limit`` bytes stored after it.

        On appendable backends this is what a writer left that died between writing an append's
        data and its commit record: at most one append's bytes. More than one whole append there
        means commit records were lost (damage, not a crash), which only the layer above can tell
        by parsing; ``append`` of exactly those bytes at that length commits them again (the write
        is identical, so nothing changes but the commit record). Object backends have no such bytes.
        """
        self._check_open()
        if not self.storage.appendable:
            return self.length, b""  # objects are whole: nothing is ever stored past an end
        with self._mutex:
            for _attempt in range(MAX_REFRESH_ATTEMPTS):
                self.refresh()
                if not self._chunks:
                    return self.length, b""
                last = self._chunks[-1]
                path = f"{self._dir}/{last.name}"
                try:
                    tail = self.storage.read(path, last.length, last.length + limit)
                    settled = self.storage.committed_size(path) == last.length
                except FileNotFoundError:
                    continue  # truncated or rolled meanwhile: look again
                if settled:  # no commit landed while the tail was read: it really is uncommitted
                    return last.end, tail
        raise StorageError(f"segment {self.name!r}: the last chunk kept changing; its uncommitted tail could "
                           "not be read")

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
        with self._mutex:
            self.refresh()  # rare, and only the true chunk list tells which chunk is the last
            if offset > self.length:
                raise OffsetOutOfRangeError(self.name, offset, 0, self._start_offset, self.length)
            if offset <= self._start_offset:
                return
            # The marker goes first: a crash before the deletions leaves only unreachable chunks.
            self._put_marker(f"{self._dir}/{TRUNCATION_DIR}/{chunk_name(offset)}")
            self._start_offset, self._markers = offset, [*self._markers, offset]
            self._delete_dead()

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
        try:
            self._drop_truncated_predecessor()
            old = [m for m in self._markers if m < self._start_offset]
            if old:
                self.storage.delete([f"{self._dir}/{TRUNCATION_DIR}/{chunk_name(m)}" for m in old])
            self._markers = [m for m in self._markers if m >= self._start_offset]
        except StorageError as exc:
            _log.warning("segment %r: could not delete truncated chunks or markers (retried later): %s", self.name, exc)

    def delete(self) -> None:
        """Delete the segment and all its chunks; the handle then sees an empty segment."""
        self._check_open()
        with self._mutex:
            self.storage.remove_directory(self._dir)
            self._chunks, self._start_offset, self._markers = [], 0, []
            self._doomed.clear()

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
