"""EventWriter linger on S3 (moto): requests per second of a steady stream of small events.

10,000 events/s of 100 bytes into a 4-segment stream from one process, with ``linger_ms=100``
(issue 12's goal: <= 50 PUTs/s, each event durable within linger + one append), against the
same stream written synchronously with a ``flush()`` per 10 ms tick (what a caller needing the
same durability delay does without linger). Requests are counted at the s3fs client
(testkit/s3_requests.py); moto's server (testkit/moto_server.py) is started here on a free loopback port.

    python -m sims.segments.linger [--seconds 5] [--rate 10000] [--linger-ms 100]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

from attrindex import EventWriter, SegmentStore
from testkit import moto_server
from testkit.moto_server import make_s3_url
from testkit.s3_requests import counting

TICK = 0.01


def run(options: dict, seconds: float, rate: int, linger_ms: float | None) -> dict:
    """Write ``rate`` events/s for ``seconds``; return request rates and acknowledgement delays."""
    url = make_s3_url(options)
    payload = b"x" * 100
    per_tick = max(1, int(rate * TICK))
    delays: list[float] = []
    tickets: queue.Queue = queue.Queue()

    def waiter() -> None:
        while (item := tickets.get()) is not None:
            written, ticket = item
            ticket.wait()
            delays.append(time.monotonic() - written)

    with SegmentStore.open(url, storage_options=options) as store:
        writer = EventWriter(store, "events", segments=4, linger_ms=linger_ms, batch_events=5000)
        watcher = threading.Thread(target=waiter)
        watcher.start()
        with counting(store.storage) as log:
            started = time.monotonic()
            sent, late = 0, 0
            while (now := time.monotonic()) - started < seconds:
                ticket = None
                for i in range(per_tick):
                    ticket = writer.write(payload, routing_key=sent + i)
                sent += per_tick
                if linger_ms:
                    tickets.put((now, ticket))  # the tick's last event: the others are on earlier or equal footing
                else:
                    writer.flush()
                    delays.append(time.monotonic() - now)
                pause = started + sent / rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                else:
                    late += 1
            writer.close()
            elapsed = time.monotonic() - started
            tickets.put(None)
            watcher.join()
            counts = log.counts
    delays.sort()
    return {"events_per_s": sent / elapsed, "appends": writer.appends, "elapsed": elapsed,
            **{f"{kind}_per_s": counts.get(kind, 0) / elapsed for kind in ("PUT", "GET", "LIST", "HEAD")},
            "PUT_per_1000_events": 1000 * counts.get("PUT", 0) / sent,
            "ack_p50_ms": 1000 * statistics.median(delays), "ack_p99_ms": 1000 * delays[int(len(delays) * 0.99)],
            "ack_max_ms": 1000 * delays[-1], "late_ticks": late}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--linger-ms", type=float, default=100.0)
    args = parser.parse_args()
    with moto_server.running() as options:
        lingering = run(options, args.seconds, args.rate, args.linger_ms)
        synchronous = run(options, args.seconds, args.rate, None)
    print(f"{args.rate} events/s of 100 bytes, 4 segments, {args.seconds:g} s on moto")
    print(f"{'':28}{'linger_ms=' + format(args.linger_ms, 'g'):>16}{'flush per 10 ms':>18}{'ratio':>8}")
    for key in ("events_per_s", "appends", "PUT_per_s", "PUT_per_1000_events", "GET_per_s", "LIST_per_s", "HEAD_per_s",
                "ack_p50_ms", "ack_p99_ms", "ack_max_ms", "late_ticks"):
        a, b = lingering[key], synchronous[key]
        ratio = f"{a / b:8.3f}" if b else f"{'-':>8}"
        print(f"{key:28}{a:16.1f}{b:18.1f}{ratio}")


if __name__ == "__main__":
    main()
