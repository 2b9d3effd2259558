"""The append-only B+tree: page codec, footer, compaction policies and ``BTreeIndex``."""

from .compaction import BoundedPolicy, NoCompaction, OnePagePolicy, TreeShape, policy_for
from .footer import FOOTER_SIZE, Footer
from .tree import DEFAULT_PIECE_SIZE, BTreeIndex, TreeState

__all__ = ["BTreeIndex", "DEFAULT_PIECE_SIZE", "BoundedPolicy", "FOOTER_SIZE", "Footer", "NoCompaction", "OnePagePolicy", "TreeShape", "TreeState", "policy_for"]
