"""The test S3 server (testkit/moto_server.py) enforces exclusive creates as S3 does: of
concurrent ``If-None-Match: *`` creates of one key, exactly one succeeds and its bytes are stored.

Plain moto checks the condition and stores the object in two steps, so under thread switches two
creates can both succeed; the tests' S3 results (one chunk per range) depend on this server not
doing that. The server runs here with a 1 µs thread switch interval to provoke the interleaving.
The server also routes requests by a list of moto's service modules read once, and keeps a
client's connection open for its next request.
"""

from __future__ import annotations

import http.client
import os
import threading
import urllib.parse

from storage_adapters import open_storage
from storage_adapters.errors import ChunkExistsError
from testkit import moto_server

ROUNDS, WRITERS = 150, 8


def test_concurrent_exclusive_creates_of_one_name_have_one_winner():
    with moto_server.running(switch_interval=1e-6) as options:
        storage = open_storage(moto_server.make_s3_url(options), **options)
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


def test_the_server_routes_by_a_module_list_read_once(monkeypatch):
    """moto lists its package directory (and stats each entry) to route every request; the
    server program reads that list once."""
    from moto import backends

    monkeypatch.setattr(backends, "list_of_moto_modules", backends.list_of_moto_modules)  # put back afterwards
    listed = list(backends.list_of_moto_modules())
    moto_server.list_moto_modules_once()
    listings = []
    monkeypatch.setattr(os, "listdir", lambda *args: listings.append(args) or [])
    assert "s3" in listed and list(backends.list_of_moto_modules()) == listed and listings == []


def test_one_connection_carries_a_clients_requests_whatever_their_bodies_and_answers(s3_options):
    """Every answer has its length and the server reads each request's body to its end, the body of
    a refused PUT too, so one connection serves request after request (moto's own server closes
    it after each answer)."""
    bucket = moto_server.make_s3_url(s3_options).split("/")[2]
    endpoint = urllib.parse.urlsplit(s3_options["endpoint_url"])
    connection = http.client.HTTPConnection(endpoint.hostname, endpoint.port, timeout=60)
    big = os.urandom(1 << 20)
    steps = [("PUT", "k", b"a" * 1000, {"If-None-Match": "*"}, 200, b""),
             ("PUT", "k", big, {"If-None-Match": "*"}, 412, None),  # refused: its body is read all the same
             ("HEAD", "k", None, {}, 200, b""),
             ("GET", "k", None, {}, 200, b"a" * 1000),
             ("GET", "k", None, {"Range": "bytes=10-19"}, 206, b"a" * 10),
             ("GET", "missing", None, {}, 404, None),
             ("PUT", "k2", big, {}, 200, b""),
             ("GET", "k2", None, {}, 200, big)]
    # moto routes a request by the service its Authorization names (it checks no signature);
    # without one, it answers a refused conditional PUT with an empty 403.
    signed = {"Authorization": f"AWS4-HMAC-SHA256 Credential={moto_server.S3_KEY}/20260101/us-east-1/s3/aws4_request, "
                               "SignedHeaders=host, Signature=00"}
    connection.connect()
    first = connection.sock
    for method, key, body, headers, status, expected in steps:
        connection.request(method, f"/{bucket}/{key}", body=body, headers={**headers, **signed})
        answer = connection.getresponse()
        payload = answer.read()
        assert (method, key, answer.status) == (method, key, status)
        if expected is not None:
            assert payload == expected
        if method == "HEAD":
            assert answer.getheader("Content-Length") == "1000"
        assert answer.getheader("Connection") != "close" and not answer.will_close
        assert connection.sock is first  # not reconnected
    connection.close()
