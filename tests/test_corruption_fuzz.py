"""Corruption fuzz in the suite: 200+ random damage trials (bit flip, zeroed range, truncation) over
the chunks, chunk index files and newest batches/footers of a deep-tree ``AttributeIndex`` and of a
segment with records and attributes, on local disk.

Every trial must answer every query exactly like the model or raise an ``AttrIndexError``, or, for
damage reaching the newest frame of a last chunk (cut as a torn write: docs/decisions/0001), answer
exactly like the state before the frames it reached; a wrong answer, a non-project exception or a
hang (each trial runs under a 3 s timer) fails the test, naming the trial's seed and damage. The machinery is ``sims.faults.fuzz`` (``python -m sims.faults.run``
runs the same at 10,000+ trials).

Also: the newest and an older batch of a segment's log damaged, and a replay that folds tier 1
into columns (``overlay.FOLD_KEYS`` made small) meeting a torn or damaged batch of an index's WAL,
judged by the same rules.
"""

from __future__ import annotations

import random

import pytest

from attrindex import AttributeIndex
from attrindex import overlay as overlay_module
from attrindex import replay as replay_module
from attrindex.errors import CorruptDataError, StorageError
from attrindex.log.batch.header import BATCH_HEADER_SIZE
from sims.faults import fuzz
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage

TRIALS = 200


