"""numpy internals that shardflow uses.

* ``_read_array_header`` (in ``numpy.lib._format_impl`` since numpy 2.0, in
  ``numpy.lib.format`` before): the one reader of a version 3.0 ``.npy`` header
  (UTF-8 field names); versions 1.0 and 2.0 have public readers.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

__all__ = ["REQUIRED", "read_array_header", "missing"]

REQUIRED = ("numpy.lib._format_impl._read_array_header",)
"""The private names used here (``tests/test_compat.py`` checks each one exists)."""


def read_array_header(f: Any, version: tuple[int, int]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` header at ``f`` (after the magic).

    Raises:
        ValueError: the header is invalid, or of a version this numpy cannot read.
    """
    fmt = np.lib.format
    if version == (1, 0):
        return fmt.read_array_header_1_0(f)
    if version == (2, 0):
        return fmt.read_array_header_2_0(f)
    reader = _v3_reader()
    if reader is None:
        raise ValueError(f".npy format version {version} has no reader in numpy {np.__version__}")
    return reader(f, version=version)


def _v3_reader() -> Any:
    for where in ("numpy.lib._format_impl", "numpy.lib.format"):
        try:
            module = importlib.import_module(where)
        except ImportError:
            continue
        reader = getattr(module, "_read_array_header", None)
        if reader is not None:
            return reader
    return None


def missing() -> list[str]:
    """The names of :data:`REQUIRED` that this numpy does not have."""
    return [] if _v3_reader() is not None else list(REQUIRED)
