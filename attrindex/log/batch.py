"""Record batches of the segment log: a core that does no I/O (records in, bytes out, and back).

A batch is a fixed 64-byte header and a payload; docs/format.md has the layout byte by byte::

    0   4s   magic b"AIXB"
    4   u16  format version (3)
    6   u16  flags: bits 0-2 codec, bit 3 keys column, bit 4 timestamps column, bit 5 headers column,
              bit 6 tombstones column
    8   u32  size of the whole batch, header included
    12  u32  record count
    16  u32  attribute update count
    20  u32  payload length before compression
    24  i64  base offset (logical offset of the first record)
    32  i64  first timestamp (the first record's; the append timestamp if there are no records)
    40  i64  max timestamp
    48  u64  batch id (random, fixed per append call: a writer recognises its own batch)
    56  u32  CRC-32 of the stored (possibly compressed) payload
    60  u32  CRC-32 of bytes 0..59, seeded with the batch's byte position in its segment

The header has its own checksum, so a reader tells a torn tail (a valid header whose payload is not
all there yet) from garbage (a header that fails its checksum). That checksum is seeded with where
the batch lies (the CRC-32 of the position as a little-endian u64, then bytes 0..59, as B+tree
pages and footers are), so a batch is valid at one position only: stale bytes, or a batch copied
or moved elsewhere, never pass for data there. ``place_batches`` seals batches for where they
land; the encoders seal for position 0 unless told another. The payload is columnar so that
both directions run on C-level bulk operations: value lengths (varints), all values as one blob,
then the optional key, timestamp, header and tombstone columns, then the attribute updates, whose size is fixed (25 bytes each) so they sit at a known place at the
end of the payload. A tombstone (``Record(value=None, key=...)``: the key is deleted, Kafka's null
value) is a record whose byte in the tombstones column is 1; batches without tombstones have no
such column, so they are byte for byte what they were before tombstones existed.
"""

from __future__ import annotations

import array
import enum
import functools
import itertools
import operator
import os
import random
import struct
import sys
import typing
import zlib
from collections.abc import Iterator

import attrs

from .. import checksum
from ..errors import CorruptDataError, InvalidInputError, MissingDependencyError
from .varint import decode_varints, encode_lengths

__all__ = [
    "BATCH_HEADER_SIZE",
    "BATCH_MAGIC",
    "BATCH_VERSION",
    "BatchHeader",
    "Codec",
    "Record",
    "available_codecs",
    "BatchColumns",
    "batch_columns",
    "check_batch",
    "codec_for",
    "decode_attribute_updates",
    "decode_keys",
    "decode_records",
    "encode_batch_with_header",
    "encode_batch",
    "iter_batches",
    "new_batch_id",
    "peek_header",
    "place_batches",
    "read_header",
    "rebase_batch",
    "seal_header",
    "uniform_keys",
]

BATCH_MAGIC = b"AIXB"
BATCH_VERSION = 3  # 1 (no batch id) and 2 (checksum not seeded with the position) were never released
HEADER_STRUCT = struct.Struct("<4sHHIIIIqqqQII")
BATCH_HEADER_SIZE = HEADER_STRUCT.size  # 64
_CHECKED_HEADER = BATCH_HEADER_SIZE - 4  # the header checksum covers the bytes before it
_PREFIX = struct.Struct("<4sHHI")  # magic, version, flags, size
_FRAME = struct.Struct("<4sH2xI44xII")  # magic, version, size, payload CRC, header CRC
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")

_CODEC_MASK = 0x07
FLAG_KEYS = 0x08
FLAG_TIMESTAMPS = 0x10
FLAG_HEADERS = 0x20
FLAG_TOMBSTONES = 0x40  #: a column of one byte per record: 1 = tombstone (value None)
_KNOWN_FLAGS = _CODEC_MASK | FLAG_KEYS | FLAG_TIMESTAMPS | FLAG_HEADERS | FLAG_TOMBSTONES

MAX_RECORDS = (1 << 31) - 1
_U32_MAX = (1 << 32) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_U64_MASK = (1 << 64) - 1
KEY_SIZE = 16
UPDATE_SIZE = KEY_SIZE + 8 + 1  # key, i64 value, removed flag
_BIG_ENDIAN = sys.byteorder == "big"

# --------------------------------------------------------------------------------------- codecs


class Codec(enum.IntEnum):
    """How a batch's payload is compressed (the low three bits of the header flags)."""

    NONE = 0
    GZIP = 1
    ZSTD = 2
    LZ4 = 3


_CODEC_PACKAGES = {Codec.ZSTD: ("zstandard", "zstandard"), Codec.LZ4: ("lz4.frame", "lz4")}
_codec_modules: dict[Codec, object] = {}  # Codec -> imported module, or None if it is missing


def _codec_module(codec: Codec):
    try:
        return _codec_modules[codec]
    except KeyError:
        pass
    import importlib

    try:
        module = importlib.import_module(_CODEC_PACKAGES[codec][0])
    except ImportError:
        module = None
    _codec_modules[codec] = module
    return module


def available_codecs() -> frozenset[Codec]:
    """The codecs this interpreter can write and read: NONE and GZIP always, ZSTD and LZ4 if installed."""
    return frozenset(c for c in Codec if c not in _CODEC_PACKAGES or _codec_module(c) is not None)


def _require(codec: Codec):
    """The module that implements ``codec`` (None for the built-in ones), or MissingDependencyError."""
    if codec not in _CODEC_PACKAGES:
        return None
    module = _codec_module(codec)
    if module is None:
        package = _CODEC_PACKAGES[codec][1]
        raise MissingDependencyError(
            f"codec {codec.name.lower()!r} needs the {package!r} package: pip install {package}"
        )
    return module


_CODEC_CHOICES = ", ".join(repr(c.name.lower()) for c in Codec)
_MAX_CODEC = max(Codec)


def codec_for(spec: str | int | Codec | None) -> Codec:
    """The codec named by ``spec``: a ``Codec``, its number, its name (any case), or None for NONE."""
    if spec is None or spec is Codec.NONE:
        return Codec.NONE
    if isinstance(spec, str):
        try:
            codec = Codec[spec.strip().upper()]
        except KeyError:
            raise InvalidInputError(f"unknown codec {spec!r}; choose one of {_CODEC_CHOICES}") from None
    elif isinstance(spec, int) and not isinstance(spec, bool):
        try:
            codec = Codec(spec)
        except ValueError:
            raise InvalidInputError(f"unknown codec number {spec!r}; choose one of {_CODEC_CHOICES}") from None
    else:
        raise InvalidInputError(
            f"codec must be a name ({_CODEC_CHOICES}), a Codec or None, got {type(spec).__name__}"
        )
    _require(codec)
    return codec


def compress_payload(codec: Codec, payload: bytes) -> bytes:
    """``payload`` compressed with ``codec`` (``MissingDependencyError`` if its package is missing)."""
    module = _require(codec)
    if codec == Codec.GZIP:
        compressor = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: the gzip wrapper
        return compressor.compress(payload) + compressor.flush()
    if codec == Codec.ZSTD:
        return module.ZstdCompressor(level=3, write_content_size=True).compress(payload)
    return module.compress(payload, store_size=True)  # lz4.frame


