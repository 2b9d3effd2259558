"""Tests of ``attrindex.log.varint``, in the spirit of LevelDB's ``util/coding_test.cc``.

The LevelDB cases come first (32- and 64-bit round trips, overflow, truncation), then the
strictness rules this module adds (a 10th byte beyond 64 bits, input validation), then the bulk
helpers, whose fast paths must agree with the one-at-a-time codec.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attrindex.errors import CorruptDataError, InvalidInputError
from attrindex.log.varint import (
    VarintError,
    decode_varint,
    decode_varint32,
    decode_varints,
    encode_lengths,
    encode_varint,
    encode_varints,
    put_varint,
    unzigzag,
    zigzag,
)

U32 = (1 << 32) - 1


def varint64_values() -> list[int]:
    values = [0, 100, (1 << 64) - 1, (1 << 64) - 2]
    for k in range(64):
        power = 1 << k
        values += [power, power - 1, power + 1]
    return values


# --- LevelDB's coding_test.cc, adapted ---------------------------------------------------------


def test_varint32_round_trip():
    buf = bytearray()
    expected = []
    for i in range(32 * 32):
        v = ((i // 32) << (i % 32)) & U32
        expected.append(v)
        put_varint(buf, v)
    pos = 0
    for v in expected:
        start = pos
        actual, pos = decode_varint32(buf, pos)
        assert actual == v
        assert pos - start == len(encode_varint(v))
    assert pos == len(buf)


def test_varint64_round_trip():
    values = varint64_values()
    buf = bytearray()
    for v in values:
        put_varint(buf, v)
    pos = 0
    for v in values:
        start = pos
        actual, pos = decode_varint(buf, pos)
        assert actual == v
        assert pos - start == len(encode_varint(v))
    assert pos == len(buf)


def test_varint32_overflow():
    with pytest.raises(VarintError, match="overflows 32 bits"):
        decode_varint32(b"\x81\x82\x83\x84\x85\x11", 0)


def test_varint32_truncation():
    large = (1 << 32) - 1
    encoded = encode_varint(large)
    for length in range(len(encoded)):
        with pytest.raises(VarintError, match="truncated"):
            decode_varint32(encoded[:length], 0)
    assert decode_varint32(encoded, 0) == (large, len(encoded))


def test_varint64_overflow():
    with pytest.raises(VarintError, match="overflows 64 bits"):
        decode_varint(b"\x81\x82\x83\x84\x85\x81\x82\x83\x84\x85\x11", 0)


def test_varint64_truncation():
    large = (1 << 64) - 1
    encoded = encode_varint(large)
    assert len(encoded) == 10
    for length in range(len(encoded)):
        with pytest.raises(VarintError, match="truncated"):
            decode_varint(encoded[:length], 0)
    assert decode_varint(encoded, 0) == (large, len(encoded))


@pytest.mark.parametrize("value", varint64_values())
def test_every_strict_prefix_is_truncated(value):
    encoded = b"\x00" + encode_varint(value)
    for end in range(1, len(encoded)):
        with pytest.raises(VarintError):
            decode_varint(encoded[:end], 1)
        if value <= U32:
            with pytest.raises(VarintError):
                decode_varint32(encoded[:end], 1)


# --- strictness this module adds ----------------------------------------------------------------


def test_tenth_byte_beyond_64_bits_overflows():
    assert decode_varint(b"\xff" * 9 + b"\x01") == ((1 << 64) - 1, 10)
    with pytest.raises(VarintError, match="overflows 64 bits"):
        decode_varint(b"\xff" * 9 + b"\x02")
    with pytest.raises(VarintError, match="overflows 64 bits"):
        decode_varint(b"\x80" * 10 + b"\x00")  # 11 bytes, even if the value is 0


def test_fifth_byte_beyond_32_bits_overflows():
    assert decode_varint32(b"\xff\xff\xff\xff\x0f") == (U32, 5)
    with pytest.raises(VarintError, match="overflows 32 bits"):
        decode_varint32(b"\xff\xff\xff\xff\x10")
    assert decode_varint(b"\xff\xff\xff\xff\x10") == ((1 << 32) + (1 << 28) - 1, 5)


def test_varint_error_is_corrupt_data():
    with pytest.raises(CorruptDataError) as info:
        decode_varint(b"\x00\x80", 1)
    assert isinstance(info.value, VarintError)
    assert info.value.offset == 1


def test_decode_from_memoryview_and_offset():
    buf = memoryview(b"\xff" + encode_varint(300) + encode_varint(5))
    value, pos = decode_varint(buf, 1)
    assert (value, pos) == (300, 3)
    assert decode_varint(buf, pos) == (5, 4)


@pytest.mark.parametrize("bad", [-1, 1 << 64, 1.5, "1", None])
def test_encode_rejects_out_of_range(bad):
    with pytest.raises(InvalidInputError):
        encode_varint(bad)
    with pytest.raises(InvalidInputError):
        encode_varints([1, bad])


def test_negative_position_is_invalid():
    with pytest.raises(InvalidInputError):
        decode_varint(b"\x01", -1)
    with pytest.raises(InvalidInputError):
        decode_varints(b"\x01", -1, 1)


def test_zigzag():
    pairs = [(0, 0), (-1, 1), (1, 2), (-2, 3), (2, 4), ((1 << 63) - 1, (1 << 64) - 2), (-(1 << 63), (1 << 64) - 1)]
    for signed, unsigned in pairs:
        assert zigzag(signed) == unsigned
        assert unzigzag(unsigned) == signed
    with pytest.raises(InvalidInputError):
        zigzag(1 << 63)
    with pytest.raises(InvalidInputError):
        zigzag(-(1 << 63) - 1)


@given(st.integers(-(1 << 63), (1 << 63) - 1))
def test_zigzag_round_trip(n):
    assert unzigzag(zigzag(n)) == n
    assert decode_varint(encode_varint(zigzag(n))) == (zigzag(n), len(encode_varint(zigzag(n))))


# --- bulk helpers -------------------------------------------------------------------------------


def mixed_ints():
    return st.one_of(
        st.integers(0, 0x7F),
        st.integers(0x80, (1 << 14) - 1),
        st.integers(1 << 14, (1 << 21) - 1),  # three bytes: the table path
        st.integers(1 << 21, (1 << 64) - 1),
    )


@settings(max_examples=300)
@given(st.lists(mixed_ints(), max_size=60), st.binary(max_size=3), st.binary(max_size=3))
def test_bulk_round_trip(values, prefix, suffix):
    encoded = encode_varints(values)
    assert encoded == b"".join(map(encode_varint, values))
    assert encode_lengths(values) == encoded
    buf = prefix + encoded + suffix
    assert decode_varints(buf, len(prefix), len(values)) == (values, len(prefix) + len(encoded))
    assert decode_varints(memoryview(buf), len(prefix), len(values)) == (values, len(prefix) + len(encoded))


@pytest.mark.parametrize(
    "values",
    [
        [],
        [5] * 100,  # all one byte
        [200, 16383, 128] * 40,  # all two bytes
        [5, 200] * 50,  # one and two bytes mixed
        [1, 1 << 40, 300, (1 << 64) - 1],  # long ones
        [16384, (1 << 21) - 1, 99999] * 30,  # all three bytes
        [7, 16383, 16384, 2_000_000, 1 << 21] * 20,  # one to four bytes
    ],
)
def test_bulk_shapes(values):
    encoded = encode_varints(values)
    assert decode_varints(encoded, 0, len(values)) == (values, len(encoded))
    assert encode_varints(iter(values)) == encoded
    for end in range(len(encoded)):  # every strict prefix is truncated
        with pytest.raises(VarintError, match="truncated"):
            decode_varints(encoded[:end], 0, len(values))


def test_bulk_overflow():
    buf = encode_varints([1, 2]) + b"\x80" * 10 + b"\x00"
    with pytest.raises(VarintError, match="overflows 64 bits"):
        decode_varints(buf, 0, 3)


def test_bulk_stops_after_count():
    buf = encode_varints([1, 300, 2]) + b"\x80"  # a truncated varint after the ones asked for
    assert decode_varints(buf, 0, 3) == ([1, 300, 2], 4)
    assert decode_varints(buf, 0, 0) == ([], 0)
