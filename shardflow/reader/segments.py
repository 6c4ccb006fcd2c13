"""Opening one segment of a shard: its byte stream and the samples read from it.

A segment is a shard's samples ``[start, stop)``. It is read by seeking with the
offset index when the reader is given one, else from the shard's start; either
way its bytes start streaming at once (:func:`shardflow.storage.open_chunks`)
and its size is checked against the manifest as it opens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import storage
from ..errors import ManifestError, ShardflowError, ShardFormatError, TruncatedShardError
from ..format.layouts import Layouts
from ..format.wholes import Frame
from ..format.tar import iter_samples
from ..sources.source import ShardSet

__all__ = ["Opened", "open_segment", "open_shard", "one_sample_lost", "close"]


class Opened:
    """The samples of one shard (or segment) over a byte stream that is already open.

    The stream's read-ahead thread starts when the shard is opened, so a shard
    opened one step before it is needed downloads while the previous one is
    decoded. ``close()`` releases the stream (thread, file handle, connection)
    whether or not a sample was read.

    Attributes:
        samples: the generator of ``(key, offset, fields)`` tuples (see
            :func:`shardflow.format.tar.iter_samples`); a hot loop may call it
            directly, without the ``__next__`` of this wrapper.
    """

    __slots__ = ("raw", "samples")

    def __init__(self, raw: Iterator[bytes], samples: Iterator[Any]) -> None:
        self.raw = raw
        self.samples = samples

    def __iter__(self) -> Opened:
        return self

    def __next__(self) -> Any:
        return next(self.samples)

    def close(self) -> None:
        try:
            close(self.samples)
        finally:
            close(self.raw)


def close(it: Any) -> None:
    """Close ``it`` if it is not None and has a ``close`` (a generator, an :class:`Opened`)."""
    if it is not None and hasattr(it, "close"):
        it.close()


def _from(items: Iterator[Any], start: int) -> Iterator[Any]:
    for n, item in enumerate(items):
        if n >= start:
            yield item


def _size_check(source: ShardSet, shard: int) -> Callable[[int], None] | None:
    """A check of the shard's size against the manifest, made when the shard is
    opened: offsets into a replaced shard would cut samples in the wrong places,
    and a whole read of one would yield samples the manifest does not list."""
    manifest = source.manifest
    if manifest is None or manifest.shards[shard].bytes < 0:
        return None
    url = source.urls[shard]
    listed = manifest.shards[shard].bytes

    def check(size: int) -> None:
        # shorter: cut short after indexing; reading it yields the samples before the
        # cut and then reports the truncation. Longer: the shard was replaced.
        if size > listed:
            raise ManifestError(
                f"{url}: the shard has {size} bytes but the manifest lists {listed}: it changed since the "
                "manifest was written (re-run `shardflow index`, or restore the shard)",
                reason="changed_shard",
            )

    return check


def open_segment(
    source: ShardSet,
    shard: int,
    start: int,
    stop: int,
    offsets: np.ndarray | None,
    io: storage.IOOptions,
    walk: np.ndarray | None = None,
    tag: int | None = None,
) -> Opened:
    """Samples ``[start, stop)`` of one shard, seeking with the offset index if any.

    Args:
        source: the shards.
        shard: the shard's number in ``source``.
        start, stop: the segment's first and past-the-last sample numbers.
        offsets: int64, the shard's offset index (None: read from its start).
        io: storage options (the source's own are applied on top).
        walk: without ``offsets``, the offset index all the same, to walk the
            tar headers faster (:func:`iter_samples`' ``walk_starts``) and to
            tell where samples start (its ``starts``), as a read that seeks with
            it does: one sample per indexed position, whichever way the shard is read.
        tag: with it, each sample comes whole, with ``__source__`` ``tag``, in place of its
            fields (:func:`iter_samples`' ``frame``).

    Returns:
        The opened segment; its stream is already reading.
    """
    url = source.urls[shard]
    io = source.options_for(shard, io)  # a source's own storage options
    check = _size_check(source, shard)
    frame = (url, tag) if tag is not None else None
    manifest = source.manifest
    pin = (manifest.shards[shard].sha256 or None) if manifest is not None else None  # (finds a cached copy)
    if offsets is not None:
        lo, hi = int(offsets[start]), int(offsets[stop])
        frames = source.load_frames(shard, io)  # a framed .tar.zst: tar offsets, served frame by frame
        if frames is not None:
            raw = storage.open_framed(url, lo, hi, frames, io, check_size=check)
            layouts = None
        else:
            layouts = Layouts()  # (bound when a local file opens: see format.layouts)
            raw = storage.open_chunks(url, lo, hi, io, check_size=check, digest=pin, opened=layouts.opened)
        return Opened(raw, _seek_samples(raw, url, lo, hi, io, offsets[start : stop + 1], framed=frames is not None,
                                         layouts=layouts, frame=frame))
    # read to the end: the manifest's digest checks the bytes where the store gives no validator
    # (a local file always has one: its size, mtime and inode, see storage.readers.local)
    sha = manifest.shards[shard].sha256 if manifest is not None and stop >= manifest.shards[shard].samples else None
    if storage.is_local(url):
        sha = None
    layouts = Layouts()
    raw = storage.open_chunks(url, 0, None, io, check_size=check, sha256=sha, digest=pin, opened=layouts.opened)
    chunks: Iterator[bytes] = _Unclosed(raw) if sha else raw  # the tar reader stops at the end-of-archive
    samples = iter_samples(storage.decompressing_chunks(chunks, url), url, 0, limit=stop, sample_errors="yield",
                           limits=io.limits, starts=walk, walk_starts=walk, layouts=layouts, frame=frame)
    if sha:
        samples = _drained(samples, raw)
    return Opened(raw, _from(samples, start) if start else samples)


def open_shard(source: ShardSet, shard: int, io: storage.IOOptions) -> Opened:
    """All samples of one shard (no manifest); streaming starts at once."""
    url = source.urls[shard]
    io = source.options_for(shard, io)
    raw = storage.open_chunks(url, 0, None, io)
    return Opened(raw, iter_samples(storage.decompressing_chunks(raw, url), url, 0, sample_errors="yield", limits=io.limits))


_NOTHING = object()


def _drained(samples: Iterator[Any], raw: Iterator[bytes]) -> Iterator[Any]:
    """``samples``, with the rest of ``raw`` read (the end-of-archive padding) before the
    last one is given, so that a whole read reaches its end, where its digest is checked,
    while the reader still listens."""
    held = _NOTHING
    try:
        for item in samples:
            if held is not _NOTHING:
                yield held
            held = item
    except ShardflowError:
        if held is not _NOTHING:  # the error is the stream's, not the held sample's
            yield held
        raise
    for _ in raw:
        pass
    if held is not _NOTHING:
        yield held


class _Unclosed:
    """An iterator over ``it`` without ``close``: a consumer that stops early leaves ``it`` open."""

    __slots__ = ("_it",)

    def __init__(self, it: Iterator[bytes]) -> None:
        self._it = it

    def __iter__(self) -> _Unclosed:
        return self

    def __next__(self) -> bytes:
        return next(self._it)


def _seek_samples(
    raw: Iterator[bytes], url: str, lo: int, hi: int, io: storage.IOOptions, starts: np.ndarray, framed: bool = False,
    layouts: Layouts | None = None, frame: Frame | None = None,
) -> Iterator[Any]:
    """Samples of the tar bytes ``[lo, hi)`` (``starts``: their offsets); a compressed shard gets an error that says so
    (not a framed one, read through its frame table: its format error is the one to report)."""
    try:
        # one sample (a scattered plan's read): the bulk header walk costs more than it saves
        yield from iter_samples(raw, url, lo, end=hi, sample_errors="yield", limits=io.limits, starts=starts,
                                walk_starts=starts if len(starts) > 2 else None, layouts=layouts, frame=frame)
    except ShardFormatError as e:
        if framed:
            raise
        try:
            compressed = storage.is_compressed(url, io)
        except Exception:  # noqa: BLE001 - the format error is the one to report
            compressed = False
        if not compressed:
            raise
        raise ShardFormatError(
            f"{url}: compressed shard (gzip/zstd), but the manifest gives it an offset index: byte offsets "
            "cannot seek into a compressed stream. Re-index the shards with `shardflow index` (compressed "
            "shards then stream whole), or decompress them",
            reason="compressed_shard",
        ) from e


def one_sample_lost(err: ShardflowError) -> bool:
    """Whether ``err``, met in a sample reached through the offset index, loses that sample only.

    A damaged header or member does; a shard cut short, compressed, or whose
    index does not match it loses every sample after.
    """
    return (
        isinstance(err, ShardFormatError)
        and not isinstance(err, TruncatedShardError)
        and err.reason not in ("compressed_shard", "stale_index")
    )
