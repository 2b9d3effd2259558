"""The ``attrindex`` console script."""

from __future__ import annotations

import shutil
import subprocess
import sys

from attrindex import __version__
from attrindex.cli import main


def test_version_from_the_installed_console_script():
    script = shutil.which("attrindex") or [sys.executable, "-m", "attrindex.cli"]
    command = [script, "--version"] if isinstance(script, str) else [*script, "--version"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"attrindex {__version__}"


def test_demo_runs_and_says_what_is_not_built_yet(tmp_path, capsys):
    assert main(["demo", "--path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not built yet" in out
    assert "refused: segment 'demo': append expected offset 0" in out
    assert "last record        b'event 000999\\n'" in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_storage_errors_become_messages_not_tracebacks(capsys):
    assert main(["demo", "--path", "gs://bucket/x"]) == 1
    assert "unsupported storage scheme 'gs'" in capsys.readouterr().err
