"""Key-based log compaction (issue 13): tombstones, cleanup policies, the cleaner's rules.

Kafka's cleaner cases, a hypothesis model (dict key -> last value, surviving offsets), other
processes appending and tailing during compaction, and SIGKILL during compaction.
"""

from __future__ import annotations

import pytest

from attrindex import Record, SegmentStore
from attrindex.errors import CorruptDataError, InvalidInputError
from attrindex.log.batch import decode_keys, decode_records, encode_batch, read_header
from attrindex.log.cleaner import KeepRule, OffsetMap, TombstoneClock, decode_checkpoint, encode_checkpoint, rewrite_batch
from attrindex.log.cleanup_policy import CleanupPolicy, decode_policy, policy_from_options

DAY = 86_400_000

# A batch encoded by the format before tombstones existed (main at 8519730): it must decode, and
# encode, byte for byte the same.
OLD_BATCH = bytes.fromhex(
    "4149584202003800690000000200000001000000290000000700000000000000050000000000000009000000000000002a00000000"
    "000000610efd859b28067f0200763103006b31000801000101687861616161616161616161616161616161030000000000000000")


# ------------------------------------------------------------------------------- tombstones


def test_batches_without_tombstones_are_unchanged():
    fresh = encode_batch(7, [Record(b"v1", b"k1", 5, (("h", b"x"),)), Record(b"", None, 9)], timestamp=5,
                         attribute_updates=([b"a" * 16], [3]), batch_id=42)
    assert fresh == OLD_BATCH
    records = decode_records(OLD_BATCH, 0, read_header(OLD_BATCH))
    assert [(r.value, r.key, r.offset) for r in records] == [(b"v1", b"k1", 7), (b"", None, 8)]


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
    import struct
    import zlib
    head = bytearray(batch[:64])
    struct.pack_into("<I", head, 56, zlib.crc32(batch[64:]))
    struct.pack_into("<I", head, 60, zlib.crc32(bytes(head[:60])))
    return bytes(head) + batch[64:]


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
    import json

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

