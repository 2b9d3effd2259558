"""Turns for the tasks that write one segment's attributes: on local disk, one task at a time.

Every handle that appends to a segment replays the other handles' appends into its own pending
updates (tier 1), and every handle merges what it holds into the one B+tree. Two tasks loading
one segment at once thus each hold both tasks' updates and race each other's merges: a lost race
rebuilds tier 1 from the log, merges fall behind, and tier 1 outgrows ``max_pending_bytes``
(measured: two processes loading 4M keys each into one segment took 400 s and 1 GiB each; one
process loads 10M in 50 s in 560 MiB). The log and the tree take one writer's appends at a time
anyway, so the tasks of a job lose nothing by writing in turn.

The turn is an exclusive ``flock`` on a lock file named after the store's directory and the
segment, in the machine's temporary directory: it orders the Python workers of every executor on
this machine. The kernel releases it when its holder dies (a killed executor never blocks the
next attempt). Stores elsewhere (object stores, ``memory://``) are written without turns.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from typing import Iterator

from storage_adapters.local import LocalChunkStorage

LOCK_DIR = "attrindex-spark-turns"


def lock_path(root: str, segment: str) -> str:
    """The lock file of ``segment`` in the local store at ``root``."""
    digest = hashlib.sha256(f"{os.path.realpath(root)}\0{segment}".encode()).hexdigest()[:40]
    return os.path.join(tempfile.gettempdir(), LOCK_DIR, digest + ".lock")


@contextlib.contextmanager
def writer_turn(storage, segment: str) -> Iterator[bool]:
    """Hold the write turn of ``segment`` in ``storage`` while the block runs (waiting for it
    first); yields whether a turn was taken (False: not a local store, nothing held)."""
    if not isinstance(storage, LocalChunkStorage):
        yield False
        return
    path = lock_path(storage.root, segment)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # (closing the only descriptor releases the lock)