def _decompress(codec: Codec, data, expected: int, corrupt) -> bytes:
    """Decompress ``data``, producing at most ``expected`` bytes; anything else is ``corrupt``."""
    module = _require(codec)
    try:
        if codec == Codec.GZIP:
            inflater = zlib.decompressobj(31)
            out = inflater.decompress(data, expected + 1)  # max_length 0 would mean unlimited
            complete = inflater.eof and not inflater.unused_data and not inflater.unconsumed_tail
        elif codec == Codec.ZSTD:
            declared = module.frame_content_size(data)  # -1 when the frame does not record it
            if declared != expected:
                raise corrupt(f"zstd frame declares {declared} bytes of content, the header {expected}")
            if expected:
                # allocates exactly the declared size; a frame that inflates past it is an error
                out = module.ZstdDecompressor().decompress(data, max_output_size=expected, allow_extra_data=False)
                complete = True
            else:  # decompress() returns b"" for an empty frame without looking at what follows
                inflater = module.ZstdDecompressor().decompressobj()
                out = inflater.decompress(data)
                complete = inflater.eof and not inflater.unused_data
        else:
            declared = module.get_frame_info(data)["content_size"]
            if declared not in (0, expected):  # 0: the frame does not record its size
                raise corrupt(f"lz4 frame declares {declared} bytes, the header {expected}")
            inflater = module.LZ4FrameDecompressor()
            out = inflater.decompress(data, max_length=expected + 1)
            complete = inflater.eof and not inflater.unused_data
    except (CorruptDataError, MemoryError):
        raise
    except Exception as exc:  # zlib.error, ZstdError, lz4's RuntimeError, ...: all mean bad bytes
        raise corrupt(f"{codec.name.lower()} payload does not decompress: {exc}") from exc
    if len(out) > expected:
        raise corrupt(f"{codec.name.lower()} payload decompresses to more than the declared {expected} bytes")
    if len(out) != expected or not complete:
        raise corrupt(
            f"{codec.name.lower()} payload does not end cleanly after the declared {expected} bytes "
            f"(got {len(out)}, stream complete: {bool(complete)})"
        )
    return out


# -------------------------------------------------------------------------------------- records


class Record(typing.NamedTuple):
    """One record: the input form of ``encode_batch`` and what ``decode_records`` returns.

    ``value=None`` makes a tombstone (Kafka's null value: log compaction deletes the key); a
    tombstone must have a key."""

    value: bytes | None
    key: bytes | None = None
    timestamp: int | None = None  # ms since the epoch; None on input means the batch's timestamp
    headers: typing.Sequence[tuple[str, bytes]] = ()  # (name, value) pairs; records read back hold a tuple
    offset: int | None = None  # set on records read back; ignored on input


@attrs.frozen
class BatchHeader:
    """A decoded batch header. ``size`` counts the whole batch, header included."""

    size: int
    base_offset: int
    record_count: int
    attribute_count: int
    first_timestamp: int
    max_timestamp: int
    codec: Codec
    # Beyond the fields above, what the payload readers need (defaulted, so that code building a
    # header from the seven fields above still works; such a header cannot verify a payload).
    payload_size: int = 0  # payload length before compression
    payload_crc: int = 0  # CRC-32 of the stored payload
    flags: int = 0  # the raw header flags (codec and which optional columns are present)
    batch_id: int = 0  # random per append call, kept across its retries (see ``new_batch_id``)

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.record_count - 1


# ------------------------------------------------------------------------------------- encoding


def _as_bytes(obj, what: str) -> bytes:
    if type(obj) is bytes:
        return obj
    if isinstance(obj, str):
        raise InvalidInputError(f"{what} must be bytes-like, got str (encode it first)")
    try:
        return bytes(memoryview(obj))
    except TypeError:
        raise InvalidInputError(f"{what} must be bytes-like, got {type(obj).__name__}") from None


def _check_i64(value, what: str) -> int:
    if type(value) is int and _I64_MIN <= value <= _I64_MAX:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{what} must be an int, got {type(value).__name__}")
    if not _I64_MIN <= value <= _I64_MAX:
        raise InvalidInputError(f"{what} must be in the signed 64-bit range, got {value}")
    return int(value)


_NONE_TYPE = type(None)


def _normalize_columns(records, timestamp: int):
    """``_normalize`` for the common case, checked column by column at C speed: every item a
    ``Record`` with a ``bytes`` value, a ``bytes`` or no key, an int64 or no timestamp and no
    headers. ``None`` when anything else is there (the per-record path then says what is wrong)."""
    if not all(type(r) is Record for r in records):
        return None
    values, keys, stamps, headers, _offsets = zip(*records)
    if any(headers) or set(map(type, values)) != {bytes}:  # tombstones (None) take the per-record path
        return None
    key_types = set(map(type, keys))
    if not key_types <= {bytes, _NONE_TYPE}:
        return None
    stamp_types = set(map(type, stamps))
    if not stamp_types <= {int, _NONE_TYPE}:
        return None
    if _NONE_TYPE in stamp_types:
        stamps = [timestamp if t is None else t for t in stamps]
    if min(stamps) < _I64_MIN or max(stamps) > _I64_MAX:
        return None
    return list(values), list(keys) if bytes in key_types else None, list(stamps), None, None


def _normalize(records, timestamp: int):
    """Per-record path: (values, keys or None, timestamps or None, headers or None, tombstone
    flags or None). A tombstone's value is stored as ``b""`` and flagged."""
    fast = _normalize_columns(records, timestamp)
    if fast is not None:
        return fast
    values: list[bytes] = []
    keys: list[bytes | None] = []
    stamps: list[int] = []
    headers: list[tuple] = []
    tombstones: list[int] = []
    any_key = any_headers = False
    for i, record in enumerate(records):
        dead = 0
        if isinstance(record, Record):
            value, key, stamp, pairs, _offset = record
            if value is None:
                if key is None:
                    raise InvalidInputError(f"record {i}: a tombstone (value None) needs a key: it deletes that key")
                value, dead = b"", 1
            else:
                value = _as_bytes(value, f"record {i}: value")
            if key is not None:
                if isinstance(key, str):
                    raise InvalidInputError(f"record {i}: key must be bytes or None, got str")
                key = _as_bytes(key, f"record {i}: key")
                any_key = True
            if stamp is None:
                stamp = timestamp
            else:
                stamp = _check_i64(stamp, f"record {i}: timestamp")
            if pairs:
                pairs = normalize_headers(pairs, f"record {i}")
                any_headers = any_headers or bool(pairs)
            else:
                pairs = ()
        elif isinstance(record, tuple):
            raise InvalidInputError(f"record {i}: must be bytes-like or a Record, got a plain tuple")
        else:
            value, key, stamp, pairs = _as_bytes(record, f"record {i}: value"), None, timestamp, ()
        values.append(value)
        keys.append(key)
        stamps.append(stamp)
        headers.append(pairs)
        tombstones.append(dead)
    return (values, keys if any_key else None, stamps, headers if any_headers else None,
            tombstones if any(tombstones) else None)


def record_list(records) -> list:
    """The records of an append as a list: any iterable but a single value (``InvalidInputError``)."""
    if isinstance(records, list):
        return records
    if isinstance(records, (bytes, bytearray, memoryview, str, Record)) or records is None:
        raise InvalidInputError(f"records must be a list of bytes values or Records, got {type(records).__name__}")
    try:
        return list(records)
    except TypeError:
        raise InvalidInputError(f"records must be a list of bytes values or Records, got {type(records).__name__}") from None


