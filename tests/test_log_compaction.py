"""Key-based log compaction: tombstones, cleanup policies, the cleaner's rules.

Kafka's cleaner cases, a hypothesis model (dict key -> last value, surviving offsets), other
processes appending and tailing during compaction, and SIGKILL during compaction.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from attrindex import Record, SegmentStore
from attrindex.errors import CorruptDataError, InvalidInputError, RecordTruncatedError
from attrindex.log.batch.decode import decode_keys, decode_records
from attrindex.log.batch.encode import encode_batch
from attrindex.log.batch.header import read_header, seal_header
from attrindex.log.cleaner import KeepRule, OffsetMap, TombstoneClock, decode_checkpoint, encode_checkpoint, rewrite_batch
from attrindex.log.cleanup_policy import CleanupPolicy, decode_policy, policy_from_options
from attrindex.log.framing import LOG_FRAMING
from storage_adapters import open_storage

from .conftest import make_s3_url
from .object_memory import ObjectMemoryStorage

DAY = 86_400_000

# ------------------------------------------------------------------------------- tombstones


@pytest.mark.parametrize("codec", ["none", "gzip"])
def test_tombstones_round_trip(codec):
    batch = encode_batch(3, [Record(b"a", b"k1"), Record(None, b"k2", 9, (("h", b"v"),)), b"plain",
                             Record(None, b"")], timestamp=4, codec=codec)
    header = read_header(batch)
    records = decode_records(batch, 0, header)
    assert [(r.value, r.key, r.offset) for r in records] == [(b"a", b"k1", 3), (None, b"k2", 4), (b"plain", None, 5),
                                                             (None, b"", 6)]
    assert records[1].headers == (("h", b"v"),) and records[1].timestamp == 9
    keys, dead = decode_keys(batch, 0, header)
    assert keys == [b"k1", b"k2", None, b""] and dead == b"\x00\x01\x00\x01"


def test_a_tombstone_without_a_key_is_refused():
    with pytest.raises(InvalidInputError, match="tombstone"):
        encode_batch(0, [Record(b"a", b"k"), Record(None)], timestamp=1)


def test_a_damaged_tombstone_column_is_corruption():
    batch = bytearray(encode_batch(0, [Record(None, b"k")], timestamp=1))
    # the column is the last payload byte (no updates): 2 is neither 0 nor 1
    batch[-1] = 2
    forged = _refresh_payload_crc(bytes(batch))
    with pytest.raises(CorruptDataError, match="tombstone flag"):
        decode_records(forged, 0, read_header(forged))
    batch[-1] = 1
    batch[64] = 1  # the tombstone now has a value length of 1
    forged = _refresh_payload_crc(bytes(batch))
    with pytest.raises(CorruptDataError):
        decode_records(forged, 0, read_header(forged))


def _refresh_payload_crc(batch: bytes) -> bytes:
    head = bytearray(batch[:64])
    struct.pack_into("<I", head, 56, zlib.crc32(batch[64:]))
    return seal_header(head, 0) + batch[64:]


def test_segment_reads_return_tombstones():
    with SegmentStore.open("memory://compaction-tombstones") as store:
        seg = store.segment("s", create=True)
        seg.append([Record(b"v", b"k"), Record(None, b"k")])
        assert [(r.value, r.key) for r in seg.read(0)] == [(b"v", b"k"), (None, b"k")]
        with pytest.raises(InvalidInputError, match="tombstone"):
            seg.append([Record(None)])
        assert seg.next_offset == 2


# ------------------------------------------------------------------------------- policies


def test_policy_is_stored_with_the_segment_and_read_by_new_handles(tmp_path):
    url = str(tmp_path / "store")
    with SegmentStore.open(url) as store:
        seg = store.segment("users", create=True, cleanup_policy="compact,delete", tombstone_retention_ms=5)
        assert seg.cleanup_policy() == CleanupPolicy("delete,compact", tombstone_retention_ms=5)
    with SegmentStore.open(url) as store:
        seg = store.segment("users")
        assert seg.cleanup_policy().cleanup_policy == "delete,compact"
        assert store.segment("users", cleanup_policy="delete,compact") is seg  # same options: fine
        with pytest.raises(InvalidInputError, match="configure"):
            store.segment("users", cleanup_policy="compact")
        assert seg.configure(cleanup_policy="compact").tombstone_retention_ms == 5
    with SegmentStore.open(url) as store:
        assert store.segment("users").cleanup_policy() == CleanupPolicy("compact", tombstone_retention_ms=5)
        assert store.segment("other", create=True).cleanup_policy() == CleanupPolicy()


@pytest.mark.parametrize("options, problem", [
    (dict(cleanup_policy="shrink"), "cleanup_policy"),
    (dict(cleanup_policy=3), "cleanup_policy"),
    (dict(tombstone_retention_ms=-1), "tombstone_retention_ms"),
    (dict(min_compaction_lag_ms=1.5), "min_compaction_lag_ms"),
    (dict(retention_ms="1d"), "retention_ms"),
    (dict(retain=True), "unknown"),
])
def test_bad_policy_options_are_refused_before_anything_is_written(options, problem):
    with SegmentStore.open("memory://compaction-bad-options") as store:
        with pytest.raises(InvalidInputError, match=problem):
            store.segment("s", create=True, **options)
        assert not store.exists("s")
        assert store.storage.list_files("s") == {}


def test_a_damaged_newest_policy_version_falls_back_to_the_one_before():
    with SegmentStore.open("memory://compaction-torn-policy") as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        store.storage.create("s/_config/00000000000000000001", CleanupPolicy().encode()[:-3])  # torn
        assert seg.cleanup_policy().cleanup_policy == "compact"
        assert seg.configure(min_compaction_lag_ms=7).min_compaction_lag_ms == 7  # written as version 2
        assert sorted(store.storage.list_files("s/_config")) == [f"{v:020d}" for v in range(3)]
    with pytest.raises(CorruptDataError):
        decode_policy(b"{}\n00000000", where="x")
    assert policy_from_options({"cleanup_policy": "COMPACT"}).compacts


def test_compact_only_segments_refuse_keyless_records():
    with SegmentStore.open("memory://compaction-keyless") as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for bad in ([b"plain"], [Record(b"v", b"k"), Record(b"no key")]):
            with pytest.raises(InvalidInputError, match="no key"):
                seg.append(bad)
        assert seg.next_offset == 0
        seg.update_attributes({1: 2})  # attribute updates alone need no key
        other = store.segment("d", create=True)
        other.append([b"plain"])  # the default policy (delete) takes them
        with pytest.raises(InvalidInputError, match="compact"):
            other.compact()


# ------------------------------------------------------------------------------- the pure core


def test_a_compact_segment_created_on_s3_refuses_keyless_records_from_its_first_append(s3_options):
    """On an object store a segment opens from one listing; the policy this same call stores
    must be the one its first append checks, not the default the listing (taken before) shows."""
    url = make_s3_url(s3_options)
    with SegmentStore.open(url, storage_options=s3_options) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        with pytest.raises(InvalidInputError, match="no key"):
            seg.append([b"plain"])
        assert seg.cleanup_policy().compacts
        assert seg.next_offset == 0  # nothing was appended
    with SegmentStore.open(url, storage_options=s3_options) as store:
        with pytest.raises(InvalidInputError, match="no key"):
            store.segment("s").append([b"plain"])


def test_offset_map_is_bounded_and_keeps_the_latest_offset():
    offsets = OffsetMap(3)
    assert offsets.add([b"a", b"b", b"a", None], 10)
    assert offsets.latest([b"a", b"b", b"c"]) == [12, 11, -1] and offsets.end_offset == 14
    assert offsets.add([b"a", b"c"], 20)  # one new key: fits exactly
    assert not offsets.add([b"d"], 30)  # a fourth key does not
    assert offsets.end_offset == 22 and len(offsets) == 3
    assert OffsetMap(1).add([b"x", b"y", b"z"], 0)  # an empty map takes a whole batch: progress
    long_key = b"k" * 100
    offsets.add([long_key, b"b"], 40, first=0)  # bounded check uses the digest for long keys
    with pytest.raises(InvalidInputError):
        OffsetMap(0)


def test_tombstone_clock_gives_the_first_clean_and_only_ever_merges_later():
    clock = TombstoneClock().advanced(10, 100).advanced(20, 200).advanced(15, 300)  # 15: no progress
    assert clock.cleaned_at([0, 9, 10, 19, 20]) == [100, 100, 200, 200, None]
    many = TombstoneClock()
    for i in range(1, 200):
        many = many.advanced(i * 10, i * 1000)
    assert len(many.entries) <= 64
    exact = {o: (o // 10 + 1) * 1000 for o in range(0, 1990)}
    for offset, first in zip(range(0, 1990), many.cleaned_at(list(range(0, 1990)))):
        assert first >= exact[offset]  # merged entries only make tombstones live longer
    assert decode_checkpoint(encode_checkpoint(5, clock))[1].entries == clock.entries
    assert decode_checkpoint(encode_checkpoint(5, clock)[:-1]) is None


def test_rewrite_keeps_the_latest_per_key_and_offsets():
    batch = encode_batch(100, [Record(b"1", b"a"), Record(b"2", b"b"), Record(b"3", b"a"), Record(b"4", None),
                               Record(None, b"c")], timestamp=5, codec="gzip")
    header = read_header(batch)
    offsets = OffsetMap(10)
    offsets.add([b"a", b"b", b"a", None, b"c"], 100)
    offsets.add([b"b"], 200)  # b was rewritten later
    rule = KeepRule(offsets, now_ms=10, tombstone_retention_ms=DAY, clock=TombstoneClock())
    pieces, kept, expired = rewrite_batch(batch, 0, header, rule)
    assert (kept, expired) == (3, 0)
    records = [r for p in pieces for r in decode_records(p, 0, read_header(p))]
    assert [(r.offset, r.value, r.key) for r in records] == [(102, b"3", b"a"), (103, b"4", None), (104, None, b"c")]
    assert all(read_header(p).codec == header.codec and read_header(p).batch_id == header.batch_id for p in pieces)
    # cleaned a day later, the tombstone (first cleaned at 10 by a pass ending past it) expires
    later = KeepRule(offsets, now_ms=10 + DAY, tombstone_retention_ms=DAY, clock=TombstoneClock([(105, 10)]))
    assert rewrite_batch(batch, 0, header, later)[1:] == (2, 1)
    just_before = KeepRule(offsets, now_ms=9 + DAY, tombstone_retention_ms=DAY, clock=TombstoneClock([(105, 10)]))
    assert rewrite_batch(batch, 0, header, just_before)[1:] == (3, 0)
    pinned = KeepRule(offsets, now_ms=10 + DAY, tombstone_retention_ms=DAY, clock=TombstoneClock([(105, 10)]),
                      pinned={b"c"})
    assert rewrite_batch(batch, 0, header, pinned)[1:] == (3, 0)


def test_small_gaps_between_survivors_stay_so_that_a_batch_never_grows():
    keys = [bytes([i]) for i in range(9)]  # tiny records, every other one superseded
    batch = encode_batch(0, [Record(b"", k) for k in keys], timestamp=5)
    offsets = OffsetMap(10)
    offsets.add(keys, 0)
    offsets.add(keys[::2], 50)
    rule = KeepRule(offsets, now_ms=0, tombstone_retention_ms=0, clock=TombstoneClock())
    pieces, kept, _ = rewrite_batch(batch, 0, read_header(batch), rule)
    # 0 and 8 go (no new batch needed); 2, 4 and 6 stay: removing them would cost a header each
    assert [[r.offset for r in decode_records(p, 0, read_header(p))] for p in pieces] == [list(range(1, 8))]
    assert kept == 7 and rule.kept_anyway == 3 and rule.pinned == {b"\x02", b"\x04", b"\x06"}
    big = encode_batch(0, [Record(b"x" * 80, k) for k in keys], timestamp=5)
    rule = KeepRule(offsets, now_ms=0, tombstone_retention_ms=0, clock=TombstoneClock())
    pieces, kept, _ = rewrite_batch(big, 0, read_header(big), rule)
    assert len(pieces) == 4 and kept == 4 and rule.kept_anyway == 0 and sum(map(len, pieces)) < len(big)


# ------------------------------------------------------------------------------- the command


def test_cli_shows_tombstones_policy_and_dirty_ratio(tmp_path, capsys):
    from attrindex.cli import main

    url = str(tmp_path / "store")
    with SegmentStore.open(url) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        seg.append([Record(b"v", b"k"), Record(None, b"k"), Record(b"(tombstone)", b"j")], timestamp=5)
    capsys.readouterr()
    assert main(["segment", "read", url, "s"]) == 0
    assert capsys.readouterr().out.splitlines() == ["0\t5\tk\tv", "1\t5\tk\t(tombstone)",
                                                    "2\t5\tj\t0x" + b"(tombstone)".hex()]
    assert main(["segment", "read", url, "s", "--format", "json", "--offset", "1", "--max", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == {"offset": 1, "timestamp": 5, "key": "k", "value": None,
                                                   "headers": []}
    assert main(["segment", "stats", url, "s"]) == 0
    out = capsys.readouterr().out
    assert "cleanup_policy             compact" in out and "dirty_ratio                1.000" in out
    assert main(["segment", "stats", url, "s", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["dirty_ratio"] == 1.0 and shown["cleanup_policy"]["cleanup_policy"] == "compact"


# ------------------------------------------------------------------------------- the cleaner


ROLL = 400  # tiny chunks: a few batches each


def compact_store(url="memory://", **options):
    if url == "memory://":
        url = f"memory://compaction-{uuid.uuid4().hex}"
    return SegmentStore.open(url, log_rolling_size=ROLL, **options)


def everything(seg) -> list[Record]:
    out, offset = [], seg.start_offset
    while True:
        got = seg.read(offset, 1000)
        if not got:
            return out
        out.extend(got)
        offset = got[-1].offset + 1


def seg_stored(seg) -> int:
    return sum(c.stored for c in seg._log.bytes.chunks())


def roll(seg, n=3, now=1):
    """Append keyless-free padding so that what came before lies in sealed chunks."""
    for i in range(n):
        seg.append([Record(b"p" * 150, b"pad-%d" % i)], timestamp=now)


def test_a_key_rewritten_across_chunks_keeps_its_latest_record_and_offsets():
    with compact_store() as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        seg.append([Record(b"a1", b"a"), Record(b"b1", b"b")], timestamp=1)
        roll(seg)
        seg.append([Record(b"a2", b"a")], timestamp=1)
        roll(seg)
        before = everything(seg)
        stats = seg.compact(min_lag_ms=0, now_ms=10)
        after = everything(seg)
        assert [(r.offset, r.value) for r in after if r.key in (b"a", b"b")] == [(1, b"b1"), (5, b"a2")]
        assert stats.records_before - stats.records_after == len(before) - len(after) > 0
        assert stats.chunks_cleaned > 0 and stats.bytes_after < stats.bytes_before
        assert {r.offset: r for r in before}.items() >= {r.offset: r for r in after}.items()
        # a reader at a removed offset gets the first surviving record at or after it
        assert seg.read(0, 1)[0].offset == 1
        reader = seg.reader(offset=0)
        assert [reader.read(1).offset for _ in range(len(after))] == [r.offset for r in after]
        assert seg.offset_for_timestamp(1) == 1
        assert 0 < seg.dirty_ratio() < 1  # the active chunk is after the checkpoint
        assert seg.dirty_ratio() == pytest.approx(
            store.storage.list_files("s/_log.seg")[seg._log.bytes.chunks()[-1].name] / seg_stored(seg))
        again = seg.compact(min_lag_ms=0, now_ms=11)
        assert again.chunks_cleaned == 0 and everything(seg) == after  # clean chunks stay as they are
    with compact_store(store.storage.url) as reopened:
        assert everything(reopened.segment("s")) == after


def test_tombstones_survive_exactly_their_retention_after_the_first_clean():
    with compact_store() as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        seg.append([Record(b"head", b"head")], timestamp=1)  # the log's first record may stay (see docs)
        seg.append([Record(b"v", b"k"), Record(b"w", b"other")], timestamp=1)
        seg.append([Record(None, b"k")], timestamp=1)
        roll(seg)
        first = seg.compact(min_lag_ms=0, tombstone_retention_ms=100, now_ms=1000)
        assert first.tombstones_removed == 0
        assert [(r.offset, r.value) for r in everything(seg) if r.key == b"k"] == [(3, None)]
        seg.append([Record(b"x", b"late")], timestamp=1)  # more work does not restart the clock
        roll(seg)
        assert seg.compact(min_lag_ms=0, tombstone_retention_ms=100, now_ms=1099).tombstones_removed == 0
        assert [r.value for r in everything(seg) if r.key == b"k"] == [None]
        last = seg.compact(min_lag_ms=0, tombstone_retention_ms=100, now_ms=1100)
        assert last.tombstones_removed == 1
        assert [r for r in everything(seg) if r.key == b"k"] == []
        assert [r.value for r in everything(seg) if r.key == b"other"] == [b"w"]


def test_a_pinned_key_keeps_its_tombstone_in_every_later_pass():
    """A superseded value kept between survivors pins its key; a later pass, whose key map no
    longer holds the key, must still keep the tombstone (the pin is stored with the checkpoint)."""
    with compact_store() as store:
        seg = store.segment("s", create=True, cleanup_policy="compact", tombstone_retention_ms=0)
        seg.append([Record(b"a1", b"ka"), Record(b"b1", b"kb"), Record(b"c1", b"kc")], timestamp=1)
        seg.append([Record(None, b"kb")], timestamp=1)
        roll(seg, n=6)
        first = seg.compact(min_lag_ms=0, now_ms=10)
        assert first.kept_anyway == 1  # b1 stays: removing it saves less than a batch header
        for now in (60, 10**6):
            seg.compact(min_lag_ms=0, now_ms=now)
            assert [(r.offset, r.value) for r in everything(seg) if r.key == b"kb"] == [(1, b"b1"), (3, None)]
        # written and deleted again: the pass that maps kb judges b1 again (and keeps it again)
        seg.append([Record(b"b2" * 40, b"kb")], timestamp=1)
        seg.append([Record(None, b"kb")], timestamp=1)
        roll(seg, n=6)
        for now in (10**6 + 1, 10**6 + 2):
            seg.compact(min_lag_ms=0, now_ms=now)
            assert [r.value for r in everything(seg) if r.key == b"kb"][-1] is None
    with compact_store(store.storage.url) as reopened:
        seg = reopened.segment("s")
        seg.compact(min_lag_ms=0, now_ms=10**6 + 3)
        assert [r.value for r in everything(seg) if r.key == b"kb"] == [b"b1", None]


def test_the_checkpoint_carries_the_pins_and_a_pass_that_maps_a_key_releases_its_pin():
    offsets = OffsetMap(10)
    offsets.add([b"a"], 0)
    rule = KeepRule.carrying(offsets, 0, 0, TombstoneClock(), frozenset({b"a", b"z"}))
    assert rule.pinned == {b"z"}  # a: this pass judges its older records again
    offset, clock, pins = decode_checkpoint(encode_checkpoint(5, TombstoneClock([(5, 1)]), {b"z", b"\x00" * 16}))
    assert (offset, clock.entries, pins) == (5, [(5, 1)], {b"z", b"\x00" * 16})


def _checkpoint_of_format(fmt: int, offset: int) -> bytes:
    body = json.dumps({"format": fmt, "offset": offset, "clock": [], "pins": []}).encode()
    return body + b"\n" + f"{zlib.crc32(body):08x}".encode()


@pytest.mark.parametrize("fmt", [1, 3])
def test_a_checkpoint_of_another_format_is_said_and_never_taken_for_damage(fmt, caplog):
    """An older format (ours before the pins) is not used: compaction starts from the log's
    start once, which is always safe, and says so. A newer one (a newer attrindex) is refused:
    cleaning on without what it carries could bring deleted keys back."""
    with compact_store() as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(30):  # "old" twice first: only a pass whose key map starts there removes the first
            seg.append([Record(b"%d" % i + b"." * 40, b"old" if i < 2 else b"k%d" % (i % 4))], timestamp=1)
        latest = {r.key: r.value for r in everything(seg)}
        store.storage.create(f"s/_cleaner/{20:020d}", _checkpoint_of_format(fmt, 20))
        if fmt == 3:
            with pytest.raises(CorruptDataError, match="format 3, written by a newer attrindex"):
                seg.compact(min_lag_ms=0)
            assert len(everything(seg)) == 30  # nothing cleaned
            return
        with caplog.at_level("INFO", logger="attrindex.cleaner"):
            stats = seg.compact(min_lag_ms=0)
        assert any("older format (1)" in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        survivors = everything(seg)
        assert stats.checkpoint > 20 and {r.key: r.value for r in survivors} == latest
        assert [r.offset for r in survivors if r.key == b"old"] == [1]  # cleaned from the log's start


def test_chunks_emptied_by_cleaning_keep_offsets_and_the_start():
    with compact_store() as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(6):  # chunk after chunk of the same key
            seg.append([Record(b"v%d" % i + b"." * 150, b"k")], timestamp=1)
        seg.append([Record(b"last", b"k")], timestamp=1)
        roll(seg)
        next_offset = seg.next_offset
        seg.compact(min_lag_ms=0, now_ms=5)
        kept = everything(seg)
        assert [(r.offset, r.value) for r in kept if r.key == b"k"] == [(6, b"last")]
        assert seg.start_offset <= 6 and seg.next_offset == next_offset
        assert seg.read(0, 1)[0].offset == 6
        assert seg.append([Record(b"after", b"k")]).first_offset == next_offset
        assert seg.offset_for_timestamp(0) == 6
        with compact_store(store.storage.url) as reopened:
            again = reopened.segment("s")
            assert again.next_offset == next_offset + 1 and again.start_offset <= 6
            assert again.chunk_offsets()[0][0] <= 6


def test_min_lag_and_the_active_chunk_are_never_cleaned():
    with compact_store() as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        seg.append([Record(b"head", b"head")], timestamp=1000)
        seg.append([Record(b"old", b"k")], timestamp=1000)
        roll(seg, now=1000)
        seg.append([Record(b"new", b"k")], timestamp=5000)
        roll(seg, now=5000)
        seg.append([Record(b"tail", b"k")], timestamp=5000)  # in the active chunk
        seg.compact(min_lag_ms=2000, now_ms=6000)  # the chunks of 5000 are younger than the lag
        assert [r.value for r in everything(seg) if r.key == b"k"] == [b"old", b"new", b"tail"]
        seg.compact(min_lag_ms=0, now_ms=6000)
        assert [r.value for r in everything(seg) if r.key == b"k"] == [b"new", b"tail"]  # tail: active chunk


def test_attribute_updates_in_rewritten_batches_are_kept():
    with compact_store(flush_keys=10**9, flush_seconds=10**9) as store:  # tier 1 holds them until compact
        seg = store.segment("s", create=True, cleanup_policy="compact")
        seg.append([Record(b"1", b"k")], [(1, 10)], timestamp=1)
        seg.update_attributes({2: 20})  # an attribute-only batch: it can go
        seg.append([Record(b"2", b"k")], [(1, 11), (3, 30)], timestamp=1)
        roll(seg)
        stats = seg.compact(min_lag_ms=0, now_ms=5)
        assert stats.records_after < stats.records_before
        assert seg.get_attributes([1, 2, 3]) == [11, 20, 30]
    with compact_store(store.storage.url) as reopened:
        assert reopened.segment("s").get_attributes([1, 2, 3]) == [11, 20, 30]


def test_a_small_key_map_cleans_in_several_passes_to_the_same_result():
    results = []
    for capacity in (1_000_000, 3):
        with compact_store() as store:
            seg = store.segment("s", create=True, cleanup_policy="compact")
            for i in range(40):
                seg.append([Record(b"%d" % i, b"k%d" % (i % 7))], timestamp=1)
            roll(seg)
            stats = seg.compact(min_lag_ms=0, now_ms=5, max_map_keys=capacity)
            results.append([(r.offset, r.key, r.value) for r in everything(seg)])
            if capacity == 3:
                assert stats.passes > 1
    assert results[0] == results[1]


def test_delete_compact_applies_the_policy_retention_first():
    with compact_store() as store:
        seg = store.segment("s", create=True, cleanup_policy="delete,compact", retention_ms=1000)
        seg.append([Record(b"ancient", b"a")], timestamp=0)
        roll(seg, now=0)
        seg.append([Record(b"b1", b"b")], timestamp=9000)
        roll(seg, now=9000)
        seg.append([Record(b"b2", b"b")], timestamp=9000)
        roll(seg, now=9000)
        stats = seg.compact(min_lag_ms=0, now_ms=9500)
        assert stats.retention_chunks_deleted > 0
        values = [r.value for r in everything(seg)]
        assert b"ancient" not in values and b"b1" not in values and b"b2" in values


def test_a_segment_switched_to_compact_keeps_its_keyless_records():
    with compact_store() as store:
        seg = store.segment("s", create=True)
        seg.append([b"keyless", Record(b"v1", b"k")], timestamp=1)
        seg.append([Record(b"v2", b"k")], timestamp=1)
        roll(seg)
        seg.configure(cleanup_policy="compact")
        seg.compact(min_lag_ms=0, now_ms=5)
        assert [(r.offset, r.value) for r in everything(seg)][:2] == [(0, b"keyless"), (2, b"v2")]


def test_the_compact_command(tmp_path, capsys):
    from attrindex.cli import main

    url = str(tmp_path / "store")
    with compact_store(url) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(12):
            seg.append([Record(b"%d" % i + b"." * 60, b"k%d" % (i % 2))], timestamp=1)
        roll(seg)
        plain = store.segment("d", create=True)
        plain.append([b"x"])
    capsys.readouterr()
    assert main(["segment", "compact", url, "s", "--min-lag", "0s", "--tombstone-retention", "1h"]) == 0
    out = capsys.readouterr().out
    before, after = map(int, re.search(r"compacted \d+ chunk\(s\): (\d+) -> (\d+) records", out).groups())
    assert before > after and "dirty ratio now" in out
    assert main(["segment", "compact", url, "d"]) == 2
    assert "cleanup_policy 'delete'" in capsys.readouterr().err
    with compact_store(url) as store:
        assert len(everything(store.segment("s"))) < 15


def test_spark_free_scan_ranges_do_not_repeat_records_across_gaps():
    from attrindex.spark.scan import ScanBounds, ScanRange, scan

    with compact_store() as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(20):
            seg.append([Record(b"%d" % i, b"k%d" % (i % 3))], timestamp=1)
        roll(seg)
        seg.compact(min_lag_ms=0, now_ms=5)
        bounds = ScanBounds()
        halves = [ScanRange("s", 0, 10), ScanRange("s", 10, seg.next_offset)]
        got = [o for part in halves for batch in scan(store, part, bounds) for o in batch.column("offset").to_pylist()]
        assert got == [r.offset for r in everything(seg)]


# ------------------------------------------------------------------------------- the model


KEYS = [b"k%d" % i for i in range(6)]
RETENTION = 1000


class CompactionMachine(RuleBasedStateMachine):
    """Appends (values, tombstones, attribute updates), compactions, time, reopens against a model:
    every appended record by offset, the attributes, and when each tombstone was first cleaned."""

    def __init__(self):
        super().__init__()
        self.url = f"memory://compaction-model-{uuid.uuid4().hex}"
        self.store = compact_store(self.url)
        self.seg = self.store.segment("s", create=True)  # delete first: keyless records get in
        self.appended: dict[int, tuple] = {}  # offset -> (key, value)
        self.attributes: dict[int, int] = {}
        self.first_cleaned: dict[int, int] = {}  # tombstone offset -> time of the first clean passing it
        self.now = 1000

    @initialize(keyless=st.integers(0, 2))
    def keyless_then_compact(self, keyless):
        for i in range(keyless):
            self.add(self.seg.append([b"keyless-%d" % i], timestamp=self.now), [(None, b"keyless-%d" % i)])
        self.seg.configure(cleanup_policy="compact", tombstone_retention_ms=RETENTION)

    def add(self, result, records):
        for offset, record in zip(range(result.first_offset, result.last_offset + 1), records):
            self.appended[offset] = record

    @rule(items=st.lists(st.tuples(st.sampled_from(KEYS), st.one_of(st.none(), st.binary(min_size=70, max_size=90),
                                                                     st.binary(min_size=1, max_size=4))),
                         min_size=1, max_size=5),
          attribute=st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 99))))
    def append(self, items, attribute):
        updates = [] if attribute is None else [attribute]
        result = self.seg.append([Record(v, k) for k, v in items], updates, timestamp=self.now)
        self.add(result, items)
        if attribute is not None:
            self.attributes[attribute[0]] = attribute[1]

    @rule()
    def keyless_is_refused(self):
        with pytest.raises(InvalidInputError):
            self.seg.append([b"no key"])

    @rule(ms=st.sampled_from([1, RETENTION // 2, RETENTION - 1, RETENTION]))
    def advance(self, ms):
        self.now += ms

    @rule(capacity=st.sampled_from([2, 1000]))
    def compact(self, capacity):
        stats = self.seg.compact(min_lag_ms=0, now_ms=self.now, max_map_keys=capacity)
        for offset, (key, value) in self.appended.items():
            if value is None and offset < stats.checkpoint:
                self.first_cleaned.setdefault(offset, self.now)
        survivors = everything(self.seg)
        # Below the checkpoint a record with a big value survives only as the latest of its key
        # (removing one always pays for a batch header), or as the log's first record (it holds the
        # start offset). Small values between survivors and tombstones may stay longer (see docs).
        first = min(self.appended, default=0)
        for r in survivors:
            if (r.value is not None and len(r.value) >= 70 and r.key is not None and r.offset < stats.checkpoint
                    and r.offset != first):
                later = [o for o, (k, _v) in self.appended.items() if k == r.key and r.offset < o < stats.checkpoint]
                assert not later, f"{r.key!r} at {r.offset} survives although {later} came after it"

    @rule()
    def reopen(self):
        self.store.close()
        self.store = compact_store(self.url)
        self.seg = self.store.segment("s")

    @invariant()
    def matches_the_model(self):
        survivors = everything(self.seg)
        offsets = [r.offset for r in survivors]
        assert offsets == sorted(set(offsets))
        latest: dict[bytes, int] = {}
        for offset, (key, _value) in self.appended.items():
            if key is not None:
                latest[key] = max(latest.get(key, -1), offset)
        present = {r.offset for r in survivors}
        for r in survivors:  # every survivor is what was appended there
            assert (r.key, r.value) == self.appended[r.offset]
        for offset, (key, value) in self.appended.items():
            if key is None:
                assert offset in present, "a keyless record was removed"
        for key, offset in latest.items():
            if self.appended[offset][1] is not None or offset not in self.first_cleaned:
                assert offset in present, f"the latest record of {key!r} is gone"
            elif self.now - self.first_cleaned[offset] < RETENTION:
                assert offset in present, "a tombstone went before its retention"
            if offset not in present:  # an expired tombstone: no older value of its key may come back
                # (an older tombstone of the key may stay, kept between survivors of its batch: it
                # deletes the key all the same)
                assert all(r.key != key or r.value is None for r in survivors), f"an older value of {key!r} came back"
        assert self.seg.get_attributes(list(self.attributes)) == list(self.attributes.values())
        for stamp in sorted({r.timestamp for r in survivors})[::3]:  # the time index over the gaps
            assert self.seg.offset_for_timestamp(stamp) == min(r.offset for r in survivors if r.timestamp >= stamp)

    def teardown(self):
        self.store.close()


def test_compaction_model():
    run_state_machine_as_test(CompactionMachine, settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


# ------------------------------------------------------------------------------- other processes

_WRITER = """
import sys, time
from attrindex import Record, SegmentStore
url, count = sys.argv[1], int(sys.argv[2])
with SegmentStore.open(url, log_rolling_size=%d) as store:
    seg = store.segment("s")
    for i in range(count):
        r = seg.append([Record(b"%%d" %% i, b"k%%d" %% (i %% 5))], timestamp=1)
        print(r.first_offset, i, flush=True)
        time.sleep(0.002)
