"""Storage layer: byte streams over local paths and any fsspec URL.

Everything that touches bytes on disk or on a remote store goes through here:

- :func:`iter_chunks` streams a byte range of an object in blocks and survives
  transient failures by reopening at the byte offset already reached, after
  checking that the object did not change in between;
- :func:`read_range` is one ranged read (random access), with the same retries;
- :func:`readahead` runs a chunk stream in a background thread;
- :func:`open_chunks` composes local cache -> :func:`iter_chunks` -> read-ahead and
  is the entry point of the tar reader;
- :func:`decompressing_chunks` undoes gzip / zstd compression found by magic bytes;
- :func:`open_output` writes an object atomically (it appears only when complete);
- :func:`join_url`, :func:`is_local`, :func:`exists`, :func:`is_dir`, :func:`list_glob`, :func:`object_size`.

Remote I/O is fsspec's (``s3://``, ``gs://``, ``http(s)://``, ``memory://`` ...). HTTP
bodies are read raw: ``Accept-Encoding: identity`` is sent and a ``Content-Encoding``
the server applies anyway is not undone, so the bytes read are the stored object's
bytes (their size and sha256 match the manifest) and a gzip body is gunzipped by
:func:`decompressing_chunks` like any ``.tar.gz`` shard.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import logging
import math
import os
import posixpath
import queue
import re
import secrets
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO
from urllib.parse import urljoin

import fsspec
from fsspec.core import split_protocol, url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations

from shardflow.errors import (
    RemoteReadError,
    ShardflowError,
    ShardFormatError,
    TruncatedShardError,
    missing_dependency,
)

__all__ = [
    "IOOptions",
    "RemoteWriteError",
    "ShardChangedError",
    "ShardNotFoundError",
    "decompressing_chunks",
    "exists",
    "is_compressed",
    "is_dir",
    "iter_chunks",
    "join_url",
    "list_glob",
    "object_size",
    "is_local",
    "open_chunks",
    "open_output",
    "read_range",
    "readahead",
]

logger = logging.getLogger(__name__)

MAX_BACKOFF = 10.0
"""Seconds; the retry delay doubles from ``IOOptions.backoff`` up to this."""

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

_LOCAL_PROTOCOLS = frozenset({"", "file", "local"})
# Stores where one PUT makes the whole object appear at once (never a partial one).
_ATOMIC_PUT_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"}
)
# pip extra of shardflow that installs each protocol's filesystem
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}
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
_RETRY_S3_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling",
     "ThrottlingException", "RequestTimeTooSkewed"}
)
_DECOMPRESS_OUT = 1 << 22  # bytes of decompressed output per yielded chunk (gzip)
_ZSTD_IN = 1 << 17  # bytes of zstd input per decompress call, bounds the output size
_READAHEAD_POLL = 0.05  # seconds between checks of the stop flag in the producer
_READAHEAD_JOIN = 2.0  # seconds close() waits for the producer thread
_HTTP_CONNECT_TIMEOUT = 30.0  # seconds
_HTTP_READ_TIMEOUT = 120.0  # seconds without a byte from the server


class ShardNotFoundError(RemoteReadError, FileNotFoundError):
    """The object at a URL does not exist."""


class ShardChangedError(RemoteReadError):
    """An object changed (size, ETag, mtime or version) while it was being read."""


class RemoteWriteError(ShardflowError, OSError):
    """Writing an object failed; nothing was left at its final name."""


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class IOOptions:
    """How shards are read and written.

    Args:
        storage_options: keyword arguments for the fsspec filesystem (for s3fs:
            ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``).
            When sources mix protocols, key them by protocol instead:
            ``{"s3": {...}, "https": {...}}``. Ignored for local paths.
        retries: reopen attempts after a transient read failure before giving up;
            the count restarts whenever a read makes progress. 0 disables retries.
        backoff: seconds before the first retry; doubled at each further retry of
            the same failure, capped at :data:`MAX_BACKOFF`.
        block_size: bytes per read, and so the size of the chunks yielded.
        readahead: chunks buffered ahead by a background thread (0 = none).
        cache_dir: local directory caching whole remote shards, or ``None``.
        cache_limit: bytes; the cache evicts least recently used shards to stay
            below it. A shard larger than the limit is streamed uncached.
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    retries: int = 5
    backoff: float = 0.2
    block_size: int = 4 << 20
    readahead: int = 2
    cache_dir: str | None = None
    cache_limit: int = 32 << 30

    def __post_init__(self) -> None:
        if not isinstance(self.storage_options, Mapping):
            raise TypeError(
                f"storage_options must be a mapping, got {type(self.storage_options).__name__}"
            )
        # a plain dict copy: picklable for DataLoader workers, not aliased by the caller
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        for name, low in (("retries", 0), ("block_size", 1), ("readahead", 0), ("cache_limit", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        backoff = self.backoff
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)):
            raise TypeError(f"backoff must be a number of seconds, got {backoff!r}")
        if not math.isfinite(backoff) or backoff < 0:
            raise ValueError(f"backoff must be a finite number of seconds >= 0, got {backoff}")
        if self.cache_dir is not None:
            cache_dir = os.fspath(self.cache_dir)
            if not isinstance(cache_dir, str) or not cache_dir:
                raise ValueError(
                    f"cache_dir must be a non-empty local path, got {self.cache_dir!r}"
                )
            object.__setattr__(self, "cache_dir", cache_dir)


_DEFAULT_OPTIONS = IOOptions()


# --------------------------------------------------------------------------- filesystems


def _protocol(url: str) -> str:
    return split_protocol(url)[0] or ""


def _is_local(url: str) -> bool:
    return _protocol(url) in _LOCAL_PROTOCOLS


def is_local(url: str) -> bool:
    """Whether ``url`` is a local path or ``file://`` URL (no request per open)."""
    return _is_local(os.fspath(url))


