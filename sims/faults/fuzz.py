"""Corruption fuzz: damage a copy of a pristine store, query everything, judge the answers.

Two pristine stores are built once on local disk, each with its model:

- ``index``: an ``AttributeIndex`` with a deep tree (256-byte pages), many updates with removals,
  compacted and truncated as it goes; model: a dict;
- ``segment``: a segment with records and attributes (REPLACE and ACCUMULATE), some merged into
  its B+tree and the newest only in the log; model: the record values and the attribute dict.

A trial copies one (``shutil.copytree``), damages one file (``flip`` a bit, ``zero`` a range,
``truncate``) in one *target*: ``chunk`` (any data chunk), ``commit`` (a v1 ``.commit`` file or the
value of a v2 chunk's commit-record xattr),
``index`` (a chunk index file under ``_index/``) or ``tail`` (the last 128 bytes of the newest
chunk of a log or tree: the newest batch or footer). Then it reopens the copy and runs every query
under a timer. The outcome is ``ok`` (every answer equals the model), ``error`` (an
``AttrIndexError`` was raised: the damage was reported), ``rollback`` (the newest commit record
was damaged and the answers are exactly the state one write back: what a crash between a write's
data and its commit record leaves, indistinguishable to storage), ``wrong`` (any other answer that
differs, answers that disagree with each other, or an append after the damage that reused an
offset), ``crash`` (an exception that is no project error) or ``hang`` (the timer fired). Only
``ok``, ``error`` and ``rollback`` are allowed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from collections import Counter
from typing import Callable

import attrs

from attrindex import AttributeIndex, SegmentStore
from attrindex.conditional import AttributeUpdate, UpdateType
from attrindex.errors import AttrIndexError
from storage_adapters import local

OUTCOMES = ("ok", "error", "rollback", "wrong", "crash", "hang")
ALLOWED = ("ok", "error", "rollback")
ATTACKS = ("flip", "zero", "truncate")
TARGETS = ("chunk", "commit", "index", "tail")
INDEX_OPTIONS = {"page_size": 256, "rolling_size": 4096}
SEGMENT_OPTIONS = {"log_rolling_size": 2048, "flush_keys": 40, "attribute_options": dict(INDEX_OPTIONS)}
INDEX_KEYS = 1500  #: keys 0 .. INDEX_KEYS-1 are queried (present or not)
SEGMENT_KEYS = 200
TAIL_BYTES = 128


class TrialTimeout(BaseException):
    """The trial's timer fired (a BaseException, so no ``except Exception`` in the code under test
    can swallow it)."""


@attrs.frozen
class Pristine:
    """A pristine store on disk and what it must answer."""

    kind: str  #: "index" or "segment"
    path: str
    model: dict  #: index: {key: value}; segment: {"records": [...], "attributes": {...}}
    earlier: list = attrs.Factory(list)  #: the models after each earlier write, oldest first


@attrs.frozen
class Trial:
    """One damage trial: reproducible from ``seed`` over the same pristine store."""

    seed: int
    kind: str
    target: str
    attack: str
    file: str
    detail: str
    outcome: str
    note: str = ""

    def describe(self) -> str:
        return (f"seed={self.seed} {self.kind}/{self.target}/{self.attack} {self.file} {self.detail}: "
                f"{self.outcome} {self.note}")


# -- building the pristine stores ---------------------------------------------------------------
def build_index(path: str, seed: int = 1, updates: int = 60) -> Pristine:
    """An index with a deep tree: random updates of up to 25 keys, some removing keys."""
    rng = random.Random(seed)
    model: dict[int, int] = {}
    index = AttributeIndex.open(path, **INDEX_OPTIONS)
    earlier: list[dict] = []
    for _ in range(updates):
        earlier.append(dict(model))
        batch: dict[int, int | None] = {rng.randrange(INDEX_KEYS): rng.randrange(-2**63, 2**63) for _ in range(25)}
        for key in rng.sample(sorted(model), min(4, len(model))):
            batch[key] = None
        index.update(batch)
        for key, value in batch.items():
            if value is None:
                model.pop(key, None)
            else:
                model[key] = value
    index.close()
    return Pristine("index", path, model, earlier[1:])  # the empty index is no rollback target


def build_segment(path: str, seed: int = 2, appends: int = 150) -> Pristine:
    """A segment of ``appends`` appends of 1-3 records each with REPLACE and ACCUMULATE updates;
    the last ones stay in the log only (the handle is dropped, not closed: no final merge)."""
    rng = random.Random(seed)
    store = SegmentStore.open(path, **SEGMENT_OPTIONS)
    segment = store.segment("s", create=True)
    records: list[str] = []
    attributes: dict[int, int] = {}
    earlier: list[dict] = []
    for n in range(appends):
        earlier.append({"records": list(records), "attributes": dict(attributes)})
        values = [f"r{n}.{i}:" + "x" * rng.randrange(40) for i in range(rng.randint(1, 3))]
        key, total = rng.randrange(SEGMENT_KEYS), rng.randrange(SEGMENT_KEYS)
        segment.append([v.encode() for v in values],
                       [AttributeUpdate(key, value=n), AttributeUpdate(total, UpdateType.ACCUMULATE, value=n + 1)])
        records += values
        attributes[key] = n
        attributes[total] = attributes.get(total, 0) + n + 1
    earlier = [dict(m, records=m["records"]) for m in earlier[1:]]
    return Pristine("segment", path, {"records": records, "attributes": attributes}, earlier)


# -- queries ------------------------------------------------------------------------------------
class Inconsistent(Exception):
    """Two queries of one store disagreed with each other (always a wrong answer)."""


def query_index(path: str) -> dict:
    """Every query of an index copy; returns what it holds (``{key: value}``), checking that
    ``get_many``, ``get`` and full and ranged scans agree."""
    index = AttributeIndex.open(path, **INDEX_OPTIONS)
    try:
        keys = list(range(INDEX_KEYS))
        seen = {k: v for k, v in zip(keys, index.get_many(keys)) if v is not None}
        for key in keys[::97]:
            if index.get(key) != seen.get(key):
                raise Inconsistent(f"get({key}) != get_many")
        scanned = sorted((k.to_bytes(16, "big"), v) for k, v in seen.items())
        if list(index.items()) != scanned:
            raise Inconsistent("items() != get_many")
        low, high = 300, 900
        if list(index.items(low, high)) != [kv for kv in scanned if low <= int.from_bytes(kv[0], "big") < high]:
            raise Inconsistent("items(300, 900) != get_many")
        return seen
    finally:
        index.close()


def query_segment(path: str) -> dict:
    """Every query of a segment copy, then one append; returns ``{"records", "attributes",
    "appended_at"}``, checking that reads are offset-contiguous and lookups agree with the scan."""
    store = SegmentStore.open(path, **SEGMENT_OPTIONS)
    try:
        segment = store.segment("s")
        values, offset = [], 0
        for _ in range(10_000):
            batch = segment.read(offset, 100)
            if not batch:
                break
            if [r.offset for r in batch] != list(range(offset, offset + len(batch))):
                raise Inconsistent(f"read({offset}): offsets {[r.offset for r in batch][:5]}...")
            values += [r.value.decode() for r in batch]
            offset += len(batch)
        keys = list(range(SEGMENT_KEYS))
        attributes = {k: v for k, v in zip(keys, segment.get_attributes(keys)) if v is not None}
        if list(segment.attributes()) != sorted((k.to_bytes(16, "big"), v) for k, v in attributes.items()):
            raise Inconsistent("attributes() scan != get_attributes")
        done = segment.append([b"after-damage"])
        return {"records": values, "attributes": attributes, "appended_at": done.first_offset}
    finally:
        _close_quietly(store)


def index_matches(seen: dict, model: dict) -> str:
    """"" if an index answered like ``model``, else what differs."""
    wrong = sorted(k for k in set(seen) | set(model) if seen.get(k) != model.get(k))
    return f"{len(wrong)} keys differ, e.g. {wrong[0]}: {seen.get(wrong[0])} != {model.get(wrong[0])}" if wrong else ""


def segment_matches(seen: dict, model: dict) -> str:
    """"" if a segment answered like ``model`` and the append landed at its next offset."""
    if seen["records"] != model["records"]:
        return f"records differ: {len(seen['records'])} read, {len(model['records'])} expected"
    if seen["attributes"] != model["attributes"]:
        wrong = sorted(k for k in set(seen["attributes"]) | set(model["attributes"])
                       if seen["attributes"].get(k) != model["attributes"].get(k))
        return f"attributes: {len(wrong)} differ, e.g. key {wrong[0]}"
    if seen["appended_at"] != len(model["records"]):
        return f"an append after the damage landed at offset {seen['appended_at']}, not {len(model['records'])}"
    return ""


def _close_quietly(store) -> None:
    try:
        store.close()
    except AttrIndexError:
        pass  # closing a damaged store may report the damage again; the queries were judged


QUERIES: dict[str, Callable[[str], dict]] = {"index": query_index, "segment": query_segment}
MATCHES: dict[str, Callable[[dict, dict], str]] = {"index": index_matches, "segment": segment_matches}


def judge_answers(pristine: "Pristine", seen: dict, target: str) -> tuple[str, str]:
    """``ok`` if ``seen`` is the final model. ``rollback`` if the newest commit record was damaged
    and ``seen`` is the state one write back: a crash between a write's data and its commit record
    leaves exactly that, so storage cannot tell them apart (docs/reliability.md). Anything else,
    including a rollback of two or more writes (no crash loses a synced commit record), is ``wrong``."""
    difference = MATCHES[pristine.kind](seen, pristine.model)
    if not difference:
        return "ok", ""
    for n, earlier in enumerate(reversed(pristine.earlier)):
        if not MATCHES[pristine.kind](seen, earlier):
            if n == 0 and target == "commit":
                return "rollback", f"answers are the state one write back; {difference}"
            return "wrong", f"answers are the state {n + 1} writes back: {difference}"
    return "wrong", difference


# -- damage -------------------------------------------------------------------------------------
def targets(root: str) -> dict[str, list[str]]:
    """Files of a store by target (paths relative to ``root``; empty files left out)."""
    found: dict[str, list[str]] = {t: [] for t in TARGETS}
    newest: dict[str, str] = {}
    for directory, _dirs, files in os.walk(root):
        for name in sorted(files):
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, root)
            if not os.path.getsize(full):
                continue
            if name.endswith(".commit"):
                found["commit"].append(rel)
            elif os.sep + "_index" + os.sep in os.sep + rel:
                found["index"].append(rel)
            elif name.isdigit() and directory.endswith(".seg"):
                found["chunk"].append(rel)
                newest[directory] = max(newest.get(directory, ""), rel)
                if local.read_commit_record(full) is not None:
                    found["commit"].append(rel)  # a v2 chunk: its record is an xattr of the file
    found["tail"] = sorted(newest.values())
    return found


def damage(path: str, target: str, attack: str, rng: random.Random) -> str:
    """Damage file ``path`` in place; return what was done (for the report)."""
    if target == "commit" and not path.endswith(".commit"):
        return _damage_commit_xattr(path, attack, rng)
    size = os.path.getsize(path)
    low = max(0, size - TAIL_BYTES) if target == "tail" else 0
    with open(path, "r+b") as handle:
        if attack == "flip":
            at = rng.randrange(low, size)
            handle.seek(at)
            byte = handle.read(1)[0]
            bit = rng.randrange(8)
            handle.seek(at)
            handle.write(bytes([byte ^ (1 << bit)]))
            return f"bit {bit} of byte {at}/{size}"
        if attack == "zero":
            at = rng.randrange(low, size)
            length = min(rng.randint(1, 64), size - at)
            handle.seek(at)
            handle.write(bytes(length))
            return f"zeroed {at}..{at + length}/{size}"
        cut = rng.randrange(low, size)
        handle.truncate(cut)
        return f"truncated to {cut}/{size}"


def _damage_commit_xattr(path: str, attack: str, rng: random.Random) -> str:
    """The same attacks on the value of a v2 chunk's commit record (an extended attribute)."""
    value = bytearray(local.read_commit_record(path) or b"")
    size = len(value)
    if attack == "flip":
        at, bit = rng.randrange(size), rng.randrange(8)
        value[at] ^= 1 << bit
        detail = f"bit {bit} of byte {at}/{size}"
    elif attack == "zero":
        at = rng.randrange(size)
        length = min(rng.randint(1, 64), size - at)
        value[at:at + length] = bytes(length)
        detail = f"zeroed {at}..{at + length}/{size}"
    else:
        cut = rng.randrange(size)
        del value[cut:]
        detail = f"truncated to {cut}/{size}"
    local.write_commit_record(path, bytes(value))
    return "commit xattr: " + detail