""" % ROLL

_TAILER = """
import sys
from attrindex import SegmentStore
url, until = sys.argv[1], int(sys.argv[2])
with SegmentStore.open(url, log_rolling_size=%d) as store:
    reader = store.segment("s").reader(offset=0)
    while True:
        r = reader.read(20)
        if r is None:
            break
        print(r.offset, r.key.decode(), r.value.decode(), flush=True)
        if r.offset >= until:
            break
""" % ROLL

_COMPACTOR = """
import sys
from attrindex import SegmentStore
url = sys.argv[1]
options = eval(sys.argv[2])
with SegmentStore.open(url, storage_options=options, log_rolling_size=%d) as store:
    seg = store.segment("s")
    print("ready", flush=True)
    while True:
        print("done", seg.compact(min_lag_ms=0).chunks_cleaned, flush=True)
""" % ROLL


def _child(code: str, *args: str):
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                            env=_child_env())


def _child_env():
    return {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}


def test_a_writer_and_a_tailing_reader_in_other_processes_during_compaction(tmp_path):
    url = str(tmp_path / "store")
    count = 150
    with compact_store(url) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        writer = _child(_WRITER, url, str(count))
        tailer = _child(_TAILER, url, str(count - 1))
        compactions = 0
        while writer.poll() is None:
            compactions += seg.compact(min_lag_ms=0).chunks_cleaned > 0
            time.sleep(0.02)
        written = [tuple(map(int, line.split())) for line in writer.stdout]
        assert writer.wait() == 0 and len(written) == count
        seen = [line.split() for line in tailer.communicate(timeout=60)[0].splitlines()]
        assert tailer.returncode == 0
        seg.compact(min_lag_ms=0)
        final = everything(seg)
    by_offset = {offset: i for offset, i in written}
    offsets = [int(o) for o, _k, _v in seen]
    assert offsets == sorted(set(offsets)), "the tailer saw a record twice or out of order"
    for offset, key, value in seen:  # each record seen is the one written there
        i = by_offset[int(offset)]
        assert (key, value) == ("k%d" % (i % 5), "%d" % i)
    assert {r.offset for r in final} <= set(offsets), "a surviving record was never seen by the tailer"
    assert compactions > 0, "no compaction ran while the processes worked"


def test_two_cleaners_at_once_both_finish_with_a_valid_log(tmp_path):
    url = str(tmp_path / "store")
    with compact_store(url) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(200):
            seg.append([Record(b"%d" % i + b"." * 40, b"k%d" % (i % 9))], timestamp=1)
        latest = {r.key: r for r in everything(seg)}
    errors, stores = [], [compact_store(url) for _ in range(2)]

    def clean(handle):
        try:
            for _ in range(3):
                handle.segment("s").compact(min_lag_ms=0)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=clean, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for handle in stores:
        handle.close()
    assert errors == []
    with compact_store(url) as store:
        survivors = everything(store.segment("s"))
    assert {r.key: r for r in survivors} == latest
    assert len(survivors) < 60


def test_a_pass_that_loses_the_switch_to_another_cleaner_starts_again(tmp_path):
    from attrindex.log.cleaner import LogCleaner

    url = str(tmp_path / "store")
    with compact_store(url) as store, compact_store(url) as other:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(30):
            seg.append([Record(b"%d" % i + b"." * 40, b"k%d" % (i % 4))], timestamp=1)
        latest = {r.key: r for r in everything(seg)}
        raced = []

        class Racing(LogCleaner):
            def _clean(self, spans, rule):
                if not raced:  # another process cleans the chunks this pass has just planned
                    raced.append(other.segment("s").compact(min_lag_ms=0).chunks_cleaned)
                super()._clean(spans, rule)

        cleaner = Racing(seg._cleaner_log(), limit=seg._log.position, min_lag_ms=0, tombstone_retention_ms=DAY,
                         now_ms=10)
        cleaner.run()
        assert raced[0] > 0 and cleaner.passes == 2  # the first pass lost the switch and ran again
        seg.refresh()
        assert {r.key: r for r in everything(seg)} == latest


# ------------------------------------------------------------- retention racing a compaction
def _place(backend: str, tmp_path) -> tuple[str, str]:
    return backend, f"race-{uuid.uuid4().hex}" if backend != "local" else str(tmp_path / "store")


def _store(place: tuple[str, str]) -> SegmentStore:
    """A new handle on the store at ``place``, on its own storage object."""
    backend, where = place
    storage = ObjectMemoryStorage(where) if backend == "objects" else open_storage(
        f"memory://{where}" if backend == "memory" else where)
    return SegmentStore(storage, log_rolling_size=ROLL)


def _sealed_chunks(place: tuple[str, str], kept: str) -> tuple[int, int]:
    """A ``delete,compact`` segment of sealed chunks and one being appended to (on objects, one
    chunk per append). Records alternate two hot keys (superseded: compaction removes them);
    with ``kept == "most"``, one in three has a hot key and the others keys of their own (kept,
    and packed towards the replacement's start). ``(start of the second chunk, max_bytes that
    makes retention delete the first chunk only)``."""
    with _store(place) as store:
        seg = store.segment("s", create=True, cleanup_policy="delete,compact", min_compaction_lag_ms=0)
        while seg.next_offset < 13:
            n = seg.next_offset
            key = b"k%d" % (n % 2) if kept == "none" else b"h" if n % 3 == 0 else b"u%d" % n
            seg.append([Record(b"." * 60 + b"%d" % n, key)])
        chunks = seg._log.chunks
        return chunks[1].start, chunks[-1].end - chunks[1].start


def _compact(place: tuple[str, str], into: list[Record]) -> None:
    """Compact the segment in a handle of its own; ``into`` gets the records it then holds."""
    with _store(place) as cleaner:
        assert cleaner.segment("s").compact().chunks_cleaned >= 2
        into.extend(everything(cleaner.segment("s")))


def _readable(place: tuple[str, str]) -> tuple[int, list[Record]]:
    """The start offset and the records from it, read by a fresh handle and by a tail reader
    alike; ``verify_segment`` finds no damage."""
    with _store(place) as store:
        seg = store.segment("s")
        records = everything(seg)
        reader = seg.reader()
        assert [(r.offset, r.value) for r in (reader.read(timeout=5) for _ in records)] == \
            [(r.offset, r.value) for r in records]
        assert store.verify_segment("s").ok
        if seg.start_offset:
            with pytest.raises(RecordTruncatedError):
                seg.read(seg.start_offset - 1)
        return seg.start_offset, records


@pytest.mark.parametrize("backend", ["memory", "local", "objects"])
def test_retention_whose_cut_a_compaction_rewrote_after_its_plan_plans_again(backend, tmp_path, monkeypatch):
    """Retention chooses its cut (the second chunk's start) in its view; then a compaction in
    another handle packs the chunks around it into one. The cut no longer lies where retention
    meant: the truncation is refused, nothing is cut, and retention plans again on the new layout."""
    from attrindex.log import retention as retention_module

    place = _place(backend, tmp_path)
    _cut, max_bytes = _sealed_chunks(place, "none")
    real_plan, planned, compacted = retention_module.plan_retention, [], []

    def racing_plan(log, *args):
        planned.append(real_plan(log, *args))
        if len(planned) == 1:
            _compact(place, compacted)
        return planned[-1]

    monkeypatch.setattr(retention_module, "plan_retention", racing_plan)
    with _store(place) as retainer:
        retainer.segment("s").apply_retention(max_bytes=max_bytes)
    assert len(planned) == 2 and planned[0][1] == 1  # one chunk to delete, refused; planned again
    start, records = _readable(place)
    assert start <= compacted[0].offset  # the packed chunk holds nothing retention meant to delete
    assert [(r.offset, r.value) for r in records] == [(r.offset, r.value) for r in compacted]


@pytest.mark.parametrize("backend, kept", [("memory", "none"), ("local", "none"), ("objects", "none"),
                                           ("objects", "most")])  # the cut lands in the hole; inside a batch
def test_a_cut_that_lands_inside_a_chunk_compacted_meanwhile_starts_the_log_past_that_chunk(backend, kept, tmp_path,
                                                                                          monkeypatch):
    """The replacement switches between retention's last look and its truncation marker (no
    check can close that window on object stores), so the marker names a byte inside the packed
    chunk: in its hole, or inside one of its batches. Every handle then starts the log at that
    chunk's end: no read starts at a byte that is no batch, no record past the chunk is skipped
    (a tail reader restarting at the start offset lands on them), and verify, compaction and
    retention go on. What it costs: the packed chunk's records above the cut go too."""
    place = _place(backend, tmp_path)
    cut, max_bytes = _sealed_chunks(place, kept)
    compacted: list[Record] = []
    with _store(place) as retainer:
        storage = retainer.storage
        real_marker = storage.put_marker

        def racing_marker(path):
            if "/truncation/" in path and not compacted:
                _compact(place, compacted)
            real_marker(path)

        monkeypatch.setattr(storage, "put_marker", racing_marker)
        seg = retainer.segment("s")
        assert seg.apply_retention(max_bytes=max_bytes) == 1
        monkeypatch.setattr(storage, "put_marker", real_marker)
        seg.refresh()
        packed = seg._log.bytes.chunk_at(cut)
        assert packed.generation and packed.start < cut < packed.end
        if kept == "most":
            assert cut < packed.stored_end  # inside the packed batches, not in the hole
        start, records = _readable(place)
        assert seg.start_offset == start
        assert [(r.offset, r.value) for r in records] == [(r.offset, r.value) for r in compacted
                                                            if r.offset >= start]
        assert records[0].offset == min(r.offset for r in compacted if r.offset >= seg._log.summary(
            seg._log.chunk_index(packed.end)).base_offset)  # the first record past the packed chunk
        seg.append([Record(b"after", b"k0")])
        seg.compact()
        seg.apply_retention(max_bytes=max_bytes)
    _start, records = _readable(place)
    assert records[-1].value == b"after"


