"""Tests of ``attrindex.btree.key_filter``: the Bloom filter of a sorted run's keys.

The contract: no false negatives for any set of keys (random bytes, sequential integers, shared
prefixes, empty, one key, a filter capped far below its keys' share); ``may_contain`` and
``may_contain_many`` give the same answer for every key; the body ``encode`` gives is the one the
module's docstring lays out (checked against a model written from that text alone) and decodes
to the same filter; every other body is a ``ValueError``. The false-positive rate at 10 bits per
key is near the theory's, for random and for sequential keys.
"""

from __future__ import annotations

import math
import pickle
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attrindex.btree.key_filter import BLOCK_KEYS, KEY_DTYPE, MAX_HASHES, FilterBuilder, KeyFilter, build_filter, decode_filter

HEADER = struct.Struct("<IIQ")
MASK = (1 << 64) - 1

random_keys = st.sets(st.binary(min_size=16, max_size=16), max_size=150)


@st.composite
def sequential_keys(draw):
    """Integers ``start + i * stride`` as 16-byte big-endian keys (strides of 1, 256 or 2**64:
    keys that differ only in their last bytes, in a middle byte, or in their first eight)."""
    count = draw(st.integers(0, 300))
    stride = draw(st.sampled_from([1, 1 << 8, 1 << 64]))
    start = draw(st.integers(0, (1 << 128) - 1 - count * stride))
    return [(start + i * stride).to_bytes(16, "big") for i in range(count)]


@st.composite
def prefixed_keys(draw):
    """Keys sharing a prefix of 8 to 15 bytes, with distinct suffixes."""
    prefix = draw(st.binary(min_size=8, max_size=15))
    suffixes = draw(st.sets(st.binary(min_size=16 - len(prefix), max_size=16 - len(prefix)), max_size=200))
    return [prefix + s for s in suffixes]


key_sets = st.one_of(random_keys.map(list), sequential_keys(), prefixed_keys())


def as_array(keys) -> np.ndarray:
    return np.array(list(keys), KEY_DTYPE).reshape(-1)


