"""Framed zstd shards: independent frames and the frame table that seeks into them.

A ``.tar.zst`` shard written with ``compression="zstd"`` is a plain tar cut
into independent zstd frames of about :data:`FRAME_BYTES` uncompressed bytes
each (a frame ends between samples; only a sample larger than
:data:`FRAME_CAP` is cut inside, so no frame is larger), each with its content
size and checksum in its header. Then comes the zstd seekable-format seek
table (a skippable frame, see the zstd repository's
``contrib/seekable_format/zstd_seekable_compression_format.md``), so that
other tools can seek too; a plain ``zstd -dc`` skips it.

The frame table, a ``.npy`` beside the offset index (int64, shape
``(frames + 1, 2)``, no pickle), maps uncompressed offsets to compressed ones:
row ``i`` is ``(uncompressed offset, compressed offset)`` of frame ``i``'s
first byte, and the last row is ``(tar size, end of the last frame)``. The
offset index keeps tar (uncompressed) offsets, so a sample at ``[lo, hi)`` is
read by decompressing the frames that hold it, and only those.

Everything a table declares is checked (:func:`decode_frames`), and every
frame is checked against it while it is decompressed: a frame never yields
more than the table says, and no frame larger than
``Limits.max_frame_bytes`` is decompressed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import ManifestError, ShardFormatError, missing_dependency
from .limits import Limits
from .manifest import encode_offsets, load_npy

__all__ = [
    "FRAME_BYTES",
    "FRAME_CAP",
    "FRAMES_SUFFIX",
    "FrameTable",
    "FrameTableError",
    "FrameWriter",
    "decode_frames",
    "framed_chunks",
    "read_framed",
    "table_of_frames",
]

FRAME_BYTES = 256 << 10
"""Uncompressed bytes after which a frame ends at the next sample boundary."""
FRAME_CAP = 4 << 20
"""Uncompressed bytes no frame exceeds (a larger sample is cut inside)."""
FRAMES_SUFFIX = ".frames.npy"
"""The frame table of ``x.tar.zst`` is ``x.tar.zst.frames.npy``."""
ZSTD_LEVEL = 3
_SEEKABLE_MAGIC = 0x8F92EAB1
_SKIPPABLE_SEEK_MAGIC = 0x184D2A5E


class FrameTableError(ManifestError):
    """A frame table does not fit its shard, or a frame does not match its table entry."""

    default_reason = "bad_frames"


def _zstd(purpose: str):  # noqa: ANN202 - the zstandard module
    try:
        import zstandard
    except ImportError as exc:
        raise missing_dependency("zstandard", "zstd", purpose) from exc
    return zstandard


@dataclass(frozen=True)
class FrameTable:
    """Where the frames of a framed zstd shard lie.

    Attributes:
        plain: int64, shape (frames + 1,): uncompressed (tar) offset of each
            frame's first byte, then the tar size.
        stored: int64, shape (frames + 1,): compressed offset of each frame in
            the shard, then the end of the last frame.
    """

    plain: np.ndarray
    stored: np.ndarray

    @property
    def size(self) -> int:
        """The shard's tar bytes (uncompressed), in bytes."""
        return int(self.plain[-1])

    def frames_for(self, lo: int, hi: int) -> tuple[int, int]:
        """``(first, stop)``: the frames ``[first, stop)`` that hold the tar bytes ``[lo, hi)``."""
        last = len(self.plain) - 2  # the last frame
        first = min(max(int(np.searchsorted(self.plain, lo, side="right")) - 1, 0), last)
        stop = int(np.searchsorted(self.plain, hi, side="left"))
        return first, min(max(stop, first + 1), last + 1)

    def encode(self) -> bytes:
        """The table as ``.npy`` bytes (int64, shape (frames + 1, 2))."""
        return encode_offsets(np.stack([self.plain, self.stored], axis=1))


