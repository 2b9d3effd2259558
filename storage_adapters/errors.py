"""The exception hierarchy of attrindex.

It is defined here, in the bottom layer, because ``storage_adapters`` must not import ``attrindex``;
``attrindex.errors`` re-exports every name so users catch everything from one module.
"""

from __future__ import annotations


class AttrIndexError(Exception):
    """Base class of every error attrindex raises on purpose."""


class InvalidInputError(AttrIndexError, ValueError):
    """An argument is malformed: a bad URL, segment name, offset, length, key or value."""


class UnsupportedSchemeError(InvalidInputError):
    """A storage URL names a scheme attrindex has no backend for."""


class MissingDependencyError(AttrIndexError, ImportError):
    """An optional package is needed for what was asked; the message names the extra to install."""


class StorageError(AttrIndexError):
    """The storage backend failed or refused an operation."""


class RetriesExhaustedError(StorageError):
    """A bounded retry loop reached its bound: another handle kept winning the race it retried, or
    storage kept failing the request it repeated. The message names the loop and its bound.

    What was written is what the raising loop's documentation says (usually nothing: see
    docs/retries.md, which lists every loop and what it leaves at its bound). The loops above the
    one that raised pass it up without trying again: the failure was retried to its bound by the
    one layer that could settle it. Try again later.
    """


class BadOffsetError(StorageError):
    """A compare-and-append found the segment's length different from the expected offset.

    Nothing was written. ``expected_offset`` is what the caller asked for, ``actual_offset`` the
    segment's length as stored when the append was refused (``None`` if it could not be read).
    """

    def __init__(self, segment: str, expected_offset: int, actual_offset: int | None, detail: str = ""):
        self.segment = segment
        self.expected_offset = expected_offset
        self.actual_offset = actual_offset
        actual = "unknown" if actual_offset is None else str(actual_offset)
        message = (
            f"segment {segment!r}: append expected offset {expected_offset} but the segment's length "
            f"is {actual}; nothing was written"
        )
        super().__init__(f"{message} ({detail})" if detail else message)


class OffsetOutOfRangeError(StorageError):
    """A read asked for bytes outside ``[start_offset, length)`` of a segment."""

    def __init__(self, segment: str, offset: int, length: int, start_offset: int, end_offset: int):
        self.segment = segment
        self.offset = offset
        self.length = length
        self.start_offset = start_offset
        self.end_offset = end_offset
        super().__init__(self._describe())

    def _describe(self) -> str:
        return (
            f"segment {self.segment!r}: cannot read {self.length} bytes at offset {self.offset}; "
            f"readable range is [{self.start_offset}, {self.end_offset})"
        )


class TruncatedError(OffsetOutOfRangeError):
    """A read asked for bytes below the segment's truncation offset (``start_offset``)."""

    def _describe(self) -> str:
        return (
            f"segment {self.segment!r}: offset {self.offset} was truncated; the segment now starts at "
            f"{self.start_offset}"
        )


class ChunkExistsError(StorageError):
    """An exclusive create found the chunk already there (another writer created it first)."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(f"chunk {path!r} already exists")


class ExclusiveCreateUnsupportedError(StorageError):
    """The object store accepted a conditional create of an existing object instead of refusing it."""


class StorageFullError(StorageError):
    """The backend has no space left (ENOSPC, a quota); the write that raised it did not happen."""


class OutcomeUnknownError(StorageError):
    """A write may or may not have reached storage (a lost response, a timeout, a crash mid-call).

    Raised only when reading back what is stored could not settle it; the caller must read before
    writing again, never simply re-apply the write.
    """


class CorruptDataError(StorageError):
    """Bytes read back failed verification; the message names where."""

    def __init__(self, message: str, *, segment: str | None = None, offset: int | None = None):
        self.segment = segment
        self.offset = offset
        super().__init__(message)


class HoleError(StorageError):
    """A read touched a hole: bytes ``[hole_start, hole_end)`` of the segment were replaced by a
    shorter chunk (``RollingSegment.replace_range``) and hold nothing. Offsets around a hole stay
    valid; ``RollingSegment.holes()`` lists the holes so readers can step over them."""

    def __init__(self, segment: str, hole_start: int, hole_end: int):
        self.segment = segment
        self.hole_start = hole_start
        self.hole_end = hole_end
        super().__init__(f"segment {segment!r}: bytes [{hole_start}, {hole_end}) are a hole left by a chunk "
                         "replacement (compaction); nothing is stored there")

    def __reduce__(self):
        return (type(self), (self.segment, self.hole_start, self.hole_end))


class LayoutConflictError(StorageError):
    """A chunk replacement lost to another one: the chunks it was to replace were replaced (or
    truncated) by another handle or process first. Nothing of the losing replacement is visible."""


class ReplaceRetriesExhaustedError(RetriesExhaustedError, LayoutConflictError):
    """A chunk replacement lost the race for a generation to other replacers at every one of its
    bounded attempts; nothing of it is visible. A ``LayoutConflictError`` too, so code that skips a
    replacement it lost (consolidation) skips this one; retry loops pass it up as a
    ``RetriesExhaustedError``."""
