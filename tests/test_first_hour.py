"""A newcomer's first hour: no silent empty stores, no answers from closed handles, no
single key taken for an iterable of keys."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import tomllib
import uuid

import pytest

import attrindex
from attrindex import AttributeIndex, SegmentStore
from attrindex.errors import IndexNotFoundError, InvalidInputError, StoreNotFoundError
from attrindex.layout import STORE_MARKER
from storage_adapters import open_storage

KEY = b"k" * 16
ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- read-only opens of what is not there ---------------------------------------------------------

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


# -- closed handles ------------------------------------------------------------------------------

CALLS_ON_A_CLOSED_INDEX = {
    "get": lambda idx: idx.get(KEY),
    "get_many": lambda idx: idx.get_many([KEY]),
    "items": lambda idx: list(idx.items()),
    "split_keys": lambda idx: idx.split_keys(2),
    "len": len,
    "in": lambda idx: KEY in idx,
    "stats": lambda idx: idx.stats(),
    "verify": lambda idx: idx.verify(),
    "refresh": lambda idx: idx.refresh(),
    "checkpoint": lambda idx: idx.checkpoint,
    "update": lambda idx: idx.update({KEY: 2}),
    "update_sorted": lambda idx: idx.update_sorted([KEY], [2]),
    "with": lambda idx: idx.__enter__(),
}


@pytest.mark.parametrize("call", CALLS_ON_A_CLOSED_INDEX.values(), ids=CALLS_ON_A_CLOSED_INDEX.keys())
def test_every_call_on_a_closed_index_raises(tmp_path, call):
    idx = AttributeIndex.open(str(tmp_path))
    idx.update({KEY: 1})
    idx.close()
    with pytest.raises(InvalidInputError, match="index handle is closed"):
        call(idx)
    idx.close()  # closing twice is harmless
    assert idx.closed and "closed" in repr(idx)
    with AttributeIndex.open(str(tmp_path)) as reopened:
        assert reopened.get(KEY) == 1  # the closed handle wrote nothing


# -- a single key where keys are expected -----------------------------------------------------------

SINGLE_KEYS = [b"x" * 16, bytearray(b"x" * 16), memoryview(b"x" * 16), "x" * 16, uuid.UUID(int=7), 7]
NOT_ITERABLE = [None, 7.5]


@pytest.mark.parametrize("keys", SINGLE_KEYS + NOT_ITERABLE,
                         ids=lambda keys: f"memoryview({bytes(keys)!r})" if isinstance(keys, memoryview) else repr(keys))
def test_get_many_refuses_a_single_key(keys):
    with AttributeIndex.open(f"memory://first-hour-{uuid.uuid4().hex}") as idx:
        idx.update({b"x" * 16: 1})
        with pytest.raises(InvalidInputError, match="iterable of keys"):
            idx.get_many(keys)
        assert idx.get_many([b"x" * 16]) == [1] and idx.get_many(iter([7])) == [None]


# -- packaging -------------------------------------------------------------------------------------

def test_python_dash_m_attrindex_runs_the_command():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "attrindex", "--version"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, f"attrindex {attrindex.__version__}")


# -- logging -----------------------------------------------------------------------------------------

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


def test_the_readme_sets_up_with_two_commands_the_first_installing_the_lean_demo_extra():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = setup.split("```bash\n")[1:]
    assert len(commands) == 2
    assert "pip install '.[demo]'" in commands[0] and "attrindex demo" in commands[0]
    assert "Java 17+" in setup and "GB of memory" in setup
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    demo = " ".join(extras["demo"])
    assert "pyspark[sql]" in demo and "pandas" in demo  # pyspark[sql] brings pyarrow
    for tool in ("pytest", "hypothesis", "moto", "mypy", "matplotlib", "lmdb", "tqdm"):
        assert tool not in demo


def test_a_local_s3_installs_with_one_extra_whose_boto3_fits_s3fs():
    # `pip install '.[s3]' 'moto[server]'` does not resolve: pip takes the newest boto3 (moto's),
    # whose botocore the aiobotocore under s3fs refuses, and backtracks s3fs instead. The
    # s3-server extra pins boto3 into the botocore range of the aiobotocore installed here.
    import importlib.metadata

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {Requirement(r).name: Requirement(r) for r in extras["s3-server"]}
    assert {"attrindex", "moto", "boto3", "s3fs"} <= set(wanted) and "server" in wanted["moto"].extras
    botocore = next(Requirement(r) for r in importlib.metadata.requires("aiobotocore")
                    if Requirement(r).name == "botocore" and not Requirement(r).marker)
    boto3_pin = wanted["boto3"].specifier
    lowest = next(s.version for s in boto3_pin if s.operator == ">=")
    assert botocore.specifier.contains(lowest), (boto3_pin, botocore)  # boto3 X needs botocore X on
    assert importlib.metadata.version("boto3") in boto3_pin  # what the test extra resolved to fits too
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    assert "pip install '.[s3-server]'" in guide and "moto_server -H 127.0.0.1" in guide
