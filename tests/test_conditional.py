"""Conditional attribute updates: the semantics table, ordering, failures, purity, input conversion."""

from __future__ import annotations

import pickle
import uuid

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attrindex.conditional import AttributeUpdate, UpdateFailure, UpdateType, resolve_updates
from attrindex.errors import ConditionalUpdateError, InvalidInputError, InvalidKeyError, InvalidValueError
from attrindex.keys import VALUE_MAX, VALUE_MIN, to_key

K1, K2, K3 = to_key(1), to_key(2), to_key(3)
T = UpdateType


class Store:
    """The ``current_values`` callback over a dict, recording every call."""

    def __init__(self, values: dict[bytes, int] | None = None):
        self.values = dict(values or {})
        self.calls: list[list[bytes]] = []

    def __call__(self, keys: list[bytes]) -> list[int | None]:
        self.calls.append(list(keys))
        return [self.values.get(k) for k in keys]


def resolve(updates, store: dict | None = None):
    """``{key: final}`` for a request against ``store``."""
    keys, values = resolve_updates(updates, Store(store))
    return dict(zip(keys, values))


def failures_of(updates, store: dict | None = None) -> list[UpdateFailure]:
    with pytest.raises(ConditionalUpdateError) as info:
        resolve_updates(updates, Store(store))
    return info.value.failures


def U(kind, value=None, compare=None, key=K1):
    return AttributeUpdate(key, kind, value, compare)


# -- NONE ------------------------------------------------------------------------------------------
def test_none_creates_when_absent():
    assert resolve([U(T.NONE, 5)]) == {K1: 5}


def test_none_fails_when_present():
    [failure] = failures_of([U(T.NONE, 5)], {K1: 7})
    assert failure.current == 7 and "already has value 7" in failure.reason


def test_none_with_none_value_passes_when_absent_and_leaves_it_absent():
    assert resolve([U(T.NONE, None)]) == {K1: None}


def test_none_with_none_value_fails_when_present():
    [failure] = failures_of([U(T.NONE, None)], {K1: 7})
    assert failure.current == 7


# -- REPLACE ---------------------------------------------------------------------------------------
def test_replace_sets_when_absent():
    assert resolve([U(T.REPLACE, 5)]) == {K1: 5}


def test_replace_sets_when_present():
    assert resolve([U(T.REPLACE, 5)], {K1: 7}) == {K1: 5}


def test_replace_with_none_removes():
    assert resolve([U(T.REPLACE, None)], {K1: 7}) == {K1: None}


def test_replace_with_none_on_absent_key_stays_absent():
    assert resolve([U(T.REPLACE, None)]) == {K1: None}


# -- REPLACE_IF_GREATER ----------------------------------------------------------------------------
def test_replace_if_greater_passes_when_absent():
    assert resolve([U(T.REPLACE_IF_GREATER, -5)]) == {K1: -5}


def test_replace_if_greater_fails_when_equal():
    [failure] = failures_of([U(T.REPLACE_IF_GREATER, 7)], {K1: 7})
    assert failure.current == 7 and failure.reason == "value 7 is not greater than current 7"


def test_replace_if_greater_fails_when_smaller():
    [failure] = failures_of([U(T.REPLACE_IF_GREATER, 5)], {K1: 7})
    assert failure.current == 7 and failure.reason == "value 5 is not greater than current 7"


def test_replace_if_greater_passes_when_greater():
    assert resolve([U(T.REPLACE_IF_GREATER, 8)], {K1: 7}) == {K1: 8}


# -- ACCUMULATE ------------------------------------------------------------------------------------
def test_accumulate_counts_absent_as_zero():
    assert resolve([U(T.ACCUMULATE, 5)]) == {K1: 5}


def test_accumulate_adds():
    assert resolve([U(T.ACCUMULATE, -3)], {K1: 7}) == {K1: 4}


def test_accumulate_up_to_the_bounds_passes():
    assert resolve([U(T.ACCUMULATE, 1)], {K1: VALUE_MAX - 1}) == {K1: VALUE_MAX}
    assert resolve([U(T.ACCUMULATE, -1)], {K1: VALUE_MIN + 1}) == {K1: VALUE_MIN}


