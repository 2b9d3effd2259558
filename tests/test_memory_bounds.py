"""Memory bounded by options, not by the size of the index: loads and merges in a child process
whose data segment is limited (``RLIMIT_DATA``) to less than what they would hold whole.

The same work is run twice: with small ``piece_size`` and ``spill_bytes`` it must succeed under
the limit, and with both set as large as the work (everything held whole, as before the bounds)
it must run out of memory under the same limit, which shows the limit binds: were the bounds
lost, the first run would fail too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
