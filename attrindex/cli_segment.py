"""The ``attrindex segment`` commands: append to, read, follow and maintain segments.

Exit codes as for every command (cli_errors.py). Ctrl-C ends ``tail`` with 0: it is how a tail
without --max or --timeout ends."""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import json
import signal
import sys
import textwrap
import threading
from typing import Any, Iterator

import attrs

from .cli_errors import EXIT_CODES_HELP
from .cli_options import (check_count, debug_option, parse_duration, parse_key, parse_size, parse_value, print_damage,
                          storage_options)
from .errors import AttrIndexError, InvalidInputError, SegmentNotFoundError, StoreNotFoundError

_READ_PAGE = 1000

_READ_FORMATS_HELP = """\
output formats:
  text  one line per record: offset, timestamp (ms), key and value, separated by tabs. A key or
        value is shown as UTF-8 text when it decodes as UTF-8 and holds no control characters
        (tabs, newlines...) and does not start with "0x"; otherwise as 0x followed by its bytes
        in hex. A record without a key has an empty key column. A tombstone (a record that
        deletes its key: value null) shows "(tombstone)" as its value, and a value that is
        those very characters is shown in hex. Headers are not shown.
  json  one JSON object per line: {"offset", "timestamp", "key", "value", "headers"}. A key or
        value that is valid UTF-8 is a JSON string; one that is not is given base64-encoded
        under "key_base64" / "value_base64" instead (and "key" / "value" is then absent). A
        record without a key has "key": null, a tombstone "value": null. "headers" is a list of {"name", "value"} objects,
        a header value that is not UTF-8 given as "value_base64" likewise.
"""


def _shown(data: bytes | None) -> str:
    """Bytes for the text format: UTF-8 text if that is unambiguous on one line, else 0x + hex."""
    if data is None:
        return ""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + data.hex()
    if text.startswith("0x") or any(c < " " or c == "\x7f" or "\x80" <= c <= "\x9f" or c in "\u2028\u2029" for c in text):
        return "0x" + data.hex()
    return text


def _json_field(out: dict, name: str, data: bytes | None) -> None:
    if data is None:
        out[name] = None
        return
    try:
        out[name] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[f"{name}_base64"] = base64.b64encode(data).decode("ascii")


_TOMBSTONE = "(tombstone)"


def _shown_value(value: bytes | None) -> str:
    if value is None:
        return _TOMBSTONE
    shown = _shown(value)
    return "0x" + value.hex() if shown == _TOMBSTONE else shown


def _format_record(record, fmt: str) -> str:
    if fmt == "json":
        out: dict = {"offset": record.offset, "timestamp": record.timestamp}
        _json_field(out, "key", record.key)
        _json_field(out, "value", record.value)
        headers = []
        for name, value in record.headers:
            header = {"name": name}
            _json_field(header, "value", value)
            headers.append(header)
        out["headers"] = headers
        return json.dumps(out, ensure_ascii=False)
    return f"{record.offset}\t{record.timestamp}\t{_shown(record.key)}\t{_shown_value(record.value)}"


@contextlib.contextmanager
def _open_store(args: argparse.Namespace, *, writes: bool, create: bool = False, missing: str | None = None) -> Iterator:
    """The ``SegmentStore`` at ``args.url``; a missing one is ``StoreNotFoundError`` (with the hint
    ``missing``) unless ``create``. Commands that only read release the storage without closing the segment handles:
    closing a handle merges the attribute updates it replayed from the log into the B+tree, which
    is a write, and a reader should never write."""
    from .store import SegmentStore

    try:
        store = SegmentStore.open(args.url, storage_options=storage_options(args),
                                   mode="a" if create else "r+")
    except StoreNotFoundError as exc:
        if missing is None:
            raise
        raise StoreNotFoundError(f"{exc}; {missing}") from None
    try:
        yield store
    finally:
        if writes:
            store.close()
        else:
            store.storage.close()


def _attribute_updates(pairs: list[str]) -> list:
    from .conditional import AttributeUpdate, UpdateType

    updates = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidInputError(f"--attribute {pair!r} must look like KEY=VALUE (VALUE 'none' removes)")
        updates.append(AttributeUpdate(parse_key(key), UpdateType.REPLACE, parse_value(value)))
    return updates