def test_accumulate_overflow_above_value_max_fails():
    [failure] = failures_of([U(T.ACCUMULATE, 1)], {K1: VALUE_MAX})
    assert failure.current == VALUE_MAX and "64-bit" in failure.reason


def test_accumulate_overflow_below_value_min_fails():
    [failure] = failures_of([U(T.ACCUMULATE, -1)], {K1: VALUE_MIN})
    assert failure.current == VALUE_MIN and "64-bit" in failure.reason


def test_accumulate_overflow_from_absent_cannot_happen_but_from_in_flight_value_can():
    [failure] = failures_of([U(T.ACCUMULATE, VALUE_MAX), U(T.ACCUMULATE, 1)])
    assert failure.current == VALUE_MAX and failure.update == U(T.ACCUMULATE, 1)


# -- REPLACE_IF_EQUALS -----------------------------------------------------------------------------
def test_replace_if_equals_compare_none_passes_when_absent():
    assert resolve([U(T.REPLACE_IF_EQUALS, 5, None)]) == {K1: 5}


def test_replace_if_equals_compare_none_fails_when_present():
    [failure] = failures_of([U(T.REPLACE_IF_EQUALS, 5, None)], {K1: 7})
    assert failure.current == 7 and "absent" in failure.reason


def test_replace_if_equals_mismatch_fails():
    [failure] = failures_of([U(T.REPLACE_IF_EQUALS, 5, 6)], {K1: 7})
    assert failure.current == 7 and failure.reason == "current 7 does not equal compare 6"


def test_replace_if_equals_compare_given_but_key_absent_fails():
    [failure] = failures_of([U(T.REPLACE_IF_EQUALS, 5, 6)])
    assert failure.current is None and "absent" in failure.reason


def test_replace_if_equals_match_passes():
    assert resolve([U(T.REPLACE_IF_EQUALS, 5, 7)], {K1: 7}) == {K1: 5}


def test_replace_if_equals_match_with_none_value_removes():
    assert resolve([U(T.REPLACE_IF_EQUALS, None, 7)], {K1: 7}) == {K1: None}


# -- several updates in one request ----------------------------------------------------------------
def test_two_accumulates_on_one_key_sum():
    assert resolve([U(T.ACCUMULATE, 2), U(T.ACCUMULATE, 3)], {K1: 10}) == {K1: 15}


def test_replace_if_equals_after_replace_sees_the_new_value():
    assert resolve([U(T.REPLACE, 8), U(T.REPLACE_IF_EQUALS, 9, 8)], {K1: 7}) == {K1: 9}
    [failure] = failures_of([U(T.REPLACE, 8), U(T.REPLACE_IF_EQUALS, 9, 7)], {K1: 7})
    assert failure.current == 8  # the in-flight value it was checked against


def test_none_after_remove_in_the_same_request_passes():
    assert resolve([U(T.REPLACE, None), U(T.NONE, 4)], {K1: 7}) == {K1: 4}


def test_result_is_sorted_by_key_and_holds_every_touched_key():
    updates = [U(T.REPLACE, 3, key=K3), U(T.NONE, None, key=K2), U(T.ACCUMULATE, 1)]
    keys, values = resolve_updates(updates, Store({K1: 1}))
    assert keys == [K1, K2, K3] and values == [2, None, 3]


def test_empty_request_returns_empty_lists_without_reading():
    store = Store()
    assert resolve_updates([], store) == ([], [])
    assert store.calls == []


def test_plain_pairs_mean_replace():
    assert resolve([(K1, 5), (2, None), [uuid.UUID(int=3), 9]], {K2: 1}) == {K1: 5, K2: None, K3: 9}


# -- failures --------------------------------------------------------------------------------------
def test_every_failure_is_reported_with_its_current_value():
    updates = [
        U(T.NONE, 1, key=K1),  # fails: K1 is 10
        U(T.REPLACE, 5, key=K2),  # passes
        U(T.REPLACE_IF_GREATER, 3, key=K2),  # fails against the in-flight 5
        U(T.REPLACE_IF_EQUALS, 1, 99, key=K3),  # fails: K3 is 30
        U(T.ACCUMULATE, 1, key=K1),  # passes
    ]
    failures = failures_of(updates, {K1: 10, K2: 20, K3: 30})
    assert [(f.update, f.current) for f in failures] == [(updates[0], 10), (updates[2], 5), (updates[3], 30)]


