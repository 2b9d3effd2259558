"""The ``attrindex`` command."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Sequence

from ._version import __version__
from .errors import AttrIndexError, BadOffsetError


def _demo(args: argparse.Namespace) -> int:
    """Show the storage layer at work; the full Spark pipeline demo is not built yet."""
    from storage_adapters import RollingSegment, open_storage

    print("attrindex demo: the Spark ingestion pipeline is not built yet (it arrives with the Spark")
    print("data source); this run shows the storage layer it stands on: compare-and-append and truncation.")
    with tempfile.TemporaryDirectory(prefix="attrindex-demo-") as tmp:
        url = args.path or tmp
        storage = open_storage(url)
        first, second = RollingSegment(storage, "demo", rolling_size=4096), RollingSegment(storage, "demo")
        first.delete()
        started, count = time.perf_counter(), 1000
        for i in range(count):
            first.append(b"event %06d\n" % i, expected_offset=first.length)
        elapsed = time.perf_counter() - started
        try:
            second.append(b"stale write\n", expected_offset=0)
            stale = "accepted (unexpected!)"
        except BadOffsetError as exc:
            stale = f"refused: {exc}"
        first.truncate(first.length // 2)
        print(f"  storage            {storage.url}")
        print(f"  appends            {count} compare-and-appends in {elapsed:.2f} s ({count / elapsed:,.0f}/s, each durable)")
        print(f"  stale writer       {stale}")
        print(f"  after truncation   start_offset={first.start_offset} length={first.length} chunks={len(first.chunks())}")
        print(f"  last record        {first.read(first.length - 13, 13)!r}")
        first.delete()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attrindex", description=__doc__)
    parser.add_argument("--version", action="version", version=f"attrindex {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser("demo", help="run the demonstration job")
    demo.add_argument("--path", help="storage URL to run in (default: a temporary directory)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except AttrIndexError as exc:
        print(f"attrindex: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
