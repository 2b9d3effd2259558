"""Bulk load: a fresh B+tree built bottom-up in one append, checked against a dict, the
tree's own verify, its shape, reopening, bad input, another writer's race and storage faults; and
``AttributeIndex.bulk_load`` beside another handle's pending updates, merges and refreshes; loads
from columns, against a dict and under faults at any append and a kill."""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attrindex import AttributeIndex
from attrindex.tree_index import TreeIndex
from attrindex.btree import bulk, spill
from attrindex.btree.columns import KEY_DTYPE, VALUE_DTYPE, merge_columns
from attrindex.btree.page import decode_page, encode_leaf, leaf_capacity
from attrindex.errors import (InvalidInputError, InvalidKeyError, InvalidValueError, OutcomeUnknownError, StorageError,
                              StorageFullError)
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage

from .conftest import make_s3_url

PAGE_SIZE = 120  # 4 leaf entries, 3 index entries per page: deep trees from few keys


def KEY_OF(i: int) -> bytes:
    return (i * 0x9E3779B97F4A7C15 % (1 << 128)).to_bytes(16, "big")


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


KEYS = st.integers(min_value=0, max_value=300).map(KEY_OF)
VALUES = st.one_of(st.none(), st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1))
PAIRS = st.lists(st.tuples(KEYS, VALUES), max_size=300)


def new_index(url: str | None = None, storage=None, page_size: int = PAGE_SIZE) -> TreeIndex:
    storage = storage if storage is not None else open_storage(url or f"memory://bulk-{uuid.uuid4().hex}")
    return TreeIndex(storage, page_size=page_size, cache_bytes=1 << 20)


def load(index: TreeIndex, pairs, **kwargs) -> int:
    """The bulk load under test (TreeIndex.bulk_load over BTreeIndex.bulk_load)."""
    return index.bulk_load(pairs, **kwargs)


def apply(model: dict, pairs) -> None:
    for key, value in pairs:  # the last value for a key wins; None removes
        if value is None:
            model.pop(key, None)
        else:
            model[key] = value


def check(index: TreeIndex, model: dict) -> None:
    assert list(index.items()) == sorted(model.items())
    assert len(index) == len(model)
    report = index.verify()
    assert report.ok, report.damage
    assert report.entries == len(model)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=PAIRS, pairs=PAIRS, order=st.sampled_from(["as given", "sorted", "reversed"]),
       existing=st.sampled_from(["empty", "updated", "bulk loaded"]))
def test_bulk_load_matches_a_dict(before, pairs, order, existing):
    _bulk_load_matches_a_dict(before, pairs, order, existing)


def _bulk_load_matches_a_dict(before, pairs, order, existing):
    index = new_index()
    model: dict = {}
    if existing == "updated":
        index.update(before)
        apply(model, before)
    elif existing == "bulk loaded":
        load(index, before)
        apply(model, before)
    if order == "sorted":
        pairs = sorted(pairs, key=lambda p: p[0])  # stable: the last of equal keys stays last
    elif order == "reversed":
        pairs = pairs[::-1]
    count = load(index, iter(pairs))  # a one-shot iterator
    apply(model, pairs)
    assert count == len(model)
    check(index, model)
    probe = [KEY_OF(i) for i in range(0, 300, 7)]
    assert index.get_many(probe) == [model.get(p) for p in probe]
    reopened = new_index(storage=index._segment.storage)
    check(reopened, model)
    assert [reopened.get(p) for p in probe] == [model.get(p) for p in probe]


@pytest.mark.parametrize("count", [1, 4, 5, 13, 100, 1000])
def test_leaves_and_index_pages_are_full(count):
    index = new_index()
    load(index, [(k(i), i) for i in range(count)])
    leaves, per_level = [], {}
    for depth, _offset, _length, page in index._tree.pages():
        per_level.setdefault(depth, []).append(len(page))
        if page.is_leaf:
            leaves.append(page)
    leaf_cap, index_cap = index._tree.leaf_capacity, index._tree.index_capacity
    sizes = [len(page) for page in sorted(leaves, key=lambda p: p.keys[0])]
    assert all(size == leaf_cap for size in sizes[:-1]) and 0 < sizes[-1] <= leaf_cap
    assert len(sizes) == -(-count // leaf_cap)
    for depth, sizes in per_level.items():
        if depth < max(per_level):  # index levels: full but the last two, never one child
            assert sum(size == index_cap for size in sizes) >= len(sizes) - 2 and min(sizes) >= (2 if len(sizes) > 1 or depth > 1 else 1)
    stats = index.stats()
    assert stats.page_count == sum(map(len, per_level.values()))
    assert stats.live_bytes + 72 == stats.length  # one append: every byte but the footer is a live page
    check(index, {k(i): i for i in range(count)})


# Keys that stress numpy's fixed-width byte strings: trailing and leading zero bytes, 0x80 and up.
_EDGE_KEY = st.builds(bytes, st.lists(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]), min_size=16, max_size=16))


@settings(max_examples=300, deadline=None)
@given(old=st.dictionaries(_EDGE_KEY, st.integers(-(1 << 63), (1 << 63) - 1), max_size=40),
       new=st.dictionaries(_EDGE_KEY, st.one_of(st.none(), st.integers(-(1 << 63), (1 << 63) - 1)), max_size=40))
