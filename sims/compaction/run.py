"""Pravega's compaction experiment, on attrindex's B+tree.

Workloads (32 KiB pages, 32 MiB chunks):
  sequential: N attributes inserted in ascending key order;
  random:     N random-order updates of existing keys over a bulk-loaded N.
Each at batch sizes 10, 100, 1000, 10000, under three compaction policies: none, Pravega's
one-page policy, and attrindex's bounded policy. Reports storage bytes, bytes written,
(length - start_offset) / live_bytes, and the reduction of storage versus no compaction.
Writes results.csv and compaction.png to the output directory.

    python -m sims.compaction.run [--keys 1000000] [--out sims/out/compaction] [--jobs 2]
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import random
import sys
import time

from attrindex.tree_index import TreeIndex
from attrindex.btree import BoundedPolicy

from .null_storage import NullChunkStorage

POLICIES = ("none", "pravega", "bounded")
BATCHES = (10, 100, 1000, 10000)
WORKLOADS = ("sequential", "random")
FIELDS = ["workload", "batch", "policy", "updates", "seconds", "length", "start_offset", "storage_bytes",
          "live_bytes", "bytes_written", "retained_ratio", "storage_ratio", "pages_relocated", "entries", "leaf_fill"]


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def make_policy(name: str):
    """"none", "pravega", "bounded" or "bounded:R" (the bounded policy with target ratio R)."""
    if name.startswith("bounded:"):
        return BoundedPolicy(target_ratio=float(name.split(":", 1)[1]))
    return name


def run_one(workload: str, batch: int, policy: str, keys: int, updates: int | None = None, position: int = 0) -> dict:
    from tqdm import tqdm

    storage = NullChunkStorage()
    index = TreeIndex(storage, compaction=make_policy(policy), cache_bytes=1 << 40, value_cache_entries=0)
    started = time.perf_counter()
    label = f"{workload:>10} batch {batch:>5} {policy:>7}"
    with tqdm(total=keys, desc=label, unit="key", position=position, leave=False, mininterval=1.0) as bar:
        if workload == "sequential":
            for start in range(0, keys, batch):
                index.update({key(i): i for i in range(start, min(start + batch, keys))})
                bar.update(min(batch, keys - start))
        else:
            rng = random.Random(0)
            universe = [rng.getrandbits(128) for _ in range(keys)]
            index.update({key(i): 0 for i in universe})  # bulk load, one update
            total = keys if updates is None else updates
            bar.reset(total)
            for start in range(0, total, batch):
                index.update({key(rng.choice(universe)): start for _ in range(min(batch, total - start))})
                bar.update(min(batch, total - start))
    stats = index.stats()
    leaves = [len(p) for _, _, _, p in index._tree.pages() if p.is_leaf]
    from attrindex.btree.page import leaf_capacity

    return {
        "workload": workload, "batch": batch, "policy": policy,
        "updates": stats.updates_written, "seconds": round(time.perf_counter() - started, 1),
        "length": stats.length, "start_offset": stats.start_offset, "storage_bytes": stats.storage_bytes,
        "live_bytes": stats.live_bytes, "bytes_written": stats.bytes_written,
        "retained_ratio": round((stats.length - stats.start_offset) / stats.live_bytes, 3),
        "storage_ratio": round(stats.storage_bytes / stats.live_bytes, 3),
        "pages_relocated": stats.pages_relocated, "entries": stats.entry_count,
        "leaf_fill": round(sum(leaves) / (len(leaves) * leaf_capacity(32768)), 3),
    }


def _run_star(args):
    return run_one(*args)


def plot(rows: list[dict], policies: tuple[str, ...], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 8), squeeze=False)
    for col, workload in enumerate(workloads):
        for row_index, (metric, title) in enumerate([("storage_bytes", "storage held (MiB)"), ("bytes_written", "bytes written (MiB)")]):
            ax = axes[row_index][col]
            width = 0.8 / len(policies)
            for n, policy in enumerate(policies):
                values = [next((r[metric] / 2**20 for r in rows if r["workload"] == workload and r["batch"] == b and r["policy"] == policy), 0) for b in batches]
                ax.bar([i + (n - (len(policies) - 1) / 2) * width for i in range(len(batches))], values, width, label=policy)
            ax.set_xticks(range(len(batches)), [str(b) for b in batches])
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_title(f"{workload}: {title}")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--out", default="sims/out/compaction")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated: none, pravega, bounded, bounded:R (R = target ratio)")
    parser.add_argument("--updates", type=int, default=None,
                        help="random workload: updates to apply (default: as many keys as loaded)")
    args = parser.parse_args(argv)
    policies = tuple(args.policies.split(","))
    os.makedirs(args.out, exist_ok=True)
    configs = [(w, b, p, args.keys, args.updates) for w in args.workloads.split(",") for b in map(int, args.batches.split(",")) for p in policies]
    # Longest first: small random batches dominate.
    configs.sort(key=lambda c: (c[0] != "random", c[1]))
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        rows = list(pool.imap_unordered(_run_star, [(*c, i % args.jobs) for i, c in enumerate(configs)]))
    rows.sort(key=lambda r: (WORKLOADS.index(r["workload"]), r["batch"], policies.index(r["policy"])))
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{'workload':>10} {'batch':>6} {'policy':>8} {'storage MiB':>12} {'written MiB':>12} {'retained/live':>14} {'reduction':>10} {'vs pravega written':>19} {'s':>6}")
    for r in rows:
        base = next((x for x in rows if x["workload"] == r["workload"] and x["batch"] == r["batch"] and x["policy"] == "none"), r)
        pravega = next((x for x in rows if x["workload"] == r["workload"] and x["batch"] == r["batch"] and x["policy"] == "pravega"), r)
        reduction = 1 - r["storage_bytes"] / base["storage_bytes"]
        print(f"{r['workload']:>10} {r['batch']:>6} {r['policy']:>8} {r['storage_bytes'] / 2**20:>12.1f} {r['bytes_written'] / 2**20:>12.1f} "
              f"{r['retained_ratio']:>14.2f} {reduction:>10.1%} {r['bytes_written'] / pravega['bytes_written']:>18.2f}x {r['seconds']:>6}")
    plot(rows, policies, os.path.join(args.out, "compaction.png"))
    print(f"\nwrote {args.out}/results.csv and {args.out}/compaction.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
