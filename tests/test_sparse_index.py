"""Sparse offset/time indexes of a log chunk: Kafka's index tests, a builder model test, the file."""

from __future__ import annotations

import random
import struct
import zlib
from bisect import bisect_right

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attrindex.errors import CorruptDataError, InvalidInputError
from attrindex.log.sparse_index import (
    HEADER_SIZE,
    MIN_TIMESTAMP,
    NO_TIMESTAMP,
    WARM_ENTRIES,
    ChunkIndexBuilder,
    CorruptIndexError,
    IndexFullError,
    InvalidIndexEntryError,
    OffsetIndex,
    TimeIndex,
    decode_chunk_index,
    encode_chunk_index,
)

I64_MAX = (1 << 63) - 1


# -- OffsetIndex (Kafka's OffsetIndexTest) -----------------------------------------------------


@given(st.dictionaries(st.integers(0, 10_000), st.integers(0, 50), max_size=300),
       st.lists(st.integers(-5, 10_100), max_size=50))
def test_offset_random_lookup(gaps, targets):
    """randomLookupTest: lookup agrees with a floor lookup in a sorted-dict model."""
    base = 100
    index = OffsetIndex(base)
    model = {}
    position = 0
    for offset in sorted(gaps):
        position += gaps[offset]
        index.append(base + offset, position)
        model[base + offset] = position
    for target in targets + [base + o for o in model] + [base - 1, base]:
        below = [o for o in model if o <= target]
        expected = (max(below), model[max(below)]) if below else (base, 0)
        assert index.lookup(target) == expected


def test_offset_lookup_extreme_cases():
    """lookupExtremeCases: empty index, below the first entry, far above the last."""
    index = OffsetIndex(45, max_entries=30)
    assert index.lookup(45) == (45, 0)  # empty
    assert index.last_offset == 45 and len(index) == 0
    for i in range(index.max_entries):
        index.append(45 + i + 1, i)
    assert index.lookup(45) == (45, 0)  # below the first entry: the fallback
    assert index.lookup(0) == (45, 0)
    assert index.lookup(45 + 2 * index.max_entries) == index.entry(len(index) - 1) == (75, 29)
    assert index.lookup(I64_MAX) == (75, 29)


def test_offset_append_too_many():
    """appendTooMany: a full index refuses appends with IndexFullError."""
    index = OffsetIndex(45, max_entries=30)
    for i in range(30):
        index.append(45 + i + 1, i)
    assert index.is_full
    with pytest.raises(IndexFullError):
        index.append(45 + 31, 31)
    with pytest.raises(InvalidInputError):  # it is an input error, for callers catching broadly
        OffsetIndex(0, max_entries=0).append(0, 0)


def test_offset_append_out_of_order():
    """appendOutOfOrder: offsets must ascend strictly, positions never fall, nothing below base."""
    index = OffsetIndex(45)
    index.append(51, 0)
    for offset, position in [(50, 1), (51, 1), (52, -1)]:
        with pytest.raises(InvalidIndexEntryError):
            index.append(offset, position)
    with pytest.raises(InvalidIndexEntryError):
        OffsetIndex(45).append(44, 0)
    index.append(52, 0)  # equal positions are allowed
    assert index.entries == [(51, 0), (52, 0)]


def test_offset_truncate():
    """truncate: past the end, at the end, exactly on an entry, in the middle, everything."""
    index = OffsetIndex(0, max_entries=10)
    for i in range(1, 10):
        index.append(i, i)
    index.truncate_to(12)  # past the end: nothing goes
    assert index.lookup(10) == (9, 9) and index.last_offset == 9
    index.append(10, 10)
    index.truncate_to(10)  # exactly on the last entry: it goes
    assert index.lookup(10) == (9, 9) and index.last_offset == 9
    index.append(10, 10)
    index.truncate_to(9)  # on an entry: it and everything after go
    assert index.lookup(10) == (8, 8) and index.last_offset == 8
    index.append(9, 9)
    index.truncate_to(5)  # in the middle
    assert index.lookup(10) == (4, 4) and index.last_offset == 4
    index.append(5, 5)  # still appendable after truncation
    index.truncate_to(0)
    assert len(index) == 0 and index.lookup(10) == (0, 0)
    index.append(0, 0)  # an entry at the base offset is allowed in an empty index


