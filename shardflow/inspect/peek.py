"""The first samples of a dataset, or samples spread over it, as raw field bytes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .. import storage
from ..format.tar import iter_samples, raw_sample
from ..sources.source import ShardSet, resolve_source

__all__ = ["head"]



def head(
    source: str | os.PathLike | Sequence[str] | ShardSet,
    n: int = 10,
    *,
    spread: bool = False,
    io: storage.IOOptions | None = None,
) -> list[dict[str, Any]]:
    """Read ``n`` samples as raw field bytes.

    Args:
        source: anything :class:`~shardflow.ShardDataset` accepts, or a resolved
            :class:`~shardflow.sources.source.ShardSet`.
        n: number of samples (fewer when the dataset is smaller).
        spread: pick samples evenly spaced over the whole dataset (needs sample
            counts from a manifest; without one the first ``n`` are taken).
            With an offset index only those samples' bytes are read.
        io: storage options (a source's own ones are merged over them for its shards).

    Returns:
        Sample dicts in dataset order: ``__key__``, ``__url__`` and ``{field: bytes}``.

    Raises:
        ShardFormatError, SampleError, RemoteReadError: a shard read is unreadable.
    """
    io = io or storage.IOOptions()
    src = source if isinstance(source, ShardSet) else resolve_source(source, io)
    if n <= 0:
        return []
    counts = src.counts
    if spread and counts is not None and int(counts.sum()) > n:
        return _spread(src, n, io)
    out: list[dict[str, Any]] = []
    for shard, url in enumerate(src.urls):
        own = src.options_for(shard, io)  # the shard's source's own storage options
        chunks = storage.decompressing_chunks(storage.open_chunks(url, 0, None, own), url)
        it = iter_samples(chunks, url, 0, limit=n - len(out), limits=io.limits)
        try:
            for key, _, fields in it:
                out.append(raw_sample(key, url, fields))
        finally:
            it.close()
            chunks.close()
        if len(out) >= n:
            break
    return out


def _spread(src: ShardSet, n: int, io: storage.IOOptions) -> list[dict[str, Any]]:
    counts = src.counts
    total = int(counts.sum())
    wanted = sorted({(i * total) // n for i in range(n)})
    out: list[dict[str, Any]] = []
    first = 0
    for shard, (url, count) in enumerate(zip(src.urls, counts.tolist())):
        mine = [g - first for g in wanted if first <= g < first + count]
        first += count
        if not mine:
            continue
        offsets = src.load_offsets(shard, io)
        own = src.options_for(shard, io)
        if offsets is not None:
            frames = src.load_frames(shard, io)  # a framed .tar.zst: tar offsets
            memo: dict[int, bytes] = {}
            for i in mine:
                lo, hi = int(offsets[i]), int(offsets[i + 1])
                if frames is None:
                    data = storage.read_range(url, lo, hi, own)
                else:
                    data = storage.read_framed_range(url, lo, hi, frames, own, memo=memo)
                for key, _, fields in iter_samples([data], url, lo, end=hi, limits=io.limits):
                    out.append(raw_sample(key, url, fields))
            continue
        chunks = storage.decompressing_chunks(storage.open_chunks(url, 0, None, own), url)
        it = iter_samples(chunks, url, 0, limit=mine[-1] + 1, limits=io.limits)
        take = set(mine)
        try:
            for i, (key, _, fields) in enumerate(it):
                if i in take:
                    out.append(raw_sample(key, url, fields))
        finally:
            it.close()
            chunks.close()
    return out
