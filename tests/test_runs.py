"""Sorted runs of the B+tree: batches stored beside the main tree, merged into it later.

The model tests open trees whose ``run_min_entries`` is tiny, so the runs, their merging and
the rebuild that takes them into the main tree all happen on a few hundred keys.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attrindex import AttributeIndex
from attrindex.btree.columns import KEY_DTYPE, merge_streams
from attrindex.btree.runs import MAX_RUN_ENTRIES, Forest, RunPolicy, TreeRef
from attrindex.errors import CorruptDataError, InvalidInputError
from attrindex.tree_index import TreeIndex


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def runs_of(index: TreeIndex) -> int:
    return index.stats().runs


# -- merging streams of columns ----------------------------------------------------------------
entries = st.dictionaries(st.integers(0, 300), st.one_of(st.none(), st.integers(-5, 5)), max_size=60)


def as_stream(model: dict, block: int):
    """A dict as ascending ``(keys, values, gone)`` blocks of ``block`` entries."""
    items = sorted(model.items())
    for at in range(0, len(items), block):
        part = items[at:at + block]
        yield (np.array([k(i) for i, _ in part], KEY_DTYPE).reshape(-1),
               np.array([0 if v is None else v for _, v in part], "<i8"),
               np.array([v is None for _, v in part], bool))


@settings(max_examples=150, deadline=None)
@given(st.lists(entries, min_size=1, max_size=5), st.integers(1, 7), st.integers(1, 9))
def test_merged_streams_hold_each_key_once_with_the_newest_stream_s_entry(streams, block, step):
    expected: dict = {}
    for model in streams:  # oldest first
        expected.update(model)
    got = []
    for keys, values, gone in merge_streams([as_stream(model, block) for model in streams], step):
        got += [(int.from_bytes(key.tobytes().ljust(16, b"\0"), "big"), None if g else int(v))
                for key, v, g in zip(keys, values, gone)]
    assert got == sorted(expected.items())


# -- when a batch becomes a run -----------------------------------------------------------------
def forest_of(*entries: int) -> Forest:
    from attrindex.btree.runs import RunRef
    runs = tuple(RunRef(TreeRef(1, 1, 1, n, 1, 1, 1), 0, 1) for n in entries)
    return Forest(0, 1, TreeRef(), runs, (None,) * len(runs))


@pytest.mark.parametrize("main, forest, batch, expected", [
    (999, None, 10, "tree"),  # the main tree is smaller than min_entries
    (1000, None, 10, "run"),
    (1000, None, 126, "tree"),  # the batch alone passes the share
    (1000, forest_of(61, 60), 5, "tree"),  # the runs and the batch pass it
    (1000, forest_of(10, 10), 5, "run"),
    (1000, forest_of(*[1] * 8), 5, "runs"),  # as many runs as allowed: merged with the batch
    (10 ** 9, None, MAX_RUN_ENTRIES + 1, "tree"),  # larger than one run may be
])
def test_a_batch_becomes_a_run_while_the_runs_hold_less_than_their_share(main, forest, batch, expected):
    assert RunPolicy(min_entries=1000, share=0.125).plan(main, forest, batch) == expected
    assert RunPolicy(min_entries=1000, share=0).plan(main, forest, batch) == "tree"


def test_a_batch_goes_into_the_main_tree_once_the_runs_leave_too_much_dead_storage():
    """Runs merged together leave dead bytes that only a rebuild of the main tree frees: past
    ``max_retained`` times the live bytes, the next batch rebuilds instead of adding a run."""
    policy = RunPolicy(min_entries=1000, share=0.5)
    assert policy.plan(10_000, None, 100, retained=13_000, live=10_000) == "run"
    assert policy.plan(10_000, None, 100, retained=17_000, live=10_000) == "tree"
    assert RunPolicy(min_entries=1000, share=0.5, max_retained=None).plan(10_000, None, 100, 17_000, 10_000) == "run"


@pytest.mark.parametrize("sizes, batch, expected", [
    ([5, 5, 5, 5], 5, 4),  # equal runs: all of them
    ([5, 5, 5, 40], 5, 3),  # the small ones; the large one waits until they add up to it
    ([5, 5, 5, 20], 5, 4),  # ... as they do here
    ([100, 5], 5, 2),  # at least the newest, and an older one no larger than what is merged
])
def test_the_newest_runs_that_add_up_are_merged_together(sizes, batch, expected):
    from attrindex.btree.runs import RunRef, merged_runs
    runs = [RunRef(TreeRef(1, 1, 1, n, 1, 1, 1), 0, 1) for n in sizes]  # newest first
    assert merged_runs(runs, batch) == expected


# -- the tree with runs against a model ---------------------------------------------------------
ops = st.lists(st.one_of(
    st.tuples(st.just("update"), st.dictionaries(st.integers(0, 400), st.one_of(st.none(), st.integers(-9, 9)),
                                                   min_size=1, max_size=40)),
    st.tuples(st.just("reopen"), st.none()),
    st.tuples(st.just("bulk"), st.dictionaries(st.integers(0, 400), st.integers(-9, 9), max_size=80)),
), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops, st.sampled_from([0.3, 1.0]))
def test_a_tree_with_runs_answers_as_a_dict_does(tmp_path_factory, operations, share):
    url = str(tmp_path_factory.mktemp("runs"))
    options = dict(page_size=256, run_min_entries=30, run_share=share, cache_bytes=1 << 16)
    index = TreeIndex.open(url, **options)
    model = {i: i for i in range(0, 400, 7)}
    index.bulk_load({k(i): v for i, v in model.items()})
    seen_runs = 0
    for op, arg in operations:
        if op == "update":
            index.update({k(i): v for i, v in arg.items()})
            for i, v in arg.items():
                if v is None:
                    model.pop(i, None)
                else:
                    model[i] = v
        elif op == "bulk":
            index.bulk_load({k(i): v for i, v in arg.items()})  # merged over the tree and its runs
            model.update(arg)
        else:
            index.close()
            index = TreeIndex.open(url, **options)
        seen_runs = max(seen_runs, runs_of(index))
        probe = list(range(0, 401, 3))
        assert index.get_many([k(i) for i in probe]) == [model.get(i) for i in probe]
    assert [index.get(k(i)) for i in range(401)] == [model.get(i) for i in range(401)]
    assert list(index.items()) == [(k(i), v) for i, v in sorted(model.items())]
    assert list(index.items(k(50), k(250))) == [(k(i), v) for i, v in sorted(model.items()) if 50 <= i < 250]
    assert len(index) == len(model)
    report = index.verify()
    assert report.ok and report.entries == index.stats().entry_count
    index.close()


def test_runs_accumulate_merge_together_and_go_into_the_main_tree(tmp_path):
    """Runs are written beside the tree, merged into one run when there are as many as allowed,
    and rebuilt into the main tree once they hold their share of it; every version reads the
    same as a dict."""
    index = TreeIndex.open(str(tmp_path), page_size=256, run_min_entries=100, run_share=0.5)
    model = {i: i for i in range(400)}
    index.bulk_load({k(i): v for i, v in model.items()})
    counts, rng = [], random.Random(5)
    for step in range(40):
        batch = {rng.randrange(450): (None if rng.random() < 0.3 else step) for _ in range(8)}
        index.update({k(i): v for i, v in batch.items()})
        for i, v in batch.items():
            model.pop(i, None) if v is None else model.__setitem__(i, v)
        counts.append(runs_of(index))
        assert dict(index.items()) == {k(i): v for i, v in model.items()}
    assert max(counts) == RunPolicy().max_runs  # as many runs as allowed ...
    assert any(a > b > 0 for a, b in zip(counts, counts[1:]))  # ... merged into one with the next batch
    assert 0 in counts[counts.index(max(counts)):]  # the runs went into the main tree
    assert len(index) == len(model) and index.verify().ok


def test_a_lookup_skips_a_run_whose_filter_does_not_hold_the_key(tmp_path):
    """Cold lookups of keys the runs do not hold read about one leaf of the main tree each, none
    of the runs' (their filters in memory say so); keys in a run come from the run."""
    url = str(tmp_path)
    index = TreeIndex.open(url, page_size=4096, run_min_entries=1000)
    index.bulk_load({k(i): i for i in range(0, 200_000, 2)})
    for step in range(5):  # runs of multiples of 4
        index.update({k(i): -i for i in range(4 * step, 200_000, 4 * 997)})
    assert runs_of(index) == 5
    assert index.stats().run_entries == sum(len(range(4 * step, 200_000, 4 * 997)) for step in range(5))
    index.close()
    cold = TreeIndex.open(url, mode="r", page_size=4096, value_cache_entries=0)
    cold.get(k(3))  # the upper pages of the trees into the cache
    before = cold.stats().storage_reads
    absent = list(range(1, 200_000, 2002))  # odd: in no run, not in the tree
    main_only = list(range(2, 200_000, 2004))  # 2 mod 4: in the tree only
    assert [cold.get(k(i)) for i in absent] == [None] * len(absent)
    assert [cold.get(k(i)) for i in main_only] == main_only
    reads = cold.stats().storage_reads - before
    assert reads <= 1.1 * (len(absent) + len(main_only)), reads
    in_runs = [4 * step + 4 * 997 * j for step in range(5) for j in (0, 7, 50)]
    assert [cold.get(k(i)) for i in in_runs] == [-i for i in in_runs]


