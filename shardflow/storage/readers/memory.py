"""Reader of ``memory://`` objects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...compat.fsspec import strip_protocol
from ..backends.filesystems import object_identity

if TYPE_CHECKING:  # fsspec is imported by whoever made the filesystem
    import fsspec


class MemoryReader:
    """A snapshot of a ``memory://`` object (its file objects are shared, not reopenable)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, offset: int) -> None:
        stripped = strip_protocol(fs, path)
        if stripped not in fs.store:
            raise FileNotFoundError(path)
        self._data = memoryview(fs.store[stripped].getvalue())
        self.identity = object_identity(fs.info(stripped))
        self.identity["size"] = str(len(self._data))
        self.size: int | None = len(self._data)
        self._pos = offset

    def read(self, n: int) -> bytes:
        out = bytes(self._data[self._pos : self._pos + n])
        self._pos += len(out)
        return out

    def close(self) -> None:
        self._data.release()
