"""A Bloom filter over 16-byte keys: which keys a sorted run may hold (no I/O).

``build_filter`` makes a ``KeyFilter`` from a run's keys (a numpy ``S16`` array, in blocks of
``BLOCK_KEYS`` so that the memory taken is the bit array and one block); ``may_contain`` answers
for one key in pure Python (a point lookup's path) and ``may_contain_many`` for an array of keys,
both with the same answer for every key: ``False`` means the key is not in the set, ``True`` that
it may be. ``encode`` gives the filter's body and ``decode_filter`` reads one back, checked.

The hash
--------
The bits a key sets are part of the stored format: a filter decoded anywhere must probe the same
bits as the one that was built. A key is read as two unsigned 64-bit words, ``a`` from its bytes
0-7 and ``b`` from its bytes 8-15, both little-endian. With ``M = 2**64`` and the finaliser
``mix(z)`` (all arithmetic modulo ``M``)::

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)

the key's hash is ``h = mix(mix(a ^ 0x9E3779B97F4A7C15) ^ b)``: each word is mixed whole, so
keys that are sequential integers or share a long prefix spread over the whole bit array. Probe
``i`` (``0 <= i < hashes``) tests bit ``(h mod bits + i * d) mod bits`` of the bit array, where
``d = ((h >> 32) | 1) mod bits``. ``d`` is odd and ``bits`` a multiple of 64, so the probes of a
key come back to its first only after ``bits / gcd(d, bits) >= 64`` steps: its 16 or fewer probes
are distinct bits.

The body
--------
``encode`` returns ``16 + bits / 8`` bytes, all integers little-endian:

======  =====  ==========================================================================
offset  size   field
======  =====  ==========================================================================
0       4      ``hashes``: u32, the number of probes per key, 1 to 16
4       4      reserved: u32, 0
8       8      ``bits``: u64, the size of the bit array in bits, a multiple of 64, at least 64
16      bits/8 the bit array: ``bits / 64`` u64 words; bit ``j`` is bit ``j % 64`` (value
               ``1 << (j % 64)``) of word ``j // 64`` (so bit ``j % 8`` of byte ``j // 8``)
======  =====  ==========================================================================

``decode_filter`` rejects a body of any other length for its ``bits``, a ``hashes`` of 0 or over
16, a ``bits`` of 0 or not a multiple of 64, or a non-zero reserved field, with ``ValueError``.
The body carries no checksum of its own: the page that stores it does.
"""

from __future__ import annotations

import math
import struct
from typing import Callable

import numpy as np

from ..keys import KEY_SIZE

KEY_DTYPE = np.dtype(f"S{KEY_SIZE}")
WORD_DTYPE = np.dtype("<u8")
BLOCK_KEYS = 1 << 16  #: keys hashed at a time by ``build_filter`` and ``may_contain_many``
MAX_HASHES = 16
DEFAULT_BITS_PER_KEY = 10
DEFAULT_MAX_BYTES = 12 << 20
HEADER = struct.Struct("<IIQ")  #: hashes, reserved (0), bits

_MASK = (1 << 64) - 1
_SEED = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_KEY_WORDS = struct.Struct("<QQ")