# -- TimeIndex (Kafka's TimeIndexTest) ---------------------------------------------------------


def _time_index(entries: int, base: int = 45, max_entries: int = 30) -> TimeIndex:
    index = TimeIndex(base, max_entries)
    for i in range(1, entries + 1):
        index.maybe_append(i * 10, i * 10 + base)
    return index


def test_time_lookup():
    """lookUp: below the first entry gives (-1, base); otherwise the largest entry timestamp <= target."""
    index = _time_index(29)
    assert index.lookup(5) == (NO_TIMESTAMP, 45)
    assert index.lookup(-1) == (NO_TIMESTAMP, 45)
    assert index.lookup(10) == (10, 55)  # exactly the first entry
    for t in range(10, 300):
        assert index.lookup(t) == (t // 10 * 10, t // 10 * 10 + 45)
    assert index.lookup(I64_MAX) == (290, 335)
    assert TimeIndex(7).lookup(123) == (NO_TIMESTAMP, 7)  # empty


def test_time_maybe_append_only_when_timestamp_grows():
    """maybeAppend: writes only a growing timestamp; a lower offset or timestamp is a caller bug."""
    index = TimeIndex(45)
    index.maybe_append(-500, 45)  # negative timestamps are valid here, even first
    index.maybe_append(100, 50)
    index.maybe_append(100, 60)  # same max: keeps the first offset that reached it
    assert index.entries == [(-500, 45), (100, 50)]
    assert index.last_entry == (100, 50)
    with pytest.raises(InvalidIndexEntryError):
        index.maybe_append(200, 49)  # offset below the last entry's
    with pytest.raises(InvalidIndexEntryError):
        index.maybe_append(99, 70)  # timestamp below the last entry's
    with pytest.raises(InvalidIndexEntryError):
        TimeIndex(45).maybe_append(1, 44)  # below the base offset
    index.maybe_append(101, 50)  # a new max may share the last offset
    assert len(index) == 3


def test_time_full():
    """A full time index refuses only appends that would write an entry."""
    index = _time_index(30)
    assert index.is_full
    index.maybe_append(300, 400)  # not growing: nothing to write, no error
    with pytest.raises(IndexFullError):
        index.maybe_append(301, 400)


def test_time_truncate():
    """truncate: drops entries whose offset is >= the truncation offset."""
    index = _time_index(29)
    index.truncate_to(10 + 45)
    assert len(index) == 0 and index.lookup(1000) == (NO_TIMESTAMP, 45)
    index = _time_index(29)
    index.truncate_to(100 + 45)  # exactly on an entry
    assert index.last_entry == (90, 135)
    index.truncate_to(131)  # between entries
    assert index.last_entry == (80, 125)
    index.truncate_to(10_000)  # past the end
    assert index.last_entry == (80, 125)
    index.maybe_append(85, 130)


# -- warm-section search -----------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.integers(2000, 5000), st.integers(0, 2**32))
def test_warm_section_search_agrees_with_full_bisect(n, seed):
    """Both lookups give what a bisection of the whole list gives, in and out of the warm section."""
    assert n > WARM_ENTRIES
    rnd = random.Random(seed)  # the index is too large for hypothesis to draw entry by entry
    base = rnd.randrange(1000)
    offsets, timestamps = [], []
    o, t = base, rnd.randrange(-10_000, 10_000)
    for _ in range(n):
        o += rnd.randrange(1, 20)
        t += rnd.randrange(1, 20)
        offsets.append(o)
        timestamps.append(t)
    offset_index, time_index = OffsetIndex(base), TimeIndex(base)
    for i in range(n):
        offset_index.append(offsets[i], 3 * i)
        time_index.maybe_append(timestamps[i], offsets[i])
    first_warm = n - 1 - WARM_ENTRIES
    probes = [first_warm - 1, first_warm, first_warm + 1, 0, n - 1] + [rnd.randrange(n) for _ in range(200)]
    for keys, index in ((offsets, offset_index), (timestamps, time_index)):
        targets = [k + d for i in probes for k in [keys[i]] for d in (-1, 0, 1)]
        targets += [keys[0] - 100, keys[-1] + 100, rnd.randrange(keys[0], keys[-1])]
        for target in targets:
            slot = bisect_right(keys, target) - 1
            got = index.lookup(target)
            if slot < 0:
                assert got == ((base, 0) if index is offset_index else (NO_TIMESTAMP, base))
            elif index is offset_index:
                assert got == (offsets[slot], 3 * slot)
            else:
                assert got == (timestamps[slot], offsets[slot])


# -- ChunkIndexBuilder -------------------------------------------------------------------------

batch_strategy = st.tuples(
    st.one_of(st.integers(1, 700), st.sampled_from([50, 150, 300])),  # size; some land exactly on an interval
    st.one_of(st.just(0), st.integers(1, 6)),  # record count (0: record-less)
    st.sampled_from([0, 0, 0, 0, 1, 9]),  # gap in offsets before the batch
    st.integers(-100, 100),  # max timestamp, in no particular order
)


def _lay_out(first_base, specs):
    """Batches as (position, size, base_offset, record_count, max_timestamp), contiguous."""
    batches, position, next_offset = [], 0, first_base
    for size, count, gap, ts in specs:
        base = next_offset + gap
        batches.append((position, size, base, count, ts if count else MIN_TIMESTAMP))
        position += size
        next_offset = base + count if count else base
    return batches


def _build(batches, interval, builder=None):
    builder = builder or ChunkIndexBuilder(1 << 40, interval)
    for batch in batches:
        builder.add(*batch)
    return builder


def _kafka_entries(batches, interval):
    """Kafka's LogSegment.append index rule, as a counter (valid for batches that all hold records)."""
    offset_entries, time_entries = [], []
    counter, max_ts, max_ts_offset = 0, None, None
    for position, size, base, _count, ts in batches:
        if max_ts is None or ts > max_ts:
            max_ts, max_ts_offset = ts, base
        if counter > interval:
            offset_entries.append((base, position))
            if not time_entries or max_ts > time_entries[-1][0]:
                time_entries.append((max_ts, max_ts_offset))
            counter = 0
        counter += size
    return offset_entries, time_entries


def _check_summary(summary, batches, interval):
    starts = [b[0] for b in batches]
    boundaries = set(starts) | {summary.size}
    assert summary.size == sum(b[1] for b in batches) and summary.batch_count == len(batches)
    holding = [b for b in batches if b[3]]
    if holding:
        assert summary.next_offset == holding[-1][2] + holding[-1][3] or not batches[-1][3]
        assert summary.max_timestamp == max(b[4] for b in holding)
        assert summary.first_timestamp == holding[0][4]
    else:
        assert summary.max_timestamp == MIN_TIMESTAMP and not summary.offset_index and not summary.time_index
    # Offsets: the scan from locate(o) never misses a batch with a record >= o or a base offset >= o.
    for o in range(summary.base_offset - 2, summary.next_offset + 3):
        at = summary.locate(o)
        assert 0 <= at <= summary.size and at in boundaries
        later = [b[0] for b in batches if b[2] >= o or (b[3] and b[2] + b[3] - 1 >= o)]
        if later:
            assert at <= later[0]
        holder = [b[0] for b in batches if b[3] and b[2] <= o < b[2] + b[3]]
        if holder:
            assert at <= holder[0]  # and scanning batch by batch from a boundary reaches it
    # Timestamps: no batch before locate_time(t) holds a record with ts >= t.
    candidates = {MIN_TIMESTAMP, I64_MAX} | {b[4] + d for b in holding for d in (-1, 0, 1)}
    for t in candidates:
        at = summary.locate_time(t)
        assert 0 <= at <= summary.size and at in boundaries
        first = [b[0] for b in holding if b[4] >= t]
        if first:
            assert at <= first[0]
    # Sparse: each entry is triggered more than `interval` bytes after the previous entry.
    entries = summary.offset_index.entries
    assert len(summary.time_index) <= len(entries) <= 2 * summary.size // (interval + 1) + 1
    if all(b[3] for b in batches):
        assert len(entries) <= summary.size // (interval + 1)
        expected_offsets, expected_times = _kafka_entries(batches, interval)
        assert entries == expected_offsets
        assert summary.time_index.entries == expected_times


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.lists(batch_strategy, max_size=60), st.sampled_from([0, 1, 150, 600, 4096]),
       st.data())
