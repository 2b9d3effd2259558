"""Tests of ``attrindex.log.batch``: the record batch codec of the segment log (all its modules).

Round trips (hypothesis, every available codec), the header layout as documented in
docs/format.md, and the failure rules: a strict prefix is incomplete, never wrong records; any
flipped byte is ``CorruptDataError``; garbage after valid batches is reported at its offset; a
payload that is consistent with its checksums but not with itself is ``CorruptDataError`` too;
decompression never inflates past the declared length.
"""

from __future__ import annotations

import gzip
import struct
import sys
import tracemalloc
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attrindex.errors import CorruptDataError, InvalidInputError, MissingDependencyError
from attrindex.log.batch import compression, encode
from attrindex.log.batch.chain import iter_batches, place_batches
from attrindex.log.batch.compression import Codec, available_codecs, codec_for
from attrindex.log.batch.decode import decode_attribute_updates, decode_records
from attrindex.log.batch.encode import encode_batch, rebase_batch
from attrindex.log.batch.header import (BATCH_HEADER_SIZE, BatchHeader, check_batch, peek_header, read_header,
                                        seal_header)
from attrindex.log.batch.records import Record
from attrindex.log.varint import encode_varints, zigzag

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
TS = 1_700_000_000_000
CODECS = sorted(available_codecs())
LAYOUT = struct.Struct("<4sHHIIIIqqqQII")  # docs/format.md, "Header (64 bytes)"


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def rich_records() -> list:
    return [
        Record(b"first", key=b"k1", timestamp=TS - 5, headers=[("trace", b"\x00\x01"), ("é", b"")]),
        b"plain",
        Record(b"", timestamp=TS + 7),
        Record(b"x" * 300, key=b""),
        bytearray(b"mutable"),
    ]


def rich_batch(codec=Codec.NONE, base_offset: int = 40) -> bytes:
    return encode_batch(
        base_offset,
        rich_records(),
        timestamp=TS,
        attribute_updates=([key(1), key(2), key(3)], [5, None, I64_MIN]),
        codec=codec,
    )


def forge(
    payload: bytes,
    *,
    count: int,
    updates: int = 0,
    flags: int = 0,
    stored: bytes | None = None,
    base_offset: int = 0,
    first: int = TS,
    last: int = TS,
    version: int = 3,
    magic: bytes = b"AIXB",
    size: int | None = None,
    position: int = 0,
) -> bytes:
    """A batch built by hand from the documented layout, with valid checksums for ``position``."""
    stored = payload if stored is None else stored
    size = BATCH_HEADER_SIZE + len(stored) if size is None else size
    head = LAYOUT.pack(
        magic, version, flags, size, count, updates, len(payload), base_offset, first, last, 7, zlib.crc32(stored), 0
    )
    head = head[:60] + struct.pack("<I", seeded_crc(position, head[:60]))
    return head + stored


def seeded_crc(position: int, data: bytes) -> int:
    """docs/format.md: the header checksum is CRC-32 of the position as a u64 LE, then the bytes."""
    return zlib.crc32(data, zlib.crc32(struct.pack("<Q", position)))


def decode_all(buf, pos=0, *, position=0, segment=None):
    header = read_header(buf, pos, position=position, segment=segment)
    assert header is not None
    check_batch(buf, pos, header, position=position, segment=segment)
    return header, decode_records(buf, pos, header, position=position, segment=segment), decode_attribute_updates(
        buf, pos, header, position=position, segment=segment
    )


# --- codecs ---------------------------------------------------------------------------------------


def test_available_codecs():
    assert {Codec.NONE, Codec.GZIP} <= available_codecs()
    assert Codec.ZSTD in available_codecs()  # the dev venv has zstandard and lz4
    assert Codec.LZ4 in available_codecs()


@pytest.mark.parametrize(
    "spec, codec",
    [(None, Codec.NONE), ("none", Codec.NONE), ("GZIP", Codec.GZIP), ("Zstd", Codec.ZSTD), ("lz4", Codec.LZ4),
     (2, Codec.ZSTD), (Codec.LZ4, Codec.LZ4), (Codec.NONE, Codec.NONE)],
)
def test_codec_for(spec, codec):
    assert codec_for(spec) is codec


@pytest.mark.parametrize("spec", ["snappy", "", 7, -1, 1.0, True, b"gzip"])
def test_codec_for_unknown(spec):
    with pytest.raises(InvalidInputError) as info:
        codec_for(spec)
    assert "'none', 'gzip', 'zstd', 'lz4'" in str(info.value)


