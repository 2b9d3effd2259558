"""Unsigned LEB128 varints (LevelDB's encoding) and zig-zag for signed ints; no I/O.

A varint stores 7 bits per byte, the low group first; the high bit of a byte says another byte
follows. A 64-bit value takes at most 10 bytes, a 32-bit one at most 5. Decoding is strict: a
buffer that ends inside a varint, a varint longer than its limit, or a last byte carrying bits
beyond 64 (or 32) raise ``VarintError``, a ``CorruptDataError``.

The bulk helpers ``encode_varints``/``decode_varints`` are what the batch codec uses for its length
columns; they have C-speed paths for the common shapes (every value one byte, or every value two
bytes) and fall back to a per-item loop otherwise.
"""

from __future__ import annotations

from ..errors import CorruptDataError, InvalidInputError

__all__ = [
    "VarintError",
    "MAX_VARINT64_BYTES",
    "MAX_VARINT32_BYTES",
    "encode_varint",
    "put_varint",
    "decode_varint",
    "decode_varint32",
    "zigzag",
    "unzigzag",
    "encode_varints",
    "encode_lengths",
    "decode_varints",
]

MAX_VARINT64_BYTES = 10
MAX_VARINT32_BYTES = 5
_U64_LIMIT = 1 << 64
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

_ONE_BYTE = [bytes((i,)) for i in range(0x80)]
_HIGH_BYTES = bytes(range(0x80, 0x100))
_LOW7 = bytes(i & 0x7F for i in range(0x100))  # translate table clearing the continuation bit
_TWO_BYTE_TABLE: list[bytes] | None = None  # encodings of 0 .. 2**14-1, built on first need
_LOW_14_TABLE: list[bytes] | None = None  # the low 14 bits of a 3-byte varint: two continuation bytes


class VarintError(CorruptDataError):
    """A varint is truncated (the buffer ends inside it) or overflows its 64- or 32-bit range."""


def _truncated(pos: int) -> VarintError:
    return VarintError(f"varint at position {pos} is truncated: the buffer ends inside it", offset=pos)


def _overflow(pos: int, bits: int) -> VarintError:
    return VarintError(f"varint at position {pos} overflows {bits} bits", offset=pos)


def encode_varint(n: int) -> bytes:
    """The varint encoding of ``n`` (an int in ``[0, 2**64)``)."""
    if type(n) is int and 0 <= n < 0x80:
        return _ONE_BYTE[n]
    if not isinstance(n, int):
        raise InvalidInputError(f"varint value must be an int, got {type(n).__name__}")
    if not 0 <= n < _U64_LIMIT:
        raise InvalidInputError(f"varint value must be in [0, 2**64), got {n}")
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def put_varint(out: bytearray, n: int) -> None:
    """Append the varint encoding of ``n`` to ``out``."""
    out += encode_varint(n)


def _decode(buf, pos: int, max_bytes: int, bits: int) -> tuple[int, int]:
    start = pos
    if pos < 0:
        raise InvalidInputError(f"position must be >= 0, got {pos}")
    end = len(buf)
    result = 0
    shift = 0
    last = max_bytes - 1
    for i in range(max_bytes):
        if pos >= end:
            raise _truncated(start)
        b = buf[pos]
        pos += 1
        if i == last and b >> (bits - shift):
            # the last allowed byte may hold only the remaining high bits, and no continuation
            raise _overflow(start, bits)
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
    raise AssertionError("unreachable")  # pragma: no cover


def decode_varint(buf, pos: int = 0) -> tuple[int, int]:
    """Decode the 64-bit varint at ``buf[pos]``: ``(value, position after it)``."""
    if 0 <= pos < len(buf):
        b = buf[pos]
        if b < 0x80:
            return b, pos + 1
    return _decode(buf, pos, MAX_VARINT64_BYTES, 64)


def decode_varint32(buf, pos: int = 0) -> tuple[int, int]:
    """Decode the 32-bit varint at ``buf[pos]`` (at most 5 bytes, value below ``2**32``)."""
    if 0 <= pos < len(buf):
        b = buf[pos]
        if b < 0x80:
            return b, pos + 1
    return _decode(buf, pos, MAX_VARINT32_BYTES, 32)