def test_merging_columns_is_a_dict_update(old, new):
    keys = sorted(old)
    set_keys = sorted(key for key, value in new.items() if value is not None)
    removed = sorted(key for key, value in new.items() if value is None)
    merged_keys, merged_values = merge_columns(
        np.array(keys, KEY_DTYPE).reshape(-1), np.array([old[key] for key in keys], VALUE_DTYPE),
        np.array(set_keys, KEY_DTYPE).reshape(-1), np.array([new[key] for key in set_keys], VALUE_DTYPE),
        np.array(removed, KEY_DTYPE).reshape(-1))
    expected = {**old, **new}
    expected = {key: value for key, value in sorted(expected.items()) if value is not None}
    got_keys = [merged_keys[i:i + 1].tobytes() for i in range(len(merged_keys))]  # 16 bytes each, zeros kept
    assert got_keys == list(expected)
    assert merged_values.tolist() == list(expected.values())


def test_leaves_are_encoded_as_the_page_codec_does():
    builder = bulk._Builder(1000, leaf_capacity(4096), 100)
    keys = [k(i) for i in range(5)]
    builder.add(np.array(keys, KEY_DTYPE), np.array([-1, 0, 1, 1 << 62, -(1 << 63)], VALUE_DTYPE))
    data, _footer, _at = builder.finish(-1)
    page = encode_leaf(keys, [-1, 0, 1, 1 << 62, -(1 << 63)], 1000)
    assert data.startswith(page)
    assert decode_page(page, 1000).values == [-1, 0, 1, 1 << 62, -(1 << 63)]


