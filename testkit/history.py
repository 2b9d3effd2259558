"""A history of concurrent operations and a checker of what the final state must hold.

Clients (threads or processes) record each operation as it is *invoked* and as it ends: ``ok``
(acknowledged), ``failed`` (a definite error: nothing was written) or ``unknown`` (the outcome is
not known: ``OutcomeUnknownError``, a process killed mid-call, an exception that is no project
error). Each client appends JSON lines to its own file, so a SIGKILLed process loses at most its
last, torn line (and an invoked operation without an end is ``unknown``).

``check(history, final_state)`` then verifies the promises of docs/reliability.md:

- every ``ok`` append is in the final log exactly once, at the offsets it was acknowledged with;
- every ``unknown`` append is there at most once; every ``failed`` one is absent;
- no offset is used twice, and each client's ``ok`` appends got increasing offsets;
- every counter (ACCUMULATE) equals the sum of the increments of the appends that are present,
  which must be the ``ok`` ones plus some subset of the ``unknown`` ones;
- compare-and-set updates (REPLACE_IF_EQUALS) applied form one chain from absent to the final value;
- a counter read is one some prefix of the writes gives (a subset sum of the increments invoked
  before the read ended, at least the ``ok`` ones done before a fresh read began), monotone per
  reader; a records read agrees with the final log at every offset it returned.

An append op has ``payloads`` (unique strings, the records it appends), optional ``increments``
(``{counter key: int}``) and optional ``cas`` (``[key, compare, value]``, ``compare`` ``None`` =
absent, values unique per key). A ``read`` op has ``counter`` + ``value``, or ``records``
(``[[offset, payload], ...]``). ``final_state`` = ``{"records": [[offset, payload], ...],
"attributes": {key: value}}``.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import threading
import time
from collections import Counter, defaultdict
from typing import Any, Callable, Iterator

import attrs

from attrindex.errors import AttrIndexError, OutcomeUnknownError, StorageError

OK, FAILED, UNKNOWN = "ok", "failed", "unknown"
_op_ids = itertools.count()


def classify(exc: BaseException) -> tuple[str, str]:
    """``(status, note)`` of an operation that raised ``exc``: ``OutcomeUnknownError`` and any
    non-project exception are ``unknown`` (the latter also noted as a violation), every other
    project error a definite failure."""
    if isinstance(exc, OutcomeUnknownError):
        return UNKNOWN, ""
    if isinstance(exc, AttrIndexError):
        return FAILED, ""
    return UNKNOWN, f"non-project exception {type(exc).__name__}: {exc}"


class Recorder:
    """Records one client's operations as JSON lines in ``path`` (appended, flushed per line)."""

    def __init__(self, path: str, client: str):
        self.client = client
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def _write(self, event: dict) -> None:
        event["client"], event["t"] = self.client, time.monotonic()  # system-wide clock on Linux
        with self._lock:
            self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
            self._file.flush()

    def invoke(self, kind: str, **fields: Any) -> str:
        """Record that an operation starts; return its id."""
        op_id = f"{self.client}/{os.getpid()}/{next(_op_ids)}"
        self._write({"phase": "invoke", "op": op_id, "kind": kind, **fields})
        return op_id

    def end(self, op_id: str, status: str, **fields: Any) -> None:
        """Record how operation ``op_id`` ended (``ok``, ``failed`` or ``unknown``)."""
        self._write({"phase": "end", "op": op_id, "status": status, **fields})

    def event(self, phase: str, **fields: Any) -> None:
        """Record an event that is no operation (``phase`` names it: what a tail reader saw, a
        violation the client noticed itself)."""
        self._write({"phase": phase, **fields})

    @contextlib.contextmanager
    def operation(self, kind: str, *, queued: bool = False, judge: Callable[[Exception], str] | None = None,
                  **fields: Any) -> Iterator[dict]:
        """Record ``kind`` around a block; put result fields into the yielded dict. An exception
        from the block is classified (``classify``), recorded and swallowed: the caller goes on.
        ``queued``: the client keeps what a failed call did not write and sends it later (an
        ``EventWriter`` flush), so a storage error is no definite failure but ``unknown``.
        ``judge``: returns a note (a violation) for a project error this call must never raise
        (``""`` if it may)."""
        op_id = self.invoke(kind, **fields)
        result: dict = {}
        try:
            yield result
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded, judged by the checker
            status, note = classify(exc)
            if queued and isinstance(exc, StorageError):
                status = UNKNOWN
            if not note and judge is not None:
                note = judge(exc)
            self.end(op_id, status, error=f"{type(exc).__name__}: {exc}"[:300], note=note)
        else:
            self.end(op_id, OK, **result)

    def faults(self, injected: list) -> None:
        """Record how many faults of each kind were injected into this client (``FaultyStorage.injected``)."""
        self._write({"phase": "faults", "counts": dict(Counter(i.kind for i in injected))})

    def close(self) -> None:
        self._file.close()


