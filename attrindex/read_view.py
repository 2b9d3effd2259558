"""The lock-free read view of an attribute state: what reads look at, as one tuple.

A view is ``(active, active_settled, frozen, frozen_settled, recent, tree_get, tree_get_many)``:
the active overlay's lookup table (``AttributeOverlay.lookup``; ``None`` while it is empty, so
read-mostly handles skip it) and its settled part (``AttributeOverlay.settled``; ``None``: empty),
the frozen overlay's two (``None``: none), the tree's recent values (``ValueCache``), and the
tree's lookups of canonical keys past those (``TreeIndex.lookups``). The attribute state publishes a new
tuple in one assignment whenever a part is replaced; a read takes the tuple once and probes its
parts in that order, so it never pairs the active overlay of one state with the frozen one of
another. No I/O and no locks here: the lookups do the tree's reads.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import is_
from typing import Callable

from .overlay import probe_many
from .value_cache import MISSING, ValueCache

#: The recent values of a view that holds nothing (a closed handle's, or one whose attributes are
#: not loaded yet): every key falls through to the view's tree lookups, which raise or load.
NO_VALUES = ValueCache(0)  # capacity 0: never holds a value


def fallback_view(get: Callable[[bytes], object], get_many: Callable[[list[bytes]], list]) -> tuple:
    """A view with no overlays whose every read goes to ``get`` / ``get_many`` (a closed handle's,
    which raise; or a handle that loads or rebuilds its attributes on the first read)."""
    return None, None, None, None, NO_VALUES, get, get_many


def view_value(view: tuple, key: bytes) -> int | None:
    """The value of one canonical key in ``view``: the active overlay, the frozen one, the tree's
    recent values, then the tree (the hot path: dict probes, no lists)."""
    active, active_settled, frozen, frozen_settled, recent, tree_get, _tree_get_many = view
    if active is not None:
        value = active[key[-2]].get(key, MISSING)
        if value is not MISSING:
            return value  # type: ignore[return-value]
    if active_settled is not None:
        value = active_settled.get(key)
        if value is not MISSING:
            return value  # type: ignore[return-value]
    if frozen is not None:
        value = frozen[key[-2]].get(key, MISSING)
        if value is not MISSING:
            return value  # type: ignore[return-value]
    if frozen_settled is not None:
        value = frozen_settled.get(key)
        if value is not MISSING:
            return value  # type: ignore[return-value]
    value = recent.young.get(key, MISSING)
    if value is MISSING:
        return tree_get(key)  # type: ignore[no-any-return]
    recent.hits += 1
    return value  # type: ignore[return-value]


def _probe(table, settled, keys: list[bytes]) -> list[object]:
    """An overlay's values of ``keys`` (``MISSING`` where it has none) from its two parts."""
    found = probe_many(table, keys) if table is not None else [MISSING] * len(keys)
    if settled is not None:
        settled.get_many(keys, found)
    return found


def view_values(view: tuple, keys: list[bytes]) -> list[int | None]:
    """``view_value`` for each canonical key, in order; the keys no overlay holds go to the tree as
    one ``get_many``. Every step is one C-level call (``map``, ``compress``) or one numpy search:
    no Python loop per key."""
    active, active_settled, frozen, frozen_settled, _recent, _tree_get, tree_get_many = view
    if active is None and active_settled is None:  # an empty overlay: nothing to probe
        if frozen is None and frozen_settled is None:
            return list(tree_get_many(keys))
        found: list[object] = [MISSING] * len(keys)
        missing = keys
    else:
        found = _probe(active, active_settled, keys)
        missing = list(compress(keys, map(is_, found, repeat(MISSING))))
        if not missing:
            return found  # type: ignore[return-value]
    if frozen is None and frozen_settled is None:
        fill = dict(zip(missing, tree_get_many(missing)))
    else:
        older = _probe(frozen, frozen_settled, missing)
        still = list(compress(missing, map(is_, older, repeat(MISSING))))
        stored = dict(zip(still, tree_get_many(still))) if still else {}
        fill = dict(zip(missing, map(stored.get, missing, older)))
    # A key is in ``fill`` exactly where the overlay had no entry: elsewhere the overlay's value.
    return list(map(fill.get, keys, found))  # type: ignore[arg-type]


__all__ = ["NO_VALUES", "fallback_view", "view_value", "view_values"]
