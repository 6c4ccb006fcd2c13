"""The integer codec (``cls``, ``idx``, ``label`` ... fields): ASCII decimal, within int64 both
ways, so that a label is never written that the reader refuses."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..errors import DecodeError

__all__ = ["INT64", "decode_int", "encode_int"]

INT64 = range(-(1 << 63), 1 << 63)
"""The class indexes an integer field holds: an int64, the dtype the default collate stacks them into."""
_INT_DIGITS = 19  # an int64's
_INT_RE = re.compile(rb"[+-]?[0-9]+")


def encode_int(value: Any, ext: str) -> bytes:
    """An int (a numpy or 0-d tensor integer too) as ASCII decimal.

    Raises:
        TypeError: not an integer.
        ValueError: outside :data:`INT64` (what :func:`decode_int` would refuse).
    """
    if isinstance(value, (np.integer,)) or (hasattr(value, "item") and getattr(value, "ndim", 1) == 0):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an int class index, got {type(value).__name__}")
    if value not in INT64:
        raise ValueError(f"class index {value} does not fit an int64 (the reader's bound for .{ext} fields); "
                         "store it in a .txt or .json field instead")
    return str(value).encode("ascii")


def decode_int(data: bytes, options: Any) -> int:
    """An ASCII decimal integer that fits an int64 (surrounding whitespace allowed); a longer
    or other value is a DecodeError here, not a bare ValueError at collate time."""
    text = bytes(data).strip()  # bytes, bytearray or a memoryview alike
    if not _INT_RE.fullmatch(text):
        shown = text[:20].decode("ascii", "replace")
        raise DecodeError(f"not an ASCII decimal integer ({len(text)} bytes, starting {shown!r})")
    digits = len(text.lstrip(b"+-"))
    if digits > _INT_DIGITS:
        raise DecodeError(f"{digits} digits, more than {_INT_DIGITS} (an int64 class index)")
    value = int(text)
    if value not in INT64:
        raise DecodeError(f"{value} does not fit an int64 class index")
    return value
