"""``ObjectMemoryStorage``: memory chunks written whole by an exclusive create, one object per
append, as on S3 (``appendable`` False), with a deletion grace of the test's choosing."""

from __future__ import annotations

from storage_adapters.memory import MemoryChunkStorage


class ObjectMemoryStorage(MemoryChunkStorage):
    """Memory storage that rolling segments treat as an object store."""

    appendable = False

    def __init__(self, root: str, *, deletion_grace: float = 0.0):
        super().__init__(root)
        self.deletion_grace = deletion_grace