def decode_frames(data: bytes, url: str, stored_size: int, limits: Limits) -> FrameTable:
    """Parse a frame table and check it against its shard and the limits.

    Args:
        data: the ``.frames.npy`` bytes.
        url: the table's URL, named in errors.
        stored_size: the shard's size in bytes (the manifest's), or -1 if unknown.
        limits: ``max_frame_bytes`` bounds each frame, ``max_compression_ratio``
            the tar size against the compressed size.

    Raises:
        FrameTableError: (reason ``"bad_frames"``) not an int64 array of shape
            (n, 2) with n >= 2; a first row other than (0, 0); offsets that do
            not strictly increase; a frame larger than ``Limits.max_frame_bytes``
            (compressed or not); frames that end past the shard; a tar size
            more than ``Limits.max_compression_ratio`` times the compressed size.
    """
    try:
        arr = load_npy(data, url, "frame table", (-1, 2))
    except ManifestError as e:
        raise FrameTableError(str(e)) from e
    rows = len(arr)
    if rows < 2:
        raise FrameTableError(f"{url}: frame table has {rows} rows, expected at least 2 (one frame and the end)")
    plain, stored = arr[:, 0].copy(), arr[:, 1].copy()
    if plain[0] != 0 or stored[0] != 0:
        raise FrameTableError(f"{url}: frame table starts at ({int(plain[0])}, {int(stored[0])}), not (0, 0)")
    for name, col in (("uncompressed", plain), ("compressed", stored)):
        steps = np.diff(col)
        if np.any(steps <= 0):
            i = int(np.argmax(steps <= 0))
            raise FrameTableError(f"{url}: frame table's {name} offsets do not increase at frame {i} "
                                  f"({int(col[i])} then {int(col[i + 1])})")
        if int(steps.max()) > limits.max_frame_bytes:
            i = int(np.argmax(steps))
            raise FrameTableError(f"{url}: frame {i} is {int(steps[i])} bytes {name}, more than "
                                  f"Limits.max_frame_bytes={limits.max_frame_bytes}")
    if stored_size >= 0 and int(stored[-1]) > stored_size:
        raise FrameTableError(f"{url}: frame table ends at byte {int(stored[-1])}, past the end of the shard's "
                              f"{stored_size} bytes")
    if int(plain[-1]) > int(stored[-1]) * limits.max_compression_ratio:
        raise FrameTableError(f"{url}: frame table declares {int(plain[-1])} tar bytes in {int(stored[-1])} "
                              f"compressed, more than Limits.max_compression_ratio={limits.max_compression_ratio}")
    return FrameTable(plain, stored)


def table_of_frames(frames: list[tuple[int, int]], end: int) -> FrameTable | None:
    """The frame table of a zstd stream whose frames a :class:`~shardflow.format.compression.ZstdFrames`
    walk saw, or None when it cannot have one.

    A stream has one when its data frames start at byte 0, follow each other
    with nothing between them, each declares its content size, and only
    skippable frames (such as the seekable format's seek table) come after
    them. The table is not checked against the limits (see :func:`decode_frames`).

    Args:
        frames: ``ZstdFrames.frames`` of the whole stream.
        end: the stream's size in bytes.
    """
    data = 0
    while data < len(frames) and frames[data][1] != -2:
        data += 1
    if not data or frames[0][0] != 0 or any(size < 0 for _, size in frames[:data]):
        return None
    if any(size != -2 for _, size in frames[data:]):  # a data frame after a skippable one
        return None
    stop = frames[data][0] if data < len(frames) else end
    plain = np.cumsum([0] + [size for _, size in frames[:data]], dtype=np.int64)
    return FrameTable(plain, np.asarray([start for start, _ in frames[:data]] + [stop], np.int64))