def normalize_headers(pairs, where: str) -> tuple:
    """A record's headers as a tuple of ``(str, bytes)`` pairs, or ``InvalidInputError`` naming
    ``where`` (e.g. ``"record 3"``) and what is wrong."""
    wrong = f"{where}: headers must be a sequence of (str, bytes) pairs, got {type(pairs).__name__}"
    if isinstance(pairs, (str, bytes, bytearray, memoryview, dict)):
        raise InvalidInputError(wrong)
    out = []
    try:
        items = list(pairs)
    except TypeError:
        raise InvalidInputError(wrong) from None
    for j, pair in enumerate(items):
        try:
            name, value = pair
        except (TypeError, ValueError):
            raise InvalidInputError(f"{where}: header {j} must be a (name, value) pair, got {pair!r:.60}") from None
        if not isinstance(name, str):
            raise InvalidInputError(f"{where}: header {j} name must be a str, got {type(name).__name__}")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(f"{where}: header {j} name {name!r} is not encodable as UTF-8") from None
        out.append((name, _as_bytes(value, f"{where}: header {name!r} value")))
    return tuple(out)


def check_timestamps(stamps, what: str = "timestamp") -> list:
    """``stamps`` as a list, each ``None`` or an int64 of ms (not a bool, float or str), or
    ``InvalidInputError`` naming the first bad one. Checked at C speed when all are fine."""
    stamps = list(stamps)
    types = set(map(type, stamps))
    if types <= {int, _NONE_TYPE}:
        ints = [t for t in stamps if t is not None] if _NONE_TYPE in types else stamps
        if not ints or (_I64_MIN <= min(ints) and max(ints) <= _I64_MAX):
            return stamps
    for i, stamp in enumerate(stamps):
        if stamp is not None:
            _check_i64(stamp, f"{what} {i}")
    return stamps


def encode_updates(attribute_updates) -> tuple[int, list[bytes]]:
    """``(count, pieces)``: ``(keys, values)`` attribute updates as a batch stores them (``InvalidInputError``
    for bad input, before anything is written)."""
    try:
        keys, values = attribute_updates
    except (TypeError, ValueError):
        raise InvalidInputError("attribute_updates must be a pair (keys, values)") from None
    keys, values = list(keys), list(values)
    n = len(keys)
    if len(values) != n:
        raise InvalidInputError(f"attribute_updates has {n} keys but {len(values)} values")
    if n == 0:
        return 0, []
    try:
        key_blob = b"".join(keys)
    except TypeError:
        raise InvalidInputError("attribute update keys must be 16-byte bytes objects") from None
    if len(key_blob) != KEY_SIZE * n or set(map(len, keys)) != {KEY_SIZE}:
        raise InvalidInputError(f"attribute update keys must be {KEY_SIZE} bytes each")
    if None in values:
        removed = bytes(v is None for v in values)
        values = [0 if v is None else v for v in values]
    else:
        removed = bytes(n)
    try:
        column = array.array("q", values)
    except (TypeError, OverflowError):
        bad = next((v for v in values if type(v) is not int or not _I64_MIN <= v <= _I64_MAX), None)
        raise InvalidInputError(
            f"attribute update values must be ints in the signed 64-bit range or None, got {bad!r:.60}"
        ) from None
    if _BIG_ENDIAN:
        column.byteswap()
    return n, [key_blob, column.tobytes(), removed]


def encode_batch(
    base_offset: int,
    records,
    *,
    timestamp: int,
    attribute_updates=((), ()),
    codec: Codec | str | int | None = Codec.NONE,
    batch_id: int | None = None,
    position: int = 0,
) -> bytes:
    """One batch holding ``records`` and ``attribute_updates`` (see ``encode_batch_with_header``)."""
    return encode_batch_with_header(base_offset, records, timestamp=timestamp, attribute_updates=attribute_updates,
                                    codec=codec, batch_id=batch_id, position=position)[0]


def encode_batch_with_header(
    base_offset: int,
    records,
    *,
    timestamp: int,
    attribute_updates=((), ()),
    codec: Codec | str | int | None = Codec.NONE,
    batch_id: int | None = None,
    position: int = 0,
) -> tuple[bytes, BatchHeader]:
    """``(batch, its header)``: the header as ``read_header`` would decode it, without decoding it
    (a writer needs both, on every append's path).

    The batch holds ``records`` (numbered from ``base_offset``) and ``attribute_updates``.

    ``records`` items are bytes-like values or ``Record``s; a record without a timestamp gets
    ``timestamp``; a ``Record`` whose value is ``None`` is a tombstone and must have a key.
    ``attribute_updates`` is ``(keys, values)``: 16-byte keys and int64 values, ``None`` meaning
    "remove". Either may be empty. ``batch_id`` (an unsigned 64-bit int; default a fresh random
    one) identifies the append call: give every encoding of one call the same id. The header is
    sealed for segment byte ``position`` (``place_batches`` seals it for another).
    """
    codec = codec_for(codec)
    _check_position(position)
    batch_id = new_batch_id() if batch_id is None else _check_batch_id(batch_id)
    if type(base_offset) is not int or base_offset < 0:
        raise InvalidInputError(f"base_offset must be an int >= 0, got {base_offset!r}")
    timestamp = _check_i64(timestamp, "timestamp")
    if isinstance(records, (bytes, bytearray, memoryview, str)):
        raise InvalidInputError("records must be a sequence of values or Records, not a single value")
    if not isinstance(records, (list, tuple)):
        try:
            records = list(records)
        except TypeError:
            raise InvalidInputError(f"records must be a sequence, got {type(records).__name__}") from None
    count = len(records)
    if count > MAX_RECORDS:
        raise InvalidInputError(f"a batch holds at most {MAX_RECORDS} records, got {count}")
    if base_offset + count > _I64_MAX:
        raise InvalidInputError(
            f"offsets from {base_offset} for {count} records exceed the signed 64-bit range "
            "(the next offset must fit too)"
        )

    flags = int(codec)
    keys = stamps = headers = tombstones = None
    values = records
    crc = total = 0
    lengths_column = b""
    if count:
        # Fast path: plain bytes-like values. join and crc32 refuse non-buffers (Records, str,
        # ints), and the byte total catches memoryviews whose len() is not their byte count.
        try:
            lengths = list(map(len, records))
            expected = sum(lengths)
            lengths_column = encode_lengths(lengths)
            values = list(records)
            crc, total = _checksum_values(values, lengths_column, expected)
        except (TypeError, BufferError):
            expected, total = 0, -1
        if total != expected:
            values, keys, stamps, headers, tombstones = _normalize(records, timestamp)
            lengths = list(map(len, values))
            lengths_column = encode_lengths(lengths)
            crc, total = _checksum_values(values, lengths_column, sum(lengths))
        total += len(lengths_column)
    parts: list = []  # the payload after the values
    first_ts = max_ts = timestamp
    if stamps is not None:
        first_ts, max_ts = stamps[0], max(stamps)
        if stamps.count(first_ts) == count:
            stamps = None
    if keys is not None:
        flags |= FLAG_KEYS
        parts.append(encode_lengths([0 if k is None else len(k) + 1 for k in keys]))
        parts.append(b"".join([k for k in keys if k is not None]))
    if stamps is not None:
        flags |= FLAG_TIMESTAMPS
        deltas = []
        for t in stamps:
            d = t - first_ts
            if not _I64_MIN <= d <= _I64_MAX:  # wrap to int64; the reader wraps back
                d = ((d - _I64_MIN) & _U64_MASK) + _I64_MIN
            deltas.append((d << 1) ^ (d >> 63))
        parts.append(encode_lengths(deltas))
    if headers is not None:
        flags |= FLAG_HEADERS
        pairs = [pair for record_headers in headers for pair in record_headers]
        names = [name.encode("utf-8") for name, _ in pairs]
        header_values = [value for _, value in pairs]
        parts.append(encode_lengths(list(map(len, headers))))
        parts.append(encode_lengths(list(map(len, names))))
        parts.append(encode_lengths(list(map(len, header_values))))
        parts.append(b"".join(names))
        parts.append(b"".join(header_values))
    if tombstones is not None:
        flags |= FLAG_TOMBSTONES
        parts.append(bytes(tombstones))
    update_count, update_parts = encode_updates(attribute_updates)
    parts.extend(update_parts)

    pieces = [lengths_column, *values, *parts] if count else parts
    if codec == Codec.NONE:
        # no intermediate payload object: the pieces are copied once, into the batch itself
        for part in parts:
            crc = checksum.crc32(part, crc)
            total += len(part)
        payload_size = stored_size = total
    else:
        payload = b"".join(pieces)
        payload_size = len(payload)
        pieces = [compress_payload(codec, payload)]
        stored_size = len(pieces[0])
        crc = checksum.crc32(pieces[0])
    size = BATCH_HEADER_SIZE + stored_size
    if payload_size > _U32_MAX or size > _U32_MAX:
        raise InvalidInputError(f"a batch must stay below 4 GiB, this one would be {max(size, payload_size)} bytes")
    header = HEADER_STRUCT.pack(
        BATCH_MAGIC, BATCH_VERSION, flags, size, count, update_count, payload_size,
        base_offset, first_ts, max_ts, batch_id, crc, 0,
    )[:_CHECKED_HEADER]
    data = b"".join([header, _U32.pack(checksum.crc32(header, checksum.crc32(_U64.pack(position)))), *pieces])
    return data, BatchHeader(size, base_offset, count, update_count, first_ts, max_ts, codec, payload_size, crc, flags,
                             batch_id)


