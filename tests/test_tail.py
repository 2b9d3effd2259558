"""The end of a chunk appended to in place (storage_adapters/tail.py), judged from its bytes alone:
pre-written zeros, a torn newest write, or damage below committed frames. Pure: a chunk is bytes."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from storage_adapters.errors import StorageError
from storage_adapters.framing import LengthChecksumFraming
from storage_adapters.tail import MARK_BYTES, PROBE_BYTES, TailLook, look_at_tail

FRAMING = LengthChecksumFraming()


def _reader(chunk: bytes):
    return lambda a, b: bytes(chunk[max(a, 0):b])


def _frames(payloads: list[bytes], start: int) -> tuple[bytes, list[int]]:
    """The frames of ``payloads`` placed from ``start``; and where each frame ends."""
    data, ends = b"", []
    for payload in payloads:
        data += FRAMING.frame(payload, start + len(data))
        ends.append(start + len(data))
    return data, ends


payload_lists = st.lists(st.binary(min_size=0, max_size=300), min_size=0, max_size=12)
starts = st.integers(0, 1 << 40)


@settings(max_examples=200, deadline=None)
@given(payloads=payload_lists, start=starts, zeros=st.integers(0, 3 * PROBE_BYTES))
def test_frames_then_zeros_end_where_the_frames_end(payloads, start, zeros):
    data, _ends = _frames(payloads, start)
    look = look_at_tail(_reader(data + bytes(zeros)), start, FRAMING)
    assert look.end == start + len(data) and look.torn is None and look.damaged_at is None
    assert look.zeros_after == (zeros > 0)
    assert look.mark == data[-MARK_BYTES:]


@settings(max_examples=200, deadline=None)
@given(payloads=payload_lists, start=starts, torn=st.binary(min_size=1, max_size=400), cut=st.data(),
       zeros=st.integers(0, 100))
def test_a_torn_newest_write_is_cut_and_reported(payloads, start, torn, cut, zeros):
    data, _ends = _frames(payloads, start)
    whole = FRAMING.frame(torn, start + len(data))
    prefix = whole[:cut.draw(st.integers(1, len(whole) - 1))]  # a prefix: what a killed writer leaves
    look = look_at_tail(_reader(data + prefix + bytes(zeros)), start, FRAMING)
    if zeros >= len(whole) - len(prefix) and not whole[len(prefix):].strip(b"\0"):
        assert look.end == start + len(data) + len(whole)  # the bytes not written were zeros anyway
        return
    kept = prefix.rstrip(b"\0")
    assert look.end == start + len(data) and look.damaged_at is None
    assert look.torn == (start + len(data), start + len(data) + len(kept)) and look.torn_bytes == kept


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(st.binary(min_size=1, max_size=300), min_size=2, max_size=10), start=starts,
       pick=st.data())
def test_damage_before_a_valid_frame_is_damage_not_a_torn_tail(payloads, start, pick):
    data, ends = _frames(payloads, start)
    i = pick.draw(st.integers(0, len(payloads) - 2))  # any frame but the newest
    begin = ends[i - 1] if i else start
    at = pick.draw(st.integers(begin, ends[i] - 1)) - start
    damaged = data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:]
    look = look_at_tail(_reader(damaged + bytes(64)), start, FRAMING)
    assert look.end == ends[-1]  # the frames after the damage stay committed: the layers above report it
    assert look.damaged_at is not None and begin <= look.damaged_at <= ends[i]
    assert look.torn is None


def test_damage_in_the_newest_frame_alone_is_cut_as_torn():
    # The documented limit of a commit without a record: with nothing valid after it, a damaged
    # newest frame is indistinguishable from a torn write.
    data, ends = _frames([b"a" * 50, b"b" * 50], 100)
    damaged = data[:-3] + b"\xff" + data[-2:]
    look = look_at_tail(_reader(damaged), 100, FRAMING)
    assert look.end == ends[0] and look.torn == (ends[0], ends[1]) and look.damaged_at is None


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=10), start=starts,
       pick=st.data())
def test_a_file_cut_short_inside_a_frame_is_damage_not_a_torn_write(payloads, start, pick):
    # A torn write never shortens the file, which went on past the chain's end for at least what
    # the backend keeps there (``zeros_kept``): the same torn-looking bytes at the end of a file
    # cut short are damage, reported; followed by what the backend keeps, a crash's torn write.
    data, ends = _frames([p.replace(b"\0", b"\1") for p in payloads], start)  # (zeros end a torn write)
    i = pick.draw(st.integers(0, len(payloads) - 1))  # any frame, the newest too
    begin = ends[i - 1] if i else start
    cut = pick.draw(st.integers(begin + 1, ends[i] - 1)) - start
    short = data[:cut]
    kept = pick.draw(st.integers(start + cut - begin + 1, 5000))  # more than the file has after the chain
    stored = start + len(short.rstrip(b"\0"))
    look = look_at_tail(_reader(short), start, FRAMING, zeros_kept=lambda _end: kept)
    assert look.damaged_at == begin and look.end == stored and look.torn is None
    gap = begin + kept - (start + cut)  # the fewest zeros after the cut that a crash leaves
    crash = look_at_tail(_reader(short + bytes(max(gap, 0))), start, FRAMING, zeros_kept=lambda _end: kept)
    assert crash.end == begin and crash.torn == (begin, stored) and crash.damaged_at is None
    assert crash.torn_bytes == short[begin - start:].rstrip(b"\0")


def test_a_frame_placed_for_another_position_is_not_a_frame():
    frame = FRAMING.frame(b"payload", 0)
    assert FRAMING.chain_end(frame, 4096) == 4096  # stale bytes never pass for data
    stale = look_at_tail(_reader(frame), 4096, FRAMING)
    assert stale.damaged_at == 4096 and stale.torn is None  # nor for a torn write: damage, reported above
    assert look_at_tail(_reader(FRAMING.place(frame, 4096)), 4096, FRAMING).end == 4096 + len(frame)


@settings(max_examples=200, deadline=None)
@given(payloads=payload_lists, start=starts, garbage=st.binary(min_size=1, max_size=300))
def test_bytes_no_crash_can_leave_are_damage_up_to_the_last_of_them(payloads, start, garbage):
    data, _ = _frames(payloads, start)
    garbage = garbage.rstrip(b"\0")
    if not garbage or FRAMING.may_be_torn(garbage, start + len(data)):
        return  # (a valid beginning of a frame written there: that is a torn write)
    look = look_at_tail(_reader(data + garbage + bytes(50)), start, FRAMING)
    assert look.damaged_at == start + len(data) and look.end == start + len(data) + len(garbage)
    assert look.torn is None


@settings(max_examples=100, deadline=None)
@given(first=payload_lists, more=payload_lists, start=starts, zeros=st.integers(0, 2 * PROBE_BYTES),
       big=st.booleans())
def test_a_look_that_goes_on_from_the_last_one_agrees_with_a_whole_look(first, more, start, zeros, big):
    if big:
        more = more + [b"x" * (3 * PROBE_BYTES)]  # a frame longer than the first read
    data, _ = _frames(first, start)
    since = look_at_tail(_reader(data + bytes(zeros)), start, FRAMING)
    grown, _ = _frames(first + more, start)
    chunk = grown + bytes(zeros)
    assert look_at_tail(_reader(chunk), start, FRAMING, since=since) == look_at_tail(_reader(chunk), start, FRAMING)


def test_a_look_that_goes_on_reads_little_when_nothing_was_appended():
    data, _ = _frames([b"x" * 1000] * 50, 0)
    chunk = data + bytes(1 << 20)
    since = look_at_tail(_reader(chunk), 0, FRAMING)
    read = []

    def counting(a, b):
        read.append(min(b, len(chunk)) - a)
        return chunk[a:b]

    assert look_at_tail(counting, 0, FRAMING, since=since) == since
    assert sum(read) <= MARK_BYTES + PROBE_BYTES + MARK_BYTES


def test_a_chunk_replaced_under_a_look_is_looked_at_whole():
    first, _ = _frames([b"old" * 30], 0)
    since = look_at_tail(_reader(first), 0, FRAMING)
    other, _ = _frames([b"new" * 40, b"more"], 0)  # the segment deleted and made again
    assert look_at_tail(_reader(other), 0, FRAMING, since=since) == look_at_tail(_reader(other), 0, FRAMING)


def test_garbage_after_a_known_end_is_judged_in_full():
    data, ends = _frames([b"a" * 10, b"b" * 10], 0)
    since = look_at_tail(_reader(data), 0, FRAMING)
    later, later_ends = _frames([b"a" * 10, b"b" * 10, b"c" * 10, b"d" * 10], 0)
    damaged = later[:ends[-1] + 2] + b"\xee" + later[ends[-1] + 3:]  # frame c damaged, d intact
    look = look_at_tail(_reader(damaged), 0, FRAMING, since=since)
    assert look.end == later_ends[-1] and look.damaged_at == ends[-1]


def test_damage_seen_by_a_reader_must_hold_still_to_count():
    # A reader (no lock) can catch a write in flight: what looks like damage once is looked at again.
    data, ends = _frames([b"a" * 10, b"b" * 10, b"c" * 10], 0)
    states = iter([data[:ends[0]] + b"\x01" * (ends[1] - ends[0]) + data[ends[1]:]] + [data] * 10)
    current = [next(states)]

    def reading(a, b):
        if a == 0 and b > len(data):  # each whole look starts with one read of the chunk
            current[0] = next(states, current[0])
        return current[0][a:b]

    look = look_at_tail(reading, 0, FRAMING)
    assert look == TailLook(ends[-1], zeros_after=False, mark=data[-MARK_BYTES:])


def test_damage_that_keeps_changing_is_an_error_not_a_guess():
    data, ends = _frames([b"a" * 10, b"b" * 10, b"c" * 10], 0)
    flips = iter(range(1, 1000))

    def reading(a, b):
        damaged = data[:ends[0]] + bytes([next(flips) % 255 + 1]) + data[ends[0] + 1:]
        return damaged[a:b]

    with pytest.raises(StorageError, match="kept changing"):
        look_at_tail(reading, 0, FRAMING)
    assert look_at_tail(reading, 0, FRAMING, locked=True).damaged_at == ends[0]  # under the lock: no write in flight