def _local_path(url: str) -> str:
    return LocalFileSystem._strip_protocol(url) if _protocol(url) else url


def _options_for(protocol: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """The storage options for one protocol, flat or keyed by protocol."""
    known = known_implementations
    nested = {
        k: v for k, v in storage_options.items() if k in known and isinstance(v, Mapping)
    }
    flat = {k: v for k, v in storage_options.items() if k not in nested}
    if not nested:
        return flat
    try:
        aliases = fsspec.get_filesystem_class(protocol).protocol
    except (ImportError, ValueError):
        aliases = (protocol,)
    others = [aliases] if isinstance(aliases, str) else aliases
    names = (protocol, *(a for a in others if a != protocol))
    for name in names:
        if name in nested:
            return {**flat, **nested[name]}
    return flat


_S3_SESSION: Any = None


def _shared_s3_session() -> Any:
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


def _s3_session_after_fork() -> None:
    if _S3_SESSION is not None:
        _S3_SESSION._credentials = None


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
    return {**kwargs, "session": _shared_s3_session()}


def _filesystem(url: str, options: IOOptions) -> tuple[fsspec.AbstractFileSystem, str]:
    protocol = _protocol(url)
    if protocol in _LOCAL_PROTOCOLS:
        kwargs: dict[str, Any] = {}
    else:
        kwargs = _options_for(protocol, options.storage_options)
        if protocol in ("s3", "s3a"):
            with contextlib.suppress(ImportError):  # (without s3fs: the install hint below)
                kwargs = _with_shared_session(kwargs)
    try:
        return url_to_fs(url, **kwargs)
    except ImportError as exc:
        if protocol in _EXTRAS:
            raise missing_dependency(exc.name or protocol, _EXTRAS[protocol],
                                     f"reading {protocol}:// URLs") from exc
        raise


def _is_http(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "http" in protocols or "https" in protocols


def _is_memory(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "memory" in protocols and isinstance(getattr(fs, "store", None), dict)


def _identity(info: Mapping[str, Any]) -> dict[str, str]:
    """The fields of an ``fs.info()`` result that identify one version of an object."""
    return {k: str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None}


def _difference(old: Mapping[str, str], new: Mapping[str, str]) -> str | None:
    """Describe how ``new`` differs from ``old`` on the keys both report, or None."""
    for key in old.keys() & new.keys():
        if old[key] != new[key]:
            return f"{key} was {old[key]}, now {new[key]}"
    return None


def _fresh_info(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)
    return fs.info(path)


# --------------------------------------------------------------------------- fork safety

# Filesystems that exist when the process forks (a DataLoader starting its workers)
# hold the parent's event-loop state, and the child shares the kernel objects behind
# it (the epoll set, the sockets of pooled connections). fsspec empties its instance
# caches in the child; were the parent's instances then garbage collected there, their
# finalizers would close those connections through the shared epoll set, and the
# parent's next request on one would hang. So each child keeps them, unused, for its
# life (DataLoader and process-pool workers end with os._exit, which runs no finalizer).
_INHERITED: list[Any] = []


def _filesystem_instances() -> list[Any]:
    found: list[Any] = []
    seen: set[type] = set()
    pending: list[type] = [fsspec.AbstractFileSystem]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
        cache = cls.__dict__.get("_cache")
        if cache:
            for _attempt in range(3):  # another thread may add an instance meanwhile
                try:
                    found.extend(cache.values())
                    break
                except RuntimeError:
                    continue
    return found


def _before_fork() -> None:
    _INHERITED.extend(_filesystem_instances())


def _after_fork_in_parent() -> None:
    _INHERITED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_s3_session_after_fork)


# --------------------------------------------------------------------------- errors and retries


class _ShortReadError(OSError):
    """The stream ended before the expected end of the range (transient)."""


def _is_transient(exc: BaseException) -> bool:
    """Whether a failed read is worth retrying after reopening."""
    if isinstance(exc, FileNotFoundError):
        # fsspec's HTTP info() reports any failure, a 503 too, as FileNotFoundError
        cause = exc.__cause__
        return (cause is not None and not isinstance(cause, FileNotFoundError)
                and _is_transient(cause))
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        if isinstance(exc, aiohttp.ClientResponseError):
            return exc.status >= 500 or exc.status in (408, 425, 429)
        if isinstance(exc, aiohttp.ClientError):
            return True
    boto = sys.modules.get("botocore.exceptions")
    if boto is not None:
        if isinstance(exc, boto.ClientError):
            response = getattr(exc, "response", None) or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = response.get("Error", {}).get("Code", "")
            return status >= 500 or status in (408, 429) or code in _RETRY_S3_CODES
        streaming = tuple(
            getattr(boto, name)
            for name in ("HTTPClientError", "IncompleteReadError", "ResponseStreamingError")
            if hasattr(boto, name)
        )
        if streaming and isinstance(exc, streaming):
            return True
    return isinstance(exc, (OSError, TimeoutError, http.client.HTTPException, EOFError))


def _is_io_error(exc: BaseException) -> bool:
    """Whether an exception is about reading from the store (and so worth naming the
    URL and offset in a :class:`RemoteReadError`); others propagate as they are."""
    if isinstance(exc, (OSError, TimeoutError, EOFError, http.client.HTTPException)):
        return True
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        return True
    boto = sys.modules.get("botocore.exceptions")
    return boto is not None and isinstance(exc, (boto.BotoCoreError, boto.ClientError))


def _delay(options: IOOptions, failures: int) -> float:
    return min(options.backoff * 2 ** (failures - 1), max(MAX_BACKOFF, options.backoff))


def _fail(url: str, offset: int, exc: BaseException, failures: int) -> ShardflowError:
    """The error to raise for a read of ``url`` that cannot go on."""
    if isinstance(exc, ShardflowError):
        return exc
    if isinstance(exc, FileNotFoundError) and not _is_transient(exc):
        return ShardNotFoundError(f"shard not found: {url}")
    if failures:
        return RemoteReadError(
            f"reading {url} failed at byte {offset} after {failures - 1} retries: "
            f"{type(exc).__name__}: {exc}"
        )
    return RemoteReadError(f"reading {url} failed at byte {offset}: {type(exc).__name__}: {exc}")


def _call_with_retries(url: str, offset: int, options: IOOptions, fn):
    """Call ``fn()`` until it succeeds, retrying transient errors with backoff."""
    failures = 0
    while True:
        try:
            return fn()
        except ShardflowError:
            raise
        except Exception as exc:
            if not _is_transient(exc):
                if not _is_io_error(exc):
                    raise
                raise _fail(url, offset, exc, 0) from exc
            failures += 1
            if failures > options.retries:
                raise _fail(url, offset, exc, failures) from exc
            wait = _delay(options, failures)
            logger.warning("reading %s at byte %d failed (%r); retry %d/%d in %.2fs",
                           url, offset, exc, failures, options.retries, wait)
            time.sleep(wait)


# --------------------------------------------------------------------------- readers


class _LocalReader:
    """A local file read with plain ``read`` calls; identity from ``fstat``."""

    def __init__(self, path: str, offset: int) -> None:
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        try:
            st = os.fstat(self._file.fileno())
            self.identity = {"size": str(st.st_size), "mtime": str(st.st_mtime_ns),
                             "ino": str(st.st_ino)}
            self.size: int | None = st.st_size
            if offset:
                self._file.seek(offset)
        except BaseException:
            self._file.close()
            raise

    def read(self, n: int) -> bytes:
        return self._file.read(n)

    def close(self) -> None:
        self._file.close()


class _MemoryReader:
    """A snapshot of a ``memory://`` object (its file objects are shared, not reopenable)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, offset: int) -> None:
        stripped = fs._strip_protocol(path)
        if stripped not in fs.store:
            raise FileNotFoundError(path)
        self._data = memoryview(fs.store[stripped].getvalue())
        self.identity = _identity(fs.info(stripped))
        self.identity["size"] = str(len(self._data))
        self.size: int | None = len(self._data)
        self._pos = offset

    def read(self, n: int) -> bytes:
        out = bytes(self._data[self._pos : self._pos + n])
        self._pos += len(out)
        return out

    def close(self) -> None:
        self._data.release()


class _FileReader:
    """An fsspec file object opened without caching: each ``read`` is one ranged request.

    For stores without a streaming reader of ours (gcs, azure, ...); a reopen is
    checked against the identity ``fs.info()`` reported at the first open.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, offset: int,
                 block_size: int) -> None:
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)
        self._file = fs.open(path, "rb", block_size=block_size, cache_type="none")
        try:
            details = getattr(self._file, "details", None)
            info = details if isinstance(details, Mapping) else fs.info(path)
            self.identity = _identity(info)
            self.size = info.get("size")
            if offset:
                self._file.seek(offset)
        except BaseException:
            self._file.close()
            raise

    def read(self, n: int) -> bytes:
        return self._file.read(n)

    def close(self) -> None:
        self._file.close()


