"""Compare-and-append across OS processes, and a writer killed with SIGKILL mid-append."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from storage_adapters import open_storage

from . import workers
from .workers import run_together
from .conftest import make_s3_url
from .framed import frame, open_segment


@pytest.fixture(params=["local", "s3"])
def shared_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store"), {}
    options = request.getfixturevalue("s3_options")
    return make_s3_url(options), options


def test_every_raced_offset_is_won_by_exactly_one_process(shared_url):
    url, options = shared_url
    writers, rounds = 4, 12
    out = run_together(workers.race_rounds, lambda i: (url, options, "race", i, rounds), writers)
    winners = {}
    for writer, outcome in out:
        for result, round_number, offset in outcome:
            if result == "won":
                assert round_number not in winners, f"round {round_number} won twice"
                winners[round_number] = (writer, offset)
    assert sorted(winners) == list(range(rounds))  # every round has exactly one winner
    losses = Counter(r for _, outcome in out for result, r, _ in outcome if result == "lost")
    assert all(losses[r] == writers - 1 for r in range(rounds))
    storage = open_storage(url, **options)
    seg = open_segment(storage, "race")
    assert seg.length == rounds * len(frame(storage, workers.make_record(0, 0, 40)))
    records = workers.parse_records(seg.read(0, seg.length), framed=storage.torn_appends)
    # The segment is exactly the winners' records, in round order, at the offsets they were given.
    assert [(off, w, seq) for off, w, seq, _ in records] == [
        (winners[r][1], winners[r][0], r) for r in range(rounds)
    ]


def test_free_for_all_appends_are_neither_lost_nor_interleaved(shared_url):
    url, options = shared_url
    writers, appends = 3, 25
    out = run_together(workers.race_free_for_all, lambda i: (url, options, "ffa", i, appends), writers)
    seg = open_segment(open_storage(url, **options), "ffa")
    records = workers.parse_records(seg.read(0, seg.length), framed=seg.storage.torn_appends)
    assert len(records) == writers * appends
    acknowledged = {(writer, seq): offset for writer, won, _ in out for offset, seq in won}
    assert {(w, seq): off for off, w, seq, _ in records} == acknowledged
    # Per writer, its records appear in its own order.
    for writer in range(writers):
        assert [seq for _, w, seq, _ in records if w == writer] == list(range(appends))


def test_killed_writer_leaves_a_prefix_of_completed_appends(tmp_path):
    directory, name = str(tmp_path / "store"), "crash"
    rng = random.Random(1234)
    acknowledged: list[tuple[int, int, int]] = []
    # Kills that landed inside an append: after its bytes were written (it is committed, never
    # acknowledged) or while they were (a torn write: a prefix of its frame past the end).
    inside = 0
    for attempt in range(15):  # 6 kills, more (bounded) until one landed inside an append
        if attempt >= 6 and inside:
            break
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.workers", "append_forever", directory, name, str(len(acknowledged))],
            stdout=subprocess.PIPE,
            text=True,
        )
        # The clock starts at the first returned append: on a loaded machine starting Python alone
        # can outlast the sleep, and kills during start-up tear nothing.
        first = child.stdout.readline()
        time.sleep(rng.random() * 0.5)
        child.send_signal(signal.SIGKILL)
        lines = (first + child.stdout.read()).split()
        child.wait()
        acknowledged += [tuple(map(int, lines[i:i + 3])) for i in range(0, len(lines) - 2, 3)]
        seg = open_segment(open_storage(directory), name, rolling_size=4 << 20)
        records = workers.parse_records(seg.read(0, seg.length), framed=True)  # asserts no partial record
        stored = [(off, seq, length) for off, _, seq, length in records]
        # Everything acknowledged is there; at most the one append in flight was completed too.
        assert stored[: len(acknowledged)] == acknowledged, f"attempt {attempt}"
        assert len(stored) - len(acknowledged) in (0, 1)
        torn = seg.torn_tail
        if torn is not None:  # not committed: a prefix of the next record's frame, at the end
            next_record = frame(seg.storage, workers.make_record(7, len(stored), 4096 * (1 + len(stored) % 97)),
                                seg.length)
            assert torn[0] == seg.length and next_record.startswith(torn[1]), f"attempt {attempt}"
        inside += len(stored) > len(acknowledged) or torn is not None
        acknowledged = stored  # the next child continues after what is stored
    assert len(acknowledged) > 10
    assert inside > 0, "no kill landed inside an append; the test did not exercise a crash mid-append"