def _stdin_values() -> Iterator[bytes]:
    """One value per line of standard input (read as bytes), without its line ending."""
    stream = getattr(sys.stdin, "buffer", None)
    lines = stream if stream is not None else (line.encode("utf-8") for line in sys.stdin)
    for line in lines:
        if line.endswith(b"\n"):
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
        yield line


def _batches(values, size: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for value in values:
        batch.append(value)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _ranges(ranges: list[list[int]]) -> str:
    return ", ".join(f"{first}..{last}" for first, last in ranges)


_POLICY_OPTIONS = {"cleanup_policy": "--cleanup-policy", "min_compaction_lag_ms": "--min-compaction-lag",
                   "tombstone_retention_ms": "--tombstone-retention", "retention_ms": "--retention",
                   "retention_bytes": "--retention-bytes"}


def _policy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The cleanup-policy options given (``CleanupPolicy``'s names), checked before anything is opened."""
    from .log.cleanup_policy import policy_from_options

    options: dict[str, Any] = {}
    if args.cleanup_policy is not None:
        options["cleanup_policy"] = args.cleanup_policy
    for name, text in (("min_compaction_lag_ms", args.min_compaction_lag),
                       ("tombstone_retention_ms", args.tombstone_retention), ("retention_ms", args.retention)):
        if text is not None:
            options[name] = None if name == "retention_ms" and text.lower() == "none" else parse_duration(text)
    if args.retention_bytes is not None:
        options["retention_bytes"] = None if args.retention_bytes.lower() == "none" else parse_size(args.retention_bytes)
    policy_from_options(options)  # bad values: InvalidInputError now, naming the field
    return options


def _shown_policy(policy) -> str:
    def ms(value: int | None) -> str:
        return "none" if value is None else f"{value:,} ms"

    return (f"cleanup_policy {policy.cleanup_policy}, min_compaction_lag {ms(policy.min_compaction_lag_ms)}, "
            f"tombstone_retention {ms(policy.tombstone_retention_ms)}, retention {ms(policy.retention_ms)}, "
            f"retention_bytes {'none' if policy.retention_bytes is None else f'{policy.retention_bytes:,}'}")


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C inside the block is held until the block is done, then raised: an append is either
    done or never started when the command stops, so what it reports as appended is exact."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield  # (Ctrl-C is ignored, or handled by whoever runs this)
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def _segment_append(args: argparse.Namespace) -> int:
    from .log.batch.compression import codec_for
    from .log.batch.records import Record

    # Everything the user typed is checked before the store is touched, so bad input creates nothing.
    check_count(args.batch, "--batch")
    check_count(args.expected_offset, "--expected-offset", 0)
    updates = _attribute_updates(args.attribute)
    codec = None if args.codec is None else codec_for(args.codec)
    key = None if args.key is None else args.key.encode("utf-8", "surrogateescape")
    policy = _policy_options(args)
    if policy and not args.create:
        raise InvalidInputError(f"{', '.join(_POLICY_OPTIONS[n] for n in policy)} set the policy of a segment "
                                "'append --create' creates; 'attrindex segment configure' changes an existing one's")
    if args.tombstone:
        if key is None or args.values:
            raise InvalidInputError("--tombstone appends one tombstone (a record with no value: it deletes its key "
                                    "when the segment is compacted) and needs --key and no VALUE")
        values: Any = [None]
    elif args.values:
        values = [v.encode("utf-8", "surrogateescape") for v in args.values]
    else:
        values = _stdin_values()

    ranges: list[list[int]] = []  # [first, last] offsets appended, merged where contiguous
    count = 0
    with _open_store(args, writes=True, create=args.create,
                     missing=f"give --create to create the store and segment {args.name!r}") as store:
        try:
            segment = store.segment(args.name, create=args.create, **policy)
        except SegmentNotFoundError as exc:
            raise SegmentNotFoundError(f"{exc} (give --create to create it)") from None
        except InvalidInputError as exc:  # a policy unlike the existing segment's
            raise InvalidInputError(str(exc).replace("Segment.configure", "'attrindex segment configure'")) from None
        expected = args.expected_offset
        pending = updates
        try:
            for batch in _batches(values, args.batch):
                records = batch if key is None else [Record(value=v, key=key) for v in batch]
                with _interrupts_held():  # (a Ctrl-C meanwhile is raised after the bookkeeping too)
                    result = segment.append(records, pending, expected, timestamp=args.timestamp, codec=codec)
                    pending = []
                    if expected is not None:  # keep the whole run contiguous, as the user asked for the first offset
                        expected = result.last_offset + 1
                    count += result.record_count
                    if ranges and ranges[-1][1] + 1 == result.first_offset:
                        ranges[-1][1] = result.last_offset
                    else:
                        ranges.append([result.first_offset, result.last_offset])
        except (AttrIndexError, OSError):
            if count:  # the earlier batches are durable: say so next to the error
                print(f"attrindex: appended {count} records at offsets {_ranges(ranges)} before the error below", file=sys.stderr)
            raise
        except KeyboardInterrupt:  # between two appends (_interrupts_held): count is exact
            given = "VALUEs" if args.values else "lines of the input"
            if count:
                print(f"attrindex: interrupted: appended {count} records at offsets {_ranges(ranges)}, the first "
                      f"{count} {given}; nothing after them was appended (resume from the {_ordinal(count + 1)})",
                      file=sys.stderr)
            else:
                print("attrindex: interrupted: nothing was appended", file=sys.stderr)
            raise
        if pending:  # no records at all: the attribute updates go alone
            with _interrupts_held():
                segment.append((), pending, expected, timestamp=args.timestamp, codec=codec)
        next_offset = segment.next_offset
    with_updates = f" with {len(updates)} attribute update(s)" if updates else ""
    if count:
        print(f"appended {count} records at offsets {_ranges(ranges)}{with_updates}")
    else:
        print(f"appended 0 records{with_updates}; next offset {next_offset}")
    return 0


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _read_start(segment, args: argparse.Namespace) -> int | None:
    """The offset a read starts at, or None if ``--timestamp`` is newer than every record."""
    if args.timestamp is not None:
        return segment.offset_for_timestamp(args.timestamp)
    return segment.start_offset if args.offset is None else args.offset


def _segment_read(args: argparse.Namespace) -> int:
    check_count(args.max, "--max")
    check_count(args.offset, "--offset", 0)
    with _open_store(args, writes=False) as store:
        segment = store.segment(args.name)
        offset = _read_start(segment, args)
        remaining = args.max
        write = sys.stdout.write
        while offset is not None and (remaining is None or remaining > 0):
            records = segment.read(offset, _READ_PAGE if remaining is None else min(_READ_PAGE, remaining))
            if not records:
                break
            for record in records:
                write(_format_record(record, args.format) + "\n")
            offset = records[-1].offset + 1
            if remaining is not None:
                remaining -= len(records)
        sys.stdout.flush()
    return 0


def _segment_tail(args: argparse.Namespace) -> int:
    check_count(args.max, "--max")
    check_count(args.offset, "--offset", 0)
    if args.timeout is not None and not 0 <= args.timeout < float("inf"):  # nan too: it would never time out
        raise InvalidInputError(f"--timeout must be at least 0 seconds and finite, got {args.timeout}")
    with _open_store(args, writes=False) as store:
        segment = store.segment(args.name)
        if args.from_end:
            reader = segment.reader(offset=segment.next_offset)
        elif args.timestamp is not None:
            reader = segment.reader(timestamp=args.timestamp)
        else:
            reader = segment.reader(offset=args.offset)
        try:
            printed = 0
            while args.max is None or printed < args.max:
                record = reader.read(args.timeout)
                if record is None:  # --timeout seconds without a new record
                    break
                print(_format_record(record, args.format), flush=True)
                printed += 1
        finally:  # Ctrl-C included: it is how a tail without --max or --timeout ends (exit 0, see _guarded)
            reader.cancel()
    return 0


def _shown_timestamp(ms: int | None) -> str:
    if ms is None:
        return "-"
    try:
        moment = datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return str(ms)
    return f"{ms} ({moment.isoformat(timespec='milliseconds').replace('+00:00', 'Z')})"


_ATTRIBUTE_FIGURES = ("entry_count", "page_count", "height", "storage_bytes", "live_bytes")


def _segment_stats(args: argparse.Namespace) -> int:
    with _open_store(args, writes=False) as store:
        segment = store.segment(args.name)
        stats = segment.stats()
        policy, dirty = segment.cleanup_policy(), segment.dirty_ratio()
    if args.json:
        print(json.dumps({**attrs.asdict(stats), "cleanup_policy": attrs.asdict(policy), "dirty_ratio": dirty},
                         indent=2))
        return 0
    rows = [
        ("name", stats.name),
        ("start_offset", f"{stats.start_offset:,}"),
        ("next_offset", f"{stats.next_offset:,}"),
        ("records", f"{stats.next_offset - stats.start_offset:,}"),
        ("log_bytes", f"{stats.log_bytes:,}"),
        ("log_chunks", f"{stats.log_chunks:,}"),
        ("max_timestamp", _shown_timestamp(stats.max_timestamp)),
        ("pending_attributes", f"{stats.pending_attributes:,}"),
        ("attribute_checkpoint", "-" if stats.attribute_checkpoint is None else f"{stats.attribute_checkpoint:,}"),
        ("cleanup_policy", policy.cleanup_policy),
        ("dirty_ratio", f"{dirty:.3f}"),
    ]
    rows += [(f"attributes.{field}", f"{getattr(stats.attributes, field):,}") for field in _ATTRIBUTE_FIGURES]
    for field, value in rows:
        print(f"{field:26} {value}")
    return 0


def _segment_retention(args: argparse.Namespace) -> int:
    max_age = None if args.max_age is None else parse_duration(args.max_age)
    max_bytes = None if args.max_bytes is None else parse_size(args.max_bytes)
    check_count(args.start_offset, "--start-offset", 0)
    if max_age is None and max_bytes is None and args.start_offset is None:
        raise InvalidInputError("retention needs at least one rule: --max-age, --max-bytes or --start-offset")
    with _open_store(args, writes=True) as store:
        segment = store.segment(args.name)
        before = segment.start_offset
        deleted = segment.apply_retention(max_age_ms=max_age, max_bytes=max_bytes, start_offset=args.start_offset)
        after, end = segment.start_offset, segment.next_offset
    print(f"deleted {deleted} chunk(s); start offset {before} -> {after} ({end - after:,} records remain)")
    return 0


def _segment_compact(args: argparse.Namespace) -> int:
    min_lag = None if args.min_lag is None else parse_duration(args.min_lag)
    retention = None if args.tombstone_retention is None else parse_duration(args.tombstone_retention)
    with _open_store(args, writes=True) as store:
        segment = store.segment(args.name)
        stats = segment.compact(min_lag_ms=min_lag, tombstone_retention_ms=retention)
        dirty = segment.dirty_ratio()
    print(f"compacted {stats.chunks_cleaned} chunk(s): {stats.records_before:,} -> {stats.records_after:,} records, "
          f"{stats.bytes_before:,} -> {stats.bytes_after:,} bytes, {stats.tombstones_removed:,} tombstone(s) removed; "
          f"cleaner checkpoint {stats.checkpoint:,}; dirty ratio now {dirty:.3f}")
    return 0


def _segment_configure(args: argparse.Namespace) -> int:
    options = _policy_options(args)
    with _open_store(args, writes=True) as store:
        segment = store.segment(args.name)
        if not options:
            print(_shown_policy(segment.cleanup_policy()))
            return 0
        policy = segment.configure(**options)
    print(f"configured: {_shown_policy(policy)}")
    return 0


def _add_policy_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cleanup-policy", choices=("delete", "compact", "delete,compact"),
                        help="delete: retention only (the default); compact: keep the latest record of each key "
                             "('segment compact'); delete,compact: both")
    parser.add_argument("--min-compaction-lag", metavar="DURATION",
                        help="records younger than this are never compacted: 90s, 15m, 12h, 7d (default 0)")
    parser.add_argument("--tombstone-retention", metavar="DURATION",
                        help="keep a tombstone this long after compaction first rewrote it (default 1d)")
    parser.add_argument("--retention", metavar="DURATION",
                        help="with delete,compact: the age limit 'segment compact' applies first, or 'none'")
    parser.add_argument("--retention-bytes", metavar="SIZE",
                        help="with delete,compact: the size limit 'segment compact' applies first, or 'none'")


def _segment_list(args: argparse.Namespace) -> int:
    from .store import validate_name

    prefix = args.prefix.strip("/")
    if prefix:
        validate_name(prefix, "prefix")  # also keeps '..' from listing outside the store
    with _open_store(args, writes=False) as store:
        for name in store.segments(prefix):
            print(name)
    return 0


def _segment_verify(args: argparse.Namespace) -> int:
    with _open_store(args, writes=False) as store:
        report = store.verify_segment(args.name)
    if not report.ok:
        return print_damage(report.damage, f"{args.url} segment {args.name!r}")
    print(f"ok: {report.batches:,} batches, {report.records:,} records, {report.log_bytes:,} log bytes, "
          f"{report.index_files:,} chunk index files, {report.gaps:,} gaps from earlier repairs")
    return 0


def _segment_consolidate(args: argparse.Namespace) -> int:
    target = None if args.target_size is None else parse_size(args.target_size)
    with _open_store(args, writes=True) as store:
        segment = store.segment(args.name)
        before = segment.stats().log_chunks
        merged = segment.consolidate(target)
        after = segment.stats().log_chunks
    print(f"merged {merged} runs of small chunks: {before:,} chunks before, {after:,} after")
    return 0


def _segment_repair(args: argparse.Namespace) -> int:
    from .segment_repair import describe_repair

    with _open_store(args, writes=True) as store:
        report = store.repair_segment(args.name)
    if not report.repaired:
        print("ok: no damage found; nothing was changed")
    else:
        print(f"repaired: {describe_repair(report)}")
    return 0


def add_segment_commands(commands) -> None:
    segment = commands.add_parser("segment", help="append to, read, follow or inspect segments",
                                  description="Append to, read, follow or inspect the segments of a store. Only "
                                  "'append --create' creates a store or segment; the other commands need existing ones.",
                                  epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    debug_option(segment)
    actions = segment.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, run, help_text: str, *, named: bool = True, epilog: str = "") -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=help_text, description=textwrap.fill(help_text[0].upper() + help_text[1:] + ".", 78),
                                    epilog=(epilog + "\n" if epilog else "") + EXIT_CODES_HELP,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        debug_option(parser)
        parser.add_argument("url", metavar="URL", help="storage URL: a directory, file:// or s3://bucket/prefix")
        if named:
            parser.add_argument("name", metavar="NAME", help="the segment's name, e.g. orders or orders/0")
        parser.add_argument("-o", "--storage-option", action="append", default=[], metavar="NAME=VALUE",
                            help="fsspec storage option, e.g. -o endpoint_url=http://127.0.0.1:9000 (repeatable)")
        parser.set_defaults(run=run)
        return parser

    append = action("append", _segment_append,
                    "append the VALUEs, or with none, each line of standard input, as records")
    append.add_argument("values", nargs="*", metavar="VALUE",
                        help="record values (UTF-8); none: read stdin, one record per line (its \\n or \\r\\n dropped)")
    append.set_defaults(trailing_values="values")
    append.add_argument("--key", help="record key given to every record (UTF-8)")
    append.add_argument("--create", action="store_true", help="create the segment if it does not exist")
    append.add_argument("--attribute", action="append", default=[], metavar="KEY=VALUE",
                        help="set attribute KEY (32 hex digits, a UUID or an integer >= 0: see 'attrindex index "
                             "--help') to VALUE (an integer, or 'none' to remove) with the first batch (repeatable)")
    append.add_argument("--expected-offset", type=int, metavar="N",
                        help="append only if the segment's next offset is N (later batches follow on from it)")
    append.add_argument("--codec", help="compression of the batches: none, gzip, zstd or lz4 (default: none)")
    append.add_argument("--timestamp", type=int, metavar="MS", help="record timestamp in ms since the epoch (default: now)")
    append.add_argument("--batch", type=int, default=1000, metavar="N",
                        help="records per append when reading stdin (default 1000)")
    append.add_argument("--tombstone", action="store_true",
                        help="append one tombstone for --key instead of values: a record with no value, which "
                             "deletes the key when a compacting segment is compacted")
    _add_policy_options(append)  # for a segment --create creates

    read = action("read", _segment_read, "print records, from the first one still stored or from --offset/--timestamp",
                  epilog=_READ_FORMATS_HELP)
    start = read.add_mutually_exclusive_group()
    start.add_argument("--offset", type=int, metavar="N", help="first offset to print")
    start.add_argument("--timestamp", type=int, metavar="MS", help="start at the first record with a timestamp >= MS")
    read.add_argument("--max", type=int, metavar="N", help="print at most N records")
    read.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text; see below)")

    tail = action("tail", _segment_tail,
                  "print records as they are appended, like tail -f, from the first record still stored, "
                  "--offset, --timestamp or --from-end; Ctrl-C stops it", epilog=_READ_FORMATS_HELP)
    start = tail.add_mutually_exclusive_group()
    start.add_argument("--offset", type=int, metavar="N", help="first offset to print")
    start.add_argument("--timestamp", type=int, metavar="MS", help="start at the first record with a timestamp >= MS")
    start.add_argument("--from-end", action="store_true", help="print only records appended from now on")
    tail.add_argument("--max", type=int, metavar="N", help="stop after N records")
    tail.add_argument("--timeout", type=float, metavar="S", help="stop after S seconds without a new record (default: never)")
    tail.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text; see below)")
    tail.set_defaults(interrupted_exit=0)

    action("stats", _segment_stats, "print offsets, log size and the attribute index's figures").add_argument(
        "--json", action="store_true", help="print every figure as JSON")

    retention = action("retention", _segment_retention,
                       "delete old records by age, total size or start offset (whole chunks; the newest chunk is kept)")
    retention.add_argument("--max-age", metavar="DURATION",
                           help="delete chunks whose newest record is older: 90s, 15m, 12h, 7d, 2w or plain ms")
    retention.add_argument("--max-bytes", metavar="SIZE",
                           help="delete the oldest chunks while the log holds more: 10MB, 512KiB or plain bytes")
    retention.add_argument("--start-offset", type=int, metavar="N", help="delete the records below offset N")

    compact = action("compact", _segment_compact,
                     "key-based compaction of a segment whose cleanup policy compacts: keep only the latest "
                     "record of each key in the sealed chunks (offsets never change)")
    compact.add_argument("--min-lag", metavar="DURATION",
                         help="leave records younger than this: 90s, 15m, 12h, 7d (default: the segment's policy)")
    compact.add_argument("--tombstone-retention", metavar="DURATION",
                         help="remove tombstones first cleaned longer ago than this (default: the segment's policy, 1d)")

    configure = action("configure", _segment_configure,
                       "change the segment's cleanup policy (the options not given keep their values), or "
                       "print it when no option is given")
    _add_policy_options(configure)

    consolidate = action("consolidate", _segment_consolidate,
                         "merge runs of small log chunks (one object per append on S3) into large ones; "
                         "bytes and offsets do not change, readers and writers may go on meanwhile")
    consolidate.add_argument("--target-size", metavar="SIZE",
                             help="size of the merged chunks: 32MB, 512KiB or plain bytes (default: the log's rolling size)")

    action("verify", _segment_verify, "read every committed byte of the segment, print every damaged range; "
                                      "exit 3 if any")
    action("repair", _segment_repair, "make each damaged range of the log a gap, keeping every intact batch, "
                                      "printing exactly which offsets are lost; offsets are never reused")
    action("list", _segment_list, "print the names of the segments in the store", named=False).add_argument(
        "--prefix", default="", metavar="P", help="only the segments under this path, e.g. orders")
