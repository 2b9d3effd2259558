"""Code run in child processes by the concurrency and crash tests (importable under ``spawn``)."""

from __future__ import annotations

import hashlib
import struct
import sys

from storage_adapters import BadOffsetError, open_storage

from .framed import FRAMING, frame, open_segment

def run_together(target, args_for, count: int) -> list:
    """Run ``target(*args_for(i), barrier, results)`` in ``count`` spawned processes that start
    together at a barrier; return what each put on ``results`` (every process must exit 0)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(count), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for(i), barrier, results)) for i in range(count)]
    for proc in procs:
        proc.start()
    out = [results.get(timeout=180) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    return out


RECORD_HEADER = struct.Struct("<IIQ")  # writer id, sequence number, payload length


def make_record(writer: int, seq: int, size: int) -> bytes:
    """A self-describing record whose payload is derived from (writer, seq), so it can be verified."""
    seed = hashlib.sha256(b"%d/%d" % (writer, seq)).digest()
    payload = (seed * (size // len(seed) + 1))[:size]
    return RECORD_HEADER.pack(writer, seq, size) + payload


def parse_records(data: bytes, framed: bool = False) -> list[tuple[int, int, int, int]]:
    """``[(offset, writer, seq, length)]`` of back-to-back records read from offset 0; asserts each
    payload is intact. ``framed`` (local disk): each record is the payload of one frame, and the
    offset and length are the frame's."""
    if framed:
        # One pass over the frames (each checked on its own bytes): the cost is linear in the
        # number of frames, so a test can read back every record it wrote after each step.
        out, position = [], 0
        for payload in FRAMING.payloads(data):
            end = position + FRAMING.header_size + len(payload)
            assert FRAMING.chain_end(data[position:end], position) == end, f"no whole, valid frame at {position}"
            ((_offset, writer, seq, _length),) = parse_records(payload)
            out.append((position, writer, seq, end - position))
            position = end
        assert position == len(data), f"partial frame at {position}"
        return out
    out, position = [], 0
    while position < len(data):
        writer, seq, size = RECORD_HEADER.unpack_from(data, position)
        length = RECORD_HEADER.size + size
        assert data[position:position + length] == make_record(writer, seq, size), f"bad record at {position}"
        out.append((position, writer, seq, length))
        position += length
    assert position == len(data), "partial record at the end"
    return out


def race_rounds(url, options, name, writer, rounds, barrier, results):
    """Each round: look at the length, wait for everyone, then all append at that same offset."""
    seg = open_segment(open_storage(url, **options), name, rolling_size=256)
    outcome = []
    for round_number in range(rounds):
        seg.refresh()
        expected = seg.length
        barrier.wait()
        try:
            offset = seg.append(frame(seg.storage, make_record(writer, round_number, 40), expected),
                                expected_offset=expected)
            outcome.append(("won", round_number, offset))
        except BadOffsetError as exc:
            outcome.append(("lost", round_number, exc.actual_offset))
        barrier.wait()
    results.put((writer, outcome))


def race_free_for_all(url, options, name, writer, appends, barrier, results):
    """Append ``appends`` records, each with the expected offset this handle believes in."""
    seg = open_segment(open_storage(url, **options), name, rolling_size=512)
    won, lost, seq = [], 0, 0
    barrier.wait()
    while seq < appends:
        try:
            record = frame(seg.storage, make_record(writer, seq, 8 + seq % 50), seg.length)
            won.append((seg.append(record, expected_offset=seg.length), seq))
            seq += 1
        except BadOffsetError:
            lost += 1
    results.put((writer, won, lost))


def append_forever(directory: str, name: str) -> None:
    """Append large records in a loop, printing 'offset seq length' after each append returns."""
    seg = open_segment(open_storage(directory), name, rolling_size=4 << 20)
    seq = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    while True:
        record = frame(seg.storage, make_record(7, seq, 4096 * (1 + seq % 97)), seg.length)
        offset = seg.append(record, expected_offset=seg.length)
        print(offset, seq, len(record), flush=True)
        seq += 1


