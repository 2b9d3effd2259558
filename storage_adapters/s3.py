"""S3 chunk storage through s3fs: every chunk is one immutable object made by an exclusive create.

Exclusive create is ``PutObject`` with ``If-None-Match: *`` (s3fs ``mode="create"``); S3 refuses it
with 412 when the key exists, which is what makes compare-and-append safe across processes. Any 412
(``PreconditionFailed``, with or without the ``<Condition>`` element some stores omit) means "already
exists". Some S3-compatible stores accept the header and ignore it, so before the first write to a
bucket this module checks, once per bucket per process, that an exclusive create of an existing
object is refused.

Every operation is as few requests as S3 allows (docs/cost.md): a listing is ``ListObjectsV2``
pages only, an existence check one ``HeadObject``, a create one ``PutObject``, a deletion one
``DeleteObjects`` per 1,000 keys. The HTTP requests really sent (botocore retries included) are
counted from botocore's ``before-send`` event into ``requests``.

Storage options of this backend (the rest go to ``s3fs.S3FileSystem``): ``connect_timeout`` and
``read_timeout`` (seconds, default 10 and 20), ``max_attempts`` (default 5: botocore's standard
retry mode, exponential backoff with jitter on 500/503/SlowDown/throttling, connection errors and
timeouts; a retried create that finds its own object is settled by reading it back, see
``RollingSegment``) and ``deletion_grace`` (seconds a truncated chunk's name stays occupied before
it is deleted, default 900; see docs/storage.md).

botocore's attempts are the only retries of a request: s3fs's own retry loop, which would run them
again up to five times (25 for a read), is turned off, so an endpoint that accepts connections and
never answers fails a request after ``max_attempts`` read timeouts plus back-off
(``worst_case_seconds``: under 2 minutes with the defaults, if the connection is made). A request
whose response breaks off part-way (which botocore does not retry) is sent again, up to
``max_attempts`` times in all. A read, listing or existence check that failed at either bound is
``RetriesExhaustedError``; a write is ``OutcomeUnknownError`` (it may have been applied).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from typing import Any, Iterator

from .base import ChunkStorage, relative_paths
from .errors import (
    ChunkExistsError,
    ExclusiveCreateUnsupportedError,
    InvalidInputError,
    OutcomeUnknownError,
    RetriesExhaustedError,
    StorageError,
)

_log = logging.getLogger("attrindex.storage")
_PROBED_GUARD = threading.Lock()
_PROBED: dict[tuple[str, str], bool] = {}
#: Writers of one segment directory inside this process, on stores without exclusive create.
_SINGLE_WRITER_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_SESSION_GUARD = threading.Lock()
_SESSION: list[Any] = []  # one aiobotocore session for the process: clients share its loaded models

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 20.0
DEFAULT_MAX_ATTEMPTS = 5
#: Seconds a chunk made dead by a truncation keeps its name before it is deleted (docs/storage.md).
DEFAULT_DELETION_GRACE = 900.0

#: botocore operation -> the request kind S3 bills it as (anything else: by its HTTP method).
_OPERATION_KINDS = {
    "ListObjectsV2": "LIST", "ListObjects": "LIST", "ListBuckets": "LIST", "ListObjectVersions": "LIST",
    "ListMultipartUploads": "LIST", "ListParts": "LIST",
    "HeadObject": "HEAD", "HeadBucket": "HEAD",
    "DeleteObject": "DELETE", "DeleteObjects": "DELETE", "DeleteBucket": "DELETE",
    "AbortMultipartUpload": "DELETE",
}
_METHOD_KINDS = {"GET": "GET", "HEAD": "HEAD", "DELETE": "DELETE", "PUT": "PUT", "POST": "PUT"}
#: botocore's standard retry mode waits at most 2**(n-1) s (jittered) before its attempt n + 1,
#: and never more than this.
_MAX_BACKOFF_SECONDS = 20.0


def worst_case_seconds(connect_timeout: float, read_timeout: float, max_attempts: int) -> float:
    """The longest one S3 request can take to fail against an endpoint that never answers: every
    attempt waits out both timeouts (a slow connect, then a silent server), with botocore's
    back-off between attempts."""
    backoff = sum(min(_MAX_BACKOFF_SECONDS, 2.0 ** n) for n in range(max_attempts - 1))
    return max_attempts * (connect_timeout + read_timeout) + backoff


def is_precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is S3's 412 answer to a conditional write (the object already exists).

    s3fs turns it into ``FileExistsError`` only when the response names the ``If-None-Match``
    condition; stores that omit ``<Condition>`` (SeaweedFS) come through as a plain ``OSError``.
    """
    import botocore.exceptions

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FileExistsError):
            return True
        if isinstance(seen, botocore.exceptions.ClientError):
            error = seen.response.get("Error", {})
            status = seen.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return error.get("Code") == "PreconditionFailed" or status == 412
        seen = seen.__cause__ or seen.__context__
    message = str(exc).lower()
    return isinstance(exc, OSError) and ("pre-condition" in message or "precondition" in message)


