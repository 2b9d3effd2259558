"""The ``attrindex index`` commands: inspect or change an attribute index."""

from __future__ import annotations

import argparse
import json
import sys

import attrs

from .cli_errors import EXIT_CODES_HELP
from .cli_options import (KEYS_HELP, check_count, debug_option, parse_key, parse_value, print_damage, storage_options,
                          verify_progress)
from .errors import InvalidInputError

def _open_index(args: argparse.Namespace, mode: str):
    from .attribute_index import AttributeIndex

    return AttributeIndex.open(args.url, args.name, mode=mode, storage_options=storage_options(args),
                               page_size=args.page_size)


def _index_stats(args: argparse.Namespace) -> int:
    with _open_index(args, "r") as index:
        stats = index.stats()
    if args.json:
        print(json.dumps(attrs.asdict(stats), indent=2))
    else:
        for field, value in attrs.asdict(stats).items():
            if isinstance(value, dict):  # the storage requests, by kind
                value = ", ".join(f"{kind} {count:,}" for kind, count in value.items())
            print(f"{field:20} {value:,}" if isinstance(value, int) else f"{field:20} {value}")
    return 0


def _index_get(args: argparse.Namespace) -> int:
    keys = [parse_key(text) for text in args.keys]
    with _open_index(args, "r") as index:
        values = index.get_many(keys)
    for text, value in zip(args.keys, values):
        print(f"{text}\t{'absent' if value is None else value}")
    return 0


def _index_put(args: argparse.Namespace) -> int:
    updates = []
    for pair in args.pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidInputError(f"{pair!r} must look like KEY=VALUE (VALUE 'none' removes)")
        updates.append((parse_key(key), parse_value(value)))
    with _open_index(args, "a") as index:
        index.update(updates)
        print(f"updated {len(updates)} key(s); the index holds {len(index):,} entries")
    return 0


def _index_scan(args: argparse.Namespace) -> int:
    check_count(args.limit, "--limit")
    start = None if args.start is None else parse_key(args.start)
    stop = None if args.stop is None else parse_key(args.stop)
    with _open_index(args, "r") as index:
        for n, (key, value) in enumerate(index.items(start, stop)):
            if args.limit is not None and n >= args.limit:
                break
            print(f"{key.hex()}\t{value}")
    return 0


def _index_verify(args: argparse.Namespace) -> int:
    from .attribute_index import AttributeIndex

    progress, show = verify_progress("pages")
    # verify_at works on an index that refuses to open (a damaged newest footer).
    report = AttributeIndex.verify_at(args.url, args.name, storage_options=storage_options(args), progress=progress)
    if show:
        print(file=sys.stderr)
    if not report.ok:
        return print_damage(report.damage, args.url)
    print(f"ok: {report.pages:,} pages, {report.entries:,} entries, {report.bytes:,} bytes, height {report.height}")
    return 0


def _index_repair(args: argparse.Namespace) -> int:
    from .attribute_index import AttributeIndex

    report = AttributeIndex.repair_at(args.url, args.name, storage_options=storage_options(args))
    wal = getattr(report, "wal", None)  # the write-ahead log's repair (AttributeIndex)
    if wal is not None and wal.repaired:
        from .segment_repair import describe_repair

        print(f"repaired the write-ahead log: {describe_repair(wal)}")
    if getattr(report, "merged_updates_lost", False):
        print("lost: the kept tree version is older than the write-ahead log's start; the updates merged in "
              "between are gone")
    if not report.rolled_back:
        if not (wal is not None and wal.repaired):
            print("ok: the newest version is intact; nothing was changed")
        return 0
    before = "unknown" if report.entries_before is None else f"{report.entries_before:,}"
    print(f"repaired: rolled back {report.updates_dropped} update(s) (bytes [{report.lost_start}, {report.lost_end}) "
          f"no longer count); entries {before} -> {report.entries_after:,}")
    return 0


_INDEX_HELP = """\
Inspect or change an attribute index: 16-byte keys, signed 64-bit values. Only 'put' creates an
index; the other commands need an existing one (exit 4 if there is none at URL)."""


def add_index_commands(commands) -> None:
    index = commands.add_parser("index", help="inspect or change an attribute index", description=_INDEX_HELP,
                                epilog=KEYS_HELP + "\n" + EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    debug_option(index)
    actions = index.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, run, help_text: str) -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                                    epilog=KEYS_HELP + "\n" + EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
        debug_option(parser)
        parser.add_argument("url", help="storage URL: a directory, file:// or s3://bucket/prefix")
        parser.add_argument("--name", default="attributes", help="the index's segment name (default: attributes)")
        parser.add_argument("--page-size", type=int, default=32768, help="page size for new pages (default 32768)")
        parser.add_argument("-o", "--storage-option", action="append", default=[], metavar="NAME=VALUE",
                            help="fsspec storage option, e.g. -o endpoint_url=http://127.0.0.1:9000 (repeatable)")
        parser.set_defaults(run=run)
        return parser

    action("stats", _index_stats, "print counts, storage use and I/O counters").add_argument("--json", action="store_true")
    action("get", _index_get, "print the values of keys").add_argument("keys", nargs="+", metavar="KEY")
    action("put", _index_put, "apply KEY=VALUE updates as one durable update (creates the index if missing)").add_argument(
        "pairs", nargs="+", metavar="KEY=VALUE")
    scan = action("scan", _index_scan, "print entries in key order: hex key, tab, value")
    scan.add_argument("--start", help="first key (inclusive)")
    scan.add_argument("--stop", help="end key (exclusive)")
    scan.add_argument("--limit", type=int, metavar="N", help="print at most N entries (N >= 1)")
    action("verify", _index_verify, "read every committed byte, print every damaged range; exit 3 if any")
    action("repair", _index_repair, "roll a damaged index back to its newest intact version, saying what is lost")
