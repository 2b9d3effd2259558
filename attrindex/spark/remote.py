"""Storage work of the driver-side helpers (``lookup``'s check, ``write_summary``) run where the
store is reachable.

On a classic SparkSession the driver is the calling process, and reads and writes already touch
the store there (planning, commits), so the helpers run in place. Under Spark Connect the client
is not the driver: it may not reach the store at all, and a path or a credential may mean
something else, or nothing, where it runs. So there the work runs as a one-task Spark job on the
cluster, as reads and writes do, and only its JSON result travels back. An ``AttrIndexError``
the work raises on the cluster is raised again on the client as the same class with the same
message; anything else fails the job as Spark reports it.
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Callable

from ..errors import AttrIndexError

RESULT_SCHEMA = "result string"


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (without importing Connect's client)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def run(spark: Any, work: Callable[..., Any], *args: Any) -> Any:
    """``work(*args)`` (its result JSON-serialisable): in this process, or on a Connect
    session's cluster in one task."""
    if spark is None or not is_connect(spark):
        return work(*args)

    def task(batches):
        import pyarrow as pa

        for _ in batches:
            pass
        try:
            outcome = {"result": work(*args)}
        except AttrIndexError as exc:
            outcome = {"error": [type(exc).__module__, type(exc).__qualname__, str(exc)]}
        yield pa.RecordBatch.from_pydict({"result": [json.dumps(outcome)]})

    rows = spark.range(1, numPartitions=1).mapInArrow(task, RESULT_SCHEMA).collect()
    outcome = json.loads(rows[0].result)
    if "error" in outcome:
        raise _error(*outcome["error"])
    return outcome["result"]


def _error(module: str, name: str, message: str) -> AttrIndexError:
    """The error the cluster raised, as its own class when that takes a message alone."""
    if module != "attrindex" and not module.startswith("attrindex."):
        return AttrIndexError(f"{name}: {message}")
    try:
        cls = getattr(importlib.import_module(module), name)
        if isinstance(cls, type) and issubclass(cls, AttrIndexError):
            return cls(message)
    except (ImportError, AttributeError, TypeError):
        pass
    return AttrIndexError(f"{name}: {message}")
