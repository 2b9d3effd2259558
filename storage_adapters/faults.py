"""``FaultyStorage``: a ``ChunkStorage`` wrapper that injects storage faults on a seeded schedule.

For tests and soaks. It wraps any backend (memory, local disk, S3) and keeps its nature
(``appendable``, ``torn_appends``, ``lock``, ``trim``, ``append``). Fault kinds:

``fail_before``
    raise ``StorageError``; nothing was done (any operation).
``lost_ack``
    do the write, then raise ``OutcomeUnknownError`` (the response was lost).
``torn``
    write a prefix of the data, then raise ``StorageError`` (what a killed writer or a dropped
    connection leaves). On local disk a torn ``append`` leaves a prefix of its bytes at its
    position (the frames after the committed end are then not whole) and a torn ``create`` a partial temporary file beside the name, nothing under it (local
    creates link a whole temporary file to the name). Objects are whole or nothing, and memory has no
    partial state, so there a torn write is ``fail_before``.
``enospc``
    raise ``StorageFullError``; nothing was written.
``latency``
    sleep ``latency`` seconds, then do the operation.
``bitflip_read``
    flip one bit of the bytes a ``read`` returns (the stored bytes are intact).

Faults come from ``rates`` (kind -> probability per applicable call, drawn from ``random.Random(seed)``)
and from ``script(kind, ...)``, which injects on the next matching calls. ``enabled = False`` turns
both off; ``injected`` lists every fault injected, in order.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from typing import Iterator, NamedTuple

from .base import ChunkStorage
from .errors import ChunkExistsError, InvalidInputError, OutcomeUnknownError, StorageError, StorageFullError

_WRITES = ("create", "append", "trim", "put_marker", "delete", "remove_directory")
_READS = ("list_files", "read", "exists", "size", "trimmed")

#: The operations each fault kind applies to.
FAULT_OPERATIONS: dict[str, tuple[str, ...]] = {
    "fail_before": _READS + _WRITES,
    "lost_ack": _WRITES,
    "torn": ("create", "append"),
    "enospc": ("create", "append", "trim", "put_marker"),
    "latency": _READS + _WRITES,
    "bitflip_read": ("read",),
}
FAULT_KINDS = tuple(FAULT_OPERATIONS)


class Injection(NamedTuple):
    """One injected fault: its kind, the operation and the path it hit."""

    kind: str
    op: str
    path: str


class _Script:
    def __init__(self, kind: str, op: str | None, path_contains: str | None, times: int, after: int):
        self.kind, self.op, self.path_contains, self.remaining = kind, op, path_contains, times
        self.skip = after  #: matching calls let through before the first injection

    def matches(self, op: str, path: str) -> bool:
        return (
            op in FAULT_OPERATIONS[self.kind]
            and (self.op is None or self.op == op)
            and (self.path_contains is None or self.path_contains in path)
        )


class FaultyStorage(ChunkStorage):
    """Wrap ``inner`` and inject faults into its operations (see the module docstring)."""

    def __init__(
        self,
        inner: ChunkStorage,
        *,
        seed: int,
        rates: dict[str, float] | None = None,
        latency: float = 0.01,
    ):
        rates = dict(rates or {})
        for kind, rate in rates.items():
            _check_kind(kind)
            if not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
                raise InvalidInputError(f"fault rate of {kind!r} must be in [0, 1], got {rate!r}")
        super().__init__(inner.url)
        self.inner = inner
        self.appendable = inner.appendable
        self.torn_appends = inner.torn_appends
        self.rates = rates
        self.latency = latency
        self.enabled = True
        self.injected: list[Injection] = []
        self._random = random.Random(seed)
        self._scripts: list[_Script] = []
        self._guard = threading.Lock()

    def __repr__(self) -> str:
        return f"FaultyStorage({self.inner!r})"

    # The requests are the inner backend's (an injected failure before the call sent none).
    counts_own_requests = True

    def script(self, kind: str, *, op: str | None = None, path_contains: str | None = None, times: int = 1,
               after: int = 0) -> None:
        """Inject ``kind`` on ``times`` calls of ``op`` (any applicable one if None) on a path
        containing ``path_contains`` (any if None), after letting ``after`` such calls through.
        Scripted faults go before random ones."""
        _check_kind(kind)
        if op is not None and op not in FAULT_OPERATIONS[kind]:
            raise InvalidInputError(f"fault {kind!r} does not apply to {op!r}; it applies to {FAULT_OPERATIONS[kind]}")
        if not isinstance(times, int) or times < 1:
            raise InvalidInputError(f"times must be a positive int, got {times!r}")
        if not isinstance(after, int) or after < 0:
            raise InvalidInputError(f"after must be an int >= 0, got {after!r}")
        with self._guard:
            self._scripts.append(_Script(kind, op, path_contains, times, after))

    def cancel_scripts(self) -> int:
        """Drop the scripted faults not injected yet; return how many there were."""
        with self._guard:
            pending = sum(s.remaining for s in self._scripts)
            self._scripts.clear()
            return pending

    def pending_scripts(self) -> int:
        """How many scripted faults have not been injected yet."""
        with self._guard:
            return sum(s.remaining for s in self._scripts)

    # -- the schedule ----------------------------------------------------------------------------
    def _draw(self, op: str, path: str) -> str | None:
        """The fault to inject into this call, if any (recorded in ``injected``)."""
        if not self.enabled:
            return None
        with self._guard:
            kind = self._scripted(op, path)
            if kind is None:
                for candidate, rate in self.rates.items():
                    if op in FAULT_OPERATIONS[candidate] and rate and self._random.random() < rate:
                        kind = candidate
                        break
            if kind is not None:
                self.injected.append(Injection(kind, op, path))
            return kind

    def _scripted(self, op: str, path: str) -> str | None:
        for script in self._scripts:
            if script.matches(op, path):
                if script.skip:
                    script.skip -= 1
                    return None
                script.remaining -= 1
                if not script.remaining:
                    self._scripts.remove(script)
                return script.kind
        return None

    def _before(self, op: str, path: str) -> str | None:
        """Inject what happens before the operation; return the kind for the caller to finish."""
        kind = self._draw(op, path)
        if kind == "latency":
            time.sleep(self.latency)
            return None
        if kind == "fail_before":
            raise StorageError(f"injected fault: {op} of {path!r} failed before reaching storage")
        if kind == "enospc":
            raise StorageFullError(f"injected fault: no space left for {op} of {path!r}")
        return kind

    @staticmethod
    def _lost(op: str, path: str) -> OutcomeUnknownError:
        return OutcomeUnknownError(f"injected fault: {op} of {path!r} was done but its response was lost")

    # -- reading ---------------------------------------------------------------------------------
    def list_files(self, directory: str) -> dict[str, int]:
        self._before("list_files", directory)
        return self.inner.list_files(directory)

    def read(self, path: str, start: int, end: int) -> bytes:
        kind = self._before("read", path)
        data = self.inner.read(path, start, end)
        if kind == "bitflip_read" and data:
            with self._guard:
                bit = self._random.randrange(len(data) * 8)
            flipped = bytearray(data)
            flipped[bit // 8] ^= 1 << (bit % 8)
            data = bytes(flipped)
        return data

    def exists(self, path: str) -> bool:
        self._before("exists", path)
        return self.inner.exists(path)

    def size(self, path: str) -> int:
        self._before("size", path)
        return self.inner.size(path)

    def trimmed(self, path: str) -> bool:
        self._before("trimmed", path)
        return self.inner.trimmed(path)

    # -- writing ---------------------------------------------------------------------------------
    def create(self, path: str, data: bytes) -> None:
        kind = self._before("create", path)
        if kind == "torn":
            self._torn_create(path, data)
        self.inner.create(path, data)
        if kind == "lost_ack":
            raise self._lost("create", path)

    def append(self, path: str, position: int, data: bytes, *, clear_to: int = 0) -> None:
        kind = self._before("append", path)
        if kind == "torn":
            self._torn_append(path, position, data)
        self.inner.append(path, position, data, clear_to=clear_to)
        if kind == "lost_ack":
            raise self._lost("append", path)

    def trim(self, path: str, size: int) -> None:
        kind = self._before("trim", path)
        self.inner.trim(path, size)
        if kind == "lost_ack":
            raise self._lost("trim", path)

    def put_marker(self, path: str) -> None:
        kind = self._before("put_marker", path)
        self.inner.put_marker(path)
        if kind == "lost_ack":
            raise self._lost("put_marker", path)

    def delete(self, paths: list[str]) -> None:
        kind = self._before("delete", ",".join(paths))
        self.inner.delete(paths)
        if kind == "lost_ack":
            raise self._lost("delete", ",".join(paths))

    def remove_directory(self, directory: str) -> None:
        kind = self._before("remove_directory", directory)
        self.inner.remove_directory(directory)
        if kind == "lost_ack":
            raise self._lost("remove_directory", directory)

    def lock(self, directory: str) -> contextlib.AbstractContextManager[None]:
        return self.inner.lock(directory)

    def lock_is_held(self, directory: str) -> bool:
        return self.inner.lock_is_held(directory)

    def close(self) -> None:
        self.inner.close()

    # -- torn writes -----------------------------------------------------------------------------
    def _local_path(self, path: str) -> str | None:
        """The file behind ``path`` if the inner backend is local disk (the only one with torn state)."""
        from .local import LocalChunkStorage

        return self.inner.file_path(path) if isinstance(self.inner, LocalChunkStorage) else None

    def _prefix(self, data: bytes) -> bytes:
        with self._guard:
            return bytes(data[: self._random.randrange(len(data))]) if data else b""

    def _torn_create(self, path: str, data: bytes) -> None:
        target = self._local_path(path)
        if target is not None:
            # What a create killed mid-way leaves on local disk: its temporary, partly written,
            # and nothing under the name (the name appears only by linking the whole file). An
            # object store creates whole objects or none.
            from .local import TEMP_PREFIX

            if os.path.lexists(target):
                raise ChunkExistsError(path)
            directory, base = os.path.split(target)
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, f"{TEMP_PREFIX}{base}.torn{random.randrange(1 << 24):06x}"), "xb") as f:
                f.write(self._prefix(data))
        raise StorageError(f"injected fault: create of {path!r} was torn")

    def _torn_append(self, path: str, position: int, data: bytes) -> None:
        target = self._local_path(path)
        if target is not None:  # what a killed writer leaves: part of its bytes, not synced
            with open(target, "r+b" if os.path.exists(target) else "wb") as chunk:
                # The backend makes the file long enough (its zeros ahead) before it writes the bytes.
                chunk.truncate(max(os.fstat(chunk.fileno()).st_size,
                                   position + len(data) + self.inner.zeros_kept_after(position + len(data))))
                chunk.seek(position)
                chunk.write(self._prefix(data))
        raise StorageError(f"injected fault: append to {path!r} was torn")


def _check_kind(kind: str) -> None:
    if kind not in FAULT_OPERATIONS:
        raise InvalidInputError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")


@contextlib.contextmanager
def faults_disabled(storage: FaultyStorage) -> Iterator[None]:
    """Turn ``storage``'s faults off for a block (e.g. to check what is stored)."""
    previous, storage.enabled = storage.enabled, False
    try:
        yield
    finally:
        storage.enabled = previous
