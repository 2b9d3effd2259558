"""The command line's arguments: keys, values, durations, sizes, storage options and URLs, and
the options and output every command shares."""

from __future__ import annotations

import argparse
import decimal
import json
import os
import re
import sys
import uuid
from typing import Any

from .cli_errors import EXIT_DAMAGED
from .errors import InvalidInputError
from .locations import failing_fast

KEYS_HELP = """\
keys (KEY) are 16 bytes, typed as one of
  32 hex digits   00000000000000000000000000000003  (the 16 bytes themselves; 32 digits are
                  always read as hex, even if they are all decimal)
  a UUID          123e4567-e89b-12d3-a456-426614174000  (its 16 bytes)
  an integer      42, 0x2a, 0o52, 0b101010: 0 <= n < 2**128, as 16 big-endian bytes, so
                  integer keys sort numerically; a negative integer is not a key
Text is not a key: map names to keys in your application (e.g. uuid.uuid5(namespace, name)).
values (VALUE) are signed 64-bit integers (42, -7, 0x2a); 'none' removes the key.
"""


def parse_key(text: str) -> bytes:
    """A key typed on the command line (``KEYS_HELP``: 32 hex digits, a UUID, or an integer in
    decimal, 0x hex, 0o or 0b), as its 16 bytes; checked here, before anything is opened."""
    from .keys import to_key

    cleaned = text.strip()
    if len(cleaned) == 32 and all(c in "0123456789abcdefABCDEF" for c in cleaned):
        return bytes.fromhex(cleaned)
    if len(cleaned) == 36 and cleaned.count("-") == 4:
        try:
            return uuid.UUID(cleaned).bytes
        except ValueError:
            pass
    try:
        number = int(cleaned, 0)
    except ValueError:
        raise InvalidInputError(f"cannot read {text!r} as a key: give 32 hex digits, a UUID or an integer") from None
    return to_key(number)  # a negative or too large integer: InvalidKeyError


def parse_value(text: str) -> int | None:
    if text.lower() in ("none", "null", "-"):
        return None
    try:
        return int(text, 0)
    except ValueError:
        raise InvalidInputError(f"cannot read {text!r} as a value: give an integer, or 'none' to remove") from None


def user_storage_options(pairs: list[str]) -> dict[str, Any]:
    """``-o NAME=VALUE`` options; a VALUE starting with ``{`` or ``[`` is JSON (nested settings
    such as ``client_kwargs`` or ``config_kwargs``), as in the Spark formats' ``storage.*``."""
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InvalidInputError(f"storage option {pair!r} must look like name=value")
        if value.lstrip().startswith(("{", "[")):
            try:
                options[name] = json.loads(value)
            except ValueError as exc:
                raise InvalidInputError(f"storage option {name!r}: cannot read {value!r} as JSON: {exc}") from None
        else:
            options[name] = value
    return options


def check_url(url: str) -> str:
    """A storage URL given on the command line, refused if nothing could outlive the command:
    a ``memory://`` store lives inside one process and is gone when the command exits."""
    if url.split("://", 1)[0].lower() == "memory" and "://" in url:
        raise InvalidInputError(f"{url!r}: a memory:// store lives only inside one process, so what this command "
                                "wrote would be gone when it exits; give a directory or s3://bucket/prefix")
    return url


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    return failing_fast(check_url(args.url), user_storage_options(args.storage_option))


def s3_endpoint(options: dict[str, Any]) -> str | None:
    """The S3 endpoint that ``options`` (or the environment) point the client at, for messages."""
    client = options.get("client_kwargs")
    nested = client.get("endpoint_url") if isinstance(client, dict) else None
    return options.get("endpoint_url") or nested or os.environ.get("AWS_ENDPOINT_URL")


def verify_progress(what: str):
    """A progress callback printing ``what done/total`` on a terminal's stderr, and whether it shows."""
    show = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show and (done % 256 == 0 or done == total):
            print(f"\rverifying {what} {done:,}/{total:,}", end="", file=sys.stderr, flush=True)
    return progress, show


def print_damage(damage: list, url: str) -> int:
    """Print each damaged range (stdout, one per line) and a summary (stderr); the exit code."""
    for found in damage:
        print(f"damaged: {found.where} bytes [{found.start}, {found.end}): {found.reason}")
    print(f"attrindex: error: verify found {len(damage)} damaged range(s) at {url}; "
          f"'repair' gives up the damaged bytes and keeps the rest (it says exactly what is lost)", file=sys.stderr)
    return EXIT_DAMAGED



_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d|w)?")  # lower case only: is 10M minutes or months?
_DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?", re.IGNORECASE)
_SIZE_BYTES = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _whole(number: str, unit: int) -> int:
    """``number`` (decimal digits, maybe a fraction) times ``unit``, rounded to an int, exactly."""
    return int((decimal.Decimal(number) * unit).to_integral_value(decimal.ROUND_HALF_EVEN))


def parse_duration(text: str) -> int:
    """A duration typed on the command line, in ms: ``90s``, ``15m``, ``12h``, ``7d``, ``2w``,
    ``250ms`` or a plain number of ms."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise InvalidInputError(
            f"cannot read {text!r} as a duration: give a number with a unit ms, s, m, h, d or w "
            "(e.g. 90s, 15m, 12h, 7d), or plain milliseconds")
    return _whole(match[1], _DURATION_MS[match[2] or "ms"])


def parse_size(text: str) -> int:
    """A size typed on the command line, in bytes: ``10MB`` (10**6 each), ``512KiB`` (2**10 each),
    ``1.5GiB``, ``100B`` or a plain number of bytes."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise InvalidInputError(
            f"cannot read {text!r} as a size: give bytes, or a number with a unit "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
    return _whole(match[1], _SIZE_BYTES[(match[2] or "b").lower()])


def check_count(value: int | None, option: str, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise InvalidInputError(f"{option} must be at least {minimum}, got {value}")


def debug_option(parser: argparse.ArgumentParser) -> None:
    """``--debug`` where a user types it: before or after the command. ``SUPPRESS`` keeps a
    sub-command's default from overwriting the value given to an outer parser."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print the traceback too; log attrindex's debug messages")