@functools.lru_cache(maxsize=1)
def _aiohttp_auto_decompress_per_request() -> bool:
    import inspect

    import aiohttp

    return "auto_decompress" in inspect.signature(aiohttp.ClientSession._request).parameters


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def _range_total(value: str | None, url: str, offset: int) -> int | None:
    """The object's size from the ``Content-Range`` of a response to a request for
    the bytes from ``offset`` on (None for ``*``).

    Raises:
        RemoteReadError: the header is missing or malformed, or the range starts
            elsewhere (the bytes would be taken for the wrong ones).
    """
    match = _CONTENT_RANGE.fullmatch((value or "").strip())
    if match is None or int(match.group(1)) != offset:
        raise RemoteReadError(f"reading {url}: asked for bytes from {offset}, the store answered Content-Range {value!r}")
    return None if match.group(3) == "*" else int(match.group(3))


class _StreamReader:
    """A response body streamed on fsspec's event loop, read ``n`` bytes per call.

    Subclasses open the response in ``__init__`` and implement ``_part`` (one read
    of at most ``n`` bytes, ``b""`` at the end) and ``_release``.
    """

    _fs: Any
    _open = False
    _error: Exception | None = None

    async def _part(self, n: int) -> bytes:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    async def _read(self, n: int) -> bytes:
        parts = []
        got = 0
        while got < n:
            try:
                part = await self._part(n - got)
            except Exception as exc:
                if not parts:
                    raise
                # keep the bytes received before the failure: they count as progress
                self._error = exc
                break
            if not part:
                break
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read(self, n: int) -> bytes:
        from fsspec.asyn import sync

        if self._error is not None:
            raise self._error
        if not self._open:
            return b""
        return sync(self._fs.loop, self._read, n)

    def close(self) -> None:
        from fsspec.asyn import sync

        if not self._open:
            return
        self._open = False

        async def _close() -> None:
            self._release()

        try:
            sync(self._fs.loop, _close, timeout=5)
        except Exception:  # loop gone (interpreter exit): the socket dies with it
            logger.debug("could not close a streamed response cleanly", exc_info=True)


