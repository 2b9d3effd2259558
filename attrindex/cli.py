"""The ``attrindex`` command."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from typing import Sequence

import attrs

from ._version import __version__
from .errors import AttrIndexError, BadOffsetError, CorruptDataError, InvalidInputError


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


def parse_key(text: str) -> bytes | int | uuid.UUID:
    """A key typed on the command line: 32 hex digits, a UUID, a decimal int or 0x-prefixed hex."""
    cleaned = text.strip()
    if len(cleaned) == 32 and all(c in "0123456789abcdefABCDEF" for c in cleaned):
        return bytes.fromhex(cleaned)
    if len(cleaned) == 36 and cleaned.count("-") == 4:
        try:
            return uuid.UUID(cleaned)
        except ValueError:
            pass
    try:
        return int(cleaned, 0)
    except ValueError:
        raise InvalidInputError(f"cannot read {text!r} as a key: give 32 hex digits, a UUID or an integer") from None


def _parse_value(text: str) -> int | None:
    if text.lower() in ("none", "null", "-"):
        return None
    try:
        return int(text, 0)
    except ValueError:
        raise InvalidInputError(f"cannot read {text!r} as a value: give an integer, or 'none' to remove") from None


def _storage_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InvalidInputError(f"storage option {pair!r} must look like name=value")
        options[name] = value
    return options


def _open_index(args: argparse.Namespace):
    from .attribute_index import AttributeIndex

    return AttributeIndex.open(args.url, args.name, storage_options=_storage_options(args.storage_option), page_size=args.page_size)


def _index_stats(args: argparse.Namespace) -> int:
    stats = _open_index(args).stats()
    if args.json:
        print(json.dumps(attrs.asdict(stats), indent=2))
    else:
        for field, value in attrs.asdict(stats).items():
            print(f"{field:20} {value:,}")
    return 0


def _index_get(args: argparse.Namespace) -> int:
    index = _open_index(args)
    keys = [parse_key(text) for text in args.keys]
    for text, value in zip(args.keys, index.get_many(keys)):
        print(f"{text}\t{'absent' if value is None else value}")
    return 0


def _index_put(args: argparse.Namespace) -> int:
    updates = []
    for pair in args.pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidInputError(f"{pair!r} must look like KEY=VALUE (VALUE 'none' removes)")
        updates.append((parse_key(key), _parse_value(value)))
    index = _open_index(args)
    index.update(updates)
    print(f"updated {len(updates)} key(s); the index holds {len(index):,} entries")
    return 0


def _index_scan(args: argparse.Namespace) -> int:
    index = _open_index(args)
    start = None if args.start is None else parse_key(args.start)
    stop = None if args.stop is None else parse_key(args.stop)
    for n, (key, value) in enumerate(index.items(start, stop)):
        if args.limit is not None and n >= args.limit:
            break
        print(f"{key.hex()}\t{value}")
    return 0


def _index_verify(args: argparse.Namespace) -> int:
    index = _open_index(args)
    show = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show and (done % 256 == 0 or done == total):
            print(f"\rverifying pages {done:,}/{total:,}", end="", file=sys.stderr, flush=True)

    try:
        report = index.verify(progress)
    except CorruptDataError as exc:
        print(f"\nFAULT: {exc}", file=sys.stderr)
        return 3
    if show:
        print(file=sys.stderr)
    print(f"ok: {report.pages:,} pages, {report.entries:,} entries, {report.bytes:,} bytes, height {report.height}")
    return 0


def _add_index_commands(commands) -> None:
    index = commands.add_parser("index", help="inspect or change an attribute index")
    actions = index.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, run, help_text: str) -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=help_text)
        parser.add_argument("url", help="storage URL: a directory, file://, memory:// or s3://bucket/prefix")
        parser.add_argument("--name", default="attributes", help="the index's segment name (default: attributes)")
        parser.add_argument("--page-size", type=int, default=32768, help="page size for new pages (default 32768)")
        parser.add_argument("-o", "--storage-option", action="append", default=[], metavar="NAME=VALUE",
                            help="fsspec storage option, e.g. -o endpoint_url=http://127.0.0.1:9000 (repeatable)")
        parser.set_defaults(run=run)
        return parser

    action("stats", _index_stats, "print counts, storage use and I/O counters").add_argument("--json", action="store_true")
    action("get", _index_get, "print the values of keys").add_argument("keys", nargs="+", metavar="KEY")
    action("put", _index_put, "apply KEY=VALUE updates as one durable update").add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    scan = action("scan", _index_scan, "print entries in key order: hex key, tab, value")
    scan.add_argument("--start", help="first key (inclusive)")
    scan.add_argument("--stop", help="end key (exclusive)")
    scan.add_argument("--limit", type=int, help="print at most this many entries")
    action("verify", _index_verify, "read every live page, check checksums and ordering; exit 3 on a fault")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attrindex", description=__doc__)
    parser.add_argument("--version", action="version", version=f"attrindex {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser("demo", help="run the demonstration job")
    demo.add_argument("--path", help="storage URL to run in (default: a temporary directory)")
    demo.set_defaults(run=_demo)
    _add_index_commands(commands)
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