def test_a_cut_that_lands_inside_a_chunk_consolidated_meanwhile_stays_where_it_was_chosen(tmp_path, monkeypatch):
    """Consolidation keeps every byte where it was: a cut chosen at the second chunk's start and
    landing inside the merged chunk still starts a batch, so the log starts exactly there and
    nothing retention meant to keep is lost (the rule's other branch)."""
    place = _place("objects", tmp_path)
    cut, max_bytes = _sealed_chunks(place, "none")
    with _store(place) as before_store:
        records = everything(before_store.segment("s"))
        first_kept = before_store.segment("s")._log.summary(1).base_offset
    merged: list[int] = []
    with _store(place) as retainer:
        storage = retainer.storage
        real_marker = storage.put_marker

        def racing_marker(path):
            if "/truncation/" in path and not merged:
                with _store(place) as other:
                    merged.append(other.segment("s").consolidate())
            real_marker(path)

        monkeypatch.setattr(storage, "put_marker", racing_marker)
        assert retainer.segment("s").apply_retention(max_bytes=max_bytes) == 1
    assert merged[0] >= 1
    with _store(place) as store:
        log = store.segment("s")._log
        holder = log.bytes.chunk_at(cut)
        assert holder.generation and holder.start < cut == log.start_position  # inside the merged chunk, kept
    start, readable = _readable(place)
    assert start == first_kept
    assert [(r.offset, r.value) for r in readable] == [(r.offset, r.value) for r in records if r.offset >= first_kept]


