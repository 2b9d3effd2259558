"""Scripted faults in the merge worker process, injected from the test (nothing in the library).

``MergeFaults`` makes new merge workers run ``main`` below instead of the library's program
(``merge_worker.WORKER_MAIN``): the real worker, whose tree merge first reads a fault from a file
the test writes, then acts it out: ``exit_before_commit`` (the worker dies after replaying the log,
before the tree's footer), ``exit_after_commit`` (it dies after the footer, before answering) or
``hang`` (it sleeps mid-merge, making no progress). The file is read at each merge, so a test
changes the fault of a running worker by writing it again.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

FAULT_FILE_VARIABLE = "ATTRINDEX_TEST_MERGE_FAULT"
PROGRAM = "import sys; from tests.merge_faults import main; sys.exit(main(sys.argv[1:]))"
FAULTS = ("exit_before_commit", "exit_after_commit", "hang")


class MergeFaults:
    """The fault the next merges of workers started from now on act out (``None``: none)."""

    def __init__(self, monkeypatch, directory: pathlib.Path):
        from attrindex import merge_worker

        self.path = directory / "merge-fault"
        self.set(None)
        monkeypatch.setenv(FAULT_FILE_VARIABLE, str(self.path))
        monkeypatch.setattr(merge_worker, "WORKER_MAIN", PROGRAM)

    def set(self, fault: str | None) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown merge fault {fault!r}")
        self.path.write_text(fault or "")


def child_program_lines(path: pathlib.Path | str, fault: str) -> str:
    """Lines for a child process's script that make its merge workers act out ``fault``."""
    return (f"import os; from attrindex import merge_worker\n"
            f"open({str(path)!r}, 'w').write({fault!r})\n"
            f"os.environ[{FAULT_FILE_VARIABLE!r}] = {str(path)!r}\n"
            f"merge_worker.WORKER_MAIN = {PROGRAM!r}\n")


def main(argv: list[str]) -> int:
    from attrindex import merge_worker

    path = os.environ[FAULT_FILE_VARIABLE]
    merge = merge_worker.merge_overlay

    def merge_with_fault(tree, overlay, at, **options):
        fault = pathlib.Path(path).read_text().strip()
        if fault == "exit_before_commit":
            os._exit(17)
        if fault == "hang":
            time.sleep(3600)
        result = merge(tree, overlay, at, **options)
        if fault == "exit_after_commit":
            os._exit(18)
        return result

    merge_worker.merge_overlay = merge_with_fault
    return merge_worker.main(argv)


if __name__ == "__main__":  # pragma: no cover - run through PROGRAM
    sys.exit(main(sys.argv[1:]))