# Batch ids come from a generator of this module's own (a caller seeding ``random`` cannot make
# them repeat), seeded from the OS and seeded afresh in every forked child, so that processes
# never share a sequence; drawing one is no system call (it is on every append's path).
_batch_ids = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_batch_ids.seed)


def new_batch_id() -> int:
    """A random unsigned 64-bit batch id (the generator is seeded from the OS in every process,
    forked ones included, so processes never share one)."""
    return _batch_ids.getrandbits(64)


def _check_batch_id(batch_id) -> int:
    if type(batch_id) is not int or not 0 <= batch_id <= _U64_MASK:
        raise InvalidInputError(f"batch_id must be an int in [0, 2**64), got {batch_id!r}")
    return batch_id


def rebase_batch(data: bytes, base_offset: int, batch_id: int | None = None, *, position: int = 0) -> bytes:
    """``data`` (a batch from ``encode_batch``) renumbered from ``base_offset``: only the header's
    base offset and checksum change (the batch id stays, unless ``batch_id`` is given), so a
    writer that lost an append race resends without encoding the records again. The header is
    sealed for ``position``."""
    _check_position(position)
    if type(base_offset) is not int or not 0 <= base_offset <= _I64_MAX - max(0, HEADER_STRUCT.unpack_from(data)[4]):
        raise InvalidInputError(f"base_offset must be an int >= 0 leaving room for the batch, got {base_offset!r}")
    header = bytearray(data[:_CHECKED_HEADER])
    struct.pack_into("<q", header, 24, base_offset)
    if batch_id is not None:
        struct.pack_into("<Q", header, 48, _check_batch_id(batch_id))
    return b"".join([seal_header(header, position), memoryview(data)[BATCH_HEADER_SIZE:]])


# ---------------------------------------------------------------------------------- placement


def _check_position(position) -> None:
    if type(position) is not int or not 0 <= position <= _U64_MASK:
        raise InvalidInputError(f"position must be an int in [0, 2**64), got {position!r:.60}")


def _check_span(position, n: int) -> None:
    if type(position) is not int or not 0 <= position <= _U64_MASK - n:
        raise InvalidInputError(f"position must be an int in [0, 2**64 - {n}) for {n} bytes, got {position!r:.60}")


def seal_header(head, position: int) -> bytes:
    """The 64-byte header made of ``head`` (the first 60 bytes of a header) and their checksum
    seeded with ``position``: the CRC-32 of ``position`` as a little-endian u64, continued over
    ``head``. Such a header is valid at segment byte ``position`` only."""
    head = bytes(head[:_CHECKED_HEADER])
    return head + _U32.pack(checksum.crc32(head, checksum.crc32(_U64.pack(position))))


def place_batches(data, position: int) -> bytes:
    """``data`` (one or more whole batches back to back) as stored at segment byte ``position``:
    each header's checksum seeded with where that batch lands (``position`` plus its place in
    ``data``); nothing else changes. ``data`` itself comes back (no copy) when every header is
    sealed for its place already.

    The headers may have been sealed for any position, so their old checksums cannot be checked:
    only their magic, version and sizes are (``InvalidInputError``). Place batches that were just
    encoded, or read and verified; stored bytes are checked with ``read_header``.
    """
    n = len(data)
    _check_span(position, n)
    if type(data) is bytes and n >= BATCH_HEADER_SIZE:  # one batch (the usual append): no loop, no view
        magic, version, _flags, size = _PREFIX.unpack_from(data)
        if size == n and magic == BATCH_MAGIC and version == BATCH_VERSION:
            crc = checksum.crc32(data[:_CHECKED_HEADER], checksum.crc32(_U64.pack(position)))
            if crc == _U32.unpack_from(data, _CHECKED_HEADER)[0]:
                return data
            return b"".join([data[:_CHECKED_HEADER], _U32.pack(crc), data[BATCH_HEADER_SIZE:]])
    crc32, pack, view = checksum.crc32, _U64.pack, memoryview(data)
    at, moved = 0, []
    while at < n:
        if n - at < BATCH_HEADER_SIZE:
            raise InvalidInputError(f"place_batches: the {n - at} bytes at {at} are not a whole batch")
        magic, version, _flags, size = _PREFIX.unpack_from(data, at)
        if magic != BATCH_MAGIC or version != BATCH_VERSION or not BATCH_HEADER_SIZE <= size <= n - at:
            raise InvalidInputError(f"place_batches: the bytes at {at} are not a whole version {BATCH_VERSION} "
                                    f"batch (magic {magic!r}, version {version}, size {size}, {n - at} bytes left)")
        crc = crc32(view[at:at + _CHECKED_HEADER], crc32(pack(position + at)))
        if crc != _U32.unpack_from(data, at + _CHECKED_HEADER)[0]:
            moved.append((at, crc))
        at += size
    if not moved:
        return data if type(data) is bytes else bytes(data)
    pieces, done = [], 0
    for at, crc in moved:
        pieces += [view[done:at + _CHECKED_HEADER], _U32.pack(crc)]
        done = at + BATCH_HEADER_SIZE
    pieces.append(view[done:])
    return b"".join(pieces)


