"""The key filter of sorted runs (``attrindex.btree.key_filter``) against rbloom and a Python set.

    python -m sims.bench.key_filter [--keys 10000000] [--members 1000000] [--lookups 200000]
                                    [--fpr-keys 1000000] [--rounds 3]

Each measurement runs in a child process of its own (one engine, one task), rounds interleaved
with the engines' order rotated; each cell is the median of the rounds, and the ratios against a
peer are printed round by round too (>1: attrindex better).

* ``build``: a filter of ``--keys`` random 16-byte keys at 10 bits per key, keys/s. attrindex
  takes the keys as one numpy ``S16`` array; rbloom (``pip install rbloom``, a Rust filter with
  Python's set API, sized for the false-positive rate of 10 bits per key) takes ``bytes`` objects,
  made from the same array a block at a time, inside the timing (its input has to be objects).
* ``lookup``: one call per key (``may_contain``; ``in`` for rbloom and a ``set``), µs per call,
  over ``--lookups / 2`` of the ``--members`` the filter (or set) holds, then as many other keys
  (a lookup in a run without the key stops at its first clear bit); ``may_contain_many`` over
  the same keys as one array, keys/s. Each the fastest of 5 passes.
* ``fpr``: the false-positive rate at 8, 10 and 12 bits per key, over ``--fpr-keys`` keys and as
  many others, random keys and sequential integers (big-endian). One round: attrindex's filter
  is deterministic (rbloom's hash is Python's, seeded per process).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import numpy as np

ENGINES = ("attrindex", "rbloom", "set")
FPR_BITS = (8, 10, 12)
BLOCK = 1 << 16


def random_keys(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 16), np.uint8).view("S16").reshape(-1)


def sequential_keys(start: int, n: int) -> np.ndarray:
    words = np.zeros((n, 2), ">u8")
    words[:, 1] = np.arange(start, start + n, dtype=np.uint64)
    return words.view("S16").reshape(-1)


def as_bytes(keys: np.ndarray):
    """The keys as ``bytes`` objects, a block at a time (numpy drops an element's trailing zeros)."""
    for start in range(0, len(keys), BLOCK):
        buf = keys[start:start + BLOCK].tobytes()
        yield from (buf[i:i + 16] for i in range(0, len(buf), 16))


def theory_rate(bits_per_key: int) -> float:
    k = max(1, round(math.log(2) * bits_per_key))
    return (1 - math.exp(-k / bits_per_key)) ** k


def make(engine: str, keys: np.ndarray, bits_per_key: int):
    """``(filter, membership test of one bytes key, bytes the filter holds)``."""
    if engine == "attrindex":
        from attrindex.btree.key_filter import build_filter

        built = build_filter(keys, bits_per_key)
        return built, built.may_contain, built.nbytes
    if engine == "rbloom":
        from rbloom import Bloom

        built = Bloom(max(len(keys), 1), theory_rate(bits_per_key))
        built.update(as_bytes(keys))
        return built, built.__contains__, built.size_in_bits // 8
    built = set(as_bytes(keys))
    return built, built.__contains__, sys.getsizeof(built)


def child(engine: str, task: str, options: dict) -> dict:
    make(engine, random_keys(0, 1000), 10)  # imports and first calls before any timing
    if task == "build":
        keys = random_keys(1, options["keys"])
        start = time.perf_counter()
        _built, _test, size = make(engine, keys, 10)
        seconds = time.perf_counter() - start
        return {"keys_per_s": len(keys) / seconds, "bytes_per_key": size / len(keys)}
    if task == "lookup":
        members = random_keys(2, options["members"])
        built, test, _size = make(engine, members, 10)
        half = options["lookups"] // 2
        result = {}
        for name, probes in (("member", members[:half]), ("other", random_keys(3, half))):
            objects = list(as_bytes(probes))
            result[f"us_{name}"] = fastest(lambda: [test(key) for key in objects]) / len(objects) * 1e6
            if engine == "attrindex":
                result[f"many_{name}_keys_per_s"] = len(probes) / fastest(lambda: built.may_contain_many(probes))
        return result
    n = options["fpr_keys"]
    result = {}
    for kind, (members, others) in (("random", (random_keys(5, n), random_keys(6, n))),
                                    ("sequential", (sequential_keys(0, n), sequential_keys(n, n)))):
        for bits in FPR_BITS:
            built, test, size = make(engine, members, bits)
            if engine == "attrindex":
                positives = int(built.may_contain_many(others).sum())
            else:
                positives = sum(map(test, as_bytes(others)))
            result[f"fpr_{kind}_{bits}"] = positives / n
            result[f"bits_{kind}_{bits}"] = size * 8 / n
    return result


def fastest(work, passes: int = 5) -> float:
    """The least time of ``passes`` calls of ``work``, in seconds (the one least disturbed by
    other processes)."""
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def run_child(engine: str, task: str, options: dict) -> dict | None:
    done = subprocess.run([sys.executable, "-m", "sims.bench.key_filter", "--child", engine, task, json.dumps(options)],
                          stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode:
        print(f"{engine} {task}: the child failed (exit {done.returncode})")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def installed(engine: str) -> bool:
    if engine != "rbloom":
        return True
    try:
        import rbloom  # noqa: F401
    except ImportError:
        print("rbloom is not installed (pip install rbloom): skipped")
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--members", type=int, default=1_000_000)
    parser.add_argument("--lookups", type=int, default=200_000)
    parser.add_argument("--fpr-keys", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], json.loads(args.child[2]))))
        return
    options = {"keys": args.keys, "members": args.members, "lookups": args.lookups, "fpr_keys": args.fpr_keys}
    engines = [e for e in ENGINES if installed(e)]
    tasks = {"build": [e for e in engines if e != "set"], "lookup": engines,
             "fpr": [e for e in engines if e != "set"]}
    rounds: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for task, names in tasks.items():
            if task == "fpr" and r:
                continue
            for engine in names[r % len(names):] + names[:r % len(names)]:
                result = run_child(engine, task, options)
                if result is not None:
                    rounds.setdefault((engine, task), []).append(result)
                    print(f"round {r + 1} {task:6} {engine:9} " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()),
                          flush=True)
    report(rounds, engines, args)