@pytest.fixture(scope="module")
def pristines(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    return [fuzz.build_index(str(root / "index")), fuzz.build_segment(str(root / "segment"))]


def test_pristine_stores_answer_like_their_models(pristines):
    index, segment = pristines
    assert len(index.model) > 500 and len(segment.model["records"]) > 200
    assert fuzz.index_matches(fuzz.query_index(index.path), index.model) == ""
    assert len(index.earlier) > 10 and len(segment.earlier) > 100  # rollback targets
    found = fuzz.targets(segment.path)
    assert all(found[t] for t in fuzz.TARGETS), found  # every kind of file is there to damage
    assert fuzz.targets(index.path)["tail"]


def test_every_damage_is_answered_exactly_or_reported(pristines, tmp_path):
    tally = fuzz.fuzz(pristines, str(tmp_path), TRIALS, first_seed=0, timeout=3.0)
    report = tally.summary() + "\n" + tally.table()
    print("\n" + report)
    total = tally.totals()
    assert sum(total.values()) == TRIALS and total["error"] > 0  # damage was found, not only missed
    assert not tally.bad, report + "\n" + "\n".join(t.describe() for t in tally.bad[:40])


def test_every_damage_to_an_index_with_sorted_runs_is_answered_exactly_or_reported(tmp_path):
    """The fuzz over an index whose tree keeps sorted runs beside it (run leaves, key filters,
    runs pages, run merges and rebuilds among its newest versions)."""
    pristine = fuzz.build_index(str(tmp_path / "index"), seed=3, runs=True)
    opened = AttributeIndex.open(pristine.path, mode="r", **fuzz.INDEX_OPTIONS)
    try:
        forest = opened.stats()  # (the tree has runs: its footer's height is 0 with a root)
        assert fuzz.index_matches(fuzz.index_answers(opened), pristine.model) == ""
    finally:
        opened.close()
    assert forest.entry_count > len(pristine.model)  # entries stored in runs and in the tree
    tally = fuzz.fuzz([pristine], str(tmp_path / "scratch"), TRIALS // 2, first_seed=10_000, timeout=3.0)
    report = tally.summary() + "\n" + tally.table()
    total = tally.totals()
    assert sum(total.values()) == TRIALS // 2 and total["error"] > 0
    assert not tally.bad, report + "\n" + "\n".join(t.describe() for t in tally.bad[:40])


@pytest.mark.parametrize("part", ["payload", "header"])
def test_damage_to_the_newest_log_batch_is_at_most_a_rollback_of_that_write(pristines, tmp_path, part):
    """The newest batch of the segment's log (never merged) damaged: in its payload (header intact)
    it cannot be told from a torn write on local disk (docs/decisions/0001), so the answers are the
    state one write back, never two, and the offsets it claimed are never given out again. A
    damaged header no crash leaves (a torn write begins with its header whole): reported."""
    import shutil

    from attrindex.log.batch.header import BATCH_HEADER_SIZE

    segment = pristines[1]
    copy = str(tmp_path / "copy")
    shutil.copytree(segment.path, copy)
    rel = max(p for p in fuzz.targets(copy)["tail"] if "_log.seg" in p)
    view = fuzz.chunk_view(copy, rel)
    newest = view.frame_ends[-2]  # where the newest batch starts
    at = newest + (BATCH_HEADER_SIZE + 2 if part == "payload" else 30)
    outcome, answers = _query_with_a_flipped_byte(copy, rel, at)
    if part == "header":
        assert outcome == "error" and "CorruptDataError" in repr(answers), answers
        return
    assert outcome == "answered", answers
    outcome, note, reused, back = fuzz.judge_answers(segment, answers, fuzz.rollback_frames(view, at))
    assert outcome == "rollback" and back == 1 and not reused, note


def _query_with_a_flipped_byte(copy: str, rel: str, at: int) -> tuple[str, object]:
    """Flip one bit of byte ``at`` of the chunk ``rel`` of the store ``copy``, then query it."""
    with open(f"{copy}/{rel}", "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x08]))
    return fuzz.run_query(lambda: fuzz.query_segment(copy), timeout=3.0)


def test_damage_below_the_newest_log_batch_is_reported(pristines, tmp_path):
    """The batch before the newest one damaged: a valid batch follows it, so it is damage below
    committed data, reported, never a rollback."""
    import shutil

    from attrindex.log.batch.header import BATCH_HEADER_SIZE

    segment = pristines[1]
    copy = str(tmp_path / "copy")
    shutil.copytree(segment.path, copy)
    rel = max(p for p in fuzz.targets(copy)["tail"] if "_log.seg" in p)
    at = fuzz.chunk_view(copy, rel).frame_ends[-3] + BATCH_HEADER_SIZE + 2
    outcome, answers = _query_with_a_flipped_byte(copy, rel, at)
    assert outcome == "error", answers


# -- a replay that folds tier 1 meeting a damaged WAL ---------------------------------------------
WAL_OPTIONS = dict(fuzz.INDEX_OPTIONS, merge_keys=1 << 20, merge_seconds=1e6, merge_process=False)  # merges: flush only


@pytest.mark.parametrize("elsewhere", ["catch-up", "merged elsewhere"])
@pytest.mark.parametrize("damage", ["torn", "newest", "older"])
def test_a_replay_that_folds_meets_a_torn_or_damaged_wal_batch(tmp_path, monkeypatch, damage, elsewhere):
    """Tier 1 folded into columns at every batch (``FOLD_KEYS`` 3; each update sets 25 keys) while
    a reader's refresh and a fresh open replay an index's WAL whose writer stopped (dropped, not
    closed) in a torn append, or whose newest or older committed batch has a flipped byte. The
    reader's refresh replays the tail (``catch-up``), or, after the writer merged meanwhile,
    rebuilds tier 1 from the newer tree (``merged elsewhere``). Torn: the acknowledged state.
    The newest batch flipped (cannot be told from a torn write on local disk): one write back,
    never two. An older batch: ``CorruptDataError``, and the reader answers a state no older
    than the one it had."""
    monkeypatch.setattr(overlay_module, "FOLD_KEYS", 3)
    calls = {"fold": 0, "rebuild": 0}
    fold, rebuild = overlay_module.AttributeOverlay.fold, replay_module.from_newest_tree

    def counted_fold(overlay):
        calls["fold"] += 1
        fold(overlay)

    def counted_rebuild(log, tree):
        calls["rebuild"] += 1
        return rebuild(log, tree)

    monkeypatch.setattr(overlay_module.AttributeOverlay, "fold", counted_fold)
    monkeypatch.setattr(replay_module, "from_newest_tree", counted_rebuild)

    root = str(tmp_path / "index")
    storage = FaultyStorage(open_storage(root), seed=0)
    writer = AttributeIndex(storage, **WAL_OPTIONS)
    rng, model, history = random.Random(7), {}, []

    def update() -> None:
        batch = fuzz.index_batch(rng, model)
        writer.update(batch)
        history.append(dict(model))  # the state before it
        fuzz.apply_batch(model, batch)

    for n in range(12):
        update()
        if n == 7:
            writer.flush()  # a tree, and batches after its checkpoint
    reader = AttributeIndex.open(root, mode="r", **WAL_OPTIONS)
    assert fuzz.index_answers(reader) == model
    opened_at = len(history)  # the reader holds history[opened_at] (the model now)
    for n in range(6):
        update()
        if n == 0 and elsewhere == "merged elsewhere":
            writer.flush()  # the reader's tree version is no longer the newest
    rel = max(p for p in fuzz.targets(root)["tail"] if "_wal" in p)
    view = fuzz.chunk_view(root, rel)
    at = None
    if damage == "torn":
        storage.script("torn", op="append")
        with pytest.raises(StorageError):  # never acknowledged: the writer stops here
            writer.update(fuzz.index_batch(rng, model))
        assert storage.injected
    else:
        at = view.frame_ends[-2 if damage == "newest" else -3] + BATCH_HEADER_SIZE + 2  # in a batch's payload
        with open(f"{root}/{rel}", "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x08]))
    pristine = fuzz.Pristine("index", root, model, history)
    allowed = fuzz.rollback_frames(view, at) if at is not None else 0
    expected = {"torn": ("ok", 0), "newest": ("rollback", 1)}.get(damage)  # (outcome, writes back)

    def judged(answers: dict) -> tuple[str, int]:
        outcome, _note, _reused, back = fuzz.judge_answers(pristine, answers, allowed)
        return outcome, back

    calls.update(fold=0, rebuild=0)
    outcome, answers = fuzz.run_query(lambda: (reader.refresh(), fuzz.index_answers(reader))[1], timeout=10.0)
    if expected is None:
        assert outcome == "error" and "CorruptDataError" in answers, (outcome, answers)
        states = history + [model]
        after = fuzz.index_answers(reader)  # what it applied before the damage, never less
        assert any(states[n] == after for n in range(opened_at, len(states) - 1)), "the reader went back"
    else:
        assert outcome == "answered", answers
        assert judged(answers) == expected
        assert calls["rebuild"] == (elsewhere == "merged elsewhere")
    assert calls["fold"] >= 2, "the reader's replay did not fold"

    calls.update(fold=0)
    outcome, answers = fuzz.run_query(lambda: fuzz.query_index(root), timeout=10.0)
    assert calls["fold"] >= 2, "the open's replay did not fold"
    if expected is None:
        assert outcome == "error" and answers == "CorruptDataError", (outcome, answers)
        with pytest.raises(CorruptDataError):
            AttributeIndex.open(root, mode="r", **WAL_OPTIONS)
    else:
        assert outcome == "answered", answers
        assert judged(answers) == expected
    reader.close()
