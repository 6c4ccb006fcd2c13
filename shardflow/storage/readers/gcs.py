"""Streaming reader of ``gs://`` objects: one media GET per open, pinned to one generation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardflow.errors import RemoteReadError

from ...compat import gcsfs as gcsfs_compat
from ..errors import ShardChangedError
from ..backends.filesystems import fresh_info, sync_within
from .stream import StreamReader, range_total

if TYPE_CHECKING:  # fsspec is imported by whoever made the filesystem
    import fsspec


class GCSReader(StreamReader):
    """One streaming media GET (``Range: bytes=offset-``) on gcsfs's session and loop.

    One request serves the rest of the range, where gcsfs's file object issues one
    ranged request per block. The first open learns the object's generation (from
    the response); a reopen (after a dropped connection) asks for that generation
    only, so that a replaced object answers 404 instead of splicing two versions:
    that is raised as :class:`ShardChangedError`. The answer's headers and each read
    must come within ``timeout`` seconds (``IOOptions.request_timeout``).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, url: str, offset: int,
                 stop: int | None, expect: Mapping[str, str] | None, timeout: float) -> None:
        self._fs = fs
        self._timeout = timeout
        self._resp = None
        self.size: int | None = None
        self.identity: dict[str, str] = {}
        _bucket, _key, generation = fs.split_path(path)
        pinned = generation or (expect or {}).get("generation")
        if stop is not None and offset >= stop:  # nothing to read (a GET would be a 416)
            self._describe(fresh_info(fs, path, timeout))
            return
        headers = {"Accept-Encoding": "identity"}
        if offset or stop is not None:
            headers["Range"] = f"bytes={offset}-{'' if stop is None else stop - 1}"
        media = fs.url(path, generation=pinned)
        self._resp = sync_within(fs.loop, self._get, media, headers, url, offset, pinned, expect is not None,
                                 timeout=timeout, what="a GET")
        if self._resp is None:  # offset at the end of the object
            self._describe(fresh_info(fs, path, timeout))
            return
        self._open = True

    def _describe(self, info: Mapping[str, Any]) -> None:
        self.size = info.get("size")
        self.identity = {k: str(info[k]) for k in ("generation", "size") if info.get(k) is not None}

    async def _get(self, media: str, headers: dict[str, str], url: str, offset: int,
                   pinned: str | None, reopen: bool):
        import aiohttp

        fs = self._fs
        http = await gcsfs_compat.session(fs)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout, sock_read=self._timeout)
        resp = await http.get(media, headers=gcsfs_compat.request_headers(fs, headers), timeout=timeout)
        try:
            if resp.status == 404:
                if reopen and pinned:
                    raise ShardChangedError(
                        f"{url} changed while being read, at byte {offset} "
                        f"(generation {pinned} is gone)")
                raise FileNotFoundError(url)
            if resp.status == 416:
                resp.close()
                return None
            if resp.status >= 400:
                resp.raise_for_status()
            self._check(resp, url, offset, pinned, "Range" in headers)
        except BaseException:
            resp.close()
            raise
        return resp

    def _check(self, resp, url: str, offset: int, pinned: str | None, ranged: bool) -> None:
        headers = resp.headers
        if resp.status == 206:
            total = range_total(headers.get("Content-Range"), url, offset)
        elif resp.status == 200 and offset == 0:
            total = int(headers["Content-Length"]) if "Content-Length" in headers else None
        else:
            raise RemoteReadError(f"reading {url}: asked for bytes from {offset}, the store answered "
                                  f"HTTP {resp.status} without a Content-Range")
        generation = headers.get("x-goog-generation") or pinned
        if pinned and generation != pinned:
            raise ShardChangedError(f"{url} changed while being read, at byte {offset} "
                                    f"(generation {pinned}, now {generation})")
        self.size = total
        self.identity = {k: str(v) for k, v in (("generation", generation), ("size", total)) if v is not None}

    async def _part(self, n: int) -> bytes:
        return await self._resp.content.read(n)

    def _release(self) -> None:
        self._resp.close()


def is_gcs(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is gcsfs's filesystem (False without gcsfs installed)."""
    try:
        from gcsfs import GCSFileSystem
        from gcsfs.core import GCSFileSystem as CoreGCSFileSystem
    except ImportError:
        return False
    return isinstance(fs, (GCSFileSystem, CoreGCSFileSystem))
