"""Tests of ``attrindex.log.columnar``: record batches decoded straight into Arrow.

The contract is ``decode_records``: for every batch the Arrow decoder gives the same rows, and
for every damaged one the same ``CorruptDataError``. Random batches of every shape (keys or not,
tombstones, headers, timestamps across the int64 range, every codec) and random damage with
valid checksums (so only the payload checks can catch it) are compared; the common shapes must
decode without falling back to ``decode_records`` at all.
"""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pytest.importorskip("numpy")

from attrindex.errors import CorruptDataError  # noqa: E402
from attrindex.log import columnar  # noqa: E402
from attrindex.log.batch.compression import Codec, available_codecs  # noqa: E402
from attrindex.log.batch.decode import decode_records  # noqa: E402
from attrindex.log.batch.encode import encode_batch  # noqa: E402
from attrindex.log.batch.header import BATCH_HEADER_SIZE, read_header, seal_header  # noqa: E402
from attrindex.log.batch.records import Record  # noqa: E402

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
TS = 1_700_000_000_000
CODECS = sorted(available_codecs())


def rows(batch) -> list[Record]:
    """An Arrow batch of ``RECORD_SCHEMA`` as the ``Record``s ``decode_records`` returns."""
    assert batch.schema == columnar.RECORD_SCHEMA
    columns = [batch.column(name) for name in ("value", "key", "timestamp", "headers", "offset")]
    values, keys, stamps, headers, offsets = (c.to_pylist() for c in (
        columns[0], columns[1], columns[2].cast(pa.int64()), columns[3], columns[4]))
    return [Record(v, k, t, tuple((p["key"], p["value"]) for p in h), o)
            for v, k, t, h, o in zip(values, keys, stamps, headers, offsets)]


def decoded(data: bytes, pos: int = 0):
    """``(decode_records result or its error text, decode_arrow result or its error text)``."""
    header = read_header(data, pos)
    outcomes = []
    for decode in (decode_records, lambda *a, **k: rows(columnar.decode_arrow(*a, **k))):
        try:
            outcomes.append(decode(data, pos, header, segment="s"))
        except CorruptDataError as exc:
            outcomes.append(f"CorruptDataError: {exc}")
    return outcomes


int64s = st.integers(I64_MIN, I64_MAX)
record = st.one_of(
    st.binary(max_size=40),
    st.builds(Record, value=st.binary(max_size=300), key=st.none() | st.binary(max_size=20),
              timestamp=st.none() | int64s | st.integers(TS - 100_000, TS + 100_000),
              headers=st.just(()) | st.lists(st.tuples(st.text(max_size=8), st.binary(max_size=8)), max_size=3)),
    st.builds(Record, value=st.none(), key=st.binary(max_size=20), timestamp=st.none() | int64s,
              headers=st.just(())),  # tombstones
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(record, max_size=40), base=st.integers(0, 1 << 62), timestamp=int64s,
       codec=st.sampled_from(CODECS), prefix=st.binary(max_size=5))
def test_arrow_rows_are_the_records_rows(records, base, timestamp, codec, prefix):
    data = prefix + encode_batch(base, records, timestamp=timestamp, codec=codec,
                                 attribute_updates=([b"k" * 16], [7]), position=len(prefix))
    expected, got = decoded(data, len(prefix))
    assert got == expected


def forge(payload: bytes, header_of: bytes) -> bytes:
    """``header_of``'s header over ``payload`` (uncompressed), checksums recomputed."""
    head = bytearray(header_of[:BATCH_HEADER_SIZE])
    struct.pack_into("<I", head, 8, BATCH_HEADER_SIZE + len(payload))
    struct.pack_into("<I", head, 20, len(payload))
    struct.pack_into("<I", head, 56, zlib.crc32(payload))
    return seal_header(head, 0) + payload


SAMPLES = [
    [Record(b"v%d" % i, b"key-%d" % (i % 3), TS + 37 * i) for i in range(50)],
    [Record(b"x" * (i * 13), None if i % 4 else b"k", TS - i * 100_003, [("h", b"%d" % i)] if i % 5 == 0 else ())
     for i in range(40)],
    [Record(None if i % 3 == 0 else b"val", b"k%d" % i, TS) for i in range(30)],
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample=st.sampled_from(range(len(SAMPLES))), edits=st.lists(st.tuples(st.integers(0, 10_000),
                                                                              st.integers(0, 255)), min_size=1,
                                                                    max_size=3),
       cut=st.integers(-3, 3))
