"""Corruption fuzz: damage a copy of a pristine store, query everything, judge the answers.

Two pristine stores are built once on local disk, each with its model:

- ``index``: an ``AttributeIndex`` with a deep tree (256-byte pages), many updates with removals,
  compacted and truncated as it goes; model: a dict;
- ``segment``: a segment with records and attributes (REPLACE and ACCUMULATE), some merged into
  its B+tree and the newest only in the log; model: the record values and the attribute dict.

A trial copies one (``shutil.copytree``), damages one file (``flip`` a bit, ``zero`` a range,
``truncate``) in one *target*: ``chunk`` (the committed bytes of any data chunk), ``index`` (a
chunk index file under ``_index/``) or ``tail`` (the last 128 committed bytes of the newest chunk
of a log or tree: its newest batch or footer). A chunk file is longer than its data (chunks are
pre-written with zeros past their end), so damage to a chunk stays within its committed bytes, as
the store's view before the damage tells them. Then it reopens the copy and runs every query
under a timer. The outcome is ``ok`` (every answer equals the model), ``error`` (an
``AttrIndexError`` was raised: the damage was reported), ``rollback`` (the damage reached the
newest frame of a log's or tree's last chunk, nothing valid after it, and the answers are exactly
the state before the frames it reached: on local disk that cannot be told from a write torn by a
crash, and is cut as one: docs/decisions/0001; a truncation only where it cuts exactly at a
frame's end, see ``rollback_frames``), ``wrong`` (any other answer that differs, answers
that disagree with each other, or an append after the damage that reused an offset other than
those of such a cut), ``crash`` (an exception that is no project error) or ``hang`` (the timer
fired). Only ``ok``, ``error`` and ``rollback`` are allowed; rollbacks are counted apart, with
those whose cut batch's offsets were given out again (its header was damaged too).
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
from attrindex.btree.footer import FOOTER_SIZE, MAGIC, decode_footer
from attrindex.btree.framing import TREE_FRAMING
from attrindex.conditional import AttributeUpdate, UpdateType
from attrindex.errors import AttrIndexError
from attrindex.log.batch.chain import iter_batches
from attrindex.log.framing import LOG_FRAMING
from storage_adapters import RollingSegment, open_storage
from storage_adapters.rolling import SEGMENT_SUFFIX

OUTCOMES = ("ok", "error", "rollback", "wrong", "crash", "hang")
ALLOWED = ("ok", "error", "rollback")
ATTACKS = ("flip", "zero", "truncate")
TARGETS = ("chunk", "index", "tail")
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
    reused: bool = False  #: a rollback whose cut batch's offsets were given out again
    back: int = 0  #: a rollback: how many writes back the answers are

    def describe(self) -> str:
        return (f"seed={self.seed} {self.kind}/{self.target}/{self.attack} {self.file} {self.detail}: "
                f"{self.outcome} {self.note}")


# -- building the pristine stores ---------------------------------------------------------------
#: Options of the index with sorted runs beside its tree (``build_index(runs=True)``): runs from
#: a tree of 100 entries on, as many as fit, merged only by ``flush`` (docs/decisions/0007).
RUNS_OPTIONS = {**INDEX_OPTIONS, "run_min_entries": 100, "run_share": 1.0, "merge_keys": 1 << 20}


def build_index(path: str, seed: int = 1, updates: int = 60, runs: bool = False) -> Pristine:
    """An index with a deep tree: random updates of up to 25 keys, some removing keys. With
    ``runs``, merged every 6 updates, so the tree's newest versions add sorted runs beside it
    (and merge them together, and into the tree) and the WAL holds the updates since."""
    rng = random.Random(seed)
    model: dict[int, int] = {}
    index = AttributeIndex.open(path, **(RUNS_OPTIONS if runs else INDEX_OPTIONS))
    earlier: list[dict] = []
    for i in range(updates):
        earlier.append(dict(model))
        batch = index_batch(rng, model)
        index.update(batch)
        apply_batch(model, batch)
        if runs and i % 6 == 5 and i + 1 < updates:
            index.flush()
    index.close()
    return Pristine("index", path, model, earlier[1:])  # the empty index is no rollback target


def index_batch(rng: random.Random, model: dict) -> dict[int, int | None]:
    """One update of ``build_index``: 25 random keys set, up to 4 keys of ``model`` removed."""
    batch: dict[int, int | None] = {rng.randrange(INDEX_KEYS): rng.randrange(-2**63, 2**63) for _ in range(25)}
    for key in rng.sample(sorted(model), min(4, len(model))):
        batch[key] = None
    return batch


def apply_batch(model: dict, batch: dict[int, int | None]) -> None:
    """``model`` after the update ``batch`` (``None`` removes)."""
    for key, value in batch.items():
        if value is None:
            model.pop(key, None)
        else:
            model[key] = value


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
        return index_answers(index)
    finally:
        index.close()


def index_answers(index: AttributeIndex) -> dict:
    """``query_index`` through a handle that is open already."""
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


def judge_answers(pristine: "Pristine", seen: dict, rollback_frames: int = 0) -> tuple[str, str, bool, int]:
    """``(outcome, note, reused, writes back)``. ``ok`` if ``seen`` is the final model. ``rollback`` if the
    damage reached the newest frame of a last chunk (``rollback_frames``: how many frames, from
    the first one it reached to the newest) and ``seen`` is the state at most that many writes
    back: on local disk that is what a torn newest write leaves, cut as one (docs/decisions/0001).
    ``reused``: the append after it got an offset an earlier append was acknowledged with (the cut
    batch's header was damaged too, so the offsets it claimed were unknown). Anything else is
    ``wrong``."""
    difference = MATCHES[pristine.kind](seen, pristine.model)
    if not difference:
        return "ok", "", False, 0
    for n, earlier in enumerate(reversed(pristine.earlier), start=1):
        if not _state_matches(pristine.kind, seen, earlier):
            continue
        if n > rollback_frames:
            return "wrong", f"answers are the state {n} writes back: {difference}", False, 0
        if pristine.kind != "segment":
            return "rollback", f"answers are the state {n} writes back", False, n
        landed, back, newest = seen["appended_at"], len(earlier["records"]), len(pristine.model["records"])
        if not back <= landed <= newest:
            return "wrong", f"state {n} writes back, but an append after it landed at offset {landed}", False, 0
        return "rollback", f"answers are the state {n} writes back; the next append landed at {landed}", landed < newest, n
    return "wrong", difference, False, 0


def _state_matches(kind: str, seen: dict, model: dict) -> bool:
    """Whether ``seen`` holds the data of ``model`` (for a segment: records and attributes; where
    the next append landed is judged apart)."""
    if kind == "segment":
        return seen["records"] == model["records"] and seen["attributes"] == model["attributes"]
    return not MATCHES[kind](seen, model)


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
            if os.sep + "_index" + os.sep in os.sep + rel:
                found["index"].append(rel)
            elif name.isdigit() and directory.endswith(SEGMENT_SUFFIX):
                found["chunk"].append(rel)
                newest[directory] = max(newest.get(directory, ""), rel)
    found["tail"] = sorted(newest.values())
    return found


@attrs.frozen
class ChunkView:
    """What a chunk file holds, as its segment's view tells (read before any damage)."""

    committed: int  #: its committed bytes (the file goes on with pre-written zeros)
    #: the last chunk of its segment: the chunk-relative ends of its frames (batches; tree
    #: updates), oldest first; empty for any other chunk
    frame_ends: tuple[int, ...] = ()


def chunk_view(root: str, rel: str) -> ChunkView:
    """The view of chunk file ``rel`` of the store at ``root``."""
    directory, chunk = os.path.split(rel)
    name = directory[:-len(SEGMENT_SUFFIX)].replace(os.sep, "/")
    log = name.rsplit("/", 1)[-1] == "_log"
    with open_storage(root) as storage, \
            RollingSegment(storage, name, framing=LOG_FRAMING if log else TREE_FRAMING) as segment:
        chunks = segment.chunks()
    (info,) = [c for c in chunks if c.name == chunk]
    if info != chunks[-1]:
        return ChunkView(info.stored)
    with open(os.path.join(root, rel), "rb") as handle:
        data = handle.read(info.stored)
    if log:
        ends = tuple(at + header.size for at, header in iter_batches(data, position=info.start))
    else:
        ends, at = [], data.find(MAGIC)
        while at >= 0:
            if decode_footer(data[at:at + FOOTER_SIZE], info.start + at) is not None:
                ends.append(at + FOOTER_SIZE)
            at = data.find(MAGIC, at + 1)
        ends = tuple(ends)
    return ChunkView(info.stored, ends)


def damage(path: str, target: str, attack: str, rng: random.Random, view: ChunkView | None) -> tuple[str, int]:
    """Damage file ``path`` in place (a chunk: within its committed bytes); return what was done
    (for the report) and the first byte damaged (for a truncation: where it cut)."""
    size = view.committed if view is not None else os.path.getsize(path)
    low = max(0, size - TAIL_BYTES) if target == "tail" else 0
    with open(path, "r+b") as handle:
        if attack == "flip":
            at = rng.randrange(low, size)
            handle.seek(at)
            byte = handle.read(1)[0]
            bit = rng.randrange(8)
            handle.seek(at)
            handle.write(bytes([byte ^ (1 << bit)]))
            return f"bit {bit} of byte {at}/{size}", at
        if attack == "zero":
            at = rng.randrange(low, size)
            length = min(rng.randint(1, 64), size - at)
            handle.seek(at)
            handle.write(bytes(length))
            return f"zeroed {at}..{at + length}/{size}", at
        cut = rng.randrange(low, size)
        handle.truncate(cut)
        return f"truncated to {cut}/{size}", cut


def rollback_frames(view: ChunkView | None, first: int, attack: str = "flip") -> int:
    """How many frames of a last chunk, from the first one damage starting at byte ``first``
    reached to the newest: a rollback of as many writes is what a torn newest write could leave
    (damage always reaches the newest frame when it starts in it or, for a zeroed range, runs to
    the end). A truncation inside a frame leaves a file shorter than any crash leaves it (the
    zeros kept after the chain's end: storage_adapters/tail.py), so it must be reported: 0. A
    truncation exactly where a frame ends (or at the chunk's start) leaves a chunk that reads as
    rolled past (trimmed), which nothing tells from a crash between the trim and the next chunk:
    the frames after the cut. 0 for damage anywhere else."""
    if view is None or not view.frame_ends:
        return 0
    if attack == "truncate" and first not in (0, *view.frame_ends):
        return 0
    return sum(1 for end in view.frame_ends if end > first)


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
        view = chunk_view(copy, rel) if target != "index" else None
        detail, first = damage(os.path.join(copy, rel), target, attack, rng, view)
        outcome, note = run_query(lambda: QUERIES[pristine.kind](copy), timeout)
        reused, back = False, 0
        if outcome == "answered":
            outcome, note, reused, back = judge_answers(pristine, note, rollback_frames(view, first, attack))
        return Trial(seed, pristine.kind, target, attack, rel, detail, outcome, note, reused, back)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def run_query(query: Callable[[], dict], timeout: float) -> tuple[str, object]:
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
    reused: int = 0  #: rollbacks whose cut batch's offsets were given out again
    deeper: Counter = attrs.Factory(Counter)  #: rollbacks of more than one write, per attack
    seconds: float = 0.0

    def add(self, trial: Trial) -> None:
        self.per_attack.setdefault(f"{trial.kind}/{trial.target}/{trial.attack}", Counter())[trial.outcome] += 1
        self.reused += trial.reused
        if trial.back > 1:
            self.deeper[trial.attack] += 1
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
                f"newest-write rollbacks (damage reaching the newest frame of a last chunk, cut as a torn "
                f"write) {total['rollback']} ({self.reused} of them gave the cut batch's offsets out again; "
                f"{sum(self.deeper.values())} rolled back more than one write: "
                f"{dict(self.deeper) or 'none'}), "
                f"wrong answers {total['wrong']}, non-project exceptions {total['crash']}, hangs "
                f"{total['hang']} in {self.seconds:.1f} s")


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
