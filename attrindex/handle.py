"""``IndexHandle``: the open/closed/read-only life of an index handle, shared by the B+tree
(``TreeIndex``) and the write-ahead-logged facade (``AttributeIndex``)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Self

from storage_adapters.rolling import validate_segment_name

from .errors import IndexNotFoundError, InvalidInputError
from .locations import index_exists, mark_index_created, open_location


class IndexHandle:
    """Closed-handle and read-only checks, context management and ``repr`` for an index handle.

    Subclasses set ``_closed`` and ``_read_only`` and give ``_location()``: ``(name, url)``.
    """

    _closed: bool
    _read_only: bool

    def _location(self) -> tuple[str, str]:
        raise NotImplementedError

    @classmethod
    def _open_at(cls, url: str | os.PathLike[str], name: str, mode: str, storage_options: Mapping[str, Any] | None,
                 options: dict[str, Any]) -> Self:
        """``open``'s work for every index class: the storage at ``url``, the index ``name`` in it
        (created in mode "a" after a handle built with ``options`` checked them; an existing one
        only in "r+" and "r"), read-only in "r"."""
        if mode not in ("a", "r+", "r"):
            raise InvalidInputError(f"mode must be 'a' (open or create), 'r+' (an existing index) or 'r' (read-only), "
                                    f"got {mode!r:.60}")
        validate_segment_name(name)
        what = f"index {name!r}"
        storage = open_location(url, storage_options, what=what, not_found=IndexNotFoundError)
        try:
            if not index_exists(storage, name):
                if mode != "a":
                    raise IndexNotFoundError(f"no {what} at URL {storage.url!r} (opened with mode {mode!r}, so nothing "
                                             f"was created)")
                cls(storage, name, **options).close()  # type: ignore[call-arg]  # options checked before the marker
                mark_index_created(storage, name)
            index = cls(storage, name, **options)  # type: ignore[call-arg]
        except BaseException:
            storage.close()
            raise
        index._read_only = mode == "r"
        return index

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

    def _counts(self) -> str:
        """What ``repr`` says of an open handle's contents (cheap: no lookups)."""
        return f"entries={len(self)}"  # type: ignore[arg-type]

    def __repr__(self) -> str:
        name, url = self._location()
        state = "closed" if self._closed else self._counts()
        return f"{type(self).__name__}({url!r}, {name!r}, {state})"
