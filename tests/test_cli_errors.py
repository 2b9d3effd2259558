"""The command line's failures: one line on stderr (what, where, what to do), one exit-code
convention for every command, ``--debug`` for the traceback, and no silent empty stores."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from attrindex import AttributeIndex
from attrindex.cli import main
from attrindex.locations import failing_fast
from attrindex.demo import spark_master

from tests.conftest import S3_KEY, S3_SECRET, make_s3_url

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "attrindex.cli"]


def _env(**changes: str | None) -> dict[str, str]:
    """A CLI subprocess's environment: this checkout first on the import path, then ``changes``
    (``None`` removes a variable)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _run(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, env=env or _env(), timeout=timeout)


def _one_error_line(err: str) -> str:
    assert err.startswith("attrindex: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err[len("attrindex: error: "):-1]


# -- 1. a mistyped path is an error, not an empty store --------------------------------------------

READING = [
    (["index", "get", "{url}", "1"], "no index 'attributes' at URL 'file://{path}'"),
    (["index", "scan", "{url}"], "no index 'attributes' at URL 'file://{path}'"),
    (["index", "stats", "{url}"], "no index 'attributes' at URL 'file://{path}'"),
    (["index", "verify", "{url}"], "no index 'attributes' at URL 'file://{path}'"),
    (["index", "get", "{url}", "1", "--name", "other"], "no index 'other' at URL 'file://{path}'"),
    (["segment", "read", "{url}", "s"], "no store at URL 'file://{path}'"),
    (["segment", "tail", "{url}", "s", "--timeout", "0"], "no store at URL 'file://{path}'"),
    (["segment", "stats", "{url}", "s"], "no store at URL 'file://{path}'"),
    (["segment", "list", "{url}"], "no store at URL 'file://{path}'"),
    (["segment", "retention", "{url}", "s", "--max-age", "1d"], "no store at URL 'file://{path}'"),
]


@pytest.mark.parametrize("existing_directory", [False, True])
@pytest.mark.parametrize(("argv", "message"), READING)
def test_reading_a_missing_store_or_index_is_exit_4_and_creates_nothing(tmp_path, capsys, argv, message, existing_directory):
    path = tmp_path / "mistyped"
    if existing_directory:
        path.mkdir()
    assert main([a.replace("{url}", str(path)) for a in argv]) == 4
    captured = capsys.readouterr()
    assert captured.out == ""
    line = _one_error_line(captured.err)
    assert line.startswith(message.replace("{path}", str(path))), line
    assert "check the URL" in line  # what to do
    assert (sorted(os.listdir(path)) == []) if existing_directory else not path.exists()


def test_only_writing_commands_create(tmp_path, capsys):
    assert main(["index", "put", str(tmp_path / "i"), "1=10"]) == 0
    assert main(["index", "get", str(tmp_path / "i"), "1"]) == 0
    assert capsys.readouterr().out.endswith("1\t10\n")
    assert main(["segment", "append", str(tmp_path / "s"), "seg", "--create", "v"]) == 0
    assert main(["segment", "list", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out.endswith("seg\n")


# -- 2. one exit-code convention --------------------------------------------------------------------


def _damaged_index(tmp_path) -> str:
    url = str(tmp_path / "damaged")
    with AttributeIndex.open(url) as index:
        index.update({i: i for i in range(100)})
    chunk = tmp_path / "damaged" / "attributes.seg" / "00000000000000000000"
    raw = bytearray(chunk.read_bytes())
    raw[30] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    return url


def test_exit_codes_are_one_convention(tmp_path, capsys):
    url = str(tmp_path / "store")
    assert main(["index", "put", url, "1=1"]) == 0
    assert main(["segment", "append", url, "s", "--create", "a"]) == 0
    assert main(["segment", "append", url, "s", "b", "--expected-offset", "0"]) == 1  # a lost race: failed
    assert main(["index", "get", url, "not-a-key"]) == 2  # bad input
    assert main(["segment", "read", url, "s", "--max", "0"]) == 2
    assert main(["demo", "--rows", "5"]) == 2
    assert main(["index", "get", _damaged_index(tmp_path), "1"]) == 3  # damage found, not just "failed"
    assert main(["index", "get", str(tmp_path / "nothing"), "1"]) == 4  # not found
    assert main(["segment", "read", url, "no-such-segment"]) == 4
    err = capsys.readouterr().err
    assert "damaged data at " in err and "checksum mismatch" in err and "'attrindex index verify'" in err


@pytest.mark.parametrize("command", [[], ["index"], ["index", "get"], ["segment"], ["segment", "read"], ["demo"]])
def test_every_help_states_the_exit_codes(capsys, command):
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for line in ("0    ok", "2    bad usage or input", "3    damaged data found", "4    not found", "--debug"):
        assert line in out, (command, line)


def test_index_help_explains_the_key_formats(capsys):
    with pytest.raises(SystemExit):
        main(["index", "--help"])
    out = capsys.readouterr().out
    for text in ("32 hex digits", "a UUID", "an integer      42, 0x2a", "0 <= n < 2**128", "negative integer is not a key",
                 "Text is not a key", "'none' removes the key"):
        assert text in out, text


# -- 3. errors instead of tracebacks ------------------------------------------------------------------


def test_debug_shows_the_traceback_before_or_after_the_command(tmp_path):
    missing = str(tmp_path / "missing")
    plain = _run("index", "get", missing, "1")
    assert plain.returncode == 4 and _one_error_line(plain.stderr).startswith("no index 'attributes'")
    for argv in (["--debug", "index", "get", missing, "1"], ["index", "get", missing, "1", "--debug"]):
        debug = _run(*argv)
        assert debug.returncode == 4
        assert "Traceback (most recent call last)" in debug.stderr and "IndexNotFoundError" in debug.stderr
        assert debug.stderr.splitlines()[-1] == plain.stderr.rstrip("\n")


def test_scan_into_a_closed_pipe_exits_141_quietly(tmp_path):
    url = str(tmp_path)
    with AttributeIndex.open(url) as index:
        index.update({i: i for i in range(20_000)})  # about 800 kB of output: far more than a pipe holds
    scan = subprocess.Popen([*CLI, "index", "scan", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert scan.stdout.readline() == b"00000000000000000000000000000000\t0\n"
    scan.stdout.close()  # what `| head -1` does
    assert scan.wait(timeout=60) == 141
    assert scan.stderr.read() == b""


@pytest.mark.parametrize("argv", [["segment", "read", "{url}", "s"], ["segment", "read", "{url}", "s", "--format", "json"],
                                  ["index", "scan", "{url}"], ["index", "get", "{url}", "1"],
                                  ["segment", "tail", "{url}", "s", "--timeout", "0"]])
def test_a_failing_standard_output_is_blamed_on_the_output_not_the_store(tmp_path, argv):
    url = str(tmp_path / "store")
    with AttributeIndex.open(url) as index:
        index.update({1: 1})
    from attrindex import SegmentStore

    with SegmentStore.open(url) as store:
        store.segment("s", create=True).append([b"a", b"b"])
    with open("/dev/full", "w") as full:  # every write: ENOSPC
        done = subprocess.run([*CLI, *[a.replace("{url}", url) for a in argv]], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=_env(), timeout=60)
    assert done.returncode == 1
    assert _one_error_line(done.stderr) == ("cannot write the output: No space left on device; check where standard "
                                            "output goes (a full disk, a closed terminal), then retry")


# Installed as sitecustomize in the child: says when attrindex starts loading, then holds that
# import for a while, so the test's Ctrl-C lands inside it.
_SLOW_IMPORT = """
import sys, time

class _Announce:
    def find_spec(self, name, path=None, target=None):
        if name == "attrindex.errors":
            sys.meta_path.remove(self)
            sys.stderr.write("importing attrindex\\n")
            sys.stderr.flush()
            time.sleep(30)
        return None

sys.meta_path.insert(0, _Announce())
"""


def test_ctrl_c_while_the_library_loads_exits_130_quietly(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_SLOW_IMPORT)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    # What the console script runs (its entry point, checked below), before attrindex is imported.
    command = subprocess.Popen([sys.executable, "-c", "import sys, attrindex_command; sys.exit(attrindex_command.main())",
                                "segment", "list", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert command.stderr.readline() == "importing attrindex\n"
        command.send_signal(signal.SIGINT)
        assert command.wait(timeout=30) == 130
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
    assert command.stderr.read() == "" and command.stdout.read() == ""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"attrindex": "attrindex_command:main"}


def test_negative_keys_reach_the_key_check_instead_of_being_options(tmp_path, capsys):
    url = str(tmp_path)
    assert main(["index", "put", url, "-5=1"]) == 2
    assert _one_error_line(capsys.readouterr().err) == "int key must be in [0, 2**128), got -5"
    assert main(["index", "put", url, "7=-5", "-0x10=2"]) == 2
    assert "got -16" in capsys.readouterr().err
    assert os.listdir(url) == []  # keys are checked before the index is opened (or created)
    assert main(["index", "put", url, "7=-5"]) == 0
    assert main(["index", "get", url, "7"]) == 0 and capsys.readouterr().out.endswith("7\t-5\n")
    assert main(["index", "get", url, "7", "-3"]) == 2
    assert main(["segment", "append", url, "s", "--create", "--attribute", "-3=1", "v"]) == 2
    assert "got -3" in capsys.readouterr().err


def test_limit_below_one_is_refused(tmp_path, capsys):
    url = str(tmp_path)
    main(["index", "put", url, "1=1"])
    capsys.readouterr()
    assert main(["index", "scan", url, "--limit", "-1"]) == 2
    assert _one_error_line(capsys.readouterr().err) == "--limit must be at least 1, got -1"
    assert main(["index", "scan", url, "--limit", "1"]) == 0


def test_storage_options_take_json_and_s3_clients_fail_fast(capsys):
    assert failing_fast("/tmp/x", {}) == {}
    assert failing_fast("s3://b/p", {"key": "k"}) == {"key": "k", "connect_timeout": 2, "read_timeout": 10,
                                                     "max_attempts": 2}
    # the user's settings win, under attrindex's names or botocore's own (in config_kwargs)
    assert failing_fast("s3://b/p", {"connect_timeout": "10", "read_timeout": "60"}) == {
        "connect_timeout": "10", "read_timeout": "60", "max_attempts": 2}
    assert failing_fast("s3://b/p", {"config_kwargs": {"connect_timeout": 10, "retries": {"max_attempts": 9}}}) == {
        "config_kwargs": {"connect_timeout": 10, "retries": {"max_attempts": 9}}, "read_timeout": 10}
    assert main(["index", "get", "/nonexistent/x", "1", "-o", "client_kwargs={not json"]) == 2
    assert "cannot read '{not json' as JSON" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["index", "put", "memory://x", "1=1"], ["index", "get", "MEMORY://x", "1"],
                                  ["index", "verify", "memory://x"], ["segment", "append", "memory://x", "s", "--create", "v"],
                                  ["segment", "list", "memory://x"], ["demo", "--path", "memory://x", "--rows", "1000"]])
def test_a_memory_store_is_refused_since_it_would_die_with_the_command(capsys, argv):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _one_error_line(captured.err).endswith(
        "a memory:// store lives only inside one process, so what this command wrote would be gone when it exits; "
        "give a directory or s3://bucket/prefix")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _no_aws(**changes: str) -> dict[str, str]:
    """An environment with no AWS credentials anywhere botocore looks (and no instance metadata)."""
    unset = {name: None for name in os.environ if name.startswith("AWS_") and name != "AWS_CA_BUNDLE"}
    return _env(**unset, AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent",
                AWS_EC2_METADATA_DISABLED="true", **changes)


@pytest.mark.parametrize("argv", [["index", "get", "{url}", "1"], ["index", "put", "{url}", "1=1"],
                                  ["segment", "list", "{url}"]])
def test_missing_s3_credentials(s3_options, argv):
    url = make_s3_url(s3_options)
    done = _run(*[a.replace("{url}", url) for a in argv], "-o", f"endpoint_url={s3_options['endpoint_url']}", env=_no_aws())
    assert done.returncode == 1
    assert _one_error_line(done.stderr) == (
        f"no S3 credentials found for {url} ({s3_options['endpoint_url']}); set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or give -o key=... -o secret=...")


# Installed as sitecustomize in the child: writes a line to PATH for every connection attempt to PORT.
_COUNT_CONNECTS = """
import socket

_connect = socket.socket.connect

def _counted(self, address, *args):
    if isinstance(address, tuple) and address[1] == {port}:
        with open({path!r}, "a") as attempts:
            attempts.write("connect\\n")
    return _connect(self, address, *args)

socket.socket.connect = _counted
"""


@pytest.mark.parametrize("argv", [["index", "get", "s3://b/x", "1"], ["segment", "append", "s3://b/x", "s", "--create", "v"],
                                  ["demo", "--path", "s3://b/x", "--rows", "1000"]])
def test_an_unreachable_s3_endpoint_fails_within_seconds(argv, tmp_path):
    port = _closed_port()
    endpoint = f"http://127.0.0.1:{port}"
    attempts = tmp_path / "attempts"
    (tmp_path / "sitecustomize.py").write_text(_COUNT_CONNECTS.format(port=port, path=str(attempts)))
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    done = _run(*argv, "-o", f"endpoint_url={endpoint}", "-o", "key=k", "-o", "secret=s", env=env)
    assert done.returncode == 1 and done.stdout.count("starting Spark") == 0
    line = _one_error_line(done.stderr)
    assert line.startswith(f"cannot reach the S3 endpoint {endpoint} for s3://b/x: ") and "check -o endpoint_url" in line
    # The command line's 2 attempts, no retry loop around them: botocore's and s3fs's default
    # retries, with their back-off sleeps between attempts, took 12 s on a refused connection.
    assert 1 <= attempts.read_text().count("connect") <= 2, attempts.read_text()


@pytest.mark.parametrize("argv", [["index", "get", "s3://b/x", "1"], ["index", "put", "s3://b/x", "1=1"],
                                  ["segment", "append", "s3://b/x", "s", "--create", "v"],
                                  ["segment", "read", "s3://b/x", "s"]])
def test_a_silent_s3_endpoint_fails_after_the_read_timeout_of_each_attempt(silent_endpoint, argv):
    # The endpoint accepts connections and never answers: each attempt waits out the read
    # timeout (given short here), and nothing retries botocore's attempts again (this took 607 s
    # with the command line's defaults of the time; with today's at most 25 s: see below).
    done = _run(*argv, "-o", f"endpoint_url={silent_endpoint.url}", "-o", "key=k", "-o", "secret=s",
                "-o", "read_timeout=0.5")
    assert done.returncode == 1
    assert _one_error_line(done.stderr) == (
        f"the S3 endpoint {silent_endpoint.url} did not answer for s3://b/x within the read timeout (every attempt); "
        "check the endpoint, or give it longer with -o read_timeout=SECONDS (and -o max_attempts=N)")
    assert silent_endpoint.requests == 2  # the command line's 2 attempts of one request


def test_the_command_lines_s3_requests_are_bounded_by_default_and_can_be_given_longer(silent_endpoint):
    from storage_adapters import open_storage

    given = {"endpoint_url": silent_endpoint.url, "key": "k", "secret": "s"}
    fast = open_storage("s3://b/x", **failing_fast("s3://b/x", given))
    assert fast.worst_case_seconds <= 30  # 2 attempts x (2 s + 10 s) + back-off
    patient = open_storage("s3://b/x", **failing_fast("s3://b/x", {**given, "read_timeout": "120", "max_attempts": "3"}))
    assert patient.fs.s3.meta.config.read_timeout == 120 and patient.max_attempts == 3
    fast.close()
    patient.close()


@pytest.mark.parametrize("argv", [["index", "put", "{url}", "1=1"], ["segment", "append", "{url}", "s", "--create", "v"],
                                  ["demo", "--path", "{url}", "--rows", "1000"]])
def test_a_missing_bucket_is_exit_4_and_the_demo_says_so_before_spark(s3_options, argv):
    url = "s3://no-such-bucket-0d1e/data"
    options = ["-o", f"endpoint_url={s3_options['endpoint_url']}", "-o", f"key={S3_KEY}", "-o", f"secret={S3_SECRET}"]
    done = _run(*[a.replace("{url}", url) for a in argv], *options)
    assert done.returncode == 4 and "starting Spark" not in done.stdout
    assert _one_error_line(done.stderr) == (
        f"S3 bucket 'no-such-bucket-0d1e' does not exist ({url} at {s3_options['endpoint_url']}); create it first "
        "(e.g. aws s3 mb s3://no-such-bucket-0d1e), or check the URL")


def _fake_java(directory: Path, version: str) -> None:
    java = directory / "java"
    java.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2020-01-01' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IEXEC)


def test_the_demo_checks_java_before_anything_else(tmp_path):
    store = tmp_path / "store"
    bare = _env(PATH=str(Path(sys.executable).parent), JAVA_HOME=None)  # a PATH without java
    if any((Path(p) / "java").exists() for p in bare["PATH"].split(os.pathsep)):
        pytest.fail("the interpreter's directory holds a java: pick another PATH for this test")
    done = _run("demo", "--path", str(store), "--rows", "1000", env=bare)
    assert done.returncode == 1 and done.stdout == ""
    assert _one_error_line(done.stderr) == (
        "the demo runs Spark, which needs Java 17+, and there is no java in the PATH; install Java 17 or newer "
        "(e.g. sudo apt install openjdk-17-jre-headless, or brew install openjdk@17) and make sure 'java -version' runs")
    old = tmp_path / "old-java"
    (old / "bin").mkdir(parents=True)
    _fake_java(old / "bin", "11.0.2")
    done = _run("demo", "--path", str(store), "--rows", "1000", env=_env(JAVA_HOME=str(old)))
    assert done.returncode == 1
    assert f"needs Java 17+, and {old}/bin/java is Java 11; install Java 17" in _one_error_line(done.stderr)
    assert not store.exists()  # nothing was written


def test_the_demo_runs_local_masters_with_task_retries(capsys):
    assert spark_master("local[2]") == ("local[2,4]", "--master local[2] never retries a failed task and the demo "
                                        "makes tasks fail on purpose, so it runs as local[2,4]")
    assert spark_master("local")[0] == "local[1,4]" and spark_master("local[*]")[0] == "local[*,4]"
    assert spark_master("local[*,4]") == ("local[*,4]", None)
    assert spark_master("spark://host:7077") == ("spark://host:7077", None)  # clusters retry tasks by default
    assert main(["demo", "--master", "local[2,1]", "--rows", "1000"]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        "--master 'local[2,1]' tries each task once, but the demo makes tasks fail on purpose and needs a retry; "
        "give local[2,4] (or leave out the count)")


def test_a_refused_update_is_explained_by_its_own_message():
    """``MergeBacklogError`` already says what happened and what to do (nothing written; retry once
    the merge's cause is fixed): the line keeps it, without the generic storage hint."""
    from attrindex.cli_errors import EXIT_FAILED, explain
    from attrindex.errors import MergeBacklogError, StorageFullError

    refused = MergeBacklogError("segment 'kv/_wal': refused, nothing was written: ... merging them into the B+tree "
                                "keeps failing (StorageFullError: no space); retry once the cause is fixed")
    refused.__cause__ = StorageFullError("no space left for append of 'kv.seg/0'")
    failure = explain(refused, "/data/store")
    assert failure.code == EXIT_FAILED
    assert "refused, nothing was written" in failure.message and "check the storage" not in failure.message
