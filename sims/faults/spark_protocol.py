"""The Spark write protocol (``attrindex.spark.ingest``: tasks, retries, a speculative twin, the
driver's commit) run without Spark over ``FaultyStorage``, recorded for the history checker."""

from __future__ import annotations

import os

import attrs

from attrindex import SegmentStore
from attrindex.errors import AttrIndexError
from attrindex.spark.ingest import (EventColumns, Faults, StreamTarget, commit_write, stage_attempt, write_direct,
                                    write_token)
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage
from testkit.history import OK, UNKNOWN, Recorder

from .workload import DEFAULT_RATES


@attrs.frozen
class FaultyTarget(StreamTarget):
    """A Spark write target whose every store handle runs over ``FaultyStorage`` (fresh seeds)."""

    seed: int = 0
    rates: dict = attrs.field(factory=dict)
    opened: list = attrs.field(factory=list, eq=False)  #: every FaultyStorage made, for its ``injected``

    def open_store(self) -> SegmentStore:
        faulty = FaultyStorage(open_storage(self.url, **self.storage_options), seed=self.seed * 7919 + len(self.opened),
                               rates=self.rates, latency=0.002)
        # A lost acknowledgement on the first log write of every store a run opens, whatever the
        # random schedule draws (which stores write, and how often, varies with timing and mode).
        faulty.script("lost_ack", path_contains="_log.seg")
        self.opened.append(faulty)
        return SegmentStore(faulty, **self.store_options)


def spark_protocol_run(url: str, options: dict, history_dir: str, seed: int, rates: dict | None = DEFAULT_RATES, *,
                       staged: bool, partitions: int = 3, rows: int = 40, attempts: int = 8) -> bool:
    """One Spark write with no Spark: tasks (``write_direct`` or ``stage_attempt``, partition 0
    with a speculative twin) retried like Spark retries them, then the driver's ``commit_write``,
    retried likewise; every store under faults. Records the write's rows as one ``events`` op:
    ``ok`` if the commit returned (every row exactly once), else ``unknown``. Returns committed."""
    stream = f"spark{seed}"
    StreamTarget(url, stream, dict(options), segments=2).prepare()
    target = FaultyTarget(url, stream, dict(options), batch_events=7, seed=seed, rates=dict(rates or {}))
    token, task = write_token(f"job-{seed}"), stage_attempt if staged else write_direct
    recorder = Recorder(os.path.join(history_dir, f"spark-{seed}.jsonl"), f"spark{seed}")
    values = {p: [f"s{seed}.{p}:{i}" for i in range(rows)] for p in range(partitions)}
    op = recorder.invoke("events", payloads=[v for p in values for v in values[p]])
    reports = []
    for p in range(partitions):
        batches = [EventColumns([v.encode() for v in values[p][i:i + 10]]) for i in range(0, rows, 10)]
        for attempt in range(attempts):
            try:
                reports.append(task(target, token, 0, p, attempt, batches, Faults(duplicate_partitions=frozenset({0}))))
                break
            except AttrIndexError:
                continue
    committed = False
    if len(reports) == partitions:
        for _attempt in range(attempts):
            try:
                commit_write(target, token, 0, reports, staged=staged)
                committed = True
                break
            except AttrIndexError:
                continue
    recorder.end(op, OK if committed else UNKNOWN)
    recorder.faults([i for faulty in target.opened for i in faulty.injected])
    recorder.close()
    return committed