def test_error_message_names_key_type_value_compare_and_current():
    update = U(T.REPLACE_IF_EQUALS, 5, 6, key=K2)
    with pytest.raises(ConditionalUpdateError) as info:
        resolve_updates([update], Store({K2: 7}))
    message = str(info.value)
    for part in (K2.hex(), "REPLACE_IF_EQUALS", "value=5", "compare=6", "current=7", "does not equal"):
        assert part in message


def test_error_pickles_with_its_failures():
    with pytest.raises(ConditionalUpdateError) as info:
        resolve_updates([U(T.NONE, 1)], Store({K1: 2}))
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.failures == info.value.failures and str(copy) == str(info.value)


# -- no side effects -------------------------------------------------------------------------------
def test_validation_has_no_side_effects_after_failure_and_retry_gives_the_same_result():
    updates = [U(T.ACCUMULATE, 5), U(T.ACCUMULATE, 5, key=K2), U(T.NONE, 1, key=K2), (K3, 4)]
    before = [attrs.evolve(u) if isinstance(u, AttributeUpdate) else u for u in updates]
    snapshot = list(updates)
    store = Store({K1: 100, K2: 1})
    outcomes = []
    for _ in range(3):
        with pytest.raises(ConditionalUpdateError) as info:
            resolve_updates(updates, store)
        outcomes.append([(f.update, f.current, f.reason) for f in info.value.failures])
        assert updates == before and all(a is b for a, b in zip(updates, snapshot))
    assert outcomes[0] == outcomes[1] == outcomes[2] == [(updates[2], 6, "key already has value 6")]
    assert store.values == {K1: 100, K2: 1}
    assert store.calls == [[K1, K2, K3]] * 3  # once per request, distinct keys, first-appearance order


def test_validation_has_no_side_effects_after_success():
    updates = [U(T.ACCUMULATE, 5), U(T.ACCUMULATE, 5), U(T.REPLACE_IF_EQUALS, 1, None, key=K2)]
    before = [attrs.evolve(u) for u in updates]
    store = Store({K1: 100})
    first = resolve_updates(updates, store)
    assert first == ([K1, K2], [110, 1])
    assert updates == before and store.values == {K1: 100}
    assert resolve_updates(updates, store) == first  # no double accumulation
    assert store.calls == [[K1, K2], [K1, K2]]


def test_updates_are_frozen():
    update = U(T.ACCUMULATE, 5)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        update.value = 6  # type: ignore[misc]


def test_bad_callback_answer_is_reported():
    with pytest.raises(InvalidInputError, match="1 values for 2 keys"):
        resolve_updates([(K1, 1), (K2, 2)], lambda keys: [None])
    with pytest.raises(InvalidInputError, match="int64 or None"):
        resolve_updates([(K1, 1)], lambda keys: ["7"])


# -- input conversion ------------------------------------------------------------------------------
def test_uuid_and_int_keys_are_canonical():
    u = uuid.uuid4()
    assert AttributeUpdate(u).key == u.bytes
    assert AttributeUpdate(1).key == K1
    assert AttributeUpdate(bytearray(K1)).key == K1


@pytest.mark.parametrize(
    "kind, expected",
    [
        (T.ACCUMULATE, T.ACCUMULATE),
        (3, T.ACCUMULATE),
        ("replace_if_equals", T.REPLACE_IF_EQUALS),
        ("Replace_If_Greater", T.REPLACE_IF_GREATER),
        ("NONE", T.NONE),
        (" replace ", T.REPLACE),
    ],
)
def test_update_type_conversion(kind, expected):
    assert AttributeUpdate(K1, kind, 1).update_type is expected


def test_defaults_are_replace_with_none():
    assert AttributeUpdate(K1) == AttributeUpdate(K1, T.REPLACE, None, None)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("replace_if_smaller", "unknown update type name"),
        (7, "unknown update type id 7"),
        (-1, "unknown update type id"),
        (True, "got bool"),
        (1.0, "got float"),
        (None, "got NoneType"),
    ],
)
def test_bad_update_type(kind, message):
    with pytest.raises(InvalidInputError, match=message):
        AttributeUpdate(K1, kind, 1)


