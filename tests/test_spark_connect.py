"""The data sources, ``lookup`` and ``write_summary`` through a real Spark Connect server (the one
PySpark's jars ship), started for this module on a free 127.0.0.1 port and stopped by its PID.

The client names the store by a relative path and runs in an empty directory of its own: on the
server that path means the session's working directory, on the client a directory that does not
exist. So whatever touches the store on the client fails or leaves a trace there; every storage
step must run on the cluster, as reads and writes do.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("grpc")  # the Connect client (pyspark[connect]); the test extra installs it

import attrindex.spark  # noqa: E402
from attrindex.errors import SegmentNotFoundError, StreamNotFoundError  # noqa: E402
from testkit.moto_server import free_port  # noqa: E402
from testkit.moto_server import die_with_parent  # noqa: E402

from .conftest import TEST_JVM_OPTIONS  # noqa: E402

pytestmark = pytest.mark.slow

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
START_TIMEOUT = 300  # seconds: a busy 2-core machine starts a JVM slowly


def _spark_submit() -> str:
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory):
    """``sc://127.0.0.1:PORT`` of a Spark Connect server (local[2,4]) running for this module."""
    root = tmp_path_factory.mktemp("spark-connect")
    port = free_port()
    command = [_spark_submit(), "--class", SERVER_CLASS, "--master", "local[2,4]", "--name", "attrindex-connect-tests",
               "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
               "--conf", f"spark.connect.grpc.binding.port={port}",
               "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
               "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=4",
               "--conf", "spark.sql.session.timeZone=UTC",
               "--conf", f"spark.driver.extraJavaOptions={TEST_JVM_OPTIONS}", "spark-internal"]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env,
                                  preexec_fn=die_with_parent)
    try:
        _wait_for_port(server, port, log_path)
        yield f"sc://127.0.0.1:{port}"
    finally:
        server.terminate()  # spark-submit execs the JVM: this PID is the server
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


def _wait_for_port(server, port: int, log_path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the Spark Connect server exited ({server.returncode}): "
                               f"{log_path.read_text(errors='replace')[-3000:]}")
        with socket.socket() as sock:
            sock.settimeout(1)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the Spark Connect server did not listen on {port} within {START_TIMEOUT} s")


@pytest.fixture(scope="module")
def connect(connect_url):
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    session = ConnectSession.builder.remote(connect_url).getOrCreate()
    attrindex.spark.register(session)
    yield session
    session.stop()


@pytest.fixture
def client_dir(tmp_path, monkeypatch):
    """The client's working directory: empty, and it must stay so."""
    path = tmp_path / "client"
    path.mkdir()
    monkeypatch.chdir(path)
    return path


def test_lookup_and_write_summary_run_on_the_cluster(connect, client_dir, monkeypatch):
    store = "store"  # relative: the server's directory, not the client's
    events = connect.range(3000, numPartitions=3).selectExpr("concat('user-', cast(id % 7 as string)) as key",
                                                            "cast(concat('e-', cast(id as string)) as binary) as value")
    (events.write.format("attrindex").option("path", store).option("stream", "events").option("segments", 2)
     .option("keyColumn", "key").option("writeId", "w1").mode("append").save())
    totals = connect.range(100).selectExpr("id as key", "id * 10 as value")
    totals.write.format("attrindex.attributes").option("path", store).option("segment", "totals").mode("append").save()

    assert connect.read.format("attrindex").option("path", store).option("stream", "events").load().count() == 3000
    summary = attrindex.spark.write_summary(store, "events", "w1", spark=connect)
    assert summary["rows"] == 3000 and summary["written"] == 3000
    assert attrindex.spark.write_summary(store, "events", "never-ran", spark=connect) is None
    with monkeypatch.context() as patched:  # a Connect-only client: its active session is found
        patched.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
        assert attrindex.spark.write_summary(store, "events", "w1")["rows"] == 3000

    looked = attrindex.spark.lookup(connect.range(95, 105).selectExpr("id as k"), "k", store, "totals")
    assert {r.k: r.value for r in looked.collect()} == {k: (k * 10 if k < 100 else None) for k in range(95, 105)}

    with pytest.raises(SegmentNotFoundError, match="segment 'absent' does not exist"):
        attrindex.spark.lookup(connect.range(3).selectExpr("id as k"), "k", store, "absent")
    with pytest.raises(StreamNotFoundError, match="stream 'nope' does not exist"):
        attrindex.spark.write_summary(store, "nope", "w1", spark=connect)
    with pytest.raises(SegmentNotFoundError, match="segment 'absent' does not exist"):  # no store there at all
        attrindex.spark.lookup(connect.range(3).selectExpr("id as k"), "k", "elsewhere", "absent")
    assert os.listdir(client_dir) == []  # nothing was created or looked for on the client
