"""Which ``resource`` limit can hold a child process (Python, numpy, attrindex) to a memory bound?

    python -m sims.scale.rlimit [--limits-mib 256,384,512,768] [--small 200000] [--big 20000000]

For the CI test issue 27 asks for (an index loaded under a limit it would break if it held the
keys whole), each limit kind (``RLIMIT_AS``: the whole address space, mapped files and reserved,
inaccessible ranges included; ``RLIMIT_DATA``: private writable mappings, the heap, anonymous
``mmap`` and thread stacks, since Linux 4.7) at each size runs three child processes, each setting
the limit on itself first (children inherit it: the merge worker is held too):

  imports   import numpy and attrindex, start a few threads: VmSize, VmData, VmRSS after
  bounded   bulk_load --small keys, 300 durable updates of 1,000 keys with merges in the merge
            worker, close: an operation whose memory is small
  whole     bulk_load --big keys (24 bytes each held in the run, as much again in the pages):
            the operation that must fail with a clear MemoryError under the limit

and prints what happened to each (ok, MemoryError, killed by a signal, another error, or hung:
no exit within ``--timeout``). A limit
recipe is reliable when "imports" and "bounded" pass and "whole" fails with MemoryError.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

KINDS = {"AS": resource.RLIMIT_AS, "DATA": resource.RLIMIT_DATA}


def status() -> dict:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmPeak", "VmSize", "VmData", "VmRSS", "VmHWM", "Threads"):
                fields[name] = int(value.split()[0]) // (1024 if name != "Threads" else 1)
    return fields


def child(kind: str, limit_mib: int, what: str, small: int, big: int, directory: str) -> None:
    limit = limit_mib << 20
    resource.setrlimit(KINDS[kind], (limit, limit))
    import numpy  # noqa: F401 - measured: its import maps its libraries (and OpenBLAS's buffers)

    from attrindex.attribute_index import AttributeIndex
    from sims.scale import data

    if what == "imports":
        stop = threading.Event()
        threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        row = status()
        stop.set()
        print(json.dumps(row))
        return
    if what == "bounded":
        index = AttributeIndex.open(directory, merge_keys=50_000)
        index.bulk_load(data.pairs(small))
        for batch in data.update_batches(3, small, 300, 1000):
            index.update(batch)
        index.close()
        print(json.dumps(status()))
        return
    index = AttributeIndex.open(directory)
    index.bulk_load(data.pairs(big))
    index.close()
    print(json.dumps(status()))


def run(kind: str, limit_mib: int, what: str, args) -> str:
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1") if args.one_blas_thread else dict(os.environ)
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "sims.scale.rlimit", "--child", kind, str(limit_mib), what,
                                   "--small", str(args.small), "--big", str(args.big), "--dir", directory],
                                  capture_output=True, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:  # (run() killed the child; its merge worker sees its parent gone)
            return f"HUNG: no exit within {args.timeout:g} s (killed)"
        took = time.perf_counter() - started
    if done.returncode == 0:
        return f"ok {took:.0f}s {done.stdout.strip().splitlines()[-1]}"
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name} after {took:.0f}s"
    last = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return f"exit {done.returncode} after {took:.0f}s: {last[-1][:160] if last else '?'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limits-mib", default="256,384,512,768")
    parser.add_argument("--kinds", default="AS,DATA")
    parser.add_argument("--what", default="imports,bounded,whole")
    parser.add_argument("--small", type=int, default=200_000)
    parser.add_argument("--big", type=int, default=20_000_000)
    parser.add_argument("--one-blas-thread", action="store_true", help="OPENBLAS_NUM_THREADS=1 in the child")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a child counts as hung")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, limit, what = args.child
        child(kind, int(limit), what, args.small, args.big, args.dir)
        return 0
    print(f"whole: bulk_load of {args.big:,} keys (~{args.big * 48 / 2**20:,.0f} MiB held by today's load); "
          f"bounded: {args.small:,} keys then 300 update calls")
    for kind in args.kinds.split(","):
        for limit in map(int, args.limits_mib.split(",")):
            for what in args.what.split(","):
                print(f"RLIMIT_{kind} {limit} MiB {what}: {run(kind, limit, what, args)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
