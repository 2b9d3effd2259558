"""Opening a storage URL for an index or a store (attrindex/locations.py, attrindex/store.py,
attrindex/layout.py): an open of what is not there in mode ``'r'`` (read-only) or ``'r+'`` (an
existing one only) raises and creates nothing; what a creating open made opens that way even when
empty; a regular file is neither an index nor a store; a store from before its marker is
recognised by its segments or streams; unknown modes are refused before anything is created.
"""

from __future__ import annotations

import pytest

from attrindex import AttributeIndex, SegmentStore
from attrindex.errors import IndexNotFoundError, InvalidInputError, StoreNotFoundError
from attrindex.layout import STORE_MARKER
from storage_adapters import open_storage

KEY = b"k" * 16


def test_read_only_open_of_a_missing_index_raises_and_creates_nothing(storage_url):
    url, options = storage_url
    with pytest.raises(IndexNotFoundError, match="no index 'attributes' at URL"):
        AttributeIndex.open(url, mode="r", storage_options=options)
    with open_storage(url, **options) as storage:
        assert storage.list_files("") == {}


def test_an_index_created_by_an_appending_open_opens_read_only_even_when_empty(storage_url):
    url, options = storage_url
    AttributeIndex.open(url, storage_options=options).close()
    with AttributeIndex.open(url, mode="r", storage_options=options) as idx:
        assert (len(idx), idx.get(KEY), list(idx.items())) == (0, None, [])


def test_a_read_only_handle_reads_and_refuses_writes(storage_url):
    url, options = storage_url
    with AttributeIndex.open(url, storage_options=options) as idx:
        idx.update({KEY: 7})
    with AttributeIndex.open(url, mode="r", storage_options=options) as idx:
        assert idx.read_only and idx.get(KEY) == 7
        with pytest.raises(InvalidInputError, match="read-only"):
            idx.update({KEY: 8})
        with pytest.raises(InvalidInputError, match="read-only"):
            idx.update_sorted([KEY], [8])
        idx.refresh()
        assert idx.get(KEY) == 7 and idx.stats().updates_written == 0


def test_an_existing_only_open_of_a_missing_index_raises_and_creates_nothing(storage_url):
    url, options = storage_url
    with pytest.raises(IndexNotFoundError, match="mode 'r\\+'"):
        AttributeIndex.open(url, mode="r+", storage_options=options)
    with open_storage(url, **options) as storage:
        assert storage.list_files("") == {}


def test_an_existing_only_open_reads_and_writes(storage_url):
    url, options = storage_url
    with AttributeIndex.open(url, storage_options=options) as idx:
        idx.update({KEY: 7})
    with AttributeIndex.open(url, mode="r+", storage_options=options) as idx:
        assert not idx.read_only and idx.get(KEY) == 7
        idx.update({KEY: 8})
    with AttributeIndex.open(url, mode="r", storage_options=options) as idx:
        assert idx.get(KEY) == 8


def test_read_only_open_of_another_name_is_missing(tmp_path):
    AttributeIndex.open(str(tmp_path), "one").close()
    with pytest.raises(IndexNotFoundError, match="no index 'two'"):
        AttributeIndex.open(str(tmp_path), "two", mode="r")


def test_an_unknown_mode_is_refused(tmp_path):
    with pytest.raises(InvalidInputError, match="mode"):
        AttributeIndex.open(str(tmp_path), mode="w")
    assert list(tmp_path.iterdir()) == []


def test_read_only_open_of_an_empty_directory_is_missing(tmp_path):
    with pytest.raises(IndexNotFoundError):
        AttributeIndex.open(f"file://{tmp_path}", mode="r")


@pytest.mark.parametrize("under", [False, True], ids=["the file", "a path under it"])
@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_regular_file_is_neither_an_index_nor_a_store(tmp_path, scheme, under):
    regular = tmp_path / "notes.txt"
    regular.write_bytes(b"not a store")
    url = scheme + str(regular / "sub" if under else regular)
    for mode in ("a", "r"):
        with pytest.raises(IndexNotFoundError, match="is a regular file"):
            AttributeIndex.open(url, mode=mode)
    for mode in ("a", "r+"):
        with pytest.raises(StoreNotFoundError, match="is a regular file"):
            SegmentStore.open(url, mode=mode)
    assert regular.read_bytes() == b"not a store"


def test_opening_a_missing_store_without_create_raises_and_creates_nothing(storage_url):
    url, options = storage_url
    with pytest.raises(StoreNotFoundError, match="no store at URL"):
        SegmentStore.open(url, storage_options=options, mode="r+")
    with open_storage(url, **options) as storage:
        assert storage.list_files("") == {}


def test_a_created_store_opens_without_create_even_when_empty(storage_url):
    url, options = storage_url
    SegmentStore.open(url, storage_options=options).close()
    with SegmentStore.open(url, storage_options=options, mode="r+") as store:
        assert store.segments() == []


def test_a_store_from_before_the_marker_is_recognised_by_its_segments(tmp_path):
    with SegmentStore.open(str(tmp_path)) as store:
        store.segment("orders/0", create=True).append([b"v"])
    (tmp_path / STORE_MARKER).unlink()
    with SegmentStore.open(str(tmp_path), mode="r+") as store:
        assert store.segments() == ["orders/0"]
        assert store.segment("orders/0").read(0)[0].value == b"v"


def test_a_store_from_before_the_marker_is_recognised_by_its_streams(tmp_path):
    with SegmentStore.open(str(tmp_path)) as store:
        store.create_stream("events", 2)
    (tmp_path / STORE_MARKER).unlink()
    with SegmentStore.open(str(tmp_path), mode="r+") as store:
        assert store.stream_segments("events") == ["events/0", "events/1"]


@pytest.mark.parametrize("mode", ["r", "w", "c", None, True])
def test_an_unknown_store_mode_is_refused_before_anything_is_created(tmp_path, mode):
    with pytest.raises(InvalidInputError, match="mode must be 'a'"):
        SegmentStore.open(str(tmp_path / "store"), mode=mode)
    assert list(tmp_path.iterdir()) == []
