"""Raw ``RollingSegment`` users in the tests, on every backend.

Where an append can tear (``storage.torn_appends``: local disk) a chunk keeps no commit record:
its committed end is the end of the chain of frames appended to it (storage_adapters/framing.py),
so a segment there needs a framing and its appends must be whole frames. Memory and S3 appends
are whole or absent: there a test's bytes are stored as they are. These helpers give a test the
bytes each backend stores, so that its offsets and lengths follow from them.
"""

from __future__ import annotations

from storage_adapters import DEFAULT_ROLLING_SIZE, ChunkStorage, RollingSegment
from storage_adapters.framing import LengthChecksumFraming

FRAMING = LengthChecksumFraming()


def framing_for(storage: ChunkStorage) -> LengthChecksumFraming | None:
    """The framing a raw segment of ``storage`` is opened with (``None`` where appends cannot tear)."""
    return FRAMING if storage.torn_appends else None


def open_segment(storage: ChunkStorage, name: str, rolling_size: int = DEFAULT_ROLLING_SIZE) -> RollingSegment:
    """``RollingSegment(storage, name, rolling_size)``, framed where ``storage`` needs it."""
    return RollingSegment(storage, name, rolling_size, framing=framing_for(storage))


def frame(storage: ChunkStorage, payload: bytes, position: int = 0) -> bytes:
    """What is appended for ``payload`` at segment position ``position``: one frame where appends
    can tear (``RollingSegment`` places it where it lands), else ``payload`` itself."""
    return LengthChecksumFraming.frame(payload, position) if storage.torn_appends else payload


def overhead(storage: ChunkStorage) -> int:
    """Bytes a frame adds to its payload on ``storage`` (0 where nothing is framed)."""
    return len(frame(storage, b""))


def pieces(storage: ChunkStorage, payloads: list[bytes], start: int = 0) -> list[bytes]:
    """The bytes stored for ``payloads`` appended one after another from position ``start``: each
    framed at the position it lands at (so a read returns exactly them)."""
    out, position = [], start
    for payload in payloads:
        out.append(frame(storage, payload, position))
        position += len(out[-1])
    return out


def offsets(stored: list[bytes], start: int = 0) -> list[int]:
    """Where each of ``stored`` (appended one after another from ``start``) begins, and the end."""
    found = [start]
    for piece in stored:
        found.append(found[-1] + len(piece))
    return found


def payloads(storage: ChunkStorage, data: bytes, position: int = 0) -> list[bytes]:
    """The payloads of the frames in ``data`` read from position ``position`` of a segment of
    ``storage``, checked to be whole, valid and back to back (``[data]`` where nothing is framed)."""
    if not storage.torn_appends:
        return [data]
    assert FRAMING.chain_end(data, position) == position + len(data), "not a chain of whole, valid frames"
    return LengthChecksumFraming.payloads(data)
