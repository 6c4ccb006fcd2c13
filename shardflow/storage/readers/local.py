"""Reader of local files."""

from __future__ import annotations

import os


class LocalReader:
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