def test_retention_that_keeps_losing_its_cut_to_compactions_gives_up_having_cut_nothing(tmp_path, monkeypatch):
    """Each planned cut refused (another handle rewrote its chunk every time): after the bound,
    ``RetriesExhaustedError``, and the log is as it was."""
    from attrindex.errors import LayoutConflictError, RetriesExhaustedError
    from attrindex.log import segment_log

    place = _place("memory", tmp_path)
    _cut, max_bytes = _sealed_chunks(place, "none")

    def always_rewritten(self, position):
        raise LayoutConflictError("rewritten meanwhile (injected)")

    monkeypatch.setattr(segment_log.SegmentLog, "truncate_at", always_rewritten)
    with _store(place) as store:
        seg = store.segment("s")
        before = everything(seg)
        with pytest.raises(RetriesExhaustedError, match="kept rewriting"):
            seg.apply_retention(max_bytes=max_bytes)
        assert seg.start_offset == 0 and everything(seg) == before


def test_a_replacement_that_lost_every_generation_race_is_passed_up_not_planned_again(tmp_path, monkeypatch):
    """A replacement retries a lost generation race ``MAX_REPLACE_ATTEMPTS`` times; at that bound
    the cleaner passes its ``ReplaceRetriesExhaustedError`` up after that ONE replacement instead of
    planning the pass again (which would run the same races up to 11 times more). Nothing of it is
    visible; the next compaction, without the racer, cleans."""
    from attrindex.errors import LayoutConflictError, ReplaceRetriesExhaustedError
    from storage_adapters.rolling_replace import MAX_REPLACE_ATTEMPTS, ChunkReplacer

    url = str(tmp_path / "store")
    with compact_store(url) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(30):
            seg.append([Record(b"%d" % i + b"." * 40, b"k%d" % (i % 4))], timestamp=1)
        latest, before = {r.key: r for r in everything(seg)}, everything(seg)
        real_switch, switches = ChunkReplacer._switch, []

        def lose_the_race(self, gen, name):
            switches.append(gen)
            self._fence(gen)  # another replacer takes this generation first (its switch marker)
            return real_switch(self, gen, name)

        monkeypatch.setattr(ChunkReplacer, "_switch", lose_the_race)
        with pytest.raises(ReplaceRetriesExhaustedError, match=f"{MAX_REPLACE_ATTEMPTS} lost races") as raised:
            seg.compact(min_lag_ms=0)
        assert isinstance(raised.value, LayoutConflictError) and len(switches) == MAX_REPLACE_ATTEMPTS
        monkeypatch.undo()
        seg.refresh()
        assert everything(seg) == before
        assert seg.compact(min_lag_ms=0).chunks_cleaned > 0
        assert {r.key: r for r in everything(seg)} == latest


