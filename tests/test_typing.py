"""The public API type-checks under mypy, as a user's code sees it (PEP 561: ``py.typed`` shipped)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
USES = ROOT / "tests" / "typing_samples" / "uses_public_api.py"
MISUSES = '''
from attrindex import AttributeIndex, SegmentStore

idx = AttributeIndex.open("memory://x")
value: str = idx.get(1)
store = SegmentStore.open("memory://x", mode=3)
store.segment(7)
'''


def _mypy(path: pathlib.Path, cache: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """mypy --strict on ``path`` against this checkout; the library's own modules are analysed for
    their types but their internal errors are not reported (--follow-imports=silent)."""
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(cache),
         "--no-error-summary", "--hide-error-context", str(path)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )


def test_typical_use_of_the_public_api_type_checks_strictly(tmp_path):
    result = _mypy(USES, tmp_path / "cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_mypy_sees_the_real_signatures(tmp_path):
    misuse = tmp_path / "misuse.py"
    misuse.write_text(MISUSES)
    result = _mypy(misuse, tmp_path / "cache")
    assert result.returncode == 1
    errors = [line.split(": error: ")[1] for line in result.stdout.splitlines() if ": error: " in line]
    assert len(errors) == 3, result.stdout  # in line order
    assert 'Incompatible types in assignment (expression has type "int | None", variable has type "str")' in errors[0]
    assert '"mode"' in errors[1] and '"str"' in errors[1]
    assert '"segment"' in errors[2] and 'expected "str"' in errors[2]


def test_py_typed_is_shipped_with_both_packages():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package in ("attrindex", "storage_adapters"):
        assert (ROOT / package / "py.typed").is_file()
        assert "py.typed" in package_data[package]
