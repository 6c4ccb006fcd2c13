"""A framed ``.tar.zst`` shard seen as its tar bytes: ranges in tar (uncompressed)
offsets, served by reading and decompressing only the frames that hold them.

The tar reader above asks for ``[lo, hi)`` in the offsets of the offset index,
as on a plain shard; the stored bytes of the frames that hold that range come
through the same stream as a plain shard's (cache, retries, read-ahead), and
a frame at a time is decompressed (see :mod:`shardflow.format.frames`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from shardflow.format.frames import FrameTable, framed_chunks, read_framed

from .options import DEFAULT_OPTIONS, IOOptions
from .reading import check_range, read_range
from .streams import open_chunks

__all__ = ["open_framed", "read_framed_range"]


def open_framed(url: str, lo: int, hi: int, table: FrameTable, options: IOOptions = DEFAULT_OPTIONS, *,
                check_size: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """Stream the tar bytes ``[lo, hi)`` of a framed zstd shard.

    Args:
        url: the shard (local path or fsspec URL).
        lo, hi: tar (uncompressed) offsets, as the offset index gives them.
        table: the shard's frame table.
        options: as :func:`~shardflow.storage.open_chunks`; ``options.limits``
            bounds each frame.
        check_size: as :func:`~shardflow.storage.open_chunks` (the stored size).

    Returns:
        An iterator of decompressed chunks whose concatenation is the tar
        bytes ``[lo, hi)`` (fewer if the shard is cut short); one streaming
        read of the frames ``table.frames_for(lo, hi)``. Close it to release
        the stream.

    Raises:
        FrameTableError: a frame does not match the table.
        ShardFormatError: corrupt zstd data.
        and as :func:`~shardflow.storage.open_chunks`.
    """
    check_range(lo, hi)
    first, stop = table.frames_for(lo, hi)
    raw = open_chunks(os.fspath(url), int(table.stored[first]), int(table.stored[stop]), options,
                      check_size=check_size)
    return framed_chunks(raw, url, lo, hi, table, options.limits)


def read_framed_range(url: str, lo: int, hi: int, table: FrameTable, options: IOOptions = DEFAULT_OPTIONS,
                      read: Callable[[int, int], bytes] | None = None,
                      memo: dict[int, bytes] | None = None) -> bytes:
    """The tar bytes ``[lo, hi)`` of a framed zstd shard in one ranged read (random access).

    Args:
        read: ``read(start, end)`` of the stored bytes (e.g. a ``pread`` on an
            open descriptor); default :func:`~shardflow.storage.read_range`.
        memo: the shard's last decompressed frame, kept by the caller (see
            :func:`~shardflow.format.frames.read_framed`).

    Raises:
        as :func:`open_framed` and :func:`~shardflow.storage.read_range`.
    """
    check_range(lo, hi)
    if read is None:
        def read(start: int, end: int) -> bytes:
            return read_range(url, start, end, options)
    return read_framed(read, url, lo, hi, table, options.limits, memo)