def test_two_handles_writing_runs_take_each_other_s_versions(tmp_path):
    """A run written over a version another handle replaced is built again over the newer one
    (the compare-and-append race): nothing either handle wrote is lost."""
    url = str(tmp_path)
    options = dict(page_size=256, run_min_entries=50, run_share=1.0)
    a = TreeIndex.open(url, **options)
    a.bulk_load({k(i): i for i in range(300)})
    b = TreeIndex.open(url, **options)
    model = {i: i for i in range(300)}
    seen = []
    for step in range(12):
        writer = (a, b)[step % 2]  # its version is the one before the other's last run
        batch = {i: step * 1000 + i for i in range(step, 330, 13)}
        writer.update({k(i): v for i, v in batch.items()})
        model.update(batch)
        seen.append(runs_of(writer))
    for handle in (a, b):
        handle.refresh()
        assert dict(handle.items()) == {k(i): v for i, v in model.items()}
        assert len(handle) == len(model)
    assert seen[:8] == list(range(1, 9)) and a.verify().ok  # each run written over the other's


def test_a_handle_that_writes_no_runs_rebuilds_over_another_s_runs(tmp_path):
    """A handle whose options write no runs (``run_share=0``) whose update loses the race to a
    version with runs takes them into the main tree with its batch: its copy-on-write rewrite is
    never laid over a runs page."""
    url = str(tmp_path)
    plain = TreeIndex.open(url, page_size=256, run_share=0)
    plain.bulk_load({k(i): i for i in range(300)})
    assert plain.get(k(5)) == 5  # its version: the one before the runs
    runs = TreeIndex.open(url, page_size=256, run_min_entries=50, run_share=1.0)
    runs.update({k(i): -i for i in range(0, 300, 7)})
    assert runs_of(runs) == 1
    plain.update({k(1): 100})  # a sparse batch, laid out over the stale version: the race is lost
    assert runs_of(plain) == 0
    expected = {k(i): (-i if i % 7 == 0 else i) for i in range(300)}
    expected[k(1)] = 100
    for handle in (plain, runs):
        handle.refresh()
        assert dict(handle.items()) == expected and handle.verify().ok


