"""``attrindex demo`` runs again on the same store, reports only what it measured, and keeps
what its report names."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile

import pytest

from attrindex import SegmentStore
from attrindex.cli import main as cli_main
from attrindex.demo import _output_to, list_command, main

from tests.conftest import make_s3_url

#: (rows, partitions) of the two runs. The first is the size where the lookup step looks up more
#: than 1,000 users, on 4 partitions (a failing task and a duplicated task that are different
#: tasks); the rerun is small, on 2 partitions.
RUNS = {1: (16_000, 4), 2: (1_000, 2)}


def _demo(spark, path, lines: list[str], run: int) -> int:
    rows, partitions = RUNS[run]
    return main(path, {}, rows, spark=spark, segments=2, partitions=partitions, say=lines.append)


def _records(store, stream: str) -> int:
    return sum(store.segment(name).stats().next_offset for name in store.stream_segments(stream))


@pytest.mark.slow
def test_the_demo_reruns_on_its_store_and_keeps_it(spark, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a demo without --path puts its store
    first: list[str] = []
    assert _demo(spark, None, first, 1) == 0  # 0: exactly once and no lookup mismatch
    url = re.fullmatch(r"attrindex demo: run 1 in (.+)", first[0])[1]
    assert os.path.dirname(url) == str(tmp_path) and os.path.basename(url).startswith("attrindex-demo-")
    second: list[str] = []
    assert _demo(spark, url, second, 2) == 0  # the same store again: was "exactly once NO: 1000 duplicates", exit 1
    assert second[0] == f"attrindex demo: run 2 in {url}"
    for run, lines in ((1, first), (2, second)):
        rows = RUNS[run][0]
        text = "\n".join(lines)
        assert "[5/5] report" in lines
        assert f"  store                {url}, run {run} under run-{run}/ (kept)" in lines
        assert "  exactly once         yes: 0 duplicates, 0 missing" in lines
        assert f"{rows:,} rows read, {rows:,} distinct events, 0 duplicates, 0 missing" in text
        assert re.search(r"  job rerun            same writeId: appended 0 rows in [\d.]+ s", text)
        assert lines[-1] == f"attrindex demo: the store is kept: attrindex segment list {url} --prefix run-{run}"
        skipped = int(re.search(r"the retries skipped ([\d,]+) rows", text)[1].replace(",", ""))
        assert skipped > 0  # the injected failure of task 1 had written rows its retry skipped
        lookups = int(re.search(r"  lookups              ([\d,]+) users looked up, 0 mismatches", text)[1].replace(",", ""))
        assert lookups > (1000 if run == 1 else 0)
    # what the reports name is there, and holds what they said
    with SegmentStore.open(url, mode="r+") as store:
        for run in (1, 2):
            assert _records(store, f"run-{run}/shop-events") == RUNS[run][0]
            loaded = int(re.search(r"([\d,]+) users loaded", "\n".join(first if run == 1 else second))[1].replace(",", ""))
            assert store.segment(f"run-{run}/user-purchase-totals").stats().attributes.entry_count == loaded > 0
    capsys.readouterr()
    assert cli_main(["segment", "list", url, "--prefix", "run-2"]) == 0
    assert capsys.readouterr().out.split() == ["run-2/shop-events/0", "run-2/shop-events/1", "run-2/user-purchase-totals"]


def test_spark_start_up_output_goes_to_the_log_not_the_terminal(tmp_path, capfd):
    log = tmp_path / "spark.log"
    with _output_to(str(log)):
        child = subprocess.Popen([sys.executable, "-c", "import sys, time; print('jvm out'); "
                                  "print('WARN jvm start-up', file=sys.stderr); sys.stdout.flush(); time.sleep(0.5); "
                                  "print('later', file=sys.stderr)"])
    print("attrindex's own line")
    child.wait(timeout=30)  # it keeps writing after the redirection ended: still to the log
    out, err = capfd.readouterr()
    assert (out, err) == ("attrindex's own line\n", "")
    assert log.read_text().split("\n") == ["jvm out", "WARN jvm start-up", "later", ""]


def test_the_closing_hint_pastes_as_is_with_the_storage_options_given(s3_options, capsys):
    # The demo's last line names the command listing its run; on S3 it needs the -o options the
    # demo was given (the endpoint and credentials here; nested ones as JSON).
    url = make_s3_url(s3_options)
    options = {**s3_options, "client_kwargs": {"region_name": "us-east-1"}}
    with SegmentStore.open(url, storage_options=options) as store:
        store.segment("run-1/events/0", create=True).append([b"e"])
    hint = list_command(url, options, "run-1")
    words = shlex.split(hint)
    assert words[:3] == ["attrindex", "segment", "list"] and "-o" in words
    capsys.readouterr()
    assert cli_main(words[1:]) == 0
    assert capsys.readouterr().out == "run-1/events/0\n"
    assert list_command("/tmp/a b", {}, "run-2") == "attrindex segment list '/tmp/a b' --prefix run-2"
