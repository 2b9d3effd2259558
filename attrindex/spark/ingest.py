"""Exactly-once writes of task output to a stream: the protocol, with no Spark in it.

A write has a *token* (a UUID naming the logical write: derived from ``writeId``, from a streaming
query's id, or random for an anonymous batch job) and a *version* (0 for batch writes, the batch id
for streaming). Task ``p`` of it writes as ``EventWriter`` ``task_writer_id(token, version, p)``,
numbering its events by row order, so every attempt of the task (a retry, a speculative twin, a
replay after a crash) writes as the same writer and the conditional appends drop what an earlier
attempt already wrote. That is the *direct* mode; it needs each task to see the same rows in the
same order on every attempt.

The *staged* mode needs no such thing: each attempt stages its rows in files of its own, and only
the driver's commit publishes, from the staging files the winning attempts reported. The commit
first records a manifest of those files (an exclusive create, so a repeated commit adopts the first
manifest and republishes the same rows), then publishes each partition with the same per-task
writer ids, so a commit that crashed half-way and is run again writes each row once.

Either way the driver's commit then records ``(token, version)`` in the stream's commit ledger; a
write whose ``(token, version)`` is there already is skipped whole (``writeId`` reruns, replayed
streaming batches). Layout under the store root::

    _streams/STREAM/_commits/TOKEN/VERSION            committed: JSON summary
    _streams/STREAM/_commits/TOKEN/VERSION.manifest   staged mode: what the commit publishes
    _streams/STREAM/_staging/TOKEN/VERSION/PART-NONCE-N   an attempt's staged rows (record batches)
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator

import attrs

from ..errors import AttrIndexError, ChunkExistsError, CorruptDataError
from ..log.batch.chain import iter_batches, place_batches
from ..log.batch.encode import encode_batch
from ..log.batch.records import Record
from ..layout import stream_dir
from ..store import SegmentStore
from .checks import check_write_target
from ..writer import EventWriter

NAMESPACE = uuid.UUID("6f2b0e52-3c1d-5a4e-9b7f-a11d7e0c5e3a")
STAGED_FILE_BYTES = 8 << 20  #: a staging file is cut once its batches pass this size


class InjectedFailure(AttrIndexError):
    """A failure the ``testing.*`` options asked for (demos and tests of the recovery paths)."""


def write_token(write_id: str | None) -> uuid.UUID:
    """The token of a batch write: fixed by ``writeId``, else random (one per job)."""
    return uuid.uuid4() if write_id is None else uuid.uuid5(NAMESPACE, "write:" + write_id)


def query_token(query_id: str) -> uuid.UUID:
    """The token of a streaming query (its id survives restarts from the same checkpoint)."""
    return uuid.uuid5(NAMESPACE, "query:" + query_id)


def task_writer_id(token: uuid.UUID, version: int, partition: int) -> uuid.UUID:
    """The writer id every attempt of task ``partition`` of write ``(token, version)`` shares."""
    return uuid.uuid5(token, f"{version}/{partition}")


@attrs.frozen
class StreamTarget:
    """Where a write goes: a stream in a store, and how to write it."""

    url: str
    stream: str
    storage_options: dict = attrs.field(factory=dict)
    segments: int | None = None  #: create the stream with this many segments if it is missing
    store_options: dict = attrs.field(factory=dict)  #: SegmentStore options (codec, ...)
    batch_events: int = 1000

    def open_store(self) -> SegmentStore:
        return SegmentStore.open(self.url, storage_options=dict(self.storage_options), **self.store_options)

    def prepare(self) -> int:
        """Check the store takes parallel writers (``checks``), then that the stream exists
        (creating it when ``segments`` is given); its segment count. Runs on the driver."""
        check_write_target(self.url, self.storage_options, "attrindex")
        with self.open_store() as store:
            if self.segments is not None:
                return len(store.create_stream(self.stream, self.segments))
            return len(store.stream_segments(self.stream))


@attrs.frozen
class Faults:
    """Failures to inject (the ``testing.*`` options): a twin on a task's first attempt, and
    failures after ``fail_after_rows`` rows on its first ``fail_attempts`` attempts."""

    fail_partitions: frozenset = frozenset()  #: these tasks fail after writing ``fail_after_rows``
    fail_after_rows: int = 0
    fail_attempts: int = 1
    duplicate_partitions: frozenset = frozenset()  #: these tasks run with a concurrent twin attempt

    def __bool__(self) -> bool:
        return bool(self.fail_partitions or self.duplicate_partitions)


@attrs.frozen
class EventColumns:
    """Rows of events as columns: payloads, and optionally routing keys, timestamps (ms), headers."""

    values: list
    keys: list | None = None
    timestamps: list | None = None
    headers: list | None = None

    def __len__(self) -> int:
        return len(self.values)

    def records(self) -> Iterator[tuple]:
        """``(value, key, timestamp, headers)`` per row."""
        n = len(self.values)
        return zip(self.values, self.keys or [None] * n, self.timestamps or [None] * n, self.headers or [()] * n)


@attrs.define
class TaskReport:
    """What one task attempt did; travels to the driver's commit."""

    partition: int
    attempt: int
    rows: int = 0
    written: int = 0  #: rows this attempt appended (direct mode)
    skipped: int = 0  #: rows an earlier attempt had appended already (direct mode)
    staged: list = attrs.Factory(list)  #: ``[path, size]`` of each staging file, in row order (staged mode)
    already_committed: bool = False  #: the write was committed before: the task did nothing


