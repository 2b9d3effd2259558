"""Python data sources from any thread of a classic (non-Connect) PySpark driver.

Spark finds a Python data source by its short name in the data source registry of the JVM
thread's *active* session only (``DataSource.lookupDataSource`` asks
``SparkSession.getActiveSession``, which has no fallback to the default session). PySpark maps
every Python thread to a JVM thread of its own, and a new one has no active session: so
``df.write.format("attrindex").save()`` from a thread pool, a web handler or an Airflow task
fails with ``[DATA_SOURCE_NOT_FOUND]`` although the format is registered with that very session,
and registering again does not help.

``activate(spark)`` makes ``spark`` the active session of the calling thread's JVM thread.
``install()`` (run by ``register``) wraps the PySpark calls that look a data source up
(``DataFrameWriter.save``, ``DataFrameReader.load``, ``DataStreamWriter.start`` and
``toTable``, ``DataStreamReader.load``) so that, in a thread whose JVM thread has no active
session, they first make the reader's or writer's own session active: the session a thread
would have found had it been the main one. A thread that has an active session keeps it.
"""

from __future__ import annotations

import functools
import threading

_PATCHED = "_attrindex_active_session"
_install_lock = threading.Lock()


def activate(spark) -> None:
    """Make ``spark`` (a classic SparkSession) the active session of the calling thread, in
    Python and in the JVM; a no-op for a Spark Connect session (its server sets it)."""
    from pyspark.sql import SparkSession

    jsession = getattr(spark, "_jsparkSession", None)
    if jsession is None:  # Spark Connect: lookups run in the server, per request
        return
    SparkSession._get_j_spark_session_class(spark._jvm).setActiveSession(jsession)


def _ensure_active(spark) -> None:
    """``activate(spark)`` unless the calling thread's JVM thread has an active session."""
    jsession = getattr(spark, "_jsparkSession", None)
    if jsession is None:
        return
    from pyspark.sql import SparkSession

    sessions = SparkSession._get_j_spark_session_class(spark._jvm)
    if not sessions.getActiveSession().isDefined():
        sessions.setActiveSession(jsession)


def _wrap(cls, name: str) -> None:
    method = getattr(cls, name)
    if getattr(method, _PATCHED, False):
        return

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        spark = getattr(self, "_spark", None)
        if spark is not None:
            _ensure_active(spark)
        return method(self, *args, **kwargs)

    setattr(wrapper, _PATCHED, True)
    setattr(cls, name, wrapper)


def install() -> None:
    """Wrap PySpark's data source entry points (once per process; idempotent)."""
    from pyspark.sql.readwriter import DataFrameReader, DataFrameWriter
    from pyspark.sql.streaming.readwriter import DataStreamReader, DataStreamWriter

    with _install_lock:
        for cls, names in ((DataFrameWriter, ("save",)), (DataFrameReader, ("load",)),
                           (DataStreamWriter, ("start", "toTable")), (DataStreamReader, ("load",))):
            for name in names:
                _wrap(cls, name)
