"""Tests of ``attrindex.log.framing``: record batches as the frames of a chunk appended in place.

The committed length of such a chunk is the end of the chain of whole, valid batches from its
start (docs/decisions/0001). Model tests over random sequences of batches (sizes, codecs, empty
batches, attribute updates) placed at random positions: the chain ends exactly after them, and
stops at the right batch for a cut at every byte, zeros, garbage, a flipped byte or a batch
sealed for another position; the last valid batch is found past garbage; a torn batch's claimed
offsets are told. Then the segment log's own chunks, written through real stores, read back as
chains that end at their stored length.
"""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attrindex import Record, SegmentStore
from attrindex.log.batch.chain import chain_end, last_batch_end, place_batches
from attrindex.log.batch.compression import available_codecs
from attrindex.log.batch.encode import encode_batch
from attrindex.log.batch.header import BATCH_HEADER_SIZE
from attrindex.log.framing import LOG_FRAMING, LogFraming, torn_claim
from storage_adapters.framing import Framing

CODECS = sorted(available_codecs())
TS = 1_700_000_000_000

shapes = st.lists(
    st.tuples(st.integers(0, 12), st.integers(0, 150), st.sampled_from(CODECS), st.integers(0, 3)),
    min_size=1, max_size=7,
)  # (records, value size, codec, attribute updates): (0, _, _, 0) is an empty batch
positions = st.integers(0, 1 << 44)


def encode(shape_list, base: int = 0) -> list[bytes]:
    """Batches of ``shape_list`` numbered from ``base``, sealed for position 0."""
    out = []
    for i, (n, size, codec, updates) in enumerate(shape_list):
        records = [Record(bytes([i + 1]) * (size + j % 5), key=b"key-%d" % j) for j in range(n)]
        keys = [bytes([7, i, j]) * 5 + b"\x01" for j in range(updates)]
        out.append(encode_batch(base, records, timestamp=TS + i, codec=codec,
                                attribute_updates=(keys, list(range(updates)))))
        base += n
    return out


def ends(batches: list[bytes], position: int) -> list[int]:
    """The segment byte position where each batch ends, laid back to back from ``position``."""
    out, at = [], position
    for batch in batches:
        at += len(batch)
        out.append(at)
    return out


def chain_of(shape_list, position: int) -> tuple[bytes, list[int]]:
    batches = encode(shape_list)
    return place_batches(b"".join(batches), position), ends(batches, position)


def test_log_framing_is_a_storage_framing():
    assert isinstance(LOG_FRAMING, LogFraming) and isinstance(LOG_FRAMING, Framing)


@settings(max_examples=150, deadline=None)
@given(shape_list=shapes, position=positions)
def test_the_chain_ends_exactly_after_the_batches(shape_list, position):
    data, batch_ends = chain_of(shape_list, position)
    assert chain_end(data, position) == LOG_FRAMING.chain_end(data, position) == batch_ends[-1]
    assert LOG_FRAMING.chain_end(memoryview(data), position) == batch_ends[-1]
    assert LOG_FRAMING.last_frame_end(data, position) == batch_ends[-1]
    assert torn_claim(data, position) is None  # whole and valid: nothing torn


@settings(max_examples=60, deadline=None)
@given(shape_list=shapes, position=positions)
def test_a_cut_at_every_byte_ends_the_chain_at_the_last_whole_batch(shape_list, position):
    data, batch_ends = chain_of(shape_list, position)
    for cut in range(len(data) + 1):
        whole = max([position] + [e for e in batch_ends if e <= position + cut])
        assert LOG_FRAMING.chain_end(data[:cut], position) == whole
        assert LOG_FRAMING.last_frame_end(data[:cut], position) == (whole if whole > position else None)


@settings(max_examples=100, deadline=None)
@given(shape_list=shapes, position=positions, zeros=st.integers(1, 300),
       garbage=st.binary(min_size=1, max_size=300))
def test_zeros_and_garbage_after_the_chain_are_not_batches(shape_list, position, zeros, garbage):
    data, batch_ends = chain_of(shape_list, position)
    end = batch_ends[-1]
    for tail in (bytes(zeros), garbage, b"AIXB" + garbage, b"AIXB\x03\x00" + bytes(zeros)):
        assert LOG_FRAMING.chain_end(data + tail, position) == end
        assert LOG_FRAMING.last_frame_end(data + tail, position) == end
    assert LOG_FRAMING.chain_end(bytes(zeros) + data, position) == position  # zeros are never a batch
    assert LOG_FRAMING.last_frame_end(bytes(zeros), position) is None
    assert torn_claim(bytes(zeros) + data, position) is None


