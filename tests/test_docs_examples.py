"""Every fenced ```python block of README.md and docs/*.md runs as written.

The blocks of one page run in order in one namespace, as a reader follows the page. A block that
talks to S3 (an ``"s3://`` string outside comments) runs against the moto server, which the page
reaches through the standard AWS environment variables, as a user's credentials would be found; a
page that uses Spark runs in the test session's SparkSession. ``tempfile`` directories land in the
test's own temporary directory. A block that is not meant to run says so right before its fence
with ``<!-- not-run: reason -->``; those are listed in ``NOT_RUN`` below, and kept rare.
"""

from __future__ import annotations

import logging
import pathlib
import re
import tempfile

import attrs
import pytest

from tests.conftest import S3_KEY, S3_SECRET

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.+?)\s*-->\s*\Z", re.S)
_S3_URL = re.compile(r"""["']s3://""")
_SPARK = re.compile(r"\bspark\b")

#: (page, reason) of every block marked not-run; a new one must be added here on purpose.
NOT_RUN: list[tuple[str, str]] = []


@attrs.frozen
class Example:
    page: str  #: relative to the repository root
    line: int  #: of the first code line
    code: str
    not_run: str | None  #: the reason given, for blocks marked not-run

    @property
    def uses_s3(self) -> bool:
        return any(_S3_URL.search(line.split("#", 1)[0]) for line in self.code.splitlines())

    @property
    def uses_spark(self) -> bool:
        return any(_SPARK.search(line.split("#", 1)[0]) for line in self.code.splitlines())


def examples(page: str, text: str) -> list[Example]:
    """The ```python blocks of a page's Markdown ``text``, in order."""
    found, previous_end = [], 0
    for match in _FENCE.finditer(text):
        marker = _NOT_RUN.search(text[previous_end:match.start()])
        line = text.count("\n", 0, match.start(1)) + 1
        found.append(Example(page, line, match[1], marker[1] if marker else None))
        previous_end = match.end()
    return found


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


EXAMPLES = {_name(page): examples(_name(page), page.read_text()) for page in PAGES}
RUNNABLE = {page: [e for e in found if e.not_run is None] for page, found in EXAMPLES.items()}
SPARK_PAGES = sorted(page for page, found in RUNNABLE.items() if any(e.uses_spark for e in found))
PLAIN_PAGES = sorted(page for page, found in RUNNABLE.items() if found and page not in SPARK_PAGES)


def test_every_python_block_is_found():
    for page in PAGES:
        assert len(EXAMPLES[_name(page)]) == page.read_text().count("```python\n")
    assert sum(map(len, RUNNABLE.values())) >= 10  # README and the guides are full of examples


def test_the_extraction_finds_code_lines_markers_and_backends():
    page = (
        "# T\n\n```python\nx = 1  # s3://in a comment\n```\n\ntext\n\n<!-- not-run: needs a cluster -->\n"
        "```python\nspark.stop()\n```\n\n```bash\nls\n```\n\n```python\nopen_storage('s3://b/p')\n```\n"
    )
    first, second, third = examples("t.md", page)
    assert (first.line, first.code, first.not_run, first.uses_s3, first.uses_spark) == (
        4, "x = 1  # s3://in a comment\n", None, False, False)
    assert (second.line, second.not_run, second.uses_spark) == (11, "needs a cluster", True)
    assert (third.not_run, third.uses_s3) == (None, True)


def test_blocks_not_run_are_listed_with_their_reasons():
    marked = [(e.page, e.not_run) for found in EXAMPLES.values() for e in found if e.not_run is not None]
    assert marked == NOT_RUN


def _run_page(page: str, namespace: dict) -> None:
    for example in RUNNABLE[page]:
        code = compile(example.code, f"{page}:{example.line}", "exec")
        try:
            exec(code, namespace)
        except Exception as exc:
            raise AssertionError(f"the example at {page}:{example.line} failed: {exc!r}") from exc


@pytest.fixture
def example_env(tmp_path, monkeypatch, request):
    """A scratch working and temporary directory, and S3 settings pointing at moto when needed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    page = request.node.callspec.params["page"]
    if any(e.uses_s3 for e in RUNNABLE[page]):
        monkeypatch.setenv("AWS_ENDPOINT_URL", request.getfixturevalue("s3_endpoint"))
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # Pages show how to turn logging on: what they configure must not outlive them.
    library = logging.getLogger("attrindex")
    root_handlers, library_level = logging.root.handlers[:], library.level
    yield tmp_path
    logging.root.handlers[:] = root_handlers
    library.setLevel(library_level)


@pytest.mark.parametrize("page", PLAIN_PAGES)
def test_examples_run(page, example_env):
    _run_page(page, {"__name__": "__example__"})


@pytest.mark.slow
@pytest.mark.parametrize("page", SPARK_PAGES)
def test_spark_examples_run(page, example_env, spark):
    """In the test session (``attrindex.spark.session()`` returns it): its settings are put back."""
    import attrindex.spark

    settings = {key: spark.conf.get(key, None) for key in
                ("spark.sql.shuffle.partitions", attrindex.spark.FILTER_PUSHDOWN_CONF, "spark.sql.session.timeZone")}
    try:
        _run_page(page, {"__name__": "__example__"})
    finally:
        for active in spark.streams.active:
            active.stop()
        for key, value in settings.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
        attrindex.spark.register(spark)
