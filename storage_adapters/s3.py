"""S3 chunk storage through s3fs: every chunk is one immutable object made by an exclusive create.

Exclusive create is ``PutObject`` with ``If-None-Match: *`` (s3fs ``mode="create"``); S3 refuses it
with 412 when the key exists, which is what makes compare-and-append safe across processes. Some
S3-compatible stores accept the header and ignore it, so before the first write to a bucket this
module checks, once per process, that an exclusive create of an existing object is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from typing import Any, Iterator

from .base import ChunkStorage, relative_paths
from .errors import ChunkExistsError, ExclusiveCreateUnsupportedError, OutcomeUnknownError, StorageError

_log = logging.getLogger("attrindex.storage")
_PROBED_GUARD = threading.Lock()
_PROBED: dict[tuple[str, str], bool] = {}


def probe_exclusive_create(fs: Any, path: str) -> bool:
    """Whether ``fs`` refuses an exclusive create of an existing object (tries it at ``path``)."""
    fs.pipe_file(path, b"first", mode="create")
    try:
        fs.pipe_file(path, b"second", mode="create")
    except FileExistsError:
        return True
    finally:
        fs.rm_file(path)
    return False


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What s3fs lets through untranslated: botocore's, aiohttp's and asyncio's own errors."""
    import aiohttp
    import botocore.exceptions

    return (OSError, botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError,
            aiohttp.ClientError, asyncio.TimeoutError)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of the response behind ``exc`` (s3fs keeps the ClientError as the cause)."""
    import botocore.exceptions

    while exc is not None:
        if isinstance(exc, botocore.exceptions.ClientError):
            return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        exc = exc.__cause__ or exc.__context__
    return None


def _never_sent(exc: BaseException) -> bool:
    """Whether the request certainly did not reach S3 (the connection was never made)."""
    import botocore.exceptions

    return isinstance(exc, (botocore.exceptions.EndpointConnectionError, ConnectionRefusedError))


@contextlib.contextmanager
def s3_errors(operation: str, path: str, *, missing: bool = False, write: bool = False) -> Iterator[None]:
    """Turn s3fs/botocore/aiohttp errors into ``StorageError`` naming ``path``.

    ``missing=True`` lets ``FileNotFoundError`` through. With ``write=True`` an error that may have
    come after the request was sent (no response, or a 5xx) is ``OutcomeUnknownError``: the write may
    have happened; a refusal (a 4xx) or a connection never made is a definite ``StorageError``.
    """
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError:
        if missing:
            raise
        raise StorageError(f"S3: {operation} of {path!r}: no such bucket or key") from None
    except _transport_errors() as exc:
        status = _http_status(exc)
        refused = status is not None and status < 500
        if write and not refused and not _never_sent(exc):
            raise OutcomeUnknownError(
                f"S3: {operation} of {path!r} may or may not have happened: {type(exc).__name__}: {exc}"
            ) from exc
        raise StorageError(f"S3: {operation} of {path!r} failed: {type(exc).__name__}: {exc}") from exc


class S3ChunkStorage(ChunkStorage):
    """Chunks as S3 objects under ``s3://bucket/prefix``."""

    appendable = False

    def __init__(self, root: str, *, single_writer: bool = False, **storage_options: Any):
        import s3fs  # the caller has checked the extra is installed

        self.root = root.strip("/")
        super().__init__("s3://" + self.root)
        self.bucket = self.root.split("/", 1)[0]
        # Listings must be live: another process's append is only seen through a fresh LIST.
        storage_options = {**storage_options, "use_listings_cache": False}
        self.fs = s3fs.S3FileSystem(**storage_options)
        self.single_writer = single_writer
        self._endpoint = str(storage_options.get("endpoint_url") or storage_options.get("client_kwargs", {}).get("endpoint_url") or "aws")

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}".rstrip("/")

    # -- reading -------------------------------------------------------------------------------
    def list_files(self, directory: str) -> dict[str, int]:
        base = self._abs(directory)
        try:
            with s3_errors("listing", base, missing=True):
                found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return relative_paths(base, ((path, info["size"]) for path, info in found.items()))

    def read(self, path: str, start: int, end: int) -> bytes:
        with s3_errors("read", self._abs(path), missing=True):
            try:
                return self.fs.cat_file(self._abs(path), start=start, end=end)
            except FileNotFoundError:
                raise
            except OSError:
                # S3 refuses a range that starts past the end (416); the other backends give b"".
                if start >= self.fs.size(self._abs(path)):  # a missing file raises FileNotFoundError here
                    return b""
                raise

    def exists(self, path: str) -> bool:
        with s3_errors("exists", self._abs(path)):
            return self.fs.exists(self._abs(path))

    # -- writing -------------------------------------------------------------------------------
    def create(self, path: str, data: bytes) -> None:
        self._ensure_exclusive_create()
        with s3_errors("create", self._abs(path), write=True):
            try:
                self.fs.pipe_file(self._abs(path), bytes(data), mode="create")
            except FileExistsError:
                raise ChunkExistsError(self._abs(path)) from None

    def put_marker(self, path: str) -> None:
        with s3_errors("marker", self._abs(path), write=True):
            self.fs.pipe_file(self._abs(path), b"")

    def delete(self, paths: list[str]) -> None:
        if paths:
            with s3_errors("delete", self._abs(paths[0]), write=True), contextlib.suppress(FileNotFoundError):
                self.fs.rm([self._abs(p) for p in paths])

    def remove_directory(self, directory: str) -> None:
        with s3_errors("delete", self._abs(directory), write=True), contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._abs(directory), recursive=True)

    def _ensure_exclusive_create(self) -> None:
        key = (self._endpoint, self.bucket)
        with _PROBED_GUARD:
            refused = _PROBED.get(key)
            if refused is None:
                probe_path = f"{self.root}/.attrindex-probe-{uuid.uuid4().hex}"
                try:
                    with s3_errors("probe", probe_path, missing=True):
                        refused = probe_exclusive_create(self.fs, probe_path)
                except FileNotFoundError as exc:
                    raise StorageError(f"S3 bucket {self.bucket!r} does not exist at {self._endpoint}") from exc
                _PROBED[key] = refused
                _log.info("S3 endpoint %s, bucket %r: an exclusive create of an existing object is %s", self._endpoint,
                          self.bucket, "refused (conditional writes work)" if refused else "ACCEPTED (no conditional writes)")
        if not refused and not self.single_writer:
            raise ExclusiveCreateUnsupportedError(
                f"the S3 endpoint {self._endpoint} accepted an exclusive create (If-None-Match: *) of an "
                f"object that already existed in bucket {self.bucket!r}, so compare-and-append cannot be "
                "made safe there; use a store that supports conditional writes, or open the storage with "
                "single_writer=True if exactly one process ever writes each segment"
            )
