"""Spark reads of a compacted segment return what ``Segment.read`` returns."""

from __future__ import annotations

import pytest

from attrindex import Record, SegmentStore

pytestmark = pytest.mark.slow


def test_spark_reads_a_compacted_segment_as_read_does(spark, tmp_path):
    url = str(tmp_path / "store")
    with SegmentStore.open(url, log_rolling_size=512) as store:
        store.create_stream("s", 1)
        store.segment("s/0").configure(cleanup_policy="compact")
        seg = store.segment("s/0")
        for i in range(300):
            value = None if i % 41 == 0 else b"v%d" % i
            seg.append([Record(value, b"k%d" % (i % 23))], timestamp=1_700_000_000_000 + i)
        stats = seg.compact(min_lag_ms=0)
        assert stats.records_after < stats.records_before
        expected, offset = [], 0
        while batch := seg.read(offset, 1000):
            expected += [(r.offset, bytes(r.key), r.value) for r in batch]
            offset = batch[-1].offset + 1
    df = (spark.read.format("attrindex").option("path", url).option("stream", "s")
          .option("maxRecordsPerPartition", "20").load())
    assert df.rdd.getNumPartitions() > 1  # ranges cut at chunk boundaries, across the gaps
    rows = sorted((r.offset, bytes(r.key), None if r.value is None else bytes(r.value))
                  for r in df.select("offset", "key", "value").collect())
    assert rows == expected
    assert any(value is None for _o, _k, value in rows)  # tombstones come through as nulls
