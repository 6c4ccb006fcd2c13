"""Writing a manifest for existing shards (``shardflow index``).

Shards from anywhere (webdataset, ``tar`` of a sorted folder) get the same
guarantees as shardflow's own once they have a manifest: exact per-rank
splits, seeking, random access. Indexing reads every shard once, computing its
sample count, size, SHA-256 and offset index.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import storage
from .format.keys import codec_extension
from .format.manifest import MANIFEST_NAME, Manifest, ShardInfo, encode_offsets
from .format.tar import scan_shard
from .storage.urls import join_url, parent_url
from .writer import write_manifest

__all__ = ["index_shards"]

log = logging.getLogger(__name__)


def _hashing(chunks: Iterator[bytes], sha: Any, size: list[int]) -> Iterator[bytes]:
    for c in chunks:
        sha.update(c)
        size[0] += len(c)
        yield c


def _index_one(url: str, out: str, io: storage.IOOptions) -> tuple[ShardInfo, dict[str, int]]:
    sha = hashlib.sha256()
    size = [0]
    raw = _hashing(storage.iter_chunks(url, 0, None, io), sha, size)
    compressed = []

    def detect(chunks: Iterator[bytes]) -> Iterator[bytes]:
        first = next(chunks, b"")
        compressed.append(first[:2] == b"\x1f\x8b" or first[:4] == b"\x28\xb5\x2f\xfd")
        if first:
            yield first
        yield from chunks

    keys, offsets, fields = scan_shard(storage.decompressing_chunks(detect(raw), url), url, limits=io.limits)
    for _ in raw:  # hash any bytes after the end-of-archive marker too
        pass
    name = url.rsplit("/", 1)[-1]
    rel = name if parent_url(url).rstrip("/") == out.rstrip("/") else url
    index = None
    if not compressed[0]:
        index = name + ".idx.npy"
        with storage.open_output(join_url(out, index), io) as f:
            f.write(encode_offsets(offsets))
    return ShardInfo(url=rel, samples=len(keys), bytes=size[0], sha256=sha.hexdigest(), index=index), fields


def index_shards(
    urls: Sequence[str],
    *,
    out: str | None = None,
    meta: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    io: storage.IOOptions | None = None,
    workers: int = 4,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Scan shards and write ``shardflow.json`` plus offset indexes.

    Args:
        urls: shard URLs in stream order (local paths or fsspec URLs).
        out: folder for the manifest and the offset indexes; default the
            shards' folder (they must share one then). Shards outside ``out``
            are listed by absolute URL.
        meta: the manifest's ``meta``.
        storage_options: fsspec options.
        io: how shards are read and written, a :class:`~shardflow.storage.IOOptions`
            (instead of ``storage_options``).
        workers: shards scanned at once (threads).
        progress: called with 1 per finished shard.

    Returns:
        The manifest written to ``out/shardflow.json``.

    Raises:
        ValueError: no URLs, or no ``out`` and the shards are in several folders,
            or both ``io`` and ``storage_options``.
        ShardFormatError, SampleError: a shard is not a valid sample tar (the
            error names it); nothing is written then.
    """
    if not urls:
        raise ValueError("no shards to index")
    if out is None:
        folders = {parent_url(u) for u in urls}
        if len(folders) != 1:
            raise ValueError(f"the shards are in {len(folders)} folders; pass out= for the manifest")
        out = folders.pop()
    io = storage.io_options(io, storage_options)

    def work(url: str) -> tuple[ShardInfo, dict[str, int]]:
        result = _index_one(url, out, io)
        if progress:
            progress(1)
        return result

    with ThreadPoolExecutor(max(1, workers)) as pool:
        results = list(pool.map(work, urls))
    fields: dict[str, str] = {}
    for _, f in results:
        fields.update({name: codec_extension(name) for name in f})
    manifest = Manifest(
        shards=[info for info, _ in results],
        fields=fields,
        meta={"source": "shardflow index", **(meta or {})},
        url=join_url(out, MANIFEST_NAME),
    )
    write_manifest(join_url(out, MANIFEST_NAME), manifest, io)
    log.info("indexed %d shards, %d samples", len(results), manifest.num_samples)
    return manifest
