"""``SegmentOptions``: the tuning of a segment handle and of the attribute state it owns.

One frozen value shared by ``Segment``, ``AttributeIndex`` (which builds one from its own keyword
options), the attribute state and the merge worker. No I/O.
"""

from __future__ import annotations

import attrs

from .log.batch.compression import Codec, codec_for
from .log.segment_log import DEFAULT_INDEX_INTERVAL_BYTES, DEFAULT_LOG_ROLLING_SIZE
from .merge_worker import DEFAULT_HANG_SECONDS

DEFAULT_FLUSH_KEYS = 250_000
DEFAULT_FLUSH_BYTES = 64 << 20
DEFAULT_FLUSH_SECONDS = 30.0
DEFAULT_MAX_PENDING_BYTES = 128 << 20
DEFAULT_MIN_POLL_INTERVAL = 0.05  #: a tail reader's first poll after records came
DEFAULT_MAX_POLL_INTERVAL = 1.0  #: ... backing off to this: an idle reader costs 1 request/s


@attrs.frozen
class SegmentOptions:
    """Tuning of a segment handle (all have defaults; see ``SegmentStore.open``)."""

    log_rolling_size: int = DEFAULT_LOG_ROLLING_SIZE
    index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES
    codec: Codec = attrs.field(default=Codec.NONE, converter=codec_for)
    flush_keys: int = DEFAULT_FLUSH_KEYS
    flush_bytes: int = DEFAULT_FLUSH_BYTES
    flush_seconds: float = DEFAULT_FLUSH_SECONDS
    poll_interval: float | None = None  #: if set: a fixed interval between polls (min = max = it)
    attribute_options: dict = attrs.field(factory=dict)
    #: Appends wait (back-pressure) while tier 1 (the overlay being filled plus the one being
    #: merged) holds more than this many bytes, until the background merge makes room.
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    #: After each merge, delete the log below the chunk holding the B+tree's checkpoint (records
    #: there are lost: for logs kept only as a write-ahead log of the attributes).
    truncate_merged_log: bool = False
    min_poll_interval: float = DEFAULT_MIN_POLL_INTERVAL
    max_poll_interval: float = DEFAULT_MAX_POLL_INTERVAL
    #: Merge tier 1 into the B+tree in a worker process (local disk only; elsewhere in a thread):
    #: the merge's CPU then never holds this process's GIL, so appends keep their latency. The
    #: worker replays the log itself, which assumes no log compaction rewrites batches meanwhile
    #: (so segments default to the thread; ``AttributeIndex`` turns it on).
    merge_process: bool = False
    #: With ``merge_process``: a worker that makes no progress (no CPU time, no read or write of its
    #: merging thread) this many seconds is hung: it is killed and the merge retried, so appends
    #: waiting for room in tier 1 wait about this long at most behind it (``attrindex.merge_worker``).
    merge_hang_seconds: float = DEFAULT_HANG_SECONDS

    def poll_intervals(self) -> tuple[float, float]:
        """``(min, max)`` seconds between a waiting reader's polls for other handles' appends."""
        if self.poll_interval is not None:
            return self.poll_interval, self.poll_interval
        return self.min_poll_interval, self.max_poll_interval


__all__ = ["DEFAULT_FLUSH_BYTES", "DEFAULT_FLUSH_KEYS", "DEFAULT_FLUSH_SECONDS", "DEFAULT_MAX_PENDING_BYTES",
           "SegmentOptions"]
