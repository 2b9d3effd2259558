"""``Damage``: one damaged byte range found by a verification (shared by segments and indexes)."""

from __future__ import annotations

import attrs


@attrs.frozen
class Damage:
    """A damaged byte range found by a verification."""

    where: str
    start: int
    end: int
    reason: str
