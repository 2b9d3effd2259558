"""The storage layout: every path a store, a segment and an index write is one that
``attrindex.layout`` names, and ``delete_segment`` deletes by it."""

from __future__ import annotations

from storage_adapters import open_storage

from attrindex import AttributeIndex, Record, SegmentStore, layout


def _owner(path: str, segments: list[str], indexes: list[str], streams: list[str]) -> str | None:
    """Which layout entry ``path`` belongs to (its function's name), or None."""
    if path == layout.STORE_MARKER:
        return "STORE_MARKER"
    if any(path.startswith(layout.stream_dir(s) + "/") for s in streams):
        return "stream_dir"
    for index in indexes:
        if path == layout.index_created_marker(index):
            return "index_created_marker"
        if path.startswith(layout.rolling_dir(index) + "/"):
            return "index tree"
        segments = segments + [layout.wal_name(index)]
    for segment in segments:
        owners = {
            "segment_marker": path == layout.segment_marker(segment),
            "log_name": path.startswith(layout.rolling_dir(layout.log_name(segment)) + "/"),
            "index_dir": path.startswith(layout.index_dir(segment) + "/"),
            "gap_dir": path.startswith(layout.gap_dir(segment) + "/"),
            "attributes_name": path.startswith(layout.rolling_dir(layout.attributes_name(segment)) + "/"),
            "config_dir": path.startswith(layout.config_dir(segment) + "/"),
            "cleaner_dir": path.startswith(layout.cleaner_dir(segment) + "/"),
        }
        found = [name for name, hit in owners.items() if hit]
        if found:
            return found[0]
    return None


def test_every_path_written_is_named_by_the_layout(tmp_path):
    root = str(tmp_path)
    with SegmentStore.open(root, log_rolling_size=512) as store:
        seg = store.segment("orders/0", create=True)
        seg.configure(cleanup_policy="compact", min_compaction_lag_ms=0)
        for i in range(60):
            seg.append([Record(value=b"v%d" % i, key=b"k%d" % (i % 5))], [(i % 7, i)])
        seg.flush()
        seg.compact(now_ms=1 << 62)
        store.create_stream("clicks", 2)
    with AttributeIndex.open(root, "idx", wal_rolling_size=512) as index:
        for i in range(40):
            index.update({i: i})
        index.flush()
    with open_storage(root) as storage:
        paths = sorted(storage.list_files(""))
    owners = {path: _owner(path, ["orders/0", "clicks/0", "clicks/1"], ["idx"], ["clicks"]) for path in paths}
    assert {path for path, owner in owners.items() if owner is None} == set()
    assert set(owners.values()) >= {"STORE_MARKER", "stream_dir", "segment_marker", "log_name", "index_dir",
                                    "attributes_name", "config_dir", "cleaner_dir", "index_created_marker",
                                    "index tree"}


def test_segment_parts_are_every_underscore_entry_but_the_marker():
    entries = {"_segment", "_log.seg", "_index", "_gaps", "_attributes.seg", "_config", "_cleaner", "_later", "0", "x"}
    rolling, others = layout.segment_parts(entries)
    assert rolling == ["_attributes", "_log"]
    assert others == ["_cleaner", "_config", "_gaps", "_index", "_later"]


def test_delete_segment_removes_every_layout_entry_and_keeps_nested_segments(tmp_path):
    root = str(tmp_path)
    with SegmentStore.open(root) as store:
        for name in ("orders", "orders/0"):
            seg = store.segment(name, create=True)
            seg.configure(cleanup_policy="compact", min_compaction_lag_ms=0)
            for i in range(10):
                seg.append([Record(value=b"v", key=b"k%d" % (i % 2))], [(i, i)])
            seg.flush()
            seg.compact(now_ms=1 << 62)
        store.delete_segment("orders")
        with open_storage(root) as storage:
            left = sorted(p for p in storage.list_files("orders") if not p.startswith("0/"))
        assert left == [] and store.segments() == ["orders/0"]
        assert store.segment("orders/0").read(0, 100)
