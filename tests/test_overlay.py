"""Tier 1 of the attribute state: the overlay of recent updates, and merging it with the tree."""

from __future__ import annotations

import random
import tracemalloc
from itertools import count, islice
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from attrindex.btree.columns import column_keys
from attrindex.keys import to_key
from attrindex.overlay import _STEP_KEYS, MISSING, SHARDS, AttributeOverlay, merge_scan, probe_many
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


def test_len_counts_the_keys_an_apply_set_before_it_failed():
    # len is counted once per apply, not on each call: an apply that fails part-way (a key that
    # is not bytes) must still be counted for the keys it did set.
    overlay = AttributeOverlay()
    overlay.apply([KEYS[0]], [1])
    with pytest.raises(TypeError):
        overlay.apply([KEYS[1], 12345, KEYS[2]], [2, 3, 4])  # type: ignore[list-item]
    assert overlay.get(KEYS[1]) == 2 and overlay.get(KEYS[2]) is MISSING
    assert len(overlay) == 2 == sum(1 for _ in overlay.items())


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


# -- the sharded entries (AttributeOverlay spreads its dicts by a key's next-to-last byte) --------
# Keys whose shard bytes differ yet share a shard (b, b + SHARDS, ...), keys of every shard, and
# arbitrary keys.
ALIASED = [bytes(14) + bytes([b, last]) for b in (0, SHARDS, 2 * SHARDS, 3 * SHARDS) for last in (0, 7)]
SPREAD = [to_key((i << 64) + (i * 37 % 256 << 8) + i) for i in range(64)]
wide_key_st = st.sampled_from(ALIASED + SPREAD + KEYS) | st.binary(min_size=16, max_size=16)


class ShardedOverlayMachine(RuleBasedStateMachine):
    """The overlay against a plain dict over keys of every shard, with scans left open while
    applies, folds and clears go on: each scan yields its snapshot's keys in order, each value of
    the recent part as it is when reached (the old contents after a clear or a fold), each value
    of the settled part as it was when the scan started. ``len`` counts a key in both parts twice."""

    def __init__(self):
        super().__init__()
        self.overlay = AttributeOverlay()
        self.model: dict[bytes, int | None] = {}
        self.recent: set[bytes] = set()
        self.settled: set[bytes] = set()
        self.scans: list[tuple[Iterator, list[bytes], dict, dict]] = []

    @rule(pairs=st.lists(st.tuples(wide_key_st, update_value_st), max_size=20))
    def apply(self, pairs):
        self.overlay.apply([k for k, _ in pairs], [v for _, v in pairs])
        self.model.update(pairs)
        self.recent.update(k for k, _ in pairs)

    @rule()
    def fold(self):
        self.overlay.fold()
        self.settled |= self.recent
        self.recent = set()
        self.model = dict(self.model)  # open scans keep reading the old dicts, which stop changing

    @rule(pairs=st.lists(st.tuples(wide_key_st, update_value_st), max_size=20))
    def absorb(self, pairs):
        newer = AttributeOverlay()
        newer.apply([k for k, _ in pairs], [v for _, v in pairs])
        self.overlay.absorb(newer)
        self.model = {**self.model, **dict(pairs)}
        self.settled |= self.recent | {k for k, _ in pairs}
        self.recent = set()

    @rule(keys=st.lists(wide_key_st, max_size=10))
    def get_and_get_many(self, keys):
        expected = [self.model.get(k, MISSING) for k in keys]
        assert [self.overlay.get(k) for k in keys] == expected
        assert self.overlay.get_many(keys) == expected
        found = probe_many(self.overlay.lookup, keys)  # what a lock-free reader does: both parts
        if self.overlay.settled is not None:
            self.overlay.settled.get_many(keys, found)
        assert found == expected

    @precondition(lambda self: len(self.scans) < 3)
    @rule(start=st.none() | wide_key_st, stop=st.none() | wide_key_st)
    def open_scan(self, start, stop):
        snapshot = sorted(k for k in self.model if in_range(k, start, stop))
        settled_only = {k: self.model[k] for k in self.settled - self.recent}
        self.scans.append((self.overlay.items(start, stop), snapshot, self.model, settled_only))

    @precondition(lambda self: self.scans)
    @rule(which=st.integers(0, 2), take=st.integers(0, 5))
    def advance_scan(self, which, take):
        entry = self.scans[which % len(self.scans)]
        scan, remaining, contents, settled_only = entry
        for key, value in islice(scan, take):
            assert key == remaining.pop(0)
            # the recent part's values read when reached (later applies are seen), the settled part's as at the start
            assert value == (settled_only[key] if key in settled_only else contents[key])
        if not remaining:
            assert next(scan, None) is None
            self.scans.remove(entry)

    @rule()
    def sorted_items_and_columns(self):
        keys = sorted(self.model)
        assert self.overlay.sorted_items() == (keys, [self.model[k] for k in keys])
        columns, values, gone = self.overlay.sorted_columns()
        assert column_keys(columns) == keys
        assert [None if g else v for v, g in zip(values.tolist(), gone.tolist())] == [self.model[k] for k in keys]

    @precondition(lambda self: len(self.model) > 3)
    @rule()
    def clear(self):
        self.overlay.clear()
        self.model = {}  # open scans keep the old dict, as they keep the old shards
        self.recent, self.settled = set(), set()

    @invariant()
    def size(self):
        assert len(self.overlay) == len(self.recent) + len(self.settled)
        assert self.overlay.recent_count == len(self.recent)


ShardedOverlayMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestShardedOverlayModel = ShardedOverlayMachine.TestCase


def test_many_new_keys_are_sorted_in_steps_across_shards():
    # More new keys than one step: the sorted list is rebuilt from all shards (the bucket sort);
    # then a few more go the incremental way (each shard's newest keys).
    rng = random.Random(5)
    overlay, model = AttributeOverlay(), {}
    for size in (_STEP_KEYS + 1000, 50, 3000):
        keys = [rng.randbytes(16) for _ in range(size)] + [to_key(i) for i in range(size // 50)]
        values = [rng.choice([None, rng.randrange(-(2**63), 2**63)]) for _ in keys]
        overlay.apply(keys, values)
        model.update(zip(keys, values))
        assert list(overlay.items()) == sorted(model.items())


def test_no_apply_regrows_the_whole_overlay():
    # One dict doubled its table inside the apply that crossed 87k, 175k, 350k, ... keys: one
    # C-level rehash of every entry holding the GIL (8-32 ms of the caller's CPU at 175k-700k
    # keys). The overlay grows by a shard at a time: no 1,000-key apply into 240k entries (random
    # keys, as from uuid4, and sequential integers) allocates more than a few shards' tables.
    rng = random.Random(11)
    random_keys = [rng.randbytes(16) for _ in range(240_000)]
    sequential = [to_key(i) for i in range(240_000)]
    for keys in (random_keys, sequential):
        overlay, worst = AttributeOverlay(), 0
        values = [None] * 1000
        tracemalloc.start()
        try:
            for i in range(0, len(keys), 1000):
                tracemalloc.reset_peak()
                before, _ = tracemalloc.get_traced_memory()
                overlay.apply(keys[i:i + 1000], values)
                worst = max(worst, tracemalloc.get_traced_memory()[1] - before)
        finally:
            tracemalloc.stop()
        assert len(overlay) == len(keys)
        # One dict allocates a 2^19-slot table (~5 MiB) when it crosses 175k keys; the shards
        # (2.7k keys each) a few 150 KiB ones (~1.1 MiB in the worst apply of this seed).
        assert worst < 2 << 20, f"an apply allocated {worst:,} bytes"


def test_probe_many_edges():
    overlay = AttributeOverlay()
    assert probe_many(overlay.lookup, [KEYS[0], KEYS[1]]) == [MISSING, MISSING]
    assert probe_many(overlay.lookup, [KEYS[0]]) == [MISSING] and probe_many(overlay.lookup, []) == []
    overlay.apply([KEYS[0]], [5])
    assert probe_many(overlay.lookup, [KEYS[0]]) == [5] and probe_many(overlay.lookup, []) == []
    with pytest.raises(ValueError):  # the shard bytes are sliced from the joined keys
        probe_many(overlay.lookup, [b"short", KEYS[0]])


def test_tier_1_folded_into_columns_holds_about_25_bytes_a_key(monkeypatch):
    """The memory bound of tier 1: 150k keys applied in batches of 1,000 with folds every 16,384
    hold their settled part in columns (25 bytes a key) and at most one recent part in dicts;
    unfolded they take over 100 bytes a key. Measured with tracemalloc (numpy reports its arrays)."""
    from attrindex import overlay as overlay_module

    count = 150_000

    def batch(i: int) -> tuple[list[bytes], list[int]]:  # made as the WAL's decoding makes them: new objects
        rng = random.Random(i)
        return [rng.getrandbits(128).to_bytes(16, "big") for _ in range(1000)], [rng.getrandbits(40) for _ in range(1000)]

    def held(fold_keys: int) -> int:
        monkeypatch.setattr(overlay_module, "FOLD_KEYS", fold_keys)
        tracemalloc.start()
        try:
            overlay = AttributeOverlay()
            for i in range(count // 1000):
                overlay.apply(*batch(i))
                if overlay.fold_due:
                    overlay.fold()
            size, _peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        keys, values = batch(7)
        assert overlay.get(keys[5]) == values[5] and len(overlay) == count
        return size

    folded = held(16_384)
    assert folded <= 25 * count + 200 * 16_384, folded  # the columns, and one recent part at most
    assert held(1 << 40) >= 100 * count  # never folded: dicts, the keys and the ints
