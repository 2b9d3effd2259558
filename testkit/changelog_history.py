"""A changelog model of a compacted segment, and a checker of a concurrent history against it.

Log compaction, consolidation and retention remove and move records while writers append and a
tail reader follows, so ``testkit.history.check`` (every acknowledged record stored exactly once)
does not apply. What may legitimately disappear (docs/segments.md, "Compaction" and "Retention"):
a record superseded by a later record of its key, a tombstone once it expired, anything below the
retention start. What never may: the latest record of a key (a value), a deleted key's older value
once its tombstone is gone, an offset's record changing, a failed append's records.

The history uses ``testkit.history``'s format. Writers record ``append`` operations whose fields are
``payloads`` (unique ids, one per record, stored in the record's ``id`` header), ``keys``,
``values`` (``None`` = tombstone) and optionally ``increments`` (``{counter: int}``, ACCUMULATE);
an ``ok`` end has ``first_offset``/``last_offset``. The tail reader records ``begin`` (``position``:
where a life of the reader starts), ``seen`` (``offset``, ``id``, ``key``, ``value``) and
``restart`` (``at``: its position when it got ``RecordTruncatedError``, ``start``: the start offset
it went on from) events. Any client may record a ``violation`` event (``message``) and any
operation may carry a ``note`` (an error it must never raise). ``final`` = ``{"records": [[offset,
id, key, value], ...] in read order, "start_offset": int, "attributes": {counter: value}}``.

``check_changelog(history, final)`` requires:

- the final records: offsets strictly increasing, none below the start offset, each exactly what
  was appended at that offset (id, key, value), each id once, none from a failed append;
- every offset known for an id (acknowledged, stored, seen by the reader) is the same, and no
  offset is known for two ids (an offset is never reused);
- per key, the latest record that survives is the latest write known to be applied (acknowledged,
  stored or seen): no later write of the key is gone. A later write that is gone is a lost latest
  value or, if a tombstone, a deleted key that came back, unless the record that survives is a
  tombstone too: the key reads as deleted either way (an older tombstone the cleaner had to keep,
  its batch rewritten no smaller, outlives the newest one that expired). A key none of whose records survives had
  a tombstone as its latest write, or it lies below the start offset, or an append of unknown
  outcome that may have come later could have superseded it;
- each counter = the acknowledged increments + those of appends known applied + a subset of the
  other unknown ones;
- the reader: offsets strictly increasing over all its lives, each record seen exactly what was
  appended there, a truncation restart moves forward, and every final record at or after where it
  began was seen (the start offset only grows, so a record that survives was never below it).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import attrs

from .history import FAILED, OK, UNKNOWN, Op, merge_ops, subset_sums


@attrs.define
class ChangelogResult:
    """What ``check_changelog`` found: ``violations`` (empty = valid) and counts."""

    violations: list[str] = attrs.Factory(list)
    ok: int = 0
    failed: int = 0
    unknown: int = 0
    records_written: int = 0  #: records of appends known applied
    records_stored: int = 0
    tombstones_expired: int = 0  #: keys whose latest write was a tombstone that is gone
    reader_seen: int = 0
    reader_restarts: int = 0
    unjudged_keys: int = 0  #: keys gone whose latest known value an unknown append may have superseded

    @property
    def valid(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        return (f"appends ok={self.ok} failed={self.failed} unknown={self.unknown} records written="
                f"{self.records_written} stored={self.records_stored} tombstones expired={self.tombstones_expired} "
                f"reader seen={self.reader_seen} restarts={self.reader_restarts} unjudged keys={self.unjudged_keys} "
                f"violations={len(self.violations)}")

    def assert_valid(self) -> None:
        assert self.valid, self.summary() + "\n" + "\n".join(self.violations[:30])


@attrs.define
class _Write:
    id: str
    key: str
    value: str | None
    op: Op


def check_changelog(history: list[dict], final: dict) -> ChangelogResult:
    """Check ``history`` against ``final`` (see the module doc)."""
    result = ChangelogResult()
    ops = merge_ops(history)
    result.violations += [f"{op.id}: {op.note}" for op in ops if op.note]
    result.violations += [f"{e['client']}: {e['message']}" for e in history if e["phase"] == "violation"]
    appends = [op for op in ops if op.kind == "append"]
    for op in appends:
        setattr(result, op.status, getattr(result, op.status) + 1)
    writes = _writes(appends, result)
    offsets = _Offsets(result)
    for op in appends:
        first = op.result.get("first_offset")
        if op.status == OK and first is not None:
            ids = op.fields["payloads"]
            if op.result.get("last_offset") != first + len(ids) - 1:
                result.violations.append(f"{op.id}: acknowledged {first}..{op.result.get('last_offset')} "
                                         f"for {len(ids)} records")
            for i, record_id in enumerate(ids):
                offsets.learn(record_id, first + i, f"acknowledged to {op.id}")
    stored = _check_final(final, writes, offsets, result)
    seen = _check_reader(history, writes, offsets, stored, final, result)
    for op in appends:  # one record of a batch known (stored or seen): the batch's offsets are known
        ids = op.fields.get("payloads", [])
        where = next(((i, offsets.of[record_id]) for i, record_id in enumerate(ids) if record_id in offsets.of), None)
        if where is not None and op.status != OK:
            for i, record_id in enumerate(ids):
                offsets.learn(record_id, where[1] - where[0] + i, f"in the batch of {ids[where[0]]!r}")
    for record_id, write in writes.items():
        if write.op.status == FAILED and (record_id in stored or record_id in seen):
            result.violations.append(f"{record_id!r}: its append failed (a definite error) but it was "
                                     f"{'stored' if record_id in stored else 'seen by the reader'}")
    applied = {op.id for op in appends
               if op.status == OK or any(i in offsets.of for i in op.fields.get("payloads", []))}
    result.records_written = sum(len(op.fields.get("payloads", [])) for op in appends if op.id in applied)
    _check_keys(writes, offsets, stored, final.get("start_offset", 0), appends, result)
    _check_counters(appends, applied, final.get("attributes", {}), result)
    return result


def _writes(appends: list[Op], result: ChangelogResult) -> dict[str, _Write]:
    writes: dict[str, _Write] = {}
    for op in appends:
        ids, keys, values = (op.fields.get(name, []) for name in ("payloads", "keys", "values"))
        if not len(ids) == len(keys) == len(values):
            result.violations.append(f"history: {op.id} has {len(ids)} ids, {len(keys)} keys, {len(values)} values")
            continue
        for record_id, key, value in zip(ids, keys, values):
            if record_id in writes:
                result.violations.append(f"history: id {record_id!r} used by {writes[record_id].op.id} and {op.id}")
            writes[record_id] = _Write(record_id, key, value, op)
    return writes


class _Offsets:
    """The offset known for each id, and the id known at each offset; a conflict is a violation."""

    def __init__(self, result: ChangelogResult):
        self.of: dict[str, int] = {}
        self.at: dict[int, str] = {}
        self._source: dict[str, str] = {}
        self._result = result

    def learn(self, record_id: str, offset: int, source: str) -> None:
        known = self.of.get(record_id)
        if known is not None and known != offset:
            self._result.violations.append(f"{record_id!r}: {source} at offset {offset}, but "
                                           f"{self._source[record_id]} at {known}")
            return
        other = self.at.get(offset)
        if other is not None and other != record_id:
            self._result.violations.append(f"offset {offset} reused: {other!r} ({self._source[other]}) and "
                                           f"{record_id!r} ({source})")
            return
        self.of[record_id], self.at[offset] = offset, record_id
        self._source.setdefault(record_id, source)


def _same(record_id: str, key: str, value: str | None, writes: dict[str, _Write]) -> str:
    """Why the record (``record_id``, ``key``, ``value``) is not the one appended, or ``""``."""
    write = writes.get(record_id)
    if write is None:
        return f"id {record_id!r} was never appended"
    if (write.key, write.value) != (key, value):
        return f"{record_id!r} is ({key!r}, {value!r:.40}), appended as ({write.key!r}, {write.value!r:.40})"
    return ""


def _check_final(final: dict, writes: dict[str, _Write], offsets: _Offsets, result: ChangelogResult) -> dict[str, int]:
    stored: dict[str, int] = {}
    start = final.get("start_offset", 0)
    previous = -1
    for offset, record_id, key, value in final["records"]:
        result.records_stored += 1
        if offset <= previous:
            result.violations.append(f"final log: offset {offset} after {previous} (not strictly increasing)")
        if offset < start:
            result.violations.append(f"final log: offset {offset} read below the start offset {start}")
        previous = max(previous, offset)
        wrong = _same(record_id, key, value, writes)
        if wrong:
            result.violations.append(f"final log at {offset}: {wrong}")
        if record_id in stored:
            result.violations.append(f"final log: {record_id!r} stored twice (offsets {stored[record_id]}, {offset})")
        stored[record_id] = offset
        offsets.learn(record_id, offset, "stored")
    return stored


def _check_reader(history: list[dict], writes: dict[str, _Write], offsets: _Offsets, stored: dict[str, int],
                  final: dict, result: ChangelogResult) -> set[str]:
    events = sorted((e for e in history if e["phase"] in ("begin", "seen", "restart")), key=lambda e: e["t"])
    seen: set[str] = set()
    if not events:
        return seen
    begin = min(e["position"] for e in events if e["phase"] == "begin") if any(
        e["phase"] == "begin" for e in events) else 0
    previous = -1
    for event in events:
        if event["phase"] == "restart":
            result.reader_restarts += 1
            if event["start"] <= event["at"]:
                result.violations.append(f"reader: RecordTruncatedError at {event['at']}, but it went on from the "
                                         f"start offset {event['start']} (no truncation above its position)")
            continue
        if event["phase"] == "begin":
            if event["position"] <= previous:
                result.violations.append(f"reader: a life began at {event['position']}, after it had seen {previous}")
            continue
        result.reader_seen += 1
        offset, record_id = event["offset"], event["id"]
        if offset <= previous:
            result.violations.append(f"reader: saw offset {offset} after {previous} (twice or out of order)")
        previous = max(previous, offset)
        wrong = _same(record_id, event["key"], event["value"], writes)
        if wrong:
            result.violations.append(f"reader at {offset}: {wrong}")
        seen.add(record_id)
        offsets.learn(record_id, offset, "seen by the reader")
    for record_id, offset in stored.items():
        if offset >= begin and record_id not in seen:
            result.violations.append(f"reader: never saw {record_id!r} at offset {offset}, which survives")
    return seen


def _check_keys(writes: dict[str, _Write], offsets: _Offsets, stored: dict[str, int], start: int,
                appends: list[Op], result: ChangelogResult) -> None:
    applied: dict[str, list[tuple[int, _Write]]] = defaultdict(list)
    for record_id, offset in offsets.of.items():
        write = writes.get(record_id)
        if write is not None:
            applied[write.key].append((offset, write))
    for key, known in applied.items():
        known.sort(key=lambda pair: pair[0])
        survivors = [offset for offset, write in known if write.id in stored]
        if survivors:
            later = [(offset, write) for offset, write in known if offset > survivors[-1]]
            if later and later[-1][1].value is None and writes[_id_at(known, survivors[-1])].value is None:
                result.tombstones_expired += later[-1][0] >= start  # deleted then, deleted now
            elif later:
                offset, write = later[-1]
                what = ("a deleted key came back: its tombstone" if write.value is None
                        else "its latest value was lost:")
                result.violations.append(f"key {key!r}: {what} {write.id!r} at {offset} ({write.op.status}) is gone "
                                         f"but {_id_at(known, survivors[-1])!r} at {survivors[-1]} survives")
            continue
        offset, latest = known[-1]
        if latest.value is None:
            result.tombstones_expired += offset >= start
        elif offset >= start:
            if _maybe_superseded(key, latest.op, appends, offsets):
                result.unjudged_keys += 1
            else:
                result.violations.append(f"key {key!r}: its latest value {latest.id!r} at {offset} "
                                         f"({latest.op.status}) is gone and nothing of the key survives")


def _id_at(known: list[tuple[int, _Write]], offset: int) -> str:
    return next(write.id for o, write in known if o == offset)


def _maybe_superseded(key: str, op: Op, appends: list[Op], offsets: _Offsets) -> bool:
    """Whether an append of unknown outcome and unknown offset, with a record of ``key``, may have
    come after ``op`` (it did not end before ``op`` began)."""
    for other in appends:
        if (other.status == UNKNOWN and key in other.fields.get("keys", [])
                and not any(i in offsets.of for i in other.fields["payloads"]) and not other.ended < op.invoked):
            return True
    return False


def _check_counters(appends: list[Op], applied: set[str], attributes: dict[str, Any], result: ChangelogResult) -> None:
    for counter in sorted({c for op in appends for c in op.fields.get("increments", {})}):
        mine = [op for op in appends if counter in op.fields.get("increments", {}) and op.status != FAILED]
        known = sum(op.fields["increments"][counter] for op in mine if op.id in applied)
        open_ = [op.fields["increments"][counter] for op in mine if op.id not in applied]
        final = attributes.get(counter) or 0
        sums = subset_sums(open_)
        if sums is not None and final - known not in sums:
            result.violations.append(f"counter {counter}: {final} is not the {known} of the appends known applied "
                                     f"plus a subset of {len(open_)} unknown increments")
