"""A sharded, byte-charged LRU cache of decoded pages: the B+tree's page cache.

Modelled on LevelDB's ``ShardedLRUCache`` (``util/cache.cc``), in idiomatic Python: there is no
pinning or reference counting, because a caller's Python reference keeps a value alive after it has
been evicted. Keys are the pages' integer storage offsets; every entry carries a *charge* (its size
in bytes) and each shard evicts least-recently-used entries while its charge exceeds its capacity.
The charge is what the caller passes, or what the cache's ``weigh`` function says of the value (the
B+tree's: the decoded page's memory, ``tree_index.page_memory``, not its stored size).

Sharding keeps lock contention low: a key's shard comes from a multiplicative (Fibonacci) hash of the
key, since storage offsets are far from uniform in their low bits. Each shard has its own
``threading.Lock``, an ``OrderedDict`` in recency order (least recently used first) and its usage.

``get_or_load`` adds single-flight loading: concurrent misses of one key run the loader once, and the
loader runs without any lock held, so loads of different keys proceed in parallel.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from .errors import InvalidInputError

__all__ = ["ShardedLRUCache"]

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd: a bijection on 64-bit integers
_MASK64 = (1 << 64) - 1


class _Flight:
    """One in-progress load of a key, which the other callers missing that key wait on."""

    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None


class _Shard:
    """One LRU shard; every field is guarded by ``lock``.

    ``data`` maps key -> ``(value, charge)`` in recency order (least recently used first);
    ``high`` is the same for high-priority entries, which are evicted only when ``data`` is empty;
    ``inflight`` maps key -> ``_Flight`` for the keys ``get_or_load`` is loading right now.
    """

    __slots__ = ("lock", "data", "high", "inflight", "usage", "capacity", "hits", "misses")

    def __init__(self, capacity: int) -> None:
        self.lock = threading.Lock()
        self.data: OrderedDict[int, tuple[object, int]] = OrderedDict()
        self.high: OrderedDict[int, tuple[object, int]] = OrderedDict()
        self.inflight: dict[int, _Flight] = {}
        self.usage = 0
        self.capacity = capacity
        self.hits = 0
        self.misses = 0

    def put(self, key: int, value: object, charge: int, high: bool = False) -> None:
        """Store ``value`` under ``key`` and evict down to capacity; the caller holds ``lock``."""
        data = self.data
        old = data.pop(key, None) or self.high.pop(key, None)
        if old is not None:
            self.usage -= old[1]
        if charge > self.capacity or self.capacity == 0:
            # Too big to ever fit (it would evict everything else for nothing), or caching is off.
            # Any previous entry under this key is gone too: it must not outlive its replacement.
            return
        (self.high if high else data)[key] = (value, charge)
        self.usage += charge
        while self.usage > self.capacity:
            _, (_, evicted_charge) = (data or self.high).popitem(last=False)
            self.usage -= evicted_charge

    def find(self, key: int) -> tuple[object, int] | None:
        """The entry under ``key`` made most recently used, or ``None``; the caller holds ``lock``."""
        for table in (self.high, self.data):
            entry = table.get(key)
            if entry is not None:
                table.move_to_end(key)
                return entry
        return None

    def lookup(self, key: int) -> tuple[object, int] | None:
        """``find`` that counts a hit; the caller holds ``lock`` and decides what a miss counts as."""
        entry = self.find(key)
        if entry is not None:
            self.hits += 1
        return entry

    def remove(self, key: int) -> None:
        """Drop ``key`` from either pool; the caller holds ``lock``."""
        entry = self.data.pop(key, None) or self.high.pop(key, None)
        if entry is not None:
            self.usage -= entry[1]


class ShardedLRUCache:
    """A thread-safe LRU cache of int keys, charged by bytes, split into independently locked shards.

    ``capacity`` is the total charge the cache may hold, split evenly: each of the ``shards`` shards
    holds at most ``ceil(capacity / shards)``. A capacity of 0 disables caching entirely: ``get``
    always misses, ``insert`` stores nothing and ``get_or_load`` calls its loader on every call.

    ``hits`` and ``misses`` count the lookups of ``get`` and ``get_or_load``; a caller of
    ``get_or_load`` that waits for another thread's load of the same key counts as a hit, since it
    caused no storage read.

    ``high_priority(value)``, if given, marks values (for the B+tree: index pages) that are evicted
    only after every ordinary entry of their shard, like RocksDB's high-priority pool: a scan of
    leaves cannot push the upper levels of the tree out.

    ``weigh(value)``, if given, is every entry's charge (its memory in bytes), in place of the
    charge ``insert`` and ``get_or_load``'s loader pass.
    """

    __slots__ = ("_shards", "_shift", "_capacity", "_high_priority", "_weigh")

    def __init__(self, capacity: int, shards: int = 16, high_priority: Callable[[object], bool] | None = None,
                 weigh: Callable[[object], int] | None = None) -> None:
        """Create an empty cache holding at most ``capacity`` charge across ``shards`` shards.

        Raises ``InvalidInputError`` (a ``ValueError``) if ``capacity`` is not a non-negative int or
        ``shards`` is not a positive power of two.
        """
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise InvalidInputError(f"cache capacity must be a non-negative int, got {capacity!r}")
        if (
            not isinstance(shards, int)
            or isinstance(shards, bool)
            or shards <= 0
            or shards & (shards - 1)
        ):
            raise InvalidInputError(f"cache shards must be a positive power of two, got {shards!r}")
        per_shard = -(-capacity // shards)  # ceil(capacity / shards)
        self._shards = tuple(_Shard(per_shard) for _ in range(shards))
        # The shard is the top log2(shards) bits of the 64-bit product; 64 when shards == 1 (-> 0).
        self._shift = 64 - (shards.bit_length() - 1)
        self._capacity = capacity
        self._high_priority = high_priority
        self._weigh = weigh

    def _shard(self, key: int) -> _Shard:
        return self._shards[((key * _GOLDEN) & _MASK64) >> self._shift]

    def shard_of(self, key: int) -> int:
        """The number of the shard ``key`` goes to (each holds ``ceil(capacity / shards)``): for
        sizing a cache that must hold given keys."""
        return ((key * _GOLDEN) & _MASK64) >> self._shift

    @property
    def shards(self) -> int:
        """The number of shards."""
        return len(self._shards)

    def get(self, key: int) -> object | None:
        """Return the value cached under ``key`` and mark it most recently used, or ``None``."""
        shard = self._shard(key)
        with shard.lock:
            entry = shard.lookup(key)
            if entry is None:
                shard.misses += 1
                return None
            return entry[0]

    def peek(self, key: int) -> object | None:
        """The value cached under ``key``, or ``None``, counting neither a hit nor a miss and
        leaving the order alone (a merge that reads every leaf once takes what is cached)."""
        shard = self._shard(key)
        with shard.lock:
            for table in (shard.high, shard.data):
                entry = table.get(key)
                if entry is not None:
                    return entry[0]
        return None

    def insert(self, key: int, value: object, charge: int) -> None:
        """Cache ``value`` under ``key`` with ``charge`` bytes, replacing any entry with that key.

        The new entry is the most recently used; then least recently used entries of its shard are
        evicted while the shard's usage exceeds its capacity. An entry whose charge alone exceeds
        the shard's capacity is not stored (and any previous entry under ``key`` is dropped).
        Raises ``InvalidInputError`` if ``charge`` is negative.
        """
        if self._weigh is not None:
            charge = self._weigh(value)
        if charge < 0:
            raise InvalidInputError(f"cache charge must be non-negative, got {charge!r}")
        shard = self._shard(key)
        high = self._high_priority is not None and self._high_priority(value)
        with shard.lock:
            shard.put(key, value, charge, high)

    def erase(self, key: int) -> None:
        """Drop the entry under ``key``, if any.

        A ``get_or_load`` of ``key`` in progress still hands its result to the callers already
        waiting for it, but that result is not cached, and later callers start a new load.
        """
        shard = self._shard(key)
        with shard.lock:
            shard.remove(key)
            shard.inflight.pop(key, None)

    def get_or_load(self, key: int, load: Callable[..., tuple[object, int]], *args: object) -> object:
        """Return the value cached under ``key``, calling ``load()`` to produce and cache it on a miss.

        ``load(*args)`` returns ``(value, charge)`` and runs without any lock held, so loads of different
        keys run in parallel. Loading is single-flight: while one caller runs ``load`` for a key,
        other callers missing the same key wait for its result instead of loading it themselves. If
        ``load`` raises, that exception is raised to the loading caller and to every waiter, and
        nothing is cached; the next call loads again.
        """
        # Every page access that misses a page's child references comes here: the hash is inlined
        # and the lock taken with acquire()/release(), cheaper than ``with`` on CPython 3.11.
        shard = self._shards[((key * _GOLDEN) & _MASK64) >> self._shift]
        lock = shard.lock
        lock.acquire()
        try:
            entry = shard.lookup(key)
            if entry is not None:
                return entry[0]
            flight = shard.inflight.get(key)
            if flight is None:
                flight = shard.inflight[key] = _Flight()
                shard.misses += 1
                leader = True
            else:
                shard.hits += 1
                leader = False
        finally:
            lock.release()

        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.value

        try:
            value, charge = load(*args)
            if self._weigh is not None:
                charge = self._weigh(value)
            if charge < 0:
                raise InvalidInputError(f"cache charge must be non-negative, got {charge!r}")
        except BaseException as exc:
            flight.error = exc
            with shard.lock:
                if shard.inflight.get(key) is flight:
                    del shard.inflight[key]
            flight.done.set()
            raise
        high = self._high_priority is not None and self._high_priority(value)
        with shard.lock:
            # Cache the result only if no erase() or clear() detached this flight meanwhile.
            if shard.inflight.get(key) is flight:
                del shard.inflight[key]
                shard.put(key, value, charge, high)
        flight.value = value
        flight.done.set()
        return value

    def clear(self) -> None:
        """Drop every entry; loads in progress finish for their callers but are not cached."""
        for shard in self._shards:
            with shard.lock:
                shard.data.clear()
                shard.high.clear()
                shard.usage = 0
                shard.inflight.clear()

    def values(self) -> list[object]:
        """The values held now (a snapshot, in no particular order)."""
        held: list[object] = []
        for shard in self._shards:
            with shard.lock:
                held += [value for value, _charge in (*shard.high.values(), *shard.data.values())]
        return held

    @property
    def usage(self) -> int:
        """The total charge of the entries held."""
        return sum(shard.usage for shard in self._shards)

    @property
    def capacity(self) -> int:
        """The total capacity given to the constructor (each shard holds ``ceil(capacity / shards)``)."""
        return self._capacity

    @property
    def hits(self) -> int:
        """Lookups by ``get`` and ``get_or_load`` that did not read storage (waiters included)."""
        return sum(shard.hits for shard in self._shards)

    @property
    def misses(self) -> int:
        """Lookups by ``get`` that found nothing, and ``get_or_load`` calls that ran ``load``."""
        return sum(shard.misses for shard in self._shards)

    def __len__(self) -> int:
        """The number of entries held."""
        return sum(len(shard.data) + len(shard.high) for shard in self._shards)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self._capacity}, shards={len(self._shards)}, "
            f"entries={len(self)}, usage={self.usage})"
        )