@settings(max_examples=100, deadline=None)
@given(shape_list=shapes, position=positions, data_=st.data())
def test_a_batch_sealed_for_another_position_stops_the_chain(shape_list, position, data_):
    batches = encode(shape_list)
    k = data_.draw(st.integers(0, len(batches) - 1), label="moved batch")
    at = position + sum(map(len, batches[:k]))
    wrong = data_.draw(st.integers(0, 1 << 44).filter(lambda p: p != at), label="its seal")
    data = (place_batches(b"".join(batches[:k]), position) + place_batches(batches[k], wrong)
            + place_batches(b"".join(batches[k + 1:]), at + len(batches[k])))
    assert LOG_FRAMING.chain_end(data, position) == at
    later = ends(batches, position)[-1] if k < len(batches) - 1 else (at if k else None)
    assert LOG_FRAMING.last_frame_end(data, position) == later
    assert torn_claim(data[at - position:], at) is None  # its header is not valid there: no claim
    # the whole chain read at any other position: not one batch of it (``wrong`` may be ``position``)
    elsewhere = wrong if wrong != position else position + 1
    assert LOG_FRAMING.chain_end(place_batches(b"".join(batches), position), elsewhere) == elsewhere


@settings(max_examples=80, deadline=None)
@given(shape_list=shapes, position=positions, data_=st.data())
def test_a_flipped_byte_stops_the_chain_at_its_batch(shape_list, position, data_):
    batches = encode(shape_list)
    data = bytearray(place_batches(b"".join(batches), position))
    k = data_.draw(st.integers(0, len(batches) - 1), label="damaged batch")
    offset = data_.draw(st.integers(0, len(batches[k]) - 1), label="byte in it")
    mask = data_.draw(st.integers(1, 255), label="flip")
    start = sum(map(len, batches[:k]))
    data[start + offset] ^= mask
    assert LOG_FRAMING.chain_end(bytes(data), position) == position + start
    later = ends(batches, position)[-1] if k < len(batches) - 1 else (position + start if k else None)
    assert LOG_FRAMING.last_frame_end(bytes(data), position) == later


@settings(max_examples=100, deadline=None)
@given(shape_list=shapes, position=positions, garbage=st.binary(max_size=200), more=shapes)
def test_the_last_valid_batch_is_found_past_garbage(shape_list, position, garbage, more):
    """Damage below valid batches: the chain stops at the garbage, the last batch after it is found."""
    first, _ = chain_of(shape_list, position)
    at = position + len(first) + len(garbage)
    second, second_ends = chain_of(more, at)
    data = first + garbage + second
    assert LOG_FRAMING.chain_end(data, position) == position + len(first) + (0 if garbage else len(second))
    assert LOG_FRAMING.last_frame_end(data, position) == second_ends[-1]
    # the newest batch torn: the last whole one before it, in the second chain or else the first
    found = LOG_FRAMING.last_frame_end(first + garbage + second[:-1], position)
    assert found == (second_ends[-2] if len(second_ends) > 1 else position + len(first))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 50), updates=st.integers(0, 3), size=st.integers(0, 100), codec=st.sampled_from(CODECS),
       base=st.integers(0, 1 << 40), position=positions, data_=st.data())
def test_torn_claim_is_what_a_torn_batch_header_claims(n, updates, size, codec, base, position, data_):
    keys = [bytes([j]) * 16 for j in range(updates)]
    batch = encode_batch(base, [b"v" * size] * n, timestamp=TS, codec=codec, position=position,
                         attribute_updates=(keys, list(range(updates))))
    assert torn_claim(batch, position) is None
    assert torn_claim(batch + b"\x00" * 10, position) is None
    if len(batch) > BATCH_HEADER_SIZE:
        cut = data_.draw(st.integers(BATCH_HEADER_SIZE, len(batch) - 1), label="cut")
        assert torn_claim(batch[:cut], position) == base + n  # payload not all there
        if batch[cut:].count(0) != len(batch) - cut:  # zeros where it was not written (unless they were the bytes)
            assert torn_claim(batch[:cut] + bytes(len(batch) - cut), position) == base + n
        flipped = bytearray(batch)
        flipped[data_.draw(st.integers(BATCH_HEADER_SIZE, len(batch) - 1), label="flip")] ^= 0x40
        assert torn_claim(bytes(flipped), position) == base + n  # payload checksum fails
    for cut in (0, 1, BATCH_HEADER_SIZE - 1):
        assert torn_claim(batch[:cut], position) is None  # no whole header: it tells nothing
    header_flip = bytearray(batch)
    header_flip[data_.draw(st.integers(0, BATCH_HEADER_SIZE - 1), label="header flip")] ^= 0x01
    assert torn_claim(bytes(header_flip), position) is None  # the header is damaged: it claims nothing
    assert torn_claim(batch, position + 1) is None  # sealed for another position


