"""The append-only B+tree: page codec, footer, compaction policies and ``BTreeIndex``."""

from .compaction import BoundedPolicy, NoCompaction, OnePagePolicy, TreeShape, policy_for
from .footer import FOOTER_SIZE, Footer
from .tree import BTreeIndex, TreeState

__all__ = ["BTreeIndex", "BoundedPolicy", "FOOTER_SIZE", "Footer", "NoCompaction", "OnePagePolicy", "TreeShape", "TreeState", "policy_for"]
