"""What the log's frames cost in CPU (batch format 3, docs/decisions/0001): the chain walk on open
and the stamping on every append.

    python -m sims.bench.log_frames [--rounds 7]

* ``chain_end``: µs per batch of ``LOG_FRAMING.chain_end`` over a 16 MiB chunk of batches of one
  shape (a one-key attribute update, the WAL's usual batch; one 100-byte record; 100 of them),
  the walk a local chunk's open makes;
* ``place``: µs of ``place_batches`` for one batch already sealed for its position (the usual
  append: a check), and for one sealed for another (a retried or moved append: a new header
  and one copy of the batch);
* ``append``: µs of CPU per encoding and ``SegmentLog.append_many`` of a one-key batch on
  ``memory://`` (no device sync: what the stamping adds to the write path's CPU): encoded for the
  append position (what ``Segment`` does: ``place_batches`` only checks), encoded for position 0
  (sealed again on append), and with ``place_batches`` replaced by the identity (the path before
  format 3); rounds interleaved.

Medians of the rounds, process CPU time (``time.process_time``): the host is shared.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from attrindex.log import segment_log
from attrindex.log.batch.chain import place_batches
from attrindex.log.batch.encode import encode_batch, encode_batch_with_header
from attrindex.log.framing import LOG_FRAMING
from storage_adapters import open_storage

CHUNK = 16 << 20


def _cpu(fn, repeat: int) -> float:
    started = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - started) / repeat


def chain_arms() -> dict[str, tuple[bytes, int]]:
    shapes = {
        "one-key update": encode_batch(0, (), timestamp=1, attribute_updates=([b"k" * 16], [5])),
        "1 record of 100 B": encode_batch(0, [b"x" * 100], timestamp=1),
        "100 records of 100 B": encode_batch(0, [b"x" * 100] * 100, timestamp=1),
    }
    out = {}
    for name, batch in shapes.items():
        n = CHUNK // len(batch)
        out[name] = (place_batches(batch * n, 0), n)
    return out


def append_arm(stamp: bool, encoded_for_there: bool, calls: int):
    """A fresh log on memory://; returns a function appending ``calls`` one-key batches."""
    storage = open_storage(f"memory://frames-{uuid.uuid4().hex}")
    log = segment_log.SegmentLog(storage, "s")
    log.catch_up()

    def run() -> float:
        original = segment_log.place_batches
        if not stamp:
            segment_log.place_batches = lambda data, position: data
        try:
            started = time.process_time()
            for i in range(calls):
                data, header = encode_batch_with_header(log.next_offset, (), timestamp=1,
                                                        attribute_updates=([i.to_bytes(16, "big")], [i]),
                                                        position=log.position if encoded_for_there else 0)
                log.append_many([data], [header])
            return (time.process_time() - started) / calls
        finally:
            segment_log.place_batches = original
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    chains = chain_arms()
    one = encode_batch(0, (), timestamp=1, attribute_updates=([b"k" * 16], [5]), position=4096)
    big = encode_batch(0, [b"v" * 100] * 10_000, timestamp=1, position=4096)
    place = {"place one-key batch, sealed for there": lambda: place_batches(one, 4096),
             "place one-key batch, moved": lambda: place_batches(one, 8192),
             "place 1 MB batch, sealed for there": lambda: place_batches(big, 4096),
             "place 1 MB batch, moved": lambda: place_batches(big, 8192)}
    appends = {"append one-key, encoded for there (checked)": append_arm(True, True, args.calls),
               "append one-key, encoded for 0 (sealed again)": append_arm(True, False, args.calls),
               "append one-key, not stamped (before format 3)": append_arm(False, False, args.calls)}
    results: dict[str, list[float]] = {}
    for _round in range(args.rounds):
        for name, (data, n) in chains.items():
            results.setdefault(f"chain_end per batch, {name} ({n} in 16 MiB)", []).append(
                _cpu(lambda: LOG_FRAMING.chain_end(data, 0), 1) / n)
        for name, fn in place.items():
            results.setdefault(name, []).append(_cpu(fn, 2000 if "one-key" in name else 20))
        for name, fn in appends.items():
            results.setdefault(name, []).append(fn())
    for name, values in results.items():
        print(f"{name:60s} {statistics.median(values) * 1e6:9.2f} µs")
    plain = statistics.median(results["append one-key, not stamped (before format 3)"])
    for name in ("append one-key, encoded for there (checked)", "append one-key, encoded for 0 (sealed again)"):
        print(f"{name + ' / before':60s} {statistics.median(results[name]) / plain:9.3f}x")


if __name__ == "__main__":
    main()
