"""attrindex: append-only segments with an attribute index, on any fsspec filesystem.

``SegmentStore`` opens segments: record logs whose appends carry conditional attribute updates
(``AttributeUpdate``, ``UpdateType``), the basis of exactly-once writers (``EventWriter``).
``AttributeIndex`` is the durable map of 16-byte keys to int64 values beneath them, an append-only
B+tree with progressive compaction; ``storage_adapters`` (``open_storage``, ``RollingSegment``) is
the storage layer. Every error raised on purpose is in ``attrindex.errors``.
"""

from . import errors
from ._version import __version__
from .attribute_index import AttributeIndex, IndexVerifyReport, WalIndexRepairReport
from .btree.verify import VerifyReport
from .btree.repair import IndexRepairReport
from .damage import Damage
from .conditional import AttributeUpdate, UpdateFailure, UpdateType
from .log.batch.compression import Codec
from .log.batch.records import Record
from .log.cleaner import CompactionStats
from .log.cleanup_policy import CleanupPolicy
from .reader import SegmentReader
from .appender import AppendResult
from .segment import Segment, SegmentStats
from .segment_repair import SegmentRepairReport, SegmentVerifyReport
from .tree_index import IndexStats
from .store import SegmentStore
from .writer import Acknowledgement, EventWriter

__all__ = [
    "Acknowledgement",
    "AppendResult",
    "AttributeIndex",
    "AttributeUpdate",
    "CleanupPolicy",
    "Codec",
    "CompactionStats",
    "Damage",
    "EventWriter",
    "IndexRepairReport",
    "IndexStats",
    "IndexVerifyReport",
    "Record",
    "Segment",
    "SegmentReader",
    "SegmentRepairReport",
    "SegmentStats",
    "SegmentVerifyReport",
    "SegmentStore",
    "UpdateFailure",
    "UpdateType",
    "VerifyReport",
    "WalIndexRepairReport",
    "__version__",
    "errors",
]
