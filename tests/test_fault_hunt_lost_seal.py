"""Fault hunt: a writer whose stale view ends in a chunk that lost its seal forked the log.

Writer A's view ends in chunk X, unsealed and not full for A's rolling size. Writer B, with a
smaller rolling size, seals X and rolls into Y. Then X's seal is lost: its newest commit record is
dropped or garbled (damage; the previous record, which carries the same size, wins), or B was a
writer from before seals, which rolled past X without sealing it (a store the walk still reads).
Since the catch-up skipped both existence checks for a chunk found unsealed, A appended in place
to X at Y's offset: acknowledged, at an offset already used, and lost (every reader reads Y's
bytes there). Before that shortcut, the walk found Y and A appended at the true end. An unsealed
chunk now costs one existence check of its successor; only a chunk that has one takes the walk.
"""

from __future__ import annotations

import os

import pytest

from storage_adapters import RollingSegment, open_storage
from storage_adapters.local import drop_commit_records, garble_commit_records

X = "00000000000000000000"


@pytest.mark.parametrize("commit_format, damage", [
    ("xattr", "drop"),      # the v2 record's newest size (the seal) taken back
    ("sidecar", "drop"),    # the v1 seal record cut off: also a pre-seal writer's roll
    ("sidecar", "garble"),  # the v1 seal record torn: the previous record wins
])
def test_a_stale_writer_never_appends_in_place_to_a_chunk_that_lost_its_seal(tmp_path, commit_format, damage):
    url = str(tmp_path)
    a = RollingSegment(open_storage(url, commit_format=commit_format), "s", rolling_size=1 << 20)
    assert a.append(b"AAAA") == 0  # X = [0, 4), unsealed, A's view ends there
    b = RollingSegment(open_storage(url, commit_format=commit_format), "s", rolling_size=4)
    assert b.append(b"BBBB") == 4  # X is full for B: sealed, then Y = [4, 8)
    assert b.storage.committed(f"s.seg/{X}") == (4, True)
    (drop_commit_records if damage == "drop" else garble_commit_records)(os.path.join(url, "s.seg", X), 1)
    assert b.storage.committed(f"s.seg/{X}") == (4, False)  # X's bytes are intact; only its seal is gone

    assert a.append(b"XXXX") == 8  # the true end, not Y's offset 4
    assert a.length == 12
    fresh = RollingSegment(open_storage(url), "s", rolling_size=4)
    assert fresh.read(0, fresh.length) == b"AAAABBBBXXXX"
    assert b.append(b"CCCC") == 12  # B follows A's append: nothing forked
    assert RollingSegment(open_storage(url), "s").read(0, 16) == b"AAAABBBBXXXXCCCC"


@pytest.mark.parametrize("commit_format", ["xattr", "sidecar"])
def test_a_segment_append_through_a_stale_handle_lands_after_a_roll_whose_seal_was_lost(tmp_path, commit_format):
    """The same through the public API: A's view of the log ends exactly at X's end, so its
    compare-and-append matched there. Its record was acknowledged at B's offset 1 and lost, while
    its attribute update reached the index (a value that no stored batch carries)."""
    from attrindex import SegmentStore

    root = str(tmp_path / "store")
    with SegmentStore.open(root, {"commit_format": commit_format}, log_rolling_size=1 << 20) as sa, \
            SegmentStore.open(root, {"commit_format": commit_format}, log_rolling_size=10) as sb:
        a = sa.segment("s", create=True)
        assert a.append([b"a0"], [(1, 10)]).first_offset == 0  # X, unsealed; A's view ends at its end
        b = sb.segment("s")
        assert b.append([b"b0"], [(1, 20)]).first_offset == 1  # X is full for B: sealed, then Y
        chunks = sorted(n for n in os.listdir(os.path.join(root, "s", "_log.seg")) if n.isdigit())
        assert len(chunks) == 2
        drop_commit_records(os.path.join(root, "s", "_log.seg", chunks[0]), 1)
        assert a.append([b"a1"], [(1, 30)]).first_offset == 2
    with SegmentStore.open(root) as store:
        seg = store.segment("s")
        assert [(r.offset, r.value) for r in seg.read(0, 100)] == [(0, b"a0"), (1, b"b0"), (2, b"a1")]
        assert seg.get_attribute(1) == 30
