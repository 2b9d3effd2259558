"""Hypothesis model test: TreeIndex against a dict, with tiny pages so trees are 4+ levels deep.

Updates are written whole or in pieces of one page or a few (``piece_size``), and some fail at a
random append of their pieces: the index must then read as before the update, verify clean, and
take the next update.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test


from attrindex.btree import DEFAULT_PIECE_SIZE
from attrindex.tree_index import TreeIndex
from storage_adapters import StorageError, open_storage
from storage_adapters.faults import FaultyStorage

PAGE_SIZE = 120  # 4 leaf entries or 3 index entries per page: deep trees from few keys
# Keys from a small universe so updates hit existing keys, removes find them, and ranges are dense.
def KEY_OF(i: int) -> bytes:
    return (i * 0x9E3779B97F4A7C15 % (1 << 128)).to_bytes(16, "big")


KEYS = st.integers(min_value=0, max_value=400).map(KEY_OF)
VALUES = st.one_of(st.none(), st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1))


def machine_for(new_url, compaction, heights):
    class IndexMachine(RuleBasedStateMachine):
        @initialize(rolling=st.sampled_from([256, 4096, 1 << 20]), preload=st.integers(min_value=120, max_value=400),
                    piece_size=st.sampled_from([PAGE_SIZE, 3 * PAGE_SIZE, DEFAULT_PIECE_SIZE]))
        def open(self, rolling, preload, piece_size):
            self.url = new_url()
            self.rolling = rolling
            self.piece_size = piece_size
            self.index = self._open()
            # Start from a tree at least 4 levels deep (more than 4 * 3 * 3 = 36 * 3 entries).
            self.model = {KEY_OF(i): i for i in range(preload)}
            self.index.update(self.model)
            self.max_height = self.index.stats().height
            assert self.max_height >= 4

        def _open(self, cache_bytes=1 << 20):
            self.storage = FaultyStorage(open_storage(self.url), seed=0)
            return TreeIndex(self.storage, page_size=PAGE_SIZE, rolling_size=self.rolling,
                             cache_bytes=cache_bytes, compaction=compaction, piece_size=self.piece_size)

        @rule(batch=st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=40))
        def update(self, batch):
            self.index.update(batch)
            for key, value in batch:  # the last value for a key wins
                if value is None:
                    self.model.pop(key, None)
                else:
                    self.model[key] = value
            self.max_height = max(self.max_height, self.index.stats().height)

        @rule(batch=st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=40), after=st.integers(0, 12))
        def update_that_fails_part_way(self, batch, after):
            # Its appends (its pieces, then the last one) fail from the (after + 1)-th on; an update
            # with fewer appends is applied whole.
            self.storage.script("fail_before", op="append" if self.storage.appendable else "create", after=after)
            try:
                self.update(batch)
            except StorageError:
                pass  # not applied: the model is unchanged, and the index must read as before
            finally:
                self.storage.cancel_scripts()

        @rule(key=KEYS)
        def get(self, key):
            assert self.index.get(key) == self.model.get(key)

        @rule(keys=st.lists(KEYS, max_size=30))
        def get_many(self, keys):
            assert self.index.get_many(keys) == [self.model.get(k) for k in keys]

        @rule(start=st.one_of(st.none(), KEYS), stop=st.one_of(st.none(), KEYS))
        def items(self, start, stop):
            expected = sorted((k, v) for k, v in self.model.items() if (start is None or k >= start) and (stop is None or k < stop))
            assert list(self.index.items(start, stop)) == expected

        @rule(cache_bytes=st.sampled_from([0, 1 << 20]))
        def reopen(self, cache_bytes):
            self.index.close()
            self.index = self._open(cache_bytes)

        @precondition(lambda self: hasattr(self, "index"))
        @invariant()
        def tree_is_sound(self):
            stats = self.index.stats()
            assert stats.entry_count == len(self.model) == len(self.index)
            report = self.index.verify()  # checksums, ordering, minimum offsets, footer counts, chain
            assert report.ok, report.damage
            assert report.entries == len(self.model)
            if report.pages:
                # The truncation offset is the smallest offset of any live page.
                live = [offset for _, offset, _, _ in self.index._tree.pages()]
                assert stats.start_offset == min(live)

        def teardown(self):
            if hasattr(self, "index"):
                heights.append(self.max_height)
                self.index.close()
                # Each example's store goes with it: memory:// stores share one process-wide
                # dict that every memory listing scans, so stores left there slow every later
                # example.
                open_storage(self.url).remove_directory("")

    return IndexMachine


def _run(new_url, compaction, examples):
    heights: list[int] = []
    run_state_machine_as_test(
        machine_for(new_url, compaction, heights),
        settings=settings(max_examples=examples, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]),
    )
    assert max(heights) >= 4, f"no run built a tree of 4+ levels: {sorted(heights)[-5:]}"


#: Each model's examples are split over several test items (``part``), so that pytest-xdist's two
#: workers share a model; every item draws its own examples, and the items of a model together run
#: its full number (``EXAMPLES``).
EXAMPLES = {"memory": 120, "local": 40, "pravega": 40, "no compaction": 40}
PARTS = {"memory": 4, "local": 2, "pravega": 2, "no compaction": 2}


def _examples(model: str) -> int:
    """The examples of one item of ``model``."""
    assert EXAMPLES[model] % PARTS[model] == 0
    return EXAMPLES[model] // PARTS[model]


@pytest.mark.parametrize("part", range(PARTS["memory"]))
def test_index_matches_dict_on_memory(part):
    _run(lambda: f"memory://index-model-{uuid.uuid4().hex}", True, _examples("memory"))


@pytest.mark.parametrize("part", range(PARTS["local"]))
def test_index_matches_dict_on_local_disk(tmp_path, part):
    _run(lambda: str(tmp_path / uuid.uuid4().hex), True, _examples("local"))


@pytest.mark.parametrize("part", range(PARTS["pravega"]))
def test_index_matches_dict_with_pravega_policy(part):
    _run(lambda: f"memory://index-model-{uuid.uuid4().hex}", "pravega", _examples("pravega"))


@pytest.mark.parametrize("part", range(PARTS["no compaction"]))
def test_index_matches_dict_without_compaction(part):
    _run(lambda: f"memory://index-model-{uuid.uuid4().hex}", False, _examples("no compaction"))
