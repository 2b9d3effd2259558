"""CRC-32 for every checksum the formats store (docs/format.md): the zlib polynomial and values,
computed by python-isal where it is installed (the ``fast``, ``arrow`` and ``spark`` extras: the
same values, 2 to 3 times faster on this project's batches and pages), else by ``zlib``."""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - the extras install isal
    from zlib import crc32

__all__ = ["crc32"]
