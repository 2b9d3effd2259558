"""Every error attrindex raises, in one module.

The storage errors are defined in ``storage_adapters.errors`` (the bottom layer never imports
``attrindex``) and re-exported here; the errors of the higher layers are defined here.
"""

from storage_adapters.errors import (
    AttrIndexError,
    BadOffsetError,
    ChunkExistsError,
    CorruptDataError,
    ExclusiveCreateUnsupportedError,
    HoleError,
    InvalidInputError,
    LayoutConflictError,
    MissingDependencyError,
    OffsetOutOfRangeError,
    OutcomeUnknownError,
    ReplaceRetriesExhaustedError,
    RetriesExhaustedError,
    StorageError,
    StorageFullError,
    TruncatedError,
    UnsupportedSchemeError,
)


class InvalidKeyError(InvalidInputError):
    """An attribute key is not 16 bytes, a ``uuid.UUID``, or an int in ``[0, 2**128)``."""


class InvalidValueError(InvalidInputError):
    """An attribute value is not an int in the signed 64-bit range."""


class ConditionalUpdateError(AttrIndexError):
    """An append's attribute conditions failed; nothing was appended and nothing changed.

    ``failures`` lists every failed update (an ``attrindex.conditional.UpdateFailure`` each: the
    update, the value it was checked against, and why it failed), not just the first.
    """

    def __init__(self, failures):
        # Stored as given: importing attrindex.conditional here would be an import cycle.
        self.failures = list(failures)
        details = "; ".join(map(self._describe, self.failures))
        super().__init__(f"{len(self.failures)} attribute update(s) failed: {details}")

    def __reduce__(self):
        # The default pickling would call __init__(message); rebuild from the failures instead
        # so the error survives crossing a process boundary.
        return (type(self), (self.failures,))

    @staticmethod
    def _describe(failure) -> str:
        try:
            update = failure.update
            return (
                f"key {update.key.hex()} {update.update_type.name} value={update.value}"
                f" compare={update.compare} current={failure.current}: {failure.reason}"
            )
        except AttributeError:  # not an UpdateFailure; still say something useful
            return repr(failure)


class SegmentNotFoundError(AttrIndexError, LookupError):
    """A segment that does not exist was opened without ``create=True``."""


class StreamNotFoundError(AttrIndexError, LookupError):
    """A stream that does not exist was named without a segment count to create it."""


class RecordTruncatedError(AttrIndexError, LookupError):
    """Records were read below a segment's start offset: retention removed them."""

    def __init__(self, segment: str, offset: int, start_offset: int):
        self.segment, self.offset, self.start_offset = segment, offset, start_offset
        super().__init__(f"segment {segment!r}: offset {offset} was removed by retention; records start at {start_offset}")

    def __reduce__(self):
        return (type(self), (self.segment, self.offset, self.start_offset))


class WriterConflictError(AttrIndexError):
    """A segment holds event numbers for a writer id that this writer never sent: two live
    writers share one id."""


class MergeBacklogError(StorageError):
    """An update or append was refused, before anything was written: the pending attribute
    updates (tier 1) exceed ``max_pending_bytes`` and the background merge that would make room
    keeps failing (its error is the ``__cause__`` and ``stats().merge_error``). Retry once the
    cause is fixed; every update acknowledged before is durable in the log."""


class LayoutChangedError(StorageError):
    """Chunks under a scan of a segment's log were replaced meanwhile (consolidation or compaction
    elsewhere): the bytes read may belong to the new layout. Scans resync and go on, so this is
    raised only where no resync is possible (a single read of planned chunks), for the caller that
    can plan again. A scan that resynced to its bound raises ``RetriesExhaustedError`` instead."""


class IndexNotFoundError(AttrIndexError, LookupError):
    """An index opened read-only (``AttributeIndex.open(url, mode="r")``) does not exist at its URL,
    or the URL cannot hold one (a regular file)."""


class StoreNotFoundError(AttrIndexError, LookupError):
    """A store opened with ``mode="r+"`` (``SegmentStore.open(url, mode="r+")``) does not exist
    at its URL, or the URL cannot hold one (a regular file)."""


__all__ = [
    "AttrIndexError",
    "BadOffsetError",
    "ChunkExistsError",
    "ConditionalUpdateError",
    "CorruptDataError",
    "ExclusiveCreateUnsupportedError",
    "HoleError",
    "InvalidInputError",
    "InvalidKeyError",
    "InvalidValueError",
    "LayoutChangedError",
    "LayoutConflictError",
    "MergeBacklogError",
    "MissingDependencyError",
    "OffsetOutOfRangeError",
    "OutcomeUnknownError",
    "RecordTruncatedError",
    "ReplaceRetriesExhaustedError",
    "RetriesExhaustedError",
    "SegmentNotFoundError",
    "StreamNotFoundError",
    "WriterConflictError",
    "StorageError",
    "StorageFullError",
    "TruncatedError",
    "UnsupportedSchemeError",
    "IndexNotFoundError",
    "StoreNotFoundError",
]
