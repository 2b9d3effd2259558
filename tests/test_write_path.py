"""The path of one durable update: a lone writer does all of it in its own thread, and its batch,
encoded before the queue, is written as encoded (no second encoding, rebase or header parse)."""

from __future__ import annotations

import threading

from attrindex import AttributeIndex, SegmentStore
from attrindex import appender as appender_module
from attrindex.log import framing as framing_module


def _spy(monkeypatch, module, name, calls):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(name), real(*a, **k))[1])


def test_a_lone_writer_writes_in_its_own_thread_and_waits_on_no_one(tmp_path, monkeypatch):
    index = AttributeIndex.open(str(tmp_path), "i")
    index.update({b"k" * 16: 1})
    storage = index._log.bytes.storage
    threads, waits = [], []
    real_append = type(storage).append
    monkeypatch.setattr(type(storage), "append",
                        lambda self, *a, **k: (threads.append(threading.get_ident()), real_append(self, *a, **k))[1])
    real_wait = threading.Condition.wait
    me = threading.get_ident()

    def wait(self, *a, **k):
        if threading.get_ident() == me:  # (the merge thread waits for work meanwhile: not counted)
            waits.append(self)
        return real_wait(self, *a, **k)

    monkeypatch.setattr(threading.Condition, "wait", wait)
    for i in range(5):
        index.update({b"k" * 16: i})
    monkeypatch.undo()
    assert threads == [threading.get_ident()] * 5  # the caller is the leader: no handoff
    assert waits == []  # and the caller never waited on a condition (another thread's write)
    assert index.get(b"k" * 16) == 4
    index.close()


def test_a_lone_batch_is_written_as_encoded(tmp_path, monkeypatch):
    index = AttributeIndex.open(str(tmp_path), "i")
    index.update({b"a" * 16: 1})
    calls: list[str] = []
    for name in ("rebase_batch", "encode_batch", "encode_batch_with_header", "read_header", "new_batch_id"):
        _spy(monkeypatch, appender_module, name, calls)
    placed = []  # (bytes given, bytes written) of each placement (the log's framing, on the append)
    real_place = framing_module.place_batches
    monkeypatch.setattr(framing_module, "place_batches",
                        lambda data, position: (lambda out: (placed.append((data, out)), out)[1])(
                            real_place(data, position)))
    index.update({b"b" * 16: 2})
    monkeypatch.undo()
    assert sorted(calls) == ["encode_batch_with_header", "new_batch_id"]  # once each, before the queue
    assert len(placed) == 1 and placed[0][1] is placed[0][0]  # placed once, encoded for where it lands: not sealed again
    index.close()
    with AttributeIndex.open(str(tmp_path), "i") as again:
        assert again.get_many([b"a" * 16, b"b" * 16]) == [1, 2]


def test_a_lone_append_behind_another_handle_is_rebased_to_the_true_tail(tmp_path):
    """Encoded at the offset this handle last saw; another handle appended since: the leader
    rebases it once (the lost race) and it lands after the other's records."""
    store = SegmentStore.open(str(tmp_path / "s"))
    first = store.segment("s", create=True)
    first.append([b"one"])
    with SegmentStore.open(str(tmp_path / "s")) as other_store:
        other_store.segment("s").append([b"two", b"three"])
    result = first.append([b"four"])
    assert result.first_offset == 3
    assert [r.value for r in first.read(0, 10)] == [b"one", b"two", b"three", b"four"]
    store.close()


def test_batch_ids_differ_across_forked_children_and_ignore_the_random_module():
    """Ids are not drawn by a system call each: a forked child must still draw its own, and
    a caller seeding ``random`` (hypothesis does) must not make them repeat."""
    import multiprocessing
    import random

    from attrindex.log.batch.encode import new_batch_id

    context = multiprocessing.get_context("fork")
    with context.Pool(2) as pool:
        children = pool.map(_draw_ids, range(2))
    mine = _draw_ids(0)
    assert len({*children[0], *children[1], *mine}) == 3 * len(mine)
    random.seed(7)
    first = new_batch_id()
    random.seed(7)
    assert new_batch_id() != first


def _draw_ids(_n: int) -> list[int]:
    from attrindex.log.batch.encode import new_batch_id

    return [new_batch_id() for _ in range(100)]


def test_the_header_given_with_a_batch_is_the_one_read_back():
    from attrindex.log.batch.compression import Codec, available_codecs
    from attrindex.log.batch.encode import encode_batch_with_header
    from attrindex.log.batch.header import read_header
    from attrindex.log.batch.records import Record

    key = b"k" * 16
    cases = [((), ([key], [5])), ([b"a", b"bc"], ([], [])), ([Record(b"v", key=b"x", timestamp=9)], ([key], [None])),
             ([b"x" * 300] * 3, ([key, b"l" * 16], [-1, 2**63 - 1]))]
    for codec in [Codec.NONE, *available_codecs()]:
        for records, updates in cases:
            data, header = encode_batch_with_header(7, records, timestamp=1234, attribute_updates=updates,
                                                    codec=codec, batch_id=99)
            assert header == read_header(data)
