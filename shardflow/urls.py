"""Shard URL patterns: brace expansion, globs, and URL joining.

Brace rules follow the webdataset / bash convention:

- ``train-{000000..000009}.tar``: a numeric range, zero-padded to the width of
  the first bound, in order;
- ``{a,b}-{0..1}.tar``: alternatives; several braces in one pattern expand as a
  product, leftmost slowest (``a-0 a-1 b-0 b-1``);
- parts joined by ``::`` expand independently and are concatenated.

Globs (``*``, ``?``, ``[``) are matched on the URL's fsspec filesystem and
sorted; zero matches is an error. A glob is never opened as a literal name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["expand_braces", "expand_urls", "has_glob", "join_url", "parent_url", "protocol_of", "SHARD_SUFFIXES"]

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.zstd")
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{a..b}`` ranges and ``{x,y}`` alternatives (not ``::``).

    Raises:
        ValueError: a range's end is below its start.
    """
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    r = _RANGE.match(body)
    if r:
        lo, hi = r.group(1), r.group(2)
        a, b = int(lo), int(hi)
        if b < a:
            raise ValueError(f"brace range {{{body}}} in {pattern!r} ends before it starts")
        width = len(lo.lstrip("-")) if lo.lstrip("-").startswith("0") else 0
        options = [f"{i:0{width}d}" for i in range(a, b + 1)]
    elif "," in body:
        options = body.split(",")
    else:
        options = ["{" + body + "}"]  # a literal brace: leave it
        head, tail = pattern[: m.end()], pattern[m.end() :]
        return [head + rest for rest in expand_braces(tail)]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [head + opt + rest for opt in options for rest in expand_braces(tail)]


def has_glob(url: str) -> bool:
    """True when the URL's path has glob characters (``*``, ``?``, ``[``).

    For ``http(s)://`` URLs only the path counts: ``?`` starts the query string
    (presigned URLs), and globs cannot be listed there anyway.
    """
    proto, sep, path = url.partition("://")
    if not sep:
        path = url
    elif proto in ("http", "https"):
        path = path.split("?", 1)[0]
        return "*" in path or "[" in path
    return any(c in path for c in "*?[")


def protocol_of(url: str) -> str:
    """The fsspec protocol of a URL (``"file"`` for plain paths)."""
    return url.split("://", 1)[0] if "://" in url else "file"


def parent_url(url: str) -> str:
    """The folder part of a URL or path (``s3://b/x/y.tar`` -> ``s3://b/x``)."""
    if "://" in url:
        proto, path = url.split("://", 1)
        head = path.rsplit("/", 1)[0] if "/" in path else path
        return f"{proto}://{head}"
    import os

    return os.path.dirname(url) or "."


def join_url(base: str, rel: str) -> str:
    """Resolve ``rel`` against the folder ``base``; absolute URLs/paths are kept."""
    if "://" in rel or rel.startswith("/"):
        return rel
    if not base or base == ".":
        return rel
    return base.rstrip("/") + "/" + rel


def expand_urls(source: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Expand a URL pattern into the list of shard URLs.

    Args:
        source: one URL, a brace pattern, a glob, or such parts joined by ``::``.
        storage_options: for listing globs on remote filesystems.

    Returns:
        The URLs in order: brace expansions in pattern order, glob matches sorted.

    Raises:
        FileNotFoundError: a glob matched nothing.
    """
    urls: list[str] = []
    for part in source.split("::"):
        for url in expand_braces(part):
            if has_glob(url):
                matches = _glob(url, storage_options or {})
                if not matches:
                    raise FileNotFoundError(f"no shards match the glob {url!r}")
                urls.extend(matches)
            else:
                urls.append(url)
    return urls


def _glob(pattern: str, storage_options: Mapping[str, Any]) -> list[str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(pattern, **storage_options)
    found = sorted(fs.glob(path))
    if "://" not in pattern:
        return found
    return [fs.unstrip_protocol(m) for m in found]