def test_builder_model(first_base, specs, interval, data):
    """Model: locate/locate_time are safe, entries follow Kafka's rule, resume and the file round-trip."""
    batches = _lay_out(first_base, specs)
    summary = _build(batches, interval).summary()
    _check_summary(summary, batches, interval)
    assert decode_chunk_index(encode_chunk_index(summary), chunk_start=1 << 40) == summary
    # Resume from a snapshot (directly or through the file) and continue: same result.
    k = data.draw(st.integers(0, len(batches)))
    first = _build(batches[:k], interval)
    snapshot = first.summary()
    frozen = encode_chunk_index(snapshot)
    _build(batches[k:], interval, first)  # keeps feeding the builder that made the snapshot
    assert encode_chunk_index(snapshot) == frozen  # the snapshot did not change
    assert first.summary() == summary
    for resumed in (snapshot, decode_chunk_index(frozen, chunk_start=1 << 40)):
        assert _build(batches[k:], interval, ChunkIndexBuilder.resume(resumed)).summary() == summary


def test_builder_kafka_rule_example():
    """1000-byte batches, 4096-byte interval: entries at 5000, 10000, ... (first batch never indexed)."""
    batches = [(i * 1000, 1000, i * 10, 10, 100 + i) for i in range(16)]
    summary = _build(batches, 4096).summary()
    assert summary.offset_index.entries == [(50, 5000), (100, 10000), (150, 15000)]
    assert summary.time_index.entries == [(105, 50), (110, 100), (115, 150)]
    assert summary.locate(0) == 0 and summary.locate(49) == 0 and summary.locate(50) == 5000
    assert summary.locate(123) == 10000 and summary.locate(160) == summary.records_end == 16000
    assert summary.locate_time(104) == 0 and summary.locate_time(105) == 5000
    assert summary.locate_time(1000) == 16000  # nothing that recent in this chunk


