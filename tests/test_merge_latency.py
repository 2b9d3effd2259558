"""Appends and reads never wait for a background merge's storage I/O (no merge stalls).

A merge writes the B+tree without the segment's lock; these tests hold a merge inside the
tree's storage write (a gate that blocks it) and check that appends, reads and ``len`` beside it
return promptly and see the right values, through the plain ``AttributeIndex`` and a ``Segment``.
They also pin the overlay's stepwise sort (the merge's CPU work must not hold the GIL for long).
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

import pytest

from attrindex import SegmentStore
from attrindex.attribute_index import AttributeIndex
from attrindex.overlay import _STEP_KEYS, AttributeOverlay, sort_keys
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage

PROMPT = 5.0  # seconds: generous for a loaded machine; a stalled call waits until the gate opens (60 s)


class GatedStorage(FaultyStorage):
    """Storage whose writes to paths containing ``blocked`` wait for ``gate`` (a merge blocked in storage)."""

    def __init__(self, inner, blocked: str):
        super().__init__(inner, seed=0)
        self.blocked = blocked
        self.gate = threading.Event()
        self.entered = threading.Event()  #: a blocked write is waiting at the gate

    def _hold(self, path: str) -> None:
        if self.blocked in path and not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(60), "the gate was never opened"

    def create(self, path: str, data: bytes) -> None:
        self._hold(path)
        super().create(path, data)

    def append(self, path: str, position: int, data: bytes, **options) -> None:
        self._hold(path)
        super().append(path, position, data, **options)


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def returns_promptly(fn, seconds: float = PROMPT):
    """Run ``fn`` in a thread; return its result if it finished within ``seconds``, else fail."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call waited for the blocked merge ({seconds} s and counting)"
    if "error" in box:
        raise box["error"]
    return box["result"], time.monotonic() - started


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_index_updates_reads_and_len_go_on_while_a_merge_is_blocked_in_tree_storage(tmp_path, backend):
    root = f"memory://gate-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path / "idx")
    storage = GatedStorage(open_storage(root), blocked="idx.seg")  # the tree's chunks; the WAL is idx/_wal
    index = AttributeIndex(storage, "idx", merge_keys=50, page_size=512)
    try:
        model = {key(i): i for i in range(60)}
        index.update(model)  # 60 pending keys >= merge_keys: frozen and merged in the background
        assert storage.entered.wait(20), "the background merge never reached the tree's storage"
        assert index._attributes.runner._mutex.locked() and index._attributes._frozen is not None
        for round_ in range(5):  # several appends, each durable, while the merge stays blocked
            batch = {key(1000 + 10 * round_ + j): j for j in range(10)} | {key(round_): -round_}
            assert returns_promptly(lambda: index.update(batch))[0] is True
            model.update(batch)
        got, _ = returns_promptly(lambda: index.get_many(list(model)))
        assert got == list(model.values())
        assert returns_promptly(lambda: index.get(key(3)))[0] == -3  # the active overlay over the frozen one
        assert returns_promptly(lambda: len(index))[0] == len(model)
        assert not storage.gate.is_set() and index._attributes._frozen is not None  # it was blocked all along
    finally:
        storage.gate.set()
    index.flush()
    assert dict(index.items()) == model and len(index) == len(model)
    index.close()
    reopened = AttributeIndex(storage, "idx", merge_keys=50, page_size=512)
    assert dict(reopened.items()) == model and reopened.checkpoint is not None
    reopened.close()


def test_segment_appends_go_on_while_a_merge_is_blocked_in_tree_storage():
    root = f"memory://gate-{uuid.uuid4().hex}"
    storage = GatedStorage(open_storage(root), blocked="_attributes")
    store = SegmentStore(storage, flush_keys=5, attribute_options=dict(page_size=512))
    seg = store.segment("s", create=True)
    try:
        seg.append([b"a"], {key(i): i for i in range(6)})
        assert storage.entered.wait(20)
        for i in range(5):
            result, _ = returns_promptly(lambda: seg.append([b"r%d" % i], {key(100 + i): i}))
            assert result.first_offset == i + 1
        assert returns_promptly(lambda: seg.get_attributes([key(0), key(104)]))[0] == [0, 4]
        assert returns_promptly(lambda: seg.read(0))[0][-1].value == b"r4"
    finally:
        storage.gate.set()
    seg.flush()
    assert seg.stats().pending_attributes == 0 and dict(seg.attributes()) == {
        **{key(i): i for i in range(6)}, **{key(100 + i): i for i in range(5)}}
    seg.close()


