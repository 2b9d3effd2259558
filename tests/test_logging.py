"""What the library logs: recoveries and background work, at the levels the user guide names;
what a creating open made, at INFO; and nothing configured by importing the library."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import uuid

from attrindex import AttributeIndex, SegmentStore
from storage_adapters import open_storage
from storage_adapters.faults import FaultyStorage
from tests.conftest import make_s3_url

ROOT = pathlib.Path(__file__).resolve().parent.parent


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


def test_creating_opens_log_what_they_created(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="attrindex")
    SegmentStore.open(str(tmp_path / "store")).close()
    AttributeIndex.open(str(tmp_path / "index")).close()
    SegmentStore.open(str(tmp_path / "store")).close()  # exists: nothing to say
    created = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert created == [
        ("attrindex.store", logging.INFO, f"created store at file://{tmp_path}/store (wrote its _store marker)"),
        ("attrindex.locations", logging.INFO, f"created index 'attributes' at file://{tmp_path}/index"),
    ]


def test_importing_the_library_configures_no_logging():
    code = (
        "import logging, attrindex, attrindex.cli, attrindex.demo, storage_adapters\n"
        "loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.split('.')[0] in ('attrindex', 'storage_adapters')]\n"
        "assert logging.root.handlers == [], logging.root.handlers\n"
        "assert [l.name for l in loggers if isinstance(l, logging.Logger) and l.handlers] == []\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert (result.returncode, result.stdout) == (0, "ok\n"), result.stderr
