"""``AttributeIndex``: the public key-value index (16-byte keys, int64 values) over any storage URL.

It owns three parts, the ones a ``Segment`` is built of too (see docs/architecture.md):

* a record-batch log (``SegmentLog``) named ``NAME/_wal``, the write-ahead log: each ``update`` is
  one attribute-only batch appended to it (REPLACE semantics, ``None`` removes) by the
  ``Appender`` (group commit), and returns when that append is durable;
* the ``AttributeState``: its tier-1 overlays serve the updates at once, and its merge moves them
  into the B+tree, a ``TreeIndex`` kept at the index's own name ``NAME``, as large sorted batches
  with the WAL position they cover as the tree's checkpoint; the WAL below it is then deleted;
* opening replays the WAL after that checkpoint.

See docs/design.md, "Write path".
"""

from __future__ import annotations

import os
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import attrs

from storage_adapters import ChunkStorage, RollingSegment
from storage_adapters.rolling import validate_segment_name

from .arguments import check_progress
from .btree.bulk import DEFAULT_SPILL_BYTES, read_columns, read_pairs
from .btree.columns import column_keys
from .btree.repair import IndexRepairReport
from .btree.runs import RUN_MIN_ENTRIES, RUN_SHARE
from .btree.verify import VerifyReport
from .errors import CorruptDataError, InvalidInputError, RetriesExhaustedError, StorageError
from .handle import IndexHandle
from .keys import KEY_SIZE, all_canonical_keys, all_canonical_values, canonical_batch, to_key
from .locations import index_storage
from .value_cache import MISSING
from .appender import Appender
from .layout import log_name, rolling_dir, wal_name
from .attribute_state import AttributeState
from .log.framing import LOG_FRAMING
from .log.segment_log import SegmentLog
from .merge_worker import DEFAULT_HANG_SECONDS
from .options import (DEFAULT_FLUSH_BYTES, DEFAULT_FLUSH_KEYS, DEFAULT_FLUSH_SECONDS, DEFAULT_MAX_PENDING_BYTES,
                      SegmentOptions)
from .segment_repair import SegmentRepairReport, SegmentVerifyReport, repair_segment, verify_segment
from .tree_index import (DEFAULT_CACHE_BYTES, DEFAULT_PIECE_SIZE, DEFAULT_INDEX_ROLLING_SIZE, DEFAULT_VALUE_CACHE_ENTRIES,
                         LOGICAL_BYTES_PER_KEY, MAX_SPLIT_PARTS, IndexStats, TreeIndex, key_list, pair_count,
                         write_amplification)

#: WAL chunk size: space comes back a whole merged chunk at a time, so small next to the tree
DEFAULT_WAL_ROLLING_SIZE = 4 << 20
MAX_REFRESH_ATTEMPTS = 10  #: refreshes that met another handle's WAL truncation before giving up

_log = logging.getLogger("attrindex.index")


@attrs.frozen
class IndexVerifyReport(VerifyReport):
    """``VerifyReport`` of the B+tree (pages, entries, ... count the tree) with the WAL's damage
    added to ``damage``; ``wal`` is the WAL's own report (batches and bytes read)."""

    wal: SegmentVerifyReport | None = None


@attrs.frozen
class WalIndexRepairReport(IndexRepairReport):
    """``IndexRepairReport`` of the B+tree, and ``wal``: what the repair of the WAL did."""

    wal: SegmentRepairReport | None = None
    #: the tree rolled back to a version older than the WAL's start: the updates merged between
    #: that version and the WAL's start are lost for good (the tree's checkpoint was moved on)
    merged_updates_lost: bool = False


#: Pending keys looked up in the tree at a time by ``len`` (Python objects for one block only).
_COUNT_BLOCK = 1 << 16


def _stored_count(get_many: Callable[[list[bytes]], list], keys) -> int:
    """How many of the sorted ``S16`` ``keys`` the tree holds, asked ``_COUNT_BLOCK`` at a time."""
    stored = 0
    for at in range(0, len(keys), _COUNT_BLOCK):
        stored += sum(value is not None for value in get_many(column_keys(keys[at:at + _COUNT_BLOCK])))
    return stored


