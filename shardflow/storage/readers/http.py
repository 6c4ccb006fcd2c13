"""Streaming reader of ``http(s)://`` objects: one ranged GET per open."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardflow.compat.aio import request_parameters
from shardflow.errors import RemoteReadError, redact

from ..errors import ShardChangedError, ShortReadError
from ..backends.filesystems import identity_difference, object_identity, sync_within
from .stream import StreamReader, range_total

if TYPE_CHECKING:  # fsspec is imported by whoever made the filesystem
    import fsspec

logger = logging.getLogger(__name__)



@functools.lru_cache(maxsize=1)
def _aiohttp_auto_decompress_per_request() -> bool:
    return "auto_decompress" in request_parameters()


class HTTPReader(StreamReader):
    """One streaming GET (``Range: bytes=offset-``) on fsspec's aiohttp session and loop.

    One request serves the whole range (no request per block); the response's
    Content-Range, ETag and Last-Modified are checked against the identity seen by
    ``HEAD`` so that a reopened read cannot splice two versions of an object.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, url: str, offset: int,
                 stop: int | None, info: Mapping[str, Any], timeout: float) -> None:
        from fsspec.asyn import sync

        self._fs = fs
        self._timeout = timeout
        self._resp = None
        self.identity = object_identity(info)
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
            # pace; bound the silence between packets instead (IOOptions.request_timeout)
            import aiohttp

            kwargs["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        if stop is None or offset < stop:  # else nothing to read (a GET would be a 416)
            # the headers too must come within the timeout (a server may stall before them)
            self._resp = sync_within(fs.loop, self._get, url, offset, headers, kwargs, timeout=timeout, what="a GET")
            self._open = True

    async def _get(self, url: str, offset: int, headers: dict, kwargs: dict):
        session = await self._fs.set_session()
        encode = getattr(self._fs, "encode_url", None)  # fsspec >= 2023.9
        target = encode(url) if encode is not None else url
        resp = await session.get(target, headers=headers, **kwargs)
        try:
            self._check(resp, url, offset)
            if resp.status == 200 and offset:
                logger.debug("%s: server ignored the Range header; skipping %d bytes", redact(url), offset)
                left = offset
                while left:
                    skipped = await resp.content.read(min(left, 1 << 20))
                    if not skipped:
                        raise ShortReadError(f"{url}: body ended before byte {offset}")
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
            total = range_total(headers.get("Content-Range"), url, offset)
        elif resp.status == 200:
            if headers.get("Content-Encoding", "identity") in ("identity", ""):
                total = headers.get("Content-Length")
        else:
            raise RemoteReadError(f"reading {url}: unexpected HTTP status {resp.status}")
        seen = {k: headers[k] for k in ("ETag", "Last-Modified") if k in headers}
        if total is not None:
            seen["size"] = str(int(total))
        change = identity_difference(self.identity, seen)
        if change is not None:
            raise ShardChangedError(f"{url} changed while being read ({change})")

    async def _part(self, n: int) -> bytes:
        return await self._resp.content.read(n)

    def _release(self) -> None:
        self._resp.close()
