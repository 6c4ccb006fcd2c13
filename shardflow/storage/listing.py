"""Glob listing and shard URL patterns (braces, globs, ``::``), on any fsspec store.

Globs (``*``, ``?``, ``[``) are matched on the URL's fsspec filesystem and sorted; a
glob is never opened as a literal name.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Mapping
from typing import Any

from .backends.filesystems import filesystem, is_http
from .options import DEFAULT_OPTIONS, IOOptions
from .urls import expand_braces, has_glob, protocol

__all__ = ["expand_urls", "list_glob"]


def list_glob(pattern: str, options: IOOptions = DEFAULT_OPTIONS, *, canonical: bool = False) -> list[str]:
    """Sorted URLs matching a glob pattern.

    By default they are written in the pattern's own form: ``s3://b/train-*.tar``
    gives ``["s3://b/train-0.tar", ...]`` and a local relative pattern gives relative
    paths. ``canonical=True`` writes them as the filesystem names them instead
    (absolute local paths, ``memory:///x`` for ``memory://x``). ``**`` matches across
    directories.
    """
    pattern = os.fspath(pattern)
    proto = protocol(pattern)
    if not proto and not canonical:
        return sorted(glob.glob(pattern, recursive=True))
    fs, path = filesystem(pattern, options)
    with contextlib.suppress(Exception):
        fs.invalidate_cache()
    matches = fs.glob(path)
    if canonical:
        if "://" not in pattern:
            return sorted(matches)
        return sorted(_same_scheme(fs.unstrip_protocol(m), proto, fs) for m in matches)
    if is_http(fs):
        return sorted(matches)
    rest = pattern.split("://", 1)[1]
    out = []
    for match in matches:
        if "://" in match:  # adlfs names az:// matches abfs://: keep the pattern's scheme
            match = match.split("://", 1)[1]
        if match.startswith("/") and not rest.startswith("/"):
            match = match.lstrip("/")
        out.append(f"{proto}://{match}")
    return sorted(out)


def _same_scheme(url: str, proto: str, fs) -> str:
    """``url`` under the scheme the user wrote when it is one of ``fs``'s own
    (adlfs names ``az://`` objects ``abfs://``)."""
    scheme, sep, rest = url.partition("://")
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return f"{proto}://{rest}" if sep and scheme != proto and proto in protocols else url


def expand_urls(source: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Expand a URL pattern into the list of shard URLs.

    Args:
        source: one URL, a brace pattern, a glob, or such parts joined by ``::``.
        storage_options: for listing globs on remote filesystems (flat, or keyed by
            protocol as in :class:`IOOptions`).

    Returns:
        The URLs in order: brace expansions in pattern order, glob matches sorted
        and written as the filesystem names them (see :func:`list_glob`).

    Raises:
        FileNotFoundError: a glob matched nothing.
    """
    options = IOOptions(storage_options=storage_options or {})
    urls: list[str] = []
    for part in source.split("::"):
        for url in expand_braces(part):
            if has_glob(url):
                matches = list_glob(url, options, canonical=True)
                if not matches:
                    raise FileNotFoundError(f"no shards match the glob {url!r}")
                urls.extend(matches)
            else:
                urls.append(url)
    return urls
