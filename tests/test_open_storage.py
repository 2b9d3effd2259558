"""open_storage: schemes, options, clear errors; the S3 exclusive-create probe; ranged reads on S3."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from storage_adapters import (
    ExclusiveCreateUnsupportedError,
    InvalidInputError,
    OutcomeUnknownError,
    RetriesExhaustedError,
    RollingSegment,
    StorageError,
    StorageFullError,
    UnsupportedSchemeError,
    open_storage,
)
from storage_adapters.local import LocalChunkStorage
from storage_adapters.memory import MemoryChunkStorage
from storage_adapters.s3 import S3ChunkStorage, probe_exclusive_create
from testkit.moto_server import S3_KEY, S3_SECRET, free_port, make_s3_url

from .framed import open_segment, pieces
from .s3_proxy import S3Proxy


def test_schemes_pick_backends(tmp_path, s3_options):
    assert isinstance(open_storage(str(tmp_path)), LocalChunkStorage)
    assert isinstance(open_storage("file://" + str(tmp_path)), LocalChunkStorage)
    assert open_storage("file://" + str(tmp_path)).root == str(tmp_path)
    assert isinstance(open_storage("memory://x"), MemoryChunkStorage)
    assert isinstance(open_storage("s3://bucket/prefix", **s3_options), S3ChunkStorage)


def test_plain_path_and_file_url_share_data(tmp_path):
    storage = open_storage(str(tmp_path))
    (data,) = pieces(storage, [b"data"])
    open_segment(storage, "s").append(data)
    assert open_segment(open_storage("file://" + str(tmp_path)), "s").read(0, len(data)) == data


def test_memory_url_is_shared_within_the_process():
    RollingSegment(open_storage("memory://shared-root"), "s").append(b"data")
    assert RollingSegment(open_storage("memory://shared-root"), "s").read(0, 4) == b"data"
    assert RollingSegment(open_storage("memory://other-root"), "s").length == 0


class _PathLike:
    """An ``os.PathLike`` that is not a ``pathlib.Path`` (as third-party path classes are)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __fspath__(self) -> str:
        return self._path


@pytest.mark.parametrize("as_path", [pathlib.Path, _PathLike], ids=["pathlib.Path", "os.PathLike"])
def test_every_os_pathlike_opens_as_its_local_path(tmp_path, as_path):
    from attrindex import AttributeIndex, SegmentStore

    with open_storage(as_path(str(tmp_path / "raw"))) as storage:
        assert isinstance(storage, LocalChunkStorage) and storage.root == str(tmp_path / "raw")
    with AttributeIndex.open(as_path(str(tmp_path / "attrs"))) as idx:
        idx.update({1: 10})
    with AttributeIndex.open(str(tmp_path / "attrs"), mode="r") as idx:  # the same index as by its str
        assert idx.get(1) == 10
    assert AttributeIndex.verify_at(as_path(str(tmp_path / "attrs"))).ok
    assert not AttributeIndex.repair_at(as_path(str(tmp_path / "attrs"))).rolled_back
    with SegmentStore.open(as_path(str(tmp_path / "events"))) as store:
        store.segment("s", create=True).append([b"v"])
    with SegmentStore.open(str(tmp_path / "events"), mode="r+") as store:
        assert [r.value for r in store.segment("s").read(0)] == [b"v"]


@pytest.mark.parametrize("url", ["gs://bucket/x", "hdfs://host/path", "ftp://h/p"])
def test_unknown_scheme_is_a_clear_error(url):
    with pytest.raises(UnsupportedSchemeError) as caught:
        open_storage(url)
    message = str(caught.value)
    assert url.split(":")[0] in message and "memory://" in message and "s3://" in message
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("url", ["", "   ", None, 42])
def test_bad_url(url):
    with pytest.raises(InvalidInputError):
        open_storage(url)


def test_s3_url_needs_a_bucket():
    with pytest.raises(InvalidInputError, match="bucket"):
        open_storage("s3://")


@pytest.mark.parametrize("url", ["memory://x", "/tmp/somewhere"])
def test_local_and_memory_take_no_options(url):
    with pytest.raises(InvalidInputError, match="endpoint_url"):
        open_storage(url, endpoint_url="http://127.0.0.1:1")


def test_missing_s3fs_names_the_extra():
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from storage_adapters import open_storage, MissingDependencyError\n"
        "try:\n    open_storage('s3://bucket/p')\n"
        "except MissingDependencyError as exc:\n    print(exc); assert isinstance(exc, ImportError)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "attrindex[s3]" in out


