"""Chunk storage that counts bytes and keeps none: experiments measure storage without holding it.

The B+tree's page cache must then hold every live page (``cache_bytes`` large enough), and any
read that reaches storage is an error: it would mean the experiment depends on dead data.
"""

from __future__ import annotations

import contextlib

from storage_adapters import ChunkStorage


class NullChunkStorage(ChunkStorage):
    """An appendable backend that records file sizes only (its appends are whole, like memory's)."""

    appendable = True

    def __init__(self):
        super().__init__("null://")
        self.sizes: dict[str, int] = {}

    def list_files(self, directory):
        prefix = directory.rstrip("/") + "/"
        return {path[len(prefix):]: size for path, size in self.sizes.items() if path.startswith(prefix)}

    def read(self, path, start, end):
        raise AssertionError(f"the experiment read {path}[{start}:{end}] from storage; the page cache is too small")

    def exists(self, path):
        return path in self.sizes

    def size(self, path):
        if path not in self.sizes:
            raise FileNotFoundError(path)
        return self.sizes[path]

    def create(self, path, data):
        self.sizes[path] = len(data)

    def put_marker(self, path):
        self.sizes.setdefault(path, 0)

    def delete(self, paths):
        for path in paths:
            self.sizes.pop(path, None)

    def remove_directory(self, directory):
        for path in list(self.list_files(directory)):
            self.sizes.pop(f"{directory}/{path}", None)

    @contextlib.contextmanager
    def lock(self, directory):
        yield

    def trimmed(self, path):
        return False  # one writer, one view: nobody rolls past its chunks behind it

    def trim(self, path, size):
        pass  # nothing is kept past a chunk's end

    def append(self, path, position, data, *, clear_to=0):
        self.sizes[path] = position + len(data)
