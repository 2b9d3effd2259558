"""The payload codecs of a record batch: which exist, which are installed, compressing a payload
and decompressing one strictly (never past the length its header declares). No I/O."""

from __future__ import annotations

import enum
import zlib

from ...errors import CorruptDataError, InvalidInputError, MissingDependencyError

__all__ = ["Codec", "available_codecs", "codec_for", "compress_payload", "decompress_payload"]


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


def decompress_payload(codec: Codec, data, expected: int, corrupt) -> bytes:
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
