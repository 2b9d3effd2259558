"""``ChunkReplacer``: the replacement of a range of sealed chunks by one chunk (consolidation, log compaction).

The new chunk ``<start>-<end>.<generation>`` covers exactly the range; if it holds fewer bytes,
the rest is a hole. It is visible only once its switch marker ``switch/<generation>`` exists (one
exclusive create: the atomic switch); it then shadows the chunks inside its range, which are
deleted afterwards (``SegmentHandle.sweep_layout``). Generations are taken one after another, so
a replacer that loses a race looks again, a bounded number of times. docs/format.md, "Replaced
chunks", gives the rules readers apply to a listing and for crash recovery.
"""

from __future__ import annotations

import logging

from .errors import (ChunkExistsError, InvalidInputError, LayoutConflictError, OutcomeUnknownError,
                     ReplaceRetriesExhaustedError, StorageError)
from .rolling_handle import SegmentHandle
from .rolling_view import SWITCH_DIR, chunk_name, replacement_name

_log = logging.getLogger("attrindex.storage")

#: Bound on the attempts of one ``replace_range`` (each is one lost race for a generation).
MAX_REPLACE_ATTEMPTS = 10


class ChunkReplacer:
    """Replaces ranges of sealed chunks of one handle's segment (``handle``'s view and I/O)."""

    def __init__(self, handle: SegmentHandle):
        self.handle = handle

    def replace_range(self, start: int, end: int, data: bytes, expected: list[str] | None) -> None:
        """Replace the sealed chunks covering exactly ``[start, end)`` by one chunk holding ``data``
        (input already checked), if they are still ``expected`` (default: those of the view)."""
        handle = self.handle
        with handle.mutex:
            if expected is None:
                expected = [c.name for c in handle.view.sealed_run(handle.name, start, end, InvalidInputError)]
            elif not expected or not all(isinstance(n, str) for n in expected):
                raise InvalidInputError(f"replace_range expected must be a non-empty list of chunk names, "
                                        f"got {expected!r:.100}")
            with handle.writers_lock():
                self._replace_locked(start, end, data, expected)

    def _replace_locked(self, start: int, end: int, data: bytes, expected: list[str]) -> None:
        handle = self.handle
        for _attempt in range(MAX_REPLACE_ATTEMPTS):
            handle.refresh()
            run = handle.view.sealed_run(handle.name, start, end, LayoutConflictError)
            if [c.name for c in run] != expected:
                raise LayoutConflictError(
                    f"segment {handle.name!r}: the chunks in [{start}, {end}) changed since this handle looked "
                    f"(replaced by another handle: {[c.name for c in run]} instead of {expected}); nothing replaced")
            handle.clear_debris(handle.view.layout.debris)
            gen = handle.view.layout.generation + 1
            name = replacement_name(start, end, gen)
            if not self._write_replacement(name, data):
                self._fence(gen)  # a crashed or slower replacer holds the name: take its generation away
                continue
            if not self._switch(gen, name):
                handle.delete_quietly([name])
                continue  # another replacement took this generation: look again
            self._confirm_switch(start, end, name)
            handle.sweep_layout()
            handle.delete_obsolete(handle.obsolete_names(), locked=True)  # this listing: _confirm_switch's
            return
        raise ReplaceRetriesExhaustedError(f"segment {handle.name!r}: gave up replacing [{start}, {end}) after "
                                  f"{MAX_REPLACE_ATTEMPTS} lost races with other replacers; nothing replaced")

    def _write_replacement(self, name: str, data: bytes) -> bool:
        """Write the (still invisible) replacement object; ``False`` if another replacer holds the name."""
        handle = self.handle
        path = handle.path(name)
        try:
            handle.storage.create(path, data)
            return True
        except StorageError as exc:
            found = handle.settle_create(path, data, exc)
            if found == "ours":
                return True
            if found == "theirs":
                return False
            if isinstance(exc, OutcomeUnknownError):
                raise StorageError(f"segment {handle.name!r}: the replacement did not happen ({exc})") from exc
            raise

    def _switch(self, gen: int, name: str) -> bool:
        """Create the switch marker of ``gen`` naming ``name``: the atomic switch. ``False`` if
        another replacement took ``gen`` first; ``OutcomeUnknownError`` if it cannot be told."""
        handle = self.handle
        path = handle.path(f"{SWITCH_DIR}/{chunk_name(gen)}")
        content = name.encode("ascii")
        try:
            handle.storage.create(path, content)
            return True
        except StorageError as exc:
            try:
                found = handle.settle_create(path, content, exc)
            except OutcomeUnknownError:
                raise OutcomeUnknownError(
                    f"segment {handle.name!r}: the switch to {name} may or may not have happened ({exc}); "
                    "refresh to see which layout holds") from exc
            if found == "ours":
                return True
            if found == "theirs":
                return False
            handle.delete_quietly([name])
            if isinstance(exc, OutcomeUnknownError):
                raise StorageError(f"segment {handle.name!r}: the replacement did not happen ({exc})") from exc
            raise

    def _fence(self, gen: int) -> None:
        """Take generation ``gen`` with an empty switch marker (it switches nothing): the replacer
        holding it, if alive, then loses its switch and looks again. Losing this race is fine too."""
        handle = self.handle
        try:
            handle.storage.create(handle.path(f"{SWITCH_DIR}/{chunk_name(gen)}"), b"")
        except ChunkExistsError:
            pass
        except OutcomeUnknownError as exc:
            _log.info("segment %r: fencing generation %d: %s (the next listing tells)", handle.name, gen, exc)

    def _confirm_switch(self, start: int, end: int, name: str) -> None:
        """After the switch: a replacement of a higher generation that overlaps ours (a racer that
        listed before us and switched after) wins; then take ours back and report the conflict."""
        handle = self.handle
        try:
            handle.refresh()
        except StorageError as exc:
            raise OutcomeUnknownError(
                f"segment {handle.name!r}: switched to {name} but could not list the segment after it ({exc}); "
                "refresh to see whether the replacement holds") from exc
        if name not in handle.view.layout.accepted:
            handle.delete_quietly([name])  # its marker stays until a sweep: generations are never reused
            raise LayoutConflictError(
                f"segment {handle.name!r}: another replacement of [{start}, {end}) switched at the same time and "
                "won; nothing of this one is visible")

    def consolidate(self, target: int) -> int:
        """Merge runs of small sealed chunks into chunks of up to ``target`` bytes, each by one
        ``replace_range`` with the exact bytes; return how many merged chunks were written. Runs
        that another process replaces meanwhile are skipped. Holds at most one merged chunk in memory."""
        handle = self.handle
        written = 0
        with handle.mutex:
            handle.refresh()
            for run in handle.view.small_runs(target):
                start, end = run[0].start, run[-1].end
                try:
                    handle.check_open()
                    data = handle.read(start, run[-1].stored_end - start)
                    self.replace_range(start, end, data, None)
                except (LayoutConflictError, FileNotFoundError) as exc:
                    _log.info("segment %r: consolidating [%d, %d) skipped: %s", handle.name, start, end, exc)
                    continue
                written += 1
        return written

