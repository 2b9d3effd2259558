"""Code run in child processes by the storage tests (``python -m tests.storage_workers ...``)."""

from __future__ import annotations

import sys
import time

from storage_adapters import ChunkStorage, open_storage

from .framed import frame, open_segment


def pattern(offset: int, length: int) -> bytes:
    """``length`` bytes for position ``offset`` on: each byte names its offset."""
    return bytes((offset + i) % 251 for i in range(length))


class Stream:
    """The bytes a segment holds after a first append of ``piece(0, 0)`` and ``churn``'s appends
    (one writer: each append's bytes follow from where it lands and its step number)."""

    def __init__(self, storage: ChunkStorage):
        self.storage = storage
        self._data = bytearray()
        self._step = 0

    def piece(self, position: int, step: int) -> bytes:
        """What append number ``step`` stores at ``position``: a payload of pattern bytes, framed
        where the backend needs it."""
        return frame(self.storage, pattern(position, 5 + step % 23), position)

    def read(self, offset: int, length: int) -> bytes:
        """The segment's bytes ``[offset, offset + length)``."""
        while len(self._data) < offset + length:
            self._data += self.piece(len(self._data), self._step)
            self._step += 1
        return bytes(self._data[offset:offset + length])


def churn(root: str, name: str, seconds: float, rolling_size: int) -> None:
    """Append the ``Stream``'s pieces after its first and truncate close behind the end, in a loop,
    for ``seconds``."""
    storage = open_storage(root)
    seg, stream = open_segment(storage, name, rolling_size=rolling_size), Stream(storage)
    deadline, step = time.monotonic() + seconds, 1
    while time.monotonic() < deadline:
        length = seg.length
        seg.append(stream.piece(length, step), expected_offset=length)
        if step % 3 == 0:
            seg.truncate(max(seg.start_offset, seg.length - 8))
        step += 1
    print(step, flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "churn":
        churn(args[0], args[1], float(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown command {command!r}")
