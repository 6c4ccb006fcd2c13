"""The one reader of ``.npy`` headers (format versions 1.0, 2.0 and 3.0): for the offset
and sizes indexes (:mod:`.manifest`), the ``npy`` codec (:mod:`shardflow.codecs`) and
``convert arrays`` (:mod:`shardflow.convert.records.arraysource`).

The header dict is parsed by numpy's own parser (:func:`shardflow.compat.numpy.read_array_header`),
so nothing is unpickled. With the fast paths on (:mod:`shardflow.fastpath`, ``"npy"``)
the form ``np.save`` writes for a little-endian integer array in C order (shardflow's
indexes) is matched by a strict pattern, and every other header is parsed once and kept
(a data set repeats a handful of headers; numpy's parser costs ~100 us a call); with them
off, numpy parses every header.
"""

from __future__ import annotations

import functools
import re
from io import BytesIO
from typing import IO, Union

import numpy as np

from .. import fastpath
from ..compat.numpy import read_array_header

__all__ = ["MAGIC", "NpyHeader", "header_of", "read_header"]

MAGIC = b"\x93NUMPY"
"""The first 6 bytes of every ``.npy``."""

NpyHeader = tuple[tuple[int, ...], bool, np.dtype, int]
"""``(shape, fortran_order, dtype, data offset in bytes)``."""

_Bytes = Union[bytes, bytearray, memoryview]

_MOST = 1 << 20  # the longest header read from a file (numpy refuses more than 10,000 bytes anyway)
_PLAIN = re.compile(rb"\{'descr': '([<|][iu][1248])', 'fortran_order': False, 'shape': \(((?:\d+, )*\d*),?\), \} *\n")


def header_of(data: _Bytes) -> NpyHeader:
    """The header of the ``.npy`` at the start of ``data``.

    Args:
        data: the file's bytes (the header at least).

    Returns:
        ``(shape, fortran_order, dtype, offset)``: the array's shape and order, its dtype
        (an object dtype is returned, not refused: the caller decides), and where its data
        starts in ``data``.

    Raises:
        ValueError: not a ``.npy`` (wrong magic bytes), a format version numpy cannot
            read, a header cut short, or one numpy's parser refuses.
    """
    if len(data) < 10 or bytes(data[:6]) != MAGIC:
        raise ValueError(f"not a .npy: it starts with {bytes(data[:8])!r}, not {MAGIC!r}")
    version = (data[6], data[7])
    if version == (1, 0):
        start = 10
    elif version in ((2, 0), (3, 0)):
        start = 12
    else:
        raise ValueError(f".npy format version {version[0]}.{version[1]} is not one of 1.0, 2.0, 3.0")
    end = start + int.from_bytes(data[8:start], "little")
    if len(data) < end:
        raise ValueError(f"the .npy header says it is {end - start} bytes long, but only {len(data) - start} follow")
    # bytes() of the header alone: the cache hashes its key, and a bytearray or memoryview
    # (members of 1 MiB and more arrive as bytearray) is not hashable
    head = bytes(data[8:end])
    parse = _fast if fastpath.enabled("npy") else _parse
    shape, fortran, dtype = parse(head, version)
    return shape, fortran, dtype, end


def read_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` that file ``f`` is at the start of;
    ``f`` is left at the first byte of the data.

    Raises:
        ValueError: as :func:`header_of`.
    """
    prefix = f.read(10)
    if len(prefix) == 10 and prefix[6] != 1:
        prefix += f.read(2)
    length = int.from_bytes(prefix[8:], "little") if len(prefix) in (10, 12) else 0
    if length > _MOST:
        raise ValueError(f"the .npy header says it is {length} bytes long (numpy reads at most {_MOST})")
    shape, fortran, dtype, _ = header_of(prefix + f.read(length))
    return shape, fortran, dtype


def _parse(head: bytes, version: tuple[int, int]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """numpy's parse of ``head`` (the length field and the header dict)."""
    shape, fortran, dtype = read_array_header(BytesIO(head), version)
    return tuple(shape), bool(fortran), dtype


def _fast(head: bytes, version: tuple[int, int]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """:func:`_parse`'s result: shardflow's plain form by the pattern, any other header cached."""
    m = _PLAIN.fullmatch(head, 4 if version != (1, 0) else 2)
    if m is not None:
        return tuple(int(d) for d in m.group(2).split(b", ") if d), False, np.dtype(m.group(1).decode("ascii"))
    return _cached(head, version)


_cached = functools.lru_cache(maxsize=256)(_parse)
