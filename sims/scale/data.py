"""The keys of a scale run: key ``i`` of ``n`` computed, never stored, so a billion of them cost nothing.

Key ``i`` is 16 bytes: its first 8 are ``i * (2**64 // n)`` (big-endian, so keys ascend with ``i``
and spread over the key space), its last 8 a 64-bit mix of ``i`` (splitmix64), so the bytes an
index shards or hashes on look random. Sorted input is ``i = 0, 1, ... n-1``; unsorted input the
permutation ``i -> (A * i + C) mod n`` (``A`` prime and not a factor of ``n``), which jumps all over the
key space from one pair to the next. Random updates and lookups draw ``i`` from a seeded numpy
generator and compute the keys the same way, so every engine gets the same keys and values.
"""

from __future__ import annotations

import struct
from typing import Iterator

import numpy as np

CHUNK = 1 << 16  #: pairs made per numpy step
_A, _C = 2_654_435_761, 40_503  #: the unsorted permutation's multiplier (a prime) and increment
_STRUCTS: dict[int, struct.Struct] = {}


def _mix(i: np.ndarray) -> np.ndarray:
    """splitmix64 of each uint64 (wrapping arithmetic)."""
    z = i + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def key_words(indexes: np.ndarray, n: int) -> np.ndarray:
    """The keys of ``indexes`` (uint64, each < ``n``) as big-endian 64-bit halves, shape ``(k, 2)``."""
    indexes = np.asarray(indexes, dtype=np.uint64)
    block = np.empty((len(indexes), 2), dtype=">u8")
    with np.errstate(over="ignore"):
        block[:, 0] = indexes * np.uint64((1 << 64) // n)
        block[:, 1] = _mix(indexes)
    return block


def keys_of(indexes: np.ndarray, n: int) -> list[bytes]:
    """The keys of ``indexes`` (uint64, each < ``n``) as 16-byte ``bytes``."""
    block = key_words(indexes, n)
    count = len(block)
    unpack = _STRUCTS.get(count)
    if unpack is None:
        unpack = _STRUCTS[count] = struct.Struct("16s" * count)
    return list(unpack.unpack(block.tobytes()))


def order_of(n: int, start: int, stop: int, sorted_input: bool) -> np.ndarray:
    """Indexes ``start..stop`` of the input order (the identity, or the unsorted permutation)."""
    positions = np.arange(start, stop, dtype=np.uint64)
    if sorted_input:
        return positions
    if n % _A == 0:
        raise ValueError(f"n={n} is a multiple of the permutation's prime {_A}")
    with np.errstate(over="ignore"):
        # A * i < 2**64 for i < 6.9e9: exact, no wrap.
        return (positions * np.uint64(_A) + np.uint64(_C)) % np.uint64(n)


def pairs(n: int, sorted_input: bool = True, chunk: int = CHUNK) -> Iterator[tuple[bytes, int]]:
    """``(key, value)`` for every key of ``n``, value ``i``: streamed, about 100 bytes of Python
    objects per pair in flight (one chunk), nothing else held."""
    for start in range(0, n, chunk):
        indexes = order_of(n, start, min(start + chunk, n), sorted_input)
        yield from zip(keys_of(indexes, n), indexes.astype(np.int64).tolist())


def columns(n: int, sorted_input: bool = True, chunk: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The same pairs as ``pairs`` as ``(keys, values)`` chunks of columns (``S16`` keys, int64
    values), for ``bulk_load_columns``: no Python object per pair."""
    for start in range(0, n, chunk):
        indexes = order_of(n, start, min(start + chunk, n), sorted_input)
        yield key_words(indexes, n).view("S16").reshape(-1), indexes.astype(np.int64)


def random_indexes(seed: int, n: int, count: int) -> np.ndarray:
    """``count`` uniformly random key indexes of ``n`` (with repeats), from ``seed``."""
    return np.random.default_rng(seed).integers(0, n, size=count, dtype=np.uint64)


def update_batches(seed: int, n: int, calls: int, batch: int) -> Iterator[list[tuple[bytes, int]]]:
    """``calls`` lists of ``batch`` random existing keys with new values (the same for every engine)."""
    rng = np.random.default_rng(seed)
    for _ in range(calls):
        indexes = rng.integers(0, n, size=batch, dtype=np.uint64)
        values = rng.integers(0, 1 << 40, size=batch, dtype=np.int64).tolist()
        yield list(zip(keys_of(indexes, n), values))
