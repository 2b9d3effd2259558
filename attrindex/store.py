"""``SegmentStore``: the segments (and streams of segments) under one storage URL.

The paths under the store's root are named by ``attrindex.layout``: segment ``NAME`` keeps
everything under ``NAME/`` in names starting with ``_``, which segment names may not use, so no
two segments can collide. Stream markers live apart from the segments (``_streams/``), so finding
one lists a few names, not every chunk.
"""

from __future__ import annotations

import os
import inspect
import logging
import re
import threading
from typing import Any, Mapping

import attrs

from storage_adapters import ChunkStorage
from storage_adapters.requests import RequestCounters
from storage_adapters.rolling import RollingSegment, validate_segment_name

from .tree_index import TreeIndex
from .listing import ListedStorage
from .errors import (AttrIndexError, ChunkExistsError, InvalidInputError, SegmentNotFoundError, StoreNotFoundError,
                     StorageError, StreamNotFoundError)
from .layout import CONFIG_DIR, SEGMENT_MARKER, STORE_MARKER, segment_marker, segment_parts, stream_dir
from .log.cleanup_policy import load_policy, policy_from_options, store_policy
from .locations import open_location
from .options import SegmentOptions
from .segment import Segment
from .segment_repair import SegmentRepairReport, SegmentVerifyReport, repair_segment, verify_segment

_STREAM_MARKER = re.compile(r"_count\.(\d+)")
MAX_STREAM_SEGMENTS = 1 << 16
_SIZE_OPTIONS = ("log_rolling_size", "index_interval_bytes", "flush_keys", "flush_bytes", "max_pending_bytes")

log = logging.getLogger(__name__)


@attrs.frozen
class StoreStats:
    """A snapshot of a store: its URL, open segment handles, and the requests its storage made."""

    url: str
    open_segments: int
    requests: RequestCounters  #: by kind (PUT, GET, LIST, HEAD, DELETE) and bytes moved; see docs/cost.md


def validate_name(name: str, what: str = "segment") -> str:
    """A segment or stream name: ``/``-separated parts of ``[A-Za-z0-9_.=+@$-]``; no part may
    start with ``_`` or ``.`` (reserved for the store's own files)."""
    try:
        validate_segment_name(name)
    except InvalidInputError as exc:
        if what != "stream":  # a prefix is (the start of) a segment name, and says so
            raise
        raise InvalidInputError(str(exc).replace("segment name", "stream name", 1)) from None
    for part in name.split("/"):
        if part.startswith("_"):
            raise InvalidInputError(f"invalid {what} name {name!r}: parts starting with '_' are reserved")
    return name