def run_trial(pristine: Pristine, scratch: str, seed: int, timeout: float = 3.0) -> Trial:
    """Copy, damage and query ``pristine`` once (``scratch``: a directory for the copy)."""
    rng = random.Random(seed)
    copy = os.path.join(scratch, f"trial-{seed}")
    shutil.copytree(pristine.path, copy)
    try:
        found = targets(copy)
        target = rng.choice([t for t in TARGETS if found[t]])
        attack = rng.choice(ATTACKS)
        rel = rng.choice(found[target])
        detail = damage(os.path.join(copy, rel), target, attack, rng)
        outcome, note = _judge(lambda: QUERIES[pristine.kind](copy), timeout)
        if outcome == "answered":
            outcome, note = judge_answers(pristine, note, target)
        return Trial(seed, pristine.kind, target, attack, rel, detail, outcome, note)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def _judge(query: Callable[[], dict], timeout: float) -> tuple[str, object]:
    """Run ``query`` under a real-time timer (main thread only); ``("answered", answers)`` or how
    it failed."""
    def fire(_signum, _frame):
        raise TrialTimeout()

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return "answered", query()
    except Inconsistent as exc:
        return "wrong", f"inconsistent answers: {exc}"
    except TrialTimeout:
        return "hang", f"no answer within {timeout} s"
    except AttrIndexError as exc:
        return "error", f"{type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - any other exception is a finding, reported by the caller
        return "crash", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@attrs.define
