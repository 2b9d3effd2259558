"""The ``attrindex`` command: its parser, the demo command, and how every command ends (one
line on stderr and an exit code).

The commands live in ``cli_index`` and ``cli_segment``; their shared arguments in ``cli_options``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import traceback
from typing import Any, Sequence


from ._version import __version__
from .cli_errors import EXIT_BROKEN_PIPE, EXIT_CODES_HELP, EXIT_INTERRUPTED, EXIT_USAGE, OutputError, explain
from .cli_index import add_index_commands
from .cli_options import check_url, debug_option, s3_endpoint, user_storage_options
from .cli_segment import add_segment_commands
from .errors import InvalidInputError

log = logging.getLogger("attrindex.cli")


def _demo(args: argparse.Namespace) -> int:
    """The Spark pipeline demo (attrindex/demo.py)."""
    from .demo import main as demo_main

    if args.rows < 1000:
        raise InvalidInputError(f"--rows must be at least 1000, got {args.rows}")
    if args.path is not None:
        check_url(args.path)
    return demo_main(args.path, user_storage_options(args.storage_option), args.rows, args.master)


_DESCRIPTION = """\
The attrindex command: run the Spark demo, inspect or change attribute indexes, append to, read
and follow segments. 'attrindex COMMAND --help' describes each."""


class _Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser``, except that an argument made of ``-`` and a digit (``-5``,
    ``-5=1``, ``-0x10``) is always a value, never an option: no option name starts with a digit,
    and argparse alone calls ``index put URL -5=1`` an unknown option."""

    def _parse_optional(self, arg_string):  # type: ignore[override]
        if _NEGATIVE_VALUE.match(arg_string):
            return None  # a positional argument
        return super()._parse_optional(arg_string)


_NEGATIVE_VALUE = re.compile(r"-[0-9.]")


def build_parser() -> argparse.ArgumentParser:
    """The ``attrindex`` command's parser."""
    parser = _Parser(prog="attrindex", description=_DESCRIPTION, epilog=EXIT_CODES_HELP,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"attrindex {__version__}")
    debug_option(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser("demo", help="run the Spark pipeline demo: exactly-once ingest, read back, attributes",
                               description=_DEMO_HELP, epilog=EXIT_CODES_HELP,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    debug_option(demo)
    demo.add_argument("--path", help="storage URL to run in, e.g. s3://bucket/prefix (default: a new directory "
                                     "under the temporary directory, kept afterwards)")
    demo.add_argument("-o", "--storage-option", action="append", default=[], metavar="NAME=VALUE",
                      help="a storage option, e.g. -o endpoint_url=http://127.0.0.1:9000 (repeatable)")
    demo.add_argument("--rows", type=int, default=400_000, help="events to generate (default 400,000; at least 1,000)")
    demo.add_argument("--master", default="local[*,4]",
                      help="Spark master (default local[*,4]: all cores, each task tried up to 4 times; local[N] "
                           "is run as local[N,4], since the demo's injected failures need retries)")
    demo.set_defaults(run=_demo)
    add_index_commands(commands)
    add_segment_commands(commands)
    return parser


_DEMO_HELP = """\
Run the Spark pipeline demo: ingest events exactly once while tasks fail, rerun the job, read
everything back and count duplicates and losses, bulk-load attributes and look them up. Each run
writes under run-N/ in the store (N = 1, 2, ...), so rerunning on the same --path is fine and keeps
the earlier runs. Needs Java 17+ (checked first), and about 2.5 GB of memory while Spark runs."""


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that a command whose last positional takes any number of values
    (``segment append``'s VALUEs) also gets the values typed after its options: argparse alone
    gives ``append URL NAME --create a b`` no VALUE and calls ``a b`` unrecognized."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        into = getattr(args, "trailing_values", None)
        options = extra[: extra.index("--")] if "--" in extra else extra  # after "--" all are values
        if into is None or any(e.startswith("-") and e != "-" and not _NEGATIVE_VALUE.match(e) for e in options):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if "--" in extra:
            extra.remove("--")
        getattr(args, into).extend(extra)
    return args


def _stop_writing_output() -> None:
    """The reader of our output went away (e.g. ``| head``): point stdout at devnull so the
    interpreter's final flush does not fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class _Output:
    """Standard output as the commands write it: a write or flush that fails (other than a closed
    pipe) raises ``OutputError``, so the failure is told apart from the store's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _show_debug_logs() -> None:
    if getattr(_show_debug_logs, "done", False):  # main() may run many times in one process (tests)
        return
    _show_debug_logs.done = True  # type: ignore[attr-defined]
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("attrindex: %(levelname)s %(name)s: %(message)s"))
    for name in ("attrindex", "storage_adapters"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.DEBUG)


def _where(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The store URL a command works on and the S3 endpoint it uses, for error messages."""
    url = getattr(args, "url", None) or getattr(args, "path", None)
    try:
        options = user_storage_options(getattr(args, "storage_option", []))
    except InvalidInputError:
        options = {}
    return url, s3_endpoint(options)


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; every failure ends as one line on stderr and an exit code
    (``cli_errors``), with the traceback too under ``--debug``."""
    debug = getattr(args, "debug", False)
    stdout = sys.stdout
    sys.stdout = _Output(stdout)  # type: ignore[assignment]
    try:
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        _stop_writing_output()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return getattr(args, "interrupted_exit", EXIT_INTERRUPTED)
    except Exception as exc:  # noqa: BLE001 - the command line's last word: one line, never a traceback
        if debug:
            traceback.print_exc()
        failure = explain(exc, *_where(args))
        log.debug("exit %d: %r", failure.code, exc)
        print(f"attrindex: error: {failure.message}", file=sys.stderr)
        if isinstance(exc, OutputError):
            _stop_writing_output()  # what is still buffered would fail again at the interpreter's exit
        return failure.code
    finally:
        sys.stdout = stdout


def main(argv: Sequence[str] | None = None) -> int:
    """The ``attrindex`` console script: parse ``argv``, run the command, return its exit code."""
    parser = build_parser()
    args = _parse(parser, argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USAGE
    if getattr(args, "debug", False):
        _show_debug_logs()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
