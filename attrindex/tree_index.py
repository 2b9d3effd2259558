"""``TreeIndex``: a durable map of 16-byte keys to int64 values stored as an append-only B+tree.

Each ``update`` is one durable append of the modified pages (copy-on-write, root last). It is the
checkpoint layer under ``Segment`` (a segment's attributes) and under the public ``AttributeIndex``
(whose updates go to a write-ahead log first, see ``attrindex.attribute_index``). The shared input
helpers (``canonical_batch``, ``key_list``) and ``IndexStats`` live here too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping  # (isinstance checks: typing.Mapping's is ~5x slower, on every update)
from itertools import compress, repeat
from operator import is_
from typing import Any, Callable, Iterable, Iterator

import uuid

import attrs

from storage_adapters import ChunkStorage, RollingSegment
from storage_adapters.errors import OffsetOutOfRangeError

from .btree import DEFAULT_PIECE_SIZE, BTreeIndex, policy_for
from .btree.bulk import DEFAULT_SPILL_BYTES, read_columns, read_pairs
from .btree.framing import TREE_FRAMING
from .btree.runs import RUN_MIN_ENTRIES, RUN_SHARE, RunPolicy
from .btree.repair import IndexRepairReport, repair_index
from .btree.sorted_run import SortedRun
from .btree.spill import SpilledRuns
from .btree.verify import VerifyReport, verify_index
from .cache import ShardedLRUCache
from .errors import InvalidInputError
from .handle import IndexHandle
from .keys import KEY_SIZE, VALUE_MAX, all_canonical_keys, canonical_batch, to_key
from .locations import index_storage
from .value_cache import MISSING, ValueCache

#: ``cache_bytes``: memory of the decoded pages the page cache holds (``page_memory``): about 1,200
#: decoded 32 KiB leaves (1.6M keys), as a decoded page holds about 6.7 times its stored size
DEFAULT_CACHE_BYTES = 256 << 20
MAX_SPLIT_PARTS = 1 << 20  #: more parts than this cannot be meaningful (and would loop for long)
# Space comes back a whole chunk at a time, so the index's chunks are small next to its live bytes:
# with 32 MiB chunks, an index of 25 MiB could hold a whole dead chunk more than it needs.
DEFAULT_INDEX_ROLLING_SIZE = 4 << 20
DEFAULT_VALUE_CACHE_ENTRIES = 1 << 20
LOGICAL_BYTES_PER_KEY = KEY_SIZE + 8  #: a key update's logical size: its key and its int64 value


# Updates up to this size enter the recent-values cache; larger ones only refresh cached entries.
_CACHE_UPDATES_UP_TO = 10_000


# Single keys: iterating one would turn it into a list of bogus keys (16 one-byte "keys" of a bytes).
_SINGLE_KEY_TYPES = (bytes, bytearray, memoryview, str, int, uuid.UUID)


def key_list(keys: Iterable[object]) -> list[object]:
    """``keys`` as a list; a single key (bytes, str, int, UUID) or a non-iterable raises
    ``InvalidInputError`` instead of being iterated."""
    if isinstance(keys, list):
        return keys
    if isinstance(keys, _SINGLE_KEY_TYPES):
        raise InvalidInputError(
            f"expected an iterable of keys, got a single {type(keys).__name__} key; wrap it in a list: [key]"
        )
    try:
        return list(keys)
    except TypeError:
        raise InvalidInputError(f"expected an iterable of keys, got {type(keys).__name__}") from None


def pair_count(run: SortedRun | SpilledRuns) -> int:
    """The key updates a load's pairs hold (``bulk.read_pairs``): kept and removed keys (for
    runs spilled to files, summed over the runs: a key in several counts in each)."""
    return run.pairs if isinstance(run, SpilledRuns) else len(run) + len(run.removed)


def _is_index_page(page: object) -> bool:
    return not page.is_leaf  # type: ignore[attr-defined]


#: Memory a decoded page holds on 64-bit CPython 3.11 (RSS growth over 1,000 decoded 32 KiB pages,
#: sims/README.md, "Page cache memory"). A leaf entry: its 16-byte ``bytes`` key (64 bytes as
#: allocated), its int value (up to 48), two list slots and its share of the lookup dict the first
#: lookup builds; 125-158 bytes measured. An index entry: its key, three ints, four list slots and
#: the weak reference to its decoded child; 275 measured.
LEAF_ENTRY_MEMORY = 160
INDEX_ENTRY_MEMORY = 280
PAGE_MEMORY = 512  #: a page's object and its lists' headers


def page_memory(page: Any) -> int:
    """The memory a decoded page holds, estimated from its entry count: the page cache's charge
    (so ``cache_bytes`` bounds the decoded pages' memory, not their stored size)."""
    return PAGE_MEMORY + len(page) * (LEAF_ENTRY_MEMORY if page.is_leaf else INDEX_ENTRY_MEMORY)


@attrs.frozen
class IndexStats:
    """A snapshot of an index's shape, storage use and I/O counters."""

    entry_count: int
    page_count: int
    height: int
    length: int  #: bytes ever appended to the index's storage
    start_offset: int  #: truncation offset: the smallest offset of a live page
    storage_bytes: int  #: bytes the chunks still listed hold (each whole; at least length - start_offset)
    live_bytes: int  #: bytes of the pages reachable from the root
    bytes_written: int  #: bytes this handle appended to the tree (its merge worker's appends included)
    updates_written: int  #: appends this handle made
    pages_relocated: int  #: pages this handle moved to the tail for compaction
    storage_reads: int  #: page reads that went to storage
    cache_hits: int  #: page lookups served by the page cache; descents that follow an
    #: index page's references to children still decoded in memory bypass the cache and are not counted
    cache_misses: int
    value_cache_hits: int  #: lookups served by the recent-values cache
    value_cache_misses: int
    pending_keys: int = 0  #: ``AttributeIndex``: keys in its write-ahead log not yet merged into the tree
    wal_bytes: int = 0  #: ``AttributeIndex``: bytes of its write-ahead log still stored
    #: requests made so far through the index's storage (``storage_adapters.RequestCounters``), by kind
    requests: Any = None
    #: ``LOGICAL_BYTES_PER_KEY`` (16-byte key + 8-byte value) per key update this handle accepted:
    #: ``AttributeIndex``: keys of its updates and bulk loads; ``TreeIndex``: keys given to its
    #: updates and bulk loads (a segment's tree: the keys its merges moved in), its merge worker's included
    logical_bytes: int = 0
    wal_bytes_written: int = 0  #: ``AttributeIndex``: bytes this handle appended to its write-ahead log
    #: ``(wal_bytes_written + bytes_written) / logical_bytes``: bytes written per logical byte (0.0 before any)
    write_amplification: float = 0.0
    runs: int = 0  #: sorted runs beside the main tree (docs/design.md, "Sorted runs")
    run_entries: int = 0  #: entries the runs hold (``entry_count`` includes them)


def write_amplification(logical_bytes: int, bytes_written: int) -> float:
    """Bytes written per logical byte (0.0 when nothing logical was written yet)."""
    return bytes_written / logical_bytes if logical_bytes else 0.0


class TreeIndex(IndexHandle):
    """A durable map of 16-byte keys to signed 64-bit values, stored as an append-only B+tree.

    Keys may be given as 16 ``bytes``, a ``uuid.UUID`` or an ``int`` in ``[0, 2**128)``; they come
    back as ``bytes`` in unsigned byte order. Each ``update`` is one durable append. Several handles
    and processes may update one index: an update that loses the race reloads and re-applies
    itself. Reads see this handle's latest view; ``refresh()`` picks up other writers' updates.
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
    ):
        if not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise InvalidInputError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
        if isinstance(run_share, bool) or not isinstance(run_share, (int, float)) or not 0 <= run_share <= 1:
            raise InvalidInputError(f"run_share must be a number in [0, 1], got {run_share!r:.60}")
        if type(run_min_entries) is not int or run_min_entries < 0:
            raise InvalidInputError(f"run_min_entries must be an int >= 0, got {run_min_entries!r:.60}")
        self._segment = RollingSegment(storage, name, rolling_size=rolling_size, framing=TREE_FRAMING)
        # Index pages are high priority: scans of leaves never push the upper levels out. Each page
        # is charged its decoded memory, not its stored size.
        self._page_cache = (ShardedLRUCache(cache_bytes, high_priority=_is_index_page, weigh=page_memory)
                            if cache_bytes else None)
        self._values = ValueCache(value_cache_entries)
        # A lookup may run beside an update in another thread (a segment's background merge):
        # a value read from the old tree is cached only if no update landed meanwhile.
        self._cache_lock = threading.Lock()
        self._cache_epoch = 0  #: updates and adopted versions so far
        self._versions_adopted = 0  # versions written by others that the tree adopted
        self._closed = False
        self._read_only = False  # set by open(mode="r")
        self._keys_written = 0  #: key updates this handle's updates and bulk loads wrote (``logical_bytes``)
        #: keys, bytes, appends and relocated pages its merge worker wrote for it (``count_written_elsewhere``)
        self._elsewhere = (0, 0, 0, 0)
        # Another writer's version makes the recent values stale: the tree says when it adopts one.
        self._tree = BTreeIndex(self._segment, page_size=page_size, cache=self._page_cache,
                                policy=policy_for(compaction), on_external_change=self._external_change,
                                piece_size=piece_size, runs=RunPolicy(run_min_entries, float(run_share)))

    def _external_change(self) -> None:
        with self._cache_lock:
            self._cache_epoch += 1
            self._versions_adopted += 1
            self._values.clear()

    def _cache_found(self, epoch: int, state: object, keys, values) -> None:
        """Cache values read from the tree (or promote ones found in the old generation), unless
        an update landed or the tree's version changed since ``epoch`` and ``state`` were read
        (before the values were): they may be older than the tree then. Checking the version as
        well as the epoch closes the window between another writer's version being adopted and
        ``_external_change`` running: a fill read from the old version in it is refused."""
        with self._cache_lock:
            if self._cache_epoch == epoch and self._tree.state is state:
                self._values.put_many(keys, values)

    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str],
        name: str = "attributes",
        *,
        mode: str = "a",
        storage_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> "TreeIndex":
        """Open the index ``name`` at a storage URL: ``memory://``, ``file://`` or a path, ``s3://``.

        ``mode="a"`` (the default) opens the index or creates it; ``mode="r+"`` opens an existing
        index only; ``mode="r"`` opens an existing index read-only (``update`` raises
        ``InvalidInputError``). A missing index (a mistyped path, an empty directory) raises
        ``IndexNotFoundError`` in modes "r+" and "r", and a local path that is a regular file in
        every mode.

        ``options``: ``page_size`` (default 32768), ``rolling_size`` (4 MiB), ``cache_bytes``: the
        memory of decoded pages the page cache holds (256 MiB, about 1,200 leaves of 32 KiB; 0
        disables), ``value_cache_entries`` (1Mi), ``compaction`` (True:
        the bounded policy; "pravega"; False), ``piece_size`` (8 MiB: an update that writes more is
        appended in pieces of about this size, which bounds its memory; at least ``page_size``),
        ``run_share`` (0.125) and ``run_min_entries`` (2Mi): into a tree of at least
        ``run_min_entries`` entries, a batch is written as a sorted run beside the tree until the
        runs hold ``run_share`` of its entries, and only then is the tree rebuilt with them (0:
        every batch goes into the tree; docs/design.md, "Sorted runs").
        """
        return cls._open_at(url, name, mode, storage_options, options)

    # -- reading -------------------------------------------------------------------------------
    def get(self, key: object) -> int | None:
        """The value stored for ``key``, or ``None``."""
        self._check_open()
        return self._cached_get(key if type(key) is bytes and len(key) == KEY_SIZE else to_key(key))

    def get_many(self, keys: Iterable[object]) -> list[int | None]:
        """Values for ``keys`` in input order (``None`` where absent)."""
        self._check_open()
        keys = key_list(keys)
        return self._get_many_canonical(keys if all_canonical_keys(keys) else [to_key(k) for k in keys])

    def lookups(self) -> tuple[ValueCache, Callable[[bytes], int | None], Callable[[list[bytes]], list]]:
        """What a lock-free read view (``attrindex.read_view``) probes after its overlays: the recent
        values, then ``get`` of one canonical key that their young generation did not hold, and
        ``get_many`` of canonical keys. Both run beside the merge's updates, without a lock."""
        return self._values, self._get_uncached, self._get_many_canonical

    # Lock-free: a read view calls these for keys its overlays do not hold, beside the background
    # merge's updates. Only ``_cache_found`` writes the cache (under its lock).
    def _cached_get(self, key: bytes) -> int | None:
        """``get`` for a canonical key: the young generation of the recent values, else the tree."""
        values = self._values
        value = values.young.get(key, MISSING)
        if value is MISSING:
            return self._get_uncached(key)
        values.hits += 1
        return value  # type: ignore[return-value]

    def _get_uncached(self, key: bytes) -> int | None:
        """``get`` for a canonical key the young generation did not hold a moment ago: the old
        generation (promoted) or the tree (cached), each only if the tree did not change meanwhile."""
        self._check_open()
        values = self._values
        if not values.capacity:
            return self._tree.get(key)
        epoch, state = self._cache_epoch, self._tree.state  # read before the value: see _cache_found
        value, from_old = values.peek(key)
        if value is MISSING:
            value = self._tree.get(key)
        elif not from_old:
            return value  # type: ignore[return-value]  # (put into the young generation meanwhile)
        self._cache_found(epoch, state, (key,), (value,))
        return value  # type: ignore[return-value]

    def _get_many_canonical(self, canonical: list[bytes]) -> list[int | None]:
        """``get_many`` for canonical keys (lock-free, as ``_get_uncached``)."""
        self._check_open()
        if not self._values.capacity:
            return self._tree.get_many(canonical)
        adopted, epoch, state = self._versions_adopted, self._cache_epoch, self._tree.state
        cached, from_old = self._values.peek_many(canonical)
        if from_old:
            self._cache_found(epoch, state, [canonical[i] for i in from_old], [cached[i] for i in from_old])
        missing = list(compress(canonical, map(is_, cached, repeat(MISSING))))
        if not missing:
            return cached  # type: ignore[return-value]
        found = dict(zip(missing, self._tree.get_many(missing)))
        if self._versions_adopted != adopted:
            # The lookup moved to a newer version (compaction freed pages of the old one): the
            # cached values are of the old one. Answer every key from one version.
            return self._tree.get_many(canonical)
        self._cache_found(epoch, state, found.keys(), found.values())
        return list(map(found.get, canonical, cached))  # (found holds exactly the keys not cached)

    def items(self, start: object = None, stop: object = None) -> Iterator[tuple[bytes, int]]:
        """``(key, value)`` pairs with ``start <= key < stop`` in ascending key order."""
        self._check_open()
        low = None if start is None else to_key(start)
        high = None if stop is None else to_key(stop)
        return self._tree.items(low, high)

    def split_keys(self, parts: int) -> list[bytes]:
        """Up to ``parts - 1`` ascending keys cutting the stored keys into about equal ranges
        (for scanning in parallel); reads only a few upper pages."""
        self._check_open()
        if type(parts) is not int or not 0 <= parts <= MAX_SPLIT_PARTS:
            raise InvalidInputError(f"parts must be an int in [0, {MAX_SPLIT_PARTS}], got {parts!r:.60}")
        return self._tree.split_keys(parts)

    def __len__(self) -> int:
        self._check_open()
        return self._tree.count()

    def count(self, version=None) -> int | None:
        """The keys present in ``version`` (one of ``self.version``; the current one by
        default), or ``None`` if another writer's compaction freed pages of that version since
        (it is no longer current: count again). Reads storage only for a version with sorted
        runs (their keys are looked up in the main tree)."""
        if version is None:
            return self._tree.count()
        try:
            return self._tree.count(version)
        except OffsetOutOfRangeError:
            return None

    def __contains__(self, key: object) -> bool:
        self._check_open()
        return self.get(key) is not None

    # -- writing -------------------------------------------------------------------------------
    def update(self, updates: Mapping[object, int | None] | Iterable[tuple[object, int | None]], *,
               checkpoint: int | None = None) -> bool:
        """Apply ``key -> value`` updates (``None`` removes) as one durable append; return whether it was.

        Within one call the last value given for a key wins. Invalid keys or values raise before
        anything changes. ``checkpoint`` (an int >= 0) is stored with the update, as the position
        in some other log that the index now covers (segments use it): it only moves forward, so
        an update whose checkpoint the index already covers is skipped and returns False.
        """
        self._check_writable()
        if checkpoint is not None and (type(checkpoint) is not int or not 0 <= checkpoint <= VALUE_MAX):
            raise InvalidInputError(f"checkpoint must be an int >= 0, got {checkpoint!r}")
        batch = canonical_batch(updates)
        if not batch and checkpoint is None:
            return False
        keys = sorted(batch)
        return self.update_sorted(keys, list(map(batch.__getitem__, keys)), checkpoint=checkpoint)

    def update_sorted(self, keys: list[bytes], values: list[int | None], *, checkpoint: int | None = None,
                      base: int | None = None) -> bool:
        """``update`` for input already canonical: ``keys`` 16-byte ``bytes``, sorted and unique,
        ``values`` int64 or ``None``. Not checked (segments merge their checked tier 1 this way).
        ``base``: see ``BTreeIndex.update`` (``TreeMovedError``)."""
        self._check_writable()
        written = self._tree.update(keys, values, checkpoint, base)

        def cache() -> None:
            if len(keys) <= _CACHE_UPDATES_UP_TO:
                self._values.put_many(keys, values)
            else:  # a bulk load: refresh what is cached, do not flood the recent values with it
                # In steps: one dict of a 250k-key merge is a C call holding the GIL for 0.1-0.5 s
                # (the background merge's), which an update in another thread would wait out.
                for i in range(0, len(keys), _CACHE_UPDATES_UP_TO):
                    self._values.refresh_many(dict(zip(keys[i:i + _CACHE_UPDATES_UP_TO],
                                                       values[i:i + _CACHE_UPDATES_UP_TO])))
        return self._written(written, checkpoint, len(keys), cache)

    def update_columns(self, keys, values, gone, *, checkpoint: int | None = None, base: int | None = None,
                       defer_rebuild: bool = False) -> bool:
        """``update_sorted`` for a batch as numpy columns: ascending unique ``S16`` keys, int64
        values and removal flags (True: remove). Not checked (a merge of tier 1 uses it). Large
        batches keep no Python object per key; the recent values already cached are refreshed.
        ``defer_rebuild``: a merge someone waits for, which writes a sorted run rather than rebuild
        the tree while the runs hold up to twice their share (docs/design.md, "Sorted runs")."""
        self._check_writable()
        written = self._tree.update_columns(keys, values, gone, checkpoint, base, defer_rebuild)
        return self._written(written, checkpoint, len(keys), lambda: self._values.refresh_columns(keys, values, gone))

    def _written(self, written, checkpoint: int | None, keys: int, cache: Callable[[], None]) -> bool:
        """After an update of ``keys`` keys wrote version ``written``: False if ``checkpoint`` was
        covered already (nothing written); else count it and bring the recent values up to date
        (``cache()``), unless another thread adopted a newer version meanwhile (a segment catching
        up beside its merge): that one may hold newer values of these keys than the batch, so
        caching the batch would answer older values than the tree, and the cache is dropped."""
        if checkpoint is not None and written.footer.checkpoint != checkpoint:
            return False
        with self._cache_lock:
            self._keys_written += keys
            self._cache_epoch += 1
            if self._tree.state.footer_offset != written.footer_offset:
                self._values.clear()
            else:
                cache()
        return True

    def bulk_load(self, pairs: Mapping[object, int | None] | Iterable[tuple[object, int | None]], *,
                  checkpoint: int | None = None, progress: Callable[[int, int], None] | None = None,
                  spill_bytes: int = DEFAULT_SPILL_BYTES) -> int:
        """Load ``(key, value)`` pairs, in any order, as a fresh B+tree written in ONE durable update;
        return the number of entries the index holds afterwards.

        The tree is built bottom-up (full leaves, then index pages, then the footer) in one pass
        over the sorted pairs; into a non-empty index the stored entries are merged in and the
        whole tree is written afresh (the old pages become dead and their chunks are deleted).
        Every pair is checked before anything is written (``InvalidInputError`` otherwise); the
        last pair for a key wins; ``None`` removes the key. ``checkpoint`` as in ``update`` (an
        index that covers it already is left as it is). ``progress(done, total)`` is called in
        passes, each counting up to its total: reading the pairs (``total`` is ``len(pairs)``, 0
        if unknown), sorting them (unsorted input only) and building the tree (entries). Sorted
        input is streamed into compact columns (about 24 bytes a pair); unsorted input is sorted
        in memory; past ``spill_bytes`` (256 MiB) of pairs held, sorted runs are spilled to
        temporary files (``TMPDIR``) and merged back, so memory does not grow with the input.
        """
        self._check_writable()
        given = isinstance(pairs, (SortedRun, SpilledRuns))  # read and checked by the caller, who closes it
        run = pairs if given else read_pairs(pairs, progress, spill_bytes=spill_bytes)
        try:
            covered = checkpoint is not None and checkpoint <= self._tree.state.footer.checkpoint
            entries = self._tree.bulk_load(run, checkpoint=checkpoint, progress=progress)
            if not covered:
                with self._cache_lock:
                    self._keys_written += pair_count(run)
            return entries
        finally:
            if not given:
                run.close()  # the sorted runs spilled to temporary files, if any
            # The recent values may hold values the load replaced (also after a failure: a settled lost
            # acknowledgement may have loaded them): drop it, as when another writer's version
            # is adopted.
            self._external_change()

    def bulk_load_columns(self, chunks: Iterable[tuple[object, object]], *, checkpoint: int | None = None,
                          progress: Callable[[int, int], None] | None = None,
                          spill_bytes: int = DEFAULT_SPILL_BYTES) -> int:
        """``bulk_load`` for input given as columns: an iterable of ``(keys, values)`` chunks, each
        checked as a whole, without a Python object per pair. Keys: a numpy array of ``S16``, of
        ``uint8`` shaped ``(n, 16)`` or of ``uint64`` shaped ``(n, 2)`` (big-endian words, high
        first), a pyarrow ``fixed_size_binary(16)`` array, or ``bytes`` of 16 per key; values:
        integers that fit int64 (numpy, pyarrow or a sequence), no nulls: columns remove nothing.
        Chunks in ascending key order are streamed; others are sorted as ``bulk_load`` sorts (the
        last value for a key wins). Returns the number of entries afterwards."""
        self._check_writable()
        run = read_columns(chunks, progress, spill_bytes=spill_bytes)  # every chunk checked first
        try:
            return self.bulk_load(run, checkpoint=checkpoint, progress=progress)
        finally:
            run.close()

    @property
    def version(self):
        """The tree version this handle reads now (its footer and the footer's offset): two reads
        that see the same ``footer_offset`` read the same tree."""
        return self._tree.state

    def get_many_uncached(self, keys: list[bytes]) -> list[int | None]:
        """Values of sorted canonical ``keys`` read from the B+tree's pages of one version, never
        through the recent-values cache (which a merge refreshes only after its version became
        current: in between it answers the previous version's values)."""
        return self._tree.get_many(keys)

    @property
    def checkpoint(self) -> int | None:
        """The checkpoint stored by the last update that gave one (``None`` if none ever did)."""
        self._check_open()
        checkpoint = self._tree.state.footer.checkpoint
        return None if checkpoint < 0 else checkpoint

    def refresh(self) -> None:
        """Pick up updates made by other handles or processes (the version seen never goes back).

        Raises ``CorruptDataError`` if the newest footer is damaged: see ``verify`` and ``repair``."""
        self._check_open()
        self._tree.reload()

    def count_written_elsewhere(self, keys: int, bytes_written: int, updates_written: int,
                                pages_relocated: int) -> None:
        """Count in ``stats()`` what another process wrote to this tree for this handle (its merge
        worker, ``attrindex.merge_worker``): ``keys`` key updates in ``updates_written`` appends of
        ``bytes_written`` bytes, ``pages_relocated`` pages moved for compaction."""
        with self._cache_lock:
            k, b, u, r = self._elsewhere
            self._elsewhere = (k + keys, b + bytes_written, u + updates_written, r + pages_relocated)

    # -- inspection ----------------------------------------------------------------------------
    def stats(self) -> IndexStats:
        """Counts, storage use and I/O counters of this handle; ``logical_bytes``,
        ``bytes_written`` and ``write_amplification`` include what its merge worker wrote for it.
        Cheap: nothing is read from storage."""
        self._check_open()
        state, io = self._tree.state, self._tree.io
        footer = state.footer
        cache = self._page_cache
        with self._cache_lock:
            keys, elsewhere_bytes, elsewhere_updates, elsewhere_relocated = self._elsewhere
            keys += self._keys_written
        logical = keys * LOGICAL_BYTES_PER_KEY
        written = io.bytes_written + elsewhere_bytes
        return IndexStats(
            entry_count=footer.entry_count,
            page_count=footer.page_count,
            height=state.main.height,
            length=state.length,
            start_offset=footer.min_offset if state.footer_offset >= 0 else state.length,
            storage_bytes=sum(c.stored for c in self._segment.chunks()),  # whole chunks, holes excluded
            live_bytes=footer.live_bytes,
            bytes_written=written,
            updates_written=io.updates_written + elsewhere_updates,
            pages_relocated=io.pages_relocated + elsewhere_relocated,
            storage_reads=io.storage_reads,
            cache_hits=cache.hits if cache else 0,
            cache_misses=cache.misses if cache else 0,
            value_cache_hits=self._values.hits,
            value_cache_misses=self._values.misses,
            requests=self._segment.storage.requests,
            logical_bytes=logical,
            write_amplification=write_amplification(logical, written),
            runs=len(state.forest.runs) if state.forest is not None else 0,
            run_entries=state.forest.run_entries if state.forest is not None else 0,
        )

    def verify(self, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Read every committed byte of the index and report every damaged range.

        Checks the chain of updates from the tail footer back to the truncation offset (each footer
        decodes, each update's pages pass their checksums) and every live page of the newest version
        (checksum, key order, routing, depth, subtree minimum offsets, footer counts). Damage is
        collected in ``report.damage`` (``report.ok`` when there is none), not raised.
        ``progress(pages_done, pages_total)`` is called as live pages are checked.
        """
        self._check_open()
        return verify_index(self._segment, progress)

    @classmethod
    def verify_at(cls, storage: str | os.PathLike[str] | ChunkStorage, name: str = "attributes", *,
                  storage_options: Mapping[str, Any] | None = None,
                  progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """``verify`` for the index ``name`` at a storage URL or ``ChunkStorage``, without opening
        it: works on an index that refuses to open (a damaged newest footer)."""
        with RollingSegment(index_storage(storage, storage_options, name), name, framing=TREE_FRAMING) as segment:
            return verify_index(segment, progress)

    def repair(self) -> IndexRepairReport:
        """Roll back to the newest version whose footer and every live page verify.

        The kept version's footer is appended again so it becomes the tail; the report says what
        was lost (updates dropped, byte range, entry counts) and is logged at WARNING. If no intact
        version remains, ``CorruptDataError``: rebuild the index from its source. Stop other
        writers first.
        """
        self._check_writable()
        report = repair_index(self._segment)
        self._tree.reload()
        return report

    @classmethod
    def repair_at(cls, storage: str | os.PathLike[str] | ChunkStorage, name: str = "attributes", *,
                  storage_options: Mapping[str, Any] | None = None) -> IndexRepairReport:
        """``repair`` for the index ``name`` at a storage URL or ``ChunkStorage``, without opening it."""
        with RollingSegment(index_storage(storage, storage_options, name), name, framing=TREE_FRAMING) as segment:
            return repair_index(segment)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Release the handle (every update is already durable); every later call but ``close``
        raises ``InvalidInputError``."""
        self._closed = True
        self._segment.close()

    def _location(self) -> tuple[str, str]:
        return self._segment.name, self._segment.storage.url
