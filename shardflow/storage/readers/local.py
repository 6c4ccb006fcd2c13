"""Reader of local files, and the base of every reader over an open file object."""

from __future__ import annotations

import os
import stat
from typing import Any, BinaryIO

from ..errors import NotRegularFileError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _refuse(path: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(21, "Is a directory", path)
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    raise NotRegularFileError(
        f"{path} is {kind}, not a regular file: shards, indexes and manifests are read from regular files only"
    )


def open_regular(path: str) -> BinaryIO:
    """:func:`regular_fd` as an unbuffered binary file."""
    return os.fdopen(regular_fd(path), "rb", buffering=0)


def regular_fd(path: str) -> int:
    """Open a local file for reading (a descriptor), refusing anything but a regular file.

    ``stat`` first (a socket cannot be opened at all), then ``open`` with
    ``O_NONBLOCK`` (a FIFO without a writer would block the open) and ``fstat``
    of what was opened (the name may have been swapped in between).

    Raises:
        NotRegularFileError: a FIFO, a device or a socket (names the path and the kind).
        IsADirectoryError, FileNotFoundError, PermissionError: as ``open``.
    """
    _refuse(path, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _refuse(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


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
        super().__init__(open_regular(path), offset)

    def describe(self) -> tuple[dict[str, str], int | None]:
        st: Any = os.fstat(self._file.fileno())
        # dev and ctime too: together they tell one version of a file from any other (format.layouts)
        identity = {"size": str(st.st_size), "mtime": str(st.st_mtime_ns), "ino": str(st.st_ino), "dev": str(st.st_dev),
                    "ctime": str(st.st_ctime_ns)}
        return identity, st.st_size
