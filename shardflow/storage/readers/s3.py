"""Streaming reader of ``s3://`` objects: one ``GetObject`` per open, ``If-Match`` on reopen."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardflow.compat.fsspec import call_s3
from shardflow.errors import RemoteReadError

from ..errors import ShardChangedError
from ..backends.filesystems import fresh_info, object_identity, sync_within
from .stream import StreamReader, range_total

if TYPE_CHECKING:  # fsspec is imported by whoever made the filesystem
    import fsspec


class S3Reader(StreamReader):
    """One streaming ``GetObject`` (``Range: bytes=offset-``) on s3fs's client and loop.

    One request serves the rest of the range, where an fsspec file issues one ranged
    request per block after a ``HEAD``: the response itself gives the object's ETag,
    version and size (``Content-Range``). A single GET reads one version of the
    object; a reopen (after a dropped connection) sends ``If-Match`` with the ETag
    seen first, so that the store refuses a changed object (412) rather than
    splicing two versions: that is raised as :class:`ShardChangedError`.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, url: str, offset: int,
                 stop: int | None, expect: Mapping[str, str] | None, timeout: float) -> None:
        from fsspec.asyn import sync

        self._fs = fs
        self._timeout = timeout
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
            resp = sync_within(fs.loop, call_s3(fs), "get_object", timeout=timeout, what="a GetObject", **kwargs)
        except OSError as exc:
            code = _s3_error_code(exc)
            if code == "PreconditionFailed":
                raise ShardChangedError(
                    f"{url} changed while being read, at byte {offset} (its ETag is no longer {etag})"
                ) from exc
            if code == "InvalidRange":  # offset at or past the end: nothing left to read
                info = fresh_info(fs, path, timeout)
                self.identity = object_identity(info)
                self.size = info.get("size")
                return
            raise
        self._body = resp["Body"]
        self._open = True
        total = None
        if resp.get("ContentRange"):
            try:
                total = range_total(resp["ContentRange"], url, offset)
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


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is s3fs's filesystem (False without s3fs installed)."""
    try:
        from s3fs import S3FileSystem
    except ImportError:
        return False
    return isinstance(fs, S3FileSystem)
