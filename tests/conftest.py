"""Shared fixtures: a real moto S3 server on 127.0.0.1 and storage URLs for every backend."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from storage_adapters import open_storage

S3_KEY, S3_SECRET = "testing", "testing"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's HTTP server in a child process on a free loopback port, for the whole session."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
    yield endpoint
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_options(s3_endpoint):
    return {"endpoint_url": s3_endpoint, "key": S3_KEY, "secret": S3_SECRET}


def make_s3_url(s3_options) -> str:
    """A new bucket on the moto server; returns ``s3://bucket/prefix``."""
    import boto3

    bucket = "t-" + uuid.uuid4().hex[:20]
    client = boto3.client(
        "s3",
        endpoint_url=s3_options["endpoint_url"],
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/data"


@pytest.fixture(params=["memory", "local", "s3"])
def backend(request):
    return request.param


@pytest.fixture
def storage_url(backend, tmp_path, request):
    """``(url, storage_options)`` of a fresh, empty store on the parametrized backend."""
    if backend == "memory":
        url = f"memory://test-{uuid.uuid4().hex}"
        yield url, {}
        open_storage(url).remove_directory("")
    elif backend == "local":
        yield str(tmp_path / "store"), {}
    else:
        options = request.getfixturevalue("s3_options")
        yield make_s3_url(options), options


@pytest.fixture
def storage(storage_url):
    url, options = storage_url
    with open_storage(url, **options) as opened:
        yield opened


@pytest.fixture(scope="session")
def spark():
    """One ``local[2,4]`` SparkSession for the whole run (2 cores; a task may fail 3 times and be
    retried, which plain ``local[2]`` never does), with the attrindex formats registered."""
    import attrindex.spark

    session = attrindex.spark.session("local[2,4]", app_name="attrindex-tests",
                                      conf={"spark.sql.shuffle.partitions": "4",
                                            "spark.default.parallelism": "4"})
    session.sparkContext.setLogLevel("OFF")  # injected task failures would log pages of traces
    yield session
    session.stop()
