"""Conditional attribute updates: validate a request against the current state, with no side effects.

An append may carry attribute updates. Each has a type (Pravega's ``AttributeUpdateType`` ids)
saying how its new value depends on the current one, and when it fails:

======================  =========================================================================
``NONE``                create only if absent; fails if a value is present
``REPLACE``             set unconditionally (``None`` removes)
``REPLACE_IF_GREATER``  absent passes; otherwise fails unless the new value > current
``ACCUMULATE``          current + value (absent counts as 0); leaving the int64 range fails
``REPLACE_IF_EQUALS``   fails unless current == ``compare`` (``compare=None``: must be absent)
======================  =========================================================================

``resolve_updates`` computes the final values of a request, or raises ``ConditionalUpdateError``
naming every failed update. It only reads: the updates are frozen and nothing is written back into
them, so retrying a request that failed gives the same answer (unlike Pravega bug #5765, where
validation stored the accumulated sum into the request and a retry counted it twice).
"""

from __future__ import annotations

import enum
from typing import Callable, Sequence

import attrs

from .errors import ConditionalUpdateError, InvalidInputError, InvalidValueError
from .keys import VALUE_MAX, VALUE_MIN, pair_list, to_key, to_update

__all__ = ["AttributeUpdate", "UpdateFailure", "UpdateType", "resolve_updates"]


class UpdateType(enum.IntEnum):
    """How an update's new value depends on the current one (ids as in Pravega)."""

    NONE = 0  # create only if absent: fails if a value is present
    REPLACE = 1  # set unconditionally
    REPLACE_IF_GREATER = 2  # absent passes; fails unless new value > current
    ACCUMULATE = 3  # current + value (absent counts as 0); int64 overflow fails, never wraps
    REPLACE_IF_EQUALS = 4  # fails unless current == compare; compare=None means "must be absent"

    @classmethod
    def _missing_(cls, value: object) -> "UpdateType":
        """``UpdateType(x)`` for an unknown ``x``: ``InvalidInputError`` (a ``ValueError``) saying
        what is accepted, and names too (``UpdateType("accumulate")``)."""
        if isinstance(value, str):
            return _to_update_type(value)
        names = ", ".join(t.name for t in cls)
        raise InvalidInputError(f"unknown update type {value!r:.60}; expected an id 0..{len(cls) - 1} or a name ({names})")


def _to_update_type(kind: object) -> UpdateType:
    """An ``UpdateType`` from itself, its int id, or its name (any case), or ``InvalidInputError``."""
    if isinstance(kind, UpdateType):
        return kind
    names = ", ".join(t.name for t in UpdateType)
    if isinstance(kind, str):
        try:
            return UpdateType[kind.strip().upper()]
        except KeyError:
            raise InvalidInputError(f"unknown update type name {kind!r}; expected one of {names}") from None
    if isinstance(kind, int) and not isinstance(kind, bool):  # True is an int, but not an id
        try:
            return UpdateType(kind)
        except ValueError:
            raise InvalidInputError(
                f"unknown update type id {kind}; expected 0..{len(UpdateType) - 1} ({names})"
            ) from None
    raise InvalidInputError(
        f"update type must be an UpdateType, its int id or its name, got {type(kind).__name__}: {kind!r}"
    )


def _compare_value(compare: object) -> int | None:
    try:
        return to_update(compare)
    except InvalidValueError as exc:
        raise InvalidValueError(f"compare: {exc}") from None


@attrs.frozen
class AttributeUpdate:
    """One attribute update of an append: ``key`` gets ``value`` (``None`` removes) per ``update_type``.

    Frozen, so validating a request can never change it. Inputs are converted on construction:
    ``key`` as by ``attrindex.keys.to_key`` (16 bytes, ``uuid.UUID`` or int), ``update_type`` from an
    ``UpdateType``, its int id or its name (case-insensitive), ``value``/``compare`` as int64 or
    ``None``. ``ACCUMULATE`` and ``REPLACE_IF_GREATER`` need an int ``value``; ``compare`` is only
    for ``REPLACE_IF_EQUALS`` (where ``None`` means "the key must be absent").
    """

    key: bytes = attrs.field(converter=to_key)
    update_type: UpdateType = attrs.field(default=UpdateType.REPLACE, converter=_to_update_type)
    value: int | None = attrs.field(default=None, converter=to_update)
    compare: int | None = attrs.field(default=None, converter=_compare_value)

    def __attrs_post_init__(self) -> None:
        kind = self.update_type
        if self.value is None and kind in (UpdateType.ACCUMULATE, UpdateType.REPLACE_IF_GREATER):
            raise InvalidInputError(f"{kind.name} needs an int value, got None (key {self.key.hex()})")
        if self.compare is not None and kind is not UpdateType.REPLACE_IF_EQUALS:
            raise InvalidInputError(
                f"compare is only for REPLACE_IF_EQUALS, got compare={self.compare}"
                f" with {kind.name} (key {self.key.hex()})"
            )


