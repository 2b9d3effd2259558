"""Fault hunt: a bulk load by one handle, then a merge by another handle that wrote before it.

``AttributeIndex.bulk_load`` writes its pairs into the tree, not the WAL: the tree version it
makes (checkpoint P, the end of its empty WAL batch) is no longer the WAL replayed up to P. Every
other tree version is, so a handle could merge its tier 1 (the WAL from the checkpoint it was
built on up to its position) over any newer version another handle wrote: the newer values are
all in its tier 1 too. Over a bulk-loaded version that is false. Handle A updated key 1 before the
load, caught up past the load's batch (its next update lost the append race) and flushed: its
tier 1 still held key 1's value from before the load and the merge wrote it over the loaded one,
with a checkpoint past the load, so every handle and every reopen answered the older value; a key
the load removed came back ("bulk load 1 -> 2, then A's flush: reopened reads 1").

The in-process merge now checks that the tree still is the version tier 1 was built on; if
another handle wrote it meanwhile, tier 1 is rebuilt from the tree's newest version instead (as
a merge that finds the tree ahead of it always did). The worker process already replayed the WAL
from the tree's own checkpoint.
"""

from __future__ import annotations

import uuid

import pytest

from attrindex import AttributeIndex
from attrindex.errors import StorageError
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage

OPTIONS = dict(page_size=256, merge_keys=10**6, merge_seconds=10**6)


@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize("loaded", [2, None])
@pytest.mark.parametrize("b_merges_first", [False, True])
def test_a_merge_by_a_handle_that_wrote_before_a_bulk_load_never_undoes_the_load(backend, loaded, b_merges_first,
                                                                                   tmp_path):
    """``b_merges_first``: B merges up to A's position first, so A's merge finds the tree covering
    exactly its frozen tier 1 and writes nothing; it put tier 1's values (1 -> 1) into A's
    recent-values cache, which A then answered from, also after ``refresh``."""
    url = f"memory://hunt-bulk-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)
    a = AttributeIndex(open_storage(url), **OPTIONS)
    b = AttributeIndex(open_storage(url), **OPTIONS)
    a.update({1: 1, 2: 1})  # pending in A's tier 1 (and in the WAL)
    b.bulk_load({1: loaded, 3: 3})  # B's empty WAL batch catches up with A's update and merges it first
    assert b.get_many([1, 2, 3]) == [loaded, 1, 3]
    a.update({5: 5})  # loses the append race: catches up past the load's WAL batch
    if b_merges_first:
        b.refresh()
        b.flush()
        assert b.checkpoint == a._log.position
    a.flush()  # was: merged A's tier 1 (1 -> 1) over the loaded tree
    b.refresh()
    assert b.get_many([1, 2, 3, 5]) == [loaded, 1, 3, 5]
    a.refresh()
    assert a.get_many([1, 2, 3, 5]) == [loaded, 1, 3, 5]
    for index in (a, b):
        index.close()
    with AttributeIndex(open_storage(url), **OPTIONS) as reopened:
        assert reopened.get_many([1, 2, 3, 5]) == [loaded, 1, 3, 5]
        assert len(reopened) == 3 + (loaded is not None)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_refresh_that_failed_after_adopting_a_bulk_loaded_tree_rebuilds_on_the_next_one(backend, tmp_path):
    """``refresh`` rebuilt tier 1 only when the tree moved during that call. One that read the
    bulk-loaded tree and then failed to read the WAL (a storage error) left A's tier 1 from before
    the load over it: the next refresh found the tree unmoved, only caught up, and A kept answering
    the value the load replaced, after a successful ``refresh``. Tier 1 is now rebuilt whenever
    the tree is not the version it was built on."""
    url = f"memory://hunt-bulk-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)
    faulty = FaultyStorage(open_storage(url), seed=1)
    a = AttributeIndex(faulty, **OPTIONS)
    b = AttributeIndex(open_storage(url), **OPTIONS)
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
