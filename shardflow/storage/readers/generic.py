"""Reader of any other fsspec store (gcs, azure, ...) through an uncached file object."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..backends.filesystems import object_identity
from .local import FileObjectReader

if TYPE_CHECKING:  # fsspec is imported by whoever made the filesystem
    import fsspec


class FileReader(FileObjectReader):
    """An fsspec file object opened without caching: each ``read`` is one ranged request.

    For stores without a streaming reader of ours (gcs, azure, ...); a reopen is
    checked against the identity ``fs.info()`` reported at the first open.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, offset: int,
                 block_size: int) -> None:
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)
        self._fs, self._path = fs, path
        super().__init__(fs.open(path, "rb", block_size=block_size, cache_type="none"), offset)

    def describe(self) -> tuple[dict[str, str], int | None]:
        details = getattr(self._file, "details", None)
        info = details if isinstance(details, Mapping) else self._fs.info(self._path)
        return object_identity(info), info.get("size")
