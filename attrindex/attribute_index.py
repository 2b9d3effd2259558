"""``AttributeIndex``: the public key-value index (16-byte keys, int64 values) over any storage URL.

For now it is the B+tree itself (``attrindex.tree_index.TreeIndex``); it becomes a facade over a
write-ahead log and the tree. The helpers other modules import from here are re-exported.
"""

from __future__ import annotations

from .btree.verify import VerifyReport
from .tree_index import (DEFAULT_CACHE_BYTES, DEFAULT_INDEX_ROLLING_SIZE, DEFAULT_VALUE_CACHE_ENTRIES, MAX_SPLIT_PARTS,
                         IndexStats, TreeIndex, _all_canonical_keys, _all_canonical_values, _canonical_batch, _storage,
                         key_list)


class AttributeIndex(TreeIndex):
    """A durable map of 16-byte keys to signed 64-bit values, stored as an append-only B+tree.

    Keys may be given as 16 ``bytes``, a ``uuid.UUID`` or an ``int`` in ``[0, 2**128)``; they come
    back as ``bytes`` in unsigned byte order. Each ``update`` is one durable append. Several handles
    and processes may update one index: an update that loses the race reloads and re-applies
    itself. Reads see this handle's latest view; ``refresh()`` picks up other writers' updates.
    """


__all__ = ["AttributeIndex", "IndexStats", "TreeIndex", "VerifyReport", "key_list", "DEFAULT_CACHE_BYTES",
           "DEFAULT_INDEX_ROLLING_SIZE", "DEFAULT_VALUE_CACHE_ENTRIES", "MAX_SPLIT_PARTS", "_all_canonical_keys",
           "_all_canonical_values", "_canonical_batch", "_storage"]
