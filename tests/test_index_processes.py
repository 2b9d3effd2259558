"""The index across OS processes: concurrent writers of disjoint keys, and a writer killed mid-update."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from attrindex.attribute_index import AttributeIndex

from . import workers
from .conftest import make_s3_url
from .test_processes import _run


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_processes_updating_disjoint_keys_lose_nothing(backend, tmp_path, request):
    if backend == "local":
        url, options, count = str(tmp_path / "store"), {}, 300
    else:
        options = request.getfixturevalue("s3_options")
        url, count = make_s3_url(options), 60
    writers, batch = 3, 10
    out = _run(workers.index_disjoint_writer, lambda i: (url, options, i, count, batch), writers)
    assert sorted(w for w, _ in out) == list(range(writers))
    index = AttributeIndex.open(url, storage_options=options, page_size=1024)
    expected = {workers_key: workers_key * 10 for w in range(writers) for workers_key in (w + 1000 * i for i in range(count))}
    assert len(index) == len(expected)
    assert index.get_many(sorted(expected)) == [expected[key] for key in sorted(expected)]
    report = index.verify()
    assert report.ok, report.damage
    index.flush()  # verify counts the tree's entries: the WAL's pending updates join them
    assert index.verify().entries == len(expected)


def test_killed_updater_keeps_every_update_that_returned(tmp_path):
    directory = str(tmp_path / "store")
    rng = random.Random(99)
    returned = -1
    for attempt in range(5):
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.workers", "index_update_forever", directory, str(returned + 1)],
            stdout=subprocess.PIPE,
            text=True,
        )
        # The clock starts at the first returned update: on a loaded machine starting Python alone
        # can take longer than the sleep, and a kill before any update tests nothing.
        first = child.stdout.readline()
        time.sleep(rng.random() * 0.6)
        child.send_signal(signal.SIGKILL)
        batches = [int(line) for line in (first + child.stdout.read()).split()]
        child.wait()
        assert batches, "the child returned no update before it was killed"
        index = AttributeIndex.open(directory, page_size=2048, rolling_size=1 << 16)
        assert index.verify().ok
        last = batches[-1]
        # Batch b wrote keys (b*50 .. b*50+49) % 20000 with value b; a later batch may have
        # overwritten them (or the one in flight may have landed). Never an older value.
        for batch in batches[-20:]:
            values = index.get_many([(batch * 50 + i) % 20_000 for i in range(50)])
            assert all(v is not None and batch <= v <= last + 1 for v in values), f"attempt {attempt}, batch {batch}"
        newest = index.get_many([(last * 50 + i) % 20_000 for i in range(50)])
        assert set(newest) <= {last, last + 1}
        returned = max(v for v in index.get_many(range(20_000)) if v is not None)
        assert returned in (last, last + 1)
