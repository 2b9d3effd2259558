"""Tests of ``attrindex.cache.ShardedLRUCache``, in the spirit of LevelDB's ``util/cache_test.cc``.

LevelDB's tests use a capacity of 1000; so do these. Values are fresh objects so that identity
(``is``) checks prove which insert a lookup returned. The model test compares one shard against a
plain list kept in recency order; the threaded tests check single-flight loading and that loads run
without the shard lock held.
"""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attrindex.cache import ShardedLRUCache

CACHE_SIZE = 1000


def shard_usages(cache: ShardedLRUCache) -> list[tuple[int, int]]:
    """``(usage, sum of charges held)`` of every shard, read from the internals."""
    return [(shard.usage, sum(charge for _, charge in shard.data.values())) for shard in cache._shards]


# --- LevelDB's cache_test.cc, adapted -------------------------------------------------------------


def test_hit_and_miss():
    cache = ShardedLRUCache(CACHE_SIZE)
    assert cache.get(100) is None

    v101 = object()
    cache.insert(100, v101, 1)
    assert cache.get(100) is v101
    assert cache.get(200) is None
    assert cache.get(300) is None

    v201 = object()
    cache.insert(200, v201, 1)
    assert cache.get(100) is v101
    assert cache.get(200) is v201
    assert cache.get(300) is None
    assert (len(cache), cache.usage) == (2, 2)

    # Overwriting a key replaces the value and its charge (not added on top of the old one).
    v102 = object()
    cache.insert(100, v102, 7)
    assert cache.get(100) is v102
    assert cache.get(200) is v201
    assert cache.get(300) is None
    assert (len(cache), cache.usage) == (2, 8)
    cache.insert(100, v102, 3)
    assert (len(cache), cache.usage) == (2, 4)

    # Hits: 100, 100, 200, 100, 200; misses: 100 (empty), 200, 300, 300, 300.
    assert (cache.hits, cache.misses) == (5, 5)


def test_erase():
    cache = ShardedLRUCache(CACHE_SIZE)
    cache.erase(200)  # missing key: no-op
    assert (len(cache), cache.usage) == (0, 0)

    v101, v201 = object(), object()
    cache.insert(100, v101, 5)
    cache.insert(200, v201, 3)
    cache.erase(100)
    assert cache.get(100) is None
    assert cache.get(200) is v201
    assert (len(cache), cache.usage) == (1, 3)

    cache.erase(100)  # erasing twice is a no-op
    assert cache.get(100) is None
    assert cache.get(200) is v201
    assert (len(cache), cache.usage) == (1, 3)


