"""``open_storage(url)``: pick the chunk-storage backend for a URL."""

from __future__ import annotations

import os
from typing import Any

from fsspec.core import split_protocol

from .base import ChunkStorage
from .errors import InvalidInputError, MissingDependencyError, UnsupportedSchemeError

SUPPORTED_SCHEMES = ("file", "memory", "s3")


def open_storage(url: str | os.PathLike[str], *, single_writer: bool = False, **storage_options: Any) -> ChunkStorage:
    """Open chunk storage rooted at ``url``.

    ``url`` is ``memory://name``, ``file:///abs/dir`` or a plain directory path (a ``str`` or any
    ``os.PathLike``, such as ``pathlib.Path``), or ``s3://bucket/prefix``. ``storage_options`` go to the filesystem (for S3: ``endpoint_url``,
    ``key``, ``secret``, ``client_kwargs``, ...). ``single_writer=True`` declares that exactly one
    process writes each segment, which lets S3-compatible stores that ignore ``If-None-Match`` be used.
    Local disk takes two options: ``sync`` (default True): False skips fsync, so writes survive a
    killed process but not a power loss or an OS crash.
    """
    if isinstance(url, os.PathLike):  # a local path, as the standard library takes them
        url = os.fsdecode(os.fspath(url))
    if not isinstance(url, str) or not url.strip():
        raise InvalidInputError(f"storage URL must be a non-empty string or os.PathLike, got {url!r}")
    protocol, path = split_protocol(url)
    if protocol in (None, "file", "local"):
        sync = _flag(storage_options.pop("sync", True), "sync")
        _no_options("local disk", storage_options)
        from .local import LocalChunkStorage

        return LocalChunkStorage(os.path.expanduser(path), sync=sync)
    if protocol == "memory":
        _no_options("memory", storage_options)
        from .memory import MemoryChunkStorage

        return MemoryChunkStorage(path)
    if protocol in ("s3", "s3a"):
        try:
            import s3fs  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(
                f"{url!r} needs the s3fs package: pip install 'attrindex[s3]'"
            ) from exc
        if not path.strip("/"):
            raise InvalidInputError(f"S3 URL {url!r} names no bucket; use s3://bucket/prefix")
        from .s3 import S3ChunkStorage

        return S3ChunkStorage(path, single_writer=single_writer, **storage_options)
    raise UnsupportedSchemeError(
        f"unsupported storage scheme {protocol!r} in {url!r}; supported: "
        + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        + " or a plain directory path"
    )


def _flag(value: Any, name: str) -> bool:
    """A boolean option, also from the strings a command line gives (``-o sync=false``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise InvalidInputError(f"storage option {name!r} must be true or false, got {value!r}")


def _no_options(backend: str, storage_options: dict[str, Any]) -> None:
    if storage_options:
        raise InvalidInputError(
            f"{backend} storage takes no storage options, got {sorted(storage_options)}"
        )
