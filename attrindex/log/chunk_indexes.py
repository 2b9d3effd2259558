"""The sparse index of each chunk of a segment's log (``ChunkSummary``): building one from the
batches a chunk holds, and the index files of sealed chunks, stored best effort beside the data
and loaded back checked against their chunk. Index files are derived data: a missing or damaged
one is rebuilt from the chunk (the log does that scan).
"""

from __future__ import annotations

import contextlib

from storage_adapters import ChunkStorage, RollingSegment

from ..errors import ChunkExistsError, CorruptDataError, InvalidInputError, StorageError
from .batch.chain import iter_batches
from .batch.header import BatchHeader
from .sparse_index import (MIN_TIMESTAMP, ChunkIndexBuilder, ChunkSummary, CorruptIndexError, decode_chunk_index,
                           encode_chunk_index)

__all__ = ["IndexFiles", "index_batch", "summarize_replacement"]


def index_batch(builder: ChunkIndexBuilder, at: int, header: BatchHeader) -> None:
    """Add the batch at log byte ``at`` to a chunk's sparse index builder."""
    builder.add(at - builder.chunk_start, header.size, header.base_offset, header.record_count,
                header.max_timestamp if header.record_count else MIN_TIMESTAMP)


def summarize_replacement(segment: str, start: int, end: int, data: bytes, base: int, interval: int) -> ChunkSummary:
    """The summary of a replacement chunk holding ``data`` from log byte ``start`` and a hole up to
    ``end``, its records numbered from ``base`` on; ``InvalidInputError`` unless ``data`` is whole
    valid batches (sealed for where they lie) with rising offsets."""
    if not 0 <= start < end or len(data) > end - start:
        raise InvalidInputError(f"segment {segment!r}: replace_range needs start < end and at most "
                                f"end - start bytes; got [{start}, {end}) with {len(data)} bytes")
    builder = ChunkIndexBuilder(start, interval, next_offset=base)
    whole, next_offset = 0, base  # bytes of whole batches so far; the offset the next must reach
    try:
        for pos, header in iter_batches(data, position=start, segment=segment):
            if header.base_offset < next_offset:
                raise InvalidInputError(f"segment {segment!r}: replacement data at byte {pos}: base "
                                        f"offset {header.base_offset} below {next_offset}")
            index_batch(builder, start + pos, header)
            whole, next_offset = pos + header.size, header.next_offset
    except CorruptDataError as exc:
        raise InvalidInputError(f"segment {segment!r}: replacement data is not valid record "
                                f"batches: {exc}") from None
    if whole < len(data):
        raise InvalidInputError(f"segment {segment!r}: replacement data at byte {whole}: an incomplete batch")
    if len(data) < end - start:
        builder.add(len(data), end - start - len(data), next_offset, 0, MIN_TIMESTAMP)
    return builder.summary()


class IndexFiles:
    """The index files in ``directory`` of ``storage``, one per sealed chunk of ``log_bytes`` that
    holds more than one batch, named like the chunk.

    The files are listed once, at creation: a chunk that was sealed then and had none is known to
    have none, so a read of it is not asked of storage (object stores bill for each)."""

    def __init__(self, storage: ChunkStorage, directory: str, log_bytes: RollingSegment, segment: str):
        self.storage = storage
        self.directory = directory
        self.segment = segment
        self._names = set(storage.list_files(directory))
        #: the log length when the files were listed, and its chunks then (a replacement made
        #: later may have a file)
        self._listed_at = log_bytes.length
        self._listed_chunks = {c.name for c in log_bytes.chunks()}

    def path(self, name: str) -> str:
        return f"{self.directory}/{name}"

    def store(self, summary: ChunkSummary, name: str) -> None:
        """Store the index of chunk ``name``, best effort (a reader without write access still works)."""
        with contextlib.suppress(ChunkExistsError, StorageError, OSError):
            self.storage.create(self.path(name), encode_chunk_index(summary))
            self._names.add(name)

    def load(self, name: str, start: int, end: int) -> ChunkSummary | None:
        """The stored index of chunk ``name`` holding log bytes ``[start, end)``, or None if it has
        none, or a damaged one (which is deleted: the caller rebuilds it)."""
        path = self.path(name)
        try:
            if name not in self._names and end < self._listed_at and name in self._listed_chunks:
                return None  # sealed when the index files were listed, and had none
            summary = decode_chunk_index(self.storage.read(path, 0, 1 << 30), chunk_start=start, segment=self.segment)
            if summary.size != end - start:
                raise CorruptIndexError(f"index of chunk {start} covers {summary.size} bytes, chunk has "
                                        f"{end - start}", segment=self.segment, offset=start)
            return summary
        except FileNotFoundError:
            return None
        except CorruptIndexError:
            self.storage.delete([path])
            self._names.discard(name)
            return None