@pytest.mark.parametrize(
    "codec, module, package", [(Codec.ZSTD, "zstandard", "zstandard"), (Codec.LZ4, "lz4.frame", "lz4")]
)
def test_missing_codec_package(monkeypatch, codec, module, package):
    written = encode_batch(0, [b"v"], timestamp=TS, codec=codec)
    monkeypatch.setattr(compression, "_codec_modules", {})
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    assert codec not in available_codecs()
    for spec in (codec, codec.name.lower(), int(codec)):
        with pytest.raises(MissingDependencyError, match=f"pip install {package}"):
            codec_for(spec)
    with pytest.raises(MissingDependencyError, match=package):
        encode_batch(0, [b"v"], timestamp=TS, codec=codec)
    header = read_header(written)  # the header does not need the package; the payload does
    with pytest.raises(MissingDependencyError, match=package):
        decode_records(written, 0, header)


# --- header ---------------------------------------------------------------------------------------


def test_header_fields():
    written = rich_batch()
    header = read_header(written)
    assert BATCH_HEADER_SIZE == 64
    assert header == read_header(memoryview(written))
    assert header.size == len(written)
    assert header.base_offset == 40
    assert header.record_count == 5
    assert header.attribute_count == 3
    assert header.first_timestamp == TS - 5
    assert header.max_timestamp == TS + 7
    assert header.codec is Codec.NONE
    assert header.next_offset == 45
    assert header.last_offset == 44


@pytest.mark.parametrize("codec", CODECS)
def test_header_matches_documented_layout(codec):
    written = rich_batch(codec)
    fields = LAYOUT.unpack_from(written)
    magic, version, flags, size, count, updates, payload_size, base, first, last, batch_id, payload_crc, header_crc = fields
    assert (magic, version, size) == (b"AIXB", 3, len(written))
    assert batch_id == read_header(written).batch_id
    assert (count, updates, base, first, last) == (5, 3, 40, TS - 5, TS + 7)
    assert flags == int(codec) | 0x08 | 0x10 | 0x20  # keys, timestamps and headers columns present
    assert payload_crc == zlib.crc32(written[64:])
    assert header_crc == seeded_crc(0, written[:60])  # sealed for position 0 until placed
    header = read_header(written)
    assert header.codec is codec
    assert header.payload_size == payload_size
    if codec == Codec.NONE:
        assert payload_size == len(written) - 64


def test_plain_values_have_no_optional_columns():
    written = encode_batch(3, [b"a", b"bb", b"ccc"], timestamp=TS)
    assert LAYOUT.unpack_from(written)[2] == 0  # flags: no codec, no optional column
    assert written[64:] == b"\x01\x02\x03abbccc"  # value lengths, then the values
    header = read_header(written)
    assert (header.first_timestamp, header.max_timestamp) == (TS, TS)


def test_equal_timestamps_need_no_column():
    written = encode_batch(0, [Record(b"a", timestamp=5), Record(b"b", timestamp=5)], timestamp=TS)
    header = read_header(written)
    assert header.flags & 0x10 == 0
    assert (header.first_timestamp, header.max_timestamp) == (5, 5)
    assert [r.timestamp for r in decode_records(written, 0, header)] == [5, 5]


def test_empty_batch_with_attribute_updates():
    written = encode_batch(12, [], timestamp=TS, attribute_updates=([key(9), key(3)], [None, -7]))
    header, records, updates = decode_all(written)
    assert (header.record_count, header.attribute_count) == (0, 2)
    assert (header.base_offset, header.next_offset) == (12, 12)
    assert (header.first_timestamp, header.max_timestamp) == (TS, TS)
    assert records == []
    assert updates == ([key(9), key(3)], [None, -7])


def test_empty_batch():
    written = encode_batch(0, [], timestamp=TS)
    header, records, updates = decode_all(written)
    assert len(written) == BATCH_HEADER_SIZE
    assert records == [] and updates == ([], [])


# --- round trips ----------------------------------------------------------------------------------

int64s = st.integers(I64_MIN, I64_MAX)
header_pairs = st.lists(st.tuples(st.text(max_size=8), st.binary(max_size=8)), max_size=3)
records_strategy = st.lists(
    st.one_of(
        st.binary(max_size=40),
        st.builds(
            Record,
            value=st.binary(max_size=300),
            key=st.none() | st.binary(max_size=20),
            timestamp=st.none() | int64s | st.integers(TS - 1000, TS + 1000),
            headers=st.just(()) | header_pairs,
        ),
    ),
    max_size=25,
)
updates_strategy = st.lists(st.tuples(st.binary(min_size=16, max_size=16), st.none() | int64s), max_size=20)