def fault_counts(history: list[dict]) -> Counter:
    """Faults injected per kind, over every client that recorded them."""
    total: Counter = Counter()
    for event in history:
        if event["phase"] == "faults":
            total.update(event["counts"])
    return total


@attrs.define
class Op:
    """One operation as the checker sees it (invocation merged with its end)."""

    id: str
    client: str
    kind: str
    invoked: float
    status: str = UNKNOWN
    ended: float = float("inf")
    fields: dict = attrs.Factory(dict)
    result: dict = attrs.Factory(dict)
    note: str = ""


def load_history(directory: str) -> list[dict]:
    """Every event of every ``*.jsonl`` file in ``directory`` (a torn last line is dropped)."""
    events = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().split("\n")
        for number, line in enumerate(lines):
            if not line:
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                if number < len(lines) - 2:  # only the last line may be torn by a kill
                    raise
    return events


def merge_ops(history: list[dict]) -> list[Op]:
    """Operations from events: an invocation without an end is ``unknown``."""
    ops: dict[str, Op] = {}
    for event in history:
        if event["phase"] == "invoke":
            fields = {k: v for k, v in event.items() if k not in ("phase", "op", "kind", "client", "t")}
            ops[event["op"]] = Op(event["op"], event["client"], event["kind"], event["t"], fields=fields)
    for event in history:
        if event["phase"] == "end":
            op = ops[event["op"]]
            op.status, op.ended, op.note = event["status"], event["t"], event.get("note", "")
            op.result = {k: v for k, v in event.items()
                         if k not in ("phase", "op", "status", "client", "t", "note", "error")}
    return sorted(ops.values(), key=lambda o: o.invoked)


