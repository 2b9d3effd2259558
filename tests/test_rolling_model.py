"""Hypothesis model test: two handles on one rolling segment against a ``bytearray`` model.

Random appends (with right, stale and wrong expected offsets, and unconditional), reads in and out
of range, truncations, refreshes and reopens (with another rolling size), on every backend (on
local disk each append is one frame: tests/framed.py).
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from storage_adapters import (
    BadOffsetError,
    OffsetOutOfRangeError,
    TruncatedError,
    open_storage,
)
from storage_adapters.rolling import TRUNCATION_DIR

from .conftest import make_s3_url
from .framed import frame, open_segment

HANDLES = st.sampled_from(["a", "b"])
ROLLING = st.integers(min_value=1, max_value=48)


def machine_for(new_url):
    class RollingSegmentMachine(RuleBasedStateMachine):
        @initialize(rolling=ROLLING)
        def open(self, rolling):
            url, options = new_url()
            self.storage = open_storage(url, **options)
            self.handles = {h: open_segment(self.storage, "stream/0", rolling_size=rolling) for h in "ab"}
            self.model = bytearray()
            self.start = 0

        def teardown(self):
            if hasattr(self, "storage"):
                self.handles["a"].delete()

        @rule(h=HANDLES, data=st.binary(min_size=1, max_size=40), how=st.sampled_from(["end", "view", "wrong", "none"]), wrong=st.integers(0, 400))
        def append(self, h, data, how, wrong):
            handle = self.handles[h]
            data = frame(self.storage, data, len(self.model))  # local disk: a frame placed where it lands
            if how == "none":
                assert handle.append(data) == len(self.model)
            elif how == "end" or (how == "view" and handle.length == len(self.model)):
                expected = len(self.model)
                assert handle.append(data, expected_offset=expected) == expected
            else:
                expected = handle.length if how == "view" else wrong
                if expected == len(self.model):
                    expected += 1
                with pytest.raises(BadOffsetError) as caught:
                    handle.append(data, expected_offset=expected)
                assert caught.value.expected_offset == expected
                assert caught.value.actual_offset == len(self.model)
                return
            self.model += data

        @rule(h=HANDLES, offset=st.integers(0, 500), length=st.integers(0, 60))
        def read(self, h, offset, length):
            handle = self.handles[h]
            end = offset + length
            if offset < self.start:
                try:
                    got = handle.read(offset, length)
                except (TruncatedError, OffsetOutOfRangeError):
                    return
                # A handle that has not seen the truncation may still find the (correct) old bytes.
                assert handle.start_offset < self.start and got == self.model[offset:end]
            elif end > len(self.model):
                with pytest.raises(OffsetOutOfRangeError) as caught:
                    handle.read(offset, length)
                assert not isinstance(caught.value, TruncatedError)
            else:
                assert handle.read(offset, length) == self.model[offset:end]

        @rule(h=HANDLES, data=st.data())
        def truncate(self, h, data):
            offset = data.draw(st.integers(0, len(self.model)))
            self.handles[h].truncate(offset)
            self.start = max(self.start, offset)

        @rule(h=HANDLES)
        def refresh(self, h):
            self.handles[h].refresh()
            assert self.handles[h].length == len(self.model)
            assert self.handles[h].start_offset == self.start

        @rule(h=HANDLES, rolling=ROLLING)
        def reopen(self, h, rolling):
            self.handles[h].close()
            self.handles[h] = open_segment(self.storage, "stream/0", rolling_size=rolling)

        @precondition(lambda self: hasattr(self, "storage"))
        @invariant()
        def stored_state_matches_model(self):
            fresh = open_segment(self.storage, "stream/0")
            assert (fresh.start_offset, fresh.length) == (self.start, len(self.model))
            assert fresh.read(self.start, len(self.model) - self.start) == self.model[self.start:]
            chunks = fresh.chunks()
            for before, after in zip(chunks, chunks[1:]):
                assert before.end == after.start
            # Every chunk lying wholly below the start offset is gone, except the last one.
            assert all(c.end > self.start for c in chunks[:-1])
            files = self.storage.list_files("stream/0.seg")
            stored = sorted(n for n in files if not n.startswith(TRUNCATION_DIR))
            if self.storage.deletion_grace and not self.storage.appendable:
                # Object chunks made dead keep their names for the deletion grace (docs/storage.md):
                # the extra names all lie below the first live chunk.
                first = chunks[0].name if chunks else "9" * 20
                stored = [n for n in stored if n >= first]
            assert stored == [c.name for c in chunks]

    return RollingSegmentMachine


def test_rolling_segment_matches_bytearray_model(backend, tmp_path, request):
    if backend == "memory":
        new_url, examples, steps = (lambda: (f"memory://model-{uuid.uuid4().hex}", {})), 150, 40
    elif backend == "local":
        new_url, examples, steps = (lambda: (str(tmp_path / uuid.uuid4().hex), {})), 100, 40
    else:
        options = request.getfixturevalue("s3_options")
        bucket_url = make_s3_url(options)
        new_url, examples, steps = (lambda: (f"{bucket_url}/{uuid.uuid4().hex}", options)), 10, 20
    run_state_machine_as_test(
        machine_for(new_url),
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