# -- the ledger -------------------------------------------------------------------------------
class CommitLedger:
    """Which ``(token, version)`` writes are committed to a stream, and staged-mode manifests."""

    def __init__(self, storage, stream: str):
        self.storage = storage
        self.stream = stream
        self.root = f"{stream_dir(stream)}/_commits"

    def _path(self, token: uuid.UUID, version: int) -> str:
        return f"{self.root}/{token.hex}/{version:020d}"

    def committed(self, token: uuid.UUID, version: int) -> dict | None:
        """The summary recorded when the write was committed, or ``None`` if it was not."""
        path = self._path(token, version)
        try:
            data = self.storage.read(path, 0, 1 << 20)
        except FileNotFoundError:
            return None
        return _load_json(data, path)

    def record(self, token: uuid.UUID, version: int, summary: dict) -> bool:
        """Mark the write committed; False if it already was (by this or a concurrent commit)."""
        try:
            self.storage.create(self._path(token, version), json.dumps(summary, sort_keys=True).encode())
        except ChunkExistsError:
            return False
        return True

    def adopt_manifest(self, token: uuid.UUID, version: int, partitions: list[list]) -> list[list]:
        """Record ``[[partition, [files...]], ...]`` as what this write publishes, unless an earlier
        commit recorded one: then that one is returned and must be published instead."""
        path = self._path(token, version) + ".manifest"
        try:
            self.storage.create(path, json.dumps(partitions).encode())
            return partitions
        except ChunkExistsError:
            return _load_json(self.storage.read(path, 0, 1 << 30), path)

    def manifest(self, token: uuid.UUID, version: int) -> list[list] | None:
        path = self._path(token, version) + ".manifest"
        try:
            return _load_json(self.storage.read(path, 0, 1 << 30), path)
        except FileNotFoundError:
            return None

    def forget_before(self, token: uuid.UUID, version: int) -> None:
        """Drop the records of versions below ``version`` (streaming keeps only recent batches)."""
        names = self.storage.list_files(f"{self.root}/{token.hex}")
        old = [f"{self.root}/{token.hex}/{n}" for n in names if n[:20].isdigit() and int(n[:20]) < version]
        self.storage.delete(old)


