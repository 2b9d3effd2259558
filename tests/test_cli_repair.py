"""``attrindex segment verify|repair`` and ``attrindex index verify|repair`` on damaged stores.

Damage is a flipped bit in committed bytes; each command's output and exit code are what a user
relies on: 3 when damage is found, a repair that says what it lost, and a clean verify after it.
"""

from __future__ import annotations

import os
import re

import pytest

from attrindex import AttributeIndex, SegmentStore
from attrindex.tree_index import TreeIndex
from attrindex.cli import main
from attrindex.cli_errors import EXIT_DAMAGED, EXIT_NOT_FOUND
from tests.raw_chunks import committed_length


def _flip(path: str, position: int) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0x10]))


def _chunks(root: str, directory: str) -> list[str]:
    found = os.path.join(root, directory)
    return sorted(os.path.join(found, n) for n in os.listdir(found) if re.fullmatch(r"\d{20}", n))


def _segment_with_records(root: str, appends: int = 40) -> None:
    with SegmentStore.open(root) as store:
        seg = store.segment("s", create=True)
        for i in range(appends):
            seg.append([b"record %d" % i], [(1, i)])


def test_segment_verify_finds_damage_and_repair_says_what_is_lost(tmp_path, capsys):
    root = str(tmp_path / "store")
    _segment_with_records(root)
    assert main(["segment", "verify", root, "s"]) == 0
    assert capsys.readouterr().out.startswith("ok: 40 batches, 40 records")
    assert main(["segment", "repair", root, "s"]) == 0  # a healthy segment: said plainly
    assert capsys.readouterr().out == "ok: no damage found; nothing was changed\n"

    last = _chunks(root, "s/_log.seg")[-1]
    _flip(last, committed_length(last) // 2)
    assert main(["segment", "read", root, "s"]) == EXIT_DAMAGED  # refused, never answered around
    capsys.readouterr()
    assert main(["segment", "verify", root, "s"]) == EXIT_DAMAGED
    out, err = capsys.readouterr()
    assert re.search(r"^damaged: s/_log.* bytes \[\d+, \d+\): ", out, re.M), out
    assert "verify found 1 damaged range(s)" in err

    assert main(["segment", "repair", root, "s"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("repaired: "), said
    lost = re.search(r"log bytes \[\d+, \d+\) damaged, now a gap: offset (\d+) lost", said)
    assert lost, said
    victim = int(lost[1])
    assert 0 < victim < 39 and f"{39 - victim} intact batches after the first damaged one kept" in said

    assert main(["segment", "verify", root, "s"]) == 0
    with SegmentStore.open(root, mode="r+") as store:
        seg = store.segment("s")
        kept = [r.offset for r in seg.read(0, 1000)]
        assert kept == [i for i in range(40) if i != victim]  # every batch but the damaged one
        result = seg.append([b"after repair"])
        assert result.first_offset == 40  # no offset is ever reused


def test_index_verify_and_repair_roll_back_a_damaged_newest_update(tmp_path, capsys):
    root = str(tmp_path / "idx")
    # Five versions of the tree, written as before indexes had a write-ahead log (whose replay
    # would bring a rolled-back version back): the CLI opens this layout unchanged.
    with TreeIndex.open(root, page_size=256) as index:
        for version in range(5):
            index.update({key: version for key in range(30)})
        root_page = index._tree.state.footer.root_offset
        chunk = index._segment.chunk_at(root_page)
    # The newest root page, below the newest footer: damage (a footer damaged with nothing after
    # it would be a torn update on local disk, cut without a word: docs/decisions/0001).
    _flip(os.path.join(root, "attributes.seg", chunk.name), root_page - chunk.start + 20)

    assert main(["index", "get", root, "3"]) == EXIT_DAMAGED
    assert main(["index", "verify", root]) == EXIT_DAMAGED
    out, err = capsys.readouterr()
    assert re.search(r"^damaged: attributes.* bytes \[\d+, \d+\): ", out, re.M), out

    assert main(["index", "repair", root]) == 0
    said = capsys.readouterr().out
    assert said.startswith("repaired: rolled back 1 update(s)"), said
    assert main(["index", "verify", root]) == 0
    assert main(["index", "repair", root]) == 0
    assert "nothing was changed" in capsys.readouterr().out
    with AttributeIndex.open(root, mode="r") as index:
        assert index.get_many(list(range(30))) == [3] * 30  # the previous version, whole


@pytest.mark.parametrize("argv", [["segment", "verify"], ["segment", "repair"], ["index", "verify"], ["index", "repair"]])
def test_verify_and_repair_of_a_mistyped_path_are_not_found(tmp_path, argv, capsys):
    missing = str(tmp_path / "no-such-store")
    extra = ["s"] if argv[0] == "segment" else []
    assert main([*argv, missing, *extra]) == EXIT_NOT_FOUND
    assert not os.path.exists(missing)  # nothing was created
    assert "no " in capsys.readouterr().err