def expected_records(records, base_offset: int, timestamp: int) -> list[Record]:
    out = []
    for i, r in enumerate(records):
        if not isinstance(r, Record):
            r = Record(bytes(r))
        stamp = timestamp if r.timestamp is None else r.timestamp
        out.append(Record(bytes(r.value), r.key, stamp, tuple(tuple(p) for p in r.headers), base_offset + i))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=records_strategy,
    updates=updates_strategy,
    base_offset=st.integers(0, 1 << 62),
    timestamp=int64s,
    codec=st.sampled_from(CODECS),
    prefix=st.binary(max_size=5),
    position=st.integers(0, 1 << 40),
)
def test_round_trip(records, updates, base_offset, timestamp, codec, prefix, position):
    keys = [k for k, _ in updates]
    values = [v for _, v in updates]
    written = encode_batch(base_offset, records, timestamp=timestamp, attribute_updates=(keys, values), codec=codec,
                           position=position + len(prefix))
    expected = expected_records(records, base_offset, timestamp)
    for buf in (prefix + written, memoryview(prefix + written), bytearray(prefix + written) + b"AI"):
        pos = len(prefix)
        header, decoded, decoded_updates = decode_all(buf, pos, position=position)
        assert decoded == expected
        assert all(type(r) is Record and type(r.value) is bytes and type(r.headers) is tuple for r in decoded)
        assert decoded_updates == (keys, values)
        assert header.size == len(written)
        assert header.codec is codec
        assert header.record_count == len(records)
        assert header.next_offset == base_offset + len(records)
        stamps = [r.timestamp for r in expected] or [timestamp]
        assert header.first_timestamp == stamps[0]
        assert header.max_timestamp == max(stamps)
        assert [p for p, _ in iter_batches(buf, pos, position=position)] == [pos]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "values",
    [
        [b"v" * 100] * 1000,  # the fast path: equal lengths, one-byte varints
        [bytes([i % 256]) * (i % 700) for i in range(3000)],  # mixed lengths and varint widths
        [b"%05d" % i for i in range(5000)],  # equal lengths in more than one struct run
        [b""] * 10,
    ],
)
def test_round_trip_shapes(codec, values):
    written = encode_batch(7, values, timestamp=TS, codec=codec)
    records = decode_records(written, 0, read_header(written))
    assert [r.value for r in records] == values
    assert [r.offset for r in records] == list(range(7, 7 + len(values)))
    assert {(r.key, r.timestamp, r.headers) for r in records} == {(None, TS, ())}


def test_round_trip_equal_keys_and_many_updates():
    n = 2500
    records = [Record(b"value", key=key(i)) for i in range(n)]
    updates = ([key(i) for i in range(n)], [None if i % 3 == 0 else i - n for i in range(n)])
    written = encode_batch(0, records, timestamp=TS, attribute_updates=updates)
    header, decoded, decoded_updates = decode_all(written)
    assert [r.key for r in decoded] == [key(i) for i in range(n)]
    assert decoded_updates == updates


def test_timestamps_spanning_int64():
    records = [Record(b"a", timestamp=I64_MAX), Record(b"b", timestamp=I64_MIN), Record(b"c", timestamp=0)]
    written = encode_batch(0, records, timestamp=TS)
    header = read_header(written)
    assert (header.first_timestamp, header.max_timestamp) == (I64_MAX, I64_MAX)
    assert [r.timestamp for r in decode_records(written, 0, header)] == [I64_MAX, I64_MIN, 0]


def test_bytes_like_inputs():
    records = [
        memoryview(b"abc"),
        bytearray(b"de"),
        memoryview(b"0123456789abcdef").cast("q"),  # len() 2, but 16 bytes
        Record(memoryview(b"f"), key=bytearray(b"k"), headers=[("h", memoryview(b"v"))]),
    ]
    written = encode_batch(0, records, timestamp=TS)
    decoded = decode_records(written, 0, read_header(written))
    assert [r.value for r in decoded] == [b"abc", b"de", b"0123456789abcdef", b"f"]
    assert decoded[3].key == b"k" and decoded[3].headers == (("h", b"v"),)
    assert all(type(r.value) is bytes for r in decoded)


def test_input_offsets_are_ignored():
    written = encode_batch(100, [Record(b"a", offset=5), Record(b"b", offset=None)], timestamp=TS)
    assert [r.offset for r in decode_records(written, 0, read_header(written))] == [100, 101]


# --- incomplete tails, flipped bytes, garbage -----------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_every_strict_prefix_is_incomplete(codec):
    first = rich_batch(codec, base_offset=0)
    second = place_batches(rich_batch(codec, base_offset=5), len(first))
    for end in range(len(second)):
        tail = second[:end]
        assert read_header(tail, position=len(first)) is None
        buf = first + tail
        assert [(p, h.base_offset) for p, h in iter_batches(buf)] == [(0, 0)]
        assert read_header(buf, len(first)) is None