def report(rounds: dict, engines: list[str], args) -> None:
    def median(engine, task, field):
        values = [row[field] for row in rounds.get((engine, task), []) if field in row]
        return statistics.median(values) if values else math.nan

    print(f"\nmedians of {args.rounds} rounds (fpr: one round)")
    rows = [("build keys/s", "build", "keys_per_s", True, f"{args.keys:,} keys, 10 bits/key"),
            ("build bytes/key", "build", "bytes_per_key", False, ""),
            ("member µs/call", "lookup", "us_member", False, f"{args.lookups // 2:,} members of {args.members:,}"),
            ("other µs/call", "lookup", "us_other", False, f"{args.lookups // 2:,} other keys"),
            ("member keys/s", "lookup", "many_member_keys_per_s", True, "may_contain_many, the same keys"),
            ("other keys/s", "lookup", "many_other_keys_per_s", True, "may_contain_many, the same keys")]
    print(f"{'':18}" + "".join(f"{e:>14}" for e in engines) + "".join(f"{'vs ' + e:>12}" for e in engines[1:]))
    for label, task, field, higher, note in rows:
        ours = median("attrindex", task, field)
        cells = "".join(f"{median(e, task, field):>14.4g}" for e in engines)
        ratios = "".join(f"{ratio(ours, median(e, task, field), higher):>12}" for e in engines[1:])
        print(f"{label:18}{cells}{ratios}  {note}")
    for task, field, higher in (("build", "keys_per_s", True), ("lookup", "us_member", False), ("lookup", "us_other", False)):
        for peer in engines[1:]:
            pairs = list(zip(rounds.get(("attrindex", task), []), rounds.get((peer, task), [])))
            if pairs:
                print(f"  {field} vs {peer}, round by round: "
                      + ", ".join(ratio(o[field], p[field], higher) for o, p in pairs))
    print("\nfalse positives (bits/key actually used in brackets; theory for k = round(ln2 * bits/key))")
    print(f"{'':22}" + "".join(f"{e:>20}" for e in engines if ("fpr" in {t for (x, t) in rounds if x == e})) + f"{'theory':>10}")
    for kind in ("random", "sequential"):
        for bits in FPR_BITS:
            cells = ""
            for engine in engines:
                row = rounds.get((engine, "fpr"), [None])[0]
                if row is not None:
                    cells += f"{row[f'fpr_{kind}_{bits}'] * 100:>12.3f}% ({row[f'bits_{kind}_{bits}']:4.1f})"
            print(f"{kind + ' ' + str(bits) + ' bits/key':22}{cells}{theory_rate(bits) * 100:>9.3f}%")
    print("(ratios: >1 means attrindex is better)")


def ratio(ours: float, theirs: float, higher_better: bool) -> str:
    if not ours or not theirs or math.isnan(ours) or math.isnan(theirs):
        return "-"
    return f"{(ours / theirs if higher_better else theirs / ours):.2f}x"


if __name__ == "__main__":
    main()
