"""Where the last chunk of a segment ends, on a backend whose appends can tear (local disk).

The committed end of such a chunk is the end of the chain of whole, valid frames from its start
(framing.py). Past it lie the zeros the chunk was pre-written with, or, after a crash, the bytes
of the write that was torn. ``look_at_tail`` reads them and tells which:

* zeros (or nothing): the chain's end is the chunk's end;
* bytes that are not zeros, with no valid frame among them, that begin as a frame written there
  begins (``Framing.may_be_torn``): the newest write was torn. The end stays where the chain
  stops, and the torn bytes are reported (the next append zeroes them);
* a valid frame after such bytes, bytes that no torn write can leave, or torn-looking bytes in a
  file shorter than the zeros its backend keeps after committed frames say it must be (it was cut
  short: a truncation reaching back into older frames looks like a torn newest write otherwise):
  damage below committed data. The end is the end of the last valid frame, or of the last byte that is not zero, so the
  layers above meet the damaged bytes where they read them and report them
  (``CorruptDataError``), as for any damage.

A handle that has looked once remembers where the chain ended and the bytes before that end
(``TailLook.mark``); its next look reads on from there (one small read when nothing was
appended), after checking that those bytes are still there (the chunk was not replaced).
"""

from __future__ import annotations

from typing import Callable

import attrs

from .errors import RetriesExhaustedError, StorageError
from .framing import Framing

#: Bytes before a chain's end that a later look compares to tell it is the same chunk.
MARK_BYTES = 64
#: The first read of a look that continues from a known end (pre-written zeros stop it at once; a
#: frame longer than what was read makes it read on).
PROBE_BYTES = 512
#: Looks by a reader (no lock) that found damage must find the same twice in a row (a write in
#: flight can look like damage for an instant): at most this many.
MAX_DAMAGE_LOOK_ATTEMPTS = 4


@attrs.frozen
class TailLook:
    """What one look found at the end of a chunk (positions are segment positions)."""

    end: int  #: the committed end of the chunk
    #: ``(start, end)`` of a torn write's bytes after ``end`` (not committed; the next append into
    #: the chunk zeroes them), or ``None``
    torn: tuple[int, int] | None = None
    torn_bytes: bytes = b""
    #: pre-written zeros follow ``end``: the chunk is still the one appended to (a chunk that is
    #: rolled past is trimmed to its end first)
    zeros_after: bool = False
    mark: bytes = b""  #: the bytes just before ``end`` (at most ``MARK_BYTES``)
    #: the segment position of the first invalid frame below ``end`` (damage), if any
    damaged_at: int | None = None


def look_at_tail(read: Callable[[int, int], bytes], start: int, framing: Framing, *,
                 since: TailLook | None = None, locked: bool = False,
                 zeros_kept: Callable[[int], int] | None = None) -> TailLook:
    """Look at the end of the chunk that starts at segment position ``start``.

    ``read(a, b)`` returns the chunk's bytes ``[a, b)`` (chunk offsets; shorter at the end of the
    file). ``since``: this handle's previous look at the same chunk, to go on from. ``locked``:
    the caller holds the writers' lock, so no write is in flight. ``zeros_kept(end)``: how many
    bytes the file keeps at least past committed frames ending at chunk offset ``end``
    (``ChunkStorage.zeros_kept_after``); ``None``: nothing is known.
    """
    origin = start
    if since is not None:
        found = _look_on(read, start, framing, since)
        if isinstance(found, TailLook):
            return found
        if found is not None:
            origin = found
    previous = None
    for _attempt in range(MAX_DAMAGE_LOOK_ATTEMPTS):
        found = _look_whole(read, start, framing, origin, zeros_kept)
        if found.damaged_at is None or locked or found == previous:
            return found
        previous = found
    raise RetriesExhaustedError(f"the chunk at segment position {start} kept changing while its end was read: "
                                f"{MAX_DAMAGE_LOOK_ATTEMPTS} looks found different damage each time")


def _look_on(read: Callable[[int, int], bytes], start: int, framing: Framing, since: TailLook) -> TailLook | int | None:
    """Go on from ``since``: the look, or the position from which the rest of the chunk must be
    looked at whole (what follows the chain there is neither zeros nor the end of the file), or
    ``None`` when the bytes before the known end changed (the chunk is not the one looked at)."""
    known = since.end - start
    mark = since.mark
    if len(mark) > known:
        return None
    data = read(known - len(mark), known + PROBE_BYTES)
    if data[:len(mark)] != mark:
        return None
    position, buffer, window = since.end, data[len(mark):], PROBE_BYTES
    at_eof = len(buffer) < window
    while True:
        if buffer[:1] != b"\0":  # (zeros at once: nothing appended, a lone writer's usual look)
            end = framing.chain_end(buffer, position)
            if end > position:
                buffer, position = buffer[end - position:], end
        if not buffer:
            if at_eof:
                return _clean(read, start, position, since, zeros_after=False)
        elif buffer[0] == 0:
            # A frame never starts with a zero byte: the chain ends at the pre-written zeros. (What
            # lies further on was zeros when this chunk was first looked at whole, and only
            # appends at the chain's end have written since: a killed writer leaves a prefix.)
            return _clean(read, start, position, since, zeros_after=True)
        elif at_eof:
            return position  # bytes that are not a whole frame, to the end of the file
        window = max(window * 2, len(buffer) * 2)  # a frame longer than what was read: read on
        buffer = read(position - start, position - start + window)
        at_eof = len(buffer) < window


def _clean(read: Callable[[int, int], bytes], start: int, end: int, since: TailLook, *, zeros_after: bool) -> TailLook:
    mark = since.mark if end == since.end else _mark_at(read, start, end)  # (nothing appended: the same bytes)
    return TailLook(end, zeros_after=zeros_after, mark=mark)


def _mark_at(read: Callable[[int, int], bytes], start: int, end: int) -> bytes:
    low = max(end - MARK_BYTES, start)
    return read(low - start, end - start) if end > low else b""


def _look_whole(read: Callable[[int, int], bytes], start: int, framing: Framing, position: int,
                zeros_kept: Callable[[int], int] | None = None) -> TailLook:
    """Read the chunk from ``position`` (where a frame starts) to the end of its file and judge."""
    data = read(position - start, 1 << 62)
    end = framing.chain_end(data, position)
    damaged = None
    stored = end + len(data[end - position:].rstrip(b"\0"))
    if stored > end:
        last = framing.last_frame_end(data[end - position:], end)
        if last is not None and last > end:  # a valid frame after bytes that are not: damage
            damaged, end = end, last
            stored = end + len(data[end - position:].rstrip(b"\0"))
    if stored > end and not framing.may_be_torn(data[end - position:stored - position], end):
        # No crash leaves these bytes: damage, which the layers above meet below the end.
        damaged, end = (end if damaged is None else damaged), stored
    elif stored > end and zeros_kept is not None and \
            position + len(data) < end + zeros_kept(end - start):
        # A torn write never shortens the file, and it had that much past the chain's end before
        # the write began: the file was cut short, below frames that were committed.
        damaged, end = (end if damaged is None else damaged), stored
    torn = (end, stored) if stored > end else None
    return TailLook(end, torn, bytes(data[end - position:stored - position]) if torn else b"",
                    zeros_after=len(data) > stored - position and torn is None,
                    mark=_mark_at(read, start, end), damaged_at=damaged)
