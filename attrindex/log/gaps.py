"""The recorded gaps of a segment's log: byte ranges an explicit repair gave up, one empty marker
file each, which readers step over while they are in force.

A marker is named ``<20-digit start>-<20-digit end>``, plus ``.<20-digit generation>`` when the
chunk holding the range was a replacement of that generation. It is in force while the chunk
holding its start is still of that generation: once a later replacement covers the range (log
compaction rewrites the batches around a gap), the marker is void, since a kept batch may now
start there. Holes left by chunk replacements are not markers: the byte stream reports them.
"""

from __future__ import annotations

import re

from storage_adapters import ChunkStorage, RollingSegment
from storage_adapters.rolling import chunk_name

__all__ = ["GapMarkers"]

_GAP_NAME = re.compile(r"(\d{20})-(\d{20})(?:\.(\d{20}))?")


class GapMarkers:
    """The gap markers in ``directory`` of ``storage``, for the log bytes ``log_bytes``.

    ``starts`` maps each known gap's start to ``(end, generation, marker name)``; it is only ever
    changed in place, so a scan may hold it to test a batch position cheaply (``at in starts``)
    before asking ``in_force``."""

    def __init__(self, storage: ChunkStorage, directory: str, log_bytes: RollingSegment):
        self.storage = storage
        self.directory = directory
        self.log_bytes = log_bytes
        self.starts: dict[int, tuple[int, int, str]] = {}
        self.load()  # only a repair (writers stopped) adds gaps, so loading once is enough

    def load(self) -> None:
        """Add the markers stored now to ``starts``."""
        for name in self.storage.list_files(self.directory):
            match = _GAP_NAME.fullmatch(name)
            if match and int(match[2]) > int(match[1]):  # an empty range would not move a scan
                self.starts[int(match[1])] = (int(match[2]), int(match[3] or 0), name)

    def in_force(self, position: int) -> int | None:
        """End of the recorded gap starting at ``position`` if it is in force: the chunk holding it
        is still of the generation it was recorded in (a later replacement rewrote those bytes)."""
        gap = self.starts.get(position)
        if gap is None:
            return None
        chunk = self.log_bytes.chunk_at(position)
        return gap[0] if chunk is not None and chunk.generation == gap[1] else None

    def end_at(self, position: int) -> int | None:
        """End of the hole holding ``position`` or of the recorded gap in force starting there
        (reloading the markers if none is known there), else None."""
        hole = self.log_bytes.hole_at(position)
        if hole is not None:
            return hole[1]
        if position not in self.starts:
            self.load()
        return self.in_force(position)

    def all_in_force(self) -> dict[int, int]:
        """Every recorded gap in force in the byte stream's view, ``{start: end}`` (reloaded)."""
        self.starts.clear()
        self.load()
        return {start: end for start, (end, _gen, _name) in self.starts.items() if self.in_force(start) is not None}

    def record(self, start: int, end: int) -> None:
        """Store the marker of ``[start, end)`` (within one chunk of the byte stream's view)."""
        chunk = self.log_bytes.chunk_at(start)
        generation = chunk.generation if chunk is not None else 0
        name = f"{chunk_name(start)}-{chunk_name(end)}" + (f".{chunk_name(generation)}" if generation else "")
        self.storage.put_marker(f"{self.directory}/{name}")
        self.starts[start] = (end, generation, name)

    def paths_below(self, position: int) -> list[str]:
        """The marker files of the gaps that end at or below ``position``."""
        return [f"{self.directory}/{name}" for _start, (end, _gen, name) in self.starts.items() if end <= position]

    def forget_below(self, position: int) -> None:
        """Drop the gaps that end at or below ``position`` (truncated away)."""
        for start in [s for s, (end, _gen, _name) in self.starts.items() if end <= position]:
            del self.starts[start]