@attrs.define
class CheckResult:
    """What ``check`` found: ``violations`` (empty = the history is valid) and counts."""

    violations: list[str] = attrs.Factory(list)
    ok: int = 0
    failed: int = 0
    unknown: int = 0
    unknown_applied: int = 0
    duplicates: int = 0  #: payloads stored more than once
    lost: int = 0  #: acknowledged payloads missing from the final log
    reads: int = 0

    @property
    def valid(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        return (f"ops ok={self.ok} failed={self.failed} unknown={self.unknown} (applied {self.unknown_applied}) "
                f"reads={self.reads} duplicates={self.duplicates} lost={self.lost} violations={len(self.violations)}")

    def assert_valid(self) -> None:
        assert self.valid, self.summary() + "\n" + "\n".join(self.violations[:30])


def check(history: list[dict], final_state: dict) -> CheckResult:
    """Check ``history`` (events, see ``load_history``) against ``final_state``; see the module doc."""
    ops = merge_ops(history)
    result = CheckResult()
    for op in ops:
        if op.note:
            result.violations.append(f"{op.id}: {op.note}")
    appends = [op for op in ops if op.kind in ("append", "events")]
    for op in appends:
        setattr(result, op.status, getattr(result, op.status) + 1)
    stored = _final_records(final_state, result)
    present = _check_appends(appends, stored, result)
    _check_offsets(appends, result)
    _check_counters(appends, present, final_state.get("attributes", {}), result)
    _check_cas(appends, present, final_state.get("attributes", {}), result)
    _check_reads(ops, appends, present, stored, result)
    return result


def _final_records(final_state: dict, result: CheckResult) -> dict[str, list[int]]:
    """payload -> the offsets it is stored at; offsets must be unique."""
    stored: dict[str, list[int]] = defaultdict(list)
    offsets = Counter()
    for offset, payload in final_state.get("records", []):
        stored[payload].append(offset)
        offsets[offset] += 1
    for offset, times in offsets.items():
        if times > 1:
            result.violations.append(f"offset {offset} holds {times} records")
    return stored


def _check_appends(appends: list[Op], stored: dict[str, list[int]], result: CheckResult) -> set[str]:
    """Presence rules; return the ids of the ops whose records are all stored.

    Judged per payload over every op that carried it (an ``events`` op may resend what an earlier
    life of its writer sent: exactly-once writers do). A payload of an ``ok`` op is stored exactly
    once, of ``unknown`` ones at most once, of ``failed`` ones only if another op carried it too.
    """
    present, statuses = set(), defaultdict(set)
    owner: dict[str, str] = {}
    for op in appends:
        for p in op.fields.get("payloads", []):
            statuses[p].add(op.status)
            if op.kind == "append":
                if p in owner:
                    result.violations.append(f"history: payload {p!r} used by {owner[p]} and {op.id}")
                owner[p] = op.id
    for payload, seen in statuses.items():
        count = len(stored.get(payload, ()))
        if count > 1:
            result.duplicates += 1
            result.violations.append(f"payload {payload!r} ({'/'.join(sorted(seen))}) stored {count} times")
        elif OK in seen and not count:
            result.lost += 1
            result.violations.append(f"payload {payload!r}: acknowledged but missing")
        elif seen == {FAILED} and count:
            result.violations.append(f"payload {payload!r}: its write failed (a definite error) but it is stored")
    for op in appends:
        payloads = op.fields.get("payloads", [])
        counts = [len(stored.get(p, ())) for p in payloads]
        if payloads and all(counts):
            present.add(op.id)
            result.unknown_applied += op.status == UNKNOWN
        if op.kind == "append" and any(counts) and not all(counts):
            result.violations.append(f"{op.id} ({op.status}): only part of its records is stored")
        first = op.result.get("first_offset")
        if op.status == OK and first is not None and payloads and all(counts):
            where = [stored[p][0] for p in payloads]
            if where != list(range(first, first + len(payloads))):
                result.violations.append(f"{op.id}: acknowledged at offset {first}, stored at {where[:5]}")
    return present


def _check_offsets(appends: list[Op], result: CheckResult) -> None:
    """Acknowledged offset ranges never overlap; per client they increase in invocation order."""
    spans = sorted((op.result["first_offset"], op.result["last_offset"], op.id) for op in appends
                   if op.status == OK and "first_offset" in op.result and op.fields.get("payloads"))
    for (a_first, a_last, a_id), (b_first, _b_last, b_id) in zip(spans, spans[1:]):
        if b_first <= a_last:
            result.violations.append(f"offset {b_first} acknowledged to both {a_id} and {b_id}")
    by_client: dict[str, list[Op]] = defaultdict(list)
    for op in appends:
        if op.status == OK and "first_offset" in op.result:
            by_client[op.client].append(op)
    for client, done in by_client.items():
        firsts = [op.result["first_offset"] for op in sorted(done, key=lambda o: o.invoked)]
        if any(b <= a for a, b in zip(firsts, firsts[1:])):
            result.violations.append(f"client {client}: acknowledged offsets not increasing: {firsts[:20]}")


def subset_sums(values: list[int], limit: int = 1 << 16) -> set[int] | None:
    """Every sum of a subset of ``values`` (``None`` if there are more than ``limit`` of them)."""
    sums = {0}
    for value in values:
        sums |= {s + value for s in sums}
        if len(sums) > limit:
            return None
    return sums


def _check_counters(appends: list[Op], present: set[str], attributes: dict, result: CheckResult) -> None:
    counters = sorted({key for op in appends for key in op.fields.get("increments", {})})
    for key in counters:
        final = attributes.get(key) or 0
        mine = [op for op in appends if key in op.fields.get("increments", {})]
        known = sum(op.fields["increments"][key] for op in mine if op.status == OK)
        open_ = [op for op in mine if op.status == UNKNOWN]
        sums = subset_sums([op.fields["increments"][key] for op in open_])
        if sums is not None and final - known not in sums:
            result.violations.append(f"counter {key}: {final} is not the acknowledged {known} plus a subset of "
                                     f"{len(open_)} unknown increments")
        if all(op.fields.get("payloads") for op in mine):  # presence tells exactly which were applied
            applied = sum(op.fields["increments"][key] for op in mine if op.id in present)
            if applied != final:
                result.violations.append(f"counter {key}: {final}, but the appends stored add up to {applied}")


def _check_cas(appends: list[Op], present: set[str], attributes: dict, result: CheckResult) -> None:
    by_key: dict[str, list[Op]] = defaultdict(list)
    for op in appends:
        if op.fields.get("cas") and op.status != FAILED:
            by_key[op.fields["cas"][0]].append(op)
    for key, ops in by_key.items():
        if not _cas_chain(ops, attributes.get(key)):
            done = sorted(((op.fields["cas"][1:], op.status) for op in ops), key=str)
            result.violations.append(f"compare-and-set {key}: no single order of the ok updates (plus some unknown "
                                     f"ones) leads from absent to {attributes.get(key)}: {done[:10]}")


def _cas_chain(ops: list[Op], final: int | None) -> bool:
    """Whether some chain absent -> ... -> ``final`` uses every ok op once and unknown ones at most once."""
    must = {op.id for op in ops if op.status == OK}
    by_compare: dict[Any, list[Op]] = defaultdict(list)
    for op in ops:
        by_compare[op.fields["cas"][1]].append(op)
    budget = [100_000]  # the search is small in practice; a runaway one is a failure, never a hang

    def walk(current, used: frozenset) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return False
        if current == final and must <= used:
            return True
        return any(walk(op.fields["cas"][2], used | {op.id})
                   for op in by_compare.get(current, ()) if op.id not in used)
    return walk(None, frozenset())


def _check_reads(ops: list[Op], appends: list[Op], present: set[str], stored: dict[str, list[int]],
                 result: CheckResult) -> None:
    at = {offsets[0]: payload for payload, offsets in stored.items()}
    last_seen: dict[tuple[str, str], int] = {}
    for read in (op for op in ops if op.kind == "read" and op.status == OK):
        result.reads += 1
        for offset, payload in read.result.get("records", []):
            if at.get(offset) != payload:
                result.violations.append(
                    f"{read.id}: read {payload!r} at offset {offset}, final log has {at.get(offset)!r}")
        key = read.fields.get("counter")
        if key is None:
            continue
        value = read.result["value"] or 0
        before = [op for op in appends if key in op.fields.get("increments", {}) and op.invoked < read.ended
                  and (op.status != FAILED or op.id in present)]  # a failed-but-stored one is reported apart
        done = sum(op.fields["increments"][key] for op in before if op.status == OK and op.ended < read.invoked)
        sums = subset_sums([op.fields["increments"][key] for op in before])
        if sums is not None and value not in sums:
            result.violations.append(f"{read.id}: counter {key} read {value}, which no prefix of the writes gives")
        if read.fields.get("fresh") and value < done:
            result.violations.append(f"{read.id}: counter {key} read {value} after {done} was acknowledged")
        previous = last_seen.get((read.client, key))
        if previous is not None and value < previous:
            result.violations.append(f"{read.id}: counter {key} went back from {previous} to {value}")
        last_seen[(read.client, key)] = value
