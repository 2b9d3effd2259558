"""What the library logs: recoveries and background work, at the levels the user guide names."""

from __future__ import annotations

import logging
import uuid

from attrindex import SegmentStore
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage
from tests.conftest import make_s3_url


def test_merges_replays_and_compaction_log_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="attrindex")
    with SegmentStore.open(f"memory://logging-merge-{uuid.uuid4().hex}") as store:
        seg = store.segment("s", create=True)
        seg.append([b"r"], [(1, 5)])
        seg.flush()
    messages = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert any(name == "attrindex.segment" and level == logging.DEBUG and "merged 1 attribute updates" in text
               for name, level, text in messages), messages
    assert any(name == "attrindex.btree" and level == logging.DEBUG and "relocated by compaction" in text
               for name, level, text in messages), messages


def test_a_lost_acknowledgement_settled_by_reading_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="attrindex")
    storage = FaultyStorage(open_storage(f"memory://logging-lost-ack-{uuid.uuid4().hex}"), seed=1)
    storage.script("lost_ack", op="append")
    with SegmentStore(storage) as store:
        store.segment("s", create=True).append([b"once"])
        assert [r.value for r in store.segment("s").read(0)] == [b"once"]
    assert any(r.name == "attrindex.storage" and r.levelno == logging.INFO and "accepted" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_the_s3_capability_probe_is_logged(s3_options, caplog):
    url, options = make_s3_url(s3_options), s3_options
    caplog.set_level(logging.INFO, logger="attrindex.storage")
    from storage_adapters import s3

    s3._PROBED.clear()  # the probe runs once per process and bucket
    with SegmentStore.open(url, storage_options=options) as store:
        store.segment("s", create=True).append([b"x"])
    assert any("exclusive create of an existing object is refused" in r.getMessage() for r in caplog.records)