class KeyFilter:
    """A Bloom filter over 16-byte keys (immutable): ``may_contain`` is ``False`` only for a key
    that was not in the set it was built from. Made by ``build_filter`` or ``decode_filter``."""

    __slots__ = ("_hashes", "_bits", "_words", "_bytes", "_probes")

    def __init__(self, hashes: int, bits: int, words: np.ndarray) -> None:
        """A filter probing ``hashes`` bits of the ``bits``-bit array ``words`` (``bits / 64``
        little-endian u64 words, held, not copied: it must not change afterwards)."""
        if not 1 <= hashes <= MAX_HASHES or bits < 64 or bits % 64 or words.dtype != WORD_DTYPE \
                or words.shape != (bits // 64,) or not words.flags.c_contiguous:
            raise ValueError(f"a key filter of {hashes} hashes and {bits} bits over {words.dtype} words "
                             f"{words.shape}")
        words = words.view()
        words.flags.writeable = False  # (a view: the caller's array keeps its flags)
        self._hashes = hashes
        self._bits = bits
        self._words = words
        self._bytes = words.data.cast("B")
        self._probes = range(hashes)

    @property
    def hashes(self) -> int:
        """The number of bits probed per key."""
        return self._hashes

    @property
    def bits(self) -> int:
        """The size of the bit array, in bits (a multiple of 64)."""
        return self._bits

    @property
    def nbytes(self) -> int:
        """The memory the filter holds: its bit array, in bytes."""
        return self._words.nbytes

    def may_contain(self, key: bytes | bytearray | memoryview) -> bool:
        """Whether ``key`` (16 bytes: ``bytes``, ``bytearray`` or ``memoryview``) may be in the
        set; ``False`` only if it is not. ``ValueError`` for a key of another length."""
        try:
            a, b = _KEY_WORDS.unpack(key)
        except struct.error:
            raise ValueError(f"a key filter takes {KEY_SIZE}-byte keys, got {len(key)} bytes") from None
        z = a ^ _SEED
        z = ((z ^ (z >> 30)) * _MUL1) & _MASK
        z = ((z ^ (z >> 27)) * _MUL2) & _MASK
        z = (z ^ (z >> 31)) ^ b
        z = ((z ^ (z >> 30)) * _MUL1) & _MASK
        z = ((z ^ (z >> 27)) * _MUL2) & _MASK
        h = z ^ (z >> 31)
        bits, data = self._bits, self._bytes
        j, step = h % bits, ((h >> 32) | 1) % bits
        for _ in self._probes:
            if not (data[j >> 3] >> (j & 7)) & 1:
                return False
            j += step
            if j >= bits:
                j -= bits
        return True

    def may_contain_many(self, keys: np.ndarray) -> np.ndarray:
        """For each key of the ``S16`` array ``keys``, whether it may be in the set (a bool array
        of the same length; ``False`` only for keys that are not)."""
        keys = _checked_keys(keys)
        found = np.zeros(len(keys), bool)
        for start in range(0, len(keys), BLOCK_KEYS):
            j, step = _probe_start(keys[start:start + BLOCK_KEYS], self._bits)
            alive = np.arange(start, start + len(j))
            for i in self._probes:
                if i:
                    j = _next_probe(j, step, self._bits)
                hit = ((self._words[(j >> np.uint64(6)).astype(np.intp)] >> (j & np.uint64(63))) & np.uint64(1)) != 0
                if not hit.all():
                    alive, j, step = alive[hit], j[hit], step[hit]
                if not len(alive):
                    break
            found[alive] = True
        return found

    def encode(self) -> bytes:
        """The filter's body (layout in the module's docstring), for ``decode_filter``."""
        return HEADER.pack(self._hashes, 0, self._bits) + self._words.tobytes()

    def __reduce__(self) -> tuple[Callable[[bytes], KeyFilter], tuple[bytes]]:
        return decode_filter, (self.encode(),)

    def __repr__(self) -> str:
        return f"KeyFilter(hashes={self._hashes}, bits={self._bits})"


def build_filter(keys: np.ndarray, bits_per_key: int = DEFAULT_BITS_PER_KEY,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> KeyFilter:
    """A filter of the ``S16`` array ``keys`` (unique, in any order, maybe empty).

    Its bit array has ``max(64, len(keys) * bits_per_key)`` bits rounded up to whole 64-bit words,
    at most ``max_bytes`` bytes (rounded down to whole words: a huge set gets a higher false
    positive rate, never a larger array; ``encode`` adds a 16-byte header). The number of probes
    per key is about ``ln 2`` times the bits per key it gets, from 1 to 16 (at 10 bits per key:
    7 probes, about 0.8% false positives). ``ValueError`` for keys that are not a 1-d ``S16``
    array, ``bits_per_key`` under 1 or ``max_bytes`` under 8."""
    keys = _checked_keys(keys)
    builder = FilterBuilder(len(keys), bits_per_key, max_bytes)
    builder.add(keys)
    return builder.finish()


class FilterBuilder:
    """A filter built from keys that arrive in parts (a run written block by block): sized for
    at most ``keys`` keys as ``build_filter`` sizes it, so fewer keys give fewer false positives,
    and the same keys the same filter, whatever the parts."""

    def __init__(self, keys: int, bits_per_key: int = DEFAULT_BITS_PER_KEY, max_bytes: int = DEFAULT_MAX_BYTES):
        for name, value, least in (("keys", keys, 0), ("bits_per_key", bits_per_key, 1), ("max_bytes", max_bytes, 8)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int of at least {least}, got {value!r}")
        words = min(-(-max(64, keys * bits_per_key) // 64), max_bytes // 8)
        self._bits = words * 64
        self._hashes = min(MAX_HASHES, max(1, round(math.log(2) * self._bits / max(keys, 1))))
        self._words = np.zeros(words, WORD_DTYPE)

    def add(self, keys: np.ndarray) -> None:
        """Set the bits of the ``S16`` array ``keys``."""
        keys = _checked_keys(keys)
        for start in range(0, len(keys), BLOCK_KEYS):
            j, step = _probe_start(keys[start:start + BLOCK_KEYS], self._bits)
            for i in range(self._hashes):
                if i:
                    j = _next_probe(j, step, self._bits)
                _set_bits(self._words, j)

    def finish(self) -> KeyFilter:
        """The filter of the keys added (the builder is not used after)."""
        return KeyFilter(self._hashes, self._bits, self._words)


def decode_filter(body: bytes | bytearray | memoryview) -> KeyFilter:
    """The filter ``encode`` gave as ``body`` (copied: the filter does not keep ``body``), or
    ``ValueError`` saying what is wrong with it (layout in the module's docstring)."""
    view = memoryview(body).cast("B")
    if len(view) < HEADER.size:
        raise ValueError(f"a key filter's body of {len(view)} bytes, shorter than its {HEADER.size}-byte header")
    hashes, reserved, bits = HEADER.unpack_from(view)
    if reserved:
        raise ValueError(f"a key filter's reserved field is {reserved:#x}, not 0")
    if not 1 <= hashes <= MAX_HASHES:
        raise ValueError(f"a key filter of {hashes} hashes (1 to {MAX_HASHES} expected)")
    if bits == 0 or bits % 64:
        raise ValueError(f"a key filter of {bits} bits (a non-zero multiple of 64 expected)")
    if len(view) != HEADER.size + bits // 8:
        raise ValueError(f"a key filter of {bits} bits in a body of {len(view)} bytes "
                         f"({HEADER.size + bits // 8} expected)")
    return KeyFilter(hashes, bits, np.frombuffer(view, WORD_DTYPE, bits // 64, HEADER.size).copy())


def _checked_keys(keys: np.ndarray) -> np.ndarray:
    if not isinstance(keys, np.ndarray) or keys.dtype != KEY_DTYPE or keys.ndim != 1:
        shape = f"{keys.dtype} array of shape {keys.shape}" if isinstance(keys, np.ndarray) else type(keys).__name__
        raise ValueError(f"keys must be a 1-d numpy array of {KEY_DTYPE} ({KEY_SIZE}-byte keys), got {shape}")
    return keys


def _mix(z: np.ndarray) -> np.ndarray:
    """The finaliser of the module's docstring, in place on uint64 ``z`` (wrapping)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MUL1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MUL2)
    z ^= z >> np.uint64(31)
    return z


def _probe_start(keys: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The first probe and the step between probes of each of ``keys`` (new uint64 arrays)."""
    halves = np.ascontiguousarray(keys).view(WORD_DTYPE).reshape(-1, 2)
    with np.errstate(over="ignore"):
        h = halves[:, 0] ^ np.uint64(_SEED)
        _mix(h)
        h ^= halves[:, 1]
        _mix(h)
    modulus = np.uint64(bits)
    step = (h >> np.uint64(32)) | np.uint64(1)
    step %= modulus
    h %= modulus
    return h, step


def _next_probe(j: np.ndarray, step: np.ndarray, bits: int) -> np.ndarray:
    """The probes after ``j``, in place (each of ``j`` and ``step`` below ``bits``): ``j + step``,
    less ``bits`` where that is ``bits`` or more (the subtraction wraps to more than ``j + step``
    elsewhere, so the smaller of the two is the probe)."""
    j += step
    np.minimum(j, j - np.uint64(bits), out=j)
    return j


def _set_bits(words: np.ndarray, positions: np.ndarray) -> None:
    """Sets bit ``p`` of ``words`` for each ``p`` of ``positions`` (uint64). A fancy-indexed ``|=``
    keeps only the last of several writes to one word, so the bits it lost are set again, until
    none is (each round sets at least the last bit of each word written)."""
    index = (positions >> np.uint64(6)).astype(np.intp)
    values = np.uint64(1) << (positions & np.uint64(63))
    while len(index):
        words[index] |= values
        lost = (words[index] & values) == 0
        index, values = index[lost], values[lost]
