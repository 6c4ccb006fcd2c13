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
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import storage
from .errors import ManifestError, SourceError
from .format.manifest import JOURNAL_SUFFIX, MANIFEST_NAME, Manifest, ShardInfo, check_counts, decode_offsets, decode_sizes, manifest_from_journal
from .storage.urls import escapes_folder
from .urls import SHARD_SUFFIXES, expand_urls, has_glob, join_url, parent_url

__all__ = ["Source", "SourcePart", "ShardSet", "resolve_source", "load_manifest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """One dataset among the sources of a :class:`~shardflow.ShardDataset`.

    A plain URL, folder or pattern in a list of sources is a source of its own;
    a :class:`Source` adds a weight or storage options to one. Every sample
    carries ``__source__``, the index of its source in the list.

    Args:
        url: a folder, a manifest URL, a shard URL, a brace pattern or glob,
            parts joined by ``::``, or a list of shard URLs.
        weight: share of the source in each epoch of a weighted mixture (with
            ``samples_per_epoch``; see :mod:`shardflow.mixing`). Positive and
            finite; relative (weights need not sum to 1). Either every source
            of a dataset has a weight or none has.
        storage_options: fsspec options for this source's shards (merged over
            the dataset's own, this source's winning).
        name: a label for logs and ``shardflow inspect`` (default: the URL).

    Raises:
        ValueError: an empty URL, or a weight that is not a positive finite number.
    """

    url: str | os.PathLike | Sequence[str]
    weight: float | None = None
    storage_options: Mapping[str, Any] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        url = self.url
        if isinstance(url, os.PathLike):
            url = os.fspath(url)
        if isinstance(url, (list, tuple)):
            url = tuple(os.fspath(u) for u in url)
        if not url:
            raise ValueError("Source: url must be a non-empty URL, path, pattern or list of shard URLs")
        object.__setattr__(self, "url", url)
        if self.weight is not None:
            w = self.weight
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                raise ValueError(f"Source {self.label}: weight must be a positive finite number, got {w!r}")
            object.__setattr__(self, "weight", float(w))
        if self.storage_options is not None:
            object.__setattr__(self, "storage_options", dict(self.storage_options))

    @property
    def label(self) -> str:
        """The name, or the URL (the first one and a count, for a list)."""
        if self.name:
            return self.name
        if isinstance(self.url, tuple):
            return self.url[0] + (f" (+{len(self.url) - 1} more)" if len(self.url) > 1 else "")
        return str(self.url)


@dataclass(frozen=True)
class SourcePart:
    """Where one source's shards lie in a :class:`ShardSet`.

    Attributes:
        label: the source's name or URL.
        start: first shard number of the source (stream order of the set).
        stop: one past its last shard number.
        weight: its mixture weight, or None.
        sized: True when the source's sample counts are known (a manifest).
        manifest_url: the manifest it was read from, or None.
        storage_options: its own fsspec options, or None.
    """

    label: str
    start: int
    stop: int
    weight: float | None = None
    sized: bool = False
    manifest_url: str | None = None
    storage_options: Mapping[str, Any] | None = None


@dataclass
class ShardSet:
    """Shards to read, resolved from one or several sources.

    Attributes:
        urls: absolute shard URLs in stream order (the sources' shards one
            source after the other).
        manifest: the manifest restricted to ``urls`` (same order; for several
            sources, their manifests joined, with absolute shard URLs), or None
            when some shard has no sample count.
        index_urls: offset index URL per shard (None where there is none).
        parts: one entry per source, in source order.
    """

    urls: list[str]
    manifest: Manifest | None
    index_urls: list[str | None]
    parts: tuple[SourcePart, ...] = ()

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = (SourcePart(self.urls[0] if self.urls else "", 0, len(self.urls), sized=self.manifest is not None,
                                     manifest_url=self.manifest.url if self.manifest is not None else None),)
        self._options: dict[int, tuple[storage.IOOptions, storage.IOOptions]] = {}
        self._stops = np.asarray([p.stop for p in self.parts], dtype=np.int64)

    @property
    def counts(self) -> np.ndarray | None:
        """int64 samples per shard, or None without a manifest."""
        if self.manifest is None:
            return None
        return np.asarray([s.samples for s in self.manifest.shards], dtype=np.int64)

    @property
    def source_of(self) -> np.ndarray:
        """int64 source index of every shard."""
        out = np.zeros(len(self.urls), dtype=np.int64)
        for i, part in enumerate(self.parts):
            out[part.start : part.stop] = i
        return out

    @property
    def weights(self) -> list[float] | None:
        """The sources' mixture weights, or None when the sources have none."""
        if all(p.weight is None for p in self.parts):
            return None
        return [float(p.weight or 0.0) for p in self.parts]

    def unsized_reason(self) -> str:
        """Which sources lack sample counts, and what to do about it (for error messages)."""
        if len(self.parts) == 1:
            return f"{self.parts[0].label} has no manifest (shardflow.json) with sample counts; write one with `shardflow index`"
        names = ", ".join(f"{i} ({p.label})" for i, p in enumerate(self.parts) if not p.sized)
        return f"source {names} has no manifest (shardflow.json) with sample counts; write one with `shardflow index` for each"

    def part_of(self, shard: int) -> int:
        """The source index of shard number ``shard``."""
        return int(np.searchsorted(self._stops, shard, side="right"))

    def options_for(self, shard: int, options: storage.IOOptions) -> storage.IOOptions:
        """The storage options to read shard number ``shard`` with: ``options``, with
        its source's own ``storage_options`` merged over them."""
        i = self.part_of(shard)
        own = self.parts[i].storage_options
        if not own:
            return options
        hit = self._options.get(i)
        if hit is None or hit[0] is not options:
            hit = (options, replace(options, storage_options={**options.storage_options, **own}))
            self._options[i] = hit
        return hit[1]

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
        data = _read_all(url, self.options_for(shard, options))
        info = self.manifest.shards[shard]
        return decode_offsets(data, url, info.samples, info.bytes)


def _costs_of(source: ShardSet, column: str, options: storage.IOOptions) -> np.ndarray:
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
        # (a union's joined manifest has no URL: its entries were resolved and checked when joined)
        url = listed_url(folder, info.sizes, m.url, "sizes index", options) if m.url else info.sizes
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
                "folder (pass io=IOOptions(trust_manifest_urls=True), or --trust-manifest-urls on the command "
                "line, to open it anyway)",
                reason="manifest_url",
            )
    return join_url(folder, rel)


def _from_manifest(
    manifest: Manifest, murl: str, options: storage.IOOptions, urls: Sequence[str] | None = None
) -> ShardSet:
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
        data = _read_all(murl, options)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    manifest = Manifest.loads(data, url=murl)
    check_counts(manifest, options.limits)
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
            manifest = manifest_from_journal(_read_all(journal, options), murl)
            check_counts(manifest, options.limits)
            log.warning("%s: no manifest; replaying the journal of an interrupted writer (%d complete shards)",
                        source, len(manifest.shards))
            return _from_manifest(manifest, murl, options)
        found = [u for u in storage.list_glob(join_url(source, "*"), options) if u.endswith(SHARD_SUFFIXES)]
        if not found:
            raise FileNotFoundError(f"{source}: no shardflow.json and no .tar shards in this folder")
        return ShardSet(found, None, [None] * len(found))  # its manifest was looked for first: there is none
    elif as_given:
        urls = [source]
    else:
        urls = expand_urls(source, options.storage_options)
    if not urls:
        raise FileNotFoundError("the source lists no shards")
    return _sibling_manifest(urls, options, cache) or ShardSet(urls, None, [None] * len(urls))


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