def _load_json(data: bytes, path: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise CorruptDataError(f"commit ledger file {path!r} is not valid JSON") from None


def staging_dir(stream: str, token: uuid.UUID, version: int) -> str:
    return f"{stream_dir(stream)}/_staging/{token.hex}/{version:020d}"


# -- tasks ------------------------------------------------------------------------------------
def write_direct(target: StreamTarget, token: uuid.UUID, version: int, partition: int, attempt: int,
                 batches: Iterable, faults: Faults = Faults()) -> TaskReport:
    """Append a task's rows as writer ``task_writer_id(token, version, partition)``: ``batches``
    of ``EventColumns``, or of Arrow columns (``spark.arrow.ArrowColumns``), written column by column."""
    if faults and attempt == 0 and partition in faults.duplicate_partitions:
        batches = list(batches)
        twin = threading.Thread(target=_twin_attempt, args=(target, token, version, partition, batches), daemon=True)
        twin.start()
        try:
            return write_direct(target, token, version, partition, attempt, batches,
                                attrs.evolve(faults, duplicate_partitions=frozenset()))
        finally:
            twin.join()
    fail_at = faults.fail_after_rows if attempt < faults.fail_attempts and partition in faults.fail_partitions else None
    report = TaskReport(partition, attempt)
    with target.open_store() as store:
        writer = EventWriter(store, target.stream, writer_id=task_writer_id(token, version, partition),
                             batch_events=target.batch_events, shared=True)
        for columns in batches:
            if fail_at is not None and report.rows < fail_at <= report.rows + len(columns):
                _write_columns(writer, _first(columns, fail_at - report.rows))
                writer.flush()  # the rows so far land, then the attempt dies
                raise InjectedFailure(f"injected failure in task {partition} after {fail_at} rows")
            _write_columns(writer, columns)
            report.rows += len(columns)
        writer.flush()
        report.skipped = writer.events_skipped
        report.written = report.rows - report.skipped
    return report


def _write_columns(writer: EventWriter, columns) -> None:
    """Queue a batch of rows: ``EventColumns`` through ``write_many``, columns that are Arrow
    arrays (``values``, ``keys``, ``timestamps``: the Spark data source's rows) through
    ``write_arrow``, without a Python object per row."""
    if isinstance(columns, EventColumns):
        writer.write_many(columns.values, columns.keys, timestamps=columns.timestamps, headers=columns.headers)
    else:
        writer.write_arrow(columns.values, columns.keys, timestamps=columns.timestamps)


def _first(columns, n: int):
    """The first ``n`` rows of ``columns``."""
    if not isinstance(columns, EventColumns):
        return columns.head(n)
    return EventColumns(*(None if c is None else c[:n] for c in
                          (columns.values, columns.keys, columns.timestamps, columns.headers)))


def _twin_attempt(target, token, version, partition, batches) -> None:
    """A speculative duplicate of a task: same writer id, same rows, its own store handles."""
    try:
        write_direct(target, token, version, partition, attempt=1, batches=batches)
    except Exception:  # noqa: BLE001 - a losing twin's fate does not matter; its rows are deduplicated
        pass


def stage_attempt(target: StreamTarget, token: uuid.UUID, version: int, partition: int, attempt: int,
                  batches: Iterable[EventColumns], faults: Faults = Faults()) -> TaskReport:
    """Write a task attempt's rows to staging files of its own (nothing reaches the stream)."""
    if faults and attempt == 0 and partition in faults.duplicate_partitions:
        batches = list(batches)  # a twin stages a copy that nobody will publish
        stage_attempt(target, token, version, partition, 1, batches)
    fail_at = faults.fail_after_rows if attempt < faults.fail_attempts and partition in faults.fail_partitions else None
    report = TaskReport(partition, attempt)
    prefix = f"{staging_dir(target.stream, token, version)}/{partition:05d}-{uuid.uuid4().hex}"
    with target.open_store() as store:
        pending: list[bytes] = []
        size = 0
        for columns in batches:
            for rows, data in _staged_batches(columns, target.batch_events):
                pending.append(data)
                size += len(data)
                report.rows += rows
                if size >= STAGED_FILE_BYTES:
                    report.staged.append(_stage_file(store.storage, prefix, len(report.staged), pending))
                    pending, size = [], 0
                if fail_at is not None and report.rows >= fail_at:
                    raise InjectedFailure(f"injected failure in task {partition} after {report.rows} rows")
        if pending or not report.staged:
            report.staged.append(_stage_file(store.storage, prefix, len(report.staged), pending))
    return report


def _staged_batches(columns, batch_events: int) -> Iterator[tuple[int, bytes]]:
    """``(rows, batch bytes)`` of ``columns`` cut into batches of at most ``batch_events`` rows:
    ``EventColumns`` through ``Record``s, column-encoded columns (``encode(start, stop, now)``,
    the Spark data source's Arrow rows) without a Python object per row."""
    n = len(columns)
    if isinstance(columns, EventColumns):
        records = [Record(v, _routing_bytes(k), t, tuple(h)) for v, k, t, h in columns.records()]
        for start in range(0, n, batch_events):
            chunk = records[start:start + batch_events]
            yield len(chunk), encode_batch(0, chunk, timestamp=_now_ms())
        return
    for start in range(0, n, batch_events):
        stop = min(n, start + batch_events)
        yield stop - start, columns.encode(start, stop, _now_ms())


def _stage_file(storage, prefix: str, n: int, batches: list[bytes]) -> list:
    # each batch sealed for its byte position in the staging file, where ``publish`` reads it
    path, data = f"{prefix}-{n:05d}", place_batches(b"".join(batches), 0)
    storage.create(path, data)
    return [path, len(data)]


def _routing_bytes(key: object) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    return str(key).encode() if isinstance(key, (str, int)) else bytes(key)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- the driver's commit -----------------------------------------------------------------------
def commit_write(target: StreamTarget, token: uuid.UUID, version: int, reports: list[TaskReport], *,
                 staged: bool, keep_versions: int | None = None) -> dict:
    """Publish (staged mode) and record the write in the ledger; returns the summary recorded.

    ``keep_versions`` (streaming) forgets ledger entries more than that many versions old.
    """
    with target.open_store() as store:
        ledger = CommitLedger(store.storage, target.stream)
        done = ledger.committed(token, version)
        if done is not None:
            _drop_staging(store.storage, target.stream, token, version)
            return done
        summary = {"token": token.hex, "version": version, "tasks": len(reports),
                   "rows": sum(r.rows for r in reports), "committed_ms": _now_ms()}
        if staged:
            plan = sorted([r.partition, r.staged] for r in reports)
            plan = ledger.adopt_manifest(token, version, plan)
            summary.update(publish(target, store, token, version, plan))
            summary["rows"] = summary["published"]
        else:
            summary.update(written=sum(r.written for r in reports), skipped=sum(r.skipped for r in reports))
        ledger.record(token, version, summary)
        if staged:
            _drop_staging(store.storage, target.stream, token, version)
        if keep_versions is not None and version >= keep_versions:
            ledger.forget_before(token, version - keep_versions)
        return summary


def publish(target: StreamTarget, store: SegmentStore, token: uuid.UUID, version: int,
            plan: list[list]) -> dict:
    """Append the staged rows of each partition in ``plan`` as that partition's task writer."""

    def one(entry) -> tuple[int, int]:
        partition, files = entry
        writer = EventWriter(store, target.stream, writer_id=task_writer_id(token, version, partition),
                             batch_events=target.batch_events)
        rows = 0
        for path, size in files:
            data = store.storage.read(path, 0, size)
            for pos, header in iter_batches(data, segment=path):
                rows += _publish_batch(writer, data, pos, header, path)
        writer.flush()
        return rows, writer.events_skipped

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, plan))
    return {"published": sum(r for r, _ in results), "skipped": sum(s for _, s in results)}