@pytest.mark.parametrize("codec", CODECS)
def test_every_flipped_byte_is_corrupt(codec):
    written = rich_batch(codec)
    prefix = b"\x00" * 3
    for i in range(len(written)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(prefix + written)
            damaged[len(prefix) + i] ^= mask
            with pytest.raises(CorruptDataError) as info:
                decode_all(bytes(damaged), len(prefix), position=1000, segment="log")
            assert info.value.offset == 1003
            assert info.value.segment == "log"
            with pytest.raises(CorruptDataError):
                list(iter_batches(bytes(damaged), len(prefix)))


def test_verify_false_skips_the_payload_checksum():
    written = bytearray(encode_batch(0, [b"abc"], timestamp=TS))
    written[-1] ^= 0x01
    assert [p for p, _ in iter_batches(bytes(written), verify=False)] == [0]
    header = read_header(bytes(written))
    assert decode_records(bytes(written), 0, header, verify=False)[0].value == b"abb"
    with pytest.raises(CorruptDataError, match="payload checksum"):
        decode_records(bytes(written), 0, header)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "garbage",
    [b"\x00" * 100, b"garbage!" * 20, b"AIXB" + b"\x00" * 60, b"zz", b"\xff"],
    ids=["zeros", "text", "magic-then-zeros", "short", "one-byte"],
)
def test_garbage_after_valid_batches(codec, garbage):
    batches = [encode_batch(i * 10, [b"r%d" % i] * 10, timestamp=TS, codec=codec) for i in range(3)]
    buf = place_batches(b"".join(batches), 5000) + garbage
    seen = []
    with pytest.raises(CorruptDataError) as info:
        for pos, header in iter_batches(buf, position=5000, segment="seg"):
            seen.append((pos, header.base_offset))
    assert seen == [(0, 0), (len(batches[0]), 10), (len(batches[0]) + len(batches[1]), 20)]
    assert info.value.offset == 5000 + sum(map(len, batches))
    assert str(5000 + sum(map(len, batches))) in str(info.value)
    assert "'seg'" in str(info.value)


def test_magic_prefix_tail_is_incomplete():
    written = encode_batch(0, [b"a"], timestamp=TS)
    for tail in (b"", b"A", b"AI", b"AIX", b"AIXB", b"AIXB\x01"):
        assert [p for p, _ in iter_batches(written + tail)] == [0]
    with pytest.raises(CorruptDataError):
        read_header(b"AIXC")


# --- strict decoding of payloads that pass their checksums --------------------------------------


def test_forge_reproduces_the_encoder():
    payload = encode_varints([1, 2]) + b"abc"
    assert forge(payload, count=2) == encode_batch(0, [b"a", b"bc"], timestamp=TS, batch_id=7)


@pytest.mark.parametrize(
    "payload, count, updates, flags, problem",
    [
        (b"\x01\x02abcX", 2, 0, 0, "unexpected bytes"),  # trailing byte
        (b"\x01\x05abc", 2, 0, 0, "add up"),  # lengths run past the blob
        (b"\x01\x80", 2, 0, 0, "truncated"),  # varint cut by the end of the payload
        (b"\x01" + b"\x80" * 10 + b"\x00" + b"a" * 10, 2, 0, 0, "overflows"),
        (b"\x01\x01ab\x00" + bytes([zigzag(5)]), 2, 0, 0x10, "timestamp"),  # max is not TS + 5
        (b"\x01a" + bytes([zigzag(3)]), 1, 0, 0x10, "timestamp"),  # first delta must be 0
        (b"\x01a\x01\x01\x01\xffv", 1, 0, 0x20, "UTF-8"),  # header name b"\xff"
        (b"\x01a\x03\x00\x00\x00", 1, 0, 0x20, "headers cannot fit"),
        (b"\x01a" + key(1) + bytes(8) + b"\x02", 1, 1, 0, "removed flag"),
        (b"\x01a" + key(1) + struct.pack("<q", 9) + b"\x01", 1, 1, 0, "carries a value"),
        (b"\x01a\x03k", 1, 0, 0x08, "key lengths"),  # key length 2 but only 1 byte
    ],
)
def test_inconsistent_payload_is_corrupt(payload, count, updates, flags, problem):
    written = forge(payload, count=count, updates=updates, flags=flags, last=TS, position=77)
    header = read_header(written, position=77)
    with pytest.raises(CorruptDataError, match=problem) as info:
        decode_records(written, 0, header, position=77)
        decode_attribute_updates(written, 0, header, position=77)
    assert info.value.offset == 77


