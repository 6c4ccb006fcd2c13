"""Resolving a dataset source into shard URLs and, where there is one, a manifest.

A source is a folder (with ``shardflow.json``, or else its ``.tar*`` files), a
manifest URL (``.../shardflow.json``), a brace pattern or glob, parts joined by
``::``, or a list of URLs (kept as given). When the URLs come without the
manifest, a ``shardflow.json`` in their folder that lists all of them still
supplies sample counts and offset indexes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import storage
from .errors import ManifestError
from .format.manifest import JOURNAL_SUFFIX, MANIFEST_NAME, Manifest, ShardInfo, check_counts, decode_offsets, decode_sizes, manifest_from_journal
from .storage.urls import escapes_folder
from .urls import SHARD_SUFFIXES, expand_urls, has_glob, join_url, parent_url

__all__ = ["Source", "resolve_source", "load_manifest"]

log = logging.getLogger(__name__)


@dataclass
class Source:
    """Shards to read.

    Attributes:
        urls: absolute shard URLs in stream order.
        manifest: the manifest restricted to ``urls`` (same order), or None.
        index_urls: offset index URL per shard (None where there is none).
    """

    urls: list[str]
    manifest: Manifest | None
    index_urls: list[str | None]

    @property
    def counts(self) -> np.ndarray | None:
        """int64 samples per shard, or None without a manifest."""
        if self.manifest is None:
            return None
        return np.asarray([s.samples for s in self.manifest.shards], dtype=np.int64)

    def load_costs(self, column: str, options: storage.IOOptions) -> np.ndarray:
        """int64 per-sample values of a size column (``num_nodes``, ...), shards in order.

        Raises:
            ManifestError: no manifest, no such column, or a shard without a sizes index.
        """
        return _costs_of(self, column, options)

    def load_offsets(self, shard: int, options: storage.IOOptions) -> np.ndarray | None:
        """The offset index of shard number ``shard``, or None if it has none."""
        url = self.index_urls[shard]
        if url is None or self.manifest is None:
            return None
        data = _read_all(url, options)
        info = self.manifest.shards[shard]
        return decode_offsets(data, url, info.samples, info.bytes)


def _costs_of(source: "Source", column: str, options: storage.IOOptions) -> np.ndarray:
    m = source.manifest
    if m is None:
        raise ManifestError("batching by cost needs a manifest with per-sample sizes")
    columns = list(m.meta.get("size_columns", []))
    if column not in columns:
        raise ManifestError(
            f"{m.url}: no per-sample size {column!r} to batch by (the manifest has {columns or 'none'}); "
            "graph shards written by shardflow record num_nodes and num_edges"
        )
    out = []
    folder = parent_url(m.url) if m.url else ""
    for info in m.shards:
        if not info.sizes:
            raise ManifestError(f"{m.url}: shard {info.url} has no sizes index, so it cannot be batched by cost")
        url = listed_url(folder, info.sizes, m.url or "<manifest>", "sizes index", options)
        out.append(decode_sizes(_read_all(url, options), url, info.samples, len(columns))[:, columns.index(column)])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _read_all(url: str, options: storage.IOOptions) -> bytes:
    return b"".join(storage.iter_chunks(url, 0, None, options))


def load_manifest(url: str, options: storage.IOOptions) -> Manifest:
    """Read and parse a manifest.

    Raises:
        ManifestError: unreadable or invalid, or a shard declares more samples
            than its size can hold (see :func:`~shardflow.format.manifest.check_counts`).
    """
    try:
        data = _read_all(url, options)
    except FileNotFoundError as e:
        raise ManifestError(f"{url}: manifest not found") from e
    manifest = Manifest.loads(data, url=url)
    check_counts(manifest, options.limits)
    return manifest


def _is_dir(url: str, options: storage.IOOptions) -> bool:
    if url.endswith(SHARD_SUFFIXES):  # a shard, not a folder (an HTTP "isdir" would download it)
        return False
    return storage.is_dir(url, options)


def listed_url(folder: str, rel: str, murl: str, what: str, options: storage.IOOptions) -> str:
    """A URL that a manifest lists, resolved against its folder, and kept inside it.

    Args:
        folder: the manifest's folder.
        rel: the URL as listed.
        murl: the manifest's URL, for errors.
        what: what is listed (``"shard"``, ``"offset index"``, ...), for errors.
        options: ``options.trust_manifest_urls`` lifts the containment.

    Raises:
        ManifestError: (reason ``"manifest_url"``) ``rel`` is absolute, another
            protocol, an fsspec ``::`` chain, or leaves the folder. The message
            quotes the listed name, nothing read from it.
    """
    if not options.trust_manifest_urls:
        why = escapes_folder(rel)
        if why is not None:
            raise ManifestError(
                f"{murl}: the {what} URL {rel!r} {why}: a manifest's URLs must be relative paths under its "
                "folder (pass io=IOOptions(trust_manifest_urls=True) to open it anyway)",
                reason="manifest_url",
            )
    return join_url(folder, rel)


def _from_manifest(
    manifest: Manifest, murl: str, options: storage.IOOptions, urls: Sequence[str] | None = None
) -> Source:
    folder = parent_url(murl)
    chosen: list[ShardInfo]
    if urls is None:
        chosen = list(manifest.shards)
        full = [listed_url(folder, s.url, murl, "shard", options) for s in chosen]
    else:  # the user's own URLs, matched to the manifest's entries
        by_url = {join_url(folder, s.url): s for s in manifest.shards}
        full = list(urls)
        chosen = [by_url[u] for u in full]
    sub = Manifest(shards=chosen, fields=manifest.fields, meta=manifest.meta, url=murl)
    index = [listed_url(folder, s.index, murl, "offset index", options) if s.index else None for s in chosen]
    return Source(urls=full, manifest=sub, index_urls=index)


def _sibling_manifest(urls: list[str], options: storage.IOOptions) -> Source | None:
    folders = {parent_url(u) for u in urls}
    if len(folders) != 1:
        return None
    murl = join_url(folders.pop(), MANIFEST_NAME)
    try:
        if not storage.exists(murl, options):
            return None
        manifest = load_manifest(murl, options)
    except (ManifestError, OSError) as e:
        log.warning("ignoring the manifest beside the shards: %s", e)
        return None
    folder = parent_url(murl)
    listed = {join_url(folder, s.url) for s in manifest.shards}
    if not all(u in listed for u in urls):
        return None
    return _from_manifest(manifest, murl, options, urls)


def _home(url: str) -> str:
    """``~`` and ``~user`` expanded in a local path, as a shell would (URLs unchanged)."""
    return os.path.expanduser(url) if url.startswith("~") else url


def resolve_source(source: str | os.PathLike | Sequence[str], options: storage.IOOptions) -> Source:
    """Turn a dataset source into a :class:`Source`.

    Args:
        source: folder, manifest URL, pattern (braces, globs, ``::``), or list of URLs.
        options: storage options.

    Raises:
        FileNotFoundError: no shards found (empty folder, a glob with no match).
        ManifestError: an invalid manifest.
        TypeError: ``source`` is of another type.
    """
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        source = _home(source)
        if source.endswith(".json"):
            return _from_manifest(load_manifest(source, options), source, options)
        if _is_dir(source, options):
            murl = join_url(source, MANIFEST_NAME)
            if storage.exists(murl, options):
                return _from_manifest(load_manifest(murl, options), murl, options)
            journal = murl + JOURNAL_SUFFIX
            if storage.exists(journal, options):
                # a ShardWriter that never closed (killed): the shards it finished
                manifest = manifest_from_journal(_read_all(journal, options), murl)
                check_counts(manifest, options.limits)
                log.warning("%s: no manifest; replaying the journal of an interrupted writer (%d complete shards)",
                            source, len(manifest.shards))
                return _from_manifest(manifest, murl, options)
            found = [u for u in storage.list_glob(join_url(source, "*"), options) if u.endswith(SHARD_SUFFIXES)]
            if not found:
                raise FileNotFoundError(f"{source}: no shardflow.json and no .tar shards in this folder")
            return _sibling_manifest(found, options) or Source(found, None, [None] * len(found))
        urls = expand_urls(source, options.storage_options)
    elif isinstance(source, Sequence):
        urls = [os.fspath(u) for u in source]
        if not all(isinstance(u, str) for u in urls):
            raise TypeError("a list source must hold URL strings")
        urls = [_home(u) for u in urls]
        globbed = [u for u in urls if has_glob(u)]
        if globbed:
            raise ValueError(
                f"list entries are shard URLs used as given, and {globbed[0]!r} has glob characters: pass the "
                "pattern as a string source to expand it (a '*' is never opened as a literal name)"
            )
    else:
        raise TypeError(f"source must be a folder, URL, pattern or list of URLs, got {type(source).__name__}")
    if not urls:
        raise FileNotFoundError("the source lists no shards")
    return _sibling_manifest(urls, options) or Source(urls, None, [None] * len(urls))
