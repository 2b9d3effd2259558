"""moto's S3 server on 127.0.0.1 for the tests and the sims: the server program, with its
conditional writes made atomic, and ``running``, which starts it in a child process on a free
loopback port.

moto 5 checks ``If-None-Match: *`` and then stores the object as two steps of Python: a thread
switch between them (likely under load) lets two "exclusive" creates of one key both succeed, the
later one replacing the earlier. Real S3 (whose exclusive create this project's appends rely on)
never does that. With a 1 µs switch interval, 6 of 200 rounds of 8 concurrent exclusive PUTs on
one key had two winners on plain moto (0 with the lock below). The program:

    python -m testkit.moto_server [--switch-interval SECONDS] -H 127.0.0.1 -p PORT

takes moto.server's arguments; ``--switch-interval`` sets ``sys.setswitchinterval`` first (to
provoke the race above).

The program also reads moto's list of service modules once: moto lists its package directory and
stats every entry (about 180) twice per request to route it, about a third of the server's time
for a small GET.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from typing import Iterator

#: The credentials the server is started with (moto accepts any; clients must send these).
S3_KEY, S3_SECRET = "testing", "testing"
#: The directory holding ``testkit``: put on a child's ``PYTHONPATH`` so it imports ``testkit``.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CONDITIONAL_WRITES = threading.Lock()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server started next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_conditional_writes_atomic() -> None:
    """Make moto's S3 existence check and store one step, in this process (the server's)."""
    from moto.s3.responses import S3Response

    def atomic(method):
        def run(self, *args, **kwargs):
            with _CONDITIONAL_WRITES:  # the existence check and the store as one step
                return method(self, *args, **kwargs)
        run.__name__ = method.__name__
        run.atomic = True
        return run

    if getattr(S3Response.put_object, "atomic", False):
        return
    S3Response.put_object = atomic(S3Response.put_object)  # PutObject (If-None-Match checked inside)
    S3Response._key_response_post = atomic(S3Response._key_response_post)  # CompleteMultipartUpload, likewise


def options(endpoint: str) -> dict:
    """The storage options (``open_storage(url, **options)``) of the server at ``endpoint``."""
    return {"endpoint_url": endpoint, "key": S3_KEY, "secret": S3_SECRET}


def die_with_parent() -> None:
    """In a child process: be killed when the process that started it dies (a killed pytest or sims
    driver never runs its teardown). Linux only (``PR_SET_PDEATHSIG``); elsewhere the teardown does it."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def running(*, switch_interval: float | None = None, timeout: float = 30.0) -> Iterator[dict]:
    """Run the server in a child process on a free loopback port; yield its storage options.

    Waits up to ``timeout`` seconds for it to answer (``RuntimeError`` if it does not, the child
    killed); the child is terminated when the block ends.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "testkit.moto_server", "-H", "127.0.0.1", "-p", str(port)]
    if switch_interval is not None:
        command[3:3] = ["--switch-interval", repr(switch_interval)]
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                              preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not start on {endpoint} in {timeout:g} s") from None
                time.sleep(0.1)
        yield options(endpoint)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def make_s3_url(s3_options: dict) -> str:
    """A new bucket on the server of ``s3_options``; returns ``s3://bucket/data``."""
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


def list_moto_modules_once() -> None:
    """Make moto's list of its service modules (its package's directories) a list read once, in
    this process (the server's): moto routes each request by it, listing the directory each time."""
    from moto import backends

    if getattr(backends.list_of_moto_modules, "read_once", False):
        return
    modules = tuple(backends.list_of_moto_modules())

    def read_once():
        return modules

    read_once.read_once = True
    backends.list_of_moto_modules = read_once


def main(argv: list[str]) -> None:
    """The server program: moto.server's ``main`` with atomic conditional writes and its module
    list read once."""
    if argv[:1] == ["--switch-interval"]:
        sys.setswitchinterval(float(argv[1]))
        argv = argv[2:]
    make_conditional_writes_atomic()
    list_moto_modules_once()
    from moto.server import main as moto_main

    moto_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