def test_missing_bucket_is_a_storage_error(s3_options):
    storage = open_storage("s3://no-such-bucket-attrindex/p", **s3_options)
    with pytest.raises(StorageError, match="no-such-bucket-attrindex") as caught:
        RollingSegment(storage, "s").append(b"x")
    assert not isinstance(caught.value, RetriesExhaustedError)  # a refusal: nothing was retried


class IgnoresIfNoneMatch(MemoryFileSystem):
    """An object store that accepts ``If-None-Match: *`` and overwrites anyway (as some S3 clones do)."""

    protocol = "ignoring"

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        return super().pipe_file(path, value, mode="overwrite", **kwargs)


def test_probe_tells_refusing_stores_from_ignoring_ones(s3_options):
    url = make_s3_url(s3_options)
    s3 = open_storage(url, **s3_options)
    assert probe_exclusive_create(s3.fs, url[len("s3://"):] + "/probe") is True
    assert not s3.fs.exists(url[len("s3://"):] + "/probe")  # the probe cleans up
    assert probe_exclusive_create(IgnoresIfNoneMatch(), "/probe/object") is False


def test_store_ignoring_exclusive_create_is_refused_unless_single_writer(s3_options):
    url = make_s3_url(s3_options)
    storage = open_storage(url, **s3_options)
    storage.fs = IgnoresIfNoneMatch()  # same bucket name, a store that ignores the header
    storage._endpoint = "ignoring-store"
    with pytest.raises(ExclusiveCreateUnsupportedError, match="single_writer=True"):
        RollingSegment(storage, "s").append(b"x")
    storage.single_writer = True
    assert RollingSegment(storage, "s").append(b"x") == 0


def test_s3_reads_are_ranged(s3_options):
    """A 100-byte read of an 8 MiB chunk fetches about 100 bytes, counted on the HTTP responses."""
    storage = open_storage(make_s3_url(s3_options), **s3_options)
    seg = RollingSegment(storage, "big")
    blob = bytes(range(256)) * (8 * 4096)
    seg.append(blob)
    fetched = []

    def count(parsed, **_):
        fetched.append(parsed.get("ContentLength", 0))

    events = storage.fs.s3.meta.events  # s3fs's (cached, shared) aiobotocore client
    events.register("after-call.s3.GetObject", count)
    try:
        assert seg.read(5_000_000, 100) == blob[5_000_000:5_000_100]
    finally:
        events.unregister("after-call.s3.GetObject", count)
    assert fetched and sum(fetched) <= 200


def test_local_sync_option(tmp_path):
    """sync=False (also from a command line string) skips fsync; data still reaches other handles."""
    storage = open_storage(str(tmp_path), sync="false")
    assert storage.sync is False and open_storage(str(tmp_path)).sync is True
    (data,) = pieces(storage, [b"abc"])
    open_segment(storage, "s").append(data)
    assert open_segment(open_storage(str(tmp_path)), "s").read(0, len(data)) == data
    with pytest.raises(InvalidInputError, match="sync"):
        open_storage(str(tmp_path), sync="maybe")


# -- the error contract: only FileNotFoundError (where promised), ChunkExistsError and StorageError --
def test_local_full_disk_is_storage_full_error(tmp_path):
    """ENOSPC (here from /dev/full behind a chunk's name) is StorageFullError naming the chunk."""
    storage = open_storage(str(tmp_path))
    (tmp_path / "d").mkdir()
    os.symlink("/dev/full", tmp_path / "d" / "c")
    with pytest.raises(StorageFullError, match="d/c") as caught:
        storage.append("d/c", 0, b"data")
    assert not isinstance(caught.value, OSError)


def test_local_os_errors_are_storage_errors_naming_the_file(tmp_path):
    storage = open_storage(str(tmp_path))
    (tmp_path / "d").write_bytes(b"a file where a directory should be")
    calls = {
        "append": lambda: storage.append("d/c", 0, b"x"),
        "create": lambda: storage.create("d/c", b"x"),
        "put_marker": lambda: storage.put_marker("d/m"),
        "read": lambda: storage.read("d/c", 0, 1),
        "size": lambda: storage.size("d/c"),
        "trim": lambda: storage.trim("d/c", 0),
        "list_files": lambda: storage.list_files("d"),
        "lock": lambda: storage.lock("d").__enter__(),
    }
    for name, call in calls.items():
        with pytest.raises(StorageError, match="'d") as caught:
            call()
        assert not isinstance(caught.value, OSError), name
    with pytest.raises(FileNotFoundError):  # promised by the interface for a missing file
        storage.read("missing", 0, 1)
    with pytest.raises(FileNotFoundError):
        storage.size("missing")
    assert storage.list_files("no/such/dir") == {}


