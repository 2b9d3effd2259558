"""The ``attrindex`` console script."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

from attrindex import __version__
from attrindex.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_from_the_installed_console_script():
    script = shutil.which("attrindex") or [sys.executable, "-m", "attrindex.cli"]
    command = [script, "--version"] if isinstance(script, str) else [*script, "--version"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"attrindex {__version__}"


def test_demo_refuses_too_few_rows(capsys):
    assert main(["demo", "--rows", "10"]) == 2
    assert "--rows must be at least 1000" in capsys.readouterr().err


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_storage_errors_become_messages_not_tracebacks(capsys):
    assert main(["demo", "--path", "gs://bucket/x"]) == 2
    assert "unsupported storage scheme 'gs'" in capsys.readouterr().err


def test_index_put_get_scan_stats(tmp_path, capsys):
    url = str(tmp_path)
    assert main(["index", "put", url, "1=10", "0x2=20", "00000000000000000000000000000003=-3", "4=5", "4=none"]) == 0
    assert "holds 3 entries" in capsys.readouterr().out
    assert main(["index", "get", url, "1", "2", "3", "4"]) == 0
    assert capsys.readouterr().out.split("\n")[:4] == ["1\t10", "2\t20", "3\t-3", "4\tabsent"]
    assert main(["index", "scan", url, "--start", "2", "--limit", "5"]) == 0
    assert capsys.readouterr().out.split() == ["00000000000000000000000000000002", "20", "00000000000000000000000000000003", "-3"]
    assert main(["index", "stats", url, "--json"]) == 0
    assert '"entry_count": 3' in capsys.readouterr().out


def test_index_verify_passes_then_fails_on_a_flipped_byte(tmp_path, capsys):
    url = str(tmp_path)
    main(["index", "put", url, *[f"{i}={i}" for i in range(100)]])
    assert main(["index", "verify", url]) == 0
    assert "ok: 1 pages, 100 entries" in capsys.readouterr().out
    chunk = tmp_path / "attributes.seg" / "00000000000000000000"
    raw = bytearray(chunk.read_bytes())
    raw[30] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    assert main(["index", "verify", url]) == 3
    out, err = capsys.readouterr()
    assert err.startswith(f"attrindex: error: verify found 1 damaged range(s) at {url}") and err.count("\n") == 1
    assert out.startswith("damaged: attributes.seg/00000000000000000000 bytes [0, ") and "checksum" in out


def test_index_bad_key_text_is_an_error_message(tmp_path, capsys):
    assert main(["index", "get", str(tmp_path), "not-a-key"]) == 2
    assert "cannot read 'not-a-key' as a key" in capsys.readouterr().err


def test_python_dash_m_attrindex_runs_the_command():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "attrindex", "--version"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, f"attrindex {__version__}")