@pytest.mark.parametrize("key", [b"short", 2**128, -1, "a string", 1.5, None])
def test_bad_key(key):
    with pytest.raises(InvalidKeyError):
        AttributeUpdate(key, T.REPLACE, 1)


@pytest.mark.parametrize("value", [VALUE_MAX + 1, VALUE_MIN - 1, 1.5, "7", True])
def test_bad_value_and_compare(value):
    with pytest.raises(InvalidValueError):
        AttributeUpdate(K1, T.REPLACE, value)
    with pytest.raises(InvalidValueError):
        AttributeUpdate(K1, T.REPLACE_IF_EQUALS, 1, value)


@pytest.mark.parametrize("kind", [T.ACCUMULATE, T.REPLACE_IF_GREATER])
def test_types_that_need_an_int_value(kind):
    with pytest.raises(InvalidInputError, match=f"{kind.name} needs an int value"):
        AttributeUpdate(K1, kind, None)


@pytest.mark.parametrize("kind", [T.NONE, T.REPLACE, T.REPLACE_IF_GREATER, T.ACCUMULATE])
def test_compare_only_for_replace_if_equals(kind):
    with pytest.raises(InvalidInputError, match="compare is only for REPLACE_IF_EQUALS"):
        AttributeUpdate(K1, kind, 1, 2)


@pytest.mark.parametrize("item", [(K1,), (K1, 1, 2), K1, 5, {K1: 1}])
def test_bad_request_items_fail_before_reading(item):
    store = Store()
    with pytest.raises(InvalidInputError):
        resolve_updates([item], store)
    assert store.calls == []


# -- model -----------------------------------------------------------------------------------------
def model_resolve(updates: list[AttributeUpdate], stored: dict[bytes, int]):
    """The table, written out directly: ``(final dict, failures)``."""
    state = {u.key: stored.get(u.key) for u in updates}
    failures = []
    for u in updates:
        cur = state[u.key]
        if u.update_type == T.NONE:
            ok, new = cur is None, u.value
        elif u.update_type == T.REPLACE:
            ok, new = True, u.value
        elif u.update_type == T.REPLACE_IF_GREATER:
            ok, new = cur is None or u.value > cur, u.value
        elif u.update_type == T.ACCUMULATE:
            new = (cur or 0) + u.value
            ok = VALUE_MIN <= new <= VALUE_MAX
        else:
            ok, new = cur == u.compare, u.value
        if ok:
            state[u.key] = new
        else:
            failures.append((u, cur))
    return state, failures


KEYS = [to_key(i) for i in (0, 1, 2, 2**127, 2**128 - 1)]
VALUES = st.one_of(st.integers(-3, 3), st.sampled_from([VALUE_MIN, VALUE_MIN + 1, VALUE_MAX - 1, VALUE_MAX]))


@st.composite
def updates_strategy(draw):
    kind = draw(st.sampled_from(list(T)))
    key = draw(st.sampled_from(KEYS))
    needs_int = kind in (T.ACCUMULATE, T.REPLACE_IF_GREATER)
    value = draw(VALUES if needs_int else st.none() | VALUES)
    compare = draw(st.none() | VALUES) if kind == T.REPLACE_IF_EQUALS else None
    if draw(st.booleans()) and kind == T.REPLACE:
        return (key, value)  # a plain pair
    return AttributeUpdate(key, kind, value, compare)


@settings(max_examples=300, deadline=None)
@given(
    updates=st.lists(updates_strategy(), max_size=12),
    stored=st.dictionaries(st.sampled_from(KEYS), VALUES),
)
def test_matches_the_table_model(updates, stored):
    canonical = [u if isinstance(u, AttributeUpdate) else AttributeUpdate(u[0], value=u[1]) for u in updates]
    expected, expected_failures = model_resolve(canonical, stored)
    store = Store(stored)
    if expected_failures:
        with pytest.raises(ConditionalUpdateError) as info:
            resolve_updates(updates, store)
        assert [(f.update, f.current) for f in info.value.failures] == expected_failures
    else:
        keys, values = resolve_updates(updates, store)
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        assert dict(zip(keys, values)) == expected
    if updates:
        assert store.calls == [list(dict.fromkeys(u.key for u in canonical))]
    else:
        assert store.calls == []