def _unframe(frame: bytes, want: int, url: str, index: int, dctx) -> bytes:  # noqa: ANN001 - a ZstdDecompressor
    """Frame ``index`` decompressed; exactly ``want`` bytes, or a named error."""
    zstandard = _zstd(f"reading the zstd-compressed shard {url}")
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise FrameTableError(f"{url}: frame {index} is not a zstd frame ({e}): the frame table does not "
                              "match the shard") from e
    if declared != want:  # checked before anything is allocated: a frame yields what its table entry says
        raise FrameTableError(f"{url}: frame {index} declares {declared} bytes in its header, its frame table "
                              f"entry {want} (-1: none in the header)")
    try:  # (allocates the declared size, checked above; libzstd refuses a frame that yields more or less)
        out = dctx.decompress(frame, allow_extra_data=False)
    except zstandard.ZstdError as e:
        if "unused data" in str(e):
            raise FrameTableError(f"{url}: frame {index} does not end where its frame table entry does ({e})") from e
        raise ShardFormatError(f"{url}: corrupt zstd data in frame {index}: {e}") from e
    if len(out) != want:  # pragma: no cover - libzstd checks the content size
        raise FrameTableError(f"{url}: frame {index} decompressed to {len(out)} bytes, its table entry says {want}")
    return out


def _decompressor(limits: Limits, url: str):  # noqa: ANN202 - a ZstdDecompressor
    zstandard = _zstd(f"reading the zstd-compressed shard {url}")
    window = 1 << max(10, (limits.max_frame_bytes - 1).bit_length())
    return zstandard.ZstdDecompressor(max_window_size=window)


def read_framed(read: Callable[[int, int], bytes], url: str, lo: int, hi: int, table: FrameTable,
                limits: Limits, memo: dict[int, bytes] | None = None) -> bytes:
    """The tar bytes ``[lo, hi)`` of a framed shard, decompressing only the frames that hold them.

    Args:
        read: ``read(start, end)`` returns the shard's stored bytes ``[start, end)``.
        url: the shard, named in errors.
        lo, hi: uncompressed (tar) offsets, ``0 <= lo <= hi <= table.size``.
        table: the shard's frame table.
        limits: see :func:`decode_frames`.
        memo: the last decompressed frame of this shard (frame number -> tar
            bytes, one entry, frames of at most :data:`FRAME_CAP` bytes), kept
            by the caller: samples read in order then cost one read and one
            decompression per frame, not per sample.

    Returns:
        ``hi - lo`` bytes, fewer if the shard is cut short.

    Raises:
        FrameTableError: a frame does not match the table.
        ShardFormatError: corrupt zstd data.
    """
    first, stop = table.frames_for(lo, hi)
    held = memo.get(first) if memo is not None and stop == first + 1 else None
    if held is not None:
        at = int(table.plain[first])
        return held[lo - at : hi - at]
    base = int(table.stored[first])
    data = memoryview(read(base, int(table.stored[stop])))
    dctx = _decompressor(limits, url)
    out = []
    for frame in range(first, stop):
        a, b = int(table.stored[frame]) - base, int(table.stored[frame + 1]) - base
        if b > len(data):  # the shard ends early: what it holds (the tar reader reports the cut)
            break
        tar = _unframe(data[a:b], int(table.plain[frame + 1] - table.plain[frame]), url, frame, dctx)
        if memo is not None and len(tar) <= FRAME_CAP:
            memo.clear()
            memo[frame] = tar
        at = int(table.plain[frame])
        out.append(tar[max(lo - at, 0) : max(hi - at, 0)] if (lo > at or hi < at + len(tar)) else tar)
    return out[0] if len(out) == 1 else b"".join(out)