def test_a_pass_whose_later_chunks_another_handle_consolidated_starts_again(tmp_path):
    """The first group's switch reloads the view, which then shows a consolidation (by another
    handle) of the chunks of a later group: that group is a lost race, not bad input."""
    from attrindex.log.cleaner import LogCleaner
    from storage_adapters import RollingSegment, open_storage

    url = str(tmp_path / "store")
    with compact_store(url) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(30):  # a key of its own now and then: every chunk keeps a survivor
            seg.append([Record(b"%d" % i + b"." * 40, b"u%d" % i if i % 3 == 0 else b"k%d" % (i % 4))], timestamp=1)
        latest = {r.key: r for r in everything(seg)}
        consolidated = []

        class Racing(LogCleaner):
            def _clean(self, spans, rule):
                if not consolidated:  # another process merges the chunks of the second and third group
                    with open_storage(url) as storage:
                        other = RollingSegment(storage, "s/_log", rolling_size=ROLL, framing=LOG_FRAMING)
                        first, second = other.chunks()[2:4]
                        other.replace_range(first.start, second.end, other.read(first.start, second.end - first.start))
                        consolidated.append((first.start, second.end))
                super()._clean(spans, rule)

        cleaner = Racing(seg._cleaner_log(), limit=seg._log.position, min_lag_ms=0, tombstone_retention_ms=DAY,
                         now_ms=10, max_group_bytes=1)
        cleaner.run()
        assert consolidated and cleaner.passes == 2  # the first pass lost the race and ran again
        seg.refresh()
        assert {r.key: r for r in everything(seg)} == latest


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_an_open_racing_log_compaction_sees_every_attribute_update(backend, tmp_path, monkeypatch):
    """The cleaner drops the attribute updates of the batches it rewrites below its limit (a newer
    tree version, merged first, holds them). An open that read the older tree version before the
    compaction and lists the log after it still answers every attribute update (never the older
    version plus rewritten batches without them)."""
    from attrindex.log import segment_log

    url = f"memory://compaction-open-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)
    store = SegmentStore.open(url, log_rolling_size=200, flush_keys=10**6, flush_seconds=10**6)
    writer = store.segment("s", create=True, cleanup_policy="compact")
    writer.configure(min_compaction_lag_ms=0)
    writer.append([Record(b"first", key=b"k")], [(0, 0)])
    writer.flush()  # tree checkpoint C0
    for i in range(1, 30):  # each batch supersedes the last one's record: the cleaner drops them
        writer.append([Record(b"v%d" % i, key=b"k")], [(i, i)])
    real = segment_log.SegmentLog.open_at
    raced = []

    def open_at(self, position):
        if not raced and self.segment == "s":
            raced.append(position)
            writer.compact(min_lag_ms=0)  # merges (checkpoint C1), then rewrites chunks below C1
        return real(self, position)

    monkeypatch.setattr(segment_log.SegmentLog, "open_at", open_at)
    reader = SegmentStore.open(url).segment("s")
    assert raced
    assert reader.get_attributes(range(30)) == list(range(30))
    reader.close()
    writer.close()


