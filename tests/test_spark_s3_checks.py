"""Store checks of the Spark sources, made where the writer/reader is created (``save()``/``load()``),
not inside tasks: a store that ignores conditional writes, and the ``single_writer`` option.

The non-conforming store is moto behind an HTTP proxy that drops ``If-None-Match`` from every
request, so an exclusive create of an existing object overwrites it, as some S3 clones do; Spark's
Python workers reach it over the network like any store."""

from __future__ import annotations

import contextlib
import uuid

import pytest

from attrindex import EventWriter, SegmentStore
from attrindex.errors import InvalidInputError
from attrindex.spark import lookup
from storage_adapters import open_storage
from storage_adapters.s3 import probe_exclusive_create

from .conftest import make_s3_url
from .s3_proxy import S3Proxy


@pytest.fixture(scope="module")
def ignoring_options(s3_options):
    """Storage options of moto seen through the proxy: a store that ignores conditional writes."""
    proxy = S3Proxy(s3_options["endpoint_url"], drop_if_none_match=True)
    yield {**s3_options, "endpoint_url": proxy.endpoint}
    proxy.close()


def _spark_options(url: str, storage_options: dict, **more: str) -> dict:
    return {"path": url, **{f"storage.{k}": str(v) for k, v in storage_options.items()}, **more}


@contextlib.contextmanager
def _job_group(spark):
    """Run the block's Spark jobs in a group of their own; yields the function listing the ids of
    the jobs started in it (a refusal made before any task leaves none: no task ran, none retried)."""
    context, group = spark.sparkContext, f"check-{uuid.uuid4().hex}"
    context.setJobGroup(group, "a store check")
    try:
        yield lambda: list(context.statusTracker().getJobIdsForGroup(group))
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)


def _events_df(spark, n: int = 20):
    return spark.createDataFrame([(f"v{i}".encode(),) for i in range(n)], "value binary")


def test_the_proxy_really_ignores_conditional_writes(s3_options, ignoring_options):
    url = make_s3_url(s3_options)
    direct, proxied = open_storage(url, **s3_options), open_storage(url, **ignoring_options)
    path = url[len("s3://"):] + "/probe"
    assert probe_exclusive_create(direct.fs, path) is True
    assert probe_exclusive_create(proxied.fs, path) is False


@pytest.mark.parametrize("fmt", ["attrindex", "attrindex.attributes"])
def test_a_write_to_a_store_ignoring_conditional_writes_fails_at_save(spark, s3_options, ignoring_options, fmt):
    """The store and stream exist (made through a conforming endpoint), so nothing on the driver
    writes before the tasks do: without the driver's probe, the tasks would fail, be retried 4
    times and surface after ~28 s. With it: one clear error at save(), nothing written."""
    url = make_s3_url(s3_options)
    with SegmentStore.open(url, storage_options=s3_options) as store:
        store.create_stream("events", 2)
        store.segment("attrs", create=True)
    if fmt == "attrindex":
        df, extra = _events_df(spark), {"stream": "events"}
    else:
        df, extra = spark.createDataFrame([(i, i) for i in range(20)], "key long, value long"), {"segment": "attrs"}
    with _job_group(spark) as jobs, pytest.raises(Exception, match="ignores conditional writes") as caught:
        df.write.format(fmt).options(**_spark_options(url, ignoring_options, **extra)).mode("append").save()
    assert jobs() == []  # refused at save(), before any task (none failed and was retried)
    with _job_group(spark) as jobs:
        df.count()
    assert jobs()  # (a group does list the jobs started in it)
    message = str(caught.value)
    assert url in message and "AWS S3, MinIO, SeaweedFS" in message
    assert "single_writer=True" not in message  # the storage layer's advice does not hold for Spark
    with SegmentStore.open(url, storage_options=s3_options) as store:
        assert all(store.segment(n).next_offset == 0 for n in [*store.stream_segments("events"), "attrs"])


def test_a_read_of_a_store_ignoring_conditional_writes_works(spark, s3_options, ignoring_options):
    """Reads need no exclusive create (and no write permission): load() does not probe."""
    url = make_s3_url(s3_options)
    with SegmentStore.open(url, storage_options=s3_options) as store:  # written where writes are safe
        with EventWriter(store, "events", segments=2) as writer:
            for i in range(20):
                writer.write(f"v{i}".encode())
    read = spark.read.format("attrindex").options(**_spark_options(url, ignoring_options, stream="events")).load()
    assert sorted(r.value for r in read.select("value").collect()) == sorted(f"v{i}".encode() for i in range(20))


def test_single_writer_is_refused_at_save_and_load(spark, tmp_path):
    url = str(tmp_path / "store")
    refusal = "single_writer' cannot be used with Spark"
    events = _spark_options(url, {"single_writer": "true"}, stream="events", segments="2")
    with pytest.raises(Exception, match=refusal):
        _events_df(spark).write.format("attrindex").options(**events).mode("append").save()
    attributes = _spark_options(url, {"single_writer": "True"}, segment="attrs")
    keys = spark.createDataFrame([(1, 1)], "key long, value long")
    with pytest.raises(Exception, match=refusal):
        keys.write.format("attrindex.attributes").options(**attributes).mode("append").save()
    with pytest.raises(Exception, match=refusal):
        spark.read.format("attrindex").options(**events).load()
    with pytest.raises(Exception, match=refusal):
        spark.read.format("attrindex.attributes").options(**attributes).load()
    with pytest.raises(InvalidInputError, match=refusal):
        lookup(keys.select("key"), "key", url, "attrs", storage_options={"single_writer": True})
    # single_writer=false is the default, and accepted
    plain = _spark_options(url, {"single_writer": "false"}, stream="events", segments="2")
    _events_df(spark, 3).write.format("attrindex").options(**plain).mode("append").save()
    assert spark.read.format("attrindex").options(**plain).load().count() == 3


def test_a_streaming_write_to_a_store_ignoring_conditional_writes_fails_before_its_tasks(
        spark, s3_options, ignoring_options, tmp_path):
    """start() returns (Spark creates the stream writer in the query's thread); the query then stops
    with the error when it plans its first micro-batch, before any task, instead of retrying tasks."""
    url = make_s3_url(s3_options)
    with SegmentStore.open(url, storage_options=s3_options) as store:
        store.create_stream("events", 2)
    source = spark.readStream.format("rate").option("rowsPerSecond", "50").load().selectExpr(
        "cast(value as string) as value")
    with pytest.raises(Exception, match="ignores conditional writes"):
        query = (source.writeStream.format("attrindex").options(**_spark_options(url, ignoring_options, stream="events"))
                 .option("checkpointLocation", str(tmp_path / "checkpoint")).start())
        try:
            query.awaitTermination(120)
        finally:
            query.stop()
    # A query runs its micro-batches' jobs in the group named by its run id: none started.
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup(str(query.runId))) == []
