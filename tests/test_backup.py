"""Backing up a local store as the user guide says ("Backups"): a chunk's committed length is read
from its own bytes (the chain of frames: docs/decisions/0001), so a stopped store copied with any
tool comes back whole."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from attrindex import AttributeIndex, SegmentStore
from attrindex.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _fill(root: Path) -> None:
    with AttributeIndex.open(root / "attrs", merge_keys=1000) as index:
        index.update({1: 10})
        index.flush()  # the tree gets an append too
        index.update({2: 20})
    with SegmentStore.open(root / "events") as store:
        segment = store.segment("s", create=True)
        for i in range(3):
            segment.append([b"r%d" % i])


def _check(root: Path) -> None:
    with AttributeIndex.open(root / "attrs", mode="r") as index:
        assert index.get_many([1, 2, 3]) == [10, 20, None] and index.verify().ok
    with SegmentStore.open(root / "events", create=False) as store:
        assert [r.value for r in store.segment("s").read(0)] == [b"r0", b"r1", b"r2"]
    assert main(["segment", "verify", str(root / "events"), "s"]) == 0
    assert main(["index", "verify", str(root / "attrs")]) == 0


def _backup_section() -> str:
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    match = re.search(r"^## Backups\n(.*?)^## ", guide, re.S | re.M)
    assert match, "docs/user-guide.md has no 'Backups' section"
    return match[1]


def _zip(a: Path, b: Path) -> None:
    archive = b.with_suffix(".zip")
    subprocess.run(["zip", "-qr", str(archive), "."], cwd=a, check=True)
    subprocess.run(["unzip", "-q", str(archive), "-d", str(b)], check=True)


@pytest.mark.parametrize("copy", [
    lambda a, b: subprocess.run(["cp", "-a", str(a), str(b)], check=True),
    lambda a, b: subprocess.run(["cp", "-r", str(a), str(b)], check=True),
    lambda a, b: subprocess.run(f"tar -C {a} -cf - . | (mkdir {b} && tar -C {b} -xf -)", shell=True, check=True),
    lambda a, b: subprocess.run(["rsync", "-a", f"{a}/", f"{b}/"], check=True),
    lambda a, b: shutil.copytree(a, b),
    _zip,
], ids=["cp -a", "cp -r", "tar", "rsync -a", "shutil.copytree", "zip"])
def test_a_stopped_store_copied_with_any_tool_comes_back_whole(tmp_path, copy):
    _fill(tmp_path / "a")
    copy(tmp_path / "a", tmp_path / "b")
    _check(tmp_path / "b")
    with SegmentStore.open(tmp_path / "b" / "events", create=False) as store:  # and goes on
        assert store.segment("s").append([b"r3"]).first_offset == 3
    with AttributeIndex.open(tmp_path / "b" / "attrs") as index:
        index.update({3: 30})
    with AttributeIndex.open(tmp_path / "b" / "attrs", mode="r") as index:
        assert index.get_many([1, 2, 3]) == [10, 20, 30]
    _check(tmp_path / "a")  # the original is untouched


def test_refreshing_an_older_copy_in_place_gives_the_newer_store(tmp_path):
    """A backup refreshed over an older one (``cp -r`` onto it, as ``rsync`` would) holds the
    newer store: nothing of the older copy says anything about what is committed."""
    _fill(tmp_path / "a")
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(tmp_path / "b")], check=True)
    with SegmentStore.open(tmp_path / "a" / "events", create=False) as store:
        store.segment("s").append([b"r3"])
    subprocess.run(["cp", "-r", f"{tmp_path / 'a'}/.", str(tmp_path / "b")], check=True)
    with SegmentStore.open(tmp_path / "b" / "events", create=False) as store:
        assert [r.value for r in store.segment("s").read(0)] == [b"r0", b"r1", b"r2", b"r3"]


def test_the_user_guide_says_how_to_back_up_and_the_readme_points_there():
    section = " ".join(_backup_section().split())
    for told in ("cp -r", "rsync -a", "tar", "Live store", "snapshot", "S3", "repair"):
        assert told in section, told
    for gone in ("restore_commit_records", "extended attribute", "xattr"):  # no commit record to keep
        assert gone not in section, gone
    readme = (ROOT / "README.md").read_text()
    assert "(docs/user-guide.md#backups)" in readme and "extended attributes" not in readme