@pytest.mark.parametrize("fault", ["fail_before", "lost_ack", "torn", "enospc"])
@pytest.mark.parametrize("target", ["_log.seg", "_cleaner"])  # the switch's writes, the checkpoint
def test_a_storage_fault_during_compaction_leaves_a_valid_log(fault, target, tmp_path):
    from storage_adapters import open_storage
    from storage_adapters.errors import StorageError
    from storage_adapters.faults import FaultyStorage

    storage = FaultyStorage(open_storage(str(tmp_path / "store")), seed=3)
    store = SegmentStore(storage, log_rolling_size=ROLL)
    seg = store.segment("s", create=True, cleanup_policy="compact")
    for i in range(30):
        seg.append([Record(b"%d" % i + b"." * 40, b"k%d" % (i % 4))], timestamp=1)
    before = {r.offset: r for r in everything(seg)}
    latest = {r.key: r for r in before.values()}
    storage.script(fault, op="create", path_contains=target)
    try:
        seg.compact(min_lag_ms=0)
    except StorageError:
        pass
    assert storage.injected, "the fault was not injected"
    for handle in (seg, SegmentStore(open_storage(str(tmp_path / "store")), log_rolling_size=ROLL).segment("s")):
        survivors = everything(handle)
        assert all(before[r.offset] == r for r in survivors) and {r.key: r for r in survivors} == latest
    stats = seg.compact(min_lag_ms=0)  # and the next compaction finishes the work
    below = [r.key for r in everything(seg) if r.offset < stats.checkpoint]
    assert stats.checkpoint > 0 and len(below) == len(set(below))