@attrs.frozen
class UpdateFailure:
    """An update whose condition did not hold.

    ``current`` is the value the update was checked against (``None`` = absent): the stored value,
    or, when earlier updates of the same request touched the key, the result of those.
    """

    update: AttributeUpdate
    current: int | None
    reason: str


def _as_update(item: object) -> AttributeUpdate:
    if isinstance(item, AttributeUpdate):
        return item
    if isinstance(item, (tuple, list)) and len(item) == 2:  # a plain (key, value) pair: REPLACE
        return AttributeUpdate(item[0], UpdateType.REPLACE, item[1])
    raise InvalidInputError(
        f"an update must be an AttributeUpdate or a (key, value) pair, got {type(item).__name__}: {item!r}"
    )


def _check_current(keys: list[bytes], found: object) -> list[int | None]:
    """The callback's answer as a list, checked: one int64-or-None per key asked."""
    values = list(found)  # type: ignore[call-overload]
    if len(values) != len(keys):
        raise InvalidInputError(f"current_values returned {len(values)} values for {len(keys)} keys")
    for value in values:
        if value is not None and not (type(value) is int and VALUE_MIN <= value <= VALUE_MAX):
            raise InvalidInputError(f"current_values returned {value!r}; expected an int64 or None")
    return values


def _apply(update: AttributeUpdate, current: int | None) -> tuple[bool, int | None, str]:
    """``(passed, new value, reason)`` for one update against ``current``. Pure."""
    kind, value = update.update_type, update.value
    if kind is UpdateType.REPLACE:
        return True, value, ""
    if kind is UpdateType.NONE:
        if current is not None:
            return False, current, f"key already has value {current}"
        return True, value, ""
    if kind is UpdateType.REPLACE_IF_GREATER:
        if current is not None and not value > current:  # type: ignore[operator]
            return False, current, f"value {value} is not greater than current {current}"
        return True, value, ""
    if kind is UpdateType.ACCUMULATE:
        base = 0 if current is None else current
        total = base + value  # type: ignore[operator]
        if not VALUE_MIN <= total <= VALUE_MAX:
            return False, current, f"{base} + {value} = {total} leaves the signed 64-bit range"
        return True, total, ""
    # REPLACE_IF_EQUALS
    compare = update.compare
    if current == compare:
        return True, value, ""
    if compare is None:
        return False, current, f"expected the key to be absent, current is {current}"
    if current is None:
        return False, current, f"expected current {compare}, the key is absent"
    return False, current, f"current {current} does not equal compare {compare}"


def resolve_updates(
    updates: Sequence[AttributeUpdate | tuple[object, int | None]],
    current_values: Callable[[list[bytes]], list[int | None]],
) -> tuple[list[bytes], list[int | None]]:
    """The final value of every key ``updates`` touch, as parallel lists sorted by key.

    ``current_values`` is called once, with the distinct keys in first-appearance order, and must
    return their true current values (``None`` = absent). The updates are then applied in order,
    each seeing the results of the earlier ones on its key (a failed update changes nothing, and
    the rest are still checked). ``None`` in the returned values means removed or absent.

    Plain ``(key, value)`` pairs are accepted as ``REPLACE``. If any update fails, raises
    ``ConditionalUpdateError`` listing every failure with the value it was checked against.
    Nothing is mutated either way: the result depends only on the inputs, so a retry after a
    failure gives the same outcome. Bad input raises ``InvalidInputError`` (or its subclasses)
    before ``current_values`` is called.
    """
    converted = list(map(_as_update, updates if isinstance(updates, list) else pair_list(updates)))
    if not converted:
        return [], []
    keys = list(dict.fromkeys(u.key for u in converted))  # distinct, first-appearance order
    state = dict(zip(keys, _check_current(keys, current_values(list(keys)))))

    failures: list[UpdateFailure] = []
    for update in converted:
        current = state[update.key]
        passed, new, reason = _apply(update, current)
        if passed:
            state[update.key] = new
        else:
            failures.append(UpdateFailure(update, current, reason))
    if failures:
        raise ConditionalUpdateError(failures)

    ordered = sorted(state)
    return ordered, list(map(state.__getitem__, ordered))
