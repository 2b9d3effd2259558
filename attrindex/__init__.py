"""attrindex: append-only segments with an attribute index, on any fsspec filesystem.

The storage layer is available now as ``storage_adapters`` (``open_storage``, ``RollingSegment``);
the attribute index, segments and the Spark integration are built on top of it.
"""

from ._version import __version__
from . import errors

__all__ = ["__version__", "errors"]
