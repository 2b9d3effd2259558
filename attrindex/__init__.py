"""attrindex: append-only segments with an attribute index, on any fsspec filesystem.

``AttributeIndex`` is a durable map of 16-byte keys to int64 values stored as an append-only B+tree
with progressive compaction; ``storage_adapters`` (``open_storage``, ``RollingSegment``) is the
storage layer beneath it. Every error raised on purpose is in ``attrindex.errors``.
"""

from . import errors
from ._version import __version__
from .attribute_index import AttributeIndex, IndexStats, VerifyReport

__all__ = ["AttributeIndex", "IndexStats", "VerifyReport", "__version__", "errors"]
