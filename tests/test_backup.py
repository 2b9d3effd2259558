"""Backing up a local store as the user guide says ("Backups"). Nothing but its files' bytes says
what is committed (the chain of frames: docs/decisions/0001; no extended attribute, no sidecar),
so a stopped store copied by any ordinary tool is the same store, a copy refreshed in place over an
older one is the new store, and a copy taken while a writer appends reads as a clean prefix.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from pathlib import Path

from attrindex import AttributeIndex, SegmentStore
from attrindex.log.batch.records import Record

ROOT = Path(__file__).resolve().parents[1]

OPTIONS = dict(log_rolling_size=2048)  # many chunks in a small store


def _build(root: str, rounds: int = 1) -> None:
    """Segments (plain, key-compacted, consolidated) and an index with a write-ahead log; each
    further round appends to all of them."""
    store = SegmentStore.open(root, **OPTIONS)
    try:
        plain = store.segment("plain", create=True)
        compacted = store.segment("compacted", create=True, cleanup_policy="compact")
        consolidated = store.segment("consolidated", create=True)
        for r in range(rounds):
            for i in range(60):
                plain.append([b"plain-%d-%d" % (r, i)], [(b"k%015d" % (i % 7), r * 100 + i)])
                compacted.append([Record(b"v-%d-%d" % (r, i), key=b"key-%d" % (i % 5))])
                consolidated.append([b"c-%d-%d" % (r, i) * 3])
            compacted.append([Record(None, key=b"key-0")])  # a tombstone
        compacted.compact(min_lag_ms=0, tombstone_retention_ms=10 ** 9)
        consolidated.consolidate(64 << 10)
    finally:
        store.close()
    index = AttributeIndex.open(root, "index", merge_process=False, merge_keys=200)
    try:
        for r in range(rounds):
            index.update({i.to_bytes(16, "big"): r * 1000 + i for i in range(r * 100, r * 100 + 500)})
            index.update({7: None})
    finally:
        index.close()


def _contents(root: str) -> dict:
    """Everything a reader of the store sees (opening it read-only where there is a mode)."""
    store = SegmentStore.open(root, mode="r+")
    try:
        seen = {}
        for name in ("plain", "compacted", "consolidated"):
            segment = store.segment(name)
            records = []
            offset = segment.start_offset
            while offset < segment.next_offset:
                batch = segment.read(offset)
                if not batch:
                    break
                records += [(r.offset, r.key, r.value) for r in batch]
                offset = batch[-1].offset + 1
            seen[name] = (records, segment.next_offset, sorted(segment.attributes()))
    finally:
        store.close()
    index = AttributeIndex.open(root, "index", mode="r")
    try:
        seen["index"] = sorted(index.items())
    finally:
        index.close()
    return seen


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("copies") / "src")
    _build(root)
    return root, _contents(root)


def _run(*command: str, cwd: str | None = None) -> None:
    subprocess.run(command, check=True, cwd=cwd, capture_output=True, timeout=300)


def _cp(src: str, dst: str) -> None:
    _run("cp", "-r", src, dst)


def _tar(src: str, dst: str) -> None:
    archive = dst + ".tar"
    with tarfile.open(archive, "w") as tar:  # no extended attributes, as tar without --xattrs
        tar.add(src, arcname="store")
    with tarfile.open(archive) as tar:
        tar.extractall(os.path.dirname(dst), filter="tar")
    os.rename(os.path.join(os.path.dirname(dst), "store"), dst)


def _tar_command(src: str, dst: str) -> None:
    os.makedirs(dst)
    _run("sh", "-c", f"tar -C {src} -cf - . | tar -C {dst} -xf -")


def _rsync(src: str, dst: str) -> None:
    _run("rsync", "-a", src + "/", dst + "/")


def _zip(src: str, dst: str) -> None:
    archive = dst + ".zip"
    _run("zip", "-qr", archive, ".", cwd=src)
    _run("unzip", "-q", archive, "-d", dst)


def _python_zip(src: str, dst: str) -> None:
    archive = shutil.make_archive(dst + "-py", "zip", src)
    with zipfile.ZipFile(archive) as z:
        z.extractall(dst)


def _copytree(src: str, dst: str) -> None:
    shutil.copytree(src, dst)


COPIES = {"cp -a": lambda src, dst: _run("cp", "-a", src, dst), "cp -r": _cp, "tarfile": _tar, "tar": _tar_command, "rsync -a": _rsync, "zip/unzip": _zip,
          "zipfile": _python_zip, "shutil.copytree": _copytree}


@pytest.mark.parametrize("tool", list(COPIES))
def test_a_quiescent_store_copied_by_any_tool_reads_back_exactly(source, tmp_path, tool):
    src, expected = source
    dst = str(tmp_path / "copy")
    COPIES[tool](src, dst)
    assert _contents(dst) == expected
    store = SegmentStore.open(dst, **OPTIONS)  # and the copy takes appends where the source stood
    try:
        segment = store.segment("plain")
        assert segment.append([b"after the copy"]).first_offset == expected["plain"][1]
    finally:
        store.close()


REFRESHES = {
    "cp -r src/. dst/": lambda src, dst: _run("cp", "-r", src + "/.", dst + "/"),
    "rsync -a --inplace": lambda src, dst: _run("rsync", "-a", "--inplace", src + "/", dst + "/"),
    "rsync -a": lambda src, dst: _run("rsync", "-a", src + "/", dst + "/"),
}


@pytest.mark.parametrize("tool", list(REFRESHES))
def test_a_copy_refreshed_in_place_over_an_older_one_is_the_new_store(tmp_path, tool):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _build(src)
    _run("cp", "-a", src, dst)  # the older backup
    _build(src, rounds=2)  # the source moves on: every chunk that grew, and new ones
    REFRESHES[tool](src, dst)
    assert _contents(dst) == _contents(src)


_WRITER = r"""
import sys
from attrindex import SegmentStore
store = SegmentStore.open(sys.argv[1], log_rolling_size=1 << 30)
segment = store.segment("hot", create=True)
i = 0
while True:
    result = segment.append([b"hot-%08d" % i])
    print(result.first_offset, flush=True)
    i += 1
