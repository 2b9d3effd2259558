"""What a decoded B+tree page holds in memory, against what the page cache charges for it.

    python -m sims.bench.page_memory [--pages 1000] [--keys 1000000,3000000] [--cache-mib 64,256]

1. Per page: each kind of page (a full 32 KiB leaf with values of three ranges, with and without
   its lookup dict; an index page, with and without weak references to its children) is decoded
   ``--pages`` times in a fresh child process, and the growth of its resident set (``statm``) per
   page is compared with ``tree_index.page_memory``, the cache's charge.
2. Warm lookups over a whole key space: for each ``--keys`` size, a ``TreeIndex`` is bulk-loaded,
   then reopened in a fresh child with each ``--cache-mib`` page cache (recent-values cache off)
   and every key looked up once, in random order (at most ``--lookups``): the growth of the
   child's resident set against the cache's charged usage, pages held, storage reads.

Each measurement runs in a process of its own, so one's freed memory is not another's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

_PAGE_CHILD = r"""
import gc, json, os, random, sys, weakref
from attrindex.btree.page import decode_page, encode_index, encode_leaf, index_capacity, leaf_capacity
from attrindex.tree_index import page_memory

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

kind, values, extra, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rng = random.Random(1)
n = (leaf_capacity if kind == "leaf" else index_capacity)(32768)
encoded = []
for _ in range(8):
    keys = sorted(rng.getrandbits(128).to_bytes(16, "big") for _ in range(n))
    if kind == "leaf":
        low, high = {"small": (0, 255), "int32": (0, 1 << 31), "int64": (-(1 << 63), (1 << 63) - 1)}[values]
        encoded.append(encode_leaf(keys, [rng.randint(low, high) for _ in keys], 0))
    else:
        offsets = sorted(rng.randrange(1 << 40) for _ in keys)
        encoded.append(encode_index(keys, offsets, [32768] * n, offsets, 0))
targets = [[type("Child", (), {})() for _ in range(n)] for _ in range(count)] if extra == "children" else None
decode_page(encoded[0], 0)
gc.collect()
before = rss()
pages = []
for i in range(count):
    page = decode_page(encoded[i % 8], 0)
    if extra == "dict":
        page.get(page.keys[0])
    elif extra == "children":
        page.children = [weakref.ref(t) for t in targets[i]]
    pages.append(page)
grown = (rss() - before) / count
print(json.dumps({"page": f"{kind} {values} {extra}".strip(), "entries": n, "rss_per_page": grown,
                  "charge": page_memory(pages[0]), "charge_over_rss": page_memory(pages[0]) / grown}))
"""

_LOAD_CHILD = r"""
import random, sys
from attrindex.tree_index import TreeIndex
from storage_adapters import open_storage
path, n = sys.argv[1], int(sys.argv[2])
step = (1 << 128) // n
rng = random.Random(1)
index = TreeIndex(open_storage(path), value_cache_entries=0)
index.bulk_load((((i * step).to_bytes(16, "big"), rng.getrandbits(63)) for i in range(n)))
index.close()
"""

_WARM_CHILD = r"""
import gc, json, os, random, sys, time
from attrindex.tree_index import TreeIndex
from storage_adapters import open_storage

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

path, n, cache_bytes, lookups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
step = (1 << 128) // n
order = list(range(n))
random.Random(2).shuffle(order)
order = order[:lookups]
gc.collect()
before = rss()
index = TreeIndex(open_storage(path), value_cache_entries=0, cache_bytes=cache_bytes)
start = time.perf_counter()
for i in order:
    index.get((i * step).to_bytes(16, "big"))
elapsed = time.perf_counter() - start
gc.collect()
grown = rss() - before
cache = index._page_cache
held = cache.values()
print(json.dumps({"keys": n, "cache_mib": cache_bytes / 2**20, "lookups": len(order),
                  "rss_growth_mib": grown / 2**20, "charged_mib": cache.usage / 2**20,
                  "leaves_held": sum(p.is_leaf for p in held), "index_pages_held": sum(not p.is_leaf for p in held),
                  "storage_reads": index.stats().storage_reads, "lookups_per_s": len(order) / elapsed}))
"""


def _child(program: str, *args: object) -> dict | None:
    done = subprocess.run([sys.executable, "-c", program, *map(str, args)], capture_output=True, text=True, check=True)
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=1000)
    parser.add_argument("--keys", default="1000000,3000000")
    parser.add_argument("--cache-mib", default="64,256")
    parser.add_argument("--lookups", type=int, default=1_000_000)
    parser.add_argument("--dir", default=None, help="where the indexes go (default: a temp dir)")
    args = parser.parse_args(argv)
    print(f"{'page':<26}{'entries':>8}{'RSS/page':>11}{'charge':>9}{'charge/RSS':>12}")
    for kind, values, extra in [("leaf", v, e) for v in ("small", "int32", "int64") for e in ("", "dict")] + \
                               [("index", "", ""), ("index", "", "children")]:
        row = _child(_PAGE_CHILD, kind, values or "-", extra or "-", args.pages)
        print(f"{row['page'].replace(' -', ''):<26}{row['entries']:>8}{row['rss_per_page']:>11,.0f}{row['charge']:>9,}"
              f"{row['charge_over_rss']:>12.2f}")
    work = tempfile.mkdtemp(prefix="attrindex-page-memory-", dir=args.dir)
    try:
        print(f"\n{'keys':>10}{'cache MiB':>10}{'lookups':>10}{'RSS grown MiB':>14}{'charged MiB':>12}{'leaves':>8}"
              f"{'index pages':>12}{'reads':>10}{'lookups/s':>11}")
        for n in map(int, args.keys.split(",")):
            path = os.path.join(work, str(n))
            _child(_LOAD_CHILD, path, n)
            for mib in map(int, args.cache_mib.split(",")):
                row = _child(_WARM_CHILD, path, n, mib << 20, min(n, args.lookups))
                print(f"{row['keys']:>10,}{row['cache_mib']:>10.0f}{row['lookups']:>10,}{row['rss_growth_mib']:>14.1f}"
                      f"{row['charged_mib']:>12.1f}{row['leaves_held']:>8}{row['index_pages_held']:>12}"
                      f"{row['storage_reads']:>10,}{row['lookups_per_s']:>11,.0f}")
            shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