def test_attribute_reader_checks_record_columns():
    written = forge(b"\x01\x02abcX" + key(1) + bytes(9), count=2, updates=1)
    with pytest.raises(CorruptDataError, match="unexpected bytes"):
        decode_attribute_updates(written, 0, read_header(written))


@pytest.mark.parametrize(
    "fields, problem",
    [
        (dict(version=2), "format version 2, written by a development version before 0.1.0"),
        (dict(version=4), "unknown format version 4"),
        (dict(magic=b"AIXb"), "magic"),
        (dict(flags=0x100), "flags"),
        (dict(flags=0x40), "tombstones has no keys column"),
        (dict(flags=0x04), "flags"),  # codec 4 does not exist
        (dict(size=40), "smaller than"),
        (dict(count=5), "cannot hold"),  # 5 records need at least 5 payload bytes
        (dict(count=0), "cannot hold"),
        (dict(count=0, flags=0x08), "optional record columns"),
        (dict(first=TS, last=TS - 1), "below the first"),
        (dict(first=TS, last=TS + 1), "no timestamp column"),
        (dict(base_offset=-1), "base offset"),
        (dict(base_offset=I64_MAX), "base offset"),
        (dict(size=BATCH_HEADER_SIZE + 3), "uncompressed payload"),
    ],
)
def test_impossible_header_is_corrupt(fields, problem):
    args = dict(count=2)
    args.update(fields)
    written = forge(b"\x01\x01ab", position=12, **args)
    with pytest.raises(CorruptDataError, match=problem) as info:
        read_header(b"xx" + written, 2, position=10, segment="s")
    assert info.value.offset == 12


def test_count_above_limit_is_corrupt():
    written = forge(b"\x01\x01ab", count=1 << 31)
    with pytest.raises(CorruptDataError, match="record count"):
        read_header(written)


def test_header_checksum_mismatch_is_corrupt():
    written = bytearray(encode_batch(0, [b"a"], timestamp=TS))
    written[60] ^= 1
    with pytest.raises(CorruptDataError, match="header checksum"):
        read_header(bytes(written))


def test_valid_header_with_missing_payload_is_incomplete():
    written = encode_batch(0, [b"a" * 1000], timestamp=TS)
    assert read_header(written[:60]) is None
    header = read_header(written)
    with pytest.raises(InvalidInputError):
        check_batch(written[:60], 0, header)


# --- decompression ------------------------------------------------------------------------------


def compress(codec: Codec, data: bytes, **options) -> bytes:
    if codec == Codec.GZIP:
        return gzip.compress(data)
    if codec == Codec.ZSTD:
        import zstandard

        return zstandard.ZstdCompressor(**options).compress(data)
    import lz4.frame

    return lz4.frame.compress(data, **options)


BOMB_CASES = [
    (Codec.GZIP, {}),
    (Codec.ZSTD, {}),
    (Codec.ZSTD, {"write_content_size": False}),
    (Codec.LZ4, {}),
    (Codec.LZ4, {"store_size": False}),
]


@pytest.mark.parametrize("codec, options", BOMB_CASES)
def test_decompression_bomb_is_capped(codec, options):
    payload = b"\x01\x01ab"
    bomb = compress(codec, payload + bytes(64 << 20), **options)  # 64 MiB of zeros behind the payload
    written = forge(payload, count=2, flags=int(codec), stored=bomb)
    header = read_header(written)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match="decompress|declares"):
            decode_records(written, 0, header)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


@pytest.mark.parametrize("codec, options", BOMB_CASES)
def test_decompressed_size_must_match(codec, options):
    payload = b"\x01\x01ab"
    for declared in (payload[:-1], payload + b"\x00"):  # the header claims one byte less, one more
        written = forge(declared, count=2, flags=int(codec), stored=compress(codec, payload, **options))
        header = read_header(written)
        with pytest.raises(CorruptDataError):
            decode_records(written, 0, header)


@pytest.mark.parametrize("codec", [c for c in CODECS if c != Codec.NONE])
@pytest.mark.parametrize("stored", [b"", b"\x00" * 30, b"not compressed at all"])
def test_undecompressable_payload_is_corrupt(codec, stored):
    written = forge(b"\x01\x01ab", count=2, flags=int(codec), stored=stored)
    with pytest.raises(CorruptDataError):
        decode_records(written, 0, read_header(written))