def test_builder_interval_is_strict():
    """An entry needs strictly more than interval_bytes since the last one (Kafka's ``>``)."""
    summary = _build([(i * 100, 100, i, 1, i) for i in range(10)], 300).summary()
    assert summary.offset_index.positions == (400, 800)


def test_builder_record_less_batches():
    """Record-less batches never become entries; an entry points before the record-less run it follows."""
    builder = ChunkIndexBuilder(0, 100)
    builder.add(0, 150, 0, 10, 5)
    builder.add(150, 60, 10, 0, MIN_TIMESTAMP)  # attribute-only: base offset is the next offset
    builder.add(210, 60, 10, 0, MIN_TIMESTAMP)
    builder.add(270, 50, 10, 10, 7)  # due: 270 > 100 bytes since the chunk start
    summary = builder.summary()
    assert summary.offset_index.entries == [(10, 150)]  # not (10, 270): a reader at 10 sees the attribute batches
    assert summary.locate(10) == 150 and summary.locate(9) == 0
    for _ in range(5):  # a long record-less tail adds nothing
        builder.add(builder.size, 500, 20, 0, MIN_TIMESTAMP)
    summary = builder.summary()
    assert len(summary.offset_index) == 1 and summary.records_end == 320 and summary.size == 2820
    assert summary.locate(20) == 320  # the tail's base offset: right after the last records
    assert summary.next_offset == 20 and summary.max_timestamp == 7


