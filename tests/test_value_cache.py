"""Tier 1: the two-generation recent-values cache."""

from __future__ import annotations

import pytest

from attrindex.value_cache import MISSING, ValueCache


def test_hits_misses_and_known_absence():
    cache = ValueCache(10)
    assert cache.get(b"a") is MISSING
    cache.put(b"a", 1)
    cache.put(b"b", None)  # known absent is cached too, and is not a miss
    assert (cache.get(b"a"), cache.get(b"b")) == (1, None)
    assert (cache.hits, cache.misses) == (2, 1)


def test_generations_bound_the_size_and_keep_what_was_used():
    cache = ValueCache(4)
    for i in range(4):
        cache.put(bytes([i]), i)  # the 4th put turns the young generation into the old one
    assert cache.get(bytes([0])) == 0  # promoted from the old generation
    for i in range(4, 8):
        cache.put(bytes([i]), i)
    assert cache.get(bytes([0])) == 0  # used since the last turnover, so it survived
    assert cache.get(bytes([1])) is MISSING  # not used: dropped with its generation
    assert len(cache) <= 2 * cache.capacity


def test_refresh_many_updates_cached_keys_only():
    cache = ValueCache(100)
    cache.put(b"a", 1)
    cache.put(b"b", 2)
    cache.refresh_many({b"a": 10, b"b": None, b"c": 3})
    assert (cache.get(b"a"), cache.get(b"b"), cache.get(b"c")) == (10, None, MISSING)


def test_zero_capacity_caches_nothing():
    cache = ValueCache(0)
    cache.put(b"a", 1)
    assert cache.get(b"a") is MISSING and len(cache) == 0
    with pytest.raises(ValueError):
        ValueCache(-1)