def test_damage_with_valid_checksums_is_judged_as_decode_records_judges_it(sample, edits, cut):
    good = encode_batch(5, SAMPLES[sample], timestamp=TS, attribute_updates=([b"a" * 16], [None]))
    payload = bytearray(good[BATCH_HEADER_SIZE:])
    for at, byte in edits:
        payload[at % len(payload)] = byte
    if cut < 0:
        payload = payload[:cut]
    else:
        payload += bytes(cut)
    data = forge(bytes(payload), good)
    expected, got = decoded(data)
    if isinstance(expected, str):
        assert got == expected  # the same error, at the same place
    else:
        assert got == expected


def test_common_shapes_decode_without_the_record_decoder(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("fell back to decode_records")

    batches = [encode_batch(9, records, timestamp=TS) for records in SAMPLES]
    batches.append(encode_batch(0, [Record(b"p" * 200, b"user-%d" % i, TS + 10 * i) for i in range(5000)],
                                timestamp=TS, codec=Codec.NONE))
    batches.append(encode_batch(0, [b"v"] * 3, timestamp=TS, attribute_updates=([b"a" * 16], [1])))
    expected = [decode_records(data, 0, read_header(data)) for data in batches]
    monkeypatch.setattr(columnar, "decode_records", refuse)
    for data, records in zip(batches, expected):
        assert rows(columnar.decode_arrow(data, 0, read_header(data))) == records


def test_values_share_the_batch_bytes():
    data = encode_batch(0, [b"a" * 1000, b"b" * 1000], timestamp=TS)
    buffer = pa.py_buffer(data)
    batch = columnar.decode_arrow(data, 0, read_header(data), buffer=buffer)
    value_data = batch.column("value").buffers()[2]
    assert value_data.address >= buffer.address and value_data.address < buffer.address + buffer.size


def test_records_to_arrow_and_empty_batches():
    assert columnar.records_to_arrow([]).num_rows == 0
    data = encode_batch(3, [], timestamp=TS, attribute_updates=([b"a" * 16], [1]))
    assert columnar.decode_arrow(data, 0, read_header(data)).num_rows == 0
    records = decode_records(*(lambda d: (d, 0, read_header(d)))(encode_batch(0, SAMPLES[1], timestamp=TS)))
    assert rows(columnar.records_to_arrow(records)) == records


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(st.binary(max_size=300), st.none() | st.binary(max_size=20),
                               st.none() | int64s | st.integers(TS - 10**7, TS + 10**7)), min_size=1, max_size=40),
       keyed=st.booleans(), stamped=st.booleans(), base=st.integers(0, 1 << 62), timestamp=int64s,
       codec=st.sampled_from(CODECS), batch_id=st.integers(0, (1 << 64) - 1), offset=st.integers(0, 3),
       updates=st.dictionaries(st.binary(min_size=16, max_size=16), st.none() | int64s, max_size=3))
def test_encode_arrow_makes_the_bytes_encode_batch_makes(rows, keyed, stamped, base, timestamp, codec, batch_id,
                                                         offset, updates):
    values = pa.array([b"pad"] * offset + [v for v, _, _ in rows], pa.binary()).slice(offset)  # an offset array too
    keys = pa.array([k for _, k, _ in rows], pa.binary()) if keyed else None
    stamps = pa.array([t for _, _, t in rows], pa.int64()) if stamped else None
    records = [Record(v, k if keyed else None, t if stamped else None) for v, k, t in rows]
    update_pairs = (sorted(updates), [updates[k] for k in sorted(updates)])
    expected = encode_batch(base, records, timestamp=timestamp, codec=codec, batch_id=batch_id,
                            attribute_updates=update_pairs)
    got = columnar.encode_arrow(values, keys, stamps, timestamp=timestamp, base_offset=base, codec=codec,
                                batch_id=batch_id, attribute_updates=update_pairs)
    assert got == expected
