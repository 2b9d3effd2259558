"""Typical use of attrindex's public API; tests/test_typing.py checks it with mypy --strict."""

from __future__ import annotations

import pathlib
import uuid

from attrindex import (AppendResult, AttributeIndex, AttributeUpdate, EventWriter, IndexStats, Record, Segment,
                       SegmentReader, SegmentStats, SegmentStore, UpdateType, VerifyReport)
from attrindex.errors import AttrIndexError, IndexNotFoundError, InvalidInputError, StoreNotFoundError
from storage_adapters import RollingSegment, open_storage


def index_use(url: str) -> tuple[int | None, list[int | None], int]:
    with AttributeIndex.open(url, mode="a", page_size=4096) as idx:
        idx.update({42: 7, b"k" * 16: -1, uuid.UUID(int=3): None})
        idx.update([(42, None)])
        idx.flush()
        one: int | None = idx.get(42)
        many: list[int | None] = idx.get_many([42, b"k" * 16])
        pairs: list[tuple[bytes, int]] = list(idx.items(start=0, stop=1 << 64))
        stats: IndexStats = idx.stats()
        report: VerifyReport = idx.verify()
        checkpoint: int | None = idx.checkpoint
        idx.refresh()
        return one, many, stats.entry_count + report.pages + len(pairs) + len(idx) + (checkpoint or 0)


def path_like(root: pathlib.Path) -> int:
    with AttributeIndex.open(root / "attrs") as idx, SegmentStore.open(root / "events") as store:
        store.segment("s", create=True)
        return len(idx) + len(open_storage(root / "raw").list_files("")) + AttributeIndex.verify_at(root / "attrs").pages


def read_only(url: str) -> bool:
    try:
        with AttributeIndex.open(url, mode="r") as idx:
            return 42 in idx and idx.read_only
    except IndexNotFoundError:
        return False


def segment_use(url: str) -> list[Record]:
    try:
        store: SegmentStore = SegmentStore.open(url, mode="r+")
    except StoreNotFoundError:
        store = SegmentStore.open(url, codec="none")
    with store:
        seg: Segment = store.segment("orders-0", create=True)
        result: AppendResult = seg.append(
            [b"v1", Record(value=b"v2", key=b"k", timestamp=1, headers=[("h", b"x")])],
            attribute_updates=[AttributeUpdate(b"\x01" * 16, UpdateType.REPLACE_IF_EQUALS, value=5, compare=None)],
            expected_offset=0)
        seg.update_attributes([(7, 1)])
        values: list[int | None] = seg.get_attributes([7, 8])
        value: int | None = seg.get_attribute(b"\x01" * 16)
        reader: SegmentReader = seg.reader(offset=result.first_offset)
        first: Record | None = reader.read(timeout=0.1)
        reader.cancel()
        stats: SegmentStats = seg.stats()
        seg.flush()
        writer = EventWriter(store, "events", segments=2, writer_id=uuid.uuid4())
        writer.write(b"payload", routing_key="customer-17")
        writer.flush()
        assert first is None or first.offset == 0
        print(values, value, stats, store.segments())
        return seg.read(0, max_records=10)


def storage_use(url: str) -> int:
    storage = open_storage(url)
    with RollingSegment(storage, "raw/0", rolling_size=1 << 20) as raw:
        offset: int = raw.append(b"first", expected_offset=raw.length)
        data: bytes = raw.read(offset, 5)
        return len(data)


def errors_are_exceptions(exc: AttrIndexError) -> bool:
    return isinstance(exc, InvalidInputError)