@pytest.mark.parametrize("codec", [c for c in CODECS if c != Codec.NONE])
@pytest.mark.parametrize("payload, count", [(b"\x01\x01ab", 2), (b"", 0)])
def test_trailing_data_after_compressed_stream_is_corrupt(codec, payload, count):
    clean = forge(payload, count=count, flags=int(codec), stored=compress(codec, payload))
    expected = [Record(b"a", None, TS, (), 0), Record(b"b", None, TS, (), 1)][:count]
    assert decode_records(clean, 0, read_header(clean)) == expected
    for extra in (b"\x00", b"junk", compress(codec, b"")):
        written = forge(payload, count=count, flags=int(codec), stored=compress(codec, payload) + extra)
        with pytest.raises(CorruptDataError):
            decode_records(written, 0, read_header(written))
        with pytest.raises(CorruptDataError):
            decode_attribute_updates(written, 0, read_header(written))


# --- invalid input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "records, kwargs, message",
    [
        ([b"a", "text"], {}, "record 1: value must be bytes-like, got str"),
        ([b"a", 5], {}, "record 1: value must be bytes-like, got int"),
        ([None], {}, "record 0: value must be bytes-like, got NoneType"),
        ([Record("v")], {}, "record 0: value must be bytes-like"),
        ([Record(b"v", key="k")], {}, "record 0: key must be bytes or None"),
        ([Record(b"v", key=7)], {}, "record 0: key must be bytes-like"),
        ([Record(b"v", headers=[(b"name", b"v")])], {}, "header 0 name must be a str"),
        ([Record(b"v", headers=[("n", "v")])], {}, "header 'n' value must be bytes-like"),
        ([Record(b"v", headers=[("n",)])], {}, "must be a (name, value) pair"),
        ([Record(b"v", headers={"n": b"v"})], {}, "headers must be a sequence"),
        ([Record(b"v", headers=[("\ud800", b"v")])], {}, "not encodable as UTF-8"),
        ([Record(b"v", timestamp=1.5)], {}, "record 0: timestamp must be an int"),
        ([Record(b"v", timestamp=True)], {}, "record 0: timestamp must be an int"),
        ([Record(b"v", timestamp=1 << 63)], {}, "signed 64-bit"),
        ([(b"v", b"k")], {}, "plain tuple"),
        (b"abc", {}, "not a single value"),
        (5, {}, "must be a sequence"),
        ([b"a"], {"timestamp": 1 << 63}, "timestamp must be in the signed 64-bit range"),
        ([b"a"], {"timestamp": "now"}, "timestamp must be an int"),
        ([b"a"], {"base_offset": -1}, "base_offset must be an int >= 0"),
        ([b"a"], {"base_offset": 1.0}, "base_offset must be an int >= 0"),
        ([b"a"], {"base_offset": I64_MAX}, "exceed the signed 64-bit range"),
        ([b"a", b"b"], {"base_offset": I64_MAX - 1}, "exceed the signed 64-bit range"),
        ([b"a"], {"codec": "brotli"}, "unknown codec 'brotli'"),
        ([b"a"], {"attribute_updates": ([key(1)], [])}, "1 keys but 0 values"),
        ([b"a"], {"attribute_updates": ([b"short"], [1])}, "16 bytes each"),
        ([b"a"], {"attribute_updates": ([b"x" * 15, b"y" * 17], [1, 2])}, "16 bytes each"),
        ([b"a"], {"attribute_updates": (["k" * 16], [1])}, "16-byte bytes"),
        ([b"a"], {"attribute_updates": ([key(1)], [1 << 63])}, "signed 64-bit range or None"),
        ([b"a"], {"attribute_updates": ([key(1)], [1.5])}, "signed 64-bit range or None"),
        ([b"a"], {"attribute_updates": [key(1)]}, "pair"),
    ],
)
def test_invalid_input(records, kwargs, message):
    args = {"base_offset": 0, "timestamp": TS, **kwargs}
    base_offset = args.pop("base_offset")
    with pytest.raises(InvalidInputError) as info:
        encode_batch(base_offset, records, **args)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_too_many_records(monkeypatch):
    monkeypatch.setattr(encode, "MAX_RECORDS", 3)
    encode_batch(0, [b"a"] * 3, timestamp=TS)
    with pytest.raises(InvalidInputError, match="at most 3 records, got 4"):
        encode_batch(0, [b"a"] * 4, timestamp=TS)


def test_generator_of_records():
    written = encode_batch(0, (bytes([i]) for i in range(3)), timestamp=TS)
    assert [r.value for r in decode_records(written, 0, read_header(written))] == [b"\x00", b"\x01", b"\x02"]


