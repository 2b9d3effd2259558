"""Memory bounded by options, not by the size of the index.

Loads and merges run in a child process whose data segment is limited (``RLIMIT_DATA``) to less
than what they would hold whole. The same work is run twice: with small ``piece_size`` and
``spill_bytes`` it must succeed under the limit, and with both set as large as the work
(everything held whole, as before the bounds) it must run out of memory under the same limit,
which shows the limit binds: were the bounds lost, the first run would fail too.

The page cache charges each decoded page its memory (``tree_index.page_memory``), measured here
as the ``sys.getsizeof`` sum of the page's objects: the charge never falls below it and stays
within ``CHARGE_FACTOR`` of it, and the pages a cache holds after lookups over a whole index take
no more than ``cache_bytes``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import weakref

from hypothesis import given, settings
from hypothesis import strategies as st

from attrindex.btree.page import decode_page, encode_index, encode_leaf, index_capacity, leaf_capacity
from attrindex.tree_index import TreeIndex, page_memory
from storage_adapters import open_storage

KEYS = 3_000_000  # 72 MB of pairs in columns, 72 MB of leaves
LIMIT = 96 << 20  # bytes of data segment above the child's size after its imports

_CHILD = textwrap.dedent("""
    import random, resource, sys
    from attrindex.tree_index import TreeIndex
    from storage_adapters import open_storage

    path, keys, limit, piece, spill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    index = TreeIndex(open_storage(path), cache_bytes=2 << 20, value_cache_entries=0, piece_size=piece)
    step = (1 << 128) // keys
    pairs = (((i * step).to_bytes(16, "big"), i) for i in range(keys))
    with open("/proc/self/status") as status:
        data = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
    resource.setrlimit(resource.RLIMIT_DATA, (data + limit, data + limit))
    try:
        assert index.bulk_load(pairs, spill_bytes=spill) == keys
        rng = random.Random(1)  # a merge that rewrites every leaf
        batch = {(rng.randrange(keys) * step).to_bytes(16, "big"): -1 for _ in range(20_000)}
        index.update(batch)
        assert len(index) == keys and index.get(next(iter(batch))) == -1
    except MemoryError:
        print("out of memory", flush=True)
        sys.exit(3)
    print("ok", flush=True)
""")


def _run(path: str, piece: int, spill: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD, path, str(KEYS), str(LIMIT), str(piece), str(spill)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_a_bulk_load_and_a_merge_of_every_leaf_stay_within_their_bounds(tmp_path):
    bounded = _run(str(tmp_path / "bounded"), 1 << 20, 16 << 20)
    assert bounded.returncode == 0 and bounded.stdout.strip() == "ok", bounded.stderr[-2000:]
    whole = _run(str(tmp_path / "whole"), 1 << 30, 1 << 40)
    assert whole.returncode == 3 and "out of memory" in whole.stdout, (whole.returncode, whole.stderr[-2000:])


# -- the page cache's charge -----------------------------------------------------------------------
#: The charge is calibrated on resident memory, which the allocator's rounding puts above the
#: ``getsizeof`` sum (a 49-byte key takes 64): it may exceed the sum by up to this factor
#: (a leaf of small shared ints, whose values take no memory of their own, comes closest).
CHARGE_FACTOR = 2.0


def page_objects_size(page) -> int:
    """``sys.getsizeof`` of a decoded page and of every object it holds alone: its lists, keys,
    ints (small ones are shared by the interpreter and hold nothing of the page's), a leaf's
    lookup dict and an index page's weak references to its children."""
    def ints(values):
        return sum(sys.getsizeof(v) for v in values if not -5 <= v <= 256)

    size = sys.getsizeof(page) + sys.getsizeof(page.keys) + sum(map(sys.getsizeof, page.keys))
    if page.is_leaf:
        page.get(page.keys[0])  # the first lookup builds the leaf's dict (the charge counts it)
        table = dict(zip(page.keys, page.values))  # a dict built the same way is the same size
        return size + sys.getsizeof(page.values) + ints(page.values) + sys.getsizeof(table)
    size += sum(sys.getsizeof(column) + ints(column) for column in (page.offsets, page.lengths, page.min_offsets))
    if page.children is not None:
        size += sys.getsizeof(page.children) + sum(sys.getsizeof(r) for r in page.children if r is not None)
    return size


class _Child:
    """Something for an index page's weak references to point at."""


VALUE_RANGES = {"small": (0, 256), "int32": (0, 1 << 31), "int64": (-(1 << 63), (1 << 63) - 1)}


@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([512, 4096, 32768]), fill=st.floats(0.0, 1.0), values=st.sampled_from(sorted(VALUE_RANGES)),
       leaf=st.booleans(), children=st.booleans(), seed=st.integers(0, 1 << 32))
def test_the_page_charge_tracks_the_decoded_page_size(page_size, fill, values, leaf, children, seed):
    rng = random.Random(seed)
    n = max(1, round(fill * (leaf_capacity if leaf else index_capacity)(page_size)))
    keys = sorted({rng.getrandbits(128).to_bytes(16, "big") for _ in range(n)})
    if leaf:
        low, high = VALUE_RANGES[values]
        page = decode_page(encode_leaf(keys, [rng.randint(low, high) for _ in keys], 0), 0)
    else:
        offsets = sorted(rng.randrange(1 << 40) for _ in keys)
        page = decode_page(encode_index(keys, offsets, [page_size] * len(keys), offsets, 0), 0)
        targets = [_Child() for _ in keys]
        if children:  # every child visited: a weak reference to each
            page.children = [weakref.ref(t) for t in targets]
    real = page_objects_size(page)
    assert real <= page_memory(page) <= CHARGE_FACTOR * real, (real, page_memory(page))


def test_the_page_cache_holds_at_most_cache_bytes_of_decoded_pages(tmp_path):
    cache_bytes = 2 << 20  # 128 KiB a shard: about four decoded leaves of 4 KiB
    index = TreeIndex(open_storage(str(tmp_path)), page_size=4096, cache_bytes=cache_bytes, value_cache_entries=0)
    rng = random.Random(3)
    keys = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(40_000)]
    index.bulk_load((key, rng.getrandbits(63)) for key in keys)
    rng.shuffle(keys)
    for key in keys:  # warm lookups over the whole key space: leaves churn through the cache
        assert index.get(key) is not None
    cache = index._page_cache
    held = cache.values()
    assert len(held) > 32 and any(page.is_leaf for page in held) and cache.usage <= cache_bytes
    assert sum(map(page_objects_size, held)) <= cache_bytes  # what the pages really hold, not their stored size
    assert index.stats().storage_reads > len(keys) // 2  # the index is many times the cache: lookups read
