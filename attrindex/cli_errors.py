"""How the ``attrindex`` command reports a failure: one line on stderr saying what went wrong,
where, and what to do, and one exit code per kind of failure, the same for every command."""

from __future__ import annotations

from typing import Iterator

import attrs

from .errors import (
    AttrIndexError,
    BadOffsetError,
    ConditionalUpdateError,
    CorruptDataError,
    IndexNotFoundError,
    InvalidInputError,
    MergeBacklogError,
    MissingDependencyError,
    OutcomeUnknownError,
    RecordTruncatedError,
    SegmentNotFoundError,
    StorageError,
    StorageFullError,
    StoreNotFoundError,
    StreamNotFoundError,
    WriterConflictError,
)

EXIT_OK = 0
EXIT_FAILED = 1  #: the operation failed: storage unreachable, no credentials, a lost race, ...
EXIT_USAGE = 2  #: bad arguments or input (argparse's own errors exit 2 as well)
EXIT_DAMAGED = 3  #: damaged data found (a checksum failed), or the demo's exactly-once check failed
EXIT_NOT_FOUND = 4  #: no such store, index, segment, stream or S3 bucket
EXIT_INTERRUPTED = 130  #: Ctrl-C (128 + SIGINT), as shells report it
EXIT_BROKEN_PIPE = 141  #: the reader of the output went away (128 + SIGPIPE), e.g. ``| head``

EXIT_CODES_HELP = """\
exit codes:
  0    ok
  1    the operation failed (storage unreachable, missing credentials, a lost race, ...)
  2    bad usage or input
  3    damaged data found (a checksum failed; the demo: its exactly-once check failed)
  4    not found: no such store, index, segment, stream or S3 bucket
  130  interrupted (Ctrl-C)    141  output closed early (e.g. | head)
Errors are one line on stderr: attrindex: error: WHAT; WHAT TO DO. --debug adds the traceback.
"""

# Exception classes of the S3 client stack, by name: botocore may not even be installed.
_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                "ClientConnectorError", "ServerDisconnectedError", "ConnectionError"}
_SILENT = {"ReadTimeoutError", "ServerTimeoutError"}  # connected, but no answer within the read timeout
_S3_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3")


class OutputError(Exception):
    """Writing the command's own output (standard output) failed: a full disk under a redirection,
    a closed terminal. Not the store's failure; ``__cause__`` is the ``OSError``."""


@attrs.frozen
class Failure:
    """What the command prints (after ``attrindex: error: ``) and the exit code it returns."""

    message: str
    code: int


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during, innermost last."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _s3_client_error(exc: BaseException, names: set[str]) -> bool:
    return any(cls.__name__ in names and cls.__module__.startswith(_S3_MODULES) for cls in type(exc).__mro__)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _missing_bucket(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "bucket" in text and ("does not exist" in text or "nosuchbucket" in text)


def explain(exc: BaseException, url: str | None = None, endpoint: str | None = None) -> Failure:
    """The line and exit code for ``exc``, raised by a command working on the store at ``url``
    (S3 ``endpoint`` if one was given)."""
    where = f" at {url}" if url else ""
    server = endpoint or "the default AWS endpoint"
    if isinstance(exc, OutputError):
        cause = exc.__cause__
        reason = (cause.strerror if isinstance(cause, OSError) and cause.strerror else _one_line(str(cause)))
        return Failure(f"cannot write the output: {reason}; check where standard output goes (a full disk, "
                       "a closed terminal), then retry", EXIT_FAILED)
    chain = list(_chain(exc))
    if any(_s3_client_error(e, _CREDENTIALS) for e in chain):
        return Failure(f"no S3 credentials found for {url or 'the store'} ({server}); set AWS_ACCESS_KEY_ID and "
                       "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or give -o key=... -o secret=...", EXIT_FAILED)
    if any(_s3_client_error(e, _UNREACHABLE) for e in chain):
        return Failure(f"cannot reach the S3 endpoint {server} for {url or 'the store'}: {_one_line(str(chain[-1]))}; "
                       "check -o endpoint_url=... and the network, then retry", EXIT_FAILED)
    if not isinstance(exc, OutcomeUnknownError) and any(_s3_client_error(e, _SILENT) for e in chain):
        return Failure(f"the S3 endpoint {server} did not answer for {url or 'the store'} within the read timeout "
                       "(every attempt); check the endpoint, or give it longer with -o read_timeout=SECONDS "
                       "(and -o max_attempts=N)", EXIT_FAILED)
    if any(_missing_bucket(e) for e in chain):
        bucket = url.split("://", 1)[1].split("/", 1)[0] if url and "://" in url else "BUCKET"
        return Failure(f"S3 bucket {bucket!r} does not exist ({url} at {server}); create it first "
                       f"(e.g. aws s3 mb s3://{bucket}), or check the URL", EXIT_NOT_FOUND)
    if isinstance(exc, AttrIndexError):
        return _explain_ours(exc, url)
    if isinstance(exc, PermissionError):
        return Failure(f"permission denied{where}: {_one_line(str(exc))}; check the path's permissions "
                       "or the S3 credentials' policy", EXIT_FAILED)
    if isinstance(exc, OSError):
        return Failure(f"{_one_line(str(exc))}{where}; check the storage, then retry", EXIT_FAILED)
    return Failure(f"unexpected {type(exc).__name__}: {_one_line(str(exc))}{where}; this is a bug in attrindex: "
                   "rerun with --debug and report the traceback", EXIT_FAILED)


_NOT_FOUND_HINTS = (
    (IndexNotFoundError, "check the URL and --name (only 'attrindex index put' creates an index)"),
    (StoreNotFoundError, "check the URL (only 'attrindex segment append ... --create' creates a store)"),
    (SegmentNotFoundError, "check the name ('attrindex segment list URL' lists them; "
                           "'segment append ... --create' creates one)"),
    (StreamNotFoundError, "check the stream's name ('attrindex segment list URL' lists its segments)"),
)


def _explain_ours(exc: AttrIndexError, url: str | None) -> Failure:
    text = _one_line(str(exc))
    where = f" at {url}" if url else ""
    located = text if not url or url in text else f"{text} (store {url})"  # most messages already name it
    for kind, hint in _NOT_FOUND_HINTS:
        if isinstance(exc, kind):
            return Failure(text if "--create" in text else f"{text}; {hint}", EXIT_NOT_FOUND)
    if isinstance(exc, InvalidInputError):
        return Failure(text, EXIT_USAGE)
    if isinstance(exc, CorruptDataError):
        return Failure(f"damaged data{where}: {text}; 'attrindex index verify' / 'segment verify' list "
                       "every damaged range", EXIT_DAMAGED)
    if isinstance(exc, StorageFullError):
        return Failure(f"{located}; nothing was written: free space (or raise the quota), then retry", EXIT_FAILED)
    if isinstance(exc, OutcomeUnknownError):
        return Failure(f"{located}; the write may or may not have happened: read back before retrying", EXIT_FAILED)
    if isinstance(exc, (ConditionalUpdateError, BadOffsetError, RecordTruncatedError, WriterConflictError,
                        MissingDependencyError, MergeBacklogError)):
        return Failure(text, EXIT_FAILED)  # the message says what to know and do; the store is not to blame
    if isinstance(exc, StorageError):
        return Failure(f"{located}; check the storage, then retry", EXIT_FAILED)
    return Failure(located, EXIT_FAILED)
