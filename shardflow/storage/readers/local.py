"""Reader of local files, and the base of every reader over an open file object."""

from __future__ import annotations

import os
from typing import Any, BinaryIO


class FileObjectReader:
    """A reader over an open binary file: ``read`` and ``close`` pass through.

    Subclasses open the file and give :meth:`describe` (identity and size); the
    file is closed if that, or the seek to ``offset``, fails.
    """

    identity: dict[str, str]
    size: int | None

    def __init__(self, file: BinaryIO, offset: int) -> None:
        self._file = file
        try:
            self.identity, self.size = self.describe()
            if offset:
                self._file.seek(offset)
        except BaseException:
            self._file.close()
            raise

    def describe(self) -> tuple[dict[str, str], int | None]:
        """``(identity, size in bytes or None)`` of the open object."""
        raise NotImplementedError

    def read(self, n: int) -> bytes:
        return self._file.read(n)

    def close(self) -> None:
        self._file.close()


class LocalReader(FileObjectReader):
    """A local file read with plain ``read`` calls; identity from ``fstat``."""

    def __init__(self, path: str, offset: int) -> None:
        super().__init__(open(path, "rb", buffering=0), offset)  # noqa: SIM115 - closed by close()

    def describe(self) -> tuple[dict[str, str], int | None]:
        st: Any = os.fstat(self._file.fileno())
        return {"size": str(st.st_size), "mtime": str(st.st_mtime_ns), "ino": str(st.st_ino)}, st.st_size
