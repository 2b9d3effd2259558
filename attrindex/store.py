"""``SegmentStore``: the segments (and streams of segments) under one storage URL.

Layout under the store's root (docs/storage.md): segment ``NAME`` keeps everything under ``NAME/``
in names starting with ``_``, which segment names may not use, so no two segments can collide::

    _store                        marker: the store exists (written by SegmentStore.open(create=True))
    NAME/_segment                 marker: the segment exists
    NAME/_log.seg/, NAME/_index/, NAME/_gaps/   the record log (attrindex.log)
    NAME/_attributes.seg/         the attributes' B+tree
    _streams/STREAM/_count.N      marker: STREAM is a stream of N segments STREAM/0 ... STREAM/N-1

(Stream markers live apart from the segments so finding one lists a few names, not every chunk.)
"""

from __future__ import annotations

import re
import threading
from typing import Any, Mapping

from storage_adapters import ChunkStorage
from storage_adapters.rolling import validate_segment_name

from .errors import InvalidInputError, SegmentNotFoundError, StoreNotFoundError, StreamNotFoundError
from .locations import STORE_MARKER, mark_store_created, open_location, store_exists
from .segment import Segment, SegmentOptions

SEGMENT_MARKER = "_segment"
_STREAM_MARKER = re.compile(r"_count\.(\d+)")
STREAMS_DIR = "_streams"


def validate_name(name: str, what: str = "segment") -> str:
    """A segment or stream name: ``/``-separated parts of ``[A-Za-z0-9_.=+@$-]``; no part may
    start with ``_`` or ``.`` (reserved for the store's own files)."""
    validate_segment_name(name)
    for part in name.split("/"):
        if part.startswith("_"):
            raise InvalidInputError(f"invalid {what} name {name!r}: parts starting with '_' are reserved")
    return name


