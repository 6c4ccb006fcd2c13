"""Images a Parquet file references by path, read for ``convert parquet --images-root DIR``.

``datasets``' ``to_parquet()`` writes a local ``Image`` column as ``{bytes: null, path: ...}``:
the file holds where the image was, not the image. With ``images_root`` (a local folder the
user names) such a value is read from disk: a relative path is taken relative to the Parquet
file's folder (a local file; a remote file's relative paths are taken relative to the root),
an absolute one as it is, and either must lead to a regular file inside the root, symlinks
resolved: a path that leads out of it (``../../etc/passwd``, a link pointing outside) is an
:class:`ImagePathError` naming the row and the path, never read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any

from ... import storage
from ...errors import ConversionError
from ...storage.urls import local_path

__all__ = ["ImagePathError", "read_image_path", "check_images_root"]

MAX_IMAGE_BYTES = 1 << 30
"""The largest image file read by path (1 GiB): a larger one is an error, not a memory spike."""


class ImagePathError(ConversionError, PermissionError):
    """An image referenced by path in a Parquet file lies outside the folder the user allowed
    (``images_root``), or is not a regular file there."""

    default_reason = "image_path"


def check_images_root(root: str | os.PathLike[str]) -> str:
    """The real path of ``images_root``, a local folder.

    Raises:
        FileNotFoundError: no folder there.
    """
    real = os.path.realpath(os.fspath(root))
    if not os.path.isdir(real):
        raise FileNotFoundError(f"images_root {os.fspath(root)!r}: no such folder")
    return real


def read_image_path(value: Mapping[str, Any], parquet_url: str, root: str, where: str) -> bytes:
    """The bytes of the image file a struct value names by ``path``.

    Args:
        value: the ``{bytes: None, path: str}`` value.
        parquet_url: the Parquet file (a relative path is relative to its folder).
        root: the real path of the allowed folder (:func:`check_images_root`).
        where: the file, row and key, for errors.

    Returns:
        The file's bytes, unchanged.

    Raises:
        ImagePathError: no path, a path out of ``root``, or not a regular file.
        ConversionError: the file cannot be read, or is over :data:`MAX_IMAGE_BYTES`.
    """
    path = value.get("path")
    if not isinstance(path, str) or not path:
        raise ImagePathError(f"{where}: an image value with neither bytes nor a path")
    if storage.is_local(parquet_url) and not os.path.isabs(path):
        base = os.path.dirname(os.path.abspath(local_path(parquet_url)))
    else:
        base = root
    real = os.path.realpath(os.path.join(base, path))
    if os.path.commonpath([real, root]) != root:
        raise ImagePathError(f"{where}: image path {path!r} leads to {real!r}, outside images_root {root!r}; "
                             "not read")  # fmt: skip
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ConversionError(f"{where}: cannot read image path {path!r} ({real}): {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ImagePathError(f"{where}: image path {path!r} ({real}) is not a regular file")
        if info.st_size > MAX_IMAGE_BYTES:
            raise ConversionError(f"{where}: image path {path!r} is {info.st_size} bytes, over {MAX_IMAGE_BYTES}")
        return f.read(MAX_IMAGE_BYTES + 1)
