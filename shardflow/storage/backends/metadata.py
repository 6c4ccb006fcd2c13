"""What is at a URL, without reading its bytes: size, existence, directory."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from shardflow.errors import RemoteReadError

from .filesystems import filesystem, fresh_info, timed
from ..options import DEFAULT_OPTIONS, IOOptions
from ..retries import call_with_retries, is_transient
from ..urls import is_local, local_path

__all__ = ["exists", "is_dir", "object_size"]


def object_size(url: str, options: IOOptions = DEFAULT_OPTIONS) -> int:
    """Size of an object in bytes.

    Raises:
        ShardNotFoundError: no such object.
        RemoteReadError: the store does not report a size, or did not answer.
    """
    url = os.fspath(url)
    if is_local(url):
        return call_with_retries(url, 0, options, lambda: os.stat(local_path(url)).st_size)
    fs, path = filesystem(url, options)
    info = call_with_retries(url, 0, options, lambda: fresh_info(fs, path, options.request_timeout))
    if info.get("size") is None:
        raise RemoteReadError(f"{url}: the store does not report the object's size")
    return int(info["size"])


def exists(url: str, options: IOOptions = DEFAULT_OPTIONS) -> bool:
    """Whether an object (or directory) exists at ``url``."""
    url = os.fspath(url)
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = _uncached(url, options)
    return bool(call_with_retries(url, 0, options, lambda: timed(fs, "exists", path, timeout=options.request_timeout)))


def is_dir(url: str, options: IOOptions = DEFAULT_OPTIONS) -> bool:
    """Whether ``url`` names a directory (on object stores: a prefix with objects under it).

    A filesystem that cannot tell (an HTTP server without listings) answers False;
    transient failures are retried like reads, and a failure that remains raises
    :class:`RemoteReadError` rather than passing for "not a directory".
    """
    url = os.fspath(url)
    if is_local(url):
        return os.path.isdir(local_path(url))
    fs, path = _uncached(url, options)

    def check() -> bool:
        try:
            return bool(timed(fs, "isdir", path, timeout=options.request_timeout))
        except (FileNotFoundError, NotImplementedError, ValueError) as exc:
            if is_transient(exc):  # fsspec's HTTP reports a 503 as FileNotFoundError too
                raise
            return False

    return bool(call_with_retries(url, 0, options, check))


def _uncached(url: str, options: IOOptions) -> tuple[Any, str]:
    """The filesystem and path of ``url``, with fsspec's cached listing of it dropped."""
    fs, path = filesystem(url, options)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)
    return fs, path
