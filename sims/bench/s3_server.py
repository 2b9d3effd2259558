"""The cost of one request to the test S3 server: moto's own server against ``testkit.moto_server``.

Each server runs in a child process of its own; this process is the client (an ``S3ChunkStorage``
per server, as the tests open them). A round sends the same mix to each server in turn, the
order rotated every round: ``--ops`` each of create (an exclusive PUT of 100 bytes), read (a
ranged GET), exists (a HEAD), list (a LIST of a directory of 10 keys) and delete (a
DeleteObjects of one key). For each server and kind it prints the medians over the rounds of
the wall time per request, the client's CPU time per request and the server's CPU time per
request (from /proc), then the ratio of each server's total to the last server's, round by
round (>1: the last server is cheaper).

    python -m sims.bench.s3_server [--rounds 7] [--ops 100] [--server NAME=MODULE ...]

``--server`` names a server program run as ``python -m MODULE -H 127.0.0.1 -p PORT`` with the
repository root on its path (default: ``moto=moto.server`` and ``testkit=testkit.moto_server``).
On a busy machine the wall times follow the load; the CPU times much less.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterator

from storage_adapters import open_storage
from testkit.moto_server import ROOT, S3_KEY, S3_SECRET, free_port, make_s3_url, options, wait_until_serving

KINDS = ("create", "read", "exists", "list", "delete")


@contextlib.contextmanager
def server(module: str) -> Iterator[tuple[dict, int]]:
    """Run ``python -m module`` on a free loopback port; yield its storage options and its pid."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    child = subprocess.Popen([sys.executable, "-m", module, "-H", "127.0.0.1", "-p", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_until_serving(endpoint, child, 60)
        yield options(endpoint), child.pid
    finally:
        child.terminate()
        child.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def operations(storage, tag: str, ops: int) -> dict[str, Callable[[int], object]]:
    """The request mix: each call sends one request."""
    return {
        "create": lambda i: storage.create(f"{tag}/k{i:06d}", b"x" * 100),
        "read": lambda i: storage.read(f"{tag}/k{i:06d}", 0, 100),
        "exists": lambda i: storage.exists(f"{tag}/k{i:06d}"),
        "list": lambda i: storage.list_files("ten"),
        "delete": lambda i: storage.delete([f"{tag}/k{i:06d}"]),
    }


def one_round(storage, pid: int, tag: str, ops: int) -> dict[str, tuple[float, float, float]]:
    """Per kind: (wall, client CPU, server CPU) seconds per request."""
    found = {}
    for kind, op in operations(storage, tag, ops).items():
        before = storage.requests.total
        wall, client, serving = time.perf_counter(), time.process_time(), cpu_seconds(pid)
        for i in range(ops):
            op(i)
        wall, client, serving = (time.perf_counter() - wall, time.process_time() - client,
                                 cpu_seconds(pid) - serving)
        sent = storage.requests.total - before
        assert sent == ops, f"{kind}: {sent} requests for {ops} operations"
        found[kind] = (wall / ops, client / ops, serving / ops)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--server", action="append", metavar="NAME=MODULE")
    args = parser.parse_args()
    servers = dict(s.split("=", 1) for s in (args.server or ["moto=moto.server", "testkit=testkit.moto_server"]))
    names = list(servers)
    results: dict[str, list[dict]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        peers = {}
        for name, module in servers.items():
            opts, pid = stack.enter_context(server(module))
            storage = open_storage(make_s3_url(opts), **opts)
            for i in range(10):
                storage.create(f"ten/{i}", b"y")
            one_round(storage, pid, "warm", 10)
            peers[name] = (storage, pid)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                storage, pid = peers[name]
                results[name].append(one_round(storage, pid, f"r{round_}", args.ops))
            print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr)
    print(f"{args.rounds} rounds of {args.ops} requests per kind; medians, ms per request "
          "(wall / client CPU / server CPU)")
    print(f"{'kind':<8}" + "".join(f"{name:>26}" for name in names))
    for kind in KINDS:
        cells = []
        for name in names:
            wall, client, serving = (statistics.median(r[kind][j] for r in results[name]) * 1e3 for j in range(3))
            cells.append(f"{wall:8.2f} /{client:6.2f} /{serving:6.2f}")
        print(f"{kind:<8}" + "".join(f"{cell:>26}" for cell in cells))
    last = names[-1]
    for name in names[:-1]:
        for j, what in enumerate(("wall", "client CPU", "server CPU", "client+server CPU")):
            ratios = []
            for mine, theirs in zip(results[name], results[last]):
                def total(r):
                    return sum((r[k][1] + r[k][2]) if j == 3 else r[k][j] for k in KINDS)
                ratios.append(total(mine) / total(theirs))
            print(f"{what} {name}/{last}: median {statistics.median(ratios):.2f} "
                  f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