"""


def test_a_copy_taken_while_a_writer_appends_reads_as_a_clean_prefix(tmp_path):
    src = str(tmp_path / "src")
    SegmentStore.open(src).close()
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, src], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        for _ in range(200):  # let it get going
            writer.stdout.readline()
        copies = []
        for n in range(5):
            dst = str(tmp_path / f"hot-{n}")
            _run("cp", "-r", src, dst)
            copies.append(dst)
    finally:
        writer.kill()
        writer.wait(60)
    for dst in copies:
        store = SegmentStore.open(dst, mode="r+")
        try:
            segment = store.segment("hot")
            records = segment.read(0, max_records=1 << 20, max_bytes=1 << 30)
            assert len(records) >= 200
            assert [r.value for r in records] == [b"hot-%08d" % i for i in range(len(records))]
            assert [r.offset for r in records] == list(range(len(records)))
            assert segment.next_offset == len(records)
        finally:
            store.close()


def _backup_section() -> str:
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    match = re.search(r"^## Backups\n(.*?)^## ", guide, re.S | re.M)
    assert match, "docs/user-guide.md has no 'Backups' section"
    return match[1]


def test_the_user_guide_says_how_to_back_up_and_the_readme_points_there():
    section = " ".join(_backup_section().split())
    for told in ("cp -r", "rsync -a", "tar", "Live store", "snapshot", "S3", "repair"):
        assert told in section, told
    for gone in ("restore_commit_records", "extended attribute", "xattr"):  # no commit record to keep
        assert gone not in section, gone
    readme = (ROOT / "README.md").read_text()
    assert "(docs/user-guide.md#backups)" in readme and "extended attributes" not in readme