@pytest.mark.parametrize("read", ["get", "get_many", "items", "len"])
def test_reads_over_runs_another_handle_rebuilt_and_truncated_move_to_its_version(tmp_path, read):
    """A handle whose version has runs, after another handle rebuilt the tree with them and
    truncated their chunks: its reads meet pages that are gone and move to the newest version,
    never with an error. A call answers from one version: the old one while the pages it needs
    are still stored (a run may share its chunk with the rebuild's first pages), else the new."""
    url = str(tmp_path)
    options = dict(page_size=256, rolling_size=4096, run_min_entries=50, run_share=0.5)
    writer = TreeIndex.open(url, **options)
    writer.bulk_load({k(i): i for i in range(300)})
    writer.update({k(i): -i for i in range(0, 300, 9)})  # a run
    reader = TreeIndex.open(url, cache_bytes=0, value_cache_entries=0, **options)
    assert runs_of(reader) == 1 and reader.get(k(9)) == -9
    held = reader.version.forest
    writer.update({k(i): 1000 + i for i in range(0, 330, 2)})  # past the share: a rebuild, then truncation
    assert runs_of(writer) == 0 and writer.stats().start_offset > held.main.min_offset  # the old pages are gone
    old = {i: i for i in range(300)}
    old.update({i: -i for i in range(0, 300, 9)})
    expected = {**old, **{i: 1000 + i for i in range(0, 330, 2)}}
    keys = list(range(0, 340, 3))
    if read == "get":
        answers = [reader.get(k(i)) for i in keys]
        moved = next(n for n, i in enumerate(keys) if old.get(i) != expected.get(i) and answers[n] == expected.get(i))
        assert answers[:moved] == [old.get(i) for i in keys[:moved]]  # the old version, whole, then
        assert answers[moved:] == [expected.get(i) for i in keys[moved:]]  # the new one, from the first gone page on
    elif read == "get_many":
        assert reader.get_many([k(i) for i in keys]) == [expected.get(i) for i in keys]
    elif read == "items":
        assert list(reader.items()) == [(k(i), v) for i, v in sorted(expected.items())]
    else:
        assert len(reader) == len(expected)
    assert runs_of(reader) == 0  # it moved to the rebuilt version


