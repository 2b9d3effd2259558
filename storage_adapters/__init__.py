"""Chunk storage over fsspec and the rolling segment: attrindex's bottom layer.

``open_storage(url)`` gives a ``ChunkStorage`` for ``memory://``, ``file://`` (or a plain path) and
``s3://``; ``RollingSegment(storage, name)`` is one append-only byte stream with a compare-and-append
that holds across processes. This package never imports ``attrindex``.
"""

from .base import ChunkStorage
from .errors import (
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
from .open import SUPPORTED_SCHEMES, open_storage
from .requests import RequestCounters
from .rolling import DEFAULT_ROLLING_SIZE, ChunkInfo, RollingSegment, chunk_name, validate_segment_name

__all__ = [
    "AttrIndexError",
    "BadOffsetError",
    "ChunkExistsError",
    "ChunkInfo",
    "ChunkStorage",
    "CorruptDataError",
    "DEFAULT_ROLLING_SIZE",
    "ExclusiveCreateUnsupportedError",
    "HoleError",
    "InvalidInputError",
    "LayoutConflictError",
    "MissingDependencyError",
    "OffsetOutOfRangeError",
    "OutcomeUnknownError",
    "RequestCounters",
    "ReplaceRetriesExhaustedError",
    "RetriesExhaustedError",
    "RollingSegment",
    "SUPPORTED_SCHEMES",
    "StorageError",
    "StorageFullError",
    "TruncatedError",
    "UnsupportedSchemeError",
    "chunk_name",
    "open_storage",
    "validate_segment_name",
]
