"""fsspec and s3fs internals that shardflow's storage uses (s3fs is optional: imported by the caller).

* ``AbstractFileSystem._strip_protocol(path)`` (a classmethod): the path part of a URL as
  the filesystem itself writes it (``file:///a/b`` -> ``/a/b``; for ``memory://`` the key
  of its store).
* ``S3FileSystem._call_s3(method, **kwargs)``: one botocore call on the filesystem's
  client, with s3fs's retries and error translation (``OSError`` subclasses); the reader
  sends its own ``GetObject`` (``IfMatch``, ``VersionId``, one ``Range``) through it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REQUIRED", "strip_protocol", "call_s3", "missing"]

REQUIRED = ("fsspec.AbstractFileSystem._strip_protocol", "s3fs.S3FileSystem._call_s3")
"""The private names used here (``tests/test_compat.py`` checks each one exists)."""


def strip_protocol(fs: Any, path: str) -> str:
    """``path`` without its protocol, as the filesystem (an instance or its class) ``fs`` writes it."""
    return fs._strip_protocol(path)


def call_s3(fs: Any) -> Any:
    """The coroutine function that sends one S3 request on the s3fs filesystem ``fs``:
    ``await call_s3(fs)("get_object", Bucket=..., Key=...)``."""
    return fs._call_s3


def missing() -> list[str]:
    """The names of :data:`REQUIRED` that the installed fsspec and s3fs do not have (s3fs's
    all, without s3fs)."""
    import fsspec

    out = [] if hasattr(fsspec.AbstractFileSystem, "_strip_protocol") else [REQUIRED[0]]
    try:
        import s3fs
    except ImportError:
        return [*out, REQUIRED[1]]
    return out if hasattr(s3fs.S3FileSystem, "_call_s3") else [*out, REQUIRED[1]]