def _killed_compactions(url, options, rounds, per_round=40):
    """SIGKILL a process compacting a segment, ``rounds`` times at varying moments (more records
    appended before each, so that there is work); after each kill the segment must hold a valid
    state: either layout of every group, no record lost or duplicated, every key's latest there."""
    rng = random.Random(5)
    appended, latest = {}, {}
    mid_compaction = 0  # kills that landed before the first compaction finished
    for round_number in range(rounds):
        with SegmentStore.open(url, storage_options=options, log_rolling_size=ROLL) as store:
            seg = store.segment("s", create=True, cleanup_policy="compact")
            for i in range(per_round):
                records = [Record(b"%d-%d" % (round_number, i), b"k%d" % rng.randrange(12))]
                if i % 9 == 0:
                    records.append(Record(None, b"k%d" % rng.randrange(12)))
                result = seg.append(records, timestamp=1)
                for offset, record in zip(range(result.first_offset, result.last_offset + 1), records):
                    appended[offset] = (record.key, record.value)
                    latest[record.key] = offset
        child = _child(_COMPACTOR, url, repr(options))
        assert child.stdout.readline().strip() == "ready"
        time.sleep((0.005, 0.03, 0.1, 0.2)[round_number % 4])
        child.send_signal(signal.SIGKILL)
        child.wait()
        mid_compaction += not child.stdout.read().strip()
        with SegmentStore.open(url, storage_options=options, log_rolling_size=ROLL) as store:
            survivors = everything(store.segment("s"))
        offsets = [r.offset for r in survivors]
        assert offsets == sorted(set(offsets)), "a record is duplicated"
        for r in survivors:
            assert (r.key, r.value) == appended[r.offset]
        for key, offset in latest.items():
            assert offset in offsets, f"the latest record of {key!r} was lost"
    with SegmentStore.open(url, storage_options=options, log_rolling_size=ROLL) as store:
        seg = store.segment("s")
        seg.compact(min_lag_ms=0)
        assert {r.key: (r.key, r.value) for r in everything(seg)} == {k: appended[o] for k, o in latest.items()}
    assert mid_compaction, "no kill landed inside a compaction: the test did not exercise a crash"


def test_sigkill_during_compaction_on_local_disk(tmp_path):
    _killed_compactions(str(tmp_path / "store"), {}, rounds=4)


def test_sigkill_during_compaction_on_s3(s3_options):

    _killed_compactions(make_s3_url(s3_options), s3_options, rounds=2, per_round=20)