class AttributeIndex(IndexHandle):
    """A durable map of 16-byte keys to signed 64-bit values: a write-ahead log over a B+tree.

    Keys may be given as 16 ``bytes``, a ``uuid.UUID`` or an ``int`` in ``[0, 2**128)``; they come
    back as ``bytes`` in unsigned byte order. Each ``update`` is one durable append to the
    write-ahead log; reads see it at once, and the B+tree gets the updates later as large sorted
    merges (``flush()`` forces one). Several handles and processes may update one index:
    compare-and-append on the log orders their updates. Reads see this handle's latest view;
    ``refresh()`` picks up other writers' updates.
    """

    def __init__(
        self,
        storage: ChunkStorage,
        name: str = "attributes",
        *,
        page_size: int = 32768,
        rolling_size: int = DEFAULT_INDEX_ROLLING_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        value_cache_entries: int = DEFAULT_VALUE_CACHE_ENTRIES,
        compaction: bool | str | object = True,
        piece_size: int = DEFAULT_PIECE_SIZE,
        run_share: float = RUN_SHARE,
        run_min_entries: int = RUN_MIN_ENTRIES,
        wal_rolling_size: int = DEFAULT_WAL_ROLLING_SIZE,
        merge_keys: int = DEFAULT_FLUSH_KEYS,
        merge_bytes: int = DEFAULT_FLUSH_BYTES,
        merge_seconds: float = DEFAULT_FLUSH_SECONDS,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        merge_process: bool = True,
        merge_hang_seconds: float = DEFAULT_HANG_SECONDS,
    ):
        validate_segment_name(name)
        for option, value in (("wal_rolling_size", wal_rolling_size), ("merge_keys", merge_keys),
                              ("merge_bytes", merge_bytes), ("max_pending_bytes", max_pending_bytes)):
            if type(value) is not int or value < 1:
                raise InvalidInputError(f"{option} must be an int >= 1, got {value!r:.60}")
        if isinstance(merge_seconds, bool) or not isinstance(merge_seconds, (int, float)) or not merge_seconds >= 0:
            raise InvalidInputError(f"merge_seconds must be a number >= 0, got {merge_seconds!r:.60}")
        if type(merge_process) is not bool:
            raise InvalidInputError(f"merge_process must be True or False, got {merge_process!r:.60}")
        if (isinstance(merge_hang_seconds, bool) or not isinstance(merge_hang_seconds, (int, float))
                or not 0.01 <= merge_hang_seconds <= threading.TIMEOUT_MAX):
            raise InvalidInputError(f"merge_hang_seconds must be a number of seconds >= 0.01, "
                                    f"got {merge_hang_seconds!r:.60}")
        self._storage = storage
        self._name = name
        self._options = SegmentOptions(
            log_rolling_size=wal_rolling_size, flush_keys=merge_keys, flush_bytes=merge_bytes,
            flush_seconds=float(merge_seconds), max_pending_bytes=max_pending_bytes, truncate_merged_log=True,
            merge_process=merge_process, merge_hang_seconds=float(merge_hang_seconds),
            attribute_options=dict(page_size=page_size, rolling_size=rolling_size, cache_bytes=cache_bytes,
                                   value_cache_entries=value_cache_entries, compaction=compaction,
                                   piece_size=piece_size, run_share=run_share, run_min_entries=run_min_entries))
        self._closed = False
        self._read_only = False  # set by open(mode="r")
        self._updates_written = 0  # WAL appends made by this handle
        self._keys_loaded = 0  # pairs of this handle's bulk loads (``logical_bytes``, with its updates' keys)
        self._written_before = (0, 0)  # keys and bytes the appenders this handle had before a repair wrote
        self._len_cache: tuple[tuple, int] | None = None  # (state it was counted at, count)
        self._open_wal()

    def _open_wal(self) -> None:
        """The parts: the WAL at ``NAME/_wal``, the tree at ``NAME`` with the WAL replayed after its
        checkpoint, and the appender. Their lock: updates, catch-up, freezing and the read view."""
        lock = threading.RLock()
        log = SegmentLog(self._storage, self.wal_name, rolling_size=self._options.log_rolling_size,
                         index_interval_bytes=self._options.index_interval_bytes)
        state = AttributeState(log, self._name, self._options, lock)
        try:
            with lock:
                state.open()
                # Tier 1 is the WAL replayed from the tree version just read: merges check that
                # the tree is still that version (another handle's bulk load is no replay of it).
                state.track_base()
        except CorruptDataError as exc:
            log.close()
            checkpoint = self._checkpoint_without_wal()
            if checkpoint is None:
                raise
            raise CorruptDataError(
                f"index {self._name!r} at {self._storage.url!r}: its tree covers write-ahead log position "
                f"{checkpoint}, but there is no write-ahead log at {self.wal_name!r} (deleted, or not copied "
                f"with the tree: restore it beside the tree, the updates after that position are only there). "
                f"A tree written by TreeIndex.update(checkpoint=...) is not an AttributeIndex: open it with "
                f"attrindex.tree_index.TreeIndex. See docs/design.md, 'Write path'", segment=exc.segment,
                offset=exc.offset) from exc
        except BaseException:
            log.close()
            raise
        self._lock, self._log, self._attributes = lock, log, state
        self._appender = Appender(log, state, lock)

    def _checkpoint_without_wal(self) -> int | None:
        """The tree's checkpoint when it is not 0 and no WAL chunk exists (None otherwise)."""
        if self._storage.list_files(rolling_dir(log_name(self.wal_name))):
            return None
        tree = TreeIndex(self._storage, self._name, **self._options.attribute_options)
        try:
            return tree.checkpoint or None
        finally:
            tree.close()

    @property
    def wal_name(self) -> str:
        """The segment name of the write-ahead log (``NAME/_wal``)."""
        return wal_name(self._name)

    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str],
        name: str = "attributes",
        *,
        mode: str = "a",
        storage_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> "AttributeIndex":
        """Open the index ``name`` at a storage URL: ``memory://``, ``file://`` or a path (``str`` or
        ``os.PathLike``), ``s3://``.

        ``mode="a"`` (the default) opens the index or creates it; ``mode="r+"`` opens an existing
        index only; ``mode="r"`` opens an existing index read-only (nothing is written, not even a
        merge; ``update`` raises ``InvalidInputError``). A missing index (a mistyped path, an empty
        directory) raises ``IndexNotFoundError`` in modes "r+" and "r", and a local path that is a
        regular file in every mode. ``SegmentStore.open`` takes the same modes but "r".

        ``options``: ``page_size`` (default 32768), ``rolling_size`` of the tree (4 MiB),
        ``cache_bytes``: the memory of decoded pages the page cache holds (256 MiB, about 1,200
        leaves of 32 KiB; 0 disables), ``value_cache_entries`` (1Mi),
        ``compaction`` (True: the bounded policy; "pravega"; False); ``piece_size`` (8 MiB: a merge
        that writes more is appended in pieces of about this size, which bounds its memory);
        ``run_share`` (0.125) and ``run_min_entries`` (2Mi): merges into a tree of at least
        ``run_min_entries`` entries write sorted runs beside it until the runs hold ``run_share``
        of its entries, then rebuild it with them (0: every merge goes into the tree);
        ``wal_rolling_size`` (4 MiB),
        and when the WAL's pending updates are merged into the tree by the background merge:
        ``merge_keys`` (250,000 pending keys), ``merge_bytes`` (64 MiB of overlay),
        ``merge_seconds`` (30); ``max_pending_bytes`` (128 MiB) bounds the pending updates'
        memory: beyond it ``update`` waits for the merge (back-pressure, bounded);
        ``merge_process`` (True): on local disk the merge runs in a worker process, so its CPU
        never delays ``update`` (False: in a thread of this process, as on other storage);
        ``merge_hang_seconds`` (5): a worker that makes no progress (no CPU time, no read or write)
        this long is killed and its merge retried (after three in a row, merges stay in this
        process), so ``update`` never waits long behind a hung worker, and ``close`` never waits
        for the worker at all.
        """
        return cls._open_at(url, name, mode, storage_options, options)

    # -- reading -------------------------------------------------------------------------------
    def get(self, key: object) -> int | None:
        """The value stored for ``key``, or ``None``."""
        # The hot path: ``read_view.view_value`` inlined (a Python call is ~5% of a warm lookup).
        # No lock and no closed check: one read of the read view (a closed handle's raises).
        active, active_settled, frozen, frozen_settled, recent, tree_get, _tree_get_many = self._attributes.view
        if type(key) is not bytes or len(key) != KEY_SIZE:
            key = to_key(key)
        if active is not None:  # the overlay's lookup table (``AttributeOverlay.lookup``); None: empty
            value = active[key[-2]].get(key, MISSING)
            if value is not MISSING:
                return value  # type: ignore[return-value]
        if active_settled is not None:
            value = active_settled.get(key)
            if value is not MISSING:
                return value  # type: ignore[return-value]
        if frozen is not None:
            value = frozen[key[-2]].get(key, MISSING)
            if value is not MISSING:
                return value  # type: ignore[return-value]
        if frozen_settled is not None:
            value = frozen_settled.get(key)
            if value is not MISSING:
                return value  # type: ignore[return-value]
        value = recent.young.get(key, MISSING)
        if value is MISSING:
            try:
                return tree_get(key)  # type: ignore[no-any-return]
            except InvalidInputError:  # a closed handle's view: say so in the index's words
                self._check_open()
                raise
        recent.hits += 1
        return value  # type: ignore[return-value]

    def get_many(self, keys: Iterable[object]) -> list[int | None]:
        """Values for ``keys`` in input order (``None`` where absent)."""
        self._check_open()
        keys = key_list(keys)
        canonical = keys if all_canonical_keys(keys) else [to_key(k) for k in keys]
        return self._attributes.values(canonical)  # lock-free, from one read view

    def items(self, start: object = None, stop: object = None) -> Iterator[tuple[bytes, int]]:
        """``(key, value)`` pairs with ``start <= key < stop`` in ascending key order: the WAL's
        pending updates merged over the tree (a snapshot of the pending ones, the tree read lazily)."""
        self._check_open()
        low = None if start is None else to_key(start)
        high = None if stop is None else to_key(stop)
        return self._attributes.items(low, high)

    def split_keys(self, parts: int) -> list[bytes]:
        """Up to ``parts - 1`` ascending keys cutting the stored keys into about equal ranges
        (for scanning in parallel); reads only a few upper pages of the tree (keys only pending in
        the WAL are not weighed)."""
        self._check_open()
        if type(parts) is not int or not 0 <= parts <= MAX_SPLIT_PARTS:
            raise InvalidInputError(f"parts must be an int in [0, {MAX_SPLIT_PARTS}], got {parts!r:.60}")
        with self._lock:
            return self._attributes.tree.split_keys(parts)

    def __len__(self) -> int:
        """The exact number of keys: the tree's count corrected for the WAL's pending updates.

        Costs one tree lookup per pending key (``get_many``, mostly cached pages, in blocks) when
        the state changed since the last call; bounded by ``max_pending_bytes``. The lookups run
        on a snapshot of the pending updates (compact columns) without the WAL's lock: updates
        beside a ``len`` wait for the snapshot, not for the count."""
        self._check_open()
        attributes = self._attributes
        for _attempt in range(MAX_REFRESH_ATTEMPTS):
            with self._lock:
                attributes.settle()  # (a failed rebuild left tier 1 stale: rebuilt first, or raise)
                state, pending = attributes.pending_snapshot()
                cached = self._len_cache
                if cached is not None and cached[0] == state:
                    return cached[1]
            count = self._count_snapshot(state[0], pending)
            if count is not None:
                self._len_cache = (state, count)
                return count
        with attributes.runner.merging(), self._lock:  # merges kept moving the tree: count with merges held off
            return self._count()

    def _count_snapshot(self, position: int, pending: tuple) -> int | None:
        """The count at WAL ``position`` from a snapshot of tier 1 (without the lock), or None if
        the tree moved during the count or covers more than ``position`` (then count again).

        Any tree version up to ``position`` overlaid with tier 1 as of ``position`` is the state at
        ``position``: a merge landing meanwhile moves into the tree only what tier 1 overrides."""
        tree = self._attributes.tree
        version = tree.version
        if version.footer.checkpoint > position:
            return None
        # Not through the recent-values cache, which may still answer the previous version's
        # values under this version's entry count (a key about to be written cached as absent).
        # The tree answers every key from one version, checked below.
        stored = _stored_count(tree.get_many_uncached, pending[0])
        entries = tree.count(version)
        if entries is None or tree.version.footer_offset != version.footer_offset:
            return None
        return entries + int((~pending[2]).sum()) - stored

    def _count(self) -> int:
        """Tree entries + pending keys present now - pending keys the tree holds (under the lock)."""
        attributes = self._attributes
        attributes.settle()
        tree = attributes.tree
        entries = tree.count()
        keys, _values, gone = attributes.pending_columns()
        if not len(keys):
            return entries
        return entries + int((~gone).sum()) - _stored_count(tree.get_many, keys)

    def __contains__(self, key: object) -> bool:
        self._check_open()
        return self.get(key) is not None

    # -- writing -------------------------------------------------------------------------------
    def update(self, updates: Mapping[object, int | None] | Iterable[tuple[object, int | None]], *,
               checkpoint: None = None) -> bool:
        """Apply ``key -> value`` updates (``None`` removes) as one durable append to the WAL;
        return whether anything was written (False for no updates).

        Within one call the last value given for a key wins. Invalid keys or values raise before
        anything is written. Returns only once the append is durable; reads see it at once. The
        merge into the tree that may follow never fails the update (``stats().merge_error``).
        ``OutcomeUnknownError`` means storage could not settle whether the append was written
        (``refresh()`` and read to find out). ``checkpoint`` is refused: an index's checkpoint
        is its WAL position (``TreeIndex`` keeps positions of other logs).
        """
        self._check_writable()
        _refuse_checkpoint(checkpoint)
        batch = canonical_batch(updates)
        if not batch:
            return False
        self._append(batch)
        return True

    def update_sorted(self, keys: list[bytes], values: list[int | None], *, checkpoint: None = None) -> bool:
        """``update`` for input already canonical: ``keys`` 16-byte ``bytes``, sorted and unique,
        ``values`` int64 or ``None``; the lists are checked at C speed, not per key in Python."""
        self._check_writable()
        _refuse_checkpoint(checkpoint)
        if len(keys) != len(values):
            raise InvalidInputError(f"update_sorted got {len(keys)} keys and {len(values)} values")
        if not keys:
            return False
        if not (all_canonical_keys(keys) and all_canonical_values(values)):
            raise InvalidInputError("update_sorted takes 16-byte bytes keys and int64 or None values; use update")
        batch = dict(zip(keys, values))
        if len(batch) != len(keys):
            raise InvalidInputError("update_sorted takes unique keys; use update")
        self._append(batch)
        return True

    def bulk_load(self, pairs: Mapping[object, int | None] | Iterable[tuple[object, int | None]], *,
                  progress: Callable[[int, int], None] | None = None, spill_bytes: int = DEFAULT_SPILL_BYTES) -> int:
        """Load ``(key, value)`` pairs, in any order, straight into the tree; return ``len(self)``.

        The tree is built bottom-up (full leaves, then index pages) and written as ONE durable
        update (``TreeIndex.bulk_load``: sorted input is streamed, the last pair for a key wins,
        ``None`` removes, stored entries are merged in). First the WAL's pending updates are
        merged into the tree and an empty batch is appended to the WAL; the load carries that
        batch's end as its checkpoint, so it is ordered after every earlier update and before
        every later one, and replay never applies an older update over it. Every pair is checked
        before anything is written. ``progress(done, total)`` and ``spill_bytes`` (what the pairs
        held may take before they are sorted and spilled to temporary files) as in
        ``TreeIndex.bulk_load``. Stop other writers of the index first: a merge by another handle during the load raises
        ``StorageError`` (the load may or may not be in the tree then: read to find out).
        """
        self._check_writable()
        run = read_pairs(pairs, progress, spill_bytes=spill_bytes)  # checked and sorted before anything is written
        return self._load_run(run, progress)

    def bulk_load_columns(self, chunks: Iterable[tuple[object, object]], *,
                          progress: Callable[[int, int], None] | None = None,
                          spill_bytes: int = DEFAULT_SPILL_BYTES) -> int:
        """``bulk_load`` for input given as columns: an iterable of ``(keys, values)`` chunks
        (``TreeIndex.bulk_load_columns`` says what each may be), checked chunk by chunk without a
        Python object per pair; the load is ordered in the WAL as ``bulk_load``'s. Returns
        ``len(self)``."""
        self._check_writable()
        run = read_columns(chunks, progress, spill_bytes=spill_bytes)  # checked and sorted before anything is written
        return self._load_run(run, progress)

    def _load_run(self, run, progress) -> int:
        """Write a checked, sorted run into the tree at its place in the WAL (see ``bulk_load``);
        closes the run."""
        loaded = pair_count(run)  # (before ``close``, which forgets spilled runs)
        try:
            attributes = self._attributes
            tree, log = attributes.tree, self._log
            with attributes.runner.merging():  # no background merge until the load is in the tree
                for _attempt in range(MAX_REFRESH_ATTEMPTS):
                    attributes.drain()
                    with self._lock:
                        self._appender.append_empty(int(time.time() * 1000))  # the load's place in the WAL
                        position = log.position
                        if not attributes.pending_keys:  # no update slipped in before it
                            break
                else:
                    raise RetriesExhaustedError(f"index {self._name!r}: updates kept arriving during bulk_load "
                                                f"({MAX_REFRESH_ATTEMPTS} tries); nothing was loaded")
                # Updates appended meanwhile land after ``position`` in the WAL and in the overlay.
                tree.bulk_load(run, checkpoint=position, progress=progress)
                if tree.checkpoint != position:
                    raise StorageError(f"index {self._name!r}: another handle merged into the tree during bulk_load "
                                       f"(its checkpoint is {tree.checkpoint}, the load's {position}): stop other writers; "
                                       f"read the index to see whether the load is in it")
        finally:
            run.close()  # the sorted runs spilled to temporary files, if any
        with self._lock:
            self._updates_written += 1
            self._keys_loaded += loaded
        return len(self)

    def _append(self, batch: dict[bytes, int | None]) -> None:
        # In the caller's order: nothing reads a WAL batch's updates in key order (replay applies
        # them to the overlay, the merge sorts the overlay), and sorting 1,000 random keys took
        # ~15% of an update's CPU.
        self._appender.append_replacements(list(batch), list(batch.values()), self._options.codec)  # durable
        self._updates_written += 1

    def flush(self) -> None:
        """Merge every pending update of the WAL into the tree now (one sorted batch).

        Not needed for durability (every update already is). Raises the storage error if the
        merge fails; the updates stay in the WAL and a later merge retries."""
        self._check_writable()
        self._attributes.flush()

    @property
    def checkpoint(self) -> int | None:
        """The WAL byte position the tree covers: updates before it are merged into the tree
        (``None`` before the first merge)."""
        self._check_open()
        return self._attributes.tree.checkpoint

    def refresh(self) -> None:
        """Pick up updates made by other handles or processes (the version seen never goes back).

        Raises ``CorruptDataError`` if the tree's newest footer or the WAL is damaged: see
        ``verify`` and ``repair``."""
        self._check_open()
        with self._attributes.runner.merging(), self._lock:  # no merge of this handle's meanwhile
            self._attributes.refresh()

    # -- inspection ----------------------------------------------------------------------------
    def stats(self) -> IndexStats:
        """Counts, storage use and I/O counters of this handle; cheap: no lookup, nothing read.

        ``entry_count`` is the tree's (merged) entries and ``pending_keys`` the keys in the WAL
        not yet merged into it (some may be in the tree already, some removals: ``len`` is the
        exact count, at one tree lookup per pending key). The shape, ``length``,
        ``start_offset``, ``live_bytes``, ``bytes_written`` (merges, the merge worker's
        included) and the cache counters are the tree's; ``updates_written`` counts this handle's
        WAL appends and ``wal_bytes_written`` their bytes; ``logical_bytes`` is 24 per key of
        this handle's updates and bulk loads; ``write_amplification`` is ``(wal_bytes_written +
        bytes_written) / logical_bytes``; ``storage_bytes`` is the tree's plus ``wal_bytes``.
        """
        self._check_open()
        with self._lock:
            tree = self._attributes.tree.stats()
            wal_bytes = sum(c.stored for c in self._log.bytes.chunks())  # a hole holds nothing
            pending = self._attributes.pending_keys
            keys, wal_written = self._written_before
            keys += self._keys_loaded + self._appender.keys_written
            wal_written += self._appender.bytes_written
        logical = keys * LOGICAL_BYTES_PER_KEY
        return attrs.evolve(tree, updates_written=self._updates_written, storage_bytes=tree.storage_bytes + wal_bytes,
                            pending_keys=pending, wal_bytes=wal_bytes, logical_bytes=logical,
                            wal_bytes_written=wal_written,
                            write_amplification=write_amplification(logical, wal_written + tree.bytes_written))

    def _counts(self) -> str:
        """``repr``'s counts, cheap as ``stats``: the tree's entries and the keys pending in the WAL."""
        with self._lock:
            return (f"tree_entries={self._attributes.tree.version.footer.entry_count}, "
                    f"pending_keys={self._attributes.pending_keys}")

    def verify(self, progress: Callable[[int, int], None] | None = None) -> IndexVerifyReport:
        """Read every committed byte of the tree and of the WAL and report every damaged range.

        The tree: the chain of updates from the tail footer back to the truncation offset and
        every live page of the newest version (checksum, key order, routing, depth, subtree
        minimum offsets, footer counts); ``pages``, ``entries``... count the tree alone. The WAL:
        every batch and its checksum, and that the tree's checkpoint lies within it. Damage is
        collected in ``report.damage`` (``report.ok`` when there is none), not raised.
        ``progress(pages_done, pages_total)`` is called as live pages are checked.
        """
        self._check_open()
        return self._verify(self._storage, self._name, self._options, progress)

    @classmethod
    def verify_at(cls, storage: str | os.PathLike[str] | ChunkStorage, name: str = "attributes", *,
                  storage_options: Mapping[str, Any] | None = None,
                  progress: Callable[[int, int], None] | None = None) -> IndexVerifyReport:
        """``verify`` for the index ``name`` at a storage URL or ``ChunkStorage``, without opening
        it: works on an index that refuses to open (a damaged newest footer or WAL)."""
        return cls._verify(index_storage(storage, storage_options, name), name, SegmentOptions(), progress)

    @staticmethod
    def _verify(storage: ChunkStorage, name: str, options: SegmentOptions,
                progress: Callable[[int, int], None] | None) -> IndexVerifyReport:
        check_progress(progress)
        wal_report = verify_segment(storage, wal_name(name), options, tree_name=name)
        tree = wal_report.attributes
        if tree is None:  # the tree could not be read at all: its damage is in the WAL report's
            return IndexVerifyReport(0, 0, 0, 0, damage=list(wal_report.damage), wal=wal_report)
        if progress is not None:
            progress(tree.pages, tree.pages)
        return IndexVerifyReport(tree.pages, tree.entries, tree.bytes, tree.height, damage=list(wal_report.damage),
                                 updates=tree.updates, wal=wal_report)

    def repair(self) -> WalIndexRepairReport:
        """Repair the tree, then the WAL, from storage alone (see ``repair_at``); reopen after.

        Stop other writers first."""
        self._check_writable()
        with contextlib.suppress(CorruptDataError, StorageError):
            self._attributes.close(merge=False)  # no merge on the way out: the tree may be what is damaged
        self._log.close()
        report = self._repair(self._storage, self._name, self._options)
        keys, wal_written = self._written_before
        self._written_before = (keys + self._appender.keys_written, wal_written + self._appender.bytes_written)
        self._open_wal()
        self._len_cache = None
        return report

    @classmethod
    def repair_at(cls, storage: str | os.PathLike[str] | ChunkStorage, name: str = "attributes", *,
                  storage_options: Mapping[str, Any] | None = None) -> WalIndexRepairReport:
        """``repair`` for the index ``name`` at a storage URL or ``ChunkStorage``, without opening it.

        The tree rolls back to its newest version whose footer and every live page verify (its
        footer appended again; ``CorruptDataError`` if none is left: rebuild the index from its
        source); opening then replays the WAL after that version's checkpoint, so updates the WAL
        still holds come back. Then the WAL's damaged batches become gaps, its intact ones are kept
        and a damaged tail is cut (``report.wal`` says what was lost); the tree is never rebuilt
        from the WAL (it holds what was merged before).
        """
        return cls._repair(index_storage(storage, storage_options, name), name, SegmentOptions())

    @staticmethod
    def _repair(storage: ChunkStorage, name: str, options: SegmentOptions) -> WalIndexRepairReport:
        tree = TreeIndex.repair_at(storage, name)
        lost = tree.rolled_back and _advance_below_wal(storage, name, options)
        wal = repair_segment(storage, wal_name(name), options, tree_name=name, rebuild_attributes=False)
        fields = attrs.asdict(tree, recurse=False)
        fields["damage"] = tree.damage + wal.damage
        return WalIndexRepairReport(**fields, wal=wal, merged_updates_lost=lost)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Merge this handle's pending updates into the tree and release the handle (every update
        is already durable in the WAL: a merge that fails here raises, and the next open replays).
        Every later call but ``close`` raises ``InvalidInputError``."""
        if self._closed:
            return
        self._closed = True
        try:
            self._attributes.close()
        finally:
            self._log.close()

    def _location(self) -> tuple[str, str]:
        return self._name, self._storage.url


def _advance_below_wal(storage: ChunkStorage, name: str, options: SegmentOptions) -> bool:
    """After a tree rollback: if the kept version's checkpoint lies below the WAL's start (the WAL
    between was truncated after a merge), those updates are gone; move the checkpoint to the
    WAL's start so the index opens, and say so (True)."""
    wal = RollingSegment(storage, log_name(wal_name(name)), framing=LOG_FRAMING)
    tree = TreeIndex(storage, name, **options.attribute_options)
    try:
        start, covered = wal.start_offset, tree.checkpoint or 0
        if covered >= start or wal.length <= start:
            return False
        tree.update({}, checkpoint=start)
        _log.warning("index %r: the tree rolled back to a version covering the WAL up to byte %d, but the WAL "
                     "starts at %d: the updates merged in between are lost", name, covered, start)
        return True
    finally:
        tree.close()
        wal.close()


def _refuse_checkpoint(checkpoint: object) -> None:
    if checkpoint is not None:
        raise InvalidInputError(
            f"AttributeIndex.update takes no checkpoint (got {checkpoint!r:.60}): the index's checkpoint is its "
            f"write-ahead log's position; TreeIndex.update(..., checkpoint=) stores a position in another log")


__all__ = ["AttributeIndex", "IndexVerifyReport", "WalIndexRepairReport"]
