"""A segment's cleanup policy (Kafka's ``cleanup.policy`` and friends) and its stored form.

The policy is a small config object stored next to the log, in versions that are never
overwritten (stored bytes never change in place)::

    NAME/_config/<20-digit version>    one JSON object + a CRC-32 line; the largest version wins

Version 0 is written when the segment is created with policy options; ``Segment.configure``
writes the next version by exclusive create, so two processes changing the policy at once cannot
both win the same version. A segment without any version has the default policy (``delete``).
This module only encodes, decodes and validates; ``attrindex.log.cleaner`` does the I/O.
"""

from __future__ import annotations

import json
import logging
import re
import zlib

import attrs

from ..layout import config_dir
from ..errors import CorruptDataError, InvalidInputError

_log = logging.getLogger("attrindex.segment")

DEFAULT_TOMBSTONE_RETENTION_MS = 86_400_000  #: Kafka's delete.retention.ms (1 day)
DEFAULT_MIN_COMPACTION_LAG_MS = 0  #: Kafka's min.compaction.lag.ms
POLICIES = ("delete", "compact", "delete,compact")
_VERSION_NAME = re.compile(r"\d{20}")
_FORMAT = 1
_I64_MAX = (1 << 63) - 1


def _policy(value: object) -> str:
    """The canonical spelling of a cleanup policy (``"compact,delete"`` is ``"delete,compact"``)."""
    if not isinstance(value, str):
        raise InvalidInputError(f"cleanup_policy must be one of {', '.join(map(repr, POLICIES))}, got {value!r:.60}")
    parts = {p.strip().lower() for p in value.split(",")}
    canonical = ",".join(p for p in ("delete", "compact") if p in parts)
    if not parts or not parts <= {"delete", "compact"}:
        raise InvalidInputError(f"cleanup_policy must be one of {', '.join(map(repr, POLICIES))}, got {value!r:.60}")
    return canonical


def _millis(name: str, optional: bool = False):
    def check(_instance, _attribute, value) -> None:
        if value is None and optional:
            return
        if type(value) is not int or not 0 <= value <= _I64_MAX:
            raise InvalidInputError(f"{name} must be an int of ms >= 0{' or None' if optional else ''}, "
                                    f"got {value!r:.60}")
    return check


@attrs.frozen
class CleanupPolicy:
    """How a segment gives space back (see docs/segments.md, "Compaction").

    ``cleanup_policy``: ``"delete"`` (retention only, the default), ``"compact"`` (keep the latest
    record per key) or ``"delete,compact"`` (both). ``min_compaction_lag_ms``: records younger
    than this are never compacted. ``tombstone_retention_ms``: a tombstone stays at least this long
    after the cleaner first rewrote it (Kafka's ``delete.retention.ms``). ``retention_ms`` and
    ``retention_bytes``: the retention a ``delete,compact`` segment's ``compact()`` applies first
    (None: no limit).
    """

    cleanup_policy: str = attrs.field(default="delete", converter=_policy)
    min_compaction_lag_ms: int = attrs.field(default=DEFAULT_MIN_COMPACTION_LAG_MS,
                                             validator=_millis("min_compaction_lag_ms"))
    tombstone_retention_ms: int = attrs.field(default=DEFAULT_TOMBSTONE_RETENTION_MS,
                                              validator=_millis("tombstone_retention_ms"))
    retention_ms: int | None = attrs.field(default=None, validator=_millis("retention_ms", optional=True))
    retention_bytes: int | None = attrs.field(default=None, validator=_millis("retention_bytes", optional=True))

    @property
    def compacts(self) -> bool:
        return "compact" in self.cleanup_policy

    @property
    def deletes(self) -> bool:
        return "delete" in self.cleanup_policy

    def encode(self) -> bytes:
        """The stored form: a JSON object, a newline, and the CRC-32 of the JSON in hex."""
        body = json.dumps({"format": _FORMAT, **attrs.asdict(self)}, sort_keys=True).encode()
        return body + b"\n" + f"{zlib.crc32(body):08x}".encode()


OPTION_NAMES = tuple(f.name for f in attrs.fields(CleanupPolicy))


def policy_from_options(options: dict, base: CleanupPolicy | None = None) -> CleanupPolicy:
    """``base`` (default: the default policy) with ``options`` applied; unknown names or bad
    values raise ``InvalidInputError``."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise InvalidInputError(f"unknown cleanup option(s) {', '.join(map(repr, unknown))}; "
                                f"known: {', '.join(OPTION_NAMES)}")
    try:
        return attrs.evolve(base or CleanupPolicy(), **options)
    except TypeError as exc:  # attrs' own complaints about arguments
        raise InvalidInputError(str(exc)) from None


def decode_policy(data: bytes, *, where: str) -> CleanupPolicy:
    """A stored policy, or ``CorruptDataError`` naming ``where`` (a torn or flipped config)."""
    body, _, crc = data.rpartition(b"\n")
    try:
        if f"{zlib.crc32(body):08x}".encode() != crc:
            raise ValueError("checksum mismatch")
        fields = json.loads(body)
        if fields.pop("format") != _FORMAT:
            raise ValueError("unknown format")
        return CleanupPolicy(**fields)
    except (ValueError, TypeError, KeyError, AttributeError, InvalidInputError) as exc:
        raise CorruptDataError(f"cleanup policy {where!r} is damaged: {exc}", offset=0) from None


def version_name(version: int) -> str:
    return f"{version:020d}"


def config_versions(names) -> list[int]:
    """The policy versions among file names of the config directory, ascending."""
    return sorted(int(n) for n in names if _VERSION_NAME.fullmatch(n))


__all__ = ["CleanupPolicy", "DEFAULT_TOMBSTONE_RETENTION_MS", "POLICIES", "decode_policy",
           "policy_from_options"]


# ------------------------------------------------------------------------------------ storage

MAX_CONFIGURE_ATTEMPTS = 20  #: concurrent ``configure`` calls lost in a row before one gives up


def load_policy(storage, segment: str) -> tuple[CleanupPolicy, int]:
    """The newest valid stored policy of ``segment`` and the newest version number (-1 and the
    default policy if none). A damaged version (a crash while ``configure`` wrote it: it never
    returned) is skipped with a warning; its number stays taken."""
    versions = config_versions(storage.list_files(config_dir(segment)))
    for version in reversed(versions):
        path = f"{config_dir(segment)}/{version_name(version)}"
        try:
            return decode_policy(storage.read(path, 0, 1 << 20), where=path), versions[-1]
        except CorruptDataError as exc:
            _log.warning("segment %r: %s; using the version before it", segment, exc)
    return CleanupPolicy(), versions[-1] if versions else -1


def store_policy(storage, segment: str, policy: CleanupPolicy, version: int) -> None:
    """Write ``policy`` as ``version`` (exclusive create: ``ChunkExistsError`` if it exists)."""
    storage.create(f"{config_dir(segment)}/{version_name(version)}", policy.encode())
