"""Fault hunt: the merged WAL's truncation (``BackgroundMerge._truncate_merged``) under storage faults.

The truncation runs after a durable merge: a truncation marker, then the deletion of the chunks
below it. Attacked: the marker written but its answer lost, the deletions done but their answer
lost, the deletions failing; each several times in a row, with removals (``None``) among the
merged updates. Then the same handle goes on updating and merging, a second handle reads and
writes, and a fresh handle opens. Held: every acknowledged update with its newest value, no
removed key back (from an older WAL chunk or tree version), no error after the merge.
"""

from __future__ import annotations

import uuid

import pytest

from attrindex import AttributeIndex
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage

OPTIONS = dict(page_size=256, wal_rolling_size=200, merge_keys=10**6, merge_seconds=10**6)
KEYS = 30


@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize("kind, op", [("lost_ack", "put_marker"), ("lost_ack", "delete"), ("fail_before", "delete")])
def test_a_wal_truncation_whose_answer_is_lost_or_fails_loses_and_revives_nothing(backend, kind, op, tmp_path):
    url = f"memory://hunt-cut-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)
    faulty = FaultyStorage(open_storage(url), seed=1)
    a = AttributeIndex(faulty, **OPTIONS)
    model: dict[int, int | None] = {}
    for round_ in range(4):
        for i in range(KEYS):
            value = None if (i + round_) % 5 == 0 else 100 * round_ + i
            a.update({i: value})  # every one acknowledged: the faults hit the truncation only
            model[i] = value
        if round_ == 1:
            faulty.script(kind, op=op, path_contains="_wal", times=3)
        a.flush()  # the merge is durable; its truncation meets the fault (never raised)
    assert faulty.pending_scripts() == 0 and faulty.injected
    keys = list(range(KEYS))
    want = [model[i] for i in keys]
    assert a.get_many(keys) == want
    b = AttributeIndex(open_storage(url), **OPTIONS)
    assert b.get_many(keys) == want
    b.update({KEYS: 1})
    b.flush()
    a.update({KEYS + 1: 2})
    a.refresh()
    a.flush()
    assert a.get_many(keys + [KEYS, KEYS + 1]) == want + [1, 2]
    for index in (a, b):
        index.close()
    with AttributeIndex(open_storage(url), **OPTIONS) as reopened:
        assert reopened.get_many(keys + [KEYS, KEYS + 1]) == want + [1, 2]
        assert len(reopened) == sum(v is not None for v in want) + 2
        assert reopened.verify().ok