def _publish_batch(writer: EventWriter, data: bytes, pos: int, header, path: str) -> int:
    """Queue the rows of one staged batch (checksum verified by ``iter_batches``) on ``writer``,
    decoded column by column; returns how many. Without headers (the Spark source's Arrow rows)
    the columns go to ``write_arrow`` as they are (no Python object per row), else to
    ``write_many``: both number, route and encode the same events alike."""
    import pyarrow as pa

    from ..log.columnar import decode_arrow

    batch = decode_arrow(data, pos, header, segment=path, verify=False)
    if not batch.num_rows:
        return 0
    stamps, keys, values, headers = batch.column(1).cast(pa.int64()), batch.column(2), batch.column(3), batch.column(4)
    if not len(headers.flatten()) and not values.null_count:
        writer.write_arrow(values, keys, timestamps=stamps)
        return batch.num_rows
    pairs = [tuple((h["key"], h["value"]) for h in row) for row in headers.to_pylist()]
    writer.write_many(values.to_pylist(), keys.to_pylist(), timestamps=stamps.to_pylist(), headers=pairs)
    return batch.num_rows


def abort_write(target: StreamTarget, token: uuid.UUID, version: int, files: list[list], *,
                everything: bool) -> None:
    """After a failed job (staged mode): drop the staging files of its tasks, or (``everything``,
    for a write nobody else can share: no ``writeId``) all staged files of the write. Files that a
    manifest recorded by a failed commit names are kept: a rerun must publish exactly those."""
    with target.open_store() as store:
        manifest = CommitLedger(store.storage, target.stream).manifest(token, version)
        if manifest:
            return
        if everything:
            _drop_staging(store.storage, target.stream, token, version)
        else:
            store.storage.delete([path for path, _size in files])


def _drop_staging(storage, stream: str, token: uuid.UUID, version: int) -> None:
    storage.remove_directory(staging_dir(stream, token, version))
