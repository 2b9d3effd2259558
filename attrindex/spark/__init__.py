"""PySpark integration: data sources for streams of segments and for attributes, and ``lookup``.

::

    import attrindex.spark
    attrindex.spark.register(spark)
    df.write.format("attrindex").option("path", url).option("stream", "events").mode("append").save()
    spark.read.format("attrindex").option("path", url).option("stream", "events").load()
    spark.read.format("attrindex.attributes").option("path", url).option("segment", name).load()
    attrindex.spark.lookup(df, "key", url, name)

Needs the ``spark`` extra (PySpark 4.1+ with pyarrow) and a Java 17+ runtime. See docs/spark.md.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping

from ..errors import MissingDependencyError

try:
    import pyarrow  # noqa: F401
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise MissingDependencyError("attrindex.spark needs PySpark and pyarrow: pip install 'attrindex[spark]'") from exc

from .attributes import AttributesDataSource, lookup
from .events import EventsDataSource, PlainEventsDataSource
from .ingest import CommitLedger, write_token
from .threads import activate

__all__ = ["register", "activate", "lookup", "session", "write_summary", "EventsDataSource", "AttributesDataSource"]

FILTER_PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


def register(spark, *, filter_pushdown: bool = False) -> None:
    """Register the ``attrindex`` and ``attrindex.attributes`` formats with a SparkSession.

    ``filter_pushdown=True`` registers the ``attrindex`` reader that takes filters on ``segment``,
    ``offset`` and ``timestamp`` (skipping data through the offset and time indexes) and turns on
    Spark's Python filter pushdown for the session. It is off by default because PySpark 4.1-4.3
    keep the read planned for a filtered query on the DataFrame the filter was applied to, so a
    later query on that same DataFrame without the filter reads the filtered rows (docs/spark.md).
    The ``startingTimestamp``/``endingTimestamp`` read options use the time index either way.

    It also lets reads and writes run from any thread of the driver (``attrindex.spark.threads``):
    Spark looks a Python data source up in the calling JVM thread's active session only.
    """
    from . import threads

    threads.install()
    if filter_pushdown:
        spark.conf.set(FILTER_PUSHDOWN_CONF, "true")
        spark.dataSource.register(EventsDataSource)
    else:
        spark.dataSource.register(PlainEventsDataSource)
    spark.dataSource.register(AttributesDataSource)


def session(master: str = "local[*]", app_name: str = "attrindex", conf: Mapping[str, Any] | None = None, *,
            filter_pushdown: bool = False):
    """A SparkSession set up for attrindex, with the formats registered.

    Spark starts its Python workers with ``python3`` from the PATH unless ``PYSPARK_PYTHON`` says
    otherwise, and that interpreter may lack attrindex (a virtualenv's packages); so unless the
    user set it, ``PYSPARK_PYTHON`` is pointed at the running interpreter first.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "8")
               .config("spark.sql.session.timeZone", "UTC"))
    for key, value in dict(conf or {}).items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    register(spark, filter_pushdown=filter_pushdown)
    return spark


def write_summary(url: str, stream: str, write_id: str, storage_options: Mapping[str, Any] | None = None, *,
                  spark=None) -> dict | None:
    """What the commit of batch write ``write_id`` to ``stream`` recorded (rows, rows written,
    rows an earlier attempt had written, ...), or ``None`` if no such write was committed.

    With a Spark Connect session (``spark``, else the active one when PySpark runs as a Connect
    client) the store is read on the cluster, as reads and writes do, so the client need not
    reach it; otherwise here. Nothing is created: a missing store raises ``StreamNotFoundError``.
    """
    from . import remote

    if spark is None:
        spark = _active_connect_session()
    return remote.run(spark, committed_summary, url, stream, write_id, dict(storage_options or {}))


def committed_summary(url: str, stream: str, write_id: str, storage_options: dict) -> dict | None:
    """``write_summary``'s storage work, in the process that runs it."""
    from ..errors import StoreNotFoundError, StreamNotFoundError
    from ..store import SegmentStore

    try:
        with SegmentStore.open(url, storage_options=storage_options, mode="r+") as store:
            store.stream_segments(stream)
            return CommitLedger(store.storage, stream).committed(write_token(write_id), 0)
    except StoreNotFoundError as exc:
        raise StreamNotFoundError(f"stream {stream!r} does not exist: {exc}") from None


def _active_connect_session():
    """The active session if this process is a Spark Connect client, else ``None``."""
    from pyspark.sql.utils import is_remote

    if not is_remote():
        return None
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()
