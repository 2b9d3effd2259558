"""Requests per operation on S3 (moto's server), counted by ``ChunkStorage.requests`` and checked
once against the server's own HTTP log; the deletion grace that lets an append be one PUT."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from attrindex import AttributeIndex, EventWriter, SegmentStore
from attrindex.tree_index import TreeIndex
from storage_adapters import (
    BadOffsetError,
    OutcomeUnknownError,
    RequestCounters,
    RollingSegment,
    chunk_name,
    open_storage,
)
from storage_adapters.faults import FaultyStorage
from storage_adapters.s3 import is_precondition_failed
from testkit.moto_server import S3_KEY, S3_SECRET, free_port, make_s3_url

from .s3_proxy import S3Proxy


def _cost(storage, action) -> RequestCounters:
    before = storage.requests
    action()
    return storage.requests - before


def _only(counts: RequestCounters, **expected: int) -> bool:
    return counts.by_kind() == {"PUT": 0, "GET": 0, "LIST": 0, "HEAD": 0, "DELETE": 0,
                                **{k.upper(): v for k, v in expected.items()}}


# -- one PUT per append -------------------------------------------------------------------------
def test_rolling_append_is_one_put(s3_options):
    storage = open_storage(make_s3_url(s3_options), **s3_options)
    seg = RollingSegment(storage, "s")
    seg.append(b"first")  # the bucket's exclusive-create probe is behind us
    counts = _cost(storage, lambda: seg.append(b"x" * 1000, expected_offset=5))
    assert _only(counts, put=1) and counts.bytes_written == 1000
    read = _cost(storage, lambda: seg.read(0, 1005))
    assert _only(read, get=2) and read.bytes_read == 1005  # one GET per chunk object


def test_segment_and_writer_appends_are_one_put(s3_options):
    store = SegmentStore.open(make_s3_url(s3_options), storage_options=s3_options)
    segment = store.segment("a", create=True)
    segment.append([b"warm-up"])
    assert _only(_cost(store.storage, lambda: segment.append([b"r"], [(uuid.uuid4(), 5)])), put=1)
    writer = EventWriter(store, "events", segments=2)
    for _ in range(2):  # the first event to each segment loads the writer's stored state
        writer.write(b"e")
    writer.flush()

    def one_event():
        writer.write(b"event")
        writer.flush()

    assert _only(_cost(store.storage, one_event), put=1)
    assert store.stats().requests == segment.stats().requests == store.storage.requests


def test_the_first_append_of_a_process_to_a_bucket_also_probes_conditional_writes(s3_options):
    # docs/cost.md: the exclusive-create probe (once per bucket and process) comes with the first
    # create: a PUT, a second PUT that S3 refuses with 412, and a DELETE; then one PUT an append.
    store = SegmentStore.open(make_s3_url(s3_options), storage_options=s3_options)  # a new bucket: not probed yet
    segment = store.segment("orders", create=True)
    before = store.stats().requests
    segment.append([b"one record"])
    first = store.stats().requests - before
    assert (first.put, first.delete) == (3, 1), first.by_kind()
    before = store.stats().requests
    segment.append([b"another"])
    assert _only(store.stats().requests - before, put=1)
    store.close()


def test_the_cost_pages_first_example_holds_on_s3(s3_options):
    from tests.test_docs_examples import ROOT, examples

    page = "docs/cost.md"
    code = examples(page, (ROOT / page).read_text())[0].code
    opening = 'SegmentStore.open("memory://cost-demo")'
    assert opening in code
    namespace = {"URL": make_s3_url(s3_options), "OPTIONS": s3_options}  # a new bucket: not probed yet
    exec(compile(code.replace(opening, "SegmentStore.open(URL, storage_options=OPTIONS)"), page, "exec"), namespace)
    assert namespace["spent"].put == 1
    namespace["store"].close()


def test_index_update_of_1000_keys_is_about_one_put(s3_options):
    storage = open_storage(make_s3_url(s3_options), **s3_options)
    index = AttributeIndex(storage, "i")
    index.update({k: k for k in range(1000)})
    for round_ in range(1, 6):  # the WAL append is the update; merges into the tree come later
        counts = _cost(storage, lambda: index.update({k: k + round_ for k in range(1000 * round_, 1000 * round_ + 1000)}))
        assert _only(counts, put=1)
    assert index.stats().requests == storage.requests
    tree = TreeIndex(storage, "tree", page_size=4096)
    tree.update({k: k for k in range(1000)})
    total = RequestCounters()
    for round_ in range(1, 11):  # the B+tree itself: one PUT, plus a truncation marker when it compacts
        total += _cost(storage, lambda: tree.update({k: -k for k in range(round_ * 100, round_ * 100 + 1000)}))
    assert total.list == total.head == total.get == 0 and total.delete == 0  # dead chunks wait for the grace
    assert 10 <= total.put <= 20


def test_listing_is_one_list_and_a_missing_file_one_head(s3_options):
    storage = open_storage(make_s3_url(s3_options), **s3_options)
    assert _only(_cost(storage, lambda: storage.list_files("nothing/here")), list=1)  # s3fs: LIST, HEAD, LIST
    assert _only(_cost(storage, lambda: storage.exists("nothing/here")), head=1)  # s3fs: HEAD, LIST
    storage.create("d/x", b"1")
    assert _only(_cost(storage, lambda: storage.delete(["d/x", "d/y"])), delete=1)  # one DeleteObjects


def test_opening_a_store_and_a_segment(s3_options):
    """Opening an existing segment only reads (no PUT, no DELETE)."""
    url = make_s3_url(s3_options)
    with SegmentStore.open(url, storage_options=s3_options) as store:
        store.segment("a", create=True).append([b"r"] * 3, [(1, 1)])
    storage = open_storage(url, **s3_options)
    counts = _cost(storage, lambda: SegmentStore(storage).segment("a"))
    assert counts.put == counts.delete == counts.bytes_written == 0 and counts.get > 0


def test_counters_agree_with_the_servers_log(tmp_path):
    """Cross-check: a moto server of our own logs every HTTP request; its log and our counters agree."""
    port = free_port()
    log_path = tmp_path / "moto.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        options = {"endpoint_url": endpoint, "key": S3_KEY, "secret": S3_SECRET}
        url = make_s3_url(options)
        bucket = url.split("/")[2]
        storage = open_storage(url, **options, deletion_grace=0)
        seg = RollingSegment(storage, "s", rolling_size=4)
        for piece in (b"aaaa", b"bbbb", b"cccc"):
            seg.append(piece)
        seg.read(0, 12)
        seg.truncate(8)
        seg.append(b"dddd")
        RollingSegment(storage, "s").refresh()
        storage.exists("s.seg/none")
        time.sleep(0.3)  # the server writes its log line after answering
    finally:
        server.terminate()
        server.wait(timeout=10)
    logged = {"PUT": 0, "GET": 0, "LIST": 0, "HEAD": 0, "DELETE": 0}
    text = re.sub(rb"\x1b\[[0-9;]*m", b"", log_path.read_bytes())  # werkzeug colours some lines
    for method, target in re.findall(rb'"(PUT|GET|HEAD|DELETE|POST) (/\S*) HTTP', text):
        if not target.startswith(f"/{bucket}".encode()) or target == f"/{bucket}".encode():
            continue  # the bucket's creation (by the test's boto3 client) and moto's own API
        path, _, query = target.partition(b"?")
        kind = method.decode()
        if kind == "GET" and (b"list-type" in query or path.rstrip(b"/") == f"/{bucket}".encode()):
            kind = "LIST"
        elif kind == "POST" and b"delete" in query:
            kind = "DELETE"
        logged[kind] += 1
    assert storage.requests.by_kind() == logged, log_path.read_text(errors="replace")[-3000:]


# -- the deletion grace: why one PUT is safe ----------------------------------------------------
def test_dead_chunks_keep_their_names_so_a_stale_append_gets_412(s3_options):
    storage = open_storage(make_s3_url(s3_options), **s3_options)
    stale, owner = RollingSegment(storage, "s", rolling_size=2), RollingSegment(storage, "s", rolling_size=2)
    owner.append(b"aa")
    stale.refresh()  # believes the segment ends at 2
    for piece in (b"bb", b"cc", b"dd"):
        owner.append(piece)
    owner.truncate(8)
    assert {chunk_name(0), chunk_name(2), chunk_name(4)} <= set(storage.list_files("s.seg"))  # occupied
    counts = _cost(storage, lambda: stale.append(b"XX"))
    assert stale.length == 10 and RollingSegment(storage, "s").read(8, 2) == b"XX"
    assert (counts.put, counts.list) == (2, 1)  # the refused create, the listing, the create at the end


def test_a_view_older_than_half_the_grace_is_refreshed_before_appending(s3_options):
    storage = open_storage(make_s3_url(s3_options), **s3_options, deletion_grace=0.4)
    stale, owner = RollingSegment(storage, "s", rolling_size=2), RollingSegment(storage, "s", rolling_size=2)
    owner.append(b"aa")
    stale.refresh()
    owner.append(b"bb")
    owner.append(b"cc")
    owner.truncate(6)
    time.sleep(0.45)
    owner.append(b"dd")  # the grace has passed: the dead chunks go now, their names are free again
    assert chunk_name(2) not in storage.list_files("s.seg")
    counts = _cost(storage, lambda: stale.append(b"XX"))
    assert _only(counts, list=1, put=1)  # refreshed first, so it never re-creates a freed name
    fresh = RollingSegment(storage, "s")
    assert (fresh.start_offset, fresh.length, fresh.read(6, 4)) == (6, 10, b"ddXX")


def test_the_rule_is_what_protects_a_stale_handle(s3_options):
    """Control: a handle that wrongly believed its old view young would re-create a freed name below
    the truncation offset, an append nobody can read. The age rule above is what forbids it."""
    storage = open_storage(make_s3_url(s3_options), **s3_options, deletion_grace=0.2)
    stale, owner = RollingSegment(storage, "s", rolling_size=2), RollingSegment(storage, "s", rolling_size=2)
    owner.append(b"aa")
    stale.refresh()
    owner.append(b"bb")
    owner.append(b"cc")
    owner.truncate(6)
    time.sleep(0.25)
    owner.append(b"dd")
    stale._handle.view_time = time.monotonic()  # forged: the view is in fact older than the grace
    assert stale.append(b"XX") == 2 < RollingSegment(storage, "s").start_offset


def test_dead_chunks_left_by_a_gone_handle_are_deleted_by_the_next_after_the_grace(s3_options):
    storage = open_storage(make_s3_url(s3_options), **s3_options, deletion_grace=0.3)
    first = RollingSegment(storage, "s", rolling_size=2)
    for piece in (b"aa", b"bb", b"cc"):
        first.append(piece)
    first.truncate(4)
    first.close()  # gone before the grace passed: its dead chunks are still there
    later = RollingSegment(storage, "s", rolling_size=2)  # its listing shows them dead
    assert chunk_name(0) in storage.list_files("s.seg")
    time.sleep(0.35)
    later.append(b"dd")
    assert sorted(n for n in storage.list_files("s.seg") if "/" not in n) == [chunk_name(4), chunk_name(6)]


def test_a_failed_deletion_after_the_grace_is_retried_and_never_fails_the_append(s3_options):
    inner = open_storage(make_s3_url(s3_options), **s3_options, deletion_grace=0.2)
    faulty = FaultyStorage(inner, seed=3)
    seg = RollingSegment(faulty, "s", rolling_size=2)
    for piece in (b"aa", b"bb", b"cc"):
        seg.append(piece)
    seg.truncate(4)
    time.sleep(0.25)
    faulty.script("fail_before", op="delete")
    assert seg.append(b"dd") == 6  # the deletion failed: logged
    assert chunk_name(0) in inner.list_files("s.seg")
    assert seg.append(b"ee") == 8  # and retried
    assert chunk_name(0) not in inner.list_files("s.seg")


# -- S3 client behaviour ------------------------------------------------------------------------
def test_a_412_without_its_condition_element_means_exists():
    """SeaweedFS answers 412 without <Condition>; s3fs then raises a plain OSError, not FileExistsError."""
    import botocore.exceptions
    from s3fs.errors import translate_boto_error

    response = {"Error": {"Code": "PreconditionFailed",
                          "Message": "At least one of the pre-conditions you specified did not hold"},
                "ResponseMetadata": {"HTTPStatusCode": 412}}
    translated = translate_boto_error(botocore.exceptions.ClientError(response, "PutObject"))
    assert type(translated) is OSError and is_precondition_failed(translated)
    other = translate_boto_error(botocore.exceptions.ClientError(
        {"Error": {"Code": "InternalError", "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": 500}}, "PutObject"))
    assert not is_precondition_failed(other)


def test_timeouts_and_retries_reach_botocore(s3_options):
    from storage_adapters import InvalidInputError

    storage = open_storage(make_s3_url(s3_options), **s3_options, connect_timeout=3, read_timeout=7, max_attempts=2)
    config = storage.fs.s3.meta.config
    assert (config.connect_timeout, config.read_timeout) == (3, 7)
    assert config.retries["total_max_attempts"] == 2
    from_command_line = open_storage(make_s3_url(s3_options), **s3_options, max_attempts="3", read_timeout="2.5")
    assert from_command_line.fs.s3.meta.config.retries["total_max_attempts"] == 3
    for bad in ({"connect_timeout": -1}, {"read_timeout": "soon"}, {"max_attempts": 0}, {"deletion_grace": float("nan")}):
        with pytest.raises(InvalidInputError, match=next(iter(bad))):
            open_storage(make_s3_url(s3_options), **s3_options, **bad)


def test_local_and_memory_count_the_operations_that_stand_for_requests(tmp_path):
    from .framed import open_segment, pieces

    for storage in (open_storage(str(tmp_path / "store")), open_storage(f"memory://count-{uuid.uuid4().hex}")):
        seg = open_segment(storage, "s")
        first, second = pieces(storage, [b"abc", b"defg"])
        seg.append(first)
        counts = _cost(storage, lambda: seg.append(second))
        # local disk: the catch-up reads the bytes at the chunk's end (one GET), then one write
        assert counts.put == 1 and counts.bytes_written == len(second) and counts.list == 0
        assert counts.get == (1 if storage.torn_appends else 0)
        read = _cost(storage, lambda: seg.read(0, len(first) + len(second)))
        assert read.get == 1 and read.bytes_read == len(first) + len(second)
        faulty = FaultyStorage(storage, seed=1)
        assert faulty.requests == storage.requests  # the wrapper reports the backend's requests


def test_a_503_after_the_put_landed_is_retried_and_settled_by_reading_back(s3_options):
    """botocore retries the 503; the retry's exclusive create gets 412 (the first PUT did land); the
    append reads the object back, recognises its bytes and succeeds: once, at its offset."""
    proxy = S3Proxy(s3_options["endpoint_url"])
    try:
        options = {**s3_options, "endpoint_url": proxy.endpoint}
        storage = open_storage(make_s3_url(s3_options), **options)
        seg = RollingSegment(storage, "s")
        seg.append(b"first")
        proxy.fail_next_put = True
        counts = _cost(storage, lambda: seg.append(b"second", expected_offset=5))
        assert _only(counts, put=2, get=1)  # the PUT, botocore's retry (412), the read-back
        assert [status for method, status in proxy.forwarded[-3:]] == [200, 412, 206]
        fresh = RollingSegment(storage, "s")
        assert (fresh.length, fresh.read(0, 11), len(fresh.chunks())) == (11, b"firstsecond", 2)
    finally:
        proxy.close()


def test_close_releases_the_connections_and_a_reused_storage_reconnects(s3_options):
    storage = open_storage(make_s3_url(s3_options), **s3_options)
    seg = RollingSegment(storage, "s")
    seg.append(b"a")
    storage.close()
    assert storage.fs._s3 is None
    assert _only(_cost(storage, lambda: seg.append(b"b")), put=1)  # counted on the new connection too


def test_the_command_line_shows_the_requests(tmp_path, capsys):
    from attrindex.cli import main

    url = str(tmp_path)
    assert main(["index", "put", url, "1=2"]) == 0
    capsys.readouterr()
    assert main(["index", "stats", url]) == 0
    assert re.search(r"requests +put \d+, get \d+, list \d+, head \d+, delete \d+", capsys.readouterr().out)
