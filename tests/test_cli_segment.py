"""The ``attrindex segment`` commands: append, read, tail, stats, retention and list."""

from __future__ import annotations

import base64
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from attrindex import Record, SegmentStore
from attrindex.cli import main
from attrindex.cli_options import parse_duration, parse_size

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "attrindex.cli"]
DAY_MS = 86_400_000


def _env() -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout first on the import path."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"}


def _run(*argv: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], input=input, capture_output=True, text=True, env=_env(), timeout=30)


def _popen(*argv: str) -> subprocess.Popen:
    # SIGINT back to its default: a test runner started in the background may pass it on ignored,
    # and Python only turns SIGINT into KeyboardInterrupt when it is not ignored at start-up.
    return subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


class _Lines:
    """The lines a subprocess prints, collected by a thread so a test can wait with a timeout."""

    def __init__(self, stream):
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next(self, timeout: float = 10) -> str | None:
        return self._queue.get(timeout=timeout)


def _records(path, name: str = "s") -> list:
    with SegmentStore.open(str(path)) as store:
        segment = store.segment(name)
        return segment.read(segment.start_offset, 100_000) if segment.next_offset > segment.start_offset else []


def _fields(out: str) -> list[list[str]]:
    return [line.split("\t") for line in out.splitlines()]


# -- append and read ----------------------------------------------------------------------------