class SegmentStore:
    """Segments under one storage root. ``segment(name)`` returns one shared handle per name.

    ``options`` tune every segment opened through this store: ``log_rolling_size`` (16 MiB),
    ``index_interval_bytes`` (4096), ``codec`` ("none", "gzip", "zstd", "lz4"), ``flush_keys``
    (250,000), ``flush_bytes`` (64 MiB), ``flush_seconds`` (30), ``min_poll_interval`` (0.05 s) and
    ``max_poll_interval`` (1 s): a tail reader's polls for other processes' appends back off between
    them while nothing comes (``poll_interval`` instead: one fixed interval),
    ``max_pending_bytes`` (256 MiB: appends wait for the background merge above it),
    ``truncate_merged_log`` (False), and ``attribute_options`` (passed to the attributes' ``TreeIndex``:
    page_size, cache_bytes...).
    """

    def __init__(self, storage: ChunkStorage, **options: Any):
        self.options = segment_options(options)
        self.storage = storage
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, url: str | os.PathLike[str], *, mode: str = "a", storage_options: Mapping[str, Any] | None = None,
             **options: Any) -> "SegmentStore":
        """Open the store at ``url`` (``memory://``, ``file://`` or a path: ``str`` or ``os.PathLike``, ``s3://``).

        ``mode="a"`` (the default) opens the store or creates it if it is missing, by writing its
        ``_store`` marker; ``mode="r+"`` opens an existing store only, and a missing one (a
        mistyped path, an empty directory or bucket prefix) raises ``StoreNotFoundError``.
        (``AttributeIndex.open`` takes the same modes, and ``"r"`` for read-only.) A store is
        recognised by its marker. A local path that is a regular file raises
        ``StoreNotFoundError`` in both modes. ``storage_options`` go to the
        storage (``s3://``: ``endpoint_url``, credentials ...); ``options`` are ``SegmentOptions``.
        """
        if mode not in ("a", "r+"):
            raise InvalidInputError(f"mode must be 'a' (open or create) or 'r+' (an existing store), got {mode!r:.60}")
        segment_options(options)  # before the storage is opened (a local root is created then)
        storage = open_location(url, _storage_options(storage_options), what="store", not_found=StoreNotFoundError)
        try:
            if mode == "r+" and not store_exists(storage):
                raise StoreNotFoundError(f"no store at URL {storage.url!r} (opened with mode 'r+', so nothing was created)")
            store = cls(storage, **options)
            if mode == "a" and not storage.exists(STORE_MARKER):
                mark_store_created(storage)
        except BaseException:
            storage.close()
            raise
        return store

    # -- segments ------------------------------------------------------------------------------
    def segment(self, name: str, create: bool = False, **cleanup: Any) -> Segment:
        """The handle of segment ``name``; ``create=True`` creates it if missing.

        A missing segment without ``create`` raises ``SegmentNotFoundError``. ``cleanup`` options
        (``cleanup_policy="compact"``, ``min_compaction_lag_ms``, ``tombstone_retention_ms``,
        ``retention_ms``, ``retention_bytes``: see ``CleanupPolicy``) set the policy of a segment
        this call creates; for an existing segment they must match its stored policy
        (``InvalidInputError`` otherwise: change it with ``Segment.configure``).
        """
        validate_name(name)
        _check_bool(create, "create")
        wanted = policy_from_options(cleanup) if cleanup else None  # checked before anything is written
        with self._lock:
            segment = self._segments.get(name)
            if segment is not None and not segment.closed:
                if cleanup:
                    _check_policy(segment.cleanup_policy(), cleanup, name)
                return segment
            if self.storage.appendable:
                exists, storage = self.storage.exists(segment_marker(name)), self.storage
            else:  # an object store: one listing tells whether it exists and opens every part of it
                listing = self.storage.list_files(name)
                exists, storage = SEGMENT_MARKER in listing, ListedStorage(self.storage, name, listing)
            if not exists and not create:
                raise SegmentNotFoundError(f"segment {name!r} does not exist in {self.storage.url!r}")
            if cleanup:
                self._settle_policy(name, wanted, cleanup, exists)
            try:
                # Object stores open lazily: the attributes (the B+tree's footer, the log after its
                # checkpoint) are read when first needed, not to read records (docs/segments.md).
                segment = Segment(storage, name, self.options, lazy_attributes=not self.storage.appendable)
                if storage is not self.storage and not cleanup and \
                        not any(p.startswith(CONFIG_DIR + "/") for p in listing):
                    # No stored policy: the default, known from the listing for free (else the
                    # first append of records would list _config/ to learn it). Not when this
                    # call stored one: the listing was taken before it.
                    segment.cleanup_policy()
            finally:
                if storage is not self.storage:
                    storage.expire()  # later listings are live
            if not exists:
                self.storage.put_marker(segment_marker(name))
            self._segments[name] = segment
            return segment

    def _settle_policy(self, name: str, wanted, given: dict, exists: bool) -> None:
        """Store the policy of a segment being created (before its marker, so a segment that
        exists always has it), or check the given options against the stored policy."""
        stored, version = load_policy(self.storage, name)
        if not exists and version < 0:
            try:
                store_policy(self.storage, name, wanted, 0)
                return
            except ChunkExistsError:  # another process creates it at the same time: compare with its policy
                stored, version = load_policy(self.storage, name)
        _check_policy(stored, given, name)

    def verify_segment(self, name: str) -> SegmentVerifyReport:
        """Read every committed byte of segment ``name`` (log batches, chunk index files, gap
        markers, the attribute index) and report every damaged range (``report.ok``: none).
        Works on a segment that ``segment()`` refuses to open."""
        self._require(name)
        return verify_segment(self.storage, name, self.options)

    def repair_segment(self, name: str) -> SegmentRepairReport:
        """Cut segment ``name``'s log at its first damaged batch and make its attributes consistent.

        The report says exactly which offsets are lost; appends resume above every offset the
        damaged bytes could have held, so no acknowledged offset is reused. Attributes are rebuilt
        from the log when needed and possible. Stop the segment's writers first; this store's
        handle of the segment is closed (``segment()`` opens a fresh one)."""
        self._require(name)
        with self._lock:
            segment = self._segments.pop(name, None)
        if segment is not None and not segment.closed:
            try:
                segment.close()
            except AttrIndexError:  # its merge may fail on the damage being repaired
                pass
        return repair_segment(self.storage, name, self.options)

    def _require(self, name: str) -> None:
        validate_name(name)
        if not self.storage.exists(segment_marker(name)):
            raise SegmentNotFoundError(f"segment {name!r} does not exist in {self.storage.url!r}")

    def exists(self, name: str) -> bool:
        validate_name(name)
        return self.storage.exists(segment_marker(name))

    def segments(self, prefix: str = "") -> list[str]:
        """Names of the segments in the store (under ``prefix``), sorted."""
        if not isinstance(prefix, str):
            raise InvalidInputError(f"prefix must be a str, got {type(prefix).__name__}: {prefix!r:.60}")
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
        """Delete a segment and everything it holds (its handle, if open, is closed first, without
        merging: a merge of it that is writing already is waited for, and none starts after).

        Every file of the segment goes (log, indexes, gaps, attributes, configuration, cleaner
        checkpoints), its marker last; segments nested below the name (``name/0``) stay. If
        anything cannot be deleted, ``StorageError`` names it and the segment still exists:
        call ``delete_segment`` again once the cause is fixed. A name made again afterwards is
        a new, empty segment."""
        validate_name(name)
        with self._lock:
            segment = self._segments.pop(name, None)
        if segment is not None:
            segment.close(merge=False)  # no merge of it writes from now on
        rolling, others = segment_parts(self._segment_parts(name))
        for part in rolling:
            RollingSegment.remove(self.storage, f"{name}/{part}")
        for part in others:
            self.storage.remove_directory(f"{name}/{part}")
            self.storage.delete([f"{name}/{part}"])  # a file rather than a directory
        left = self._segment_parts(name) - {SEGMENT_MARKER}
        if left:
            raise StorageError(f"segment {name!r}: could not delete {sorted(left)} (the segment still exists; "
                               f"delete it again once the cause is fixed)")
        self.storage.delete([segment_marker(name)])

    def _segment_parts(self, name: str) -> set[str]:
        """The top entries of segment ``name``'s files: those starting with ``_`` (segment names
        never do, so nested segments are not among them)."""
        return {path.split("/", 1)[0] for path in self.storage.list_files(name) if path.startswith("_")}

    # -- streams -------------------------------------------------------------------------------
    def create_stream(self, name: str, segments: int) -> list[str]:
        """Create stream ``name`` of ``segments`` segments (``name/0`` ...); an existing stream must
        have the same count. Returns the segment names."""
        validate_name(name, "stream")
        check_segment_count(segments)
        existing = self._stream_count(name)
        if existing is not None and existing != segments:
            raise InvalidInputError(f"stream {name!r} has {existing} segments, not {segments}")
        if existing is None:
            self.storage.put_marker(f"{stream_dir(name)}/_count.{segments}")
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
        counts = sorted(int(m[1]) for m in map(_STREAM_MARKER.fullmatch, self.storage.list_files(stream_dir(name))) if m)
        return counts[0] if counts else None  # two racing creators: the smallest count wins everywhere

    # -- inspection ----------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """The store's URL, its open segment handles and the storage requests made so far."""
        with self._lock:
            open_handles = sum(1 for s in self._segments.values() if not s.closed)
        return StoreStats(url=self.storage.url, open_segments=open_handles, requests=self.storage.requests)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Close every segment handle (merging pending attribute updates into their B+trees)."""
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        failed: AttrIndexError | None = None
        for segment in segments:  # every handle is closed even if a merge fails; the first error is raised
            try:
                segment.close()
            except AttrIndexError as exc:
                failed = failed or exc
        self.storage.close()
        if failed is not None:
            raise failed

    def __enter__(self) -> "SegmentStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SegmentStore({self.storage.url!r})"


def segment_options(options: Mapping[str, Any]) -> SegmentOptions:
    """``SegmentOptions`` from a store's keyword options, every value checked (``InvalidInputError``
    naming the option), so a bad option is refused before anything is opened or written."""
    try:
        built = SegmentOptions(**options)
    except TypeError as exc:
        raise InvalidInputError(f"unknown segment store option: {exc}") from None
    for name in _SIZE_OPTIONS:
        value = getattr(built, name)
        if type(value) is not int or value < 1:
            raise InvalidInputError(f"store option {name} must be an int >= 1, got {value!r}")
    polls = ("poll_interval", "min_poll_interval", "max_poll_interval")
    for name, low, high in (("flush_seconds", 0, float("inf")), ("merge_hang_seconds", 0.01, threading.TIMEOUT_MAX),
                            *((poll, 1e-6, threading.TIMEOUT_MAX) for poll in polls)):
        value = getattr(built, name)  # flush_seconds=inf: never by time; a poll of 0 would spin
        if name == "poll_interval" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise InvalidInputError(f"store option {name} must be a number of seconds in [{low:g}, {high:g}], "
                                    f"got {value!r:.60}")
    if type(built.truncate_merged_log) is not bool:
        raise InvalidInputError(f"store option truncate_merged_log must be True or False, "
                                f"got {built.truncate_merged_log!r:.60}")
    if built.min_poll_interval > built.max_poll_interval:
        raise InvalidInputError(f"store option min_poll_interval ({built.min_poll_interval!r}) must not exceed "
                                f"max_poll_interval ({built.max_poll_interval!r})")
    _check_attribute_options(built.attribute_options)
    return built


def _check_attribute_options(options: object) -> None:
    """Names only: their values are checked when a segment's index is opened, before its marker."""
    if not isinstance(options, Mapping):
        raise InvalidInputError(f"store option attribute_options must be a dict, got {type(options).__name__}")
    allowed = [p.name for p in inspect.signature(TreeIndex).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(map(repr, set(options) - set(allowed)))
    if unknown:
        raise InvalidInputError(f"unknown attribute_options {', '.join(unknown)}; known: {', '.join(allowed)}")


def _storage_options(options: object) -> dict:
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise InvalidInputError(f"storage_options must be a dict of str keys or None, got {options!r:.80}")
    return dict(options)


def _check_policy(stored, given: dict, name: str) -> None:
    """``InvalidInputError`` if a given cleanup option differs from the stored policy."""
    wanted = policy_from_options(given, stored)
    if wanted != stored:
        raise InvalidInputError(f"segment {name!r} exists with cleanup policy {stored}; the options given differ "
                                f"({', '.join(f'{k}={v!r}' for k, v in given.items())}): change it with "
                                f"Segment.configure")


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {type(value).__name__}: {value!r:.60}")


def check_segment_count(segments: object) -> int:
    """A stream's segment count: an int in ``[1, MAX_STREAM_SEGMENTS]``."""
    if type(segments) is not int or not 1 <= segments <= MAX_STREAM_SEGMENTS:
        raise InvalidInputError(f"segments must be an int in [1, {MAX_STREAM_SEGMENTS}], got {segments!r:.60}")
    return segments


def store_exists(storage: ChunkStorage) -> bool:
    """Whether ``storage``'s root holds a store: its ``_store`` marker (written by a creating open)."""
    return storage.exists(STORE_MARKER)


def mark_store_created(storage: ChunkStorage) -> None:
    """Write the store marker (idempotent)."""
    storage.put_marker(STORE_MARKER)
    log.info("created store at %s (wrote its %s marker)", storage.url, STORE_MARKER)


def stream_segment_names(stream: str, count: int) -> list[str]:
    return [f"{stream}/{i}" for i in range(count)]
