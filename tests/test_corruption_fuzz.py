"""Corruption fuzz in the suite: 200+ random damage trials (bit flip, zeroed range, truncation) over
the chunks, chunk index files and newest batches/footers of a deep-tree ``AttributeIndex`` and of a
segment with records and attributes, on local disk.

Every trial must answer every query exactly like the model or raise an ``AttrIndexError``, or, for
damage reaching the newest frame of a last chunk (cut as a torn write: docs/decisions/0001), answer
exactly like the state before the frames it reached; a wrong answer, a non-project exception or a
hang (each trial runs under a 3 s timer) fails the test, naming the trial's seed and damage. The machinery is ``sims.faults.fuzz`` (``python -m sims.faults.run``
runs the same at 10,000+ trials).
"""

from __future__ import annotations

import pytest

from sims.faults import fuzz

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
