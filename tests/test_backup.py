"""Backing up a local store as the user guide says ("Backups"): a copy that keeps extended
attributes comes back whole; one that drops them is refused, never answered wrongly, and is fixed
by ``restore_commit_records``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from attrindex import AttributeIndex, SegmentStore
from attrindex.cli import main
from storage_adapters.local import restore_commit_records

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


@pytest.mark.parametrize("copy", [
    lambda a, b: subprocess.run(["cp", "-a", str(a), str(b)], check=True),
    lambda a, b: subprocess.run(f"tar --xattrs -C {a} -cf - . | (mkdir {b} && tar --xattrs -C {b} -xf -)",
                                shell=True, check=True),
], ids=["cp -a", "tar --xattrs"])
def test_a_stopped_store_copied_with_xattrs_comes_back_whole(tmp_path, copy):
    _fill(tmp_path / "a")
    copy(tmp_path / "a", tmp_path / "b")
    _check(tmp_path / "b")


def test_a_copy_without_xattrs_is_refused_then_fixed_by_restoring_the_commit_records(tmp_path, capsys):
    _fill(tmp_path / "a")
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(tmp_path / "b")], check=True)
    assert main(["segment", "read", str(tmp_path / "b" / "events"), "s"]) == 3
    assert "copied or restored without extended attributes" in capsys.readouterr().err
    assert restore_commit_records(str(tmp_path / "b"))
    _check(tmp_path / "b")


def test_the_user_guide_says_how_to_back_up_and_the_readme_points_there():
    section = " ".join(_backup_section().split())
    for told in ("cp -a", "rsync -aX", "tar --xattrs", "cp -r", "storage_adapters.local.restore_commit_records",
                 "copied or restored without extended attributes", "Live store", "snapshot", "S3"):
        assert told in section, told
    readme = (ROOT / "README.md").read_text()
    assert "(docs/user-guide.md#backups)" in readme
