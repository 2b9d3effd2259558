"""How close a one-key durable update is to the floor its commit protocol sets (Linux, local disk).

    python -m sims.bench.floor [--rounds 10] [--calls 500] [--dir DIR]

One process, rounds interleaved (so every arm sees the same moment of a noisy disk); per arm the
median of the rounds' mean µs per call, and its ratio to LMDB's one-key transaction:

* ``lmdb``: ``txn.put`` of one key (sync and metasync on), as in ``sims.bench.run``;
* ``attrindex``: ``AttributeIndex.update`` of one key (the shipped path);
* ``floor-chain``: the commit of docs/decisions/0001 (the chain of frames is the record): a
  pre-written file, ``pwrite`` of the batch, one ``fdatasync``;
* ``floor-chain+checks``: that, plus what the shipped append does besides (docs/storage.md,
  "Compare-and-append"): ``flock`` and its release, a ``stat`` of the lock file, the kernel's name
  for the chunk's descriptor and a seek to its end, a ``pread`` of the bytes at the end;
* ``floor-chain-dsync``: the floor with one ``pwritev2(RWF_DSYNC)`` instead of write + sync;
* ``rocksdb``, ``leveldb``: one ``put`` with ``sync=True`` (``rocksdict``, ``plyvel``), where installed.

``--cpu`` times each arm's CPU (process time) with ``os.fdatasync`` made a no-op: what the Python
arms spend besides the device's sync. The peers sync from C (not through ``os.fdatasync``): their
CPU figure includes their own sync's system time.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import random
import shutil
import statistics
import tempfile
import time

from attrindex.log.batch.encode import encode_batch_with_header
from sims.bench.run import LMDB, Attrindex, LevelDB, RocksDB, _installed

class Floor:
    """One bare protocol writing one-key batches to a pre-written file of its own in ``directory``."""

    def __init__(self, directory: str, name: str, *, checks: bool = False, dsync: bool = False):
        self.checks, self.dsync = checks, dsync
        self.path = os.path.join(directory, name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        os.pwrite(self.fd, bytes(64 << 20), 0)  # written, not fallocated: an overwrite needs no journal commit
        os.fsync(self.fd)
        self.lock = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        self.position, self.overlay, self.count = 0, {}, 0

    def update_one(self, key: bytes, value: int) -> None:
        data, _header = encode_batch_with_header(self.count, (), timestamp=int(time.time() * 1000),
                                                 attribute_updates=([key], [value]), batch_id=self.count,
                                                 position=self.position)
        fd, position = self.fd, self.position
        if self.checks:
            fcntl.flock(self.lock, fcntl.LOCK_EX)
            os.stat(self.path + ".lock")
            os.readlink(f"/proc/self/fd/{fd}")
            os.lseek(fd, 0, os.SEEK_END)
            os.pread(fd, 512 + 64, max(position - 64, 0))
        if self.dsync:
            os.pwritev(fd, [data], position, os.RWF_DSYNC)
        else:
            os.pwrite(fd, data, position)
            os.fdatasync(fd)
        if self.checks:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
        self.position, self.count = position + len(data), self.count + 1
        self.overlay[key] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--cpu", action="store_true",
                        help="time the CPU of each arm instead (process time, fdatasync made a no-op in this "
                             "process): what an arm spends besides the device's sync")
    args = parser.parse_args()
    if args.cpu:
        os.fdatasync = lambda fd: None  # this process only (the peers run in it too: their syncs are their own)
    rng = random.Random(1)
    pairs = [(rng.randbytes(16), i) for i in range(args.keys)]
    keys = [k for k, _ in pairs]
    directory = tempfile.mkdtemp(dir=args.dir)
    try:
        lmdb, index = LMDB(f"{directory}/lmdb"), Attrindex(f"{directory}/attrindex")
        peers = [cls(f"{directory}/{cls.name}") for cls in (RocksDB, LevelDB) if _installed(cls.name)]
        for engine in (lmdb, index, *peers):
            engine.load(pairs)
        arms = {"lmdb": lmdb.update_one, "attrindex": index.update_one,
                **{peer.name: peer.update_one for peer in peers},
                "floor-chain": Floor(directory, "chain").update_one,
                "floor-chain+checks": Floor(directory, "checks", checks=True).update_one,
                "floor-chain-dsync": Floor(directory, "dsync", dsync=True).update_one}
        means: dict[str, list[float]] = {arm: [] for arm in arms}
        for _round in range(args.rounds):
            for arm, update_one in arms.items():
                calls = [(keys[rng.randrange(len(keys))], rng.randrange(1 << 40)) for _ in range(args.calls)]
                clock = time.process_time if args.cpu else time.perf_counter
                start = clock()
                for key, value in calls:
                    update_one(key, value)
                means[arm].append((clock() - start) / args.calls * 1e6)
        base = statistics.median(means["lmdb"])
        what = "CPU µs (process time; fdatasync a no-op for the Python arms)" if args.cpu else "wall µs"
        print(f"{args.rounds} rounds of {args.calls} one-key durable updates, arms interleaved, {what}; "
              f"load {os.getloadavg()[0]:.2f}")
        best = min((statistics.median(means[p.name]), p.name) for p in peers) if peers else None
        floor = statistics.median(means["floor-chain"])
        for arm, values in means.items():
            median = statistics.median(values)
            versus = f"   {best[0] / median:5.2f}x {best[1]} (the best peer)" if best else ""
            print(f"{arm:18s} {median:6.0f} µs/call   {base / median:5.2f}x LMDB{versus}   {median / floor:5.2f}x the floor")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
