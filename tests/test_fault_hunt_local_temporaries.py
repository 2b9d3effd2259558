"""Fault hunt: temporaries that a crashed local ``create`` leaves behind (``.tmp-*``) were never
deleted. A later ``create`` in the same directory now deletes those older than
``TEMP_MAX_AGE_SECONDS``; a live create's fresh temporary is never touched, and a create stalled
past the bound fails cleanly (nothing appears under its name)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from storage_adapters import local, open_storage
from storage_adapters.errors import StorageError

OLD = time.time() - local.TEMP_MAX_AGE_SECONDS - 60


def _temporaries(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".tmp-"))


def test_a_create_sweeps_stale_temporaries_and_keeps_fresh_ones(tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    stale, fresh = directory / ".tmp-a.123", directory / ".tmp-b.456"
    stale.write_bytes(b"left by a crash")
    fresh.write_bytes(b"being written")
    os.utime(stale, (OLD, OLD))
    storage = open_storage(str(tmp_path))
    storage.create("d/x", b"data")
    assert _temporaries(directory) == [".tmp-b.456"]
    assert storage.read("d/x", 0, 10) == b"data"


def test_a_crashed_create_leaves_a_temporary_that_a_later_create_sweeps(tmp_path):
    """A child SIGKILLed inside ``create`` after writing its temporary, before linking it."""
    code = (
        "import os, sys\n"
        "from storage_adapters import local, open_storage\n"
        "real = local._write_all\n"
        "def write(fd, data, position):\n"
        "    real(fd, data, position)\n"
        "    os.fsync(fd)\n"
        "    print('written', flush=True)\n"
        "    os.kill(os.getpid(), 9)\n"
        "local._write_all = write\n"
        "open_storage(sys.argv[1]).create('d/crashed', b'x' * 1000)\n"
    )
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == -signal.SIGKILL and "written" in child.stdout
    left = _temporaries(tmp_path / "d")
    assert len(left) == 1 and not (tmp_path / "d" / "crashed").exists()
    storage = open_storage(str(tmp_path))
    storage.create("d/soon", b"1")  # the temporary is young: a create may still be writing it
    assert _temporaries(tmp_path / "d") == left
    os.utime(tmp_path / "d" / left[0], (OLD, OLD))
    open_storage(str(tmp_path)).create("d/later", b"2")  # another writer, after the bound
    assert _temporaries(tmp_path / "d") == []
    assert "crashed" not in storage.list_files("d")


def test_a_create_stalled_past_the_bound_fails_and_creates_nothing(tmp_path, monkeypatch):
    storage, sweeper = open_storage(str(tmp_path)), open_storage(str(tmp_path))
    sweeper.create("d/first", b"0")
    sweeper._swept.clear()  # its next create sweeps again
    real = local._write_all

    def stall(fd, data, position):
        real(fd, data, position)
        if data != b"late":
            return  # the sweeper's own create
        (temporary,) = _temporaries(tmp_path / "d")
        os.utime(tmp_path / "d" / temporary, (OLD, OLD))  # as if stopped for over an hour here
        sweeper.create("d/other", b"1")  # another writer sweeps it

    monkeypatch.setattr(local, "_write_all", stall)
    with pytest.raises(StorageError):
        storage.create("d/stalled", b"late")
    monkeypatch.setattr(local, "_write_all", real)
    assert not (tmp_path / "d" / "stalled").exists() and _temporaries(tmp_path / "d") == []
    storage.create("d/stalled", b"retried")  # the name is free: a retry creates it
    assert storage.read("d/stalled", 0, 10) == b"retried"


def test_a_handle_sweeps_a_directory_at_most_once_per_interval(tmp_path, monkeypatch):
    storage = open_storage(str(tmp_path))
    scans = []
    real = os.scandir
    monkeypatch.setattr(local.os, "scandir", lambda d: scans.append(d) or real(d))
    for i in range(5):
        storage.create(f"d/{i}", b"x")
    assert len(scans) == 1