def zigzag(n: int) -> int:
    """Map a signed 64-bit int to an unsigned one, small magnitudes to small values."""
    if not isinstance(n, int) or not _I64_MIN <= n <= _I64_MAX:
        raise InvalidInputError(f"zigzag needs an int in the signed 64-bit range, got {n!r}")
    return (n << 1) ^ (n >> 63)


def unzigzag(u: int) -> int:
    """Inverse of ``zigzag``."""
    return (u >> 1) ^ -(u & 1)


def _two_byte_table() -> list[bytes]:
    global _TWO_BYTE_TABLE
    if _TWO_BYTE_TABLE is None:
        table = list(_ONE_BYTE)
        table.extend(bytes(((i & 0x7F) | 0x80, i >> 7)) for i in range(0x80, 1 << 14))
        _TWO_BYTE_TABLE = table
    return _TWO_BYTE_TABLE


def _low_14_table() -> list[bytes]:
    global _LOW_14_TABLE
    if _LOW_14_TABLE is None:
        _LOW_14_TABLE = [bytes(((i & 0x7F) | 0x80, (i >> 7) | 0x80)) for i in range(1 << 14)]
    return _LOW_14_TABLE


def encode_varints(values) -> bytes:
    """The concatenated varint encodings of ``values`` (ints in ``[0, 2**64)``)."""
    if not isinstance(values, (list, tuple)):
        values = list(values)
    return _encode_all(values, False)


def encode_lengths(values: list[int]) -> bytes:
    """``encode_varints`` for values already known to be non-negative ints (``len()`` results)."""
    return _encode_all(values, True)


def _encode_all(values, nonnegative: bool) -> bytes:
    if not values:
        return b""
    try:
        encoded = bytes(values)  # C speed; ValueError if some value is outside [0, 256)
    except (ValueError, TypeError):
        pass
    else:
        if encoded.isascii():  # every value < 0x80: each is its own one-byte varint
            return encoded
    try:
        top = max(values)
        if top < (1 << 21) and (nonnegative or min(values) >= 0):
            two = _two_byte_table()
            if top < (1 << 14):
                return b"".join(map(two.__getitem__, values))
            low, one = _low_14_table(), _ONE_BYTE  # 3-byte varints by table too (timestamp deltas)
            return b"".join([two[v] if v < 16384 else low[v & 16383] + one[v >> 14] for v in values])
    except TypeError:
        pass  # a non-int somewhere: the per-item path names it
    return b"".join(map(encode_varint, values))


def decode_varints(buf, pos: int, count: int) -> tuple[list[int], int]:
    """Decode ``count`` consecutive 64-bit varints from ``buf[pos]``: ``(values, position after)``."""
    if count < 0 or pos < 0:
        raise InvalidInputError(f"count and position must be >= 0, got count {count}, position {pos}")
    if count == 0:
        return [], pos
    end = pos + count
    chunk = bytes(buf[pos:end])
    if len(chunk) == count and chunk.isascii():
        return list(chunk), end  # every varint is one byte
    end = pos + 2 * count
    chunk = bytes(buf[pos:end])
    if len(chunk) == 2 * count:
        low, high = chunk[0::2], chunk[1::2]
        if high.isascii() and not low.translate(None, _HIGH_BYTES):
            # every varint is exactly two bytes: a continuation byte, then a final byte
            return list(map(int.__or__, low.translate(_LOW7), map((7).__rlshift__, high))), end
    # mixed widths: one- and two-byte varints inline, longer ones (and any error) through _decode
    out: list[int] = []
    append = out.append
    try:
        for _ in range(count):
            b = buf[pos]
            if b < 0x80:
                append(b)
                pos += 1
                continue
            c = buf[pos + 1]
            if c < 0x80:
                append((b & 0x7F) | (c << 7))
                pos += 2
                continue
            d = buf[pos + 2]
            if d < 0x80:
                append((b & 0x7F) | ((c & 0x7F) << 7) | (d << 14))
                pos += 3
                continue
            value, pos = _decode(buf, pos, MAX_VARINT64_BYTES, 64)
            append(value)
    except IndexError:
        _decode(buf, pos, MAX_VARINT64_BYTES, 64)  # the buffer ends inside this varint: raises
        raise  # pragma: no cover
    return out, pos
