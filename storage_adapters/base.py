"""The ``ChunkStorage`` interface: the few file operations a rolling segment needs from a backend.

Paths are relative to the storage's root and use ``/``. Two kinds of backend exist:

* *appendable* (local disk, memory): a chunk file is appended to in place; ``lock`` serialises
  writers of one directory across threads and processes, and ``committed_size`` is the size of a
  chunk as of its last completed ``append`` (bytes of a torn append are never counted);
* *object* (S3): a chunk is written once by an exclusive ``create``, which is what makes
  compare-and-append safe there.

Errors: every method raises only ``FileNotFoundError`` (where its docstring says so),
``ChunkExistsError`` or a ``StorageError`` subclass: ``StorageFullError`` (no space; nothing was
written) and ``OutcomeUnknownError`` (a write that may or may not have happened) among them. No raw
``OSError`` or client-library error escapes a backend.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Iterator


class ChunkStorage(abc.ABC):
    """A directory tree of immutable or append-only chunk files under one root URL."""

    #: True when ``append``/``lock``/``committed_size`` are available (chunks grow in place).
    appendable: bool = False

    def __init__(self, url: str):
        self.url = url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- reading -------------------------------------------------------------------------------
    @abc.abstractmethod
    def list_files(self, directory: str) -> dict[str, int]:
        """Every file below ``directory`` (recursively) as ``{path relative to directory: size}``.

        A missing directory is empty. Sizes are raw sizes; for appendable backends only
        ``committed_size`` tells how much of a chunk is valid.
        """

    @abc.abstractmethod
    def read(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file, fetched as a ranged read. Missing file: ``FileNotFoundError``."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file exists."""

    # -- writing -------------------------------------------------------------------------------
    @abc.abstractmethod
    def create(self, path: str, data: bytes) -> None:
        """Write a whole new file, durably; raise ``ChunkExistsError`` if it already exists."""

    @abc.abstractmethod
    def put_marker(self, path: str) -> None:
        """Create an empty file durably (its name is its content); an existing one is kept."""

    @abc.abstractmethod
    def delete(self, paths: list[str]) -> None:
        """Delete files (and whatever sidecar files the backend keeps for them); missing ones are ignored."""

    @abc.abstractmethod
    def remove_directory(self, directory: str) -> None:
        """Delete a directory and everything below it; a missing one is ignored."""

    # -- appendable backends only ----------------------------------------------------------------
    def lock(self, directory: str) -> contextlib.AbstractContextManager[None]:
        """Exclusive lock over the writers of ``directory``, across threads and processes."""
        raise NotImplementedError(f"{type(self).__name__} has no in-place append")

    def committed_size(self, path: str) -> int:
        """Size of a chunk as of its last completed append. Missing chunk: ``FileNotFoundError``."""
        raise NotImplementedError(f"{type(self).__name__} has no in-place append")

    def append(self, path: str, position: int, data: bytes) -> None:
        """Write ``data`` at ``position`` (the committed size) and commit it durably; call under ``lock``.

        Bytes past ``position`` left by a torn earlier append are overwritten. The chunk is created if
        missing (then ``position`` must be 0).
        """
        raise NotImplementedError(f"{type(self).__name__} has no in-place append")

    def close(self) -> None:
        """Release what the backend holds (connections, descriptors)."""

    def __enter__(self) -> "ChunkStorage":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def relative_paths(root: str, found: Iterator[tuple[str, int]]) -> dict[str, int]:
    """Turn ``(absolute path, size)`` pairs under ``root`` into ``{relative path: size}``."""
    prefix = root.rstrip("/") + "/"
    return {path[len(prefix):]: size for path, size in found if path.startswith(prefix)}