def probe_exclusive_create(fs: Any, path: str) -> bool:
    """Whether ``fs`` refuses an exclusive create of an existing object (tries it at ``path``)."""
    fs.pipe_file(path, b"first", mode="create")
    try:
        fs.pipe_file(path, b"second", mode="create")
    except OSError as exc:
        if not is_precondition_failed(exc):
            raise
        return True
    finally:
        fs.rm_file(path)
    return False


def _no_tls_to_verify(options: dict[str, Any], config: dict[str, Any]) -> bool:
    """Whether the client would make no TLS connection at all: its endpoint is plain ``http://``
    and no proxy stands between (none configured, none in the environment for it), so a
    ``verify`` setting has nothing to verify. False when the caller set ``verify`` itself."""
    from botocore.utils import get_environ_proxies

    client_kwargs = options.get("client_kwargs") or {}
    endpoint = options.get("endpoint_url") or client_kwargs.get("endpoint_url")
    if not isinstance(endpoint, str) or not endpoint.lower().startswith("http://"):
        return False
    if "verify" in client_kwargs or config.get("proxies"):
        return False
    return not get_environ_proxies(endpoint)


def _shared_session() -> Any:
    import aiobotocore.session

    with _SESSION_GUARD:
        if not _SESSION:
            _SESSION.append(aiobotocore.session.AioSession())
        return _SESSION[0]