def test_s3_unreachable_endpoint_is_a_storage_error():
    storage = open_storage("s3://nowhere/data", endpoint_url=f"http://127.0.0.1:{free_port()}",
                           key=S3_KEY, secret=S3_SECRET,
                           config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1})
    for call in (lambda: storage.list_files("s.seg"), lambda: storage.read("s.seg/x", 0, 1),
                 lambda: storage.create("s.seg/x", b"x"), lambda: storage.exists("s.seg/x")):
        with pytest.raises(StorageError) as caught:
            call()
        assert not isinstance(caught.value, (OSError, OutcomeUnknownError))


def test_a_silent_s3_endpoint_fails_each_request_after_max_attempts_read_timeouts(silent_endpoint):
    # The endpoint accepts connections and never answers. botocore's attempts are the only
    # retries: s3fs's own retry loop, left on, would run them again 5 times (25 for a read), so a
    # CLI with 2 attempts of 60 s would take 607 s to give up on one listing.
    storage = open_storage("s3://silent/data", endpoint_url=silent_endpoint.url, key=S3_KEY, secret=S3_SECRET,
                           read_timeout=0.3, max_attempts=2)
    assert storage.max_attempts == 2 and storage.worst_case_seconds == 2 * (10 + 0.3) + 1
    calls = {"list": lambda: storage.list_files("s.seg"), "read": lambda: storage.read("s.seg/x", 0, 1),
             "exists": lambda: storage.exists("s.seg/x"), "create": lambda: storage.create("s.seg/x", b"x")}
    for name, call in calls.items():
        before = silent_endpoint.requests
        with pytest.raises(StorageError, match="ReadTimeoutError"):
            call()  # the create: its probe's PUT, which waited for ever for a "100 Continue"
        assert silent_endpoint.requests - before == 2, name
    storage.close()


def test_s3_requests_are_bounded_by_default(silent_endpoint):
    storage = open_storage("s3://silent/data", endpoint_url=silent_endpoint.url, key=S3_KEY, secret=S3_SECRET)
    config = storage.fs.s3.meta.config
    assert (config.connect_timeout, config.read_timeout, config.retries["total_max_attempts"]) == (10, 20, 5)
    assert storage.fs.retries == 1  # no retry loop of s3fs's on top of botocore's attempts
    assert storage.worst_case_seconds <= 165  # 5 x (10 + 20) s + back-off; it was 25 x 60 s and more
    raised = open_storage("s3://silent/data", endpoint_url=silent_endpoint.url, key=S3_KEY, secret=S3_SECRET,
                          read_timeout=120, max_attempts=3)
    assert raised.worst_case_seconds == 3 * 130 + 1 + 2
    legacy = open_storage("s3://silent/data", endpoint_url=silent_endpoint.url, key=S3_KEY, secret=S3_SECRET,
                          config_kwargs={"retries": {"max_attempts": 1}})  # botocore's: retries after the first
    assert legacy.max_attempts == 2
    for opened in (storage, raised, legacy):
        opened.close()


def _ca_bundle_loads(monkeypatch) -> list:
    """Record each CA bundle loaded into an SSL context (what botocore does to verify TLS)."""
    import ssl

    loads: list = []
    load = ssl.SSLContext.load_verify_locations

    def recorded(self, *args, **kwargs):
        loads.append(args or kwargs)
        return load(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", recorded)
    return loads


def _without_proxies(monkeypatch) -> None:
    """No proxy settings in the environment (HTTP_PROXY, https_proxy, NO_PROXY, ...)."""
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)


def test_a_plain_http_endpoint_costs_no_tls_verification_set_up(s3_options, monkeypatch):
    # botocore loads its CA bundle into a new context for each client (about 60 ms of CPU each
    # storage opened) whether or not a TLS connection is ever made.
    _without_proxies(monkeypatch)
    loads = _ca_bundle_loads(monkeypatch)
    storage = open_storage(make_s3_url(s3_options), **s3_options)
    storage.create("s.seg/x", b"x")
    assert storage.exists("s.seg/x") and storage.read("s.seg/x", 0, 1) == b"x"
    storage.close()
    assert loads == []


@pytest.mark.parametrize("where", ["https endpoint", "proxy in the environment", "proxy configured",
                                   "verify given"])
