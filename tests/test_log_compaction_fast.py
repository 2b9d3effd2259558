"""The cleaner's fast paths (its throughput) against its general path.

``uniform_keys`` (one C-level cut of a one-width keys column) must return exactly what
``decode_keys`` returns, or ``None`` (then the general path runs); it must never accept bytes the
strict decoder refuses. The rewrite drops batches without a survivor unread: a compaction with
the fast paths must leave the same records (and the same counts) as one forced down the general
path, over random key widths, keyless records, tombstones, headers, timestamps and codecs. A
corrupt batch is still a ``CorruptDataError``, never a dropped record.
"""

from __future__ import annotations

import os
import struct
import uuid
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attrindex import Record, SegmentStore
from attrindex.errors import CorruptDataError
from attrindex.log import cleaner as cleaner_module
from attrindex.log.batch.compression import Codec, available_codecs
from attrindex.log.batch.decode import batch_columns, decode_keys, decode_records, uniform_keys
from attrindex.log.batch.encode import encode_batch
from attrindex.log.batch.header import read_header, seal_header
from tests.test_log_compaction import everything

CODECS = sorted(available_codecs())
WIDTHS = [0, 1, 2, 13, 16, 32, 33, 126, 127, 200]  # 127 and up: a two-byte length code, the general path


@st.composite
def batch_specs(draw, max_records=12, pooled=False):
    """Records of one batch: keys of one width, mixed widths, or some keyless; maybe tombstones,
    headers, differing timestamps; values of one length or mixed. ``pooled``: keys from a few per
    width (so that later batches supersede earlier ones), small values, rare headers."""
    n = draw(st.integers(1, max_records))
    shape = draw(st.sampled_from(["uniform", "uniform", "mixed", "keyless"]))
    width = draw(st.sampled_from([1, 2, 13, 40] if pooled else WIDTHS))
    value_len = draw(st.sampled_from([5, 20, None] if pooled else [0, 5, 100, 127, 128, 300, None]))
    records = []

    def key_of(size):
        if pooled:
            return draw(st.sampled_from(b"xyz")).to_bytes(1, "big") * size
        return draw(st.binary(min_size=size, max_size=size))

    for i in range(n):
        if shape == "uniform":
            key = key_of(width)
        elif shape == "mixed":
            key = key_of(draw(st.sampled_from([0, 1, 2, 3, 40])))
        else:
            key = key_of(width) if draw(st.booleans()) else None
        length = draw(st.integers(0, 40 if pooled else 200)) if value_len is None else value_len
        value = b"v" * length
        if key is not None and draw(st.integers(0, 5)) == 0:
            value = None  # a tombstone
        headers = (("h", b"x" * i),) if draw(st.integers(0, 30 if pooled else 7)) == 0 else ()
        stamp = draw(st.one_of(st.none(), st.integers(0, 9 if pooled else 1 << 40)))  # pooled: older than "now"
        records.append(Record(value, key, stamp, headers))
    return records


def _encoded(records, codec, updates=0) -> bytes:
    keys = [bytes([i]) * 16 for i in range(updates)]
    return encode_batch(7, records, timestamp=5, codec=codec, attribute_updates=(keys, list(range(updates))))


@settings(max_examples=300, deadline=None)
@given(records=batch_specs(), codec=st.sampled_from(CODECS), updates=st.integers(0, 2))
def test_uniform_keys_agree_with_decode_keys_or_decline(records, codec, updates):
    data = _encoded(records, codec, updates)
    header = read_header(data)
    fast = uniform_keys(data, 0, header)
    keys, tombstones = decode_keys(data, 0, header)
    if fast is not None:
        assert fast == (keys, tombstones)
    widths = {None if r.key is None else len(r.key) for r in records}
    if len(widths) == 1 and None not in widths and widths.pop() < 127 and not any(r.headers for r in records):
        assert fast is not None, "a one-width batch without headers must take the fast path"


@settings(max_examples=200, deadline=None)
@given(records=batch_specs(), codec=st.sampled_from(CODECS), updates=st.integers(0, 2), data=st.data())
def test_runs_cut_from_columns_are_the_batches_encode_batch_makes(records, codec, updates, data):
    batch = _encoded(records, codec, updates)
    header = read_header(batch)
    n = len(records)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=4)) + [0, n]))
    runs = [(a, b) for a, b in zip(cuts, cuts[1:]) if data.draw(st.booleans()) or a == 0]
    columns = batch_columns(batch, 0, header)
    if columns.has_headers:
        return  # the cleaner re-encodes those through Records
    decoded = decode_records(batch, 0, header)
    expected = [encode_batch(a + 7, [Record(r.value, r.key, r.timestamp, r.headers) for r in decoded[a:b]],
                             timestamp=decoded[a].timestamp, codec=codec, batch_id=header.batch_id) for a, b in runs]
    assert columns.encode_runs(runs) == expected
    assert columns.record_sizes() == [len(r.value or b"") + len(r.key or b"") for r in decoded]


