"""fsspec filesystems for URLs: per-protocol storage options, one S3 session per
process, and the identity of one version of an object."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardflow.compat.aio import drop_credentials
from shardflow.errors import missing_dependency

from ..options import IOOptions
from .redirects import redirect_options
from ..urls import LOCAL_PROTOCOLS, protocol

if TYPE_CHECKING:  # imported where a filesystem is made (not by local work)
    import fsspec

# pip extra of shardflow that installs each protocol's filesystem
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure",
           "http": "http", "https": "http", "hf": "hf"}
# the package of a protocol when fsspec's ImportError does not name it
_PACKAGES = {"hf": "huggingface_hub"}
# Keys of ``fs.info()`` that identify one version of an object.
_VERSION_KEYS = (
    "size",
    "ETag",
    "etag",
    "VersionId",
    "version_id",
    "generation",
    "LastModified",
    "last_modified",
    "Last-Modified",
    "mtime",
    "created",
    "ino",
    "md5Hash",
    "Content-MD5",
    "Digest",
)


def _options_for(proto: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """The storage options for one protocol, flat or keyed by protocol."""
    import fsspec
    from fsspec.registry import known_implementations as known

    nested = {
        k: v for k, v in storage_options.items() if k in known and isinstance(v, Mapping)
    }
    flat = {k: v for k, v in storage_options.items() if k not in nested}
    if not nested:
        return flat
    try:
        aliases = fsspec.get_filesystem_class(proto).protocol
    except (ImportError, ValueError):
        aliases = (proto,)
    others = [aliases] if isinstance(aliases, str) else aliases
    names = (proto, *(a for a in others if a != proto))
    for name in names:
        if name in nested:
            return {**flat, **nested[name]}
    return flat


_S3_SESSION: Any = None


def shared_s3_session() -> Any:
    """One aiobotocore session per process for every ``s3://`` filesystem.

    Creating an S3 client parses botocore's endpoint and service models (about
    0.3 s of CPU); a session keeps them once parsed. DataLoader workers forked
    from a process that has read from S3 inherit its session with the models
    parsed, so each new worker (every epoch, without persistent workers) skips
    that cost. Connections and event loops belong to the clients, which each
    process creates for itself; the one loop-bound thing a session holds, its
    resolved credentials (refreshable ones carry an asyncio lock), is dropped in
    a forked child and resolved again there.
    """
    global _S3_SESSION
    if _S3_SESSION is None:
        from aiobotocore.session import AioSession

        _S3_SESSION = AioSession()
    return _S3_SESSION


def s3_session_after_fork() -> None:
    """In a forked child: drop the shared session's credentials (bound to the parent's loop)."""
    if _S3_SESSION is not None:
        drop_credentials(_S3_SESSION)


@functools.lru_cache(maxsize=1)
def _s3fs_arguments() -> frozenset[str]:
    """The keyword arguments ``S3FileSystem`` takes itself (others go to its session)."""
    import inspect

    from s3fs import S3FileSystem

    return frozenset(inspect.signature(S3FileSystem.__init__).parameters)


def _with_shared_session(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``S3FileSystem`` with the shared session, unless the options
    name a session, a profile, or anything s3fs would pass to a session of its own."""
    if "session" in kwargs or "profile" in kwargs or not kwargs.keys() <= _s3fs_arguments():
        return kwargs
    return {**kwargs, "session": shared_s3_session()}


def filesystem(url: str, options: IOOptions) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the path in it, built with the storage
    options for its protocol.

    Raises:
        ImportError: the protocol's package is missing (the message names the extra).
    """
    from fsspec.core import url_to_fs

    proto = protocol(url)
    if proto in LOCAL_PROTOCOLS:
        kwargs: dict[str, Any] = {}
    else:
        kwargs = _options_for(proto, options.storage_options)
        if proto in ("s3", "s3a"):
            with contextlib.suppress(ImportError):  # (without s3fs: the install hint below)
                kwargs = _with_shared_session(kwargs)
        elif proto in ("http", "https"):
            kwargs = redirect_options(kwargs, options.cross_host_redirects)
    try:
        return url_to_fs(url, **kwargs)
    except ImportError as exc:
        if proto in _EXTRAS:
            raise missing_dependency(exc.name or _PACKAGES.get(proto, proto), _EXTRAS[proto],
                                     f"reading {proto}:// URLs") from exc
        raise


def is_http(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is fsspec's HTTP filesystem."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "http" in protocols or "https" in protocols


def is_memory(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is fsspec's ``memory://`` filesystem (a dict of objects)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "memory" in protocols and isinstance(getattr(fs, "store", None), dict)


def object_identity(info: Mapping[str, Any]) -> dict[str, str]:
    """The fields of an ``fs.info()`` result that identify one version of an object."""
    return {k: str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None}


def has_validator(identity: Mapping[str, str]) -> bool:
    """Whether an identity names one version of an object by more than its size
    (an ETag, a modification time, a version id, a digest)."""
    return any(key != "size" for key in identity)


def identity_difference(old: Mapping[str, str], new: Mapping[str, str]) -> str | None:
    """Describe how ``new`` differs from ``old`` on the keys both report, or None."""
    for key in old.keys() & new.keys():
        if old[key] != new[key]:
            return f"{key} was {old[key]}, now {new[key]}"
    return None


def fresh_info(fs: fsspec.AbstractFileSystem, path: str, timeout: float | None = None) -> dict[str, Any]:
    """``fs.info(path)`` after dropping fsspec's cached listing, so a changed object is seen.

    Args:
        timeout: seconds the request may take (async filesystems: HTTP, S3,
            GCS, Azure); over it, ``fsspec.exceptions.FSTimeoutError`` (a
            ``TimeoutError``, transient).
    """
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)
    return timed(fs, "info", path, timeout=timeout)


def timed(fs: fsspec.AbstractFileSystem, method: str, *args: Any, timeout: float | None) -> Any:
    """``fs.<method>(*args)``, bounded to ``timeout`` seconds on an async filesystem.

    fsspec's async filesystems run the request on their event loop; ``sync``
    with a timeout cancels it there (``asyncio.wait_for``). A synchronous
    filesystem (local, memory) is called as it is.
    """
    coroutine = getattr(fs, "_" + method, None) if getattr(fs, "async_impl", False) else None
    if timeout is None or coroutine is None or getattr(fs, "loop", None) is None:
        return getattr(fs, method)(*args)
    return sync_within(fs.loop, coroutine, *args, timeout=timeout, what=f"{method}()")


def sync_within(loop: Any, coroutine: Any, *args: Any, timeout: float, what: str, **kwargs: Any) -> Any:
    """fsspec's ``sync`` bounded to ``timeout`` seconds; over it, a ``TimeoutError`` that says so.

    Raises:
        TimeoutError: (transient, so retried) the request took longer.
    """
    from fsspec.asyn import sync
    from fsspec.exceptions import FSTimeoutError

    try:
        return sync(loop, coroutine, *args, timeout=timeout, **kwargs)
    except FSTimeoutError as exc:
        raise TimeoutError(f"no answer to {what} within {timeout:g} s (IOOptions.request_timeout)") from exc