class _HTTPReader(_StreamReader):
    """One streaming GET (``Range: bytes=offset-``) on fsspec's aiohttp session and loop.

    One request serves the whole range (no request per block); the response's
    Content-Range, ETag and Last-Modified are checked against the identity seen by
    ``HEAD`` so that a reopened read cannot splice two versions of an object.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, url: str, offset: int,
                 stop: int | None, info: Mapping[str, Any]) -> None:
        from fsspec.asyn import sync

        self._fs = fs
        self._resp = None
        self.identity = _identity(info)
        self.size = info.get("size")
        kwargs = dict(fs.kwargs)
        headers = dict(kwargs.pop("headers", None) or {})
        headers["Accept-Encoding"] = "identity"
        if offset or stop is not None:
            last = "" if stop is None else str(stop - 1)
            headers["Range"] = f"bytes={offset}-{last}"
        if _aiohttp_auto_decompress_per_request():
            kwargs["auto_decompress"] = False
        if "timeout" not in kwargs and "timeout" not in (getattr(fs, "client_kwargs", None) or {}):
            # aiohttp's default (5 min in total) would cut streams read at training
            # pace; bound the silence between packets instead
            import aiohttp

            kwargs["timeout"] = aiohttp.ClientTimeout(
                total=None, sock_connect=_HTTP_CONNECT_TIMEOUT, sock_read=_HTTP_READ_TIMEOUT
            )
        if stop is None or offset < stop:  # else nothing to read (a GET would be a 416)
            self._resp = sync(fs.loop, self._get, url, offset, headers, kwargs)
            self._open = True

    async def _get(self, url: str, offset: int, headers: dict, kwargs: dict):
        session = await self._fs.set_session()
        encode = getattr(self._fs, "encode_url", None)  # fsspec >= 2023.9
        target = encode(url) if encode is not None else url
        resp = await session.get(target, headers=headers, **kwargs)
        try:
            self._check(resp, url, offset)
            if resp.status == 200 and offset:
                logger.debug("%s: server ignored the Range header; skipping %d bytes", url, offset)
                left = offset
                while left:
                    skipped = await resp.content.read(min(left, 1 << 20))
                    if not skipped:
                        raise _ShortReadError(f"{url}: body ended before byte {offset}")
                    left -= len(skipped)
        except BaseException:
            resp.close()
            raise
        return resp

    def _check(self, resp, url: str, offset: int) -> None:
        if resp.status == 404:
            raise FileNotFoundError(url)
        if resp.status >= 400:
            resp.raise_for_status()
        headers = resp.headers
        total = None
        if resp.status == 206:
            total = _range_total(headers.get("Content-Range"), url, offset)
        elif resp.status == 200:
            if headers.get("Content-Encoding", "identity") in ("identity", ""):
                total = headers.get("Content-Length")
        else:
            raise RemoteReadError(f"reading {url}: unexpected HTTP status {resp.status}")
        seen = {k: headers[k] for k in ("ETag", "Last-Modified") if k in headers}
        if total is not None:
            seen["size"] = str(int(total))
        change = _difference(self.identity, seen)
        if change is not None:
            raise ShardChangedError(f"{url} changed while being read ({change})")

    async def _part(self, n: int) -> bytes:
        return await self._resp.content.read(n)

    def _release(self) -> None:
        self._resp.close()


class _S3Reader(_StreamReader):
    """One streaming ``GetObject`` (``Range: bytes=offset-``) on s3fs's client and loop.

    One request serves the rest of the range, where an fsspec file issues one ranged
    request per block after a ``HEAD``: the response itself gives the object's ETag,
    version and size (``Content-Range``). A single GET reads one version of the
    object; a reopen (after a dropped connection) sends ``If-Match`` with the ETag
    seen first, so that the store refuses a changed object (412) rather than
    splicing two versions: that is raised as :class:`ShardChangedError`.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, url: str, offset: int,
                 stop: int | None, expect: Mapping[str, str] | None) -> None:
        from fsspec.asyn import sync

        self._fs = fs
        self._body = None
        self.size: int | None = None
        self.identity: dict[str, str] = {}
        bucket, key, version = fs.split_path(path)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if version:
            kwargs["VersionId"] = version
        etag = (expect or {}).get("ETag")
        if etag and not etag.startswith("W/"):  # (a weak ETag never matches If-Match)
            kwargs["IfMatch"] = etag
        if offset or stop is not None:
            kwargs["Range"] = f"bytes={offset}-{'' if stop is None else stop - 1}"
        try:
            resp = sync(fs.loop, fs._call_s3, "get_object", **kwargs)
        except OSError as exc:
            code = _s3_error_code(exc)
            if code == "PreconditionFailed":
                raise ShardChangedError(
                    f"{url} changed while being read, at byte {offset} (its ETag is no longer {etag})"
                ) from exc
            if code == "InvalidRange":  # offset at or past the end: nothing left to read
                info = _fresh_info(fs, path)
                self.identity = _identity(info)
                self.size = info.get("size")
                return
            raise
        self._body = resp["Body"]
        self._open = True
        total = None
        if resp.get("ContentRange"):
            try:
                total = _range_total(resp["ContentRange"], url, offset)
            except RemoteReadError:
                self.close()
                raise
        elif "Range" not in kwargs:
            total = resp.get("ContentLength")
        elif offset:
            # a gateway that ignores Range sends the object from byte 0: those bytes
            # must not be taken for the ones asked for
            self.close()
            raise RemoteReadError(
                f"reading {url}: asked for bytes from {offset}, the store answered without a "
                "Content-Range (it ignores Range requests)"
            )
        # the keys that fs.info() reports too (LastModified is formatted differently)
        seen = {"ETag": resp.get("ETag"), "VersionId": resp.get("VersionId"), "size": total}
        self.identity = {k: str(v) for k, v in seen.items() if v is not None}
        self.size = total

    async def _part(self, n: int) -> bytes:
        return await self._body.read(n)

    def _release(self) -> None:
        self._body.close()


def _s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an s3fs error (s3fs maps most codes to OSError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):
            return response.get("Error", {}).get("Code")
        exc = exc.__cause__ or exc.__context__
    return None


def _is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    try:
        from s3fs import S3FileSystem
    except ImportError:
        return False
    return isinstance(fs, S3FileSystem)


