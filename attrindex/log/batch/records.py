"""``Record`` and the checks of what callers append: records, headers and timestamps made into
the plain columns the encoder writes, with ``InvalidInputError`` for anything else. No I/O."""

from __future__ import annotations

import typing

from ...errors import InvalidInputError
from .header import I64_MAX, I64_MIN

__all__ = ["Record", "check_i64", "check_timestamps", "normalize_headers", "normalize_records", "record_list"]


class Record(typing.NamedTuple):
    """One record: the input form of ``encode_batch`` and what ``decode_records`` returns.

    ``value=None`` makes a tombstone (Kafka's null value: log compaction deletes the key); a
    tombstone must have a key."""

    value: bytes | None
    key: bytes | None = None
    timestamp: int | None = None  # ms since the epoch; None on input means the batch's timestamp
    headers: typing.Sequence[tuple[str, bytes]] = ()  # (name, value) pairs; records read back hold a tuple
    offset: int | None = None  # set on records read back; ignored on input


def _as_bytes(obj, what: str) -> bytes:
    if type(obj) is bytes:
        return obj
    if isinstance(obj, str):
        raise InvalidInputError(f"{what} must be bytes-like, got str (encode it first)")
    try:
        return bytes(memoryview(obj))
    except TypeError:
        raise InvalidInputError(f"{what} must be bytes-like, got {type(obj).__name__}") from None


def check_i64(value, what: str) -> int:
    """``value`` if it is an int (not a bool) in the signed 64-bit range, else ``InvalidInputError``
    naming ``what``."""
    if type(value) is int and I64_MIN <= value <= I64_MAX:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{what} must be an int, got {type(value).__name__}")
    if not I64_MIN <= value <= I64_MAX:
        raise InvalidInputError(f"{what} must be in the signed 64-bit range, got {value}")
    return int(value)


_NONE_TYPE = type(None)


def _normalize_columns(records, timestamp: int):
    """``normalize_records`` for the common case, checked column by column at C speed: every item a
    ``Record`` with a ``bytes`` value, a ``bytes`` or no key, an int64 or no timestamp and no
    headers. ``None`` when anything else is there (the per-record path then says what is wrong)."""
    if not all(type(r) is Record for r in records):
        return None
    values, keys, stamps, headers, _offsets = zip(*records)
    if any(headers) or set(map(type, values)) != {bytes}:  # tombstones (None) take the per-record path
        return None
    key_types = set(map(type, keys))
    if not key_types <= {bytes, _NONE_TYPE}:
        return None
    stamp_types = set(map(type, stamps))
    if not stamp_types <= {int, _NONE_TYPE}:
        return None
    if _NONE_TYPE in stamp_types:
        stamps = [timestamp if t is None else t for t in stamps]
    if min(stamps) < I64_MIN or max(stamps) > I64_MAX:
        return None
    return list(values), list(keys) if bytes in key_types else None, list(stamps), None, None


def normalize_records(records, timestamp: int):
    """``records`` (bytes-like values or ``Record``s) as the encoder's columns: (values, keys or
    None, timestamps or None, headers or None, tombstone flags or None), each record checked
    (``InvalidInputError`` naming the first bad one). A record without a timestamp gets
    ``timestamp``; a tombstone's value is stored as ``b""`` and flagged."""
    fast = _normalize_columns(records, timestamp)
    if fast is not None:
        return fast
    values: list[bytes] = []
    keys: list[bytes | None] = []
    stamps: list[int] = []
    headers: list[tuple] = []
    tombstones: list[int] = []
    any_key = any_headers = False
    for i, record in enumerate(records):
        dead = 0
        if isinstance(record, Record):
            value, key, stamp, pairs, _offset = record
            if value is None:
                if key is None:
                    raise InvalidInputError(f"record {i}: a tombstone (value None) needs a key: it deletes that key")
                value, dead = b"", 1
            else:
                value = _as_bytes(value, f"record {i}: value")
            if key is not None:
                if isinstance(key, str):
                    raise InvalidInputError(f"record {i}: key must be bytes or None, got str")
                key = _as_bytes(key, f"record {i}: key")
                any_key = True
            if stamp is None:
                stamp = timestamp
            else:
                stamp = check_i64(stamp, f"record {i}: timestamp")
            if pairs:
                pairs = normalize_headers(pairs, f"record {i}")
                any_headers = any_headers or bool(pairs)
            else:
                pairs = ()
        elif isinstance(record, tuple):
            raise InvalidInputError(f"record {i}: must be bytes-like or a Record, got a plain tuple")
        else:
            value, key, stamp, pairs = _as_bytes(record, f"record {i}: value"), None, timestamp, ()
        values.append(value)
        keys.append(key)
        stamps.append(stamp)
        headers.append(pairs)
        tombstones.append(dead)
    return (values, keys if any_key else None, stamps, headers if any_headers else None,
            tombstones if any(tombstones) else None)


def record_list(records) -> list:
    """The records of an append as a list: any iterable but a single value (``InvalidInputError``)."""
    if isinstance(records, list):
        return records
    if isinstance(records, (bytes, bytearray, memoryview, str, Record)) or records is None:
        raise InvalidInputError(f"records must be a list of bytes values or Records, got {type(records).__name__}")
    try:
        return list(records)
    except TypeError:
        raise InvalidInputError(f"records must be a list of bytes values or Records, got {type(records).__name__}") from None


def normalize_headers(pairs, where: str) -> tuple:
    """A record's headers as a tuple of ``(str, bytes)`` pairs, or ``InvalidInputError`` naming
    ``where`` (e.g. ``"record 3"``) and what is wrong."""
    wrong = f"{where}: headers must be a sequence of (str, bytes) pairs, got {type(pairs).__name__}"
    if isinstance(pairs, (str, bytes, bytearray, memoryview, dict)):
        raise InvalidInputError(wrong)
    out = []
    try:
        items = list(pairs)
    except TypeError:
        raise InvalidInputError(wrong) from None
    for j, pair in enumerate(items):
        try:
            name, value = pair
        except (TypeError, ValueError):
            raise InvalidInputError(f"{where}: header {j} must be a (name, value) pair, got {pair!r:.60}") from None
        if not isinstance(name, str):
            raise InvalidInputError(f"{where}: header {j} name must be a str, got {type(name).__name__}")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(f"{where}: header {j} name {name!r} is not encodable as UTF-8") from None
        out.append((name, _as_bytes(value, f"{where}: header {name!r} value")))
    return tuple(out)


def check_timestamps(stamps, what: str = "timestamp") -> list:
    """``stamps`` as a list, each ``None`` or an int64 of ms (not a bool, float or str), or
    ``InvalidInputError`` naming the first bad one. Checked at C speed when all are fine."""
    stamps = list(stamps)
    types = set(map(type, stamps))
    if types <= {int, _NONE_TYPE}:
        ints = [t for t in stamps if t is not None] if _NONE_TYPE in types else stamps
        if not ints or (I64_MIN <= min(ints) and max(ints) <= I64_MAX):
            return stamps
    for i, stamp in enumerate(stamps):
        if stamp is not None:
            check_i64(stamp, f"{what} {i}")
    return stamps
