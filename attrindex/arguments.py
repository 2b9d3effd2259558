"""Checks of plain arguments that several public methods share: a wait limit, a progress callback.

Each raises ``InvalidInputError`` saying what was given, before the caller does anything.
"""

from __future__ import annotations

import threading

from .errors import InvalidInputError


def check_timeout(timeout: object, name: str = "timeout") -> None:
    """A wait limit: ``None`` (no limit) or a finite number of seconds >= 0, else ``InvalidInputError``."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidInputError(f"{name} must be a number of seconds or None, got {type(timeout).__name__}: {timeout!r}")
    if not 0 <= timeout <= threading.TIMEOUT_MAX:  # also refuses nan, which compares false
        raise InvalidInputError(f"{name} must be a finite number of seconds >= 0 (at most "
                                f"{threading.TIMEOUT_MAX:.0f}) or None, got {timeout!r}")


def check_progress(progress: object) -> None:
    """A progress callback: ``None`` or a callable taking ``(done, total)``, else ``InvalidInputError``."""
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress must be a callable taking (done, total) or None, "
                                f"got {type(progress).__name__}: {progress!r:.60}")