def test_append_values_then_read_them_as_text_and_json(tmp_path, capsys):
    url = str(tmp_path)
    # "\udcff" is how Python hands over the undecodable byte 0xff in a command-line argument
    assert main(["segment", "append", url, "s", "--create", "--key", "k1", "plain", "ünïcode", "\udcff\udcfe"]) == 0
    assert capsys.readouterr().out == "appended 3 records at offsets 0..2\n"
    assert main(["segment", "append", url, "s", "tab\there", "0xab", ""]) == 0
    assert capsys.readouterr().out == "appended 3 records at offsets 3..5\n"

    assert [r.value for r in _records(tmp_path)] == [b"plain", "ünïcode".encode(), b"\xff\xfe", b"tab\there", b"0xab", b""]

    assert main(["segment", "read", url, "s"]) == 0
    rows = _fields(capsys.readouterr().out)
    assert [row[0] for row in rows] == ["0", "1", "2", "3", "4", "5"]
    assert all(abs(int(row[1]) - time.time() * 1000) < 60_000 for row in rows)
    assert [row[2] for row in rows] == ["k1", "k1", "k1", "", "", ""]
    # text when it is unambiguous on one line; 0x-hex for non-UTF-8, control characters and text
    # that itself starts with 0x
    assert [row[3] for row in rows] == ["plain", "ünïcode", "0xfffe", "0x" + b"tab\there".hex(), "0x" + b"0xab".hex(), ""]

    assert main(["segment", "read", url, "s", "--format", "json", "--offset", "1", "--max", "3"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["offset"] for o in objects] == [1, 2, 3]
    assert objects[0]["value"] == "ünïcode" and objects[0]["key"] == "k1" and objects[0]["headers"] == []
    assert "value" not in objects[1] and base64.b64decode(objects[1]["value_base64"]) == b"\xff\xfe"
    assert objects[2]["value"] == "tab\there" and objects[2]["key"] is None


def test_append_reads_stdin_lines_in_batches(tmp_path, capsys, monkeypatch):
    url = str(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\ntwo\r\n\nfour\n\xff five")))
    assert main(["segment", "append", url, "s", "--create", "--batch", "2"]) == 0
    assert capsys.readouterr().out == "appended 5 records at offsets 0..4\n"
    assert [r.value for r in _records(tmp_path)] == [b"one", b"two", b"", b"four", b"\xff five"]

    # --expected-offset holds for the first batch and chains the later ones
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a\nb\nc\n")))
    assert main(["segment", "append", url, "s", "--batch", "2", "--expected-offset", "5"]) == 0
    assert capsys.readouterr().out == "appended 3 records at offsets 5..7\n"
    assert main(["segment", "append", url, "s", "late", "--expected-offset", "5"]) == 1
    assert "append expected offset 5 but the segment's length is 8" in capsys.readouterr().err


def test_a_failing_batch_reports_the_batches_already_appended(tmp_path, capsys, monkeypatch):
    from attrindex.errors import StorageError
    from attrindex.segment import Segment

    real_append, calls = Segment.append, []

    def flaky_append(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise StorageError("the disk went away")
        return real_append(self, *args, **kwargs)

    monkeypatch.setattr(Segment, "append", flaky_append)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"1\n2\n3\n4\n5\n")))
    assert main(["segment", "append", str(tmp_path), "s", "--create", "--batch", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("attrindex: appended 4 records at offsets 0..3 before the error below\n"
                            f"attrindex: error: the disk went away (store {tmp_path}); check the storage, then retry\n")
    assert [r.value for r in _records(tmp_path)] == [b"1", b"2", b"3", b"4"]


def test_values_may_follow_the_options(tmp_path, capsys):
    url = str(tmp_path)
    assert main(["segment", "append", url, "s", "--create", "--codec", "gzip", "a", "-5", "--key", "k", "b", "--", "-x"]) == 0
    assert capsys.readouterr().out == "appended 4 records at offsets 0..3\n"
    assert [(r.key, r.value) for r in _records(tmp_path)] == [(b"k", b"a"), (b"k", b"-5"), (b"k", b"b"), (b"k", b"-x")]
    with pytest.raises(SystemExit) as caught:  # argparse's own errors exit as for every command
        main(["segment", "append", url, "s", "a", "--no-such-option"])
    assert caught.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_append_and_read_through_real_processes(tmp_path):
    url = str(tmp_path)
    done = _run("segment", "append", url, "s", "--create", "--timestamp", "1234", input="first\nsecond\nthird\n")
    assert (done.returncode, done.stdout, done.stderr) == (0, "appended 3 records at offsets 0..2\n", "")
    read = _run("segment", "read", url, "s", "--format", "json", "--offset", "1")
    assert read.returncode == 0, read.stderr
    assert [json.loads(line) for line in read.stdout.splitlines()] == [
        {"offset": 1, "timestamp": 1234, "key": None, "value": "second", "headers": []},
        {"offset": 2, "timestamp": 1234, "key": None, "value": "third", "headers": []},
    ]


def test_append_to_a_missing_segment_needs_create(tmp_path, capsys):
    url = str(tmp_path)
    assert main(["segment", "append", url, "s", "x"]) == 4  # not even the store exists
    err = capsys.readouterr().err
    assert err.startswith(f"attrindex: error: no store at URL 'file://{tmp_path}'") and "give --create" in err
    assert err.count("\n") == 1 and os.listdir(url) == []  # nothing was created
    main(["segment", "append", url, "other", "--create", "x"])
    assert main(["segment", "append", url, "s", "x"]) == 4
    err = capsys.readouterr().err
    assert err.startswith("attrindex: error: segment 's' does not exist") and "--create" in err
    assert err.count("\n") == 1
    with SegmentStore.open(url) as store:
        assert store.segments() == ["other"]
    assert main(["segment", "read", url, "s"]) == 4
    assert "segment 's' does not exist" in capsys.readouterr().err


def test_attributes_set_by_append_are_visible_to_the_library(tmp_path, capsys, monkeypatch):
    url = str(tmp_path)
    writer = uuid.uuid4()
    assert main(["segment", "append", url, "s", "--create", "record",
                 "--attribute", "1=10", "--attribute", f"{writer}=-5", "--attribute", "0000000000000000000000000000000a=7"]) == 0
    assert capsys.readouterr().out == "appended 1 records at offsets 0..0 with 3 attribute update(s)\n"
    # no records at all: the updates go alone ("none" removes)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    assert main(["segment", "append", url, "s", "--attribute", "1=none", "--attribute", "10=70"]) == 0
    assert capsys.readouterr().out == "appended 0 records with 2 attribute update(s); next offset 1\n"
    with SegmentStore.open(url) as store:
        segment = store.segment("s")
        assert segment.get_attribute(1) is None
        assert segment.get_attribute(writer) == -5
        assert segment.get_attribute(10) == 70
        assert segment.next_offset == 1


def test_read_from_a_timestamp(tmp_path, capsys):
    url = str(tmp_path)
    main(["segment", "append", url, "s", "--create", "--timestamp", "1000", "a", "b"])
    main(["segment", "append", url, "s", "--timestamp", "2000", "c"])
    main(["segment", "append", url, "s", "--timestamp", "3000", "d"])
    capsys.readouterr()
    assert main(["segment", "read", url, "s", "--timestamp", "1500"]) == 0
    assert _fields(capsys.readouterr().out) == [["2", "2000", "", "c"], ["3", "3000", "", "d"]]
    assert main(["segment", "read", url, "s", "--timestamp", "2000", "--max", "1"]) == 0
    assert _fields(capsys.readouterr().out) == [["2", "2000", "", "c"]]
    assert main(["segment", "read", url, "s", "--timestamp", "9999"]) == 0
    assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit) as caught:
        main(["segment", "read", url, "s", "--offset", "1", "--timestamp", "1"])
    assert caught.value.code == 2
    assert "argument --timestamp: not allowed with argument --offset" in capsys.readouterr().err


# -- tail ---------------------------------------------------------------------------------------


def test_tail_in_process_prints_what_a_thread_appends_then_stops_at_max(tmp_path, capsys):
    url = str(tmp_path)
    main(["segment", "append", url, "s", "--create", "old0", "old1"])
    capsys.readouterr()

    def appender():
        with SegmentStore.open(url) as store:
            segment = store.segment("s")
            for value in (b"new2", b"new3", b"new4", b"new5"):
                time.sleep(0.1)
                segment.append([value])

    thread = threading.Thread(target=appender)
    thread.start()
    try:
        assert main(["segment", "tail", url, "s", "--offset", "1", "--max", "4", "--timeout", "10"]) == 0
    finally:
        thread.join()
    assert [row[3] for row in _fields(capsys.readouterr().out)] == ["old1", "new2", "new3", "new4"]


def test_tail_stops_after_timeout_without_new_records(tmp_path, capsys):
    url = str(tmp_path)
    main(["segment", "append", url, "s", "--create", "a", "b"])
    capsys.readouterr()
    started = time.monotonic()
    assert main(["segment", "tail", url, "s", "--timeout", "0.3", "--format", "json"]) == 0
    assert 0.25 < time.monotonic() - started < 30  # waited its timeout, and stopped
    assert [json.loads(line)["value"] for line in capsys.readouterr().out.splitlines()] == ["a", "b"]
    started = time.monotonic()
    assert main(["segment", "tail", url, "s", "--from-end", "--timeout", "0.2"]) == 0
    assert capsys.readouterr().out == ""
    assert time.monotonic() - started < 30


def test_tail_subprocess_follows_another_process_and_ctrl_c_exits_cleanly(tmp_path):
    url = str(tmp_path)
    assert main(["segment", "append", url, "s", "--create", "before"]) == 0
    tail = _popen("segment", "tail", url, "s")
    lines = _Lines(tail.stdout)
    try:
        assert lines.next().split("\t")[3] == "before"  # it is running and has reached the tail
        appended = _run("segment", "append", url, "s", "after1", "after2")  # a second process
        assert appended.returncode == 0, appended.stderr
        assert [lines.next().split("\t")[::3] for _ in range(2)] == [["1", "after1"], ["2", "after2"]]
        tail.send_signal(signal.SIGINT)
        assert tail.wait(timeout=10) == 0
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
    err = tail.stderr.read()
    assert "Traceback" not in err and err == ""


def test_tail_subprocess_from_end_prints_only_new_records_up_to_max(tmp_path):
    url = str(tmp_path)
    assert main(["segment", "append", url, "s", "--create", "old0", "old1", "old2"]) == 0
    tail = _popen("segment", "tail", url, "s", "--from-end", "--max", "2", "--timeout", "15")
    sent = []
    try:
        # The tail's start is unknown from outside: append until it has seen two records.
        with SegmentStore.open(url) as store:
            segment = store.segment("s")
            deadline = time.monotonic() + 20
            while tail.poll() is None and time.monotonic() < deadline:
                sent.append(b"new%d" % len(sent))
                segment.append([sent[-1]])
                time.sleep(0.1)
        out, err = tail.communicate(timeout=10)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
    assert (tail.returncode, err) == (0, "")
    rows = _fields(out)
    assert len(rows) == 2
    first = int(rows[0][0])
    assert first >= 3 and int(rows[1][0]) == first + 1
    assert [row[3].encode() for row in rows] == sent[first - 3:first - 1]


# -- stats, list ----------------------------------------------------------------------------------


def test_stats_text_and_json(tmp_path, capsys):
    url = str(tmp_path)
    main(["segment", "append", url, "s", "--create", "--timestamp", "1700000000000", "--attribute", "1=1", "a", "b", "c"])
    capsys.readouterr()
    assert main(["segment", "stats", url, "s"]) == 0
    text = dict(re.split(r"\s+", line, maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert text["name"] == "s"
    assert (text["start_offset"], text["next_offset"], text["records"], text["log_chunks"]) == ("0", "3", "3", "1")
    assert text["max_timestamp"] == "1700000000000 (2023-11-14T22:13:20.000Z)"
    assert text["attributes.entry_count"] == "1"  # append's close merged the update into the B+tree
    assert int(text["log_bytes"].replace(",", "")) > 0

    assert main(["segment", "stats", url, "s", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["next_offset"], stats["max_timestamp"], stats["pending_attributes"]) == (3, 1700000000000, 0)
    assert stats["attributes"]["entry_count"] == 1


def test_read_only_commands_do_not_write(tmp_path, capsys):
    url = str(tmp_path)
    store = SegmentStore.open(url)  # records and an attribute not yet merged into the B+tree
    store.segment("s", create=True).append([b"a"], [(1, 1)])
    store.storage.close()  # dropped without Segment.close(), which would merge them (a write)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for argv in (["read", url, "s"], ["stats", url, "s"], ["tail", url, "s", "--timeout", "0"], ["list", url]):
        assert main(["segment", *argv]) == 0
    capsys.readouterr()
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_list_segments(tmp_path, capsys):
    url = str(tmp_path)
    for name in ("b", "a", "orders/0", "orders/1"):
        assert main(["segment", "append", url, name, "--create", "x"]) == 0
    capsys.readouterr()
    assert main(["segment", "list", url]) == 0
    assert capsys.readouterr().out.split() == ["a", "b", "orders/0", "orders/1"]
    assert main(["segment", "list", url, "--prefix", "orders/"]) == 0
    assert capsys.readouterr().out.split() == ["orders/0", "orders/1"]
    assert main(["segment", "list", url, "--prefix", ".."]) == 2  # never lists outside the store
    assert "invalid segment name '..'" in capsys.readouterr().err


# -- retention ----------------------------------------------------------------------------------


def _chunked(path, old_batches: int = 0, new_batches: int = 20) -> tuple[int, int]:
    """Segment ``s`` in many 4 KiB chunks: batches of 10 records of ~100 bytes, the old ones
    3 days old. Returns (first new offset, next offset)."""
    now = int(time.time() * 1000)
    with SegmentStore.open(str(path), log_rolling_size=4096) as store:
        segment = store.segment("s", create=True)
        for i in range(old_batches + new_batches):
            stamp = now - 3 * DAY_MS if i < old_batches else now
            segment.append([b"%05d" % (10 * i + j) + b"." * 95 for j in range(10)], timestamp=stamp)
        assert segment.stats().log_chunks >= 5
        return 10 * old_batches, segment.next_offset


def _retention(capsys, *argv: str) -> tuple[int, int, int]:
    assert main(["segment", "retention", *argv]) == 0
    out = capsys.readouterr().out
    match = re.fullmatch(r"deleted (\d+) chunk\(s\); start offset (\d+) -> (\d+) \([\d,]+ records remain\)\n", out)
    assert match, out
    return int(match[1]), int(match[2]), int(match[3])


def _stats(path):
    with SegmentStore.open(str(path)) as store:
        return store.segment("s").stats()


def _newest_survived(path, next_offset: int) -> None:
    with SegmentStore.open(str(path)) as store:
        segment = store.segment("s")
        assert segment.read(next_offset - 1)[0].value.startswith(b"%05d" % (next_offset - 1))


def test_retention_by_size(tmp_path, capsys):
    _, end = _chunked(tmp_path)
    chunks = _stats(tmp_path).log_chunks
    deleted, before, after = _retention(capsys, str(tmp_path), "s", "--max-bytes", "8KiB")
    stats = _stats(tmp_path)
    assert deleted > 0 and before == 0 and after == stats.start_offset > 0
    assert stats.log_chunks == chunks - deleted
    assert 8192 <= stats.log_bytes < 8192 + 4096 + 2048  # it stops before going under the limit
    _newest_survived(tmp_path, end)
    # size 0: everything but the chunk being appended to
    deleted, _, after = _retention(capsys, str(tmp_path), "s", "--max-bytes", "0")
    assert deleted > 0 and _stats(tmp_path).log_chunks == 1 and after < end
    _newest_survived(tmp_path, end)


def test_retention_by_age(tmp_path, capsys):
    first_new, end = _chunked(tmp_path, old_batches=12, new_batches=12)
    deleted, before, after = _retention(capsys, str(tmp_path), "s", "--max-age", "1d")
    assert deleted > 0 and before == 0
    assert 0 < after <= first_new and first_new - after < 40  # only old chunks went: at most one mixed chunk of old records is left
    assert _retention(capsys, str(tmp_path), "s", "--max-age", "36h") == (0, after, after)  # nothing more is that old
    _newest_survived(tmp_path, end)


def test_retention_by_start_offset(tmp_path, capsys):
    _, end = _chunked(tmp_path)
    assert _retention(capsys, str(tmp_path), "s", "--start-offset", "50")[1:] == (0, 50)
    assert _stats(tmp_path).start_offset == 50
    assert main(["segment", "read", str(tmp_path), "s", "--offset", "49"]) == 1  # removed, not bad input
    assert "offset 49 was removed by retention; records start at 50" in capsys.readouterr().err
    assert main(["segment", "read", str(tmp_path), "s", "--max", "1"]) == 0
    assert capsys.readouterr().out.split("\t")[0] == "50"
    _newest_survived(tmp_path, end)


def test_durations_and_sizes():
    assert [parse_duration(t) for t in ("90s", "15m", "12h", "7d", "2w", "250ms", "1500", "1.5h")] == [
        90_000, 900_000, 43_200_000, 604_800_000, 1_209_600_000, 250, 1500, 5_400_000]
    assert [parse_size(t) for t in ("10MB", "512KiB", "1.5GiB", "100", "100B", "2kb")] == [
        10_000_000, 524_288, 1_610_612_736, 100, 100, 2000]
    for bad in ("", "x", "5x", "-5s", "10M", "1e3", "5 days"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    for bad in ("", "10M", "-1", "1e3", "5 bytes"):
        with pytest.raises(ValueError):
            parse_size(bad)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["append", "gs://bucket/x", "s", "--create", "v"], "unsupported storage scheme 'gs'"),
    (["read", "gs://bucket/x", "s"], "unsupported storage scheme 'gs'"),
    (["append", "{url}", "s", "--create", "v", "--attribute", "not-a-key=1"], "cannot read 'not-a-key' as a key"),
    (["append", "{url}", "s", "--create", "v", "--attribute=-1=1"], "int key must be in [0, 2**128)"),
    (["append", "{url}", "s", "--create", "v", "--attribute", "1=ten"], "cannot read 'ten' as a value"),
    (["append", "{url}", "s", "--create", "v", "--attribute", "1"], "must look like KEY=VALUE"),
    (["append", "{url}", "s", "--create", "v", "--codec", "bogus"], "unknown codec 'bogus'"),
    (["append", "{url}", "s", "--create", "v", "--batch", "0"], "--batch must be at least 1"),
    (["append", "{url}", "s", "--create", "v", "-o", "nonsense"], "storage option 'nonsense' must look like name=value"),
    (["append", "{url}", "s", "--create", "v", "-o", "anon=true"], "local disk storage takes no storage options"),
    (["append", "{url}", "_private", "--create", "v"], "parts starting with '_' are reserved"),
    (["retention", "{url}", "s", "--max-age", "5 parsecs"], "cannot read '5 parsecs' as a duration"),
    (["retention", "{url}", "s", "--max-bytes", "lots"], "cannot read 'lots' as a size"),
    (["retention", "{url}", "s"], "at least one rule: --max-age, --max-bytes or --start-offset"),
    (["retention", "{url}", "s", "--start-offset", "99"], "start_offset 99 is past the end"),
    (["read", "{url}", "s", "--max", "0"], "--max must be at least 1"),
    (["tail", "{url}", "s", "--timeout", "-1"], "--timeout must be at least 0"),
    (["tail", "{url}", "s", "--timeout", "nan"], "--timeout must be at least 0 seconds and finite, got nan"),
    (["tail", "{url}", "s", "--timeout", "inf"], "--timeout must be at least 0 seconds and finite, got inf"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, argv, message):
    url = str(tmp_path / "store")
    main(["segment", "append", url, "s", "--create", "existing"])
    capsys.readouterr()
    assert main(["segment", *(a.replace("{url}", url) for a in argv)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("attrindex: error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err
    assert _records(url) and [r.value for r in _records(url)] == [b"existing"]  # nothing was appended


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    done = _run("segment", "retention", str(tmp_path), "s", "--max-age", "soon")
    assert done.returncode == 2
    assert done.stderr == "attrindex: error: cannot read 'soon' as a duration: give a number with a unit ms, s, m, h, " \
        "d or w (e.g. 90s, 15m, 12h, 7d), or plain milliseconds\n"
    done = _run("segment", "stats", "gs://bucket/x", "s")
    assert (done.returncode, done.stderr.count("\n"), "Traceback" in done.stderr) == (2, 1, False)


# -- log compaction from the command line ----------------------------------------------------------

def test_a_compacted_segment_is_created_fed_tombstones_configured_and_compacted_from_the_command_line(tmp_path, capsys):
    url = str(tmp_path / "store")
    assert main(["segment", "append", url, "users", "--create", "--cleanup-policy", "compact",
                 "--tombstone-retention", "0", "--key", "alice", "v1", "v2"]) == 0
    assert main(["segment", "append", url, "users", "--key", "bob", "b1"]) == 0
    assert main(["segment", "append", url, "users", "--key", "alice", "--tombstone"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "appended 1 records at offsets 3..3"
    with SegmentStore.open(url, log_rolling_size=64) as store:  # one more record seals the chunk: compactable
        seg = store.segment("users")
        assert seg.read(3)[0].value is None and seg.read(3)[0].key == b"alice"
        seg.append([Record(b"c1", b"carol")])
    assert main(["segment", "configure", url, "users"]) == 0
    assert capsys.readouterr().out == ("cleanup_policy compact, min_compaction_lag 0 ms, tombstone_retention 0 ms, "
                                       "retention none, retention_bytes none\n")
    assert main(["segment", "compact", url, "users"]) == 0  # keeps the tombstone a first time
    assert main(["segment", "compact", url, "users"]) == 0  # then removes it (retention 0)
    capsys.readouterr()
    assert main(["segment", "read", url, "users"]) == 0
    assert [line.split("\t")[2:] for line in capsys.readouterr().out.splitlines()] == [["bob", "b1"], ["carol", "c1"]]
    assert main(["segment", "configure", url, "users", "--cleanup-policy", "delete,compact", "--min-compaction-lag", "1h",
                 "--retention", "7d", "--retention-bytes", "1GiB"]) == 0
    assert capsys.readouterr().out == ("configured: cleanup_policy delete,compact, min_compaction_lag 3,600,000 ms, "
                                       "tombstone_retention 0 ms, retention 604,800,000 ms, "
                                       "retention_bytes 1,073,741,824\n")
    with SegmentStore.open(url, mode="r+") as store:
        policy = store.segment("users").cleanup_policy()
    assert (policy.cleanup_policy, policy.min_compaction_lag_ms, policy.retention_bytes) == ("delete,compact",
                                                                                             3_600_000, 1 << 30)


@pytest.mark.parametrize("argv, message", [
    (["--key", "k", "--tombstone", "v"], "--tombstone appends one tombstone"),
    (["--tombstone"], "--tombstone appends one tombstone"),
    (["--cleanup-policy", "compact", "--key", "k", "v"], "--cleanup-policy set the policy of a segment 'append --create'"),
    (["--create", "--cleanup-policy", "delete", "--key", "k", "v"], "change it with 'attrindex segment configure'"),
    (["--create", "--min-compaction-lag", "soon", "--key", "k", "v"], "cannot read 'soon' as a duration"),
])
def test_bad_compaction_input_is_refused_before_anything_is_written(tmp_path, capsys, argv, message):
    url = str(tmp_path / "store")
    assert main(["segment", "append", url, "users", "--create", "--cleanup-policy", "compact", "--key", "k", "v"]) == 0
    capsys.readouterr()
    assert main(["segment", "append", url, "users", *argv]) == 2
    assert message in capsys.readouterr().err
    with SegmentStore.open(url, mode="r+") as store:
        assert store.segment("users").next_offset == 1


def test_configure_refuses_a_missing_segment_and_an_unknown_policy(tmp_path, capsys):
    url = str(tmp_path / "store")
    assert main(["segment", "append", url, "s", "--create", "v"]) == 0
    assert main(["segment", "configure", url, "nope", "--cleanup-policy", "compact"]) == 4
    with pytest.raises(SystemExit):
        main(["segment", "configure", url, "s", "--cleanup-policy", "shred"])
    capsys.readouterr()
    assert main(["segment", "configure", url, "s", "--cleanup-policy", "compact"]) == 0
    assert main(["segment", "append", url, "s", "keyless"]) == 2  # a compacting segment needs keys
    assert "has no key" in capsys.readouterr().err


# -- Ctrl-C ------------------------------------------------------------------------------------------

def _wait_for_offset(url: str, name: str, offset: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with SegmentStore.open(url, mode="r+") as store:
                if store.segment(name).next_offset >= offset:
                    return
        except LookupError:  # not created yet
            pass
        assert time.monotonic() < deadline, f"{name} never reached offset {offset}"
        time.sleep(0.05)


def test_ctrl_c_during_a_stdin_append_says_exactly_which_lines_landed(tmp_path):
    url = str(tmp_path / "store")
    append = subprocess.Popen([*CLI, "segment", "append", url, "s", "--create", "--batch", "10"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        append.stdin.write("".join(f"line {i}\n" for i in range(25)))
        append.stdin.flush()
        _wait_for_offset(url, "s", 20)  # two batches of 10 landed; 5 lines wait for the third
        append.send_signal(signal.SIGINT)
        assert append.wait(timeout=30) == 130
    finally:
        if append.poll() is None:
            append.kill()
            append.wait()
    err = append.stderr.read()
    assert err == ("attrindex: interrupted: appended 20 records at offsets 0..19, the first 20 lines of the input; "
                   "nothing after them was appended (resume from the 21st)\n")
    with SegmentStore.open(url, mode="r+") as store:
        assert [r.value for r in store.segment("s").read(0)] == [f"line {i}".encode() for i in range(20)]


def test_ctrl_c_while_appending_reports_what_the_store_holds(tmp_path):
    # Ctrl-C lands wherever the child is: reading stdin or inside an append (held until the append
    # is done). Either way the count it reports is exactly what the store holds.
    url = str(tmp_path / "store")
    append = subprocess.Popen([*CLI, "segment", "append", url, "s", "--create", "--batch", "50"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(),
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    feeder = threading.Thread(target=lambda: _feed(append.stdin, 200_000), daemon=True)
    feeder.start()
    try:
        _wait_for_offset(url, "s", 1)
        append.send_signal(signal.SIGINT)
        assert append.wait(timeout=60) == 130
    finally:
        if append.poll() is None:
            append.kill()
            append.wait()
    err = append.stderr.read()
    match = re.fullmatch(r"attrindex: interrupted: appended (\d+) records at offsets 0\.\.(\d+), the first \1 lines "
                         r"of the input; nothing after them was appended \(resume from the \d+\w\w\)\n", err)
    assert match, err
    with SegmentStore.open(url, mode="r+") as store:
        assert store.segment("s").next_offset == int(match[1]) == int(match[2]) + 1


def _feed(stream, lines: int) -> None:
    try:
        for i in range(0, lines, 1000):
            stream.write("".join(f"v{j}\n" for j in range(i, i + 1000)))
        stream.close()
    except (BrokenPipeError, OSError, ValueError):  # the child stopped reading
        pass