def _pop_seconds(options: dict[str, Any], name: str, default: float) -> float:
    value = options.pop(name, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise InvalidInputError(f"S3 storage option {name!r} must be a non-negative number of seconds, got {value!r}")
    return seconds


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What s3fs lets through untranslated: botocore's, aiohttp's and asyncio's own errors."""
    import aiohttp
    import botocore.exceptions

    return (OSError, botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError,
            aiohttp.ClientError, asyncio.TimeoutError, *_broken_off_errors())


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of the response behind ``exc`` (s3fs keeps the ClientError as the cause)."""
    import botocore.exceptions

    while exc is not None:
        if isinstance(exc, botocore.exceptions.ClientError):
            return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        exc = exc.__cause__ or exc.__context__
    return None


def _broken_off_errors() -> tuple[type[BaseException], ...]:
    """A response that broke off part-way (its body, or unreadable XML from a throttled store),
    which botocore's retries do not cover: the request is tried again by ``_again``."""
    import botocore.exceptions
    from botocore.parsers import ResponseParserError
    from urllib3.exceptions import IncompleteRead

    broken: tuple[type[BaseException], ...] = (IncompleteRead, ResponseParserError)
    try:
        from aiohttp import ClientPayloadError
    except ImportError:  # pragma: no cover - aiohttp comes with aiobotocore
        pass
    else:
        broken += (ClientPayloadError,)
    return broken + tuple(getattr(botocore.exceptions, name) for name in ("ResponseStreamingError",)
                          if hasattr(botocore.exceptions, name))


def _without_expect_continue(request: Any, **_: Any) -> None:
    """botocore asks for ``Expect: 100-continue`` on every PUT with a body, and aiohttp waits for
    the ``100 Continue`` with no timeout at all (its read timeout starts once the body is sent):
    a PUT to an endpoint that never answers would wait for ever. The header is dropped (it is
    not signed), so the body goes at once and the read timeout bounds the wait for the answer.
    The cost: a create refused with 412 has sent its body (a lost race, rare)."""
    request.headers.pop("Expect", None)


#: Error codes of throttling answers that botocore's standard mode retries whatever their status.
_THROTTLING_CODES = frozenset({"Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
                               "RequestThrottledException", "TooManyRequestsException", "SlowDown",
                               "RequestLimitExceeded", "BandwidthLimitExceeded", "RequestTimeout",
                               "RequestTimeoutException", "PriorRequestNotComplete"})


def _retried_by_botocore(exc: BaseException) -> bool:
    """Whether botocore's standard retry mode retries a failure like ``exc`` (a 5xx, throttling, a
    connection error or a timeout), so that it came here only after ``max_attempts`` attempts."""
    import botocore.exceptions

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, botocore.exceptions.ClientError):
            status = seen.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = seen.response.get("Error", {}).get("Code")
            return status >= 500 or status == 429 or code in _THROTTLING_CODES
        if isinstance(seen, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
                             asyncio.TimeoutError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _never_sent(exc: BaseException) -> bool:
    """Whether the request certainly did not reach S3 (the connection was never made)."""
    import botocore.exceptions

    return isinstance(exc, (botocore.exceptions.EndpointConnectionError, ConnectionRefusedError))


@contextlib.contextmanager
def s3_errors(operation: str, path: str, *, missing: bool = False, write: bool = False) -> Iterator[None]:
    """Turn s3fs/botocore/aiohttp errors into ``StorageError`` naming ``path``.

    ``missing=True`` lets ``FileNotFoundError`` through. With ``write=True`` an error that may have
    come after the request was sent (no response, or a 5xx) is ``OutcomeUnknownError``: the write may
    have happened; a refusal (a 4xx) or a connection never made is a definite ``StorageError``.
    Otherwise a failure that the request's attempts retried to their bound (botocore's, for a 5xx,
    throttling, a connection error or a timeout; ``_again``'s, for a response that kept breaking
    off) is ``RetriesExhaustedError``: the layers above pass it up.
    """
    import botocore.exceptions

    try:
        yield
    except RetriesExhaustedError as exc:  # _again's bound: the response kept breaking off
        if write:
            raise OutcomeUnknownError(f"S3: {operation} of {path!r} may or may not have happened: {exc}") from exc
        raise RetriesExhaustedError(f"S3: {operation} of {path!r} failed: {exc}") from exc
    except StorageError:
        raise
    except FileNotFoundError:
        if missing:
            raise
        raise StorageError(f"S3: {operation} of {path!r}: no such bucket or key") from None
    except _transport_errors() as exc:
        status = _http_status(exc)
        refused = status is not None and status < 500
        if status == 403 or isinstance(exc, PermissionError):
            raise StorageError(
                f"S3: {operation} of {path!r} was refused (403): the credentials are wrong or lack the "
                f"permission (check key/secret or the AWS profile): {exc}") from exc
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            raise StorageError(f"S3: {operation} of {path!r}: no credentials found (give key and secret, "
                               "or configure an AWS profile)") from exc
        if write and not refused and not _never_sent(exc):
            raise OutcomeUnknownError(
                f"S3: {operation} of {path!r} may or may not have happened: {type(exc).__name__}: {exc}"
            ) from exc
        error, bound = StorageError, ""
        if _retried_by_botocore(exc):
            error, bound = RetriesExhaustedError, " (every one of the request's max_attempts attempts failed)"
        if _never_sent(exc):
            raise error(f"S3: {operation} of {path!r} failed: the endpoint cannot be reached "
                        f"({type(exc).__name__}: {exc}){bound}") from exc
        raise error(f"S3: {operation} of {path!r} failed: {type(exc).__name__}: {exc}{bound}") from exc


class S3ChunkStorage(ChunkStorage):
    """Chunks as S3 objects under ``s3://bucket/prefix``."""

    appendable = False
    counts_own_requests = True  # the HTTP requests really sent, from botocore's events

    def __init__(self, root: str, *, single_writer: bool = False, **storage_options: Any):
        import s3fs  # the caller has checked the extra is installed

        self.root = root.strip("/")
        super().__init__("s3://" + self.root)
        self.bucket = self.root.split("/", 1)[0]
        options = dict(storage_options)
        connect_timeout = _pop_seconds(options, "connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        read_timeout = _pop_seconds(options, "read_timeout", DEFAULT_READ_TIMEOUT)
        self.deletion_grace = _pop_seconds(options, "deletion_grace", DEFAULT_DELETION_GRACE)
        max_attempts = options.pop("max_attempts", DEFAULT_MAX_ATTEMPTS)
        if isinstance(max_attempts, str) and max_attempts.strip().isdigit():  # from a command line's -o
            max_attempts = int(max_attempts)
        if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
            raise InvalidInputError(f"S3 storage option 'max_attempts' must be a positive int, got {max_attempts!r}")
        # Explicit config_kwargs win over the options above (they name botocore's own settings).
        config = {"connect_timeout": connect_timeout, "read_timeout": read_timeout,
                  "retries": {"mode": "standard", "total_max_attempts": max_attempts},
                  **dict(options.pop("config_kwargs", None) or {})}
        # Listings must be live: another process's append is only seen through a fresh LIST. The
        # filesystem is this storage's own (not fsspec's shared instance), so its requests are ours.
        session = options.pop("session", None) or _shared_session()
        options.pop("skip_instance_cache", None)
        options["use_listings_cache"] = False
        if _no_tls_to_verify(options, config):
            # botocore would load the CA bundle for every client (60 ms of CPU each open) to
            # verify a TLS connection that plain HTTP never makes.
            options["client_kwargs"] = {"verify": False, **dict(options.get("client_kwargs") or {})}
        self.fs = s3fs.S3FileSystem(**options, config_kwargs=config, skip_instance_cache=True, session=session)
        self.fs.retries = 1  # botocore's attempts are the retries (the module docstring)
        retries = config.get("retries") or {}  # botocore's "max_attempts" there counts the retries only
        self.max_attempts = int(retries.get("total_max_attempts", retries.get("max_attempts", max_attempts - 1) + 1))
        #: the longest one request can take to fail on a silent endpoint (``worst_case_seconds``)
        self.worst_case_seconds = worst_case_seconds(float(config.get("connect_timeout", connect_timeout)),
                                                     float(config.get("read_timeout", read_timeout)),
                                                     self.max_attempts)
        self.single_writer = single_writer
        self._endpoint = str(options.get("endpoint_url") or options.get("client_kwargs", {}).get("endpoint_url") or "aws")
        self._hooked: Any = None

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}".rstrip("/")

    # -- request counting --------------------------------------------------------------------------
    def _client(self) -> Any:
        """The s3fs client, with this storage's counting hook on it (s3fs may replace its client)."""
        client = self.fs.s3 if hasattr(self.fs, "call_s3") else None
        if client is not None and client is not self._hooked:
            client.meta.events.register("before-send.s3", self._count_request)
            client.meta.events.register("before-send.s3", _without_expect_continue)
            self._hooked = client
        return client

    def _count_request(self, request: Any, event_name: str = "", **_: Any) -> None:
        operation = event_name.rsplit(".", 1)[-1]
        kind = _OPERATION_KINDS.get(operation) or _METHOD_KINDS.get(request.method, "GET")
        written = 0
        if kind == "PUT":  # the body is a stream by now; its length is in the header
            try:
                written = int(request.headers.get("Content-Length") or 0)
            except ValueError:
                written = 0
        self.request_counter.count(kind, written=written)
        # returning None lets the request go out

    def _call(self, method: str, **kwargs: Any) -> Any:
        self._client()
        return self._again(self.fs.call_s3, method, **kwargs)

    def _again(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``, tried again (up to ``max_attempts`` in all) while its response
        breaks off part-way (as s3fs's own retry loop did), then ``RetriesExhaustedError``
        (``s3_errors`` makes that ``OutcomeUnknownError`` for a write). Reads, listings and deletions
        may be repeated; so may a create: a repeat that finds its own first try landed gets 412,
        which ``RollingSegment`` settles by reading the chunk back. botocore does not retry a
        response that broke off, and this loop retries nothing else: the two never repeat the same
        failure (docs/retries.md)."""
        broken = _broken_off_errors()
        for attempt in range(1, self.max_attempts + 1):
            try:
                return call(*args, **kwargs)
            except broken as exc:
                if attempt >= self.max_attempts:
                    raise RetriesExhaustedError(f"the response broke off part-way {attempt} times in a row "
                                                f"(max_attempts): {type(exc).__name__}: {exc}") from exc
                _log.info("S3 response broke off part-way; trying again (%d of %d)", attempt + 1, self.max_attempts)

    @property
    def _native(self) -> bool:
        """Whether ``fs`` is s3fs (tests swap in other fsspec stores to imitate S3 clones)."""
        return hasattr(self.fs, "call_s3")

    def _key(self, path: str) -> str:
        return self._abs(path).split("/", 1)[1] if "/" in self._abs(path) else ""

    # -- reading -------------------------------------------------------------------------------
    def list_files(self, directory: str) -> dict[str, int]:
        base = self._abs(directory)
        try:
            with s3_errors("listing", base, missing=True):
                if not self._native:
                    found = {p.lstrip("/"): i["size"] for p, i in self.fs.find(base, detail=True).items()}
                    return relative_paths(base, iter(found.items()))
                return self._list_objects(base)
        except FileNotFoundError:
            return {}

    def _list_objects(self, base: str) -> dict[str, int]:
        """One ``ListObjectsV2`` per 1,000 keys (s3fs's ``find`` adds a HEAD and a LIST when empty)."""
        prefix = base.split("/", 1)[1] + "/" if "/" in base else ""
        found: dict[str, int] = {}
        token = None
        for _page in range(1_000_000):  # bounded: S3 ends a listing with IsTruncated false
            kwargs = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list_objects_v2", **kwargs)
            for item in page.get("Contents", []):
                found[item["Key"][len(prefix):]] = item["Size"]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found
        raise StorageError(f"S3: listing of {base!r} did not end")

    def read(self, path: str, start: int, end: int) -> bytes:
        self._client()
        with s3_errors("read", self._abs(path), missing=True):
            try:
                data = self._again(self.fs.cat_file, self._abs(path), start=start, end=end)
            except FileNotFoundError:
                raise
            except OSError as exc:
                # S3 refuses a range that starts past the end (416); the other backends give b"".
                # (Only an answer can be that refusal: a timeout is an OSError too.)
                if _http_status(exc) is not None and start >= self.fs.size(self._abs(path)):
                    return b""
                raise
        self.request_counter.add_bytes(read=len(data))
        return data

    def exists(self, path: str) -> bool:
        with s3_errors("exists", self._abs(path)):
            if not self._native:
                return self.fs.exists(self._abs(path))
            try:  # one HEAD (s3fs's exists adds a LIST for a missing key, looking for a directory)
                self._call("head_object", Bucket=self.bucket, Key=self._key(path))
            except FileNotFoundError:
                return False
            return True

    # -- writing -------------------------------------------------------------------------------
    def create(self, path: str, data: bytes) -> None:
        self._ensure_exclusive_create()
        if self.exclusive_create_enforced:
            self._create(path, data)
            return
        # The store ignores If-None-Match (single_writer=True): this process's handles are
        # serialised per directory and look before they write, so they never overwrite each other.
        with self._single_writer_lock(path):
            if self.exists(path):
                raise ChunkExistsError(self._abs(path))
            self._create(path, data)

    def _create(self, path: str, data: bytes) -> None:
        self._client()
        with s3_errors("create", self._abs(path), write=True):
            try:
                self._again(self.fs.pipe_file, self._abs(path), bytes(data), mode="create")
            except OSError as exc:
                if is_precondition_failed(exc):
                    raise ChunkExistsError(self._abs(path)) from None
                raise

    def _single_writer_lock(self, path: str) -> threading.Lock:
        key = (self._endpoint, self._abs(path).rsplit("/", 1)[0])
        with _PROBED_GUARD:
            return _SINGLE_WRITER_LOCKS.setdefault(key, threading.Lock())

    def put_marker(self, path: str) -> None:
        self._client()
        with s3_errors("marker", self._abs(path), write=True):
            self.fs.pipe_file(self._abs(path), b"")

    def delete(self, paths: list[str]) -> None:
        if not paths:
            return
        with s3_errors("delete", self._abs(paths[0]), write=True), contextlib.suppress(FileNotFoundError):
            if not self._native:
                self.fs.rm([self._abs(p) for p in paths])
                return
            for first in range(0, len(paths), 1000):  # DeleteObjects takes at most 1,000 keys
                keys = [{"Key": self._key(p)} for p in paths[first:first + 1000]]
                answer = self._call("delete_objects", Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
                if answer.get("Errors"):
                    error = answer["Errors"][0]
                    raise StorageError(f"S3: delete of {error.get('Key')!r} failed: {error.get('Code')}: "
                                       f"{error.get('Message')}")

    def remove_directory(self, directory: str) -> None:
        self._client()
        with s3_errors("delete", self._abs(directory), write=True), contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._abs(directory), recursive=True)

    def close(self) -> None:
        """Close this storage's HTTP connections (its s3fs client is its own, not a shared one)."""
        creator = getattr(self.fs, "_s3creator", None) if self._native else None
        if creator is None:
            return
        import s3fs

        with contextlib.suppress(Exception):  # closing is best effort; nothing durable depends on it
            s3fs.S3FileSystem.close_session(self.fs.loop, creator)
        self.fs._s3 = None  # a later call (the handle may be reused) connects again
        self._hooked = None

    # -- the exclusive-create capability --------------------------------------------------------
    @property
    def exclusive_create_enforced(self) -> bool:  # type: ignore[override]
        """Whether the bucket refuses an exclusive create of an existing object (probed once per process)."""
        with _PROBED_GUARD:
            return _PROBED.get((self._endpoint, self.bucket), True)

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL this storage talks to (``"aws"`` for AWS's own)."""
        return self._endpoint

    def ensure_exclusive_create(self) -> None:
        """Check now, not at the first write, that the bucket refuses an exclusive create of an
        existing object (the probe ``create`` runs, once per bucket per process):
        ``ExclusiveCreateUnsupportedError`` if it does not and ``single_writer`` is off. For callers
        that must fail before work starts elsewhere (a Spark write, before its tasks run)."""
        self._ensure_exclusive_create()

    def _ensure_exclusive_create(self) -> None:
        key = (self._endpoint, self.bucket)
        with _PROBED_GUARD:
            refused = _PROBED.get(key)
            if refused is None:
                probe_path = f"{self.root}/.attrindex-probe-{uuid.uuid4().hex}"
                self._client()
                try:
                    with s3_errors("probe", probe_path, missing=True):
                        refused = probe_exclusive_create(self.fs, probe_path)
                except FileNotFoundError as exc:
                    raise StorageError(f"S3 bucket {self.bucket!r} does not exist at {self._endpoint}") from exc
                _PROBED[key] = refused
                _log.info("S3 endpoint %s, bucket %r: an exclusive create of an existing object is %s", self._endpoint,
                          self.bucket, "refused (conditional writes work)" if refused else "ACCEPTED (no conditional writes)")
        if not refused and not self.single_writer:
            raise ExclusiveCreateUnsupportedError(
                f"the S3 endpoint {self._endpoint} accepted an exclusive create (If-None-Match: *) of an "
                f"object that already existed in bucket {self.bucket!r}, so compare-and-append cannot be "
                "made safe there; use a store that supports conditional writes, or open the storage with "
                "single_writer=True, which promises that at most one process at a time writes to each "
                "segment and index of this bucket (attrindex then serialises the handles inside that "
                "process; a second writing process would overwrite chunks and could lose acknowledged "
                "writes without any error)"
            )
