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

import uuid

import pytest

from storage_adapters import chunk_name, open_storage
from storage_adapters.errors import BadOffsetError

from .framed import offsets, open_segment, pieces


def _url(backend, tmp_path) -> str:
    return f"memory://hunt-fork-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path)


def _appends(storage) -> tuple[list[bytes], list[int], int]:
    """Four appends A, B, C, D of one chunk each (one frame each on local disk), their offsets,
    and the rolling size that makes each fill its chunk."""
    stored = pieces(storage, [b"AAAA", b"BBBB", b"CCCC", b"DDDD"])
    return stored, offsets(stored), len(stored[0])


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_stale_writer_never_rolls_into_a_chunk_another_writer_truncated(backend, tmp_path):
    url = _url(backend, tmp_path)
    a_storage, b_storage = open_storage(url), open_storage(url)
    (x, y, z, d), at, size = _appends(a_storage)
    a = open_segment(a_storage, "s", rolling_size=size)
    a.append(x)  # chunk X, full: A's next append rolls to Y's offset
    b = open_segment(b_storage, "s", rolling_size=size)
    b.append(y)  # Y
    b.append(z)  # Z
    real_exists = a_storage.exists
    raced = []

    def exists(path):  # B's truncation lands between A's look at X and its look for Y
        if not raced and path.endswith(chunk_name(at[1])):
            raced.append(path)
            b.truncate(at[2])  # deletes X and Y
        return real_exists(path)

    a_storage.exists = exists
    assert a.append(d) == at[3]  # the true end, not the reused offset of Y
    assert raced
    assert a.length == b.length + len(d) == at[4]
    fresh = open_segment(open_storage(url), "s", rolling_size=size)
    assert fresh.start_offset == at[2] and fresh.read(at[2], at[4] - at[2]) == z + d
    with pytest.raises(BadOffsetError):
        b.append(d, expected_offset=at[3])  # B learns of A's append: nothing forked


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_writer_whose_view_ends_in_a_leftover_chunk_finds_the_true_tail(backend, tmp_path):
    """X survived (its deletion was interrupted, or the deleter's view did not hold it) while its
    successor Y was deleted: the walk from X finds nothing after it."""
    url = _url(backend, tmp_path)
    storage = open_storage(url)
    (x, y, z, d), at, size = _appends(storage)
    a = open_segment(storage, "s", rolling_size=size)
    a.append(x)
    b = open_segment(open_storage(url), "s", rolling_size=size)
    b.append(y)
    b.append(z)
    b.truncate(at[2])
    assert not storage.exists(f"s.seg/{chunk_name(at[1])}")
    storage.create(f"s.seg/{chunk_name(0)}", x)  # the leftover, as the interrupted deletion left it
    assert a.append(d, expected_offset=None) == at[3]
    assert open_segment(open_storage(url), "s", rolling_size=size).read(at[2], at[4] - at[2]) == z + d
