"""One reader per protocol, chosen by :func:`open_reader`.

A reader is opened at a byte offset and has ``read(n) -> bytes`` (``b""`` at the end),
``close()``, ``identity`` (the keys naming one version of the object) and ``size``
(bytes, or ``None`` when the store does not say)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..backends.filesystems import fresh_info, is_http, is_memory
from ..options import IOOptions
from .gcs import GCSReader, is_gcs
from .generic import FileReader
from .http import HTTPReader
from .local import LocalReader, open_regular, regular_fd
from .memory import MemoryReader
from .metered import Metered
from .s3 import S3Reader, is_s3

__all__ = ["READERS", "FileReader", "GCSReader", "HTTPReader", "LocalReader", "MemoryReader", "S3Reader", "open_reader", "open_regular", "regular_fd"]


def open_reader(fs, path: str, url: str, offset: int, end: int | None, options: IOOptions,
                 expect: Mapping[str, str] | None = None):
    """Open the reader of ``fs``'s protocol at byte ``offset`` of ``path``; a remote one
    counts its request and bytes (:class:`~.metered.Metered`).

    Args:
        end: byte after the last one wanted, or None (to the end).
        expect: the identity seen at a first open, for a reopen (S3 sends ``If-Match``,
            GCS asks for the generation seen).
    """
    reader = _open(fs, path, url, offset, end, options, expect)
    return reader if isinstance(reader, LocalReader) else Metered(reader, url)


def _open(fs, path: str, url: str, offset: int, end: int | None, options: IOOptions,
          expect: Mapping[str, str] | None):
    for _, matches, opener in READERS:
        if matches(fs):
            return opener(fs, path, url, offset, end, options, expect)
    return FileReader(fs, path, offset, options.block_size)


def _is_local(fs) -> bool:
    from fsspec.implementations.local import LocalFileSystem  # imported already: fs is an fsspec filesystem

    return isinstance(fs, LocalFileSystem)


def _http(fs, path: str, url: str, offset: int, end: int | None, options: IOOptions, expect) -> HTTPReader:
    info = fresh_info(fs, path, options.request_timeout)  # the size bounds the request (no open-ended range)
    size = info.get("size")
    stop = end if size is None else (size if end is None else min(end, size))
    return HTTPReader(fs, url, offset, stop, info, options.request_timeout)


READERS: tuple[tuple[str, Callable[[Any], bool], Callable[..., Any]], ...] = (
    ("local", _is_local, lambda fs, path, url, offset, end, options, expect: LocalReader(path, offset)),
    ("memory", is_memory, lambda fs, path, url, offset, end, options, expect: MemoryReader(fs, path, offset)),
    ("http", is_http, _http),
    ("s3", is_s3, lambda fs, path, url, offset, end, options, expect: S3Reader(
        fs, path, url, offset, end, expect, options.request_timeout)),
    ("gcs", is_gcs, lambda fs, path, url, offset, end, options, expect: GCSReader(
        fs, path, url, offset, end, expect, options.request_timeout)),
)
"""The reader of each filesystem, as ``(name, matches(fs), open(fs, path, url, offset, end,
options, expect))``, tried in order (as fsspec's ``known_implementations`` maps protocols to
classes): the first that matches opens the object; any other filesystem gets the generic
:class:`~.generic.FileReader` (fsspec's own file object, read in ``block_size`` parts). A new
store's reader is one more row."""