_CHUNK_BYTES = 32768


def _checksum_values(values, lengths_column: bytes, expected: int) -> tuple[int, int]:
    """CRC-32 of ``lengths_column`` followed by all ``values``, and the values' byte count.

    Values are joined a few dozen kilobytes at a time: one big intermediate buffer next to the
    batch itself makes glibc trim and re-fault the heap on every call, which costs more than the
    copy. ``expected`` (the values' total ``len()``) only sizes the chunks. Raises TypeError or
    BufferError for a value that is not a contiguous buffer.
    """
    crc = checksum.crc32(lengths_column)
    total = 0
    n = len(values)
    step = max(1, (_CHUNK_BYTES * n) // max(1, expected))
    if step == 1:
        for value in values:
            view = memoryview(value)
            crc = checksum.crc32(view, crc)
            total += view.nbytes
        return crc, total
    chunks = []
    for i in range(0, n, step):
        chunk = b"".join(values[i : i + step])
        crc = checksum.crc32(chunk, crc)
        total += len(chunk)
        chunks.append(chunk)
    values[:] = chunks  # the batch is then assembled from these few chunks
    return crc, total


# ------------------------------------------------------------------------------------- decoding


def corruption_at(segment: str | None, offset: int):
    """``corrupt(what)``: the ``CorruptDataError`` for a batch of ``segment`` at log byte ``offset``."""
    where = f"segment {segment!r}: " if segment is not None else ""

    def corrupt(what: str) -> CorruptDataError:
        return CorruptDataError(f"{where}record batch at offset {offset}: {what}", segment=segment, offset=offset)

    return corrupt


def read_header(buf, pos: int = 0, *, position: int = 0, segment: str | None = None,
                partial: bool = False) -> BatchHeader | None:
    """The header of the batch at ``buf[pos]``, or None if that batch is not all in ``buf`` yet
    (with ``partial``, only the header must be: for callers that need just its fields).

    ``position`` is the segment byte position of ``buf[0]``: the header checksum is seeded with
    ``position + pos``, so a batch sealed for another position is invalid here. Raises
    ``CorruptDataError`` (offset ``position + pos``) when the bytes there are not a batch header:
    a wrong magic or version, a checksum mismatch (damage, or a batch not written at this
    position) or impossible fields. Fewer than a header's worth of bytes count as incomplete only
    if they start like the magic (a torn header always does), so short garbage at the end of a log
    is reported too.
    """
    if pos < 0:
        raise InvalidInputError(f"position must be >= 0, got {pos}")
    available = len(buf) - pos
    if available < BATCH_HEADER_SIZE:
        if available > 0:
            start = bytes(buf[pos : pos + min(available, len(BATCH_MAGIC))])
            if not BATCH_MAGIC.startswith(start):
                raise corruption_at(segment, position + pos)(f"bad magic {start!r} in a {available}-byte tail")
        return None
    (magic, version, flags, size, count, update_count, payload_size,
     base_offset, first_ts, max_ts, batch_id, payload_crc, header_crc) = HEADER_STRUCT.unpack_from(buf, pos)
    if magic != BATCH_MAGIC:
        raise corruption_at(segment, position + pos)(f"bad magic {magic!r}")
    if version != BATCH_VERSION:  # before the checksum, which older versions seeded differently
        raise corruption_at(segment, position + pos)(_version_problem(version))
    if type(position) is not int or position < 0:
        raise InvalidInputError(f"position must be an int >= 0, got {position!r:.60}")
    seed = checksum.crc32(_U64.pack(position + pos))
    if checksum.crc32(memoryview(buf)[pos : pos + _CHECKED_HEADER], seed) != header_crc:
        raise corruption_at(segment, position + pos)(
            f"header checksum mismatch (damaged bytes, or a batch not written at byte {position + pos})")
    problem = _header_problem(version, flags, size, count, update_count, payload_size, base_offset, first_ts, max_ts)
    if problem:
        raise corruption_at(segment, position + pos)(problem)
    if size > available and not partial:
        return None
    codec = Codec(flags & _CODEC_MASK)
    return BatchHeader(
        size, base_offset, count, update_count, first_ts, max_ts, codec, payload_size, payload_crc, flags, batch_id
    )


def peek_header(buf, pos: int = 0) -> BatchHeader:
    """The header of the whole batch at ``buf[pos]`` whatever position it is sealed for: its
    fields are checked (``InvalidInputError``), its checksum is not. For batches held in memory
    between a checked read (or their encoding) and their placement, such as the pieces a cleaner
    moves; bytes read from storage are checked with ``read_header``."""
    if pos < 0 or len(buf) - pos < BATCH_HEADER_SIZE:
        raise InvalidInputError(f"peek_header: no whole batch header at {pos} in {len(buf)} bytes")
    (magic, version, flags, size, count, update_count, payload_size,
     base_offset, first_ts, max_ts, batch_id, payload_crc, _crc) = HEADER_STRUCT.unpack_from(buf, pos)
    problem = (f"bad magic {magic!r}" if magic != BATCH_MAGIC else
               _header_problem(version, flags, size, count, update_count, payload_size, base_offset, first_ts, max_ts))
    if not problem and size > len(buf) - pos:
        problem = f"the batch of {size} bytes is not all in the buffer"
    if problem:
        raise InvalidInputError(f"peek_header: the bytes at {pos} are not a whole batch: {problem}")
    return BatchHeader(size, base_offset, count, update_count, first_ts, max_ts, Codec(flags & _CODEC_MASK),
                       payload_size, payload_crc, flags, batch_id)


def _version_problem(version: int) -> str:
    if 0 < version < BATCH_VERSION:
        return (f"format version {version}, written by a development version before 0.1.0: this attrindex reads "
                f"format version {BATCH_VERSION} only (there is no migration)")
    return f"unknown format version {version} (this attrindex reads format version {BATCH_VERSION})"


def claimed_size(buf, pos: int = 0) -> int | None:
    """The size field of the batch header at ``buf[pos]`` checked against nothing but the magic:
    what a header that fails its checksum still claims (None without the magic or a whole header)."""
    if len(buf) - pos < BATCH_HEADER_SIZE or bytes(buf[pos:pos + len(BATCH_MAGIC)]) != BATCH_MAGIC:
        return None
    return HEADER_STRUCT.unpack_from(buf, pos)[3]


def _header_problem(version, flags, size, count, update_count, payload_size, base_offset, first_ts, max_ts) -> str:
    if version != BATCH_VERSION:
        return _version_problem(version)
    if flags & ~_KNOWN_FLAGS or (flags & _CODEC_MASK) > _MAX_CODEC:
        return f"unknown flags {flags:#x}"
    if size < BATCH_HEADER_SIZE:
        return f"size {size} is smaller than the {BATCH_HEADER_SIZE}-byte header"
    if count > MAX_RECORDS:
        return f"record count {count} is above the limit {MAX_RECORDS}"
    if base_offset < 0 or base_offset + count > _I64_MAX:
        return f"base offset {base_offset} with {count} records is out of range"
    if max_ts < first_ts:
        return f"max timestamp {max_ts} is below the first timestamp {first_ts}"
    columns = (bool(flags & FLAG_KEYS) + bool(flags & FLAG_TIMESTAMPS) + bool(flags & FLAG_HEADERS)
               + bool(flags & FLAG_TOMBSTONES))
    if count == 0 and columns:
        return "optional record columns are flagged in a batch without records"
    if flags & FLAG_TOMBSTONES and not flags & FLAG_KEYS:
        return "a batch with tombstones has no keys column (a tombstone needs a key)"
    if not flags & FLAG_TIMESTAMPS and max_ts != first_ts:
        return "timestamps differ but the batch has no timestamp column"
    smallest = count * (1 + columns) + UPDATE_SIZE * update_count  # a varint per record and column
    if payload_size < smallest or (count == 0 and payload_size != smallest):
        return f"payload of {payload_size} bytes cannot hold {count} records and {update_count} attribute updates"
    if flags & _CODEC_MASK == Codec.NONE and size - BATCH_HEADER_SIZE != payload_size:
        return f"uncompressed payload of {size - BATCH_HEADER_SIZE} bytes, but the header says {payload_size}"
    return ""


def check_batch(buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None) -> None:
    """Verify the payload checksum of the batch at ``buf[pos]`` whose header is ``header``."""
    end = pos + header.size
    if pos < 0 or end > len(buf):
        raise InvalidInputError(f"the batch at {pos} ({header.size} bytes) is not all in the buffer")
    if checksum.crc32(memoryview(buf)[pos + BATCH_HEADER_SIZE : end]) != header.payload_crc:
        raise corruption_at(segment, position + pos)("payload checksum mismatch")


def iter_batches(
    buf, pos: int = 0, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> Iterator[tuple[int, BatchHeader]]:
    """Yield ``(pos, header)`` for each complete batch from ``buf[pos]``; stop at an incomplete tail.

    Raises ``CorruptDataError`` at the first invalid batch (with ``verify``, payload checksums too).
    """
    while True:
        header = read_header(buf, pos, position=position, segment=segment)
        if header is None:
            return
        if verify:
            check_batch(buf, pos, header, position=position, segment=segment)
        yield pos, header
        pos += header.size


def chain_end(data, position: int) -> int:
    """The segment byte position where the chain of whole, valid batches from ``data[0]`` (which
    lies at segment byte ``position``) ends: ``position`` itself when the first is not one.

    A batch counts when its magic and version are right, its header checksum holds for the byte
    it lies at (seeded with that position), its size is at least a header and all its bytes are
    there, and its payload checksum holds; the chain stops at the first that is not, whatever the
    bytes (zeros are never a batch). Torn writes, stale bytes and batches written for another
    position fail these; the other header fields are left to the readers (``read_header``), so a
    batch whose checksums hold but whose fields do not is reported as damage where it is read,
    never cut as a torn tail. Never raises for any bytes."""
    n = len(data)
    _check_span(position, n)
    view = memoryview(data)
    crc32, pack, unpack = checksum.crc32, _U64.pack, _FRAME.unpack_from
    at = 0
    while n - at >= BATCH_HEADER_SIZE:  # bounded: ``at`` moves by a size of at least a header
        magic, version, size, payload_crc, header_crc = unpack(data, at)
        if (magic != BATCH_MAGIC or version != BATCH_VERSION or not BATCH_HEADER_SIZE <= size <= n - at
                or crc32(view[at:at + _CHECKED_HEADER], crc32(pack(position + at))) != header_crc
                or crc32(view[at + BATCH_HEADER_SIZE:at + size]) != payload_crc):
            break
        at += size
    return position + at


def last_batch_end(data, position: int) -> int | None:
    """The segment byte position where the last whole, valid batch anywhere in ``data`` (which
    starts at segment byte ``position``) ends, or ``None`` when there is none: each occurrence of
    the magic is tried from the last one back, as ``chain_end`` checks a batch, for the byte it
    lies at. Never raises for any bytes."""
    _check_span(position, len(data))
    data = data if type(data) is bytes else bytes(data)
    view = memoryview(data)
    at = data.rfind(BATCH_MAGIC)
    while at >= 0:  # bounded: every lap moves ``at`` back
        # A valid batch found later would have been returned: the chain from here holds one at most.
        end = chain_end(view[at:], position + at)
        if end > position + at:
            return end
        at = data.rfind(BATCH_MAGIC, 0, at)
    return None


def batch_payload(buf, pos, header, corrupt, verify) -> tuple[bytes, int, int]:
    """The uncompressed payload as ``(data, start, end)``: ``data[start:end]`` (bytes, maybe ``buf``)."""
    end = pos + header.size
    if pos < 0 or end > len(buf):
        raise InvalidInputError(f"the batch at {pos} ({header.size} bytes) is not all in the buffer")
    start = pos + BATCH_HEADER_SIZE
    if verify and checksum.crc32(memoryview(buf)[start:end]) != header.payload_crc:
        raise corrupt("payload checksum mismatch")
    if header.codec == Codec.NONE:
        if header.payload_size != end - start:
            raise corrupt(f"uncompressed payload of {end - start} bytes, but the header says {header.payload_size}")
        if type(buf) is bytes:
            return buf, start, end
        return bytes(buf[start:end]), 0, end - start
    data = _decompress(header.codec, memoryview(buf)[start:end], header.payload_size, corrupt)
    return data, 0, len(data)


def _varints(data, at: int, count: int, limit: int, corrupt, what: str) -> tuple[list[int], int]:
    try:
        values, at = decode_varints(data, at, count)
    except CorruptDataError as exc:  # VarintError: truncated or overflowing
        raise corrupt(f"{what}: {exc}") from None
    if at > limit:
        raise corrupt(f"{what} run past the end of the records section")
    return values, at


def _bounds(lengths: list[int], at: int, limit: int, corrupt, what: str) -> list[int]:
    bounds = list(itertools.accumulate(lengths, initial=at))
    if bounds[-1] > limit:
        raise corrupt(f"{what} add up to {bounds[-1] - at} bytes, more than the payload holds")
    return bounds


class _Layout:
    """Where each column of a payload lies, after strict length checks (no values materialized).

    A blob column is its lengths and the bounds of its pieces (``len(lengths) + 1`` positions).
    """

    __slots__ = ("value_lengths", "value_bounds", "key_codes", "key_lengths", "key_bounds", "deltas",
                 "header_counts", "name_lengths", "name_bounds", "header_value_lengths",
                 "header_value_bounds", "tombstones", "updates_at")


def _layout(data, start: int, end: int, header: BatchHeader, corrupt) -> _Layout:
    count, flags = header.record_count, header.flags
    layout = _Layout()
    updates_at = end - UPDATE_SIZE * header.attribute_count
    if updates_at < start:
        raise corrupt("payload is too short for its attribute updates")
    layout.updates_at = updates_at
    layout.key_codes = layout.deltas = layout.header_counts = layout.tombstones = None
    at = start
    lengths, at = _varints(data, at, count, updates_at, corrupt, "value lengths")
    layout.value_lengths = lengths
    layout.value_bounds = bounds = _bounds(lengths, at, updates_at, corrupt, "value lengths")
    at = bounds[-1]
    if flags & FLAG_KEYS:
        codes, at = _varints(data, at, count, updates_at, corrupt, "key lengths")
        layout.key_codes = codes
        # key length + 1 (0: no key); subtracted in C when every record has a key
        layout.key_lengths = lengths = (list(map((1).__rsub__, codes)) if 0 not in codes
                                        else [c - 1 if c else 0 for c in codes])
        layout.key_bounds = bounds = _bounds(lengths, at, updates_at, corrupt, "key lengths")
        at = bounds[-1]
    if flags & FLAG_TIMESTAMPS:
        layout.deltas, at = _varints(data, at, count, updates_at, corrupt, "timestamp deltas")
    if flags & FLAG_HEADERS:
        counts, at = _varints(data, at, count, updates_at, corrupt, "header counts")
        total = sum(counts)
        if 2 * total > updates_at - at:  # each header takes at least two length bytes
            raise corrupt(f"{total} headers cannot fit in the payload")
        layout.header_counts = counts
        layout.name_lengths, at = _varints(data, at, total, updates_at, corrupt, "header name lengths")
        layout.header_value_lengths, at = _varints(data, at, total, updates_at, corrupt, "header value lengths")
        layout.name_bounds = bounds = _bounds(layout.name_lengths, at, updates_at, corrupt, "header name lengths")
        layout.header_value_bounds = bounds = _bounds(
            layout.header_value_lengths, bounds[-1], updates_at, corrupt, "header value lengths"
        )
        at = bounds[-1]
    if flags & FLAG_TOMBSTONES:
        at = _tombstone_column(data, at, updates_at, layout, corrupt)
    if at != updates_at:
        raise corrupt(f"{updates_at - at} unexpected bytes after the record columns")
    return layout


def _tombstone_column(data, at: int, limit: int, layout: _Layout, corrupt) -> int:
    """Read the tombstone flags (one byte per record) at ``at``; return the position after them."""
    count = len(layout.value_lengths)
    flags = bytes(data[at : at + count])
    if at + count > limit:
        raise corrupt("the tombstones column runs past the end of the records section")
    if flags.translate(None, b"\x00\x01"):
        raise corrupt("a tombstone flag is neither 0 nor 1")
    for i in itertools.compress(range(count), flags):
        if layout.value_lengths[i] or not layout.key_codes[i]:
            raise corrupt(f"tombstone {i} has a value or no key")
    layout.tombstones = flags
    return at + count


_CUT_RUN = 1024  # pieces per precompiled struct when cutting equal-length pieces


@functools.lru_cache(maxsize=64)
def _equal_pieces(length: int, count: int) -> struct.Struct:
    return struct.Struct(f"{length}s" * count)


def _cut(data, at: int, length: int, count: int) -> list[bytes]:
    """``count`` consecutive pieces of ``length`` bytes from ``data[at]``, cut in C by struct."""
    if count <= _CUT_RUN:
        return list(_equal_pieces(length, count).unpack_from(data, at))
    out: list[bytes] = []
    run = _equal_pieces(length, _CUT_RUN)
    step = length * _CUT_RUN
    full, rest = divmod(count, _CUT_RUN)
    for _ in range(full):
        out.extend(run.unpack_from(data, at))
        at += step
    if rest:
        out.extend(_equal_pieces(length, rest).unpack_from(data, at))
    return out


def _slices(data, bounds: list[int], lengths: list[int]) -> list[bytes]:
    """``data[bounds[i]:bounds[i + 1]]`` for each ``i`` (``lengths[i]`` bytes), as bytes."""
    count = len(lengths)
    if count > 1 and lengths.count(lengths[0]) == count:
        return _cut(data, bounds[0], lengths[0], count)
    return list(map(data.__getitem__, map(slice, bounds, itertools.islice(bounds, 1, None))))


def decode_records(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> list[Record]:
    """The records of the batch at ``buf[pos]``, with offsets, timestamps, keys and headers filled in.

    With ``verify`` (the default) the payload checksum is checked first. Any inconsistency in the
    payload is a ``CorruptDataError`` naming ``position + pos``.
    """
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    layout = _layout(data, start, end, header, corrupt)
    count = header.record_count
    if not count:
        return []
    values = _slices(data, layout.value_bounds, layout.value_lengths)
    keys = itertools.repeat(None)
    if layout.key_codes is not None:
        pieces = _slices(data, layout.key_bounds, layout.key_lengths)
        keys = [k if c else None for k, c in zip(pieces, layout.key_codes)]
    stamps = itertools.repeat(header.first_timestamp)
    if layout.deltas is not None:
        stamps = _timestamps(layout.deltas, header, corrupt)
    headers = itertools.repeat(())
    if layout.header_counts is not None:
        headers = _headers(data, layout, corrupt)
    if layout.tombstones is not None:
        values = [None if dead else v for v, dead in zip(values, layout.tombstones)]
    base = header.base_offset
    rows = zip(values, keys, stamps, headers, range(base, base + count))
    return list(map(tuple.__new__, itertools.repeat(Record), rows))


def decode_keys(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> tuple[list[bytes | None], bytes | None]:
    """``(keys, tombstone flags)`` of the batch at ``buf[pos]``, without materializing values:
    what the log cleaner needs to decide which records survive. ``keys`` has one entry per record
    (``None`` for a keyless one); the flags are one byte per record (``None``: no tombstones)."""
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    layout = _layout(data, start, end, header, corrupt)
    if layout.key_codes is None:
        return [None] * header.record_count, None
    pieces = _slices(data, layout.key_bounds, layout.key_lengths) if header.record_count else []
    if 0 in layout.key_codes:
        pieces = [k if c else None for k, c in zip(pieces, layout.key_codes)]
    return pieces, layout.tombstones


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]


def uniform_keys(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> tuple[list[bytes], bytes | None] | None:
    """``decode_keys`` for the common shape, in a few C-level calls: every record has a key and
    every key has the same length (the key-lengths column is one repeated byte), and there is no
    headers column. Returns what ``decode_keys`` would, or ``None`` for any other shape (mixed key
    widths, keyless records, headers, or bytes the strict decoder must judge): the caller then
    uses ``decode_keys``, which decodes every column and names any inconsistency.

    Checked here, in bulk: the value-lengths column (one repeated byte: its total is ``n * len``;
    else decoded and summed), the key-lengths column, the timestamp column's varints, the
    tombstone column's flags, and that the columns end exactly where the attribute updates start.
    """
    n, flags = header.record_count, header.flags
    if not n or not flags & FLAG_KEYS or flags & FLAG_HEADERS:
        return None
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    updates_at = end - UPDATE_SIZE * header.attribute_count
    if start + 2 * n > updates_at:
        return None
    first = data[start]
    if first < 0x80 and data.count(_ONE_BYTE[first], start, start + n) == n:
        lengths = None
        at = start + n + n * first  # every value length is ``first``: no varint decoding
    else:
        lengths, at = _varints(data, start, n, updates_at, corrupt, "value lengths")
        at += sum(lengths)
    if at + n > updates_at:
        return None
    code = data[at]  # key length + 1 (0: no key)
    if not 0 < code < 0x80 or data.count(_ONE_BYTE[code], at, at + n) != n:
        return None  # keyless records or mixed widths: the general path
    width = code - 1
    keys_at, at = at + n, at + n + n * width
    if flags & FLAG_TIMESTAMPS:
        if at > updates_at:
            return None
        _deltas, at = _varints(data, at, n, updates_at, corrupt, "timestamp deltas")
    tombstones = None
    if flags & FLAG_TOMBSTONES:
        tombstones = bytes(data[at:at + n])
        at += n
        if tombstones.translate(None, b"\x00\x01"):
            return None  # a flag that is neither 0 nor 1
        if 1 in tombstones and (first if lengths is None else any(itertools.compress(lengths, tombstones))):
            return None  # a tombstone with a value
    if at != updates_at:
        return None
    keys = _cut(data, keys_at, width, n) if width else [b""] * n
    return keys, tombstones


class BatchColumns:
    """The columns of one batch, located and checked (as ``decode_records`` checks them) but not
    cut into records: what the log cleaner needs to re-encode runs of surviving records without
    building a ``Record`` per record. Made by ``batch_columns``."""

    __slots__ = ("header", "data", "layout", "stamps")

    def __init__(self, header: BatchHeader, data, layout: _Layout, stamps: list[int] | None):
        self.header, self.data, self.layout, self.stamps = header, data, layout, stamps

    @property
    def has_headers(self) -> bool:
        return self.layout.header_counts is not None

    def record_sizes(self) -> list[int]:
        """Bytes of each record's value and key (a tombstone's value and a missing key count 0)."""
        layout = self.layout
        if layout.key_codes is None:
            return layout.value_lengths
        return list(map(operator.add, layout.value_lengths, layout.key_lengths))

    def encode_runs(self, runs: list[tuple[int, int]]) -> list[bytes]:
        """For each ``(start, stop)``, the batch ``encode_batch`` makes of records ``start..stop-1``
        (their offsets, timestamps, keys, tombstones; this batch's codec and batch id; no attribute
        updates), byte for byte, built from column slices, sealed for position 0 (``place_batches``
        seals them for where they land). Not for batches with headers."""
        if self.has_headers:
            raise InvalidInputError("encode_runs does not re-encode batches with a headers column")
        header, data, layout, stamps = self.header, self.data, self.layout, self.stamps
        value_lengths, value_bounds = layout.value_lengths, layout.value_bounds
        codes, tombstones = layout.key_codes, layout.tombstones
        key_bounds = layout.key_bounds if codes is not None else None  # unset without a keys column
        codec = header.codec
        out = []
        for a, b in runs:
            if not 0 <= a < b <= header.record_count:
                raise InvalidInputError(f"run [{a}, {b}) is not within the batch's {header.record_count} records")
            flags = int(codec)
            parts = [encode_lengths(value_lengths[a:b]), data[value_bounds[a]:value_bounds[b]]]
            if codes is not None and any(codes[a:b]):
                flags |= FLAG_KEYS
                parts += [encode_lengths(codes[a:b]), data[key_bounds[a]:key_bounds[b]]]
            first_ts = max_ts = header.first_timestamp
            if stamps is not None:
                run = stamps[a:b]
                first_ts, max_ts = run[0], max(run)
                if run.count(first_ts) != b - a:
                    flags |= FLAG_TIMESTAMPS
                    parts.append(encode_lengths([_zigzag_delta(t, first_ts) for t in run]))
            if tombstones is not None and 1 in tombstones[a:b]:
                flags |= FLAG_TOMBSTONES
                parts.append(tombstones[a:b])
            payload = b"".join(parts)
            stored = payload if codec == Codec.NONE else compress_payload(codec, payload)
            head = HEADER_STRUCT.pack(
                BATCH_MAGIC, BATCH_VERSION, flags, BATCH_HEADER_SIZE + len(stored), b - a, 0, len(payload),
                header.base_offset + a, first_ts, max_ts, header.batch_id, checksum.crc32(stored), 0,
            )[:_CHECKED_HEADER]
            out.append(b"".join([seal_header(head, 0), stored]))
        return out


def _zigzag_delta(t: int, first: int) -> int:
    """The timestamp column's entry for ``t`` (as ``encode_batch`` writes it)."""
    d = t - first
    if not _I64_MIN <= d <= _I64_MAX:  # wrap to int64; the reader wraps back
        d = ((d - _I64_MIN) & _U64_MASK) + _I64_MIN
    return (d << 1) ^ (d >> 63)


def batch_columns(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> BatchColumns:
    """The columns of the batch at ``buf[pos]`` (see ``BatchColumns``), checked as strictly as
    ``decode_records`` checks them: any inconsistency is a ``CorruptDataError``."""
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    layout = _layout(data, start, end, header, corrupt)
    stamps = _timestamps(layout.deltas, header, corrupt) if layout.deltas is not None else None
    if layout.header_counts is not None:
        _headers(data, layout, corrupt)  # names must be UTF-8, as decode_records requires
    return BatchColumns(header, data, layout, stamps)


def _timestamps(deltas: list[int], header: BatchHeader, corrupt) -> list[int]:
    first = header.first_timestamp
    stamps = [first + ((u >> 1) ^ -(u & 1)) for u in deltas]
    if min(stamps) < _I64_MIN or max(stamps) > _I64_MAX:
        stamps = [((t - _I64_MIN) & _U64_MASK) + _I64_MIN for t in stamps]
    if deltas[0] != 0 or max(stamps) != header.max_timestamp:
        raise corrupt("timestamp column disagrees with the header's first and max timestamps")
    return stamps


def _headers(data, layout: _Layout, corrupt) -> list[tuple]:
    raw_names = _slices(data, layout.name_bounds, layout.name_lengths)
    try:
        names = [name.decode("utf-8") for name in raw_names]
    except UnicodeDecodeError as exc:
        raise corrupt(f"a header name is not UTF-8: {exc}") from None
    pairs = list(zip(names, _slices(data, layout.header_value_bounds, layout.header_value_lengths)))
    bounds = list(itertools.accumulate(layout.header_counts, initial=0))
    return [tuple(pairs[a:b]) if a != b else () for a, b in zip(bounds, itertools.islice(bounds, 1, None))]


def decode_attribute_updates(
    buf, pos: int, header: BatchHeader, *, position: int = 0, segment: str | None = None, verify: bool = True
) -> tuple[list[bytes], list[int | None]]:
    """The attribute updates of the batch at ``buf[pos]``: ``(keys, values)``, None meaning removed.

    The record columns are length-checked too (not materialized), so a batch is either valid for
    every reader or ``CorruptDataError`` for all of them.
    """
    n = header.attribute_count
    corrupt = corruption_at(segment, position + pos)
    data, start, end = batch_payload(buf, pos, header, corrupt, verify)
    at = _layout(data, start, end, header, corrupt).updates_at
    if not n:
        return [], []
    keys = _cut(data, at, KEY_SIZE, n)
    at += KEY_SIZE * n
    column = array.array("q")
    column.frombytes(data[at : at + 8 * n])
    if _BIG_ENDIAN:
        column.byteswap()
    values: list[int | None] = column.tolist()
    removed = data[at + 8 * n : at + 9 * n]
    if removed.count(0) != n:
        if removed.translate(None, b"\x00\x01"):
            raise corrupt("an attribute update's removed flag is neither 0 nor 1")
        for i in itertools.compress(range(n), removed):
            if values[i]:
                raise corrupt(f"removed attribute update {i} carries a value")
            values[i] = None
    return keys, values