def test_builder_record_less_prefix_and_only():
    """A record-less prefix (a truncated or garbage start) and a chunk of record-less batches only."""
    builder = ChunkIndexBuilder(0, 100, next_offset=40)
    builder.add(0, 5000, 40, 0, MIN_TIMESTAMP)
    only = builder.summary()
    assert (only.base_offset, only.next_offset, only.max_timestamp, only.records_end) == (40, 40, MIN_TIMESTAMP, 0)
    assert only.locate(40) == 0 and only.locate_time(0) == 0
    builder.add(5000, 10, 40, 3, 9)  # due by bytes, but nothing before it holds records: no entry
    builder.add(5010, 10, 43, 3, 8)
    summary = builder.summary()
    assert summary.offset_index.entries == [(43, 5010)] and summary.time_index.entries == [(9, 40)]
    assert summary.locate(41) == 0 and summary.locate_time(9) == 0 and summary.locate_time(8) == 0
    empty = ChunkIndexBuilder(7, next_offset=12).summary()
    assert (empty.size, empty.base_offset, empty.next_offset, empty.batch_count) == (0, 12, 12, 0)
    assert decode_chunk_index(encode_chunk_index(empty), chunk_start=7) == empty


def test_builder_rejects_out_of_order_batches():
    """Batches must be contiguous and their offsets must not go back."""
    builder = ChunkIndexBuilder(0, next_offset=10)
    with pytest.raises(InvalidIndexEntryError):
        builder.add(0, 10, 9, 1, 0)  # below the chunk's next offset
    builder.add(0, 10, 10, 5, 0)
    with pytest.raises(InvalidIndexEntryError):
        builder.add(11, 10, 15, 1, 0)  # a hole
    with pytest.raises(InvalidIndexEntryError):
        builder.add(10, 10, 14, 1, 0)  # overlaps the previous batch's records
    with pytest.raises(InvalidInputError):
        builder.add(10, 0, 15, 1, 0)  # empty batch
    with pytest.raises(InvalidInputError):
        builder.add(10, 1, 15, -1, 0)
    assert builder.size == 10 and builder.next_offset == 15  # failed adds changed nothing


def test_builder_stops_indexing_when_full():
    """A full index just stops growing; lookups stay safe."""
    builder = ChunkIndexBuilder(0, 0, max_entries=3)
    batches = [(i * 10, 10, i, 1, i) for i in range(20)]
    summary = _build(batches, 0, builder).summary()
    assert len(summary.offset_index) == 3 and len(summary.time_index) == 3
    assert summary.locate(15) == 30 and summary.locate_time(15) == 30


# -- the file ----------------------------------------------------------------------------------

CHUNK = 123_456


def _sample_summary():
    specs = [(300 + 37 * i % 200, (i * 7) % 5, 1 if i % 11 == 0 else 0, (i * 37) % 90 - 20) for i in range(60)]
    return _build(_lay_out(1000, specs), 700, ChunkIndexBuilder(CHUNK, 700, next_offset=1000)).summary()


def test_file_round_trip():
    """Encode then decode gives the same summary; the size is 100 + 16 per entry."""
    summary = _sample_summary()
    n, m = len(summary.offset_index), len(summary.time_index)
    assert n >= 5 and m >= 2
    data = encode_chunk_index(summary)
    assert len(data) == HEADER_SIZE + 16 * (n + m) + 4 == 100 + 16 * (n + m)
    assert data[:8] == b"AIXCKIDX"
    assert decode_chunk_index(bytearray(data), chunk_start=CHUNK, segment="s") == summary