@settings(max_examples=100, deadline=None)
@given(shape_list=shapes, position=positions, other=positions)
def test_place_seals_for_where_the_batches_land(shape_list, position, other):
    batches = encode(shape_list)
    data = b"".join(batches)
    placed = LOG_FRAMING.place(data, position)
    assert placed == place_batches(data, position)
    assert LOG_FRAMING.place(placed, position) is placed
    moved = LOG_FRAMING.place(placed, other)
    assert LOG_FRAMING.chain_end(moved, other) == other + len(data)
    if other != position:
        assert LOG_FRAMING.chain_end(moved, position) == position


def test_version_2_batches_are_not_frames():
    head = struct.pack("<4sHHIIIIqqqQII", b"AIXB", 2, 0, 66, 1, 0, 2, 0, TS, TS, 7, zlib.crc32(b"\x01a"), 0)[:60]
    old = head + struct.pack("<I", zlib.crc32(head)) + b"\x01a"
    assert LOG_FRAMING.chain_end(old, 0) == 0
    assert LOG_FRAMING.last_frame_end(old, 0) is None
    assert torn_claim(old, 0) is None


def test_the_walks_never_raise_for_any_bytes():
    good = encode_batch(0, [b"x"], timestamp=TS)
    for data in (b"", b"A", b"AIXB", good[:64], good[:63], b"AIXB" + b"\xff" * 200, bytes(64),
                 struct.pack("<4sHHI", b"AIXB", 3, 0, 0) + bytes(56)):  # size 0 (checksum fails)
        assert chain_end(data, 5) == 5
        assert last_batch_end(data, 5) is None
        assert torn_claim(data, 5) is None


@pytest.mark.parametrize("position", [-1, (1 << 64) - 10, 1.5, None, "0"])
def test_positions_outside_a_segment_are_refused(position):
    """A segment position is a u64, and so is every byte of the data's span."""
    from attrindex.errors import InvalidInputError

    for walk in (LOG_FRAMING.chain_end, LOG_FRAMING.last_frame_end, LOG_FRAMING.place):
        with pytest.raises(InvalidInputError, match="position"):
            walk(encode_batch(0, [b"x"], timestamp=TS), position)


# --- the segment log's chunks, written through real stores --------------------------------------


def chains(log) -> list[tuple[int, int, int]]:
    """``(chunk start, chain end, stored end)`` of each chunk of a log's byte stream."""
    out = []
    for chunk in log.bytes.chunks():
        stored = chunk.stored_end - chunk.start
        data = log.bytes.read(chunk.start, stored)
        out.append((chunk.start, LOG_FRAMING.chain_end(data, chunk.start), chunk.stored_end))
    return out


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_segment_log_writes_chains_that_end_at_each_chunks_end(storage_url):
    """Appends (lone, grouped, with retries after another writer went first), a cleaner that moves
    batches into replacement chunks, and a consolidation: every chunk stays one whole chain."""
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, log_rolling_size=2000) as store, \
            SegmentStore.open(url, storage_options=options, log_rolling_size=2000) as other:
        seg = store.segment("s", create=True, cleanup_policy="compact", min_compaction_lag_ms=0)
        two = other.segment("s")
        for i in range(120):
            writer = seg if i % 3 else two  # two handles: appends at positions the other moved past
            writer.append([Record(b"value-%d" % i, key=b"k%d" % (i % 7))], [(bytes([i % 5]) * 16, i)],
                          timestamp=1000 + i)
        assert seg._log.bytes.framing is LOG_FRAMING
        before = chains(seg._log)
        assert len(before) > 3 and all(chain == stored for _start, chain, stored in before)
        stats = seg.compact()
        assert stats.records_removed > 0 and stats.chunks_cleaned > 0  # kept batches moved down
        seg.consolidate()
        after = chains(seg._log)
        assert after != before  # batches moved
        assert all(chain == stored for _start, chain, stored in after)
        assert [r.value for r in seg.read(0, 1000)][-7:] == [b"value-%d" % i for i in range(113, 120)]


def test_the_wal_log_of_an_attribute_index_writes_chains(tmp_path):
    from attrindex import AttributeIndex

    with AttributeIndex.open(str(tmp_path / "idx")) as index:
        for i in range(50):
            index.update({i.to_bytes(16, "big"): i})
        log = index._log
        assert log.bytes.framing is LOG_FRAMING
        assert all(chain == stored for _start, chain, stored in chains(log))