@pytest.mark.parametrize("target", ["runs page", "filter", "run leaf"])
def test_damage_to_a_run_is_reported_and_repair_returns_to_an_intact_version(tmp_path, target):
    url = str(tmp_path)
    index = TreeIndex.open(url, page_size=256, run_min_entries=50, run_share=1.0, compaction=False)
    index.bulk_load({k(i): i for i in range(300)})
    index.update({k(i): -i for i in range(0, 300, 5)})  # a first run
    intact = dict(index.items())
    index.update({k(i): 7 for i in range(1, 300, 5)})  # a second run: damaged below
    forest = index.version.forest
    run = forest.runs[0]
    offset = {"runs page": forest.offset + 30, "filter": run.filter_offset + 20,
              "run leaf": run.tree.offset - 40}[target]  # (the run's root follows its leaves)
    index.close()
    flip(url, offset)
    report = TreeIndex.verify_at(url)
    assert not report.ok and any(d.start <= offset < d.end for d in report.damage), report.damage
    with pytest.raises(CorruptDataError):
        reader = TreeIndex.open(url, mode="r", cache_bytes=0, value_cache_entries=0)
        [reader.get(k(i)) for i in range(300)]
    assert TreeIndex.repair_at(url).rolled_back
    assert dict(TreeIndex.open(url).items()) == intact


def flip(url: str, offset: int) -> None:
    """Flip a byte of the tree's storage at ``offset`` (one chunk: ``compaction=False``)."""
    directory = os.path.join(url, "attributes.seg")
    (chunk,) = [name for name in os.listdir(directory) if name.isdigit()]
    path = os.path.join(directory, chunk)
    with open(path, "r+b") as f:
        f.seek(offset - int(chunk))
        byte = f.read(1)
        f.seek(offset - int(chunk))
        f.write(bytes([byte[0] ^ 0x40]))