def framed_chunks(chunks: Iterator[bytes], url: str, lo: int, hi: int, table: FrameTable,
                  limits: Limits) -> Iterator[bytes]:
    """Decompress a framed shard's stored bytes into its tar bytes ``[lo, hi)``.

    Args:
        chunks: the stored bytes from ``table.stored[first]`` on, in chunks of
            any size, where ``first, stop = table.frames_for(lo, hi)``.
        url: the shard, named in errors.
        lo, hi: uncompressed (tar) offsets.
        table: the shard's frame table.
        limits: see :func:`decode_frames`.

    Yields:
        Non-empty chunks whose concatenation is the tar bytes ``[lo, hi)``; a
        frame at a time is held (at most ``Limits.max_frame_bytes`` each side).
        Stored bytes that end early end the output early (the tar reader
        reports the truncation).

    Raises:
        FrameTableError: a frame does not match its table entry.
        ShardFormatError: corrupt zstd data.
    """
    first, stop = table.frames_for(lo, hi)
    dctx = _decompressor(limits, url)
    buf = bytearray()
    frame = first
    try:
        for chunk in chunks:
            buf += chunk
            while frame < stop and len(buf) >= int(table.stored[frame + 1] - table.stored[frame]):
                n = int(table.stored[frame + 1] - table.stored[frame])
                with memoryview(buf) as view, view[:n] as stored:  # (released before buf is resized)
                    out = _unframe(stored, int(table.plain[frame + 1] - table.plain[frame]), url, frame, dctx)
                del buf[:n]
                at = int(table.plain[frame])
                piece = out[max(lo - at, 0) : max(hi - at, 0)] if (lo > at or hi < at + len(out)) else out
                frame += 1
                if piece:
                    yield piece
            if frame >= stop:
                return
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


class FrameWriter:
    """Compresses a shard's tar bytes into independent zstd frames and builds its frame table.

    Feed the tar bytes with :meth:`add`; call :meth:`sample_end` after each
    sample (a frame of :data:`FRAME_BYTES` or more ends there) and
    :meth:`finish` after the end-of-archive blocks. Each returns the stored
    bytes to append to the shard (possibly empty). Memory: one frame.
    """

    def __init__(self, url: str, level: int = ZSTD_LEVEL) -> None:
        zstandard = _zstd(f"writing the zstd-compressed shard {url}")
        self._cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        self._pending: list[bytes] = []
        self._held = 0
        self._plain = [0]
        self._stored = [0]

    @property
    def held(self) -> int:
        """Tar bytes added since the last frame ended."""
        return self._held

    def add(self, data: bytes) -> bytes:
        """Append tar bytes; returns the frames completed (of :data:`FRAME_CAP` bytes) inside them."""
        out = []
        view = memoryview(data)
        while view:
            take = min(len(view), FRAME_CAP - self._held)
            self._pending.append(bytes(view[:take]))
            self._held += take
            view = view[take:]
            if self._held >= FRAME_CAP:
                out.append(self._cut())
        return b"".join(out)

    def sample_end(self) -> bytes:
        """After a sample: the frame, if it reached :data:`FRAME_BYTES`, else nothing."""
        return self._cut() if self._held >= FRAME_BYTES else b""

    def _cut(self) -> bytes:
        data = b"".join(self._pending)
        self._pending.clear()
        self._held = 0
        frame = self._cctx.compress(data)
        self._plain.append(self._plain[-1] + len(data))
        self._stored.append(self._stored[-1] + len(frame))
        return frame

    def finish(self) -> bytes:
        """The last frame and the seekable-format seek table."""
        last = self._cut() if self._held or len(self._plain) == 1 else b""
        return last + self._seek_table()

    @property
    def table(self) -> FrameTable:
        """The frame table of the frames so far."""
        return FrameTable(np.asarray(self._plain, np.int64), np.asarray(self._stored, np.int64))

    def _seek_table(self) -> bytes:
        """The seekable format's skippable frame: per frame (compressed size, size) as u32, then the footer."""
        plain, stored = np.diff(self._plain), np.diff(self._stored)
        body = b"".join(struct.pack("<II", int(c), int(d)) for c, d in zip(stored, plain))
        body += struct.pack("<IBI", len(plain), 0, _SEEKABLE_MAGIC)
        return struct.pack("<II", _SKIPPABLE_SEEK_MAGIC, len(body)) + body
