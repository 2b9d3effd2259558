"""Log compaction, consolidation and retention racing writers and a tail reader in other
processes, over injected storage faults and SIGKILLs, judged by the changelog checker
(testkit/changelog_history.py): the bounded form of ``python -m sims.faults.compaction``.

Each round: two writer processes (keyed records, tombstones, conditional appends, a counter), a
compactor looping ``compact``, a consolidator looping ``consolidate`` (and ``apply_retention``
on ``delete,compact``) and a tail reader, all over ``FaultyStorage``, SIGKILLed a fixed number of
times at random moments and restarted. The round ends only once a compaction (and a retention)
made progress and a consolidation ran beside the writers. Then: the log as stored and after quiet
compactions that expire every tombstone must be a valid changelog of the history (no deleted key
back, no latest value lost, no offset reused, the reader saw every survivor once and in order),
``verify_segment`` clean, a fresh reader reading the same, and ``delete_segment`` under faults
leaving nothing.
"""

from __future__ import annotations

import pytest

from sims.faults import compaction


def run(url, options, tmp_path, *, seed, variant, ops, kills, rates):
    figures = compaction.run_round(url, options, str(tmp_path / "round"), seed=seed, variant=variant, ops=ops,
                                   kills=kills, rates=rates)
    violations = figures.pop("violations")
    print(f"\n{variant}: {figures}")
    assert violations == [], "\n".join(violations[:20])
    assert figures["kills"] == kills
    assert figures["compact_effective"] >= 1 and figures["consolidate_calls"] > figures["consolidate_failed"]
    if variant == "delete,compact":
        assert figures["retention_effective"] + figures["compact_retention"] >= 1
    assert figures["appends_ok"] >= ops and figures["reader_seen"] > 0
    assert figures["fault_lost_ack"] >= 2 and figures["fault_fail_before"] >= 2  # scripted in every writer
    assert figures["stored_quiet"] < figures["records_written"]  # compaction removed records
    return figures


@pytest.mark.parametrize("variant", ["compact", "delete,compact"])
def test_compaction_racing_writers_and_a_tail_reader_under_faults_and_kills_local(tmp_path, variant):
    run(str(tmp_path / "store"), {}, tmp_path, seed=20261201, variant=variant, ops=24, kills=3,
        rates=compaction.LOCAL_RATES)


def test_compaction_racing_writers_and_a_tail_reader_under_faults_and_kills_s3(tmp_path, s3_options):
    from tests.conftest import make_s3_url

    run(make_s3_url(s3_options), s3_options, tmp_path, seed=7, variant="delete,compact", ops=8, kills=2,
        rates=compaction.S3_RATES)