def test_space_stays_bounded_while_runs_come_and_go(tmp_path):
    """Runs pin the storage of the versions they build on until they go into the main tree;
    the rebuild frees it: after steady random updates, storage stays within 1.5x the live bytes."""
    url = str(tmp_path)
    index = TreeIndex.open(url, page_size=4096, rolling_size=1 << 16, run_min_entries=1000)
    index.bulk_load({k(i): i for i in range(50_000)})
    rng = random.Random(3)
    for step in range(60):
        index.update({k(rng.randrange(50_000)): step for _ in range(500)})
    stats = index.stats()
    assert stats.storage_bytes <= 1.5 * stats.live_bytes + (1 << 17), stats


def test_an_attribute_index_merges_into_runs_through_its_worker_and_replays_over_them(tmp_path):
    url = str(tmp_path)
    options = dict(page_size=512, run_min_entries=500, run_share=1.0, merge_keys=100)
    index = AttributeIndex.open(url, **options)
    model = {i: i for i in range(0, 6000, 3)}
    index.bulk_load({k(i): v for i, v in model.items()})
    rng = random.Random(9)
    for step in range(30):
        batch = {rng.randrange(6100): (None if rng.random() < 0.2 else step) for _ in range(60)}
        index.update({k(i): v for i, v in batch.items()})
        for i, v in batch.items():
            model.pop(i, None) if v is None else model.__setitem__(i, v)
        if step % 10 == 9:
            index.flush()
            assert index.stats().runs > 0
    index.update({k(1): 11})  # pending in the WAL: a reader replays it over the tree and its runs
    model[1] = 11
    reader = AttributeIndex.open(url, mode="r", **options)
    assert dict(reader.items()) == {k(i): v for i, v in model.items()} and len(reader) == len(model)
    reader.close()
    index.close()
    reopened = AttributeIndex.open(url, **options)
    assert dict(reopened.items()) == {k(i): v for i, v in model.items()}
    assert len(reopened) == len(model) and reopened.verify().ok


def test_a_merge_someone_waits_for_leaves_a_due_rebuild_to_the_background(tmp_path):
    """``flush`` and ``close`` write their batch as a run while the runs hold up to twice their
    share, where a background merge would rebuild the tree: the caller waits for a run, not for
    a rewrite of the whole tree. Past twice the share they rebuild too."""
    url = str(tmp_path)
    index = AttributeIndex.open(url, page_size=512, run_min_entries=100, run_share=0.1, merge_keys=1 << 20,
                                merge_seconds=3600)
    index.bulk_load({k(i): i for i in range(2000)})
    sizes = []
    for step in range(12):
        index.update({k(i): -i for i in range(step, 2000, 60)})  # 34 keys: 1.7% of the tree
        index.flush()
        sizes.append(index.stats().run_entries)
    assert max(sizes) > 200  # past the share (200 entries) ...
    assert max(sizes) <= 400 and 0 in sizes[sizes.index(max(sizes)):]  # ... within twice it, then rebuilt
    model = {i: (-i if any(i >= s and (i - s) % 60 == 0 for s in range(12)) else i) for i in range(2000)}
    index.close()
    assert dict(AttributeIndex.open(url).items()) == {k(i): v for i, v in model.items()}


@pytest.mark.parametrize("option, value", [("run_share", 1.5), ("run_share", -0.1), ("run_share", True),
                                           ("run_min_entries", -1), ("run_min_entries", 2.0)])
def test_bad_run_options_are_refused_before_anything_is_written(tmp_path, option, value):
    url = str(tmp_path / "new")
    with pytest.raises(InvalidInputError, match=option):
        TreeIndex.open(url, **{option: value})
    with pytest.raises(InvalidInputError, match=option):
        AttributeIndex.open(url, **{option: value})
    assert not os.path.exists(url) or not any(os.scandir(url))
