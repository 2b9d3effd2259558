"""The test S3 server (testkit/moto_server.py) enforces exclusive creates as S3 does: of
concurrent ``If-None-Match: *`` creates of one key, exactly one succeeds and its bytes are stored.

Plain moto checks the condition and stores the object in two steps, so under thread switches two
creates can both succeed; the tests' S3 results (one chunk per range) depend on this server not
doing that. The server runs here with a 1 µs thread switch interval to provoke the interleaving.
The server also routes requests by a list of moto's service modules read once.
"""

from __future__ import annotations

import os
import threading

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
