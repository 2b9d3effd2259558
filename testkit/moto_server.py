"""moto's S3 server on 127.0.0.1 for the tests and the sims: the server program, with its
conditional writes made atomic, and ``running``, which starts it in a child process on a free
loopback port.

moto 5 checks ``If-None-Match: *`` and then stores the object as two steps of Python: a thread
switch between them (likely under load) lets two "exclusive" creates of one key both succeed, the
later one replacing the earlier. Real S3 (whose exclusive create this project's appends rely on)
never does that. With a 1 µs switch interval, 6 of 200 rounds of 8 concurrent exclusive PUTs on
one key had two winners on plain moto (0 with the lock below). The program:

    python -m testkit.moto_server [--switch-interval SECONDS] -H 127.0.0.1 -p PORT

takes moto.server's host and port arguments; ``--switch-interval`` sets ``sys.setswitchinterval`` first (to
provoke the race above).

The program also reads moto's list of service modules once: moto lists its package directory and
stats every entry (about 180) twice per request to route it, about a third of the server's time
for a small GET.

And it serves moto's application over keep-alive HTTP/1.1 connections (``serve``). moto's own
server (werkzeug's development server) closes the connection after every answer and then polls
it for 10 ms, so each request paid a new TCP connection and a new server thread. Here a client's
connection, and the server thread reading it, serve all its requests; every answer carries its
length, and a request's body is read to its end before the next request is read.
"""

from __future__ import annotations

import contextlib
import functools
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


def wait_until_serving(endpoint: str, server: subprocess.Popen, timeout: float) -> None:
    """Wait until the server process ``server`` answers at ``endpoint``; ``RuntimeError`` if it
    exits or does not answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the S3 server did not start on {endpoint} in {timeout:g} s") from None
            time.sleep(0.1)


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
        wait_until_serving(endpoint, server, timeout)
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
    bucket = "t-" + uuid.uuid4().hex[:20]
    _bucket_maker(s3_options["endpoint_url"], os.getpid()).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/data"


@functools.lru_cache(maxsize=None)
def _bucket_maker(endpoint: str, pid: int):
    """The boto3 client that makes buckets at ``endpoint``: one per endpoint and process (a client
    costs about 20 ms of CPU to make; a forked child makes its own, not its parent's connections)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                        region_name="us-east-1")


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


def _keep_alive_handler() -> type:
    """The request handler of ``serve``: moto's (its header handling) over keep-alive HTTP/1.1."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.exceptions import ClientDisconnected
    from werkzeug.wsgi import LimitedStream

    class KeepAliveHandler(MotoRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # An answer's header and body are two writes: the body must not wait for an ACK.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_request(self, code: object = "-", size: object = "-") -> None:
            pass  # no line per request (the server's output goes nowhere)

        def run_wsgi(self) -> None:
            if self.headers.get("Expect", "").lower().strip(" \t") == "100-continue":
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            environ = self.make_environ()
            if "wsgi.input_terminated" not in environ:  # not chunked: the body is Content-Length bytes
                try:
                    length = int(environ.get("CONTENT_LENGTH") or 0)
                except ValueError:
                    length = -1
                if length < 0:
                    self.send_error(400, "bad Content-Length")
                    return
                environ["wsgi.input"] = LimitedStream(self.rfile, length)
            answer: list = []

            def start_response(status: str, headers: list, exc_info: object = None):
                answer[:] = [status, headers]
                return body.append

            body: list[bytes] = []
            try:
                result = self.server.app(environ, start_response)
                try:
                    body.extend(result)
                finally:
                    if hasattr(result, "close"):
                        result.close()
                rest = environ["wsgi.input"]
                while rest.read(1 << 20):  # the next request starts after this one's body
                    pass
            except (ClientDisconnected, ConnectionError):
                self.close_connection = True
                return
            except Exception as exc:  # moto answers S3's errors itself: this is a bug in it
                self.server.log("error", "moto failed on %s %s: %r", self.command, self.path, exc)
                self.close_connection = True
                answer[:] = ["500 INTERNAL SERVER ERROR", [("Content-Type", "text/plain")]]
                body = [f"moto failed: {exc!r}".encode()]
            status, headers = answer
            code, _, reason = status.partition(" ")
            payload = b"".join(body)
            head_only = self.command == "HEAD" or int(code) in (204, 304) or int(code) < 200
            self.send_response(int(code), reason)
            for name, value in headers:
                lowered = name.lower()
                if lowered in ("connection", "transfer-encoding"):
                    continue
                if lowered == "content-length" and not head_only:
                    continue  # sent below: the length of the body sent
                self.send_header(name, value)
            if not head_only:
                self.send_header("Content-Length", str(len(payload)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if payload and not head_only:
                self.wfile.write(payload)

    return KeepAliveHandler


def serve(host: str, port: int) -> None:
    """Serve moto's application on ``host:port`` until killed: a thread per client connection,
    each connection kept open for the client's next request (``_keep_alive_handler``)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    os.environ.setdefault("MOTO_PORT", str(port))  # as moto.server does: moto's URLs to itself
    app = DomainDispatcherApplication(create_backend_app)
    make_server(host, port, app, threaded=True, request_handler=_keep_alive_handler()).serve_forever()


def main(argv: list[str]) -> None:
    """The server program: moto's S3 with atomic conditional writes and its module list read
    once, served over keep-alive connections (``serve``); ``-H HOST -p PORT`` as moto.server's."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m testkit.moto_server")
    parser.add_argument("--switch-interval", type=float, default=None)
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=5000)
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    make_conditional_writes_atomic()
    list_moto_modules_once()
    serve(args.host, args.port)


if __name__ == "__main__":
    main(sys.argv[1:])