def test_a_load_into_a_tree_makes_every_old_page_dead_and_truncation_reclaims_it(tmp_path):
    index = TreeIndex(open_storage(str(tmp_path)), page_size=4096, rolling_size=1 << 14)
    for n in range(20):
        index.update({k(i): n for i in range(n * 100, n * 100 + 100)})
    before = index.stats()
    load(index, [(k(i), -i) for i in range(0, 2000, 2)] + [(k(5), None)])
    after = index.stats()
    assert after.start_offset == before.length  # the fresh tree starts where the old one ended
    assert after.storage_bytes < after.length - before.length + (1 << 14)  # old chunks deleted
    model = {k(i): (19 if i >= 1900 else i // 100) for i in range(2000)}
    apply(model, [(k(i), -i) for i in range(0, 2000, 2)] + [(k(5), None)])
    check(index, model)
    check(TreeIndex(open_storage(str(tmp_path)), page_size=4096), model)


@pytest.mark.parametrize("bad, error", [
    ([(k(1), 1), (b"short", 2)], InvalidKeyError),
    ([(k(1), 1), (k(2), 1 << 63)], InvalidValueError),
    ([(k(1), 1), (k(2), "7")], InvalidValueError),
    ([(k(1), 1), (k(2), True)], InvalidValueError),
    ([(k(1), 1), (k(2), 1, 3)], InvalidInputError),
    ([(k(1), 1), k(2)], InvalidInputError),
    (None, InvalidInputError),
    ("pairs", InvalidInputError),
    (7, InvalidInputError),
])
def test_bad_input_writes_nothing(bad, error):
    index = new_index()
    index.update({k(0): 0})
    length = index.stats().length
    with pytest.raises(error):
        load(index, bad)
    # A bad pair far into a sorted stream: pages for the first ones were never written either.
    with pytest.raises(InvalidKeyError, match="pair 200000"):
        load(index, ((k(i), i) if i < 200_000 else ("x", i) for i in range(200_001)))
    assert index.stats().length == length and index.get(k(0)) == 0
    with pytest.raises(InvalidInputError):
        load(index, [(k(1), 1)], checkpoint=-1)
    assert new_index(storage=index._segment.storage).stats().length == length


def test_key_forms_mappings_and_the_last_duplicate():
    index = new_index()
    assert load(index, {uuid.UUID(int=3): 3, 2: 2}) == 2
    assert load(index, [(bytearray(k(1)), 1), [memoryview(k(2)), 2]]) == 3
    assert load(index, [(k(9), 1), (k(9), None), (k(8), 1), (k(8), 2), (k(2), None)]) == 3
    check(index, {k(1): 1, k(3): 3, k(8): 2})


def test_an_empty_load_into_an_empty_tree_writes_nothing():
    index = new_index()
    assert load(index, []) == 0 and load(index, [(k(1), None)]) == 0
    assert index.stats().length == 0
    index.update({k(1): 1})
    assert load(index, [(k(1), None)]) == 0  # everything removed: an empty tree is written
    check(index, {})


def test_the_recent_values_cache_never_answers_a_replaced_value():
    index = new_index()
    index.update({k(1): 1, k(2): 2})
    assert index.get(k(1)) == 1 and index.get_many([k(2), k(3)]) == [2, None]  # now cached
    load(index, [(k(1), 10), (k(2), None), (k(3), 3)])
    assert index.get(k(1)) == 10 and index.get_many([k(2), k(3)]) == [None, 3]


def test_checkpoints_only_move_forward():
    index = new_index()
    assert load(index, [(k(1), 1)], checkpoint=10) == 1 and index.checkpoint == 10
    length = index.stats().length
    assert load(index, [(k(2), 2)], checkpoint=10) == 1  # covered: skipped, nothing written
    assert index.stats().length == length and index.get(k(2)) is None
    assert load(index, [(k(2), 2)]) == 2 and index.checkpoint == 10  # None keeps it
    assert load(index, [], checkpoint=11) == 2 and index.checkpoint == 11


def test_progress_passes_each_count_up_to_their_total():
    index = new_index(page_size=4096)
    calls = []
    rng = random.Random(3)
    pairs = [(rng.randbytes(16), i) for i in range(100_000)]  # unsorted: read, sort, build
    load(index, pairs, progress=lambda done, total: calls.append((done, total)))
    passes, last = [[]], 0
    for done, total in calls:
        if done < last:
            passes.append([])
        passes[-1].append((done, total))
        last = done
    assert len(passes) == 3 and all(p[-1] == (100_000, 100_000) for p in passes)
    assert passes[1][0] == (0, 100_000)  # the sort pass shows at once, before its one long step


def test_progress_is_reported_up_to_the_total():
    index = new_index(page_size=4096)
    calls = []
    load(index, [(k(i), i) for i in range(200_000)], progress=lambda done, total: calls.append((done, total)))
    assert calls[0][1] == 200_000 and (200_000, 200_000) in calls
    assert calls[-1] == (200_000, 200_000)


def test_unsorted_after_a_sorted_start_and_duplicates_across_chunks():
    n = bulk.READ_CHUNK + 10
    pairs = [(k(i), i) for i in range(n)] + [(k(n - 1), -1), (k(3), -3), (k(n + 5), 5)]
    index = new_index(page_size=4096)
    load(index, iter(pairs))
    model: dict = {}
    apply(model, pairs)
    check(index, model)
    # Equal keys across a chunk boundary of sorted input: the later one wins.
    pairs = [(k(i), i) for i in range(bulk.READ_CHUNK)] + [(k(bulk.READ_CHUNK - 1), None), (k(n), 1)]
    index = new_index(page_size=4096)
    load(index, iter(pairs))
    model = {}
    apply(model, pairs)
    check(index, model)


def test_another_writer_between_read_and_append_is_merged_not_overwritten():
    storage = open_storage(f"memory://bulk-race-{uuid.uuid4().hex}")
    mine, other = new_index(storage=storage), new_index(storage=storage)
    mine.update({k(0): 0})

    def pairs():
        yield from ((k(i), i) for i in range(1, 50))
        other.update({k(100): 100, k(0): None})  # lands after this handle last looked

    assert load(mine, pairs()) == 50
    model = {k(i): i for i in range(1, 50)} | {k(100): 100}
    check(mine, model)
    check(new_index(storage=storage), model)


@pytest.mark.parametrize("where, fault", [
    *((where, fault) for where in ("memory", "local") for fault in ("fail_before", "lost_ack", "torn", "enospc")),
    ("s3", "lost_ack"),  # on objects, torn, enospc and fail_before all leave nothing (as on memory)
])
def test_a_fault_during_the_load_leaves_the_old_tree_or_the_new_one(where, fault, tmp_path, request):
    options = request.getfixturevalue("s3_options") if where == "s3" else {}
    url = {"memory": f"memory://bulk-faults-{uuid.uuid4().hex}", "local": str(tmp_path / "store"),
           "s3": make_s3_url(options) if options else ""}[where]  # 1 KiB pages: S3 reads stay few
    storage = FaultyStorage(open_storage(url, **options), seed=5)
    index = new_index(storage=storage, page_size=1024)
    old = {k(i): i for i in range(100)}
    index.update(old)
    new = {k(i): -i for i in range(50, 400)}
    storage.script(fault, op="append" if storage.appendable else "create")  # objects: one create per append
    try:
        load(index, new)
        loaded = True
    except StorageError as error:
        assert not isinstance(error, OutcomeUnknownError), "reading back settles what is stored"
        assert storage.injected
        loaded = False
    assert loaded == (fault == "lost_ack")
    expected = old | new if loaded else old
    check(index, expected)
    reopened = new_index(storage=open_storage(url, **options), page_size=1024)
    check(reopened, expected)  # never a mix: one version or the other
    # The handle goes on: the same load again (idempotent) and an update.
    load(index, new)
    index.update({k(1000): 1})
    check(new_index(storage=open_storage(url, **options), page_size=1024), old | new | {k(1000): 1})


def test_a_failed_truncation_after_the_load_does_not_fail_it(tmp_path):
    storage = FaultyStorage(open_storage(str(tmp_path)), seed=6)
    index = TreeIndex(storage, page_size=4096, rolling_size=1 << 12)
    for n in range(5):
        index.update({k(i): n for i in range(n * 200, n * 200 + 200)})
    storage.script("fail_before", op="delete", times=100)
    storage.script("fail_before", op="put_marker", times=100)
    assert load(index, {k(i): 7 for i in range(1000)}) == 1000
    storage.enabled = False
    check(index, {k(i): 7 for i in range(1000)})


_CHILD = """
import sys
import numpy as np
from attrindex.tree_index import TreeIndex
from storage_adapters import open_storage
index = TreeIndex(open_storage(sys.argv[1]), page_size=4096, rolling_size=1 << 16, piece_size=16384)
generation = int(sys.argv[2])
keys = np.arange(20_000, dtype=">u8")
words = np.stack([np.zeros_like(keys), keys], axis=1).astype(np.uint64)  # keys 0..19999, high word first
while True:
    generation += 1
    if sys.argv[3] == "columns":
        index.bulk_load_columns([(words[i:i + 5000], np.full(5000, generation)) for i in range(0, 20_000, 5000)])
    else:
        index.bulk_load(((i.to_bytes(16, "big"), generation) for i in range(20_000)))
    print(generation, flush=True)
"""


def test_a_loader_killed_mid_load_leaves_one_whole_generation(tmp_path):
    """SIGKILL a process bulk-loading generation after generation, from pairs, then (over what
    the first left) one loading from columns (every key holds the generation; each load is about
    30 pieces, so the kill lands in a piece, between two, or in the last append): the index
    reopens with every key at one generation, the last acknowledged or the one in flight."""
    directory = str(tmp_path / "store")
    rng = random.Random(11)
    seen = 0
    for attempt, source in enumerate(("pairs", "columns")):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, directory, str(seen), source], stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        # Kill only once a load was acknowledged (start-up alone can outlast a fixed sleep on a
        # loaded machine), then at a random point of the loads that follow.
        ready, _, _ = select.select([child.stdout], [], [], 120)
        first = child.stdout.readline() if ready else ""
        time.sleep(rng.random() * 0.5)
        child.send_signal(signal.SIGKILL)
        acknowledged = [int(line) for line in (first + child.stdout.read()).split()]
        child.wait()
        assert acknowledged, "the child finished no load in 120 s"
        index = TreeIndex(open_storage(directory), page_size=4096)
        assert index.verify().ok
        generations = {value for _key, value in index.items()}
        assert len(index) == 20_000 and len(generations) == 1, f"attempt {attempt}: a mix of {generations}"
        seen = generations.pop()
        assert seen in (acknowledged[-1], acknowledged[-1] + 1)


def test_pairs_read_and_checked_first_load_as_a_run():
    """A facade that must write before the load (its log entry) checks the pairs first."""
    run = bulk.read_pairs(iter([(k(2), 2), (k(1), 1), (k(3), None)]))
    with pytest.raises(InvalidKeyError):
        bulk.read_pairs([(k(1), 1), (b"x", 2)])
    index = new_index()
    index.update({k(3): 3})
    assert load(index, run) == 2
    check(index, {k(1): 1, k(2): 2})


def test_a_load_in_pieces_that_stops_at_any_append_leaves_the_old_tree(tmp_path):
    """A load larger than ``piece_size`` is appended in pieces that restate the old tree: wherever
    it stops, the old tree is what every reader sees, and the next load goes through."""
    url = str(tmp_path / "store")
    storage = FaultyStorage(open_storage(url), seed=3)
    index = TreeIndex(storage, page_size=1024, piece_size=4096)
    old = {k(i): i for i in range(300)}
    index.update(old)
    new = {k(i): -i for i in range(100, 2000)}  # about 45 KiB of pages: a dozen pieces
    stopped = 0
    while True:
        storage.script("fail_before", op="append", after=stopped)
        try:
            load(index, iter(new.items()))
        except StorageError:
            stopped += 1
            storage.cancel_scripts()
            check(TreeIndex(open_storage(url), page_size=1024), old)
            continue
        assert storage.cancel_scripts() == 1
        break
    assert stopped > 10, "the load was not written in pieces"
    check(TreeIndex(open_storage(url), page_size=1024), old | new)


def test_piece_size_is_checked(tmp_path):
    for bad in (512, 1.5, (1 << 30) + 1):
        with pytest.raises(InvalidInputError, match="piece_size"):
            TreeIndex(open_storage(str(tmp_path)), page_size=1024, piece_size=bad)


def test_load_reopen_and_truncate_on_every_backend(storage_url):
    url, options = storage_url
    index = TreeIndex(open_storage(url, **options), page_size=1024, rolling_size=1 << 12)
    for n in range(3):
        index.update({k(i): n for i in range(n * 100, n * 100 + 300)})
    model = {k(i): (i // 100 if i < 200 else 2) for i in range(500)}
    pairs = [(k(i), -i) for i in range(250, 700)] + [(k(1), None)]
    assert load(index, pairs) == len(model) + 200 - 1
    apply(model, pairs)
    check(index, model)
    reopened = TreeIndex(open_storage(url, **options), page_size=1024)
    check(reopened, model)
    assert reopened.stats().start_offset == reopened.stats().length - reopened.stats().live_bytes - 72


@pytest.mark.parametrize("shape", ["random", "shared-prefix", "duplicates-and-removals"])
def test_unsorted_input_into_a_tree_matches_a_dict(shape):
    """Keys equal up to their last bytes (the sort's first word ties), repeats and removals,
    loaded unsorted into a tree that holds some of them."""
    rng = random.Random(shape)
    if shape == "random":
        universe = [rng.randbytes(16) for _ in range(3000)]
    elif shape == "shared-prefix":  # equal up to the last bytes
        universe = [b"\xff" * 12 + rng.randbytes(4) for _ in range(3000)]
    else:
        universe = [bytes([rng.randrange(3), rng.randrange(4)]) + rng.randbytes(14) for _ in range(3000)]
    if shape == "duplicates-and-removals":
        pairs = [(rng.choice(universe), rng.choice([None, rng.randrange(-5, 5)])) for _ in range(6000)]
    else:
        pairs = [(key, rng.randrange(-(1 << 63), 1 << 63)) for key in set(universe)]
        rng.shuffle(pairs)
    index = new_index(page_size=1024)
    index.update({universe[i]: 1 for i in range(0, 3000, 3)})
    model = {universe[i]: 1 for i in range(0, 3000, 3)}
    load(index, pairs)
    apply(model, pairs)
    check(index, model)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs=st.lists(st.tuples(PAIRS, st.booleans()), max_size=4), read_chunk=st.integers(1, 9))
def test_read_pairs_in_small_chunks_matches_a_dict(runs, read_chunk):
    """Input that streams sorted for a while, then turns unsorted in some chunk (the run so far is
    collected with it), read and packed a few pairs at a time: the run is the dict's content."""
    pairs = [pair for run, ascending in runs for pair in (sorted(run, key=lambda p: p[0]) if ascending else run)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bulk, "READ_CHUNK", read_chunk)
        run = bulk.read_pairs(iter(pairs))
    latest = dict(pairs)  # the last value for a key wins
    assert run.key_list(0, len(run)) == sorted(k for k, v in latest.items() if v is not None)
    assert list(run.values) == [latest[k] for k in run.key_list(0, len(run))]
    assert sorted(run.removed) == run.removed == sorted(k for k, v in latest.items() if v is None)


@pytest.mark.parametrize("shape", ["distinct first words", "shared first words", "repeats", "removals"])
def test_the_column_sort_matches_a_dict(shape):
    """numpy's column sort goes by the keys' first 8 bytes unless two keys share them, then by all
    16; repeats keep input order (the last wins) and removals leave the kept columns."""
    rng = random.Random(shape)
    if shape == "shared first words":  # 8 equal bytes, then the order is in the second word alone
        universe = [bytes(rng.choice([0, 255]) for _ in range(8)) + rng.randbytes(8) for _ in range(5000)]
    else:
        universe = [rng.randbytes(16) for _ in range(5000)]
    count = 20_000 if shape in ("repeats", "removals") else 5000
    pairs = [(rng.choice(universe), rng.randrange(-(1 << 63), 1 << 63)) for _ in range(count)]
    if shape == "removals":
        pairs = [(key, None if rng.random() < 0.3 else value) for key, value in pairs]
    pairs += [(universe[0], 1)]  # unsorted from the first chunk on
    run = bulk.read_pairs(pairs)
    latest = dict(pairs)
    kept = sorted(key for key, value in latest.items() if value is not None)
    assert run.key_list(0, len(run)) == kept
    assert list(run.values) == [latest[key] for key in kept]
    assert run.removed == sorted(key for key, value in latest.items() if value is None)


# -- AttributeIndex.bulk_load beside another handle ------------------------------------------------
#
# A bulk load writes its pairs into the tree, not the WAL: the tree version it makes is not the WAL
# replayed up to its checkpoint, so a handle's tier 1 (the WAL from the version it was built on up
# to its position) may hold values older than the tree's.

INDEX_OPTIONS = dict(page_size=256, merge_keys=10**6, merge_seconds=10**6)


def _index_url(backend, tmp_path) -> str:
    return f"memory://bulk-race-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)


@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize("loaded", [2, None])
@pytest.mark.parametrize("b_merges_first", [False, True])
def test_a_merge_by_a_handle_that_wrote_before_a_bulk_load_never_undoes_the_load(backend, loaded, b_merges_first,
                                                                                   tmp_path):
    """A merge by handle A, whose tier 1 holds updates from before B's bulk load, never writes them
    over the loaded tree: A, B and every reopen answer the load's values, and a key the load
    removed stays removed. ``b_merges_first``: B merges up to A's position first, so A's merge has
    nothing to write; A still answers the loaded values, also after ``refresh`` (its recent-values
    cache never takes its pre-load tier 1)."""
    url = _index_url(backend, tmp_path)
    a = AttributeIndex(open_storage(url), **INDEX_OPTIONS)
    b = AttributeIndex(open_storage(url), **INDEX_OPTIONS)
    a.update({1: 1, 2: 1})  # pending in A's tier 1 (and in the WAL)
    b.bulk_load({1: loaded, 3: 3})  # B's empty WAL batch catches up with A's update and merges it first
    assert b.get_many([1, 2, 3]) == [loaded, 1, 3]
    a.update({5: 5})  # loses the append race: catches up past the load's WAL batch
    if b_merges_first:
        b.refresh()
        b.flush()
        assert b.checkpoint == a._log.position
    a.flush()  # must not merge A's pre-load tier 1 (1 -> 1) over the loaded tree
    b.refresh()
    assert b.get_many([1, 2, 3, 5]) == [loaded, 1, 3, 5]
    a.refresh()
    assert a.get_many([1, 2, 3, 5]) == [loaded, 1, 3, 5]
    for index in (a, b):
        index.close()
    with AttributeIndex(open_storage(url), **INDEX_OPTIONS) as reopened:
        assert reopened.get_many([1, 2, 3, 5]) == [loaded, 1, 3, 5]
        assert len(reopened) == 3 + (loaded is not None)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_refresh_that_failed_after_adopting_a_bulk_loaded_tree_rebuilds_on_the_next_one(backend, tmp_path):
    """A refresh that read the bulk-loaded tree and then failed to read the WAL (a storage error)
    leaves no pre-load value behind: the next ``refresh`` finds the tree unmoved but tier 1 built
    on another version, rebuilds it, and the handle answers the loaded value."""
    url = _index_url(backend, tmp_path)
    faulty = FaultyStorage(open_storage(url), seed=1)
    a = AttributeIndex(faulty, **INDEX_OPTIONS)
    b = AttributeIndex(open_storage(url), **INDEX_OPTIONS)
    a.update({1: 1})
    b.bulk_load({1: 2})
    faulty.script("fail_before", op="list_files", path_contains="_wal")  # A's catch-up, after its tree refresh
    with pytest.raises(StorageError):
        a.refresh()
    assert faulty.pending_scripts() == 0
    a.refresh()
    assert a.get(1) == 2
    for index in (a, b):
        index.close()


# -- loads larger than memory: sorted runs spilled to files ------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=PAIRS, pairs=PAIRS, order=st.sampled_from(["as given", "sorted", "reversed"]),
       existing=st.sampled_from(["empty", "updated"]), read_chunk=st.integers(1, 40),
       spill_pairs=st.integers(1, 60), block_pairs=st.integers(1, 50))
def test_a_load_spilled_to_sorted_runs_matches_a_dict(before, pairs, order, existing, read_chunk, spill_pairs,
                                                      block_pairs):
    """Pairs read in small chunks and spilled every few pairs (sorted runs on disk that follow
    each other for sorted input and overlap otherwise), merged back in small blocks: the same
    tree as a load in memory, and the runs' files are gone afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bulk, "READ_CHUNK", read_chunk)
        patch.setattr(spill, "BLOCK_PAIRS", block_pairs)
        index, model = new_index(), {}
        if existing == "updated":
            index.update(before)
            apply(model, before)
        if order == "sorted":
            pairs = sorted(pairs, key=lambda p: p[0])
        elif order == "reversed":
            pairs = pairs[::-1]
        run = bulk.read_pairs(iter(pairs), spill_bytes=spill_pairs * 24)
        files = [r.base for r in getattr(run, "runs", [])]
        try:
            count = load(index, run)
        finally:
            run.close()
        apply(model, pairs)
        assert count == len(model)
        check(index, model)
        assert not any(os.path.exists(base + ".keys") for base in files)


def test_a_load_spills_once_its_pairs_pass_spill_bytes_and_deletes_the_runs_on_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(bulk, "READ_CHUNK", 100)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # (tempfile caches the directory it found)
    try:
        run = bulk.read_pairs(((k(i), i) for i in range(1000)), spill_bytes=250 * 24)
        assert isinstance(run, spill.SpilledRuns) and len(run.runs) == 4 and len(run) == 1000
        assert [len(chunk) for chunk in run.chunks()] and b"".join(c.keys for c in run.chunks()) == b"".join(
            k(i) for i in range(1000))
        run.close()
        assert os.listdir(tmp_path) == []
        bad = [(k(i), i) for i in range(900)] + [(b"short", 1)]
        with pytest.raises(InvalidKeyError, match="pair 900"):
            bulk.read_pairs(iter(bad), spill_bytes=250 * 24)
        assert os.listdir(tmp_path) == []  # the runs spilled before the bad pair are deleted
        with pytest.raises(InvalidInputError, match="spill_bytes"):
            bulk.read_pairs([], spill_bytes=0)
    finally:
        tempfile.tempdir = None


def test_sorted_runs_that_cannot_be_written_fail_the_load_and_leave_no_file(tmp_path, monkeypatch):
    """A full disk (or no directory) for the sorted runs fails the load with ``StorageError``
    before the tree is written; the runs already written are deleted."""
    import builtins
    import errno

    monkeypatch.setattr(bulk, "READ_CHUNK", 100)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    written = []

    def full_after_two_runs(path, mode="r", *args, **kwargs):
        if "w" in mode and path.endswith(".keys"):
            written.append(path)
            if len(written) > 2:
                raise OSError(errno.ENOSPC, "No space left on device", path)
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(spill, "open", full_after_two_runs, raising=False)
    index = new_index()
    index.update({k(0): 0})
    length = index.stats().length
    with pytest.raises(StorageError, match="No space left"):
        index.bulk_load(((k(i), i) for i in range(1000)), spill_bytes=250 * 24)
    assert len(written) == 3 and os.listdir(tmp_path) == [] and index.stats().length == length
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "not-a-directory"))
    (tmp_path / "not-a-directory").write_bytes(b"")
    with pytest.raises(StorageError, match="making a directory for sorted runs"):
        index.bulk_load(((k(i), i) for i in range(1000)), spill_bytes=250 * 24)
    check(index, {k(0): 0})


# -- loads from columns -------------------------------------------------------------------------
def _as_columns(pairs: list, form: str):
    """``(key, value)`` pairs (no removals) as one ``(keys, values)`` chunk of the given form."""
    keys = b"".join(key for key, _ in pairs)
    values = [value for _, value in pairs]
    if form == "bytes":
        return keys, values
    if form == "S16":
        return np.frombuffer(keys, KEY_DTYPE), np.array(values, np.int64)
    if form == "uint8":
        return np.frombuffer(keys, np.uint8).reshape(-1, 16), np.array(values, np.int64)
    if form == "words":
        return np.frombuffer(keys, ">u8").reshape(-1, 2).astype(np.uint64), np.array(values, np.int64)
    import pyarrow as pa

    return pa.array([key for key, _ in pairs], pa.binary(16)), pa.array(values, pa.int64())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=PAIRS, chunks=st.lists(st.lists(st.tuples(KEYS, st.integers(-(1 << 63), (1 << 63) - 1)), max_size=60),
                                     max_size=5),
       order=st.sampled_from(["as given", "sorted"]), form=st.sampled_from(["bytes", "S16", "uint8", "words", "arrow"]),
       spill_pairs=st.sampled_from([3, 1000]))
def test_a_load_from_columns_matches_a_dict(before, chunks, order, form, spill_pairs):
    """Chunks of columns in any of the accepted forms, sorted across chunks or not, with repeats
    (the last value wins), spilled every few pairs or not: the tree is the dict's content."""
    if order == "sorted":
        flat = sorted((pair for chunk in chunks for pair in chunk), key=lambda p: p[0])
        chunks = [flat[i:i + 7] for i in range(0, len(flat), 7)]
    index, model = new_index(), {}
    index.update(before)
    apply(model, before)
    assert index.bulk_load_columns([_as_columns(chunk, form) for chunk in chunks],
                                   spill_bytes=spill_pairs * 24) == len({**model, **dict(p for c in chunks for p in c)})
    for chunk in chunks:
        apply(model, chunk)
    check(index, model)


@pytest.mark.parametrize("bad, match", [
    ((np.zeros(3, KEY_DTYPE), np.zeros(2, np.int64)), "3 keys and 2 values"),
    ((np.zeros(2, "S8"), np.zeros(2, np.int64)), "keys must be S16"),
    ((b"x" * 20, [1]), "not a multiple of 16"),
    ((np.zeros(2, KEY_DTYPE), np.zeros(2, np.float64)), "values must be integers"),
    ((np.zeros(2, KEY_DTYPE), np.array([1, 1 << 63], np.uint64)), "fit int64"),
    ((np.zeros(2, KEY_DTYPE), [1, None]), "values must be integers"),
    (([b"k" * 16], [1]), "keys must be a numpy or pyarrow array or bytes"),
    ("not a pair", "must be a \\(keys, values\\) pair"),
])
def test_a_bad_chunk_of_columns_is_refused_before_anything_is_written(bad, match):
    index = new_index()
    index.update({k(1): 1})
    length = index.stats().length
    good = (np.frombuffer(k(2) + k(3), KEY_DTYPE), np.array([2, 3], np.int64))
    with pytest.raises(InvalidInputError, match=match):
        index.bulk_load_columns([good, bad])  # the bad chunk comes after a good one
    assert index.stats().length == length and dict(index.items()) == {k(1): 1}


def test_null_keys_or_values_in_arrow_columns_are_refused():
    import pyarrow as pa

    index = new_index()
    with pytest.raises(InvalidInputError, match="1 keys are null"):
        index.bulk_load_columns([(pa.array([k(1), None], pa.binary(16)), pa.array([1, 2]))])
    with pytest.raises(InvalidInputError, match="1 values are null"):
        index.bulk_load_columns([(pa.array([k(1), k(2)], pa.binary(16)), pa.array([1, None]))])
    with pytest.raises(InvalidInputError, match="fixed_size_binary"):
        index.bulk_load_columns([(pa.array([b"a"]), pa.array([1]))])
    assert not len(index)


def _column_chunks(model: dict, size: int = 250) -> list:
    """``model``'s pairs (ascending) as chunks of ``S16`` keys and int64 values."""
    pairs = sorted(model.items())
    return [_as_columns(pairs[i:i + size], "S16") for i in range(0, len(pairs), size)]


@pytest.mark.parametrize("fault", ["fail_before", "torn", "enospc", "lost_ack", "unknown"])
def test_a_load_from_columns_meeting_a_fault_at_any_append_leaves_the_old_tree_or_the_new_one(fault, tmp_path,
                                                                                               monkeypatch):
    """A load from columns in pieces, on local disk, meeting at each of its appends in turn (the
    pieces, then the last one, which carries its root) a failed append, a torn one, a full disk, a
    lost acknowledgement (settled by reading back) or an outcome that stays unknown (the append
    landed; reading back could not tell): the handle and a fresh reader see the old tree or the
    new one, whole, never a mix; only a settled lost acknowledgement or an unknown outcome of
    the last append loaded it; the same load again goes through."""
    url = str(tmp_path / "store")
    storage = FaultyStorage(open_storage(url), seed=8)
    index = TreeIndex(storage, page_size=1024, piece_size=4096)
    old = {k(i): i for i in range(300)}
    index.update(old)
    new = {k(i): -i for i in range(100, 800)}  # about 17 KiB of pages: a few pieces
    appends, unknown_at = [], [-1]
    append = index._tree.segment.append

    def unsettled(data, **kwargs):  # "unknown": the append lands, then its outcome cannot be told
        appends.append(len(data))
        result = append(data, **kwargs)
        if len(appends) - 1 == unknown_at[0]:
            raise OutcomeUnknownError("the answer was lost and reading back failed")
        return result

    monkeypatch.setattr(index._tree.segment, "append", unsettled)
    outcomes, keys = [], sorted(old | new)
    for after in range(30):
        appends.clear()
        index.get_many(keys)  # in its recent values: a load must not leave them stale
        if fault == "unknown":
            unknown_at[0] = after
        else:
            storage.script(fault, op="append", after=after)
        try:
            index.bulk_load_columns(_column_chunks(new))
            outcome = "loaded"
        except OutcomeUnknownError:
            outcome = "unknown"
        except StorageError:
            outcome = "failed"
        if not (len(appends) > after if fault == "unknown" else storage.cancel_scripts() == 0):
            assert outcome == "loaded"  # no fault met: the load (again) went through
            break
        outcomes.append(outcome)
        seen = dict(index.items())
        stored = dict(TreeIndex(open_storage(url), page_size=1024).items())
        assert seen in (old, old | new) and stored in (old, old | new), f"after {after} appends: a mix"
        assert index.get_many(keys) == [seen.get(key) for key in keys]
        if outcome != "unknown":
            assert seen == stored and (stored == old | new) == (outcome == "loaded"), (after, outcome)
        index.refresh()
        check(index, stored)
        if outcome == "unknown":  # the same load again: idempotent
            assert index.bulk_load_columns(_column_chunks(new)) == len(old | new)
            stored = old | new
        if stored == old | new:
            old, new = stored, {key: value - 1 for key, value in new.items()}  # a change to load next time
    else:
        pytest.fail("the faults never stopped the load")
    check(index, old | new)
    check(TreeIndex(open_storage(url), page_size=1024), old | new)
    assert len(outcomes) >= 4, "the load was not written in pieces"
    assert outcomes[-1] == {"lost_ack": "loaded", "unknown": "unknown"}.get(fault, "failed")
    assert set(outcomes[:-1]) == {"loaded" if fault == "lost_ack" else "failed"}


@pytest.mark.parametrize("where", ["wal", "tree"])
def test_an_index_load_from_columns_on_a_full_disk_changes_nothing_and_goes_through_when_retried(where, tmp_path):
    """``AttributeIndex.bulk_load_columns`` with the disk full at its empty WAL batch (its place
    among the updates) or at a piece of the tree's load: ``StorageFullError``, the handle and a
    reopen (which replays the WAL over the tree) answer the updates from before it, the pending
    one too; the same load again goes through, ordered after them and before the next update."""
    url = str(tmp_path / "store")
    storage = FaultyStorage(open_storage(url), seed=9)
    options = dict(page_size=1024, piece_size=4096, merge_keys=10**6, merge_seconds=10**6)
    index = AttributeIndex(storage, **options)
    old = {k(i): i for i in range(300)}
    index.update(old)
    index.flush()  # in the tree
    index.update({k(0): -5, k(900): 900})  # pending in the WAL
    old |= {k(0): -5, k(900): 900}
    new = {k(i): -i for i in range(100, 800)}  # a few pieces
    if where == "wal":
        storage.script("enospc", op="append", path_contains="_wal")
    else:
        storage.script("enospc", op="append", path_contains="attributes.seg", after=1)  # the second piece
    with pytest.raises(StorageFullError):
        index.bulk_load_columns(_column_chunks(new))
    assert storage.cancel_scripts() == 0 and storage.injected
    keys = sorted(old | new | {k(901): 0})
    assert dict(index.items()) == old and index.get_many(keys) == [old.get(key) for key in keys]
    with AttributeIndex.open(url, mode="r", **options) as reader:
        assert dict(reader.items()) == old and len(reader) == len(old)
    assert index.bulk_load_columns(_column_chunks(new)) == len(old | new)
    index.update({k(100): 1, k(901): 901})  # after the load: wins over it
    expected = old | new | {k(100): 1, k(901): 901}
    assert dict(index.items()) == expected and index.get_many(keys) == [expected.get(key) for key in keys]
    index.close()
    with AttributeIndex.open(url, mode="r", **options) as reader:
        assert dict(reader.items()) == expected and reader.verify().ok
