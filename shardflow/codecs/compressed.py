"""Field-level compression (``x.txt.gz``, ``x.npy.zst``, ``x.json.xz``), undone with a cap.

A compressed field is as untrusted as a compressed shard: 10 KB of gzip (or two layers of
it, ``k.txt.gz.gz``) can hold gigabytes. Its bytes are therefore decompressed as a stream,
in pieces of at most 4 MiB, into one buffer that may not grow past

    min(Limits.max_member_bytes, max(compressed bytes, MIN_CAP_BASE) * Limits.max_compression_ratio)

the same :class:`~shardflow.format.limits.Limits` that bound tar members, counted from the
field's stored bytes through every layer. Past the cap the field is a :class:`DecodeError`
(reason ``field_too_large``) naming the option; damaged or cut data is a :class:`DecodeError`
(reason ``decode``). Both are skippable under ``on_error="skip"``.
"""

from __future__ import annotations

import gzip
import lzma
from collections.abc import Iterator

from ..errors import DecodeError, ShardFormatError, missing_dependency
from ..format.compression import GZIP_MAGIC, ZSTD_MAGIC, decompressing_chunks
from ..format.limits import Limits

__all__ = ["COMPRESSED_EXTENSIONS", "MIN_CAP_BASE", "compress_field", "decompress_field", "field_cap"]

COMPRESSED_EXTENSIONS = ("gz", "zst", "xz")
MIN_CAP_BASE = 1 << 10
"""Bytes a compressed field counts as at least when its cap is computed (a 40-byte gzip of
a 1 MB text is legitimate): the cap is never below ``1 KiB * max_compression_ratio``."""
_XZ_MAGIC = b"\xfd7zXZ\x00"
_PIECE = 1 << 22  # bytes of output per step, at most


def field_cap(stored: int, limits: Limits) -> int:
    """The most bytes a compressed field of ``stored`` bytes may decompress to (every layer)."""
    return min(limits.max_member_bytes, max(stored, MIN_CAP_BASE) * limits.max_compression_ratio)


def decompress_field(field: str, data: bytes, limits: Limits) -> tuple[str, bytes]:
    """Undo every compression layer of a field (``k.txt.gz.gz``: both), within :func:`field_cap`.

    Args:
        field: the field name, ending ``.gz``, ``.zst`` or ``.xz``.
        data: the field's stored bytes.
        limits: the bounds (named in the error over the cap).

    Returns:
        ``(inner field name, decompressed bytes)``: ``("txt", b"...")`` for ``txt.gz.gz``
        (the name is ``""`` for a field named ``gz`` alone); the bytes are at most the cap.

    Raises:
        DecodeError: the output would pass the cap (reason ``field_too_large``), or the
            data is not what its extension says, is damaged or is cut short.
        ImportError: a ``.zst`` field without the ``zstandard`` package.
    """
    cap = field_cap(len(data), limits)
    stored = len(data)
    name = field
    while True:
        head, _, ext = name.rpartition(".")
        if ext not in COMPRESSED_EXTENSIONS:
            return name, data
        data = _layer(ext, field, data, stored, limits, cap)
        if not head:
            return "", data
        name = head


def _layer(ext: str, field: str, data: bytes, stored: int, limits: Limits, cap: int) -> bytes:
    out = bytearray()
    try:
        for piece in _pieces(ext, data, field):
            if len(out) + len(piece) > cap:
                raise DecodeError(
                    f"field {field!r}: {stored} stored bytes decompress to more than {cap} bytes, over "
                    f"min(Limits.max_member_bytes={limits.max_member_bytes}, max({stored}, {MIN_CAP_BASE}) x "
                    f"Limits.max_compression_ratio={limits.max_compression_ratio})",
                    reason="field_too_large",
                )
            out += piece
    except (ShardFormatError, lzma.LZMAError, EOFError) as e:
        raise DecodeError(f"field {field!r}: bad {ext} data: {e}") from e
    return bytes(out)


def _pieces(ext: str, data: bytes, field: str) -> Iterator[bytes]:
    head = bytes(data[:8])  # bytes, bytearray or a memoryview alike
    if ext == "xz":
        if not head.startswith(_XZ_MAGIC):
            raise DecodeError(f"field {field!r}: bad xz data: no xz magic bytes")
        yield from _unxz(data)
        return
    magic = GZIP_MAGIC if ext == "gz" else ZSTD_MAGIC
    if not head.startswith(magic):
        raise DecodeError(f"field {field!r}: bad {ext} data: no {ext} magic bytes")
    yield from decompressing_chunks(iter([data]), f"field {field!r}")


def _unxz(data: bytes) -> Iterator[bytes]:
    while data:
        dec = lzma.LZMADecompressor()
        piece = dec.decompress(data, _PIECE)
        while True:
            if piece:
                yield piece
            if dec.eof or (dec.needs_input and not dec.unused_data):
                break
            piece = dec.decompress(b"", _PIECE)
        if not dec.eof:
            raise EOFError("xz stream is truncated")
        data = dec.unused_data.lstrip(b"\0")  # streams may be concatenated, with padding


def compress_field(ext: str, data: bytes) -> bytes:
    """Compress an encoded field for writing (deterministic bytes: no timestamps).

    Raises:
        ImportError: ``zst`` without the ``zstandard`` package.
    """
    if ext == "gz":
        return gzip.compress(data, mtime=0)
    if ext == "xz":
        return lzma.compress(data)
    try:
        import zstandard
    except ImportError as exc:
        raise missing_dependency("zstandard", "zstd", "writing a .zst field") from exc
    return zstandard.ZstdCompressor().compress(data)