class Tally:
    """Outcomes per attack (``kind/target/attack``) and in total."""

    per_attack: dict = attrs.Factory(dict)
    bad: list = attrs.Factory(list)  #: the trials that were wrong, crashed or hung
    seconds: float = 0.0

    def add(self, trial: Trial) -> None:
        self.per_attack.setdefault(f"{trial.kind}/{trial.target}/{trial.attack}", Counter())[trial.outcome] += 1
        if trial.outcome not in ALLOWED:
            self.bad.append(trial)

    def totals(self) -> Counter:
        total: Counter = Counter()
        for counts in self.per_attack.values():
            total.update(counts)
        return total

    def table(self) -> str:
        rows = [f"{'attack':32} {'trials':>7} " + " ".join(f"{o:>6}" for o in OUTCOMES)]
        for name in sorted(self.per_attack):
            counts = self.per_attack[name]
            rows.append(f"{name:32} {sum(counts.values()):>7} " + " ".join(f"{counts[o]:>6}" for o in OUTCOMES))
        total = self.totals()
        rows.append(f"{'total':32} {sum(total.values()):>7} " + " ".join(f"{total[o]:>6}" for o in OUTCOMES))
        return "\n".join(rows)

    def summary(self) -> str:
        total = self.totals()
        return (f"trials {sum(total.values())}, ok {total['ok']}, project errors {total['error']}, "
                f"rollbacks of one write (newest commit record damaged) {total['rollback']}, wrong answers "
                f"{total['wrong']}, non-project exceptions {total['crash']}, hangs {total['hang']} "
                f"in {self.seconds:.1f} s")


def fuzz(pristines: list[Pristine], scratch: str, trials: int, first_seed: int = 0, timeout: float = 3.0,
         progress: Callable[[Trial], None] | None = None) -> Tally:
    """Run ``trials`` trials, alternating over ``pristines``; seeds ``first_seed``, ``first_seed + 1``..."""
    tally, started = Tally(), time.monotonic()
    for n in range(trials):
        trial = run_trial(pristines[n % len(pristines)], scratch, first_seed + n, timeout)
        tally.add(trial)
        if progress is not None:
            progress(trial)
    tally.seconds = time.monotonic() - started
    return tally