def model_body(keys: list[bytes], bits_per_key: int, max_bytes: int) -> bytes:
    """The body the module's docstring describes for ``keys``, computed from that text alone."""
    words = min(math.ceil(max(64, len(keys) * bits_per_key) / 64), max_bytes // 8)
    bits = 64 * words
    hashes = min(16, max(1, round(math.log(2) * bits / max(len(keys), 1))))

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
        return z ^ (z >> 31)

    array = 0
    for key in keys:
        a, b = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
        h = mix(mix(a ^ 0x9E3779B97F4A7C15) ^ b)
        d = ((h >> 32) | 1) % bits
        for i in range(hashes):
            array |= 1 << ((h % bits + i * d) % bits)
    return HEADER.pack(hashes, 0, bits) + array.to_bytes(bits // 8, "little")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keys=key_sets, bits_per_key=st.integers(1, 16), max_bytes=st.integers(8, 512), data=st.randoms())
def test_no_false_negatives_and_one_answer_on_both_paths(keys, bits_per_key, max_bytes, data):
    data.shuffle(keys)  # any order
    built = build_filter(as_array(keys), bits_per_key, max_bytes)
    others = [data.getrandbits(128).to_bytes(16, "big") for _ in range(100)]
    others += [(int.from_bytes(k, "big") ^ 1).to_bytes(16, "big") for k in keys[:50]]  # neighbours
    probes = keys + others
    many = built.may_contain_many(as_array(probes))
    assert many.dtype == bool and many.shape == (len(probes),)
    assert many[:len(keys)].all()
    assert [built.may_contain(k) for k in probes] == many.tolist()


@settings(max_examples=60, deadline=None)
@given(keys=key_sets, bits_per_key=st.integers(1, 16), max_bytes=st.integers(8, 512))
def test_the_body_is_the_documented_layout(keys, bits_per_key, max_bytes):
    built = build_filter(as_array(keys), bits_per_key, max_bytes)
    body = built.encode()
    assert body == model_body(keys, bits_per_key, max_bytes)
    assert HEADER.unpack_from(body) == (built.hashes, 0, built.bits)
    assert len(body) == HEADER.size + built.nbytes


@settings(max_examples=60, deadline=None)
@given(keys=key_sets, bits_per_key=st.integers(1, 16), kind=st.sampled_from([bytes, bytearray, memoryview]))
def test_a_decoded_filter_is_the_encoded_one(keys, bits_per_key, kind):
    built = build_filter(as_array(keys), bits_per_key)
    body = bytearray(built.encode())
    decoded = decode_filter(kind(body))
    assert (decoded.hashes, decoded.bits, decoded.nbytes) == (built.hashes, built.bits, built.nbytes)
    assert decoded.encode() == bytes(body)
    body[HEADER.size:] = bytes(len(body) - HEADER.size)  # the decoded filter holds its own copy
    assert decoded.may_contain_many(as_array(keys)).all()
    assert all(decoded.may_contain(k) for k in keys)
    assert pickle.loads(pickle.dumps(decoded)).encode() == built.encode()


@settings(max_examples=40, deadline=None)
@given(keys=key_sets, spare=st.integers(0, 50), cuts=st.lists(st.integers(0, 400), max_size=4))
def test_a_filter_built_in_parts_is_the_filter_of_all_its_keys(keys, spare, cuts):
    """A run's filter is built block by block, sized for at most as many keys as it may hold:
    the parts give the filter ``build_filter`` gives for that size, with every key in it."""
    array = as_array(keys)
    builder = FilterBuilder(len(keys) + spare)
    bounds = sorted({0, len(keys), *(c for c in cuts if c < len(keys))})
    for lo, hi in zip(bounds, bounds[1:]):
        builder.add(array[lo:hi])
    built = builder.finish()
    whole = FilterBuilder(len(keys) + spare)
    whole.add(array)
    assert built.encode() == whole.finish().encode()
    if not spare:
        assert built.encode() == build_filter(array).encode()
    assert all(built.may_contain(key) for key in keys)


@settings(max_examples=100, deadline=None)
@given(key=st.binary(min_size=16, max_size=16), bits_per_key=st.integers(1, 20_000))
def test_the_probes_of_a_key_are_distinct_bits(key, bits_per_key):
    """Whatever the bit count (64 times any number of words), one key sets as many bits as probes."""
    built = build_filter(np.array([key], KEY_DTYPE), bits_per_key)
    ones = sum(bin(byte).count("1") for byte in built.encode()[HEADER.size:])
    assert built.bits == 64 * math.ceil(max(64, bits_per_key) / 64)
    assert ones == built.hashes


def _valid_body() -> bytes:
    return build_filter(as_array(i.to_bytes(16, "big") for i in range(20))).encode()


@st.composite
def malformed_bodies(draw):
    """A valid body with its length or a header field made wrong."""
    body = bytearray(_valid_body())
    _hashes, _reserved, bits = HEADER.unpack_from(body)
    how = draw(st.sampled_from(["truncate", "extend", "hashes", "reserved", "bits unaligned", "bits other"]))
    if how == "truncate":
        return bytes(body[:draw(st.integers(0, len(body) - 1))])
    if how == "extend":
        return bytes(body) + draw(st.binary(min_size=1, max_size=80))
    if how == "hashes":
        struct.pack_into("<I", body, 0, draw(st.sampled_from([0, MAX_HASHES + 1, 255, 1 << 31, (1 << 32) - 1])))
    elif how == "reserved":
        struct.pack_into("<I", body, 4, draw(st.integers(1, (1 << 32) - 1)))
    elif how == "bits unaligned":
        struct.pack_into("<Q", body, 8, draw(st.integers(0, MASK).filter(lambda b: b % 64)))
    else:
        struct.pack_into("<Q", body, 8, draw(st.integers(0, MASK // 64).filter(lambda w: w * 64 != bits)) * 64)
    return bytes(body)


@settings(max_examples=100, deadline=None)
@given(body=malformed_bodies())
def test_every_malformed_body_is_a_value_error(body):
    with pytest.raises(ValueError):
        decode_filter(body)


@settings(max_examples=100, deadline=None)
@given(body=st.one_of(st.binary(max_size=120), st.builds(lambda b, i, x: b[:i] + bytes([b[i] ^ x]) + b[i + 1:],
                                                        st.just(_valid_body()), st.integers(0, 15), st.integers(1, 255))))
def test_any_body_decodes_to_itself_or_is_a_value_error(body):
    """A flipped header byte, or any bytes: never a filter of other bytes, never another error."""
    try:
        decoded = decode_filter(body)
    except ValueError:
        return
    assert decoded.encode() == body


def test_the_empty_set_and_one_key():
    empty = build_filter(np.empty(0, KEY_DTYPE))
    assert (empty.bits, empty.hashes) == (64, MAX_HASHES)
    assert not empty.may_contain(bytes(16)) and not empty.may_contain_many(np.zeros(3, KEY_DTYPE)).any()
    assert empty.may_contain_many(np.empty(0, KEY_DTYPE)).shape == (0,)
    key = b"\x01" + bytes(15)  # trailing zero bytes, which numpy drops from an S16 element
    one = build_filter(np.array([key], KEY_DTYPE))
    assert one.may_contain(key) and one.may_contain_many(np.array([key], KEY_DTYPE)).all()
    assert one.hashes == MAX_HASHES and one.bits == 64


def _random_keys(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 16), np.uint8).view(KEY_DTYPE).reshape(-1)


def _sequential_keys(start: int, n: int) -> np.ndarray:
    """Big-endian integers ``start .. start + n - 1``, built as columns (no Python object per key)."""
    words = np.zeros((n, 2), ">u8")
    words[:, 1] = np.arange(start, start + n, dtype=np.uint64)
    return words.view(KEY_DTYPE).reshape(-1)


@pytest.mark.parametrize("kind", ["random", "sequential"])
def test_the_false_positive_rate_at_10_bits_per_key(kind):
    n = 200_000
    keys, others = (_random_keys(1, n), _random_keys(2, n)) if kind == "random" else \
        (_sequential_keys(0, n), _sequential_keys(n, n))
    built = build_filter(keys, 10)
    assert built.hashes == 7 and built.bits == 64 * math.ceil(n * 10 / 64)
    assert built.may_contain_many(keys).all()
    rate = built.may_contain_many(others).mean()
    assert rate <= 0.015  # theory: (1 - e^(-7/10))^7, about 0.82%
    sample = np.arange(0, n, 97)
    assert [built.may_contain(others[i:i + 1].tobytes()) for i in sample] == built.may_contain_many(others[sample]).tolist()


def test_max_bytes_caps_the_bit_array():
    keys = _random_keys(3, 100_000)
    capped = build_filter(keys, 10, max_bytes=4096 + 5)  # rounded down to whole words
    assert capped.bits == 4096 * 8 and capped.nbytes == 4096 and len(capped.encode()) == 4096 + 16
    assert capped.hashes == 1  # a third of a bit per key
    assert capped.may_contain_many(keys).all()
    smallest = build_filter(keys, 10, max_bytes=8)
    assert smallest.bits == 64 and smallest.may_contain_many(keys).all()
    under = build_filter(keys[:100], 10, max_bytes=4096)  # the cap is a bound, not a size
    assert under.bits == 1024


def test_the_probe_count_follows_the_bits_each_key_gets():
    keys = _random_keys(4, 1000)
    assert [build_filter(keys, b).hashes for b in (1, 2, 4, 8, 10, 12, 16, 24, 64)] == \
        [1, 1, 3, 6, 7, 8, 11, 16, 16]


def test_building_takes_the_bit_array_and_one_block():
    keys = _random_keys(5, 4 * BLOCK_KEYS)
    tracemalloc.start()
    try:
        built = build_filter(keys, 10)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        found = built.may_contain_many(keys)
        _, peak_many = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    block = BLOCK_KEYS * 8 * 8  # eight uint64 columns of one block (about five are used)
    assert peak <= built.nbytes + block  # all the keys' columns at once would be four times that
    assert peak_many <= built.nbytes + found.nbytes + block
    assert found.all()


def test_keys_need_not_be_contiguous():
    keys = _random_keys(6, 3000)
    strided = keys[::3]
    built = build_filter(strided)
    assert built.encode() == build_filter(strided.copy()).encode()
    assert built.may_contain_many(strided).all()


@pytest.mark.parametrize("keys", [[bytes(16)], np.zeros(3, "S8"), np.zeros((2, 2), KEY_DTYPE), np.zeros(2, np.uint64),
                                  np.zeros(2, "U16")])
def test_keys_other_than_a_1d_s16_array_are_refused(keys):
    with pytest.raises(ValueError, match="S16"):
        build_filter(keys)
    with pytest.raises(ValueError, match="S16"):
        build_filter(np.zeros(1, KEY_DTYPE)).may_contain_many(keys)


@pytest.mark.parametrize("arguments", [{"bits_per_key": 0}, {"bits_per_key": True}, {"bits_per_key": 2.5},
                                       {"max_bytes": 7}, {"max_bytes": -1}, {"max_bytes": "64"}])
def test_bad_sizes_are_refused(arguments):
    with pytest.raises(ValueError, match=next(iter(arguments))):
        build_filter(np.zeros(1, KEY_DTYPE), **arguments)


def test_a_key_of_another_length_is_refused():
    built = build_filter(np.zeros(1, KEY_DTYPE))
    for key in (bytes(15), bytes(17), b""):
        with pytest.raises(ValueError, match="16-byte keys"):
            built.may_contain(key)
    with pytest.raises(TypeError):
        built.may_contain("0123456789abcdef")  # type: ignore[arg-type]
    assert built.may_contain(bytearray(16)) and built.may_contain(memoryview(bytes(16)))


def test_a_filter_is_made_of_a_consistent_bit_array():
    with pytest.raises(ValueError):
        KeyFilter(7, 128, np.zeros(1, "<u8"))
    with pytest.raises(ValueError):
        KeyFilter(0, 64, np.zeros(1, "<u8"))
    with pytest.raises(ValueError):
        KeyFilter(3, 64, np.zeros(2, "<u4"))
    with pytest.raises(ValueError):
        KeyFilter(3, 128, np.zeros(4, "<u8")[::2])
    words = np.zeros(1, "<u8")
    held = KeyFilter(3, 64, words)
    assert words.flags.writeable and not held.may_contain(bytes(16))
