"""The library's modules by dotted name, for the tests that read the code itself (its shape, its
retry bounds)."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("attrindex", "storage_adapters")


def library_modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, pathlib.Path]:
    """``{dotted module name: path}`` of every module of ``packages`` (a package by its own name)."""
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found