def test_file_every_byte_flip_and_truncation_is_corrupt():
    """Every single-byte flip, every truncation and any extra byte is CorruptIndexError."""
    data = encode_chunk_index(_sample_summary())
    for i in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            flipped = bytearray(data)
            flipped[i] ^= mask
            with pytest.raises(CorruptIndexError):
                decode_chunk_index(bytes(flipped), chunk_start=CHUNK)
    for length in range(len(data)):
        with pytest.raises(CorruptIndexError):
            decode_chunk_index(data[:length], chunk_start=CHUNK)
    with pytest.raises(CorruptIndexError):
        decode_chunk_index(data + b"\0", chunk_start=CHUNK)


def test_file_wrong_chunk_start():
    """An index decoded for another chunk is corrupt; the error says where."""
    data = encode_chunk_index(_sample_summary())
    with pytest.raises(CorruptIndexError) as info:
        decode_chunk_index(data, chunk_start=CHUNK + 1, segment="seg")
    assert isinstance(info.value, CorruptDataError)
    assert (info.value.segment, info.value.offset) == ("seg", CHUNK + 1)


def _reseal(body: bytearray) -> bytes:
    body = bytes(body[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def _entry_at(summary, kind: str, i: int) -> int:
    """File position of entry ``i`` of the offset (``"o"``) or time (``"t"``) index."""
    return HEADER_SIZE + 16 * (i if kind == "o" else len(summary.offset_index) + i)


def test_file_sanity_check_with_valid_checksum():
    """Well-sealed files whose content breaks the sanity check are corrupt too."""
    summary = _sample_summary()
    data = encode_chunk_index(summary)
    oi, ti = summary.offset_index, summary.time_index

    def patched(fmt: str, at: int, *values) -> bytes:
        body = bytearray(data)
        struct.pack_into(fmt, body, at, *values)
        return _reseal(body)

    bad = {
        "version": patched("<H", 8, 2),
        "reserved": patched("<H", 10, 1),
        "magic": patched("<8s", 0, b"AIXFOOT1"),
        "chunk start field": patched("<Q", 16, CHUNK + 1),
        "offsets not ascending": patched("<q", _entry_at(summary, "o", 1), oi.entry(0)[0]),
        "offset below base": patched("<q", _entry_at(summary, "o", 0), summary.base_offset - 1),
        "offset past next": patched("<q", _entry_at(summary, "o", len(oi) - 1), summary.next_offset),
        "positions falling": patched("<q", _entry_at(summary, "o", 1) + 8, oi.entry(0)[1] - 1),
        "position beyond size": patched("<q", _entry_at(summary, "o", len(oi) - 1) + 8, summary.size + 1),
        "timestamps falling": patched("<q", _entry_at(summary, "t", 1), ti.entry(0)[0] - 1),
        "time offset below base": patched("<q", _entry_at(summary, "t", 0) + 8, summary.base_offset - 1),
        "negative base": patched("<q", 40, -1),
        "next below base": patched("<q", 48, summary.base_offset - 1),
        "records end beyond size": patched("<Q", 32, summary.size + 1),
        "entry count": patched("<I", 88, len(oi) + 1),
    }
    assert decode_chunk_index(_reseal(bytearray(data)), chunk_start=CHUNK) == summary  # the helper is sound
    for name, corrupt in bad.items():
        with pytest.raises(CorruptIndexError):
            decode_chunk_index(corrupt, chunk_start=CHUNK)
            pytest.fail(name)


def test_encode_rejects_inconsistent_summary():
    """Encoding refuses a summary that could not decode (it would poison the index file)."""
    summary = _sample_summary()
    for broken in (attrs.evolve(summary, next_offset=summary.base_offset - 1),
                   attrs.evolve(summary, size=summary.records_end - 1),
                   attrs.evolve(summary, interval_bytes=1 << 32)):
        with pytest.raises(InvalidInputError):
            encode_chunk_index(broken)
        with pytest.raises(InvalidInputError):
            ChunkIndexBuilder.resume(broken)
