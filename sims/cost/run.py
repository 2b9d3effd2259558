"""Storage requests per operation, by backend, and what they cost at S3 Standard list prices.

    python -m sims.cost.run [--backends memory,local,moto] [--appends 40] [--keys 20000]
                            [--lookups 500] [--idle 2] [--out sims/out/cost]

Counts come from ``ChunkStorage.requests`` (on S3: the HTTP requests really sent; on local disk and
memory: the operations that stand in for them). ``moto`` is moto's S3 server, started on a free
loopback port for the run; its counts are the ones real S3 would see (the latencies are moto's).
Prints a table of requests per operation (by kind), then the dollar figures of docs/cost.md; writes
results.csv, and requests.png if matplotlib is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

from attrindex import AttributeIndex, EventWriter, SegmentStore
from storage_adapters import RequestCounters, open_storage

#: S3 Standard (us-east-1) list prices, dollars per request.
PRICE = {"PUT": 0.005 / 1000, "LIST": 0.005 / 1000, "GET": 0.0004 / 1000, "HEAD": 0.0004 / 1000, "DELETE": 0.0}
KINDS = ("PUT", "GET", "LIST", "HEAD", "DELETE")


def dollars(counts: dict[str, float]) -> float:
    """The S3 Standard price of ``counts`` requests by kind."""
    return sum(PRICE[kind] * counts.get(kind, 0) for kind in KINDS)


@contextlib.contextmanager
def moto_server():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    finally:
        server.terminate()
        server.wait(timeout=10)


def new_location(backend: str, options: dict, scratch: str) -> tuple[str, dict]:
    if backend == "memory":
        return f"memory://cost-{uuid.uuid4().hex}", {}
    if backend == "local":
        return os.path.join(scratch, uuid.uuid4().hex), {}
    import boto3

    bucket = "cost-" + uuid.uuid4().hex[:20]
    boto3.client("s3", endpoint_url=options["endpoint_url"], aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/data", options


def per(counts: RequestCounters, n: float) -> dict[str, float]:
    return {kind: value / n for kind, value in counts.by_kind().items()}


def measure(backend: str, options: dict, scratch: str, args) -> dict[str, dict[str, float]]:
    """``{operation: {kind: requests per operation}}`` on one backend."""
    rows: dict[str, dict[str, float]] = {}
    url, opts = new_location(backend, options, scratch)
    store = SegmentStore.open(url, storage_options=opts)
    storage = store.storage
    segment = store.segment("s", create=True)
    segment.append([b"warm-up"])

    before = storage.requests
    for i in range(args.appends):
        segment.append([b"r%d" % i])
    rows["Segment.append (1 record)"] = per(storage.requests - before, args.appends)

    writer = EventWriter(store, "events", segments=4)
    for _ in range(4):
        writer.write(b"warm-up")
    writer.flush()
    before = storage.requests
    for i in range(args.appends):
        writer.write(b"e" * 100)
        writer.flush()
    rows["EventWriter.write+flush (1 event)"] = per(storage.requests - before, args.appends)
    before = storage.requests
    writer.write_many([b"e" * 100] * 1000)
    writer.flush()
    rows["EventWriter, 1,000 events per flush (per event)"] = per(storage.requests - before, 1000)

    reopened_storage = open_storage(url, **opts)
    before = reopened_storage.requests
    reopened = SegmentStore(reopened_storage).segment("s")
    rows["SegmentStore + segment() (open)"] = per(reopened_storage.requests - before, 1)
    before = reopened_storage.requests
    records = reopened.read(1, max_records=args.appends)
    assert len(records) == args.appends
    rows[f"Segment.read (per record; {args.appends} appends of 1)"] = per(reopened_storage.requests - before, len(records))

    reader = reopened.reader(offset=reopened.stats().next_offset)
    before = reopened_storage.requests
    started = time.monotonic()
    assert reader.read(timeout=args.idle) is None
    rows["idle tail reader (per second)"] = per(reopened_storage.requests - before, time.monotonic() - started)

    index_url, index_opts = new_location(backend, options, scratch)
    index_storage = open_storage(index_url, **index_opts)
    index = AttributeIndex(index_storage, "i")
    index.update({k: k for k in range(1000)})
    before = index_storage.requests
    for round_ in range(1, 6):
        index.update({k: k for k in range(1000 * round_, 1000 * round_ + 1000)})
    rows["AttributeIndex.update (1,000 keys)"] = per(index_storage.requests - before, 5)
    for start in range(6000, args.keys, 5000):
        index.update({k: k for k in range(start, min(start + 5000, args.keys))})
    index.flush()
    index.close()
    cold_storage = open_storage(index_url, **index_opts)
    cold = AttributeIndex(cold_storage, "i")
    keys = random.Random(7).sample(range(args.keys), args.lookups)
    before = cold_storage.requests
    for key in keys:
        assert cold.get(key) == key
    rows[f"AttributeIndex.get, cold handle ({args.keys:,} keys)"] = per(cold_storage.requests - before, args.lookups)
    store.close()
    return rows


def print_table(results: dict[str, dict[str, dict[str, float]]]) -> None:
    backends = list(results)
    operations = list(next(iter(results.values())))
    print(f"{'operation':52} " + " ".join(f"{b:>28}" for b in backends))
    for op in operations:
        cells = []
        for b in backends:
            counts = results[b][op]
            cells.append(" ".join(f"{k[0]}{counts[k]:.2f}" for k in KINDS if counts[k]) or "0")
        print(f"{op:52} " + " ".join(f"{c:>28}" for c in cells))
    print("(P=PUT G=GET L=LIST H=HEAD D=DELETE, requests per operation)")


def print_dollars(rows: dict[str, dict[str, float]]) -> None:
    def cost(op: str, n: float) -> str:
        value = dollars(rows[op]) * n
        return f"${value:,.2f}" if value >= 1 else f"${value:.4f}"

    print("\nS3 Standard list prices (PUT/LIST $0.005 per 1,000; GET/HEAD $0.0004 per 1,000; DELETE free):")
    print("  per million events written, one event per append:  ", cost("EventWriter.write+flush (1 event)", 1e6))
    print("  per million events written, 1,000 per flush:       ", cost("EventWriter, 1,000 events per flush (per event)", 1e6))
    read_op = next(op for op in rows if op.startswith("Segment.read"))
    print("  per million records read (one object per record):  ", cost(read_op, 1e6))
    print("  per idle tail-reader hour:                          ", cost("idle tail reader (per second)", 3600))
    lookup_op = next(op for op in rows if op.startswith("AttributeIndex.get"))
    print("  per million cold index lookups:                     ", cost(lookup_op, 1e6))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="memory,local,moto")
    parser.add_argument("--appends", type=int, default=40)
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--lookups", type=int, default=500)
    parser.add_argument("--idle", type=float, default=2.0, help="seconds an idle tail reader waits")
    parser.add_argument("--out", default="sims/out/cost")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        for backend in args.backends.split(","):
            options = stack.enter_context(moto_server()) if backend == "moto" else {}
            results[backend] = measure(backend, options, scratch, args)
    print_table(results)
    if "moto" in results:
        print_dollars(results["moto"])
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["backend", "operation", *KINDS, "dollars_per_million_at_s3_prices"])
        for backend, rows in results.items():
            for op, counts in rows.items():
                writer.writerow([backend, op, *(f"{counts[k]:.4f}" for k in KINDS), f"{dollars(counts) * 1e6:.4f}"])
    plot(results, args.out)


def plot(results, out_dir: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib not installed: no plot; the table above is the result)")
        return
    operations = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(results)
    for i, (backend, rows) in enumerate(results.items()):
        ax.bar([x + i * width for x in range(len(operations))], [sum(rows[op].values()) for op in operations],
               width, label=backend)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(operations))])
    ax.set_xticklabels(operations, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("requests per operation")
    ax.set_yscale("symlog")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "requests.png"), dpi=120)
    print(f"\nplot: {os.path.join(out_dir, 'requests.png')}")


if __name__ == "__main__":
    main()
