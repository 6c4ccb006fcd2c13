"""Reader of any other fsspec store (gcs, azure, ...) through an uncached file object."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import fsspec

from ..filesystems import object_identity


class FileReader:
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
            self.identity = object_identity(info)
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
