"""Fault hunt: the test S3 server must enforce exclusive creates as S3 does (invariant 2).

moto checks ``If-None-Match: *`` and stores the object in two steps; under load two concurrent
exclusive creates of one key could both succeed (``test_free_for_all_appends...[s3]`` then saw two
chunks covering one range). ``tests/moto_server.py`` makes the pair atomic. Here it runs with a
1 µs thread switch interval, which made plain moto give two winners in 5-6 of 200 rounds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from storage_adapters import open_storage
from storage_adapters.errors import ChunkExistsError
from tests.conftest import S3_KEY, S3_SECRET, make_s3_url

ROUNDS, WRITERS = 150, 8


def _server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = ("import runpy, sys; sys.setswitchinterval(1e-6); "
                f"sys.argv = ['moto_server', '-H', '127.0.0.1', '-p', '{port}']; "
                f"runpy.run_path({os.path.join(os.path.dirname(__file__), 'moto_server.py')!r}, run_name='__main__')")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    server = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return server, endpoint
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)


def test_concurrent_exclusive_creates_of_one_name_have_one_winner():
    server, endpoint = _server()
    try:
        options = {"endpoint_url": endpoint, "key": S3_KEY, "secret": S3_SECRET}
        storage = open_storage(make_s3_url(options), **options)
        doubled = []
        for round_ in range(ROUNDS):
            name, winners = f"d/{round_:05d}", []
            barrier = threading.Barrier(WRITERS)

            def create(i, name=name, winners=winners, barrier=barrier):
                barrier.wait()
                try:
                    storage.create(name, b"x" * (i + 1))
                    winners.append(i)
                except ChunkExistsError:
                    pass

            threads = [threading.Thread(target=create, args=(i,)) for i in range(WRITERS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            if len(winners) != 1:
                doubled.append((name, winners))
            else:
                assert len(storage.read(name, 0, 100)) == winners[0] + 1
        assert doubled == []
    finally:
        server.terminate()
        server.wait(timeout=10)