def _open_reader(fs, path: str, url: str, offset: int, end: int | None, options: IOOptions,
                 expect: Mapping[str, str] | None = None):
    if isinstance(fs, LocalFileSystem):
        return _LocalReader(path, offset)
    if _is_memory(fs):
        return _MemoryReader(fs, path, offset)
    if _is_http(fs):
        info = _fresh_info(fs, path)
        size = info.get("size")
        stop = end if size is None else (size if end is None else min(end, size))
        return _HTTPReader(fs, url, offset, stop, info)
    if _is_s3(fs):
        return _S3Reader(fs, path, url, offset, end, expect)
    return _FileReader(fs, path, offset, options.block_size)


# --------------------------------------------------------------------------- reading


def _check_range(start: int, end: int | None) -> None:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end < start):
        raise ValueError(f"end must be None or an int >= start ({start}), got {end!r}")


def iter_chunks(url: str, start: int = 0, end: int | None = None,
                options: IOOptions = _DEFAULT_OPTIONS) -> Iterator[bytes]:
    """Stream the bytes ``[start, end)`` of an object in chunks of ``options.block_size``.

    Args:
        url: a local path or any fsspec URL (``file://``, ``memory://``, ``s3://``,
            ``gs://``, ``http(s)://``).
        start: first byte, >= 0.
        end: byte after the last one; ``None`` reads to the end. An end beyond the
            object's size is clamped to it, as in slicing.
        options: retries, backoff, block size and storage options.

    Yields:
        Non-empty ``bytes`` chunks of at most ``options.block_size`` bytes whose
        concatenation is exactly the requested bytes, even when reads failed and
        were retried by reopening the object at the offset reached.

    Raises:
        ShardNotFoundError: the object does not exist.
        ShardChangedError: the object's size, ETag, mtime or version changed
            between two opens.
        RemoteReadError: a non-transient failure, or retries exhausted; the message
            names the URL and the byte offset reached.

    Nothing is opened before the first ``next()``; the file handle or connection is
    released when the generator finishes, is closed, or is garbage collected.
    """
    _check_range(start, end)
    return _chunks(os.fspath(url), start, end, options)


def _chunks(url: str, start: int, end: int | None, options: IOOptions,
            expect: Mapping[str, str] | None = None,
            check_size: Callable[[int], None] | None = None) -> Iterator[bytes]:
    fs, path = _filesystem(url, options)
    offset = start
    stop = end
    identity = dict(expect) if expect is not None else None
    reader = None
    failures = 0
    try:
        while stop is None or offset < stop:
            try:
                if reader is None:
                    reader = _open_reader(fs, path, url, offset, stop, options, identity)
                    if identity is None:
                        identity = reader.identity
                        if check_size is not None and reader.size is not None:
                            check_size(reader.size)
                    else:
                        change = _difference(identity, reader.identity)
                        if change is not None:
                            raise ShardChangedError(
                                f"{url} changed while being read, at byte {offset} ({change})"
                            )
                    if reader.size is not None:
                        stop = reader.size if stop is None else min(stop, reader.size)
                        if offset >= stop:
                            return
                want = options.block_size
                if stop is not None:
                    want = min(want, stop - offset)
                chunk = reader.read(want)
                if not chunk:
                    if stop is None:
                        return
                    raise _ShortReadError(f"stream ended at byte {offset}, expected {stop} bytes")
                if len(chunk) > want:
                    chunk = chunk[:want]
            except ShardflowError:
                raise
            except Exception as exc:
                if not _is_transient(exc):
                    if not _is_io_error(exc):
                        raise  # not about the store (a bug, or torch's dead-worker RuntimeError)
                    if isinstance(exc, FileNotFoundError) and identity is not None:
                        raise ShardChangedError(
                            f"{url} changed while being read: it disappeared at byte {offset}"
                        ) from exc
                    raise _fail(url, offset, exc, 0) from exc
                failures += 1
                if failures > options.retries:
                    raise _fail(url, offset, exc, failures) from exc
                if reader is not None:
                    with contextlib.suppress(Exception):
                        reader.close()
                    reader = None
                wait = _delay(options, failures)
                logger.warning("reading %s failed at byte %d (%s: %s); reopening, retry %d/%d "
                               "in %.2fs", url, offset, type(exc).__name__, exc, failures,
                               options.retries, wait)
                time.sleep(wait)
                continue
            failures = 0
            offset += len(chunk)
            yield chunk
    finally:
        if reader is not None:
            reader.close()


def read_range(url: str, start: int, end: int, options: IOOptions = _DEFAULT_OPTIONS) -> bytes:
    """Read the bytes ``[start, end)`` of an object (random access), with retries.

    An ``end`` beyond the object's size is clamped to it. Raises as :func:`iter_chunks`.
    """
    if end is None:
        raise ValueError("read_range needs an end offset; use iter_chunks to read to the end")
    _check_range(start, end)
    url = os.fspath(url)
    if start == end:
        return b""
    if _is_local(url):
        path = _local_path(url)

        def read_local() -> bytes:
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                parts, want = [], end - start
                while want:
                    part = f.read(want)
                    if not part:
                        break
                    parts.append(part)
                    want -= len(part)
                return b"".join(parts)

        return _call_with_retries(url, start, options, read_local)
    fs, path = _filesystem(url, options)
    if _is_http(fs) or _is_memory(fs):
        return b"".join(_chunks(url, start, end, options))

    def read_remote() -> bytes:
        try:
            return fs.cat_file(path, start=start, end=end)
        except OSError as exc:  # S3 and friends answer 416 for a start past the end
            if "range" in str(exc).lower() and start >= _fresh_info(fs, path)["size"]:
                return b""
            raise

    data = _call_with_retries(url, start, options, read_remote)
    return data[: end - start]


