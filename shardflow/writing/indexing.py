"""Writing a manifest for existing shards (``shardflow index``).

Shards from anywhere (webdataset, ``tar`` of a sorted folder) get the same
guarantees as shardflow's own once they have a manifest: exact per-rank
splits, seeking, random access. Indexing reads every shard once, computing its
sample count, size, SHA-256 and offset index.

Compressed shards: the manifest records ``"compression"``. A ``.tar.zst``
whose zstd frames each declare their content size and follow each other
(shardflow's own, or any seekable-format writer's that records sizes) gets a
frame table beside its offset index and seeks like a ``.tar``; others
(``.tar.gz``, a single frame larger than ``Limits.max_frame_bytes``) get no
offset index and stream whole.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import storage
from ..errors import ManifestError, redact
from ..format.compression import GZIP_MAGIC, ZSTD_MAGIC, ZstdFrames
from ..format.frames import FRAMES_SUFFIX, decode_frames, table_of_frames
from ..format.keys import codec_extension
from ..format.manifest import MANIFEST_NAME, Manifest, ShardInfo, encode_offsets
from ..format.tar import scan_shard
from ..storage.urls import join_url, parent_url
from .writer import write_manifest

__all__ = ["index_shards"]

log = logging.getLogger(__name__)


def _hashing(chunks: Iterator[bytes], sha: Any, size: list[int], walk: list[ZstdFrames | None],
             url: str) -> Iterator[bytes]:
    """The chunks, hashed and counted; a zstd stream's frames walked too (``walk[0]``)."""
    for c in chunks:
        if not size[0]:
            walk.append(ZstdFrames(url) if c[:4] == ZSTD_MAGIC else None)
        if walk[0] is not None:
            walk[0].feed(memoryview(c))
        sha.update(c)
        size[0] += len(c)
        yield c


def _index_one(url: str, out: str, io: storage.IOOptions) -> tuple[ShardInfo, dict[str, int]]:
    sha = hashlib.sha256()
    size = [0]
    walk: list[ZstdFrames | None] = []
    raw = _hashing(storage.iter_chunks(url, 0, None, io), sha, size, walk, url)
    first = next(raw, b"")
    compression = "zstd" if first[:4] == ZSTD_MAGIC else "gzip" if first[:2] == GZIP_MAGIC else None

    def again(chunks: Iterator[bytes]) -> Iterator[bytes]:
        if first:
            yield first
        yield from chunks

    keys, offsets, fields = scan_shard(storage.decompressing_chunks(again(raw), url), url, limits=io.limits)
    for _ in raw:  # hash any bytes after the end-of-archive marker too
        pass
    name = url.rsplit("/", 1)[-1]
    rel = name if parent_url(url).rstrip("/") == out.rstrip("/") else url
    index = frames = None
    table = None
    if compression == "zstd" and walk[0] is not None:
        table = table_of_frames(walk[0].frames, size[0])
        try:  # the reader's own checks: a table it would refuse is not written
            table = decode_frames(table.encode(), url, size[0], io.limits) if table is not None else None
        except ManifestError as e:
            log.info("%s: no frame table (it streams whole): %s", redact(url), redact(str(e)))
            table = None
    if compression is None or table is not None:
        index = name + ".idx.npy"
        with storage.open_output(join_url(out, index), io) as f:
            f.write(encode_offsets(offsets))
    if table is not None:
        frames = name + FRAMES_SUFFIX
        with storage.open_output(join_url(out, frames), io) as f:
            f.write(table.encode())
    info = ShardInfo(url=rel, samples=len(keys), bytes=size[0], sha256=sha.hexdigest(), index=index,
                     compression=compression, frames=frames)
    return info, fields


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