def _refresh_payload_crc(batch: bytes) -> bytes:
    head = bytearray(batch[:64])
    struct.pack_into("<I", head, 56, zlib.crc32(batch[64:]))
    return seal_header(head, 0) + batch[64:]


def _outcome(function, data):
    try:
        return function(data, 0, read_header(data))
    except CorruptDataError:
        return "corrupt"


@settings(max_examples=400, deadline=None)
@given(records=batch_specs(max_records=6), updates=st.integers(0, 1), data=st.data())
def test_uniform_keys_never_accepts_what_decode_keys_refuses(records, updates, data):
    """A byte of the payload changed and the checksum forged to match (a writer's bug, not a bit
    flip): whatever the strict decoder says, the fast path says too, or declines."""
    batch = bytearray(_encoded(records, Codec.NONE, updates))
    at = data.draw(st.integers(64, len(batch) - 1))
    batch[at] = data.draw(st.sampled_from([0, 1, 2, 3, 14, 17, 0x7F, 0x80, 0xFF, batch[at] ^ 1]))
    forged = _refresh_payload_crc(bytes(batch))
    slow, fast = _outcome(decode_keys, forged), _outcome(uniform_keys, forged)
    if slow == "corrupt":
        assert fast in (None, "corrupt")
    else:
        assert fast is None or fast == slow


def test_column_shapes_the_fast_path_declines_are_corruption_for_the_general_path():
    base = encode_batch(0, [Record(b"abcde", b"k%d" % i) for i in range(4)], timestamp=1)
    cases = {
        # the key-lengths column says 4 two-byte keys, then one byte too many before the updates
        "an extra byte": bytearray(base) + b"!",
        # one key length differs (4 instead of 3) and the keys blob is short of it
        "mixed widths": bytearray(base),
    }
    cases["mixed widths"][64 + 4 + 20 + 1] = 4
    for name, batch in cases.items():
        struct.pack_into("<I", batch, 8, len(batch))
        struct.pack_into("<I", batch, 20, len(batch) - 64)
        forged = _refresh_payload_crc(bytes(batch))
        assert uniform_keys(forged, 0, read_header(forged)) is None, name
        with pytest.raises(CorruptDataError):
            decode_keys(forged, 0, read_header(forged))
    tombstoned = bytearray(encode_batch(0, [Record(None, b"k1"), Record(None, b"k2")], timestamp=1))
    tombstoned[-1] = 2  # a tombstone flag that is neither 0 nor 1
    forged = _refresh_payload_crc(bytes(tombstoned))
    assert uniform_keys(forged, 0, read_header(forged)) is None
    with pytest.raises(CorruptDataError):
        decode_keys(forged, 0, read_header(forged))
    with_value = bytearray(encode_batch(0, [Record(b"", b"k1"), Record(b"", b"k2")], timestamp=1))
    assert uniform_keys(bytes(with_value), 0, read_header(bytes(with_value))) == ([b"k1", b"k2"], None)


# ------------------------------------------------------------------- whole compactions, A/B

ROLL = 600


def _general_path(monkeypatch):
    """Force the cleaner down its general path: no fast key cut, every batch read and decoded."""
    monkeypatch.setattr(cleaner_module, "uniform_keys", lambda *args, **kwargs: None)
    monkeypatch.setattr(cleaner_module.LogCleaner, "_batches",
                        lambda self, span, read_first: self._read(span.start, span.end))


def _build(batches, codecs) -> tuple:
    store = SegmentStore.open(f"memory://compaction-fast-{uuid.uuid4().hex}", log_rolling_size=ROLL)
    seg = store.segment("s", create=True)  # "delete" first: keyless records get in
    for records, codec in zip(batches, codecs):
        seg.append(records, timestamp=1, codec=codec)
    seg.configure(cleanup_policy="compact")
    seg.append([Record(b"p" * 200, b"pad-%d" % i) for i in range(4)], timestamp=1)  # seal the rest
    return store, seg


def _compact_twice(seg, capacity, retention):
    out = []
    for now in (10, 10 + retention + 1):
        stats = seg.compact(min_lag_ms=0, tombstone_retention_ms=retention, now_ms=now, max_map_keys=capacity)
        out.append((stats.records_before, stats.records_after, stats.tombstones_removed, stats.kept_anyway,
                    stats.bytes_after, stats.chunks_cleaned, stats.checkpoint, stats.passes))
    return out, everything(seg)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches=st.lists(batch_specs(max_records=8, pooled=True), min_size=1, max_size=25),
       codecs=st.lists(st.sampled_from(CODECS), min_size=25, max_size=25),
       capacity=st.sampled_from([2, 5, 1000]), retention=st.sampled_from([0, 5, 1000]))