def object_size(url: str, options: IOOptions = _DEFAULT_OPTIONS) -> int:
    """Size of an object in bytes.

    Raises:
        ShardNotFoundError: no such object.
        RemoteReadError: the store does not report a size, or did not answer.
    """
    url = os.fspath(url)
    if _is_local(url):
        return _call_with_retries(url, 0, options, lambda: os.stat(_local_path(url)).st_size)
    fs, path = _filesystem(url, options)
    info = _call_with_retries(url, 0, options, lambda: _fresh_info(fs, path))
    if info.get("size") is None:
        raise RemoteReadError(f"{url}: the store does not report the object's size")
    return int(info["size"])


def exists(url: str, options: IOOptions = _DEFAULT_OPTIONS) -> bool:
    """Whether an object (or directory) exists at ``url``."""
    url = os.fspath(url)
    if _is_local(url):
        return os.path.exists(_local_path(url))
    fs, path = _filesystem(url, options)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)
    return bool(_call_with_retries(url, 0, options, lambda: fs.exists(path)))


def is_dir(url: str, options: IOOptions = _DEFAULT_OPTIONS) -> bool:
    """Whether ``url`` names a directory (on object stores: a prefix with objects under it).

    A filesystem that cannot tell (an HTTP server without listings) answers False;
    transient failures are retried like reads, and a failure that remains raises
    :class:`RemoteReadError` rather than passing for "not a directory".
    """
    url = os.fspath(url)
    if _is_local(url):
        return os.path.isdir(_local_path(url))
    fs, path = _filesystem(url, options)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)

    def check() -> bool:
        try:
            return bool(fs.isdir(path))
        except (FileNotFoundError, NotImplementedError, ValueError) as exc:
            if _is_transient(exc):  # fsspec's HTTP reports a 503 as FileNotFoundError too
                raise
            return False

    return bool(_call_with_retries(url, 0, options, check))


def list_glob(pattern: str, options: IOOptions = _DEFAULT_OPTIONS) -> list[str]:
    """Sorted URLs matching a glob pattern, written in the pattern's own form.

    ``s3://b/train-*.tar`` gives ``["s3://b/train-0.tar", ...]``; a local relative
    pattern gives relative paths. ``**`` matches across directories.
    """
    pattern = os.fspath(pattern)
    protocol = _protocol(pattern)
    if not protocol:
        import glob

        return sorted(glob.glob(pattern, recursive=True))
    fs, path = _filesystem(pattern, options)
    with contextlib.suppress(Exception):
        fs.invalidate_cache()
    matches = fs.glob(path)
    if _is_http(fs):
        return sorted(matches)
    rest = pattern.split("://", 1)[1]
    out = []
    for match in matches:
        if "://" in match:
            out.append(match)
            continue
        if match.startswith("/") and not rest.startswith("/"):
            match = match.lstrip("/")
        out.append(f"{protocol}://{match}")
    return sorted(out)


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
    protocol = _protocol(base)
    if protocol in ("", "local"):
        base_path = _local_path(base) if protocol else base
        return os.path.normpath(os.path.join(base_path, rel))
    if protocol in ("http", "https"):
        return urljoin(base if base.endswith("/") else base + "/", rel)
    head, rest = base.split("://", 1)
    if rel.startswith("/"):
        joined = rel if rest.startswith("/") else rel.lstrip("/")
    else:
        joined = posixpath.normpath(posixpath.join(rest, rel)) if rest else posixpath.normpath(rel)
    return f"{head}://{joined}"


# --------------------------------------------------------------------------- decompression


def decompressing_chunks(chunks: Iterator[bytes], url: str) -> Iterator[bytes]:
    """Undo gzip or zstd compression of a chunk stream, found by its magic bytes.

    gzip (``1f 8b``, several members allowed) and zstd (``28 b5 2f fd``, several
    frames allowed) streams are decompressed incrementally; anything else passes
    through unchanged. Memory stays bounded by the chunk sizes.

    Args:
        chunks: the object's bytes, in chunks of any size.
        url: named in errors.

    Raises:
        TruncatedShardError: the compressed stream ends early (a ``ShardFormatError``).
        ShardFormatError: the compressed data is corrupt.
        ImportError: zstd data but the ``zstandard`` package is missing.
    """
    try:
        head = b""
        for chunk in chunks:
            head += chunk
            if len(head) >= 4:
                break
        if head.startswith(GZIP_MAGIC):
            yield from _gunzip(head, chunks, url)
        elif head.startswith(ZSTD_MAGIC):
            yield from _unzstd(head, chunks, url)
        else:
            if head:
                yield head
            yield from chunks
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _gunzip(head: bytes, chunks: Iterator[bytes], url: str) -> Iterator[bytes]:
    dec = zlib.decompressobj(zlib.MAX_WBITS | 16)
    fed = False  # whether the current member has been given any input
    try:
        for data in _prepend(head, chunks):
            while data:
                fed = True
                out = dec.decompress(data, _DECOMPRESS_OUT)
                if out:
                    yield out
                if dec.eof:  # end of a member; another may follow
                    data = dec.unused_data
                    dec = zlib.decompressobj(zlib.MAX_WBITS | 16)
                    fed = False
                else:
                    data = dec.unconsumed_tail
        while fed and not dec.eof:  # output held back by max_length
            out = dec.decompress(b"", _DECOMPRESS_OUT)
            if not out:
                raise TruncatedShardError(f"{url}: gzip stream is truncated")
            yield out
    except zlib.error as exc:
        raise ShardFormatError(f"{url}: corrupt gzip data: {exc}") from exc


def _unzstd(head: bytes, chunks: Iterator[bytes], url: str) -> Iterator[bytes]:
    try:
        import zstandard
    except ImportError as exc:
        raise missing_dependency(
            "zstandard", "zstd", f"reading the zstd-compressed shard {url}"
        ) from exc
    dctx = zstandard.ZstdDecompressor()
    dec = dctx.decompressobj()
    fed = False
    try:
        for data in _prepend(head, chunks):
            while data:
                piece, data = data[:_ZSTD_IN], data[_ZSTD_IN:]
                while piece:
                    fed = True
                    out = dec.decompress(piece)
                    if out:
                        yield out
                    if dec.eof:
                        piece = dec.unused_data
                        dec = dctx.decompressobj()
                        fed = False
                    else:
                        piece = b""
        if fed and not dec.eof:
            raise TruncatedShardError(f"{url}: zstd stream is truncated")
    except zstandard.ZstdError as exc:
        raise ShardFormatError(f"{url}: corrupt zstd data: {exc}") from exc