def index_disjoint_writer(url, options, writer, count, batch, barrier, results):
    """Update keys ``writer, writer + N, ...`` of one shared index in batches, racing the others."""
    from attrindex.attribute_index import AttributeIndex

    index = AttributeIndex.open(url, storage_options=options, page_size=1024)
    barrier.wait()
    keys = [writer + 1000 * i for i in range(count)]
    for start in range(0, count, batch):
        index.update({key: key * 10 for key in keys[start:start + batch]})
    results.put((writer, index.stats().updates_written))


def index_update_forever(directory: str, first_batch: int) -> None:
    """Update batches of 50 keys forever, printing each batch number after its update returns."""
    from attrindex.attribute_index import AttributeIndex

    index = AttributeIndex.open(directory, page_size=2048, rolling_size=1 << 16)
    batch = first_batch
    while True:
        index.update({(batch * 50 + i) % 20_000: batch for i in range(50)})
        print(batch, flush=True)
        batch += 1


def segment_append(directory: str, name: str, count: int) -> None:
    """Append records b"p0" ... one per append, to an existing segment (a second process's writes)."""
    from attrindex import SegmentStore

    with SegmentStore.open(directory) as store:
        seg = store.segment(name)
        for i in range(count):
            seg.append([b"p%d" % i])


def merging_writer(directory: str, name: str, seconds: float) -> None:
    """Append with an attribute update each, merging every append into the B+tree and applying
    retention now and then, for ``seconds`` (another process's verifies and opens race it)."""
    import time

    from attrindex import AttributeUpdate, SegmentStore, UpdateType

    with SegmentStore.open(directory, flush_keys=1, log_rolling_size=2048) as store:
        seg = store.segment(name)
        deadline, n = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            seg.append([b"m%d" % n], [AttributeUpdate(1, UpdateType.ACCUMULATE, value=1)])
            n += 1
            if n % 37 == 0:
                seg.apply_retention(max_bytes=4096)
        print("appended", n, flush=True)


def chaos_writer(url: str, options_json: str, stream: str, writer: int, total: int, rate: float, seed: int,
                 progress: str | None = None) -> None:
    """Write events ``writer:1`` ... ``writer:total`` exactly once through a flaky store.

    The writer id depends only on ``writer``, and the events are always written in the same
    order, so a killed and restarted worker resumes where its earlier life stopped. ``progress``
    (a path) is created once the first events are flushed, so a test can kill it mid-write. The
    first write of every life loses its acknowledgement; each flush prints the events written and
    the acknowledgements lost so far.
    """
    import json
    import uuid

    from attrindex import EventWriter, SegmentStore
    from storage_adapters import open_storage
    from tests.flaky import FlakyStorage

    flaky = FlakyStorage(open_storage(url, **json.loads(options_json)), rate=rate, seed=seed, lose_first_ack=True)
    store = SegmentStore(flaky, poll_interval=0.01)
    events = EventWriter(store, stream, writer_id=uuid.UUID(int=writer + 1), batch_events=8, retries=200, retry_delay=0.001)
    for n in range(1, total + 1):
        events.write(b"%d:%d" % (writer, n), routing_key=b"%d-%d" % (writer, n % 5))
        if n % 10 == 0:
            events.flush()
            print(n, flaky.lost_acks, flush=True)  # what a life killed later has seen
            if progress is not None and n == 10:
                open(progress, "w").close()
    events.flush()
    print("done", events.events_skipped, flaky.lost_acks, flaky.failed_writes, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "append_forever":
        append_forever(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "index_update_forever":
        index_update_forever(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "segment_append":
        segment_append(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "merging_writer":
        merging_writer(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    elif sys.argv[1] == "chaos_writer":
        chaos_writer(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7]), int(sys.argv[8]),
                     *sys.argv[9:10])
