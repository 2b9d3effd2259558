"""Storage checks a Spark write or read makes once, up front, before any task runs.

A problem found inside tasks reaches the user only after Spark has retried every failing task
(about 28 s with four attempts), as a stack of task failures; the same problem found where the
writer or reader is created fails ``save()``/``load()`` at once (a streaming query: as it plans
its first micro-batch, before any task), with one line.

- ``single_writer`` is refused: it promises that at most one process writes to each segment, and
  a Spark job writes from many tasks (processes, machines) at once, so the promise cannot be kept.
- Before a write, the store's exclusive create is checked (on S3: the capability probe, cached per
  bucket per process): a store that accepts ``If-None-Match: *`` and overwrites anyway would let
  two tasks replace each other's chunks, so it is refused as a permanent error, not retried.
  Reads need no exclusive create (the chunk index files readers write are best effort), so a
  read does not probe: it needs no write permission either.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import InvalidInputError


def refuse_single_writer(storage_options: Mapping[str, Any], source: str) -> None:
    """``InvalidInputError`` if the storage options ask for ``single_writer`` (any value but false)."""
    value = storage_options.get("single_writer", False)
    if value is False or (isinstance(value, str) and value.strip().lower() == "false"):
        return
    raise InvalidInputError(
        f"{source}: the storage option 'single_writer' cannot be used with Spark: it promises that at most "
        "one process writes to each segment, and Spark runs many tasks in parallel; use a store that "
        "supports conditional writes (If-None-Match: *), such as AWS S3, MinIO or SeaweedFS")


def check_write_target(url: str, storage_options: Mapping[str, Any], source: str) -> None:
    """Before a write touches the store (opening a new store writes its marker): the checks above."""
    from storage_adapters import open_storage

    refuse_single_writer(storage_options, source)
    with open_storage(url, **dict(storage_options)) as storage:
        require_exclusive_create(storage, source)


def require_exclusive_create(storage: Any, source: str) -> None:
    """Check now that ``storage`` refuses to create an object that exists (S3: probe the bucket once
    per process); ``ExclusiveCreateUnsupportedError`` naming the store and what to do if not."""
    from storage_adapters import ExclusiveCreateUnsupportedError

    check = getattr(storage, "ensure_exclusive_create", None)
    if check is None:  # local disk and memory: create is exclusive by construction
        return
    try:
        check()
    except ExclusiveCreateUnsupportedError:
        endpoint = getattr(storage, "endpoint", None) or "its endpoint"
        raise ExclusiveCreateUnsupportedError(
            f"{source}: the store {storage.url} (endpoint {endpoint}) ignores conditional writes: it accepted "
            "an exclusive create (If-None-Match: *) of an object that already existed, so parallel Spark "
            "tasks could overwrite each other's data; write to a store that supports conditional writes "
            "(AWS S3, MinIO, SeaweedFS, ...)") from None  # its advice (single_writer) does not apply