@pytest.mark.parametrize("shards", [1, 16])
def test_eviction_policy(shards):
    cache = ShardedLRUCache(CACHE_SIZE, shards=shards)
    hot, idle = object(), object()
    cache.insert(100, hot, 1)
    cache.insert(200, idle, 1)

    # Frequently used entry must be kept around, the idle one must be evicted.
    for i in range(3 * CACHE_SIZE):
        cache.insert(1000 + i, object(), 1)
        assert cache.get(100) is hot
    assert cache.get(200) is None
    assert cache.usage <= -(-CACHE_SIZE // shards) * shards  # 1008 with 16 shards of 63
    # The most recent inserts survive; the oldest ones were evicted.
    assert cache.get(1000 + 3 * CACHE_SIZE - 1) is not None
    assert cache.get(1000) is None


@pytest.mark.parametrize("shards", [1, 4, 8, 16])
def test_heavy_entries(shards):
    # Add a bunch of light and heavy entries and then count the combined size of items still in
    # the cache, which must be at most the capacity (and each shard at most its own capacity).
    # 16 shards do not divide 1000: each holds ceil(1000 / 16) = 63, the case LevelDB allows for.
    cache = ShardedLRUCache(CACHE_SIZE, shards=shards)
    shard_capacity = -(-CACHE_SIZE // shards)
    light, heavy = 1, 10
    inserted = {}
    added, index = 0, 0
    while added < 2 * CACHE_SIZE:
        weight = light if index & 1 else heavy
        value = (index, object())
        cache.insert(index, value, weight)
        inserted[index] = (value, weight)
        added += weight
        index += 1

    cached_weight = 0
    cached_count = 0
    for key, (value, weight) in inserted.items():
        found = cache.get(key)
        if found is not None:
            assert found is value
            cached_weight += weight
            cached_count += 1
    # Each shard holds ceil(capacity / shards), so the total may round up by at most shards - 1.
    assert cached_weight <= shard_capacity * shards < CACHE_SIZE + shards
    if CACHE_SIZE % shards == 0:
        assert cached_weight <= CACHE_SIZE
    assert cached_weight == cache.usage
    assert cached_count == len(cache)
    # Eviction keeps the cache full, not just small: it sheds at most one heavy entry per shard.
    assert cached_weight > CACHE_SIZE - shards * heavy
    for usage, charge_sum in shard_usages(cache):
        assert usage == charge_sum
        assert usage <= shard_capacity


def test_zero_size_cache():
    cache = ShardedLRUCache(0)
    cache.insert(100, object(), 1)
    cache.insert(200, object(), 0)  # even a zero charge is not stored
    assert cache.get(100) is None
    assert cache.get(200) is None
    assert (len(cache), cache.usage, cache.capacity) == (0, 0, 0)

    calls = []

    def load():
        calls.append(None)
        return object(), 1

    values = [cache.get_or_load(300, load) for _ in range(3)]
    assert len(calls) == 3
    assert len({id(v) for v in values}) == 3  # a fresh load each time, nothing cached
    assert len(cache) == 0
    assert (cache.hits, cache.misses) == (0, 5)


def test_oversized_entry_is_not_stored():
    cache = ShardedLRUCache(CACHE_SIZE, shards=4)  # 250 per shard
    small = {key: object() for key in range(10)}
    for key, value in small.items():
        cache.insert(key, value, 20)
    before = cache.usage

    cache.insert(500, object(), 251)
    assert cache.get(500) is None
    assert cache.usage == before  # nothing was evicted to make room for it
    assert all(cache.get(key) is value for key, value in small.items())

    exact = object()
    cache.insert(501, exact, 250)  # exactly the shard capacity fits
    assert cache.get(501) is exact
    assert cache.usage <= CACHE_SIZE

    # Replacing an entry by an oversized value drops the old value rather than keeping it stale.
    cache.insert(0, object(), 251)
    assert cache.get(0) is None


def test_oversized_load_is_returned_but_not_cached():
    cache = ShardedLRUCache(CACHE_SIZE, shards=1)
    big = object()
    assert cache.get_or_load(7, lambda: (big, CACHE_SIZE + 1)) is big
    assert cache.get(7) is None
    assert (len(cache), cache.usage) == (0, 0)


def test_clear():
    cache = ShardedLRUCache(CACHE_SIZE)
    for key in range(50):
        cache.insert(key * 4096, object(), 10)
    assert (len(cache), cache.usage) == (50, 500)
    cache.clear()
    assert (len(cache), cache.usage) == (0, 0)
    assert all(cache.get(key * 4096) is None for key in range(50))
    v = object()
    cache.insert(4096, v, 10)  # still usable, accounting restarted from zero
    assert cache.get(4096) is v
    assert cache.usage == 10


def test_shard_capacity_is_ceil_and_offsets_spread_over_shards():
    cache = ShardedLRUCache(1001, shards=16)
    assert cache.capacity == 1001
    assert {shard.capacity for shard in cache._shards} == {63}  # ceil(1001 / 16)
    # Page offsets are multiples of a page size: their low bits are all zero, yet they must spread.
    for key in range(256):
        cache.insert(key * 4096, object(), 1)
    counts = [len(shard.data) for shard in cache._shards]
    assert sum(counts) == 256
    assert min(counts) >= 4, counts


@pytest.mark.parametrize(
    ("capacity", "shards"),
    [(-1, 16), (1000, 0), (1000, -4), (1000, 3), (1000, 12), (1000, 2.0), (1.5, 16), ("1000", 16)],
)
def test_bad_constructor_arguments(capacity, shards):
    with pytest.raises(ValueError, match="capacity|shards"):
        ShardedLRUCache(capacity, shards=shards)


def test_good_constructor_arguments():
    for shards in (1, 2, 64):
        cache = ShardedLRUCache(0, shards=shards)
        assert (cache.capacity, len(cache), cache.usage) == (0, 0, 0)


def test_negative_charge_rejected():
    cache = ShardedLRUCache(CACHE_SIZE)
    with pytest.raises(ValueError, match="charge"):
        cache.insert(1, object(), -1)
    assert len(cache) == 0


# --- Model test: one shard against a list in recency order ----------------------------------------

MODEL_CAPACITY = 20
KEYS = st.integers(min_value=0, max_value=9)
OPS = st.one_of(
    st.tuples(st.just("insert"), KEYS, st.integers(min_value=0, max_value=MODEL_CAPACITY + 3)),
    st.tuples(st.just("get"), KEYS),
    st.tuples(st.just("erase"), KEYS),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OPS, max_size=60))
def test_model_single_shard(ops):
    cache = ShardedLRUCache(MODEL_CAPACITY, shards=1)
    model: list[list] = []  # [key, value, charge], least recently used first
    hits = misses = 0

    def find(key):
        return next((i for i, entry in enumerate(model) if entry[0] == key), None)

    for serial, op in enumerate(ops):
        if op[0] == "insert":
            _, key, charge = op
            value = (key, serial)
            cache.insert(key, value, charge)
            i = find(key)
            if i is not None:
                del model[i]
            if charge <= MODEL_CAPACITY:
                model.append([key, value, charge])
                while sum(entry[2] for entry in model) > MODEL_CAPACITY:
                    del model[0]
        elif op[0] == "get":
            key = op[1]
            i = find(key)
            if i is None:
                assert cache.get(key) is None
                misses += 1
            else:
                entry = model.pop(i)
                model.append(entry)
                assert cache.get(key) is entry[1]
                hits += 1
        else:
            key = op[1]
            cache.erase(key)
            i = find(key)
            if i is not None:
                del model[i]

        # Contents, usage and counters after every step.
        assert len(cache) == len(model)
        assert cache.usage == sum(entry[2] for entry in model)
        assert (cache.hits, cache.misses) == (hits, misses)
        # Recency order, exactly as the model keeps it (this is what decides the next eviction).
        assert [(k, v, c) for k, (v, c) in cache._shards[0].data.items()] == [tuple(e) for e in model]

    # Final check through the public API: looking every entry up from least to most recently used
    # finds each value and leaves the recency order unchanged; absent keys miss.
    for key, value, _ in model:
        assert cache.get(key) is value
    present = {entry[0] for entry in model}
    for key in range(10):
        if key not in present:
            assert cache.get(key) is None
    assert list(cache._shards[0].data) == [entry[0] for entry in model]


# --- Concurrency: single flight and parallel loads ------------------------------------------------

N_THREADS = 8
LOAD_SECONDS = 0.05


def run_threads(n, target):
    """Run ``target()`` in ``n`` threads released together; return each one's result or exception."""
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def worker(i):
        barrier.wait()
        try:
            results[i] = ("ok", target())
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results[i] = ("raised", exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive(), "a get_or_load caller was left hanging"
    return results


def slow_loader(cache, calls, result):
    """A load that waits until the other callers have joined its flight, sleeps, then returns/raises.

    Waiting for the joins (they count as hits) makes the tests deterministic: without single-flight
    the other threads would be loading too, and the join never happens within the deadline.
    """
    lock = threading.Lock()

    def load():
        with lock:
            calls.append(threading.get_ident())
        deadline = time.monotonic() + 2
        while cache.hits < N_THREADS - 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(LOAD_SECONDS)
        if isinstance(result, BaseException):
            raise result
        return result, 10

    return load


def test_single_flight_load():
    cache = ShardedLRUCache(CACHE_SIZE)
    calls: list = []
    page = object()
    load = slow_loader(cache, calls, page)

    results = run_threads(N_THREADS, lambda: cache.get_or_load(4096, load))

    assert len(calls) == 1
    assert all(status == "ok" and value is page for status, value in results)
    assert (cache.hits, cache.misses) == (N_THREADS - 1, 1)
    assert cache.get(4096) is page
    assert cache.usage == 10
    assert not any(shard.inflight for shard in cache._shards)


def test_single_flight_failure_propagates_to_all_and_caches_nothing():
    cache = ShardedLRUCache(CACHE_SIZE)
    calls: list = []
    error = OSError("storage read failed")
    load = slow_loader(cache, calls, error)

    results = run_threads(N_THREADS, lambda: cache.get_or_load(4096, load))

    assert len(calls) == 1
    assert all(status == "raised" and exc is error for status, exc in results)
    assert (len(cache), cache.usage) == (0, 0)
    assert cache.get(4096) is None
    assert not any(shard.inflight for shard in cache._shards)

    # A later call loads again, and this time the result is cached.
    page = object()
    assert cache.get_or_load(4096, lambda: (page, 10)) is page
    assert cache.get_or_load(4096, lambda: pytest.fail("should have been a hit")) is page
    assert cache.usage == 10


def test_different_keys_load_in_parallel():
    # One shard: if load ran under the shard lock, the two loads would be serialized. Each load
    # waits until both have started, so serialized loads could never both finish: the first
    # would time out waiting for the second (no clock in the verdict, only a generous bound).
    cache = ShardedLRUCache(CACHE_SIZE, shards=1)
    keys = iter([4096, 8192])
    key_lock = threading.Lock()
    both_loading = threading.Barrier(2)

    def fetch():
        with key_lock:
            key = next(keys)

        def load():
            both_loading.wait(timeout=30)  # BrokenBarrierError if the other load cannot start
            return ("page", key), 10

        return cache.get_or_load(key, load)

    results = run_threads(2, fetch)

    assert sorted(value for _, value in results) == [("page", 4096), ("page", 8192)], results
    assert (len(cache), cache.misses) == (2, 2)


def test_hit_served_while_another_key_loads():
    cache = ShardedLRUCache(CACHE_SIZE, shards=1)
    cached = object()
    cache.insert(1, cached, 1)
    loading = threading.Event()
    release = threading.Event()

    def load():
        loading.set()
        assert release.wait(timeout=5)
        return object(), 1

    loader = threading.Thread(target=cache.get_or_load, args=(2, load))
    loader.start()
    try:
        assert loading.wait(timeout=5)
        assert cache.get(1) is cached  # would deadlock if load held the shard lock
        cache.insert(3, object(), 1)
    finally:
        release.set()
        loader.join(timeout=5)
    assert len(cache) == 3


def test_erase_during_load_does_not_cache_the_result():
    cache = ShardedLRUCache(CACHE_SIZE)
    loading = threading.Event()
    release = threading.Event()
    first = object()
    got = []

    def load():
        loading.set()
        assert release.wait(timeout=5)
        return first, 1

    loader = threading.Thread(target=lambda: got.append(cache.get_or_load(9, load)))
    loader.start()
    try:
        assert loading.wait(timeout=5)
        cache.erase(9)  # the page was invalidated while being read
    finally:
        release.set()
        loader.join(timeout=5)
    assert got == [first]  # the caller still gets its value ...
    assert cache.get(9) is None  # ... but it is not cached
    second = object()
    assert cache.get_or_load(9, lambda: (second, 1)) is second


def test_high_priority_entries_outlive_any_flood_of_ordinary_ones():
    cache = ShardedLRUCache(1000, shards=1, high_priority=lambda value: value.startswith("index"))
    for i in range(5):
        cache.insert(i, f"index-{i}", 100)
    for i in range(100, 400):  # a scan of "leaves", far beyond capacity
        cache.insert(i, f"leaf-{i}", 100)
        assert cache.usage <= 1000
    assert [cache.get(i) for i in range(5)] == [f"index-{i}" for i in range(5)]
    assert sum(cache.get(i) is not None for i in range(100, 400)) == 5  # the leaves share what is left
    # High-priority entries go only once no ordinary entry is left, oldest first.
    for i in range(5, 11):
        cache.insert(i, f"index-{i}", 100)
    assert cache.get(0) is None and cache.get(1) is not None
    assert all(cache.get(i) is None for i in range(100, 400))
    cache.erase(3)
    assert cache.get(3) is None and cache.usage == 900 and len(cache) == 9


def test_get_or_load_applies_the_priority_to_loaded_values():
    cache = ShardedLRUCache(300, shards=1, high_priority=lambda value: value == "index")
    cache.get_or_load(1, lambda: ("index", 100))
    for i in range(10, 20):
        cache.get_or_load(i, lambda: ("leaf", 100))
    assert cache.get(1) == "index"


def test_weigh_sets_every_charge_whatever_the_caller_passes():
    cache = ShardedLRUCache(1000, shards=1, weigh=len)  # a value's charge: its length
    cache.insert(1, "x" * 300, 1)
    cache.get_or_load(2, lambda: ("y" * 500, 1))
    assert cache.usage == 800 and len(cache) == 2
    cache.insert(3, "z" * 400, 1)  # over capacity by its weight (not by the 1 passed): the oldest goes
    assert cache.get(1) is None and cache.usage == 900
    cache.insert(4, "w" * 1001, 0)  # heavier than the whole shard: not stored
    assert cache.get(4) is None and cache.usage == 900


def test_values_and_shard_of_say_what_is_held_where():
    cache = ShardedLRUCache(16 * 1000, shards=16)
    assert cache.shards == 16 and cache.values() == []
    values = {key * 4096: object() for key in range(64)}
    for key, value in values.items():
        cache.insert(key, value, 10)
    assert sorted(map(id, cache.values())) == sorted(map(id, values.values()))
    for number, shard in enumerate(cache._shards):
        assert all(cache.shard_of(key) == number for key in shard.data)
    assert {cache.shard_of(key) for key in values} == {n for n, shard in enumerate(cache._shards) if shard.data}
