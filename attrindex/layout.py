"""Every storage path of a store, a segment and an index, named in one place.

A store's root (``SegmentStore``)::

    _store                        marker: the store exists
    _streams/STREAM/_count.N      marker: STREAM is a stream of N segments STREAM/0 ... STREAM/N-1
    _demo/                        the demo's run claims
    NAME/...                      segment NAME (below)

Segment ``NAME`` keeps everything under ``NAME/`` in entries starting with ``_``, which segment
names may not use, so no two segments can collide and a segment nested below a name
(``NAME/0``) is never one of them::

    NAME/_segment                 marker: the segment exists
    NAME/_log.seg/                the record log: a rolling segment of batches (``SegmentLog``)
    NAME/_index/                  sparse offset and time indexes of the log's sealed chunks
    NAME/_gaps/                   markers of log ranges a repair or log compaction left empty
    NAME/_attributes.seg/         the attributes' B+tree: a rolling segment of pages
    NAME/_config/                 cleanup policy versions
    NAME/_cleaner/                the log cleaner's checkpoints

An index ``NAME`` (``AttributeIndex``)::

    NAME.seg/                     its B+tree (``NAME.seg/_created``: marker, the index exists)
    NAME/_wal/...                 its write-ahead log: a segment log named NAME/_wal (its _log.seg,
                                  _index and _gaps as above)

A rolling segment named ``R`` keeps its chunks in the directory ``R.seg/`` (``rolling_dir``).
No I/O here: callers read and write the paths.
"""

from __future__ import annotations

from storage_adapters.rolling import SEGMENT_SUFFIX

STORE_MARKER = "_store"
STREAMS_DIR = "_streams"
DEMO_RUNS_DIR = "_demo"
SEGMENT_MARKER = "_segment"
LOG_DIR = "_log"  #: the log's rolling segment, under its segment's name
INDEX_DIR = "_index"
GAP_DIR = "_gaps"
ATTRIBUTES_NAME = "_attributes"  #: the attributes' B+tree (a rolling segment), under its segment's name
CONFIG_DIR = "_config"
CLEANER_DIR = "_cleaner"
WAL_NAME = "_wal"  #: the write-ahead log of an index, a segment log under the index's name
INDEX_CREATED_MARKER = "_created"


def rolling_dir(name: str) -> str:
    """The directory of rolling segment ``name``'s chunks."""
    return name + SEGMENT_SUFFIX


def segment_marker(segment: str) -> str:
    return f"{segment}/{SEGMENT_MARKER}"


def log_name(segment: str) -> str:
    """The rolling segment of ``segment``'s record log."""
    return f"{segment}/{LOG_DIR}"


def index_dir(segment: str) -> str:
    return f"{segment}/{INDEX_DIR}"


def gap_dir(segment: str) -> str:
    return f"{segment}/{GAP_DIR}"


def attributes_name(segment: str) -> str:
    """The rolling segment of ``segment``'s attribute B+tree."""
    return f"{segment}/{ATTRIBUTES_NAME}"


def config_dir(segment: str) -> str:
    return f"{segment}/{CONFIG_DIR}"


def cleaner_dir(segment: str) -> str:
    return f"{segment}/{CLEANER_DIR}"


def wal_name(index: str) -> str:
    """The segment name of index ``index``'s write-ahead log."""
    return f"{index}/{WAL_NAME}"


def index_created_marker(index: str) -> str:
    return f"{rolling_dir(index)}/{INDEX_CREATED_MARKER}"


def stream_dir(stream: str) -> str:
    return f"{STREAMS_DIR}/{stream}"


def segment_parts(entries: set[str]) -> tuple[list[str], list[str]]:
    """Of the top entries under a segment's name (what a listing of ``NAME/`` starts with): the
    segment's own, as ``(rolling segments, other entries)`` (relative names, the marker left out):
    every entry starting with ``_``, the layout's and any other, since that namespace is the
    segment's; the rolling segments by their names without ``SEGMENT_SUFFIX``."""
    own = sorted(e for e in entries if e.startswith("_") and e != SEGMENT_MARKER)
    rolling = [e[:-len(SEGMENT_SUFFIX)] for e in own if e.endswith(SEGMENT_SUFFIX)]
    return rolling, [e for e in own if not e.endswith(SEGMENT_SUFFIX)]


__all__ = ["ATTRIBUTES_NAME", "CLEANER_DIR", "CONFIG_DIR", "DEMO_RUNS_DIR", "GAP_DIR", "INDEX_CREATED_MARKER",
           "INDEX_DIR", "LOG_DIR", "SEGMENT_MARKER", "STORE_MARKER", "STREAMS_DIR", "WAL_NAME", "attributes_name",
           "cleaner_dir", "config_dir", "gap_dir", "index_created_marker", "index_dir", "log_name", "rolling_dir",
           "segment_marker", "segment_parts", "stream_dir", "wal_name"]
