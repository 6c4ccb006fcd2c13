"""What a resolved source is: :class:`ShardSet` (shard URLs, the manifest, offset indexes),
made of :class:`Source` parts; :mod:`shardflow.sources.source` resolves sources into one."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import storage
from ..errors import ManifestError, redact, redacted_repr
from ..format.frames import FrameTable, decode_frames
from ..format.manifest import Manifest, decode_offsets, decode_sizes
from ..storage.urls import escapes_folder, local_path
from ..urls import join_url, parent_url

__all__ = ["Source", "SourcePart", "ShardSet", "listed_url", "read_all"]


@dataclass(frozen=True, repr=False)
class Source:
    """One dataset among the sources of a :class:`~shardflow.ShardDataset`.

    A plain URL, folder or pattern in a list of sources is a source of its own;
    a :class:`Source` adds a weight or storage options to one. Every sample
    carries ``__source__``, the index of its source in the list.

    Args:
        url: a folder, a manifest URL, a shard URL, a brace pattern or glob,
            parts joined by ``::``, or a list of shard URLs.
        weight: share of the source in each epoch of a weighted mixture (with
            ``samples_per_epoch``; see :mod:`shardflow.planning.mixing`). Positive and
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

    def __repr__(self) -> str:  # never shows a secret (shardflow.errors.redact)
        return redacted_repr(self)

    @property
    def label(self) -> str:
        """The name, or the URL (the first one and a count, for a list)."""
        if self.name:
            return self.name
        if isinstance(self.url, tuple):
            return redact(self.url[0]) + (f" (+{len(self.url) - 1} more)" if len(self.url) > 1 else "")
        return redact(str(self.url))


@dataclass(frozen=True, repr=False)
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

    def __repr__(self) -> str:  # never shows a secret (shardflow.errors.redact)
        return redacted_repr(self)


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
        self._frames: dict[int, FrameTable | None] = {}
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

    def source_by_url(self) -> dict[str, int] | None:
        """Shard URL -> source index, for ``__source__`` (None for a single source: every sample is 0)."""
        if len(self.parts) == 1:
            return None
        return {u: int(i) for u, i in zip(self.urls, self.source_of.tolist())}

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
        data = read_all(url, self.options_for(shard, options))
        info = self.manifest.shards[shard]
        frames = self.load_frames(shard, options)
        return decode_offsets(data, url, info.samples, info.bytes if frames is None else frames.size)

    def load_frames(self, shard: int, options: storage.IOOptions) -> FrameTable | None:
        """The frame table of shard number ``shard`` (a framed ``.tar.zst``), or None if it has
        none; read once, then kept.

        Raises:
            FrameTableError: the table does not fit the shard or the limits.
        """
        if shard in self._frames:
            return self._frames[shard]
        url = self.frames_url(shard, options)
        table = None
        if url is not None:
            opts = self.options_for(shard, options)
            table = decode_frames(read_all(url, opts), url, self.manifest.shards[shard].bytes, opts.limits)  # type: ignore[union-attr]
        self._frames[shard] = table
        return table

    def frames_url(self, shard: int, options: storage.IOOptions) -> str | None:
        """The frame table URL of shard number ``shard`` (one with an offset index), or None."""
        m = self.manifest
        info = m.shards[shard] if m is not None else None
        if m is None or info is None or not info.frames or self.index_urls[shard] is None:
            return None
        return listed_url(parent_url(m.url), info.frames, m.url, "frame table", options) if m.url else info.frames


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
        out.append(decode_sizes(read_all(url, options), url, info.samples, len(columns))[:, columns.index(column)])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def read_all(url: str, options: storage.IOOptions) -> bytes:
    return storage.read_small(url, options, "manifest or index")


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
            protocol, an fsspec ``::`` chain, or leaves the folder, as written or (a
            local folder) through a symbolic link. The message quotes the listed
            name, nothing read from it.
    """
    if not options.trust_manifest_urls:
        why = escapes_folder(rel) or _linked_out(folder, rel)
        if why is not None:
            raise ManifestError(
                f"{murl}: the {what} URL {rel!r} {why}: a manifest's URLs must be relative paths under its "
                "folder (pass io=IOOptions(trust_manifest_urls=True), or --trust-manifest-urls on the command "
                "line, to open it anyway)",
                reason="manifest_url",
            )
    return join_url(folder, rel)


def _linked_out(folder: str, rel: str) -> str | None:
    """Why the local ``folder/rel`` resolves outside ``folder`` through a symbolic link (the
    file or a folder on its way), or None. One ``lstat`` for a name without a folder part
    that is no link; a missing file is left to the read that opens it."""
    if not storage.is_local(folder):
        return None
    base = local_path(folder) or "."
    path = os.path.join(base, rel)
    if "/" not in rel and not os.path.islink(path):
        return None
    root = os.path.realpath(base)
    if os.path.commonpath([root, os.path.realpath(path)]) == root:
        return None  # no link, or one that stays inside the folder
    return "is a symbolic link (or lies under one) to a file outside the manifest's folder"