def test_batch_header_is_frozen():
    header = read_header(encode_batch(0, [b"a"], timestamp=TS))
    assert isinstance(header, BatchHeader)
    with pytest.raises(AttributeError):
        header.size = 3


def test_read_header_partial_needs_only_the_header():
    batch = encode_batch(7, [b"x" * 5000], timestamp=1)
    head = batch[:BATCH_HEADER_SIZE]
    assert read_header(head) is None  # the batch is not all there
    header = read_header(head, partial=True)
    assert (header.base_offset, header.size) == (7, len(batch))


def test_rebase_batch_is_encoding_at_the_new_base_offset():
    records = [Record(b"a", b"k", 5, (("h", b"v"),)), b"bb", Record(b"c", None, 9)]
    updates = ([b"u" * 16], [42])
    for codec in sorted(c.name.lower() for c in available_codecs()):
        first = encode_batch(0, records, timestamp=7, attribute_updates=updates, codec=codec, batch_id=99)
        assert rebase_batch(first, 1000) == encode_batch(1000, records, timestamp=7, attribute_updates=updates,
                                                         codec=codec, batch_id=99)
    with pytest.raises(InvalidInputError):
        rebase_batch(first, -1)
    with pytest.raises(InvalidInputError):
        rebase_batch(first, (1 << 63) - 2)  # the three records' offsets would not fit


def test_batch_id_is_random_per_encoding_kept_by_rebase_and_checked():
    """Two encodings of the same records differ by their batch id (so a writer's byte comparison
    after a lost acknowledgement matches only its own append call); a rebase keeps the id."""
    one, two = (encode_batch(0, [b"same"], timestamp=TS) for _ in range(2))
    assert one != two and one[BATCH_HEADER_SIZE:] == two[BATCH_HEADER_SIZE:]
    assert read_header(one).batch_id != read_header(two).batch_id
    assert read_header(rebase_batch(one, 5)).batch_id == read_header(one).batch_id
    assert read_header(encode_batch(0, [b"x"], timestamp=TS, batch_id=(1 << 64) - 1)).batch_id == (1 << 64) - 1
    for bad in (-1, 1 << 64, "1", 1.0):
        with pytest.raises(InvalidInputError):
            encode_batch(0, [b"x"], timestamp=TS, batch_id=bad)


def test_version_1_headers_are_not_read():
    with pytest.raises(CorruptDataError, match="format version 1, written by a development version"):
        read_header(forge(b"\x01a", count=1, version=1))


# --- the position seal (format version 3) -------------------------------------------------------


def test_version_2_batches_are_refused_naming_their_version():
    """A batch as version 2 wrote it (header checksum not seeded) is refused wherever it lies,
    by its version, not as an anonymous checksum mismatch."""
    head = LAYOUT.pack(b"AIXB", 2, 0, 66, 1, 0, 2, 0, TS, TS, 7, zlib.crc32(b"\x01a"), 0)[:60]
    old = head + struct.pack("<I", zlib.crc32(head)) + b"\x01a"
    for position in (0, 1, 4096):
        with pytest.raises(CorruptDataError, match="format version 2.*reads format version 3 only") as info:
            read_header(old, position=position, segment="s")
        assert info.value.offset == position
    with pytest.raises(InvalidInputError, match="version 3"):
        place_batches(old, 0)


@settings(max_examples=200, deadline=None)
@given(position=st.integers(0, (1 << 64) - 1 - 100), other=st.integers(0, (1 << 64) - 1 - 100),
       codec=st.sampled_from(CODECS))
def test_a_batch_is_valid_at_its_position_only(position, other, codec):
    written = encode_batch(3, [b"v"], timestamp=TS, codec=codec, position=position)
    assert read_header(written, position=position).base_offset == 3
    if position >= 3:  # ``position`` names buf[0]: the batch at buf[3] lies at position - 3 + 3
        assert read_header(b"xyz" + written, 3, position=position - 3).base_offset == 3
    if other != position:
        with pytest.raises(CorruptDataError, match=f"header checksum mismatch .*not written at byte {other}"):
            read_header(written, position=other)
        with pytest.raises(CorruptDataError):
            list(iter_batches(written, position=other))


def test_header_checksum_is_seeded_with_the_position():
    written = encode_batch(0, [b"a"], timestamp=TS, position=123456789)
    assert struct.unpack_from("<I", written, 60)[0] == seeded_crc(123456789, written[:60])
    assert seal_header(written[:60], 123456789) == written[:64]
    assert seal_header(written[:64], 5) == written[:60] + struct.pack("<I", seeded_crc(5, written[:60]))


