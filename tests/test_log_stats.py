"""``stats().log_bytes`` (and the index's ``wal_bytes``/``storage_bytes``) against the storage.

The model: the bytes the storage holds for the chunks a fresh view of the log uses, each counted
whole by its committed length (a replacement's hole holds nothing; a chunk that the truncation
offset cuts through is stored whole). It is read from the storage itself, apart from the handle:
the stored size of every chunk but the last (trimmed to its end before its successor was made),
the end of the last one's chain of record batches (local disk: zeros follow it).
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from attrindex import Record, SegmentStore
from attrindex.log.framing import LOG_FRAMING
from storage_adapters.rolling import RollingSegment

ROLL = 400


def stored_log_bytes(storage, name: str = "s") -> int:
    """What the storage holds for the log's chunks in force, read apart from any handle."""
    log = RollingSegment(storage, f"{name}/_log", rolling_size=ROLL, framing=LOG_FRAMING)
    try:
        sizes = storage.list_files(f"{name}/_log.seg")
        chunks = log.chunks()
        total = sum(sizes[chunk.name] for chunk in chunks[:-1])
        if chunks:
            last = chunks[-1]
            data = storage.read(f"{name}/_log.seg/{last.name}", 0, sizes[last.name])
            total += LOG_FRAMING.chain_end(data, last.start) - last.start if storage.torn_appends else len(data)
        return total
    finally:
        log.close()


def _store(url):
    return SegmentStore.open(url, log_rolling_size=ROLL)


def _fill(seg, rounds: int, keys: int = 3) -> None:
    for i in range(rounds):
        seg.append([Record(b"v%d" % i + b"." * 100, b"k%d" % (i % keys))], timestamp=1)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_holes_left_by_compaction_are_not_counted(kind, tmp_path):
    url = f"memory://logstats-{uuid.uuid4().hex}" if kind == "memory" else str(tmp_path)
    with _store(url) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        _fill(seg, 40)
        seg.compact(min_lag_ms=0, now_ms=10)
        holes = seg._log.bytes.holes()
        assert holes  # the case under test: compaction left ranges that hold nothing
        stats = seg.stats()
        assert stats.log_bytes == stored_log_bytes(store.storage)
        assert stats.log_bytes < seg._log.bytes.length - seg._log.bytes.start_offset  # holes are not bytes


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_chunk_cut_by_the_truncation_is_counted_whole(kind, tmp_path):
    url = f"memory://logstats-{uuid.uuid4().hex}" if kind == "memory" else str(tmp_path)
    with _store(url) as store:
        seg = store.segment("s", create=True)
        _fill(seg, 20)
        seg.apply_retention(start_offset=seg.next_offset - 4)
        first = seg._log.bytes.chunks()[0]
        assert first.start < seg._log.start_position < first.end  # the case under test
        assert seg.stats().log_bytes == stored_log_bytes(store.storage) == sum(c.stored for c in seg._log.bytes.chunks())


class LogBytesMachine(RuleBasedStateMachine):
    """Appends, compactions, retention and reopening; ``log_bytes`` always equals what is stored."""

    def __init__(self):
        super().__init__()
        self.url = f"memory://logstats-{uuid.uuid4().hex}"
        self.store = _store(self.url)
        self.seg = self.store.segment("s", create=True, cleanup_policy="compact")
        self.now = 1

    @rule(n=st.integers(1, 12), keys=st.integers(1, 4), tombstone=st.booleans())
    def append(self, n, keys, tombstone):
        for i in range(n):
            value = None if tombstone and i == n - 1 else b"x" * (20 + 7 * i)
            self.seg.append([Record(value, b"k%d" % (i % keys))], timestamp=self.now)

    @rule()
    def compact(self):
        self.now += 1
        self.seg.compact(min_lag_ms=0, tombstone_retention_ms=0, now_ms=self.now)

    @rule(back=st.integers(0, 30))
    def retention(self, back):
        self.seg.apply_retention(start_offset=max(self.seg.start_offset, self.seg.next_offset - back))

    @rule()
    def reopen(self):
        self.store.close()
        self.store = _store(self.url)
        self.seg = self.store.segment("s")

    @invariant()
    def log_bytes_is_what_is_stored(self):
        assert self.seg.stats().log_bytes == stored_log_bytes(self.store.storage)

    def teardown(self):
        self.store.close()


def test_log_bytes_model():
    run_state_machine_as_test(LogBytesMachine, settings=settings(
        max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
