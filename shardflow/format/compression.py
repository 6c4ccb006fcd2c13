"""gzip and zstd shard compression, found by magic bytes and undone incrementally."""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from shardflow.errors import ShardFormatError, TruncatedShardError, missing_dependency

__all__ = ["GZIP_MAGIC", "ZSTD_MAGIC", "SHARD_SUFFIXES", "COMPRESSED_SUFFIXES", "ZstdFrames", "decompressing_chunks"]

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.zstd")
"""How a shard file's name ends: a tar, or one compressed with gzip or zstd (the one list:
sources, ``shardflow index``, the converters' destination and the manifest checks use it)."""

COMPRESSED_SUFFIXES = SHARD_SUFFIXES[1:]
"""The suffixes of :data:`SHARD_SUFFIXES` of compressed shards."""
_DECOMPRESS_OUT = 1 << 22  # bytes of decompressed output per yielded chunk, at most
_ZSTD_IN = 1 << 17  # bytes of zstd input the stream reader takes at a time


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
    """zstd frames out in chunks of at most :data:`_DECOMPRESS_OUT` bytes.

    ``decompressobj().decompress`` returns all the output of its input at once
    (128 KiB of a zstd bomb is gigabytes), so the stream reader is used, whose
    ``read(n)`` is bounded; it does not tell a cut stream from a complete one,
    so :class:`ZstdFrames` walks the frame structure of the bytes it consumes.
    """
    try:
        import zstandard
    except ImportError as exc:
        raise missing_dependency(
            "zstandard", "zstd", f"reading the zstd-compressed shard {url}"
        ) from exc
    frames = ZstdFrames(url)
    source = _ChunkFile(_prepend(head, chunks), frames.feed)
    reader = zstandard.ZstdDecompressor().stream_reader(source, read_size=_ZSTD_IN, read_across_frames=True)
    try:
        while True:
            # read1: the output of the input that came so far (a block at least), where read()
            # would consume input until it had _DECOMPRESS_OUT bytes of output, so a reader
            # waiting for a shard's first samples would wait for its first 4 MiB (a whole small
            # shard) to come over the link
            out = reader.read1(_DECOMPRESS_OUT)
            if not out:
                break
            yield out
    except zstandard.ZstdError as exc:
        raise ShardFormatError(f"{url}: corrupt zstd data: {exc}") from exc
    if not frames.complete:
        raise TruncatedShardError(f"{url}: zstd stream is truncated")


class _ChunkFile(io.RawIOBase):
    """A read-only file over a chunk iterator; every byte read is shown to ``watch`` first."""

    def __init__(self, chunks: Iterator[bytes], watch: Callable[[memoryview], None]) -> None:
        super().__init__()
        self._chunks = chunks
        self._watch = watch
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._buf = memoryview(chunk)
            self._watch(self._buf)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


class ZstdFrames:
    """The frame structure of a zstd stream (RFC 8878 section 3), block headers only.

    Fed the compressed bytes as they pass (:meth:`feed`), it jumps over block
    contents and tracks whether the stream ends between frames (``complete``)
    and where each frame starts (``frames``).

    Attributes:
        frames: per frame seen, ``(offset of its magic number, content size
            from its header or -1 when the header has none, -2 for a
            skippable frame)``.
        offset: bytes fed so far.
    """

    def __init__(self, url: str) -> None:
        self.frames: list[tuple[int, int]] = []
        self.offset = 0
        self._url = url
        self._skip = 0  # bytes of block content (or a skippable frame) still to pass
        self._pending = b""  # header bytes collected so far
        self._need = 4  # header bytes the current state needs
        self._state = "magic"
        self._checksum = False
        self._fcs = 0  # bytes of the current frame's content size field

    @property
    def complete(self) -> bool:
        return self._state == "magic" and not self._skip and not self._pending

    def feed(self, data: memoryview) -> None:
        """Walk the next bytes of the stream.

        Raises:
            ShardFormatError: no frame magic where a frame must start, or a reserved block type.
        """
        base = self.offset
        self.offset += len(data)
        pos, n = 0, len(data)
        while True:
            if self._skip:
                take = min(self._skip, n - pos)
                self._skip -= take
                pos += take
                if self._skip:
                    return
            want = self._need - len(self._pending)
            if n - pos < want:
                self._pending += bytes(data[pos:])
                return
            field = self._pending + bytes(data[pos : pos + want])
            pos += want
            self._pending = b""
            self._step(field, base + pos)

    def _step(self, field: bytes, end: int) -> None:
        state = self._state
        if state == "magic":
            magic = int.from_bytes(field, "little")
            if field == ZSTD_MAGIC:
                self._state, self._need = "descriptor", 1
                self.frames.append((end - 4, -1))
            elif magic & 0xFFFFFFF0 == 0x184D2A50:  # skippable frame: 4-byte size, then content
                self._state, self._need = "skippable", 4
                self.frames.append((end - 4, -2))
            else:
                raise ShardFormatError(f"{self._url}: corrupt zstd data: no frame magic after a frame")
        elif state == "skippable":
            self._skip = int.from_bytes(field, "little")
            self._state, self._need = "magic", 4
        elif state == "descriptor":
            fhd = field[0]
            single = (fhd >> 5) & 1
            fcs = (1 if single else 0, 2, 4, 8)[fhd >> 6]
            self._checksum = bool((fhd >> 2) & 1)
            self._fcs = fcs
            rest = (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + fcs
            self._state, self._need = ("header", rest) if rest else ("block", 3)
        elif state == "header":
            if self._fcs:  # the frame content size closes the header (2 bytes: stored minus 256)
                size = int.from_bytes(field[-self._fcs :], "little") + (256 if self._fcs == 2 else 0)
                self.frames[-1] = (self.frames[-1][0], size)
            self._state, self._need = "block", 3
        elif state == "block":
            value = int.from_bytes(field, "little")
            kind = (value >> 1) & 3
            if kind == 3:
                raise ShardFormatError(f"{self._url}: corrupt zstd data: reserved block type")
            self._skip = 1 if kind == 1 else value >> 3
            if value & 1:  # last block of the frame
                self._state, self._need = ("checksum", 4) if self._checksum else ("magic", 4)
        else:  # checksum
            self._state, self._need = "magic", 4


def _prepend(head: bytes, chunks: Iterator[bytes]) -> Iterator[bytes]:
    yield head
    yield from chunks