def _prepend(head: bytes, chunks: Iterator[bytes]) -> Iterator[bytes]:
    yield head
    yield from chunks


def is_compressed(url: str, options: IOOptions = _DEFAULT_OPTIONS) -> bool:
    """Whether an object starts with the gzip or zstd magic bytes."""
    magic = read_range(url, 0, 4, options)
    return magic.startswith(GZIP_MAGIC) or magic.startswith(ZSTD_MAGIC)


# --------------------------------------------------------------------------- read-ahead


_END = object()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: queue.Queue, item: object, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_READAHEAD_POLL)
            return True
        except queue.Full:
            continue
    return False


def _produce(chunks: Iterator[bytes], q: queue.Queue, stop: threading.Event) -> None:
    # Runs in the read-ahead thread. It must not reference the _ReadAhead object,
    # so that dropping the last reference to it stops this thread.
    try:
        for chunk in chunks:
            if not _put(q, chunk, stop):
                return
        _put(q, _END, stop)
    except BaseException as exc:  # handed to the consumer, which raises it
        _put(q, _Failure(exc), stop)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                logger.warning("closing a read-ahead source failed", exc_info=True)


class _ReadAhead(Iterator[bytes]):
    """The iterator returned by :func:`readahead`."""

    def __init__(self, chunks: Iterator[bytes], depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(
            target=_produce, args=(chunks, self._queue, self._stop),
            name="shardflow-readahead", daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> _ReadAhead:
        return self

    def __next__(self) -> bytes:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the thread, close the source and drop buffered chunks."""
        if self._finished:
            return
        self._finished = True
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        if threading.current_thread() is not self._thread:
            self._thread.join(_READAHEAD_JOIN)
            if self._thread.is_alive():
                logger.debug("a read-ahead thread is still in a read after %.0fs; it stops "
                             "when that read returns", _READAHEAD_JOIN)

    def __enter__(self) -> _ReadAhead:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def readahead(chunks: Iterator[bytes], depth: int) -> Iterator[bytes]:
    """Run ``chunks`` in a background thread, keeping up to ``depth`` chunks ready.

    The thread starts at once (so a shard starts downloading before it is read).
    Exceptions of the source are raised by ``next()``. ``close()`` on the returned
    iterator, or dropping it, stops the thread and closes the source (in that
    thread), releasing its handles. ``depth == 0`` returns ``chunks`` unchanged.

    Args:
        chunks: the source iterator.
        depth: chunks buffered ahead, >= 0.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"readahead depth must be an int >= 0, got {depth!r}")
    if depth == 0:
        return chunks
    return _ReadAhead(iter(chunks), depth)


# --------------------------------------------------------------------------- local shard cache


class _ShardCache:
    """Whole remote shards kept in a local directory, shared by threads and processes.

    Layout: ``<key>-<name>`` data files (key from the URL and the object's identity,
    so a changed object gets a new entry), ``.tmp-<key>-<size>-<token>`` downloads
    in progress, ``.locks/<key>`` lock files, ``.lock`` guarding eviction. A reader
    holds a shared ``flock`` on its entry's lock file, a download an exclusive one;
    eviction only removes entries whose lock it can take at once, least recently
    used first (use time is the data file's mtime, touched on every open).
    """

    def __init__(self, root: str, limit: int) -> None:
        self.root = root
        self.limit = limit
        os.makedirs(os.path.join(root, ".locks"), exist_ok=True)

    @staticmethod
    def key(url: str, identity: Mapping[str, str]) -> str:
        text = url + "\n" + "\n".join(f"{k}={v}" for k, v in sorted(identity.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _data_path(self, key: str, url: str) -> str:
        name = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(url.rstrip("/")))[-80:]
        return os.path.join(self.root, f"{key}-{name}")

    @contextlib.contextmanager
    def entry(self, url: str, options: IOOptions) -> Iterator[str | None]:
        """Yield the local path of ``url``'s cached copy (downloading it if needed),
        held in use until exit; ``None`` when it cannot be cached (no size reported,
        larger than the limit, or no room left beside shards in use)."""
        import fcntl

        fs, path = _filesystem(url, options)
        info = _call_with_retries(url, 0, options, lambda: _fresh_info(fs, path))
        size = info.get("size")
        if size is None or size > self.limit:
            yield None
            return
        identity = _identity(info)
        key = self.key(url, identity)
        data = self._data_path(key, url)
        lock_fd = os.open(os.path.join(self.root, ".locks", key), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            for _attempt in range(5):
                fcntl.flock(lock_fd, fcntl.LOCK_SH)
                if self._present(data, size):
                    break
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
                if not self._present(data, size) and not self._download(
                    url, key, data, size, identity, options
                ):
                    fcntl.flock(lock_fd, fcntl.LOCK_UN)
                    yield None
                    return
                # converting EX -> SH is not atomic; eviction may slip in: check again
                fcntl.flock(lock_fd, fcntl.LOCK_SH)
                if self._present(data, size):
                    break
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
            else:
                yield None
                return
            with contextlib.suppress(OSError):  # the use time that LRU eviction sorts by
                now = time.time_ns()
                os.utime(data, ns=(now, now))
            yield data
        finally:
            os.close(lock_fd)

    @staticmethod
    def _present(data: str, size: int) -> bool:
        try:
            return os.stat(data).st_size == size
        except FileNotFoundError:
            return False

    @contextlib.contextmanager
    def _global_lock(self) -> Iterator[None]:
        import fcntl

        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _download(self, url: str, key: str, data: str, size: int,
                  identity: Mapping[str, str], options: IOOptions) -> bool:
        import fcntl

        with self._global_lock():
            if not self._make_room(size):
                logger.warning("shard cache %s: no room for %s (%d bytes) within %d bytes "
                               "beside shards in use; streaming it uncached",
                               self.root, url, size, self.limit)
                return False
            tmp = os.path.join(self.root, f".tmp-{key}-{size}-{secrets.token_hex(6)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)  # marks the download alive for _make_room
        try:
            with os.fdopen(os.dup(fd), "wb") as out:
                for chunk in _chunks(url, 0, None, options, expect=identity):
                    out.write(chunk)
                out.flush()
                written = out.tell()
            if written != size:
                raise RemoteReadError(f"caching {url}: got {written} bytes, expected {size}")
            os.replace(tmp, data)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return True

    def _make_room(self, need: int) -> bool:
        """Evict unused shards, oldest use first, until ``need`` more bytes fit.

        Called with the global lock held. Downloads in progress count with their
        final size; those left by dead processes are removed.
        """
        import fcntl

        used = 0
        entries = []
        with os.scandir(self.root) as it:
            for e in it:
                if not e.is_file(follow_symlinks=False) or e.name == ".lock":
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if e.name.startswith(".tmp-"):
                    if self._try_lock(e.path):  # nobody writes it: a dead download
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(e.path)
                        continue
                    parts = e.name.split("-")
                    used += int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else st.st_size
                elif not e.name.startswith("."):
                    used += st.st_size
                    entries.append((st.st_mtime_ns, e.name, e.path, st.st_size))
        if used + need <= self.limit:
            return True
        for _mtime, name, path, nbytes in sorted(entries):
            lock_path = os.path.join(self.root, ".locks", name.split("-", 1)[0])
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # in use
            try:
                os.unlink(path)
                used -= nbytes
                logger.debug("shard cache %s: evicted %s (%d bytes)", self.root, name, nbytes)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
            if used + need <= self.limit:
                return True
        return False

    @staticmethod
    def _try_lock(path: str) -> bool:
        import fcntl

        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)


def _cached_chunks(url: str, start: int, end: int | None, options: IOOptions,
                   check_size: Callable[[int], None] | None) -> Iterator[bytes]:
    cache = _ShardCache(options.cache_dir, options.cache_limit)
    with cache.entry(url, options) as local:
        yield from _chunks(local if local is not None else url, start, end, options, check_size=check_size)


def open_chunks(url: str, start: int = 0, end: int | None = None,
                options: IOOptions = _DEFAULT_OPTIONS, *,
                check_size: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """The byte stream the tar reader consumes: cache, then retried reads, then read-ahead.

    With ``options.cache_dir`` set and a remote ``url``, the whole object is first
    downloaded once into the cache (atomically; concurrent threads and processes
    share one download), then ``[start, end)`` is served from the local copy. The
    read-ahead thread (``options.readahead`` chunks) starts at once, so a shard
    opened early is fetched while the previous one is consumed.

    Args:
        check_size: called with the object's size in bytes when it is first
            opened (no extra request: the open reports it); raise from it to
            refuse the object, e.g. a shard that changed since it was indexed.

    Returns:
        An iterator of ``bytes`` chunks as :func:`iter_chunks`; close it to release
        its thread, handles and cache entry early.
    """
    _check_range(start, end)
    url = os.fspath(url)
    if _is_local(url):
        # The kernel reads ahead on local files; a thread here only adds GIL hand-offs
        # (measured: ~20% of raw iteration time spent waiting on its queue).
        return _chunks(url, start, end, options, check_size=check_size)
    if options.cache_dir is not None:
        source = _cached_chunks(url, start, end, options, check_size)
    else:
        source = _chunks(url, start, end, options, check_size=check_size)
    return readahead(source, options.readahead)


# --------------------------------------------------------------------------- writing


@contextlib.contextmanager
def open_output(url: str, options: IOOptions = _DEFAULT_OPTIONS) -> Iterator[BinaryIO]:
    """Write an object that appears at ``url`` only if the ``with`` block succeeds.

    Local paths: a temporary file in the same directory, fsynced and renamed over
    ``url`` (``os.replace``); parent directories are created. Remote URLs: a local
    temporary file (in ``options.cache_dir`` if set, else the system's temporary
    directory) uploaded at exit, in one PUT on object stores (s3, gs, az, memory)
    and through a temporary name then a move elsewhere.

    Yields:
        A writable binary file.

    Raises:
        RemoteWriteError: the upload failed (nothing is left at ``url``).
    """
    url = os.fspath(url)
    if _is_local(url):
        with _local_output(_local_path(url)) as f:
            yield f
        return
    fs, path = _filesystem(url, options)
    fd, tmp = tempfile.mkstemp(prefix=".shardflow-upload-", dir=options.cache_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        protocol = _protocol(url)
        try:
            if protocol in _ATOMIC_PUT_PROTOCOLS:
                fs.put_file(tmp, path)
            else:
                parent, name = posixpath.split(path.rstrip("/"))
                staged = posixpath.join(parent, f".{name}.{secrets.token_hex(6)}.tmp")
                with contextlib.suppress(Exception):
                    fs.makedirs(parent, exist_ok=True)
                try:
                    fs.put_file(tmp, staged)
                    fs.mv(staged, path)
                except BaseException:
                    with contextlib.suppress(Exception):
                        fs.rm(staged)
                    raise
        except ShardflowError:
            raise
        except Exception as exc:
            raise RemoteWriteError(f"writing {url} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                fs.invalidate_cache(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def _local_output(path: str) -> Iterator[BinaryIO]:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    # os.open with 0o666 honours the umask, unlike mkstemp's 0o600
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable
        dir_fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