def test_fast_and_general_compactions_leave_the_same_log(batches, codecs, capacity, retention):
    with pytest.MonkeyPatch.context() as monkeypatch:
        _general_path(monkeypatch)
        store, seg = _build(batches, codecs)
        with store:
            expected = _compact_twice(seg, capacity, retention)
    store, seg = _build(batches, codecs)
    with store:
        got = _compact_twice(seg, capacity, retention)
        assert got == expected


def test_batches_without_survivors_are_dropped_unread():
    with SegmentStore.open(f"memory://compaction-fast-{uuid.uuid4().hex}", log_rolling_size=4096) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(200):
            seg.append([Record(b"%d" % i + b"." * 60, b"key-%d" % k) for k in range(5)], timestamp=1)
        stats = seg.compact(min_lag_ms=0)
        assert stats.records_after == 5 and stats.batches_skipped >= stats.records_before // 5 - 2
        # each byte read once by the key map pass; only the last batch of keys read again
        assert stats.bytes_read < stats.bytes_before + 1000
        below = [r.key for r in everything(seg) if r.offset < stats.checkpoint]
        assert sorted(below) == sorted({b"key-%d" % k for k in range(5)})


# ----------------------------------------------------------------------------- corruption


def _local_segment(tmp_path, batches=60):
    url = str(tmp_path / "store")
    with SegmentStore.open(url, log_rolling_size=2048) as store:
        seg = store.segment("s", create=True, cleanup_policy="compact")
        for i in range(batches):
            seg.append([Record(b"%03d" % i + b"." * 40, b"key-%d" % k) for k in range(4)], timestamp=1)
        records = everything(seg)
    return url, records


def test_a_flipped_byte_in_a_superseded_batch_is_corruption_not_a_silent_drop(tmp_path):
    url, records = _local_segment(tmp_path)
    chunk_dir = os.path.join(url, "s", "_log.seg")
    chunks = sorted(n for n in os.listdir(chunk_dir) if n.isdigit())
    victim = os.path.join(chunk_dir, chunks[1])  # every record in it is superseded later
    with open(victim, "r+b") as f:
        f.seek(64 + 30)
        byte = f.read(1)
        f.seek(64 + 30)
        f.write(bytes([byte[0] ^ 0x10]))
    before = {n: os.path.getsize(os.path.join(chunk_dir, n)) for n in os.listdir(chunk_dir)}
    with SegmentStore.open(url, log_rolling_size=2048) as store:
        seg = store.segment("s")
        for _attempt in range(2):  # the same clear error every time: nothing was dropped meanwhile
            with pytest.raises(CorruptDataError) as caught:
                seg.compact(min_lag_ms=0)
            assert "checksum" in str(caught.value)
    assert {n: os.path.getsize(os.path.join(chunk_dir, n)) for n in os.listdir(chunk_dir)} == before


def test_bit_flips_on_read_during_compaction_give_an_error_or_a_correct_log(tmp_path):
    from storage_adapters import open_storage
    from storage_adapters.faults import FaultyStorage

    url, records = _local_segment(tmp_path)
    latest = {r.key: r for r in records}
    for seed in range(6):
        storage = FaultyStorage(open_storage(url), seed=seed)
        store = SegmentStore(storage, log_rolling_size=2048)
        seg = store.segment("s")
        storage.script("bitflip_read", op="read", path_contains="_log.seg", times=1 + seed % 3)
        try:
            seg.compact(min_lag_ms=0)
        except CorruptDataError:
            pass
        store.close()
        with SegmentStore.open(url, log_rolling_size=2048) as clean:
            survivors = everything(clean.segment("s"))
        original = {r.offset: r for r in records}
        assert all(original[r.offset] == r for r in survivors)
        assert {r.key: r for r in survivors} == latest


def test_the_remembered_batches_are_bounded_like_the_map():
    """More batches than ``max_map_keys`` (few keys, many updates): the pass remembers at most
    that many batches; the chunks beyond are read again, and the result is the same."""
    results = []
    for capacity in (3, 1000):
        with SegmentStore.open(f"memory://compaction-fast-{uuid.uuid4().hex}", log_rolling_size=600) as store:
            seg = store.segment("s", create=True, cleanup_policy="compact")
            for i in range(60):
                seg.append([Record(b"%02d" % i + b"." * 40, b"k%d" % (i % 2))], timestamp=1)
            stats = seg.compact(min_lag_ms=0, max_map_keys=capacity)
            results.append((stats, everything(seg)))
    (small, small_log), (big, big_log) = results
    assert small_log == big_log and small.records_after == big.records_after
    assert small.batches_skipped <= 3 < big.batches_skipped
    assert small.bytes_read > big.bytes_read  # what was not remembered was read again
