"""Tests of ``attrindex.arrow``: a stream's records through a scanner, as Arrow, pandas, Polars and
DuckDB see them, against the records ``Segment.read`` returns."""

from __future__ import annotations

import pytest

pa = pytest.importorskip("pyarrow")

from attrindex import Record, SegmentStore  # noqa: E402
from attrindex.arrow import STREAM_SCHEMA, scan_stream  # noqa: E402
from attrindex.errors import CorruptDataError, InvalidInputError, StreamNotFoundError  # noqa: E402
from storage_adapters import open_storage  # noqa: E402

from .raw_chunks import committed_chunks  # noqa: E402

T0 = 1_767_225_600_000


@pytest.fixture
def stream(storage_url):
    url, options = storage_url
    with SegmentStore.open(url, storage_options=options, log_rolling_size=8192) as store:
        names = store.create_stream("events", 3)
        for i in range(40):
            name = names[i % 3]
            store.segment(name).append([Record(b"e%d-%d" % (i, j), b"k%d" % j, T0 + 100 * i + j,
                                               [("i", b"%d" % i)] if j == 0 else ()) for j in range(25)])
        yield store, names


def expected(store, names, lo=None, hi=None):
    out = []
    for name in names:
        for r in store.segment(name).read(0, 100_000):
            if (lo is None or r.timestamp >= lo) and (hi is None or r.timestamp < hi):
                out.append((name, r.offset, r.timestamp, r.key, r.value, [{"key": k, "value": v} for k, v in r.headers]))
    return out


def rows(table):
    stamps = table.column("timestamp").cast(pa.int64()).to_pylist()
    cols = [table.column(n).to_pylist() for n in ("segment", "offset", "key", "value", "headers")]
    return [(s, o, t, k, v, h) for (s, o, k, v, h), t in zip(zip(*cols), stamps)]


def test_the_scanner_gives_every_record_once_with_time_and_segment_filters(stream):
    store, names = stream
    table = scan_stream(store, "events").to_table()
    assert table.schema == STREAM_SCHEMA and rows(table) == expected(store, names)
    lo, hi = T0 + 1210, T0 + 3005
    assert rows(scan_stream(store, "events", start_time=lo, end_time=hi).to_table()) == expected(store, names, lo, hi)
    assert scan_stream(store, "events", start_time=T0 + 10**9).count_rows() == 0
    one = scan_stream(store, "events", segments=[names[1]], columns=["offset", "value"]).to_table()
    assert one.schema.names == ["offset", "value"] and one.num_rows == 13 * 25
    reader = scan_stream(store, "events").to_reader()
    assert reader.schema == STREAM_SCHEMA and sum(b.num_rows for b in reader) == 1000


def test_a_threaded_table_has_the_rows_of_the_batches_in_their_order(stream):
    store, names = stream
    for kwargs in ({}, {"start_time": T0 + 1210, "end_time": T0 + 3005}, {"columns": ["value", "segment"]}):
        scanner = scan_stream(store, "events", **kwargs)
        batches = pa.Table.from_batches(list(scanner.to_batches()), schema=scanner.schema)
        assert scanner.to_table().equals(batches)
        assert scanner.to_table(use_threads=False).equals(batches)


def test_damage_in_one_segment_fails_a_threaded_table_with_corrupt_data_error(tmp_path):
    with SegmentStore.open(str(tmp_path / "store")) as store:
        names = store.create_stream("events", 3)
        for i, name in enumerate(names):
            for first in (0, 200):  # two batches: damage to the first is not a torn newest write
                store.segment(name).append([Record(b"value-%d-%d" % (i, j), b"k%d" % j, T0 + j)
                                            for j in range(first, first + 200)])
    (name, start, data), = committed_chunks(open_storage(str(tmp_path / "store")), f"{names[1]}/_log")
    path = tmp_path / "store" / f"{names[1]}/_log.seg" / name
    with open(path, "r+b") as handle:  # a flipped byte inside the first batch's values
        at = data.index(b"value-1-100")
        handle.seek(at)
        handle.write(b"V")
    with SegmentStore.open(str(tmp_path / "store"), mode="r+") as store:
        with pytest.raises(CorruptDataError):
            scan_stream(store, "events").to_table()
        assert scan_stream(store, "events", segments=[names[0], names[2]]).to_table().num_rows == 800


def test_pandas_polars_and_duckdb_read_the_scanner(stream):
    pl = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    store, names = stream
    frame = scan_stream(store, "events").to_pandas()
    assert len(frame) == 1000 and frame["value"].iloc[0] == b"e0-0"
    assert str(frame["timestamp"].dt.tz) == "UTC"
    polars_frame = pl.from_arrow(scan_stream(store, "events").to_table())
    assert polars_frame.group_by("segment").len().sort("segment")["len"].to_list() == [350, 325, 325]
    reader = scan_stream(store, "events", columns=["segment", "value"]).to_reader()
    total = duckdb.sql("select count(*), sum(octet_length(value)) from reader").fetchall()[0]
    assert total == (1000, sum(len(r[4]) for r in expected(store, names)))


def test_bad_arguments_are_refused_before_reading(stream):
    store, names = stream
    with pytest.raises(StreamNotFoundError):
        scan_stream(store, "nope")
    for kwargs in ({"segments": "events/0"}, {"segments": ["other"]}, {"start_time": 1.5},
                   {"columns": ["nope"]}, {"columns": []}, {"columns": "value"}):
        with pytest.raises(InvalidInputError):
            scan_stream(store, "events", **kwargs)
    for use_threads in ("yes", 1, None):
        with pytest.raises(InvalidInputError, match="use_threads"):
            scan_stream(store, "events").to_table(use_threads=use_threads)
