"""Resolving dataset sources into shard URLs and, where there are some, manifests.

A source is a folder (its ``shardflow.json`` is read first; without one its
``.tar*`` files are listed), a manifest URL (``.../shardflow.json``), a brace
pattern or glob, parts joined by ``::``, or a :class:`Source` (one of those
with a weight or storage options of its own). A list holds several sources,
each entry one source (a plain string entry is a folder, a manifest or a shard
URL, used as given). When shard URLs come without the manifest, a
``shardflow.json`` in their folder that lists them still supplies sample
counts and offset indexes.

The sources' shards, one source after the other, form one :class:`ShardSet`;
the same shard reached twice is refused (:class:`~shardflow.errors.SourceError`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .. import storage
from ..errors import ManifestError, SourceError, redact
from ..format.journal import manifest_from_journal
from ..format.manifest import JOURNAL_SUFFIX, MANIFEST_NAME, Manifest, ShardInfo
from .shardset import ShardSet, Source, SourcePart, listed_url, read_all
from ..storage.writing.folder import verify_shard
from .listed import check_listed, refuse_unfinished
from ..storage.urls import local_path
from ..urls import SHARD_SUFFIXES, expand_urls, has_glob, join_url, parent_url

__all__ = ["Source", "SourcePart", "ShardSet", "resolve_source", "load_manifest", "listed_url"]

log = logging.getLogger(__name__)


def load_manifest(url: str, options: storage.IOOptions) -> Manifest:
    """Read and parse a manifest.

    Raises:
        ManifestError: unreadable or invalid, or a shard declares more samples
            than its size can hold (see :func:`~shardflow.sources.listed.check_listed`).
    """
    try:
        data = read_all(url, options)
    except FileNotFoundError as e:
        raise ManifestError(f"{url}: manifest not found") from e
    manifest = Manifest.loads(data, url=url)
    check_listed(manifest, options)
    return manifest


def _is_dir(url: str, options: storage.IOOptions) -> bool:
    if url.endswith(SHARD_SUFFIXES):  # a shard, not a folder (an HTTP "isdir" would download it)
        return False
    return storage.is_dir(url, options)


def _from_manifest(
    manifest: Manifest, murl: str, options: storage.IOOptions, urls: Sequence[str] | None = None
) -> ShardSet:
    folder = parent_url(murl)
    refuse_unfinished(folder, manifest, options)
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
    return ShardSet(urls=full, manifest=sub, index_urls=index)


def _sibling_manifest(urls: list[str], options: storage.IOOptions, cache: dict[str, Manifest | None] | None = None) -> ShardSet | None:
    folders = {parent_url(u) for u in urls}
    if len(folders) != 1:
        return None
    murl = join_url(folders.pop(), MANIFEST_NAME)
    if cache is not None and murl in cache:
        manifest = cache[murl]
    else:
        try:
            manifest = load_manifest(murl, options) if storage.exists(murl, options) else None
        except (ManifestError, OSError) as e:
            log.warning("ignoring the manifest beside the shards: %s", e)
            manifest = None
        if cache is not None:
            cache[murl] = manifest
    if manifest is None:
        return None
    folder = parent_url(murl)
    listed = {join_url(folder, s.url) for s in manifest.shards}
    if not all(u in listed for u in urls):
        return None
    return _from_manifest(manifest, murl, options, urls)


def _home(url: str) -> str:
    """``~`` and ``~user`` expanded in a local path, as a shell would (URLs unchanged)."""
    return os.path.expanduser(url) if url.startswith("~") else url


def _folder_manifest(folder: str, options: storage.IOOptions) -> Manifest | None:
    """The folder's ``shardflow.json``, read directly (no listing, no existence check first);
    None when there is none."""
    if has_glob(folder) or "{" in folder or "::" in folder or folder.endswith(SHARD_SUFFIXES):
        return None
    murl = join_url(folder, MANIFEST_NAME)
    try:
        data = read_all(murl, options)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    manifest = Manifest.loads(data, url=murl)
    check_listed(manifest, options)
    return manifest


def _resolve_one(source: str, options: storage.IOOptions, cache: dict[str, Manifest | None] | None = None, *, as_given: bool = False) -> ShardSet:
    """One source: a manifest, a folder, a pattern, or (``as_given``) one shard URL."""
    source = _home(source)
    if source.endswith(".json"):
        return _from_manifest(load_manifest(source, options), source, options)
    manifest = _folder_manifest(source, options)
    if manifest is not None:  # one request for a folder with a manifest: no listing
        return _from_manifest(manifest, join_url(source, MANIFEST_NAME), options)
    if as_given and source.endswith(SHARD_SUFFIXES):
        urls = [source]
    elif _is_dir(source, options):
        murl = join_url(source, MANIFEST_NAME)
        journal = murl + JOURNAL_SUFFIX
        if storage.exists(journal, options):
            # a ShardWriter that never closed (killed): the shards it finished
            # its last entry without a commit line counts only if the shard is whole at its name
            folder = os.path.abspath(local_path(source)) if storage.is_local(source) else None
            verify = (lambda s: verify_shard(folder, s)) if folder else None
            manifest = manifest_from_journal(read_all(journal, options), murl, verify)
            check_listed(manifest, options)
            log.warning("%s: no manifest; replaying the journal of an interrupted writer (%d complete shards)",
                        redact(source), len(manifest.shards))
            return _from_manifest(manifest, murl, options)
        refuse_unfinished(source, None, options)  # a writer's shards, before its manifest
        found = [u for u in storage.list_glob(join_url(source, "*"), options) if u.endswith(SHARD_SUFFIXES)]
        if not found:
            raise FileNotFoundError(f"{source}: no shardflow.json and no .tar shards in this folder")
        return ShardSet(found, None, [None] * len(found))  # its manifest was looked for first: there is none
    elif as_given:
        urls = [source]
    else:
        _refuse_missing_folder(source, options)
        urls = expand_urls(source, options.storage_options)
    if not urls:
        raise FileNotFoundError("the source lists no shards")
    for folder in sorted({parent_url(u) for u in urls if storage.is_local(u)}):
        refuse_unfinished(folder, None, options)  # shards a writer holds: a manifest or not
    return _sibling_manifest(urls, options, cache) or ShardSet(urls, None, [None] * len(urls))


def _refuse_missing_folder(source: str, options: storage.IOOptions) -> None:
    """Raise now for a path or URL that names no file, folder or pattern (a misspelt folder,
    bucket or prefix), rather than when its one "shard" is first read.

    Raises:
        FileNotFoundError: ``source`` has no shard suffix, glob or brace pattern, and nothing
            exists there (a remote one: one existence request, made only on this path).
    """
    if source.endswith(SHARD_SUFFIXES) or has_glob(source) or "{" in source or "::" in source:
        return
    if not storage.is_local(source):
        if not storage.exists(source, options):
            raise FileNotFoundError(
                f"{redact(source)}: nothing at this URL: no shardflow.json, no shards under it and no object "
                "named so (check the bucket and the prefix for a typo)"
            )
        return
    path = local_path(source)
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"{source}: no such folder or file (a dataset is a folder of shards, its shardflow.json, "
            "a shard, or a pattern such as 'train-{000000..000009}.tar')"
        )


def _resolve_entry(entry: Any, options: storage.IOOptions, cache: dict[str, Manifest | None]) -> tuple[ShardSet, Source]:
    if isinstance(entry, Source):
        spec = entry
        io = replace(options, storage_options={**options.storage_options, **spec.storage_options}) if spec.storage_options else options
        if isinstance(spec.url, tuple):
            return _resolve_list(list(spec.url), io, cache), spec
        return _resolve_one(str(spec.url), io), spec
    if isinstance(entry, os.PathLike):
        entry = os.fspath(entry)
    if not isinstance(entry, str):
        raise TypeError(f"a list source holds URLs, paths or shardflow.Source values, got {type(entry).__name__}")
    if has_glob(entry):
        raise ValueError(
            f"list entries are used as given, and {entry!r} has glob characters: wrap the pattern as "
            f"shardflow.Source({entry!r}) (or pass it as a string source) to expand it (a '*' is never "
            "opened as a literal name)"
        )
    return _resolve_one(entry, options, cache, as_given=True), Source(entry)


def _resolve_list(urls: list[str], options: storage.IOOptions, cache: dict[str, Manifest | None]) -> ShardSet:
    """A list of shard URLs used as given (one source)."""
    urls = [_home(os.fspath(u)) for u in urls]
    if not all(isinstance(u, str) for u in urls):
        raise TypeError("a list source must hold URL strings")
    if not urls:
        raise FileNotFoundError("the source lists no shards")
    return _sibling_manifest(urls, options, cache) or _join([_resolve_one(u, options, cache, as_given=True) for u in urls], None, options)


def _dedupe_key(url: str) -> str:
    if "://" in url and not url.startswith("file://"):
        return url
    return os.path.abspath(url[7:] if url.startswith("file://") else url)


def _join(sets: Sequence[ShardSet], specs: Sequence[Source] | None, options: storage.IOOptions) -> ShardSet:
    """The sources' shards one after the other, as one :class:`ShardSet`.

    Raises:
        SourceError: a shard is reached twice (the same shard in two sources, a
            list with a repeat, or overlapping patterns).
    """
    urls: list[str] = []
    index: list[str | None] = []
    parts: list[SourcePart] = []
    seen: dict[str, int] = {}
    for i, ss in enumerate(sets):
        spec = specs[i] if specs is not None else None
        for u in ss.urls:
            key = _dedupe_key(u)
            if key in seen:
                where = f"by source {seen[key]} and by source {i}" if specs is not None and seen[key] != i else (
                    f"twice by source {i}" if specs is not None else "twice")
                raise SourceError(
                    f"{u}: the same shard is reached {where} ({_labels(specs, seen[key], i)}); each shard may be read "
                    "once per pass: remove the repeated entry or make the patterns disjoint"
                )
            seen[key] = i
        m = ss.manifest
        parts.append(SourcePart(
            label=spec.label if spec is not None else (ss.urls[0] if ss.urls else ""),
            start=len(urls), stop=len(urls) + len(ss.urls),
            weight=spec.weight if spec is not None else None, sized=m is not None,
            manifest_url=m.url if m is not None else None,
            storage_options=spec.storage_options if spec is not None else None,
        ))
        urls.extend(ss.urls)
        index.extend(ss.index_urls)
    manifests = [ss.manifest for ss in sets]
    if any(m is None for m in manifests):
        return ShardSet(urls, None, index, tuple(parts))
    return ShardSet(urls, _join_manifests([m for m in manifests if m is not None], options), index, tuple(parts))


def _labels(specs: Sequence[Source] | None, a: int, b: int) -> str:
    if specs is None:
        return "a list of shard URLs"
    return "; ".join(f"source {j}: {specs[j].label}" for j in sorted({a, b}))


def _join_manifests(manifests: list[Manifest], options: storage.IOOptions) -> Manifest:
    """Several manifests as one, shard URLs (and their index and sizes files) resolved
    against their own manifest's folder (and kept inside it, see :func:`listed_url`)."""
    urls = {m.url for m in manifests}
    if len(urls) == 1:
        only = manifests[0]
        return Manifest(shards=[s for m in manifests for s in m.shards], fields=only.fields, meta=only.meta, url=only.url)
    shards: list[ShardInfo] = []
    fields: dict[str, str] = {}
    for m in manifests:
        folder = parent_url(m.url) if m.url else ""
        where = m.url or "<manifest>"
        for info in m.shards:
            shards.append(replace(
                info, url=listed_url(folder, info.url, where, "shard", options),
                index=listed_url(folder, info.index, where, "offset index", options) if info.index else None,
                sizes=listed_url(folder, info.sizes, where, "sizes index", options) if info.sizes else None,
                frames=listed_url(folder, info.frames, where, "frame table", options) if info.frames else None,
            ))
        fields.update(m.fields)
    metas = [m.meta for m in manifests]
    if all(meta == metas[0] for meta in metas):
        meta = dict(metas[0])
    else:
        meta = {"sources": metas}
        columns = [tuple(meta_i.get("size_columns", ())) for meta_i in metas]
        if all(c == columns[0] for c in columns) and columns[0]:
            meta["size_columns"] = list(columns[0])
    return Manifest(shards=shards, fields=fields, meta=meta, url=None)


