"""Opening a storage URL for an index or a store, and telling whether one is already there.

What marks each as existing (docs/user-guide.md, "Opening and creating"):

* an ``AttributeIndex`` named ``NAME``: any file under ``NAME.seg/`` (its chunks, truncation
  markers, or the ``_created`` marker that a creating open writes into an empty one);
* a ``SegmentStore``: see ``attrindex.store.store_exists``.

A local path that is a regular file (or lies under one) can hold neither; it is refused up front
instead of failing later with an ``OSError`` from deep inside a write.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from storage_adapters import ChunkStorage, InvalidInputError, open_storage
from storage_adapters.local import LocalChunkStorage
from storage_adapters.rolling import validate_segment_name

from .errors import IndexNotFoundError
from .layout import index_created_marker, rolling_dir


log = logging.getLogger(__name__)


def open_location(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, *, what: str,
                  not_found: type[Exception]) -> ChunkStorage:
    """``open_storage(url, **storage_options)``, refusing a local path that cannot be a directory.

    ``what`` names the thing looked for ("index 'attributes'", "store") in the error, an instance
    of ``not_found``.
    """
    if storage_options is not None and (not isinstance(storage_options, Mapping)
                                        or not all(isinstance(k, str) for k in storage_options)):
        raise InvalidInputError(f"storage_options must be a dict of str keys or None, got {storage_options!r:.80}")
    storage = open_storage(url, **dict(storage_options or {}))
    blocker = _regular_file_in_the_way(storage)
    if blocker is not None:
        storage.close()
        raise not_found(f"no {what} at URL {storage.url!r}: {blocker!r} is a regular file, not a directory")
    return storage


def _regular_file_in_the_way(storage: ChunkStorage) -> str | None:
    """The existing non-directory at or above a local storage root, if there is one."""
    if not isinstance(storage, LocalChunkStorage):
        return None
    path = storage.root
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


def index_exists(storage: ChunkStorage, name: str) -> bool:
    """Whether the index ``name`` has ever been created or written in ``storage``."""
    return bool(storage.list_files(rolling_dir(name)))


def mark_index_created(storage: ChunkStorage, name: str) -> None:
    """Make an index that has no update yet recognisable as existing (idempotent)."""
    storage.put_marker(index_created_marker(name))
    log.info("created index %r at %s", name, storage.url)


def index_storage(storage: str | os.PathLike[str] | ChunkStorage, options: Mapping[str, Any] | None, name: str) -> ChunkStorage:
    """The storage an index-at classmethod works on: a URL must hold the index ``name``."""
    validate_segment_name(name)
    if isinstance(storage, ChunkStorage):
        return storage
    what = f"index {name!r}"
    opened = open_location(storage, options, what=what, not_found=IndexNotFoundError)
    if not index_exists(opened, name):
        opened.close()
        raise IndexNotFoundError(f"no {what} at URL {opened.url!r}")
    return opened


# The project's own short-lived clients (the command line, the demo's driver) fail fast on S3: a mistyped endpoint, a dead network or an endpoint
# that never answers is reported within seconds (at most 2 attempts of a 2 s connect timeout and
# a 10 s read timeout: 25 s), not after the library's defaults (5 attempts of 10 s and 20 s).
# Options the user gives (-o read_timeout=60, or botocore's own names in -o config_kwargs={...})
# win over these.
S3_FAIL_FAST = {"connect_timeout": 2, "read_timeout": 10, "max_attempts": 2}
_BOTOCORE_NAMES = {"connect_timeout": "connect_timeout", "read_timeout": "read_timeout", "max_attempts": "retries"}


def failing_fast(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus ``S3_FAIL_FAST`` if ``url`` is on S3 (the user's settings win)."""
    if "://" not in url or url.split("://", 1)[0].lower() not in ("s3", "s3a"):
        return options
    given = options.get("config_kwargs", {})
    if not isinstance(given, dict):
        raise InvalidInputError(f"storage option 'config_kwargs' must be a JSON object, got {given!r}")
    defaults = {name: value for name, value in S3_FAIL_FAST.items()
                if name not in options and _BOTOCORE_NAMES[name] not in given}
    return {**defaults, **options}
