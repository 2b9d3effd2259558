"""Requests of idle tail readers and of opening a segment, on S3 (moto).

Idle readers: N readers (threads) waiting at the tail of one segment handle for ``--seconds``,
with the old fixed 0.05 s poll interval and with the default backoff (0.05 s doubling to 1 s),
as requests per reader-hour (the first seconds of the backoff included). Before issue 12 every
poll was a LIST (one per reader): about 52,000 LISTs per reader-hour. Opening: ``SegmentStore.open``
plus ``segment()`` of an existing segment, by request kind. Counted by the storage's own counters.

    python -m sims.segments.reader_cost [--seconds 6]
"""

from __future__ import annotations

import argparse
import threading
import time

from attrindex import SegmentStore
from testkit import moto_server
from testkit.moto_server import make_s3_url


def idle(options: dict, readers: int, seconds: float, **store_options) -> float:
    """Requests per reader-hour of ``readers`` idle readers sharing one handle."""
    url = make_s3_url(options)
    with SegmentStore.open(url, storage_options=options) as writer:
        writer.segment("s", create=True).append([b"x"])
    with SegmentStore.open(url, storage_options=options, **store_options) as store:
        seg = store.segment("s")
        before = store.storage.requests
        threads = [threading.Thread(target=seg.reader(offset=seg.next_offset).read, args=(seconds,))
                   for _ in range(readers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        spent = (store.storage.requests - before).total
    return spent / readers / seconds * 3600


def opening(options: dict) -> dict[str, int]:
    url = make_s3_url(options)
    with SegmentStore.open(url, storage_options=options) as writer:
        seg = writer.segment("s", create=True)
        for i in range(40):
            seg.append([b"r%d" % i], [(i, i)])
    store = SegmentStore.open(url, storage_options=options)
    store.segment("s")
    counts = store.storage.requests.by_kind()
    store.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    with moto_server.running() as options:
        print(f"idle tail readers on one segment handle, {args.seconds:g} s each: requests per reader-hour")
        print(f"{'readers':>8}{'fixed 0.05 s':>16}{'backoff 0.05-1 s':>18}{'ratio':>8}")
        for n in (1, 8):
            fixed = idle(options, n, args.seconds, poll_interval=0.05)
            backoff = idle(options, n, args.seconds)
            print(f"{n:8d}{fixed:16.0f}{backoff:18.0f}{backoff / fixed:8.3f}")
        counts = opening(options)
        print("SegmentStore.open + segment() of a segment of 40 appends:",
              ", ".join(f"{kind} {n}" for kind, n in counts.items() if n), f"(total {sum(counts.values())})")


if __name__ == "__main__":
    main()
