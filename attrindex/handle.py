"""``IndexHandle``: the open/closed/read-only life of an index handle, shared by the B+tree
(``TreeIndex``) and the write-ahead-logged facade (``AttributeIndex``)."""

from __future__ import annotations

from typing import Self

from .errors import InvalidInputError


class IndexHandle:
    """Closed-handle and read-only checks, context management and ``repr`` for an index handle.

    Subclasses set ``_closed`` and ``_read_only`` and give ``_location()``: ``(name, url)``.
    """

    _closed: bool
    _read_only: bool

    def _location(self) -> tuple[str, str]:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    @property
    def read_only(self) -> bool:
        """Whether the handle was opened with ``mode="r"``: ``update`` raises."""
        return self._read_only

    def _check_open(self) -> None:
        if self._closed:
            name, url = self._location()
            raise InvalidInputError(f"index {name!r} at {url!r}: the index handle is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._read_only:
            name, url = self._location()
            raise InvalidInputError(f"index {name!r} at {url!r} was opened read-only (mode='r')")

    def __enter__(self) -> Self:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        name, url = self._location()
        state = "closed" if self._closed else f"entries={len(self)}"  # type: ignore[arg-type]
        return f"{type(self).__name__}({url!r}, {name!r}, {state})"
