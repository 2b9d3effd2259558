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
    InvalidInputError,
    MissingDependencyError,
    OffsetOutOfRangeError,
    StorageError,
    TruncatedError,
    UnsupportedSchemeError,
)


class InvalidKeyError(InvalidInputError):
    """An attribute key is not 16 bytes, a ``uuid.UUID``, or an int in ``[0, 2**128)``."""


class InvalidValueError(InvalidInputError):
    """An attribute value is not an int in the signed 64-bit range."""


__all__ = [
    "AttrIndexError",
    "BadOffsetError",
    "ChunkExistsError",
    "CorruptDataError",
    "ExclusiveCreateUnsupportedError",
    "InvalidInputError",
    "InvalidKeyError",
    "InvalidValueError",
    "MissingDependencyError",
    "OffsetOutOfRangeError",
    "StorageError",
    "TruncatedError",
    "UnsupportedSchemeError",
]
