"""Reading a segment's chunk files behind the store's back, as the fault tests do.

On local disk the last chunk of a segment is pre-written with zeros past its end, so a chunk file
is longer than its data: a test that reads or damages a chunk raw stops at the chunk's committed
bytes, which the segment's own view tells (never the file's size).
"""

from __future__ import annotations

import os

from storage_adapters import RollingSegment, open_storage
from storage_adapters.rolling import SEGMENT_SUFFIX

from attrindex.btree.framing import TREE_FRAMING
from attrindex.log.framing import LOG_FRAMING


def framing_of(name: str):
    """The framing a rolling segment called ``name`` is opened with: a log (``…/_log``) holds
    record batches, anything else here a B+tree."""
    return LOG_FRAMING if name.rsplit("/", 1)[-1] == "_log" else TREE_FRAMING


def committed_chunks(storage, name: str) -> list[tuple[str, int, bytes]]:
    """``(chunk name, start, committed bytes)`` of every chunk of the rolling segment ``name``
    (``"s/_log"``, ``"s/_attributes"``, …) on ``storage``, in order."""
    with RollingSegment(storage, name, framing=framing_of(name)) as segment:
        chunks = segment.chunks()
    return [(c.name, c.start, storage.read(f"{name}{SEGMENT_SUFFIX}/{c.name}", 0, c.stored)) for c in chunks]


def committed_length(path: str) -> int:
    """The committed bytes of the local chunk file ``path`` (``…/NAME.seg/CHUNK``): where the
    segment's view ends it."""
    directory, chunk = os.path.split(path)
    parent, folder = os.path.split(directory)
    assert folder.endswith(SEGMENT_SUFFIX), path
    name = folder[:-len(SEGMENT_SUFFIX)]
    with open_storage(parent) as storage, RollingSegment(storage, name, framing=framing_of(name)) as segment:
        (info,) = [c for c in segment.chunks() if c.name == chunk]
    return info.stored


def committed(path: str) -> bytes:
    """The committed bytes of the local chunk file ``path`` (without the zeros past its end)."""
    length = committed_length(path)
    with open(path, "rb") as f:
        return f.read(length)
