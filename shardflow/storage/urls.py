"""URL and path strings: protocols, joining, brace patterns (no I/O here).

Brace rules follow the webdataset / bash convention:

- ``train-{000000..000009}.tar``: a numeric range, zero-padded to the width of
  the first bound, in order;
- ``{a,b}-{0..1}.tar``: alternatives; several braces in one pattern expand as a
  product, leftmost slowest (``a-0 a-1 b-0 b-1``);
- parts joined by ``::`` expand independently and are concatenated.

Globs are listed by :mod:`shardflow.storage.listing`.
"""

from __future__ import annotations

import os
import posixpath
import re
from urllib.parse import unquote, urljoin

from ..compat.fsspec import strip_protocol
from ..format.compression import SHARD_SUFFIXES

__all__ = [
    "LOCAL_PROTOCOLS",
    "SHARD_SUFFIXES",
    "escapes_folder",
    "expand_braces",
    "has_glob",
    "is_local",
    "join_url",
    "local_path",
    "parent_url",
    "protocol",
    "protocol_of",
]

LOCAL_PROTOCOLS = frozenset({"", "file", "local"})
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def protocol(url: str) -> str:
    """The fsspec protocol of a URL, ``""`` for a plain path.

    fsspec's ``split_protocol`` rule, without importing fsspec (local work never
    needs it): the text before ``://`` when longer than one letter (one letter is
    a Windows drive), ``data`` for a ``data:`` URL.
    """
    if "://" in url:
        proto = url.split("://", 1)[0]
        if len(proto) > 1:
            return proto
    return "data" if url.startswith("data:") else ""


def protocol_of(url: str) -> str:
    """The fsspec protocol of a URL (``"file"`` for plain paths)."""
    return url.split("://", 1)[0] if "://" in url else "file"


def is_local(url: str) -> bool:
    """Whether ``url`` is a local path or ``file://`` URL (no request per open)."""
    return protocol(os.fspath(url)) in LOCAL_PROTOCOLS


def local_path(url: str) -> str:
    """The path of a local URL (``file:///a/b`` -> ``/a/b``); a plain path unchanged."""
    if not protocol(url):
        return url
    from fsspec.implementations.local import LocalFileSystem

    return strip_protocol(LocalFileSystem, url)


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


def parent_url(url: str) -> str:
    """The folder part of a URL or path (``s3://b/x/y.tar`` -> ``s3://b/x``)."""
    if "://" in url:
        proto, path = url.split("://", 1)
        head = path.rsplit("/", 1)[0] if "/" in path else path
        return f"{proto}://{head}"
    return os.path.dirname(url) or "."


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def escapes_folder(rel: str) -> str | None:
    """Why ``rel`` would not resolve inside the folder it is joined to, or None if it does.

    A contained path is relative (no ``/`` or ``~`` start, no drive letter, no
    ``scheme:`` such as ``file:``/``http:``/``s3:``, no ``::`` chain, no
    backslash) and stays below the folder once ``..`` segments are resolved, as
    written and percent-decoded (an HTTP server decodes ``%2e%2e``).
    """
    if not rel:
        return "is empty"
    if "::" in rel:
        return "is an fsspec '::' chain"
    if _SCHEME.match(rel) or "://" in rel:
        return "is an absolute URL"
    if "\\" in rel:
        return "holds a backslash"
    for text in (rel, unquote(rel)):
        if text.startswith(("/", "~")):
            return "is an absolute path"
        norm = posixpath.normpath(text)
        if norm == ".." or norm.startswith("../"):
            return "leaves the manifest's folder"
    return None


def join_url(base: str, rel: str) -> str:
    """Resolve a manifest-relative path against the URL or path of a directory.

    ``base`` names a directory, with or without a trailing slash
    (``join_url("s3://b/x", "s-0.tar") == "s3://b/x/s-0.tar"``). ``rel`` may contain
    ``..``; a ``rel`` that is itself a URL (``scheme://``) is returned unchanged, and
    an absolute ``rel`` (``/a/b``) names that path in the base's filesystem.
    """
    base, rel = os.fspath(base), os.fspath(rel)
    if not rel:
        raise ValueError("join_url: the relative path is empty")
    if "://" in rel or "::" in rel:
        return rel
    proto = protocol(base)
    if proto in ("", "local"):
        base_path = local_path(base) if proto else base
        return os.path.normpath(os.path.join(base_path, rel))
    if proto in ("http", "https"):
        return urljoin(base if base.endswith("/") else base + "/", rel)
    head, rest = base.split("://", 1)
    if rel.startswith("/"):
        joined = rel if rest.startswith("/") else rel.lstrip("/")
    else:
        joined = posixpath.normpath(posixpath.join(rest, rel)) if rest else posixpath.normpath(rel)
    return f"{head}://{joined}"