def test_tls_verification_stays_wherever_tls_may_be_used(where, monkeypatch):
    # Each request fails at once (nothing listens), after its client has set up TLS verification.
    loads = _ca_bundle_loads(monkeypatch)
    port = free_port()
    scheme = "https" if where == "https endpoint" else "http"
    options = {"endpoint_url": f"{scheme}://127.0.0.1:{port}", "key": S3_KEY, "secret": S3_SECRET,
               "max_attempts": 1, "connect_timeout": 1}
    proxy = f"http://127.0.0.1:{free_port()}"
    _without_proxies(monkeypatch)
    if where == "proxy in the environment":
        monkeypatch.setenv("HTTP_PROXY", proxy)
    elif where == "proxy configured":
        options["config_kwargs"] = {"proxies": {"http": proxy}}
    elif where == "verify given":
        options["client_kwargs"] = {"verify": True}
    storage = open_storage("s3://nowhere/data", **options)
    with pytest.raises(StorageError):
        storage.exists("s.seg/x")
    storage.close()
    assert loads != []


def test_an_s3_response_that_breaks_off_is_read_again(s3_options):
    import aiohttp

    storage = open_storage(make_s3_url(s3_options), **s3_options, max_attempts=3)
    storage.create("d/chunk", b"payload")
    events = storage.fs.s3.meta.events
    broken = []

    def break_off(http_response, **_):
        if len(broken) < 2:
            broken.append(1)
            raise aiohttp.ClientPayloadError("Response payload is not completed")

    events.register("after-call.s3.GetObject", break_off)
    try:
        assert storage.read("d/chunk", 0, 7) == b"payload" and len(broken) == 2
        broken.clear()
        storage.max_attempts = 2
        before = storage.requests
        with pytest.raises(RetriesExhaustedError, match="ClientPayloadError"):
            storage.read("d/chunk", 0, 7)
        # max_attempts calls of one HTTP request each: botocore does not retry a broken-off body
        assert len(broken) == 2 and (storage.requests - before).get == 2
    finally:
        events.unregister("after-call.s3.GetObject", break_off)
    storage.close()


def test_a_persistent_5xx_costs_max_attempts_requests_not_their_square(s3_options):
    """botocore retries a 503 (max_attempts HTTP requests in all); ``_again`` retries only a response
    that broke off, so it does not repeat those: 3, not 3 x 3. At that bound a read or a listing is
    ``RetriesExhaustedError`` (the layers above pass it up); a create is ``OutcomeUnknownError`` (a
    5xx may come after the write was applied: the byte stream reads it back)."""
    proxy = S3Proxy(s3_options["endpoint_url"])
    try:
        storage = open_storage(make_s3_url(s3_options), **{**s3_options, "endpoint_url": proxy.endpoint},
                               max_attempts=3)
        storage.create("d/chunk", b"payload")  # (the bucket's exclusive-create probe is behind us)
        proxy.unavailable = {"GET"}
        for call in (lambda: storage.read("d/chunk", 0, 7), lambda: storage.list_files("d")):
            proxy.refused.clear()
            with pytest.raises(RetriesExhaustedError, match="max_attempts"):
                call()
            assert proxy.refused == ["GET"] * 3
        proxy.unavailable = {"PUT"}
        proxy.refused.clear()
        with pytest.raises(OutcomeUnknownError) as caught:
            storage.create("d/other", b"x")
        assert proxy.refused == ["PUT"] * 3 and not isinstance(caught.value, RetriesExhaustedError)
        proxy.unavailable = set()
        assert storage.read("d/chunk", 0, 7) == b"payload"
        storage.close()
    finally:
        proxy.close()


def test_s3_lost_response_to_a_create_is_an_unknown_outcome(s3_options):
    """The PUT lands but the connection drops before its response: the caller cannot know."""
    import aiohttp

    storage = open_storage(make_s3_url(s3_options), **s3_options)
    storage.create("d/first", b"probe done")  # the exclusive-create probe is behind us
    events = storage.fs.s3.meta.events

    def drop_response(http_response, **_):
        events.unregister("after-call.s3.PutObject", drop_response)
        raise aiohttp.ServerDisconnectedError()

    events.register("after-call.s3.PutObject", drop_response)
    try:
        with pytest.raises(OutcomeUnknownError, match="d/chunk"):
            storage.create("d/chunk", b"payload")
    finally:
        events.unregister("after-call.s3.PutObject", drop_response)
    assert storage.read("d/chunk", 0, 100) == b"payload"