# -- the overlay's stepwise sort ----------------------------------------------------------------
@pytest.mark.parametrize("shape", ["random", "sequential", "shared_prefix", "small"])
def test_sort_keys_matches_sorted(shape):
    rng = random.Random(7)
    n = 3 * _STEP_KEYS + 17 if shape != "small" else 100
    if shape == "random":
        keys = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(n)]
    elif shape == "sequential":  # small ints: 13 zero bytes in front, buckets split at the first differing byte
        keys = [i.to_bytes(16, "big") for i in range(n)]
    elif shape == "shared_prefix":  # all in one first-byte bucket, then spread over the last byte
        keys = [b"\x07" * 8 + (i * 2654435761 % (1 << 64)).to_bytes(8, "big") for i in range(n)]
    else:
        keys = [os.urandom(16) for _ in range(n)]
    keys = list(dict.fromkeys(keys))
    rng.shuffle(keys)
    assert sort_keys(list(keys)) == sorted(keys)


def test_a_big_overlay_sorts_in_steps_and_stays_exact():
    overlay = AttributeOverlay()
    rng = random.Random(3)
    model: dict[bytes, int | None] = {}
    for _round in range(4):  # new keys beyond a step, then a few: both ways of extending the sorted list
        for count in (_STEP_KEYS + 5, 7):
            keys = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(count)]
            values = [rng.choice([None, rng.randrange(1 << 40)]) for _ in keys]
            overlay.apply(keys, values)
            model.update(zip(keys, values))
            assert list(overlay.items()) == sorted(model.items())
    keys, values = overlay.sorted_items()
    assert keys == sorted(model) and values == [model[k] for k in keys]


# -- paced big appends on local disk -------------------------------------------------------------
def test_a_big_local_append_is_written_back_in_slices_and_reads_back(tmp_path, monkeypatch):
    """A merge's megabytes are written back a slice at a time (so the WAL's fsync beside it
    waits for one slice, not all): the bytes are as for one write."""
    from storage_adapters import local

    from .framed import FRAMING

    calls = []
    real = local._write_out
    monkeypatch.setattr(local, "_write_out", lambda fd, pos, n: (calls.append((pos, n)), real(fd, pos, n))[1])
    storage = open_storage(str(tmp_path / "s"))
    os.makedirs(tmp_path / "s" / "c")
    first = FRAMING.frame(os.urandom(1000))  # local chunks hold frames: their chain says what is committed
    big = FRAMING.frame(os.urandom(3 * local.PACED_WRITE_BYTES + 12345), len(first))
    storage.append("c/0", 0, first)
    calls.clear()
    storage.append("c/0", len(first), big)
    slices = [(len(first) + i, min(local.PACED_WRITE_BYTES, len(big) - i)) for i in range(0, len(big), local.PACED_WRITE_BYTES)]
    if local._SYNC_FILE_RANGE is not None:
        assert calls[:len(slices)] == slices  # each slice written back before the next is written
    else:  # no sync_file_range (not Linux): written in one go, the same bytes
        assert not calls
    assert FRAMING.chain_end(storage.read("c/0", 0, 1 << 62), 0) == len(first) + len(big)
    assert not storage.read("c/0", len(first) + len(big), 1 << 62).strip(b"\0")  # pre-written zeros only
    assert storage.read("c/0", 0, len(first) + len(big)) == first + big
    reopened = open_storage(str(tmp_path / "s"))
    assert reopened.read("c/0", len(first), len(first) + len(big)) == big


def test_an_update_does_not_wait_for_len_counting_the_pending_keys():
    """``len`` looks the pending keys up in the tree on a snapshot, without the WAL's lock."""
    index = AttributeIndex(open_storage(f"memory://len-{uuid.uuid4().hex}"), "idx", merge_keys=10**6)
    index.bulk_load({key(i): i for i in range(100)})
    index.update({key(i): (None if i % 2 else -i) for i in range(50)} | {key(500): 5})
    tree = index._attributes.tree._tree  # the B+tree itself: the count reads it, not the recent-values cache
    gate, entered, real = threading.Event(), threading.Event(), tree.get_many

    def held_lookup(keys):
        entered.set()
        assert gate.wait(60)
        return real(keys)

    tree.get_many = held_lookup  # the count's tree lookups block until the gate opens
    box: dict = {}
    counter = threading.Thread(target=lambda: box.setdefault("len", len(index)), daemon=True)
    counter.start()
    try:
        assert entered.wait(20)
        assert returns_promptly(lambda: index.update({key(600): 6, key(1): 1}))[0] is True
    finally:
        gate.set()
    counter.join(20)
    del tree.get_many
    assert box["len"] == 100 - 25 + 1  # exact as of its snapshot, before the update beside it
    assert len(index) == 100 - 25 + 1 + 2
