"""In-process chunk storage (``memory://``, storage_adapters/memory.py) under concurrent use: a
listing is one moment of the store, and an append beside a read of the same chunk waits for it
instead of failing."""

from __future__ import annotations

import threading
import uuid

from storage_adapters import memory, open_storage


def test_a_memory_listing_is_one_moment_of_the_store(monkeypatch):
    """A truncation deleting files while a listing reads their sizes: the listing still shows the
    store as it was when it was taken (never a KeyError, never an empty log)."""
    storage = open_storage(f"memory://listing-{uuid.uuid4().hex}")
    for name in ("d/a", "d/b", "d/truncation/b"):
        storage.create(name, b"12345")
    real = memory._size
    deleted = []

    def size(chunk):
        if not deleted:
            deleted.append(True)
            storage.delete(["d/a", "d/b", "d/truncation/b"])  # lands between the names and the sizes
        return real(chunk)

    monkeypatch.setattr(memory, "_size", size)
    assert storage.list_files("d") == {"a": 5, "b": 5, "truncation/b": 5}


def test_an_append_beside_a_read_of_the_same_memory_chunk_waits_instead_of_failing():
    """A read exports the chunk's buffer while it copies; an append that would grow the buffer
    meanwhile waits for the read to finish (it never raises ``BufferError``), and both see their
    bytes."""
    storage = open_storage(f"memory://buffer-{uuid.uuid4().hex}")
    storage.append("c", 0, b"x" * 100)
    chunk = storage.fs.store[storage._abs("c")]
    exported, release = threading.Event(), threading.Event()

    def slow_getbuffer():  # a read stopped by the scheduler in the middle of its copy
        buffer = type(chunk).getbuffer(chunk)
        exported.set()
        release.wait(10)
        return buffer

    chunk.getbuffer = slow_getbuffer
    got, errors = [], []
    reader = threading.Thread(target=lambda: got.append(storage.read("c", 0, 100)))
    reader.start()
    assert exported.wait(10)
    del chunk.getbuffer  # the append and later reads use the real one

    def append():
        try:
            storage.append("c", 100, b"y" * 10)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    appender = threading.Thread(target=append)
    appender.start()
    appender.join(1.0)  # without the guard the append fails at once, while the export is held
    release.set()
    reader.join(10)
    appender.join(10)
    assert errors == [] and got == [b"x" * 100]
    assert storage.read("c", 0, 200) == b"x" * 100 + b"y" * 10
