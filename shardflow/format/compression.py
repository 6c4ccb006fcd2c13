"""gzip and zstd shard compression, found by magic bytes and undone incrementally."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

from shardflow.errors import ShardFormatError, TruncatedShardError, missing_dependency

__all__ = ["GZIP_MAGIC", "ZSTD_MAGIC", "decompressing_chunks"]

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_DECOMPRESS_OUT = 1 << 22  # bytes of decompressed output per yielded chunk (gzip)
_ZSTD_IN = 1 << 17  # bytes of zstd input per decompress call, bounds the output size


def decompressing_chunks(chunks: Iterator[bytes], url: str) -> Iterator[bytes]:
    """Undo gzip or zstd compression of a chunk stream, found by its magic bytes.

    gzip (``1f 8b``, several members allowed) and zstd (``28 b5 2f fd``, several
    frames allowed) streams are decompressed incrementally; anything else passes
    through unchanged. Memory stays bounded by the chunk sizes.

    Args:
        chunks: the object's bytes, in chunks of any size.
        url: named in errors.

    Raises:
        TruncatedShardError: the compressed stream ends early (a ``ShardFormatError``).
        ShardFormatError: the compressed data is corrupt.
        ImportError: zstd data but the ``zstandard`` package is missing.
    """
    try:
        head = b""
        for chunk in chunks:
            head += chunk
            if len(head) >= 4:
                break
        if head.startswith(GZIP_MAGIC):
            yield from _gunzip(head, chunks, url)
        elif head.startswith(ZSTD_MAGIC):
            yield from _unzstd(head, chunks, url)
        else:
            if head:
                yield head
            yield from chunks
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _gunzip(head: bytes, chunks: Iterator[bytes], url: str) -> Iterator[bytes]:
    dec = zlib.decompressobj(zlib.MAX_WBITS | 16)
    fed = False  # whether the current member has been given any input
    try:
        for data in _prepend(head, chunks):
            while data:
                fed = True
                out = dec.decompress(data, _DECOMPRESS_OUT)
                if out:
                    yield out
                if dec.eof:  # end of a member; another may follow
                    data = dec.unused_data
                    dec = zlib.decompressobj(zlib.MAX_WBITS | 16)
                    fed = False
                else:
                    data = dec.unconsumed_tail
        while fed and not dec.eof:  # output held back by max_length
            out = dec.decompress(b"", _DECOMPRESS_OUT)
            if not out:
                raise TruncatedShardError(f"{url}: gzip stream is truncated")
            yield out
    except zlib.error as exc:
        raise ShardFormatError(f"{url}: corrupt gzip data: {exc}") from exc


def _unzstd(head: bytes, chunks: Iterator[bytes], url: str) -> Iterator[bytes]:
    try:
        import zstandard
    except ImportError as exc:
        raise missing_dependency(
            "zstandard", "zstd", f"reading the zstd-compressed shard {url}"
        ) from exc
    dctx = zstandard.ZstdDecompressor()
    dec = dctx.decompressobj()
    fed = False
    try:
        for data in _prepend(head, chunks):
            while data:
                piece, data = data[:_ZSTD_IN], data[_ZSTD_IN:]
                while piece:
                    fed = True
                    out = dec.decompress(piece)
                    if out:
                        yield out
                    if dec.eof:
                        piece = dec.unused_data
                        dec = dctx.decompressobj()
                        fed = False
                    else:
                        piece = b""
        if fed and not dec.eof:
            raise TruncatedShardError(f"{url}: zstd stream is truncated")
    except zstandard.ZstdError as exc:
        raise ShardFormatError(f"{url}: corrupt zstd data: {exc}") from exc


def _prepend(head: bytes, chunks: Iterator[bytes]) -> Iterator[bytes]:
    yield head
    yield from chunks
