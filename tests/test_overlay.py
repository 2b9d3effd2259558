"""Tier 1 of the attribute state: the overlay of recent updates, and merging it with the tree."""

from __future__ import annotations

from itertools import count, islice

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from attrindex.keys import to_key
from attrindex.overlay import MISSING, AttributeOverlay, merge_scan
from attrindex.value_cache import MISSING as CACHE_MISSING

# A small key space, so updates collide with known keys; includes both ends of the key order.
KEYS = [to_key(i) for i in (0, 1, 2, 3, 5, 8, 13, 255, 256, 2**64, 2**127, 2**128 - 1)]
key_st = st.sampled_from(KEYS)
bound_st = st.none() | key_st | st.binary(min_size=16, max_size=16)
update_value_st = st.none() | st.integers(-(2**63), 2**63 - 1)


def in_range(key, start, stop):
    return (start is None or start <= key) and (stop is None or key < stop)


def test_missing_is_the_value_cache_sentinel():
    assert MISSING is CACHE_MISSING


def test_basic_get_apply_and_removals_shadow():
    overlay = AttributeOverlay()
    assert overlay.get(KEYS[0]) is MISSING and len(overlay) == 0
    overlay.apply([KEYS[1], KEYS[0], KEYS[1]], [1, None, 2])  # later wins
    assert overlay.get(KEYS[1]) == 2 and overlay.get(KEYS[0]) is None
    assert overlay.get_many([KEYS[0], KEYS[2], KEYS[1]]) == [None, MISSING, 2]
    assert list(overlay.items()) == [(KEYS[0], None), (KEYS[1], 2)]
    assert overlay.sorted_items() == ([KEYS[0], KEYS[1]], [None, 2])
    overlay.clear()
    assert len(overlay) == 0 and list(overlay.items()) == [] and overlay.get(KEYS[1]) is MISSING


def test_apply_rejects_mismatched_lengths_without_changing_anything():
    overlay = AttributeOverlay()
    with pytest.raises(ValueError):
        overlay.apply([KEYS[0], KEYS[1]], [1])
    assert len(overlay) == 0


def test_nbytes_grows_with_entries():
    overlay = AttributeOverlay()
    empty = overlay.nbytes
    overlay.apply(KEYS, list(range(len(KEYS))))
    full = overlay.nbytes
    assert full > empty and full >= 16 * len(KEYS)
    overlay.apply(KEYS, [None] * len(KEYS))  # same keys: no growth
    assert overlay.nbytes == full


def test_sorted_items_returns_copies():
    overlay = AttributeOverlay()
    overlay.apply([KEYS[2], KEYS[1]], [2, 1])
    keys, values = overlay.sorted_items()
    keys.append(KEYS[5])
    values[0] = 99
    assert overlay.sorted_items() == ([KEYS[1], KEYS[2]], [1, 2])


class OverlayMachine(RuleBasedStateMachine):
    """The overlay against a plain dict."""

    def __init__(self):
        super().__init__()
        self.overlay = AttributeOverlay()
        self.model: dict[bytes, int | None] = {}

    @rule(pairs=st.lists(st.tuples(key_st, update_value_st), max_size=8))
    def apply(self, pairs):
        self.overlay.apply([k for k, _ in pairs], [v for _, v in pairs])
        self.model.update(pairs)

    @rule(key=key_st)
    def get(self, key):
        assert self.overlay.get(key) == self.model.get(key, MISSING)

    @rule(keys=st.lists(key_st, max_size=6))
    def get_many(self, keys):
        assert self.overlay.get_many(keys) == [self.model.get(k, MISSING) for k in keys]

    @rule(start=bound_st, stop=bound_st)
    def items(self, start, stop):
        expected = sorted((k, v) for k, v in self.model.items() if in_range(k, start, stop))
        assert list(self.overlay.items(start, stop)) == expected

    @rule()
    def sorted_items(self):
        keys = sorted(self.model)
        assert self.overlay.sorted_items() == (keys, [self.model[k] for k in keys])

    @precondition(lambda self: len(self.model) > 3)
    @rule()
    def clear(self):
        self.overlay.clear()
        self.model.clear()

    @invariant()
    def size(self):
        assert len(self.overlay) == len(self.model)
        assert self.overlay.nbytes >= len(self.model) * 16


OverlayMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestOverlayModel = OverlayMachine.TestCase


@settings(max_examples=300, deadline=None)
@given(
    tree=st.dictionaries(key_st, st.integers(-(2**63), 2**63 - 1)),
    batches=st.lists(st.dictionaries(key_st, update_value_st), max_size=3),
    start=bound_st,
    stop=bound_st,
)
def test_merge_scan_matches_a_dict_model(tree, batches, start, stop):
    overlay = AttributeOverlay()
    current = dict(tree)
    for batch in batches:
        overlay.apply(list(batch), list(batch.values()))
        for k, v in batch.items():
            if v is None:
                current.pop(k, None)
            else:
                current[k] = v
    tree_items = iter(sorted((k, v) for k, v in tree.items() if in_range(k, start, stop)))
    merged = list(merge_scan(overlay.items(start, stop), tree_items))
    assert merged == sorted((k, v) for k, v in current.items() if in_range(k, start, stop))


def test_merge_scan_is_lazy():
    # Both sides are endless: only laziness lets this finish.
    overlay_side = ((to_key(2 * i), None if i % 3 == 0 else -i) for i in count())  # even keys
    tree_side = ((to_key(i), i) for i in count())
    first = list(islice(merge_scan(overlay_side, tree_side), 6))
    # 0 removed; 1 tree; 2 overlay -1; 3 tree; 4 overlay -2; 5 tree
    assert first == [(to_key(k), v) for k, v in [(1, 1), (2, -1), (3, 3), (4, -2), (5, 5), (7, 7)]]


def test_merge_scan_with_one_side_empty():
    tree = [(KEYS[0], 1), (KEYS[1], 2)]
    assert list(merge_scan(iter([]), iter(tree))) == tree
    assert list(merge_scan(iter([(KEYS[0], None), (KEYS[2], 3)]), iter([]))) == [(KEYS[2], 3)]


@settings(max_examples=200, deadline=None)
@given(
    initial=st.dictionaries(key_st, update_value_st, min_size=1),
    steps=st.lists(st.tuples(st.integers(0, 3), st.dictionaries(key_st, update_value_st)), max_size=6),
    start=bound_st,
    stop=bound_st,
    clear_at=st.none() | st.integers(0, 5),
)
def test_items_while_applying_is_a_consistent_snapshot(initial, steps, start, stop, clear_at):
    overlay = AttributeOverlay()
    overlay.apply(list(initial), list(initial.values()))
    snapshot_keys = sorted(k for k in initial if in_range(k, start, stop))
    live = dict(initial)  # the values the scan's dict holds (clear() leaves the scan on the old one)
    current = dict(initial)  # the overlay's own contents
    scan = overlay.items(start, stop)
    seen = []
    for i, (take, batch) in enumerate(steps):
        for key, value in islice(scan, take):
            assert value == live[key]  # values are read when reached
            seen.append(key)
        if clear_at == i:
            overlay.clear()  # the scan keeps the old contents; later applies go to the new ones
            current = {}
        detached = clear_at is not None and clear_at <= i
        overlay.apply(list(batch), list(batch.values()))  # new keys before and after the position
        current.update(batch)
        if not detached:
            live.update(batch)
        # Another scan started now sees the new keys (and re-sorts, which must not disturb ours).
        assert list(overlay.items()) == sorted(current.items())
    for key, value in scan:
        assert value == live[key]
        seen.append(key)
    assert seen == snapshot_keys  # ascending, no key added or lost mid-scan