def resolve_source(source: Any, options: storage.IOOptions) -> ShardSet:
    """Turn a dataset source into a :class:`ShardSet`.

    Args:
        source: a folder (its ``shardflow.json`` is read first; the folder is
            listed only when there is none), a manifest URL, a pattern (braces,
            globs, ``::``), a :class:`Source`, or a list of sources: each entry
            a :class:`Source`, a folder, a manifest URL or a shard URL (used as
            given), one source each; or a :class:`ShardSet` (returned as is).
        options: storage options.

    Raises:
        FileNotFoundError: no shards found (empty folder, a glob with no match).
        ManifestError: an invalid manifest.
        SourceError: the same shard is reached twice.
        IncompleteDatasetError: a writer holds a local folder now, or its manifest says
            its conversion is not complete (:mod:`shardflow.sources.listed`; named, with
            ``IOOptions(allow_incomplete=True)``, the way to read it anyway).
        TypeError: ``source`` is of another type.
        ValueError: a list entry with glob characters.
    """
    if isinstance(source, ShardSet):  # resolved already
        return source
    cache: dict[str, Manifest | None] = {}
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        return _join([_resolve_one(source, options)], [Source(source)], options)
    if isinstance(source, Source):
        ss, spec = _resolve_entry(source, options, cache)
        return _join([ss], [spec], options)
    if isinstance(source, Sequence):
        if not source:
            raise FileNotFoundError("the source lists no shards")
        resolved = [_resolve_entry(e, options, cache) for e in source]
        return _join([r[0] for r in resolved], [r[1] for r in resolved], options)
    raise TypeError(f"source must be a folder, URL, pattern, shardflow.Source or a list of them, got {type(source).__name__}")
