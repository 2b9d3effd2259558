"""Chunk switches across processes: a replacer SIGKILLed at each of its writes, two replacers racing
for overlapping ranges, and a reader in another process that must never see a wrong byte."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from storage_adapters import RollingSegment, open_storage

from . import layout_workers as workers
from .conftest import make_s3_url
from .framed import frame

CHUNKS = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tail(storage) -> bytes:
    """The last append, after the ``CHUNKS`` chunks of ``workers.original``."""
    return frame(storage, b"tail", len(workers.original(storage, CHUNKS)))


def _fill(url, options) -> RollingSegment:
    seg = workers.open_switched(open_storage(url, **options))
    data, size = workers.original(seg.storage, CHUNKS), workers.chunk_size(seg.storage)
    for i in range(CHUNKS):
        seg.append(data[i * size:(i + 1) * size])
    seg.append(_tail(seg.storage))
    return seg


def _check_layout(url, options, exact: bool) -> RollingSegment:
    """One layout, whole: chunks end where the next begins, and every chunk's stored bytes are the
    original ones (``exact``) or one replacement's own bytes, never a mix of two layouts."""
    seg = workers.open_switched(open_storage(url, **options))
    data = workers.original(seg.storage, CHUNKS)
    chunks = seg.chunks()
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
    assert seg.length == len(data) + len(_tail(seg.storage))
    for chunk in chunks[:-1]:
        got = seg.read(chunk.start, chunk.stored)
        if exact:
            assert chunk.stored == chunk.length and got == data[chunk.start:chunk.end]
        else:
            assert got == data[chunk.start:chunk.end] or got == b"x" * chunk.stored
    if exact:
        assert seg.read(0, len(data)) == data and not seg.holes()
    return seg


def _leftovers_cleaned(seg: RollingSegment) -> None:
    workers.assert_only_live_chunks_left(seg)


def _kill_child(url, options, kill_at, seed) -> int:
    code = (f"from tests.layout_workers import replace_until_killed; "
            f"replace_until_killed({url!r}, {options!r}, {kill_at}, {seed}, {CHUNKS})")
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=120,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).returncode


@pytest.mark.parametrize("backend_name,kill_points", [("local", range(1, 7)), ("s3", (2, 3))])
def test_replacer_killed_at_each_write_leaves_one_layout(backend_name, kill_points, tmp_path, request):
    for kill_at in kill_points:
        for seed in (kill_at,):  # even: exact bytes (consolidation); odd: shorter (compaction)
            if backend_name == "local":
                url, options = str(tmp_path / f"k{kill_at}-{seed}"), {}
            else:
                options = request.getfixturevalue("s3_options")
                url = make_s3_url(options)
            _fill(url, options)
            assert _kill_child(url, options, kill_at, seed) == -9, "the child was not killed at its write"
            exact = seed % 2 == 0
            seg = _check_layout(url, options, exact)
            before = _content(seg)
            # The next switch (here: consolidation) deletes what the killed one left.
            seg.consolidate(1 << 20)
            assert _content(workers.open_switched(open_storage(url, **options))) == before
            _leftovers_cleaned(seg)


def _content(seg: RollingSegment) -> tuple[list[tuple[int, int]], bytes]:
    """The holes, and the bytes with holes left out: what consolidation must not change."""
    holes, pieces, position = seg.holes(), [], seg.start_offset
    for start, end in [*holes, (seg.length, seg.length)]:
        pieces.append(seg.read(position, start - position))
        position = end
    return holes, b"".join(pieces)


def _spawn(target, args_for, count):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(count), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for(i), barrier, results)) for i in range(count)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return out


@pytest.mark.parametrize("backend_name", ["local", "s3"])
def test_overlapping_replacements_racing_from_two_processes(backend_name, tmp_path, request):
    """Each round both processes replace a range sharing one chunk, from the same view: exactly
    one wins, the other gets ``LayoutConflictError``; the bytes never change."""
    if backend_name == "local":
        url, options = str(tmp_path / "race"), {}
    else:
        options = request.getfixturevalue("s3_options")
        url = make_s3_url(options)
    _fill(url, options)
    rounds = 2
    out = _spawn(workers.race_replace, lambda who: (url, options, who, rounds), 2)
    for r in range(rounds):
        pair = sorted([out[0][r], out[1][r]])
        assert pair in (["lost", "won"], ["none", "won"], ["none", "none"]), pair
        assert pair != ["none", "none"] or r > 0
    assert out[0][0] != out[1][0]  # the first round had chunks for both
    _check_layout(url, options, exact=True)


@pytest.mark.parametrize("backend_name", ["local", "s3"])
def test_reader_in_another_process_never_sees_a_wrong_byte(backend_name, tmp_path, request):
    if backend_name == "local":
        url, options = str(tmp_path / "reader"), {}
    else:
        options = request.getfixturevalue("s3_options")
        url = make_s3_url(options)
    seg = _fill(url, options)
    data = workers.original(seg.storage, CHUNKS)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    reader = ctx.Process(target=workers.read_while_switching, args=(url, options, CHUNKS, 1.5, results))
    reader.start()
    switches = 0
    try:
        while reader.is_alive() and switches < 400:
            sealed = seg.chunks()[:-1]
            chunk = sealed[switches % len(sealed)]
            if switches % 5 == 4 and len(sealed) > 1:  # now and then merge two into one
                chunk = sealed[(switches // 5) % (len(sealed) - 1)]
                end = seg.chunks()[seg.chunks().index(chunk) + 1].end
            else:
                end = chunk.end
            seg.replace_range(chunk.start, end, data[chunk.start:end])
            switches += 1
            time.sleep(0.002)  # compaction is not a busy loop: give the reader's listings a chance
    finally:
        status, detail = results.get(timeout=60)
        reader.join(timeout=30)
    assert status == "ok", detail
    assert detail > 0 and switches > 5
    _check_layout(url, options, exact=True)