class SegmentStore:
    """Segments under one storage root. ``segment(name)`` returns one shared handle per name.

    ``options`` tune every segment opened through this store: ``log_rolling_size`` (16 MiB),
    ``index_interval_bytes`` (4096), ``codec`` ("none", "gzip", "zstd", "lz4"), ``flush_keys``
    (250,000), ``flush_bytes`` (64 MiB), ``flush_seconds`` (30), ``poll_interval`` (0.05 s), and
    ``attribute_options`` (passed to the attributes' ``AttributeIndex``: page_size, cache_bytes...).
    """

    def __init__(self, storage: ChunkStorage, **options: Any):
        try:
            self.options = SegmentOptions(**options)
        except TypeError as exc:
            raise InvalidInputError(f"unknown segment store option: {exc}") from None
        self.storage = storage
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, url: str, storage_options: Mapping[str, Any] | None = None, *, create: bool = True,
             **options: Any) -> "SegmentStore":
        """Open the store at ``url`` (``memory://``, ``file://`` or a path, ``s3://``).

        ``create=True`` (the default) creates the store if it is missing, by writing its ``_store``
        marker; ``create=False`` opens an existing store only, and a missing one (a mistyped path,
        an empty directory or bucket prefix) raises ``StoreNotFoundError``. A store is recognised by
        its marker, or, for stores written before the marker, by any segment or stream in it. A
        local path that is a regular file raises ``StoreNotFoundError`` either way.
        """
        if not isinstance(create, bool):
            raise InvalidInputError(f"create must be True or False, got {create!r}")
        storage = open_location(url, storage_options, what="store", not_found=StoreNotFoundError)
        try:
            if not create and not store_exists(storage):
                raise StoreNotFoundError(f"no store at URL {storage.url!r} (opened with create=False, so nothing was created)")
            store = cls(storage, **options)
            if create and not storage.exists(STORE_MARKER):
                mark_store_created(storage)
        except BaseException:
            storage.close()
            raise
        return store

    # -- segments ------------------------------------------------------------------------------
    def segment(self, name: str, create: bool = False) -> Segment:
        """The handle of segment ``name``; ``create=True`` creates it if missing.

        A missing segment without ``create`` raises ``SegmentNotFoundError``.
        """
        validate_name(name)
        with self._lock:
            segment = self._segments.get(name)
            if segment is not None and not segment.closed:
                return segment
            if not self.storage.exists(f"{name}/{SEGMENT_MARKER}"):
                if not create:
                    raise SegmentNotFoundError(f"segment {name!r} does not exist in {self.storage.url!r}")
                self.storage.put_marker(f"{name}/{SEGMENT_MARKER}")
            segment = self._segments[name] = Segment(self.storage, name, self.options)
            return segment

    def exists(self, name: str) -> bool:
        validate_name(name)
        return self.storage.exists(f"{name}/{SEGMENT_MARKER}")

    def segments(self, prefix: str = "") -> list[str]:
        """Names of the segments in the store (under ``prefix``), sorted."""
        root = prefix.rstrip("/")
        if root:
            validate_name(root, "prefix")
        found = self.storage.list_files(root) if root else self.storage.list_files("")
        names = []
        suffix = "/" + SEGMENT_MARKER
        for path in found:
            if path == SEGMENT_MARKER and root:
                names.append(root)
            elif path.endswith(suffix):
                name = path[: -len(suffix)]
                names.append(f"{root}/{name}" if root else name)
        return sorted(names)

    def delete_segment(self, name: str) -> None:
        """Delete a segment and everything it holds (its handle, if open, is closed first)."""
        validate_name(name)
        with self._lock:
            segment = self._segments.pop(name, None)
        if segment is not None and not segment.closed:
            segment._closed = True
        for part in ("_log.seg", "_index", "_gaps", "_attributes.seg"):
            self.storage.remove_directory(f"{name}/{part}")
        self.storage.delete([f"{name}/{SEGMENT_MARKER}"])

    # -- streams -------------------------------------------------------------------------------
    def create_stream(self, name: str, segments: int) -> list[str]:
        """Create stream ``name`` of ``segments`` segments (``name/0`` ...); an existing stream must
        have the same count. Returns the segment names."""
        validate_name(name, "stream")
        if type(segments) is not int or segments < 1:
            raise InvalidInputError(f"a stream needs an int >= 1 of segments, got {segments!r}")
        existing = self._stream_count(name)
        if existing is not None and existing != segments:
            raise InvalidInputError(f"stream {name!r} has {existing} segments, not {segments}")
        if existing is None:
            self.storage.put_marker(f"{STREAMS_DIR}/{name}/_count.{segments}")
            existing = self._stream_count(name)
            if existing != segments:  # another process created it with another count at the same time
                raise InvalidInputError(f"stream {name!r} has {existing} segments, not {segments}")
        names = stream_segment_names(name, segments)
        for segment in names:
            self.segment(segment, create=True)
        return names

    def stream_segments(self, name: str) -> list[str]:
        """The segment names of stream ``name`` (``StreamNotFoundError`` if there is no such stream)."""
        validate_name(name, "stream")
        count = self._stream_count(name)
        if count is None:
            raise StreamNotFoundError(f"stream {name!r} does not exist in {self.storage.url!r}")
        return stream_segment_names(name, count)

    def _stream_count(self, name: str) -> int | None:
        counts = sorted(int(m[1]) for m in map(_STREAM_MARKER.fullmatch, self.storage.list_files(f"{STREAMS_DIR}/{name}")) if m)
        return counts[0] if counts else None  # two racing creators: the smallest count wins everywhere

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Close every segment handle (merging pending attribute updates into their B+trees)."""
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()
        self.storage.close()

    def __enter__(self) -> "SegmentStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SegmentStore({self.storage.url!r})"


def stream_segment_names(stream: str, count: int) -> list[str]:
    return [f"{stream}/{i}" for i in range(count)]
