"""A shard's byte stream passed through, counted and hashed as it is read."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from ..format.compression import GZIP_MAGIC, ZSTD_MAGIC

__all__ = ["HashingChunks", "strip_url"]



class HashingChunks:
    """Pass a chunk stream through, counting its bytes and hashing them (sha256).

    Deliberately has no ``close``: :func:`storage.decompressing_chunks` closes its
    input when it stops, and the rest must still be drained into the hash;
    :meth:`release` closes the underlying stream.
    """

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self.sha = hashlib.sha256()
        self.size = 0
        self.head = b""

    def __iter__(self) -> HashingChunks:
        return self

    def __next__(self) -> bytes:
        chunk = next(self._chunks)
        if len(self.head) < 4:
            self.head += chunk[:4]
        self.sha.update(chunk)
        self.size += len(chunk)
        return chunk

    def drain(self) -> None:
        """Read (and hash) the rest of the stream."""
        for _ in self:
            pass

    def release(self) -> None:
        """Close the underlying stream (its read-ahead thread and file handle)."""
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    @property
    def compressed(self) -> bool:
        return self.head.startswith(GZIP_MAGIC) or self.head.startswith(ZSTD_MAGIC)


def strip_url(message: str, url: str) -> str:
    """Drop a leading ``"<url>: "`` from a library error message (the shard is reported apart)."""
    prefix = f"{url}: "
    return message[len(prefix) :] if message.startswith(prefix) else message