batches_strategy = st.lists(
    st.builds(
        lambda n, size, codec, updates: (n, size, codec, updates),
        st.integers(0, 20), st.integers(0, 200), st.sampled_from(CODECS), st.integers(0, 3),
    ),
    max_size=8,
)


def encode_sequence(shapes, base: int = 0) -> tuple[list[bytes], list[list[Record]]]:
    """Batches of the given shapes (records, value size, codec, updates) numbered from ``base``,
    each sealed for position 0, and the records each holds."""
    out, records_of = [], []
    for i, (n, size, codec, updates) in enumerate(shapes):
        records = [Record(bytes([i % 256]) * (size + j % 3), key=b"k%d" % j) for j in range(n)]
        out.append(encode_batch(base, records, timestamp=TS + i, codec=codec,
                                attribute_updates=([key(j) for j in range(updates)], list(range(updates)))))
        records_of.append(expected_records(records, base, TS + i))
        base += n
    return out, records_of


@settings(max_examples=150, deadline=None)
@given(shapes=batches_strategy, position=st.integers(0, 1 << 48), other=st.integers(0, 1 << 48))
def test_place_batches_seals_each_batch_for_where_it_lands(shapes, position, other):
    batches, records_of = encode_sequence(shapes)
    data = b"".join(batches)
    placed = place_batches(data, position)
    assert len(placed) == len(data)
    found = list(iter_batches(placed, position=position))
    assert [pos for pos, _ in found] == [sum(map(len, batches[:i])) for i in range(len(batches))]
    assert [decode_records(placed, pos, header) for pos, header in found] == records_of
    # only each header's checksum (bytes 60..63) changed
    at = 0
    for one in batches:
        assert placed[at:at + 60] == one[:60] and placed[at + 64:at + len(one)] == one[64:]
        at += len(one)
    assert place_batches(placed, position) is placed  # sealed for there already: no copy
    assert place_batches(memoryview(placed), position) == placed
    moved = place_batches(placed, other)
    assert moved == place_batches(data, other)
    assert place_batches(moved, position) == placed
    if other != position and batches:
        with pytest.raises(CorruptDataError, match="header checksum"):
            list(iter_batches(moved, position=position))


@pytest.mark.parametrize("data, problem", [
    (b"AIXB", "not a whole batch"),
    (b"\x00" * 64, "not a whole version 3 batch"),
    (encode_batch(0, [b"a"], timestamp=TS)[:-1], "not a whole version 3 batch"),
    (encode_batch(0, [b"a"], timestamp=TS) + b"\x00", "not a whole batch"),
], ids=["magic-only", "zeros", "cut-short", "a-byte-more"])
def test_place_batches_refuses_what_is_not_whole_batches(data, problem):
    with pytest.raises(InvalidInputError, match=problem):
        place_batches(data, 0)


@pytest.mark.parametrize("position", [-1, 1 << 64, 1.0, True, "0"])
def test_positions_are_checked(position):
    written = encode_batch(0, [b"a"], timestamp=TS)
    with pytest.raises(InvalidInputError, match="position"):
        encode_batch(0, [b"a"], timestamp=TS, position=position)
    with pytest.raises(InvalidInputError, match="position"):
        place_batches(written, position)
    with pytest.raises(InvalidInputError, match="position"):
        rebase_batch(written, 1, position=position)


def test_rebase_batch_seals_for_its_position():
    first = encode_batch(0, [b"a", b"b"], timestamp=TS, batch_id=5)
    assert rebase_batch(first, 10, position=700) == encode_batch(10, [b"a", b"b"], timestamp=TS, batch_id=5,
                                                                 position=700)
    assert read_header(rebase_batch(first, 10, position=700), position=700).base_offset == 10


def test_peek_header_reads_a_batch_sealed_anywhere_and_checks_its_fields():
    written = encode_batch(9, [b"a", b"bc"], timestamp=TS, position=4242)
    assert peek_header(written) == read_header(written, position=4242)
    assert peek_header(b"xx" + written, 2).base_offset == 9
    for bad in (written[:63], written[:-1], b"\x00" * 64, forge(b"\x01\x01ab", count=2, size=40),
                forge(b"\x01\x01ab", count=2, version=2)):
        with pytest.raises(InvalidInputError, match="peek_header"):
            peek_header(bad)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.integers(0, (1 << 32) - 1))
def test_the_checksum_is_zlibs_crc32_whichever_library_computes_it(data, seed):
    """The stored checksums are zlib's CRC-32: ``attrindex.checksum`` (isal where installed) must
    give the same values, seeded or not, so stores read the same with or without it."""
    import zlib

    from attrindex import checksum

    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, seed) == zlib.crc32(data, seed)
    assert checksum.crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])
