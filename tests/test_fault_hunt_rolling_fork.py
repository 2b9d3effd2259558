"""Fault hunt: a writer whose view of an appendable segment is stale forked the log.

Writer A's view ends in a full chunk X. Writer B appends past it (chunks Y, Z) and truncates below
Z, deleting X and Y. A, walking its view forward under the writers' lock, read X's size just
before the deletions and looked for Y just after: no successor, so A "rolled" into a new chunk
at Y's offset, an offset already used, below the truncation, invisible to every other handle.
A's append was acknowledged and lost, and A went on appending on its fork (two plain-index
handles in one process lost acknowledged updates this way: 4-16 stale opens per 15 s run). A
writer about to roll now checks the truncation offset it already lists and, if it lies past
its view, re-reads the segment first.
"""

from __future__ import annotations

import shutil
import uuid

import pytest

from storage_adapters import RollingSegment, open_storage
from storage_adapters.errors import BadOffsetError


def _url(backend, tmp_path) -> str:
    return f"memory://hunt-fork-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_stale_writer_never_rolls_into_a_chunk_another_writer_truncated(backend, tmp_path):
    url = _url(backend, tmp_path)
    a_storage, b_storage = open_storage(url), open_storage(url)
    a = RollingSegment(a_storage, "s", rolling_size=4)
    a.append(b"AAAA")  # chunk X = [0, 4), full: A's next append rolls to 4
    b = RollingSegment(b_storage, "s", rolling_size=4)
    b.append(b"BBBB")  # Y = [4, 8)
    b.append(b"CCCC")  # Z = [8, 12)
    real_exists = a_storage.exists
    raced = []

    def exists(path):  # B's truncation lands between A's look at X and its look for Y
        if not raced and path.endswith("00000000000000000004"):
            raced.append(path)
            b.truncate(8)  # deletes X and Y
        return real_exists(path)

    a_storage.exists = exists
    assert a.append(b"DDDD") == 12  # the true end, not the reused offset 4
    assert raced
    assert a.length == b.length + 4 == 16
    fresh = RollingSegment(open_storage(url), "s", rolling_size=4)
    assert fresh.start_offset == 8 and fresh.read(8, 8) == b"CCCCDDDD"
    with pytest.raises(BadOffsetError):
        b.append(b"EEEE", expected_offset=12)  # B learns of A's append: nothing forked


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_writer_whose_view_ends_in_a_leftover_chunk_finds_the_true_tail(backend, tmp_path):
    """X survived (its deletion was interrupted, or the deleter's view did not hold it) while its
    successor Y was deleted: the walk from X finds nothing after it."""
    url = _url(backend, tmp_path)
    storage = open_storage(url)
    a = RollingSegment(storage, "s", rolling_size=4)
    a.append(b"AAAA")
    b = RollingSegment(open_storage(url), "s", rolling_size=4)
    b.append(b"BBBB")
    b.append(b"CCCC")
    b.truncate(8)
    assert not storage.exists("s.seg/00000000000000000004")
    if backend == "memory":
        storage.fs.pipe_file(storage._abs("s.seg/00000000000000000000"), b"AAAA")  # the leftover
    else:
        # A leftover v2 chunk keeps its record; re-create it as the interrupted deletion left it.
        shutil.copy2(tmp_path / "s.seg" / "00000000000000000008", tmp_path / "s.seg" / "00000000000000000000")
    assert a.append(b"DDDD", expected_offset=None) == 12
    assert RollingSegment(open_storage(url), "s", rolling_size=4).read(8, 8) == b"CCCCDDDD"
