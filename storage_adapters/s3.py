"""S3 chunk storage through s3fs: every chunk is one immutable object made by an exclusive create.

Exclusive create is ``PutObject`` with ``If-None-Match: *`` (s3fs ``mode="create"``); S3 refuses it
with 412 when the key exists, which is what makes compare-and-append safe across processes. Some
S3-compatible stores accept the header and ignore it, so before the first write to a bucket this
module checks, once per process, that an exclusive create of an existing object is refused.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from .base import ChunkStorage, relative_paths
from .errors import ChunkExistsError, ExclusiveCreateUnsupportedError, StorageError

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
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return relative_paths(base, ((path, info["size"]) for path, info in found.items()))

    def read(self, path: str, start: int, end: int) -> bytes:
        try:
            return self.fs.cat_file(self._abs(path), start=start, end=end)
        except OSError:
            # S3 refuses a range that starts past the end (416); the other backends give b"".
            if start >= self.fs.size(self._abs(path)):  # a missing file raises FileNotFoundError here
                return b""
            raise

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._abs(path))

    # -- writing -------------------------------------------------------------------------------
    def create(self, path: str, data: bytes) -> None:
        self._ensure_exclusive_create()
        try:
            self.fs.pipe_file(self._abs(path), bytes(data), mode="create")
        except FileExistsError:
            raise ChunkExistsError(self._abs(path)) from None

    def put_marker(self, path: str) -> None:
        self.fs.pipe_file(self._abs(path), b"")

    def delete(self, paths: list[str]) -> None:
        if paths:
            try:
                self.fs.rm([self._abs(p) for p in paths])
            except FileNotFoundError:
                pass

    def remove_directory(self, directory: str) -> None:
        try:
            self.fs.rm(self._abs(directory), recursive=True)
        except FileNotFoundError:
            pass

    def _ensure_exclusive_create(self) -> None:
        key = (self._endpoint, self.bucket)
        with _PROBED_GUARD:
            refused = _PROBED.get(key)
            if refused is None:
                probe_path = f"{self.root}/.attrindex-probe-{uuid.uuid4().hex}"
                try:
                    refused = probe_exclusive_create(self.fs, probe_path)
                except FileNotFoundError as exc:
                    raise StorageError(f"S3 bucket {self.bucket!r} does not exist at {self._endpoint}") from exc
                _PROBED[key] = refused
        if not refused and not self.single_writer:
            raise ExclusiveCreateUnsupportedError(
                f"the S3 endpoint {self._endpoint} accepted an exclusive create (If-None-Match: *) of an "
                f"object that already existed in bucket {self.bucket!r}, so compare-and-append cannot be "
                "made safe there; use a store that supports conditional writes, or open the storage with "
                "single_writer=True if exactly one process ever writes each segment"
            )
