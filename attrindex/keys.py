"""Attribute keys and values: what users may pass, and the canonical form stored.

A key is 16 bytes compared as unsigned bytes. ``uuid.UUID`` maps to its big-endian ``bytes`` and
an ``int`` in ``[0, 2**128)`` to its 16-byte big-endian form, so both keep their natural order.
A value is a signed 64-bit int; ``None`` in an update means "remove".
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping

from .errors import InvalidInputError, InvalidKeyError, InvalidValueError

KEY_SIZE = 16
MIN_KEY = bytes(KEY_SIZE)
VALUE_MIN, VALUE_MAX = -(1 << 63), (1 << 63) - 1
_KEY_LIMIT = 1 << 128


def to_key(key: object) -> bytes:
    """The canonical 16-byte form of a user key, or ``InvalidKeyError`` saying what is wrong."""
    if type(key) is bytes:
        if len(key) == KEY_SIZE:
            return key
        raise InvalidKeyError(f"key must be {KEY_SIZE} bytes, got {len(key)} bytes: {key!r}")
    if isinstance(key, uuid.UUID):
        return key.bytes
    if isinstance(key, (bytearray, memoryview)):
        return to_key(bytes(key))
    if isinstance(key, int) and not isinstance(key, bool):
        if 0 <= key < _KEY_LIMIT:
            return key.to_bytes(KEY_SIZE, "big")
        raise InvalidKeyError(f"int key must be in [0, 2**128), got {key}")
    raise InvalidKeyError(f"key must be 16 bytes, a uuid.UUID or an int in [0, 2**128), got {type(key).__name__}")


def to_value(value: object) -> int:
    """A stored value (signed 64-bit int), or ``InvalidValueError``."""
    if type(value) is int and VALUE_MIN <= value <= VALUE_MAX:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidValueError(f"value must be an int (or None to remove), got {type(value).__name__}: {value!r}")
    if not VALUE_MIN <= value <= VALUE_MAX:
        raise InvalidValueError(f"value {value} is outside the signed 64-bit range [-2**63, 2**63)")
    return int(value)


def to_update(value: object) -> int | None:
    """A value in an update: an int, or ``None`` meaning remove."""
    return None if value is None else to_value(value)


def pair_iter(updates: object, what: str = "updates") -> Iterator:
    """An iterator over updates given as a mapping's items or an iterable of pairs (streamed, not
    listed), or ``InvalidInputError`` for ``None``, a single str/bytes value or a non-iterable."""
    if isinstance(updates, Mapping):
        return iter(updates.items())
    if updates is None or isinstance(updates, (str, bytes, bytearray, memoryview)):
        raise InvalidInputError(f"{what} must be a mapping or a list of (key, value) pairs, got {updates!r:.60}")
    try:
        return iter(updates)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidInputError(f"{what} must be a mapping or a list of (key, value) pairs, "
                                f"got {type(updates).__name__}") from None


def pair_list(updates: object, what: str = "updates") -> list:
    """Updates given as an iterable (of pairs or update objects) as a list, or ``InvalidInputError``
    for ``None``, a single str/bytes value or a non-iterable."""
    if isinstance(updates, Mapping):  # a mapping here is not a list of pairs: iterating gives its keys
        return list(updates)
    return list(pair_iter(updates, what))


def to_keys(keys: object) -> list[bytes]:
    """Canonical forms of an iterable of keys; a single key (bytes, str, int...) or a
    non-iterable is ``InvalidKeyError``, not a list of one-byte keys."""
    if keys is None or isinstance(keys, (bytes, bytearray, memoryview, str, int, uuid.UUID)):
        raise InvalidKeyError(f"keys must be an iterable of keys, got a single {type(keys).__name__}: {keys!r:.60}")
    try:
        return [to_key(k) for k in keys]  # type: ignore[attr-defined]
    except TypeError:
        raise InvalidKeyError(f"keys must be an iterable of keys, got {type(keys).__name__}") from None


def all_canonical_keys(keys: Iterable[object]) -> bool:
    """Whether every key is 16 ``bytes`` (checked with C-level passes, no Python call per key)."""
    return not keys or (set(map(type, keys)) == {bytes} and set(map(len, keys)) == {KEY_SIZE})


def all_canonical_values(values) -> bool:
    """Whether every value is an int64 or ``None`` (C-level passes but for dropping the ``None``s)."""
    values = values if isinstance(values, list) else list(values)
    types = set(map(type, values))
    if not types <= {int, type(None)}:
        return False
    ints = [v for v in values if v is not None] if type(None) in types else values
    return not ints or (VALUE_MIN <= min(ints) and max(ints) <= VALUE_MAX)


def canonical_batch(updates) -> dict[bytes, int | None]:
    """``{16-byte key: int64 or None}``, the last value for a key winning; raises on bad input.

    Input that is already canonical (bytes keys, int values) is checked at C speed and used as is.
    """
    if isinstance(updates, Mapping):
        batch = updates if isinstance(updates, dict) else dict(updates)
        pairs = updates.items()
    else:
        pairs = updates if isinstance(updates, (list, tuple)) else pair_list(updates)
        try:
            batch = dict(pairs)
        except (TypeError, ValueError):  # unhashable key forms (bytearray) or malformed pairs
            batch = {}
    if batch and all_canonical_keys(batch) and all_canonical_values(batch.values()):
        return batch
    canonical: dict[bytes, int | None] = {}
    for i, pair in enumerate(pairs):  # the original order, so the last value wins across key forms
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidInputError(f"update {i} must be a (key, value) pair, got {pair!r:.60}")
        canonical[to_key(pair[0])] = to_update(pair[1])
    return canonical
