"""Pillow modes brought to 8-bit ``RGB``, ``RGBA`` or ``L`` for :func:`shardflow.codecs.image.decode_image`
(and JPEG encoding).

* ``mode="RGB"`` (the default of ``decode_image``) gives 3 channels of uint8. Every Pillow mode
  is brought there: ``1`` -> 0/255; ``L`` replicated; palette images (``P``, ``PA``, with or without
  transparency) expanded through their palette; ``CMYK`` converted by Pillow's plain formula
  (no ICC colour management); ``YCbCr``, ``LAB``, ``HSV`` converted by Pillow.
* **Alpha is dropped, not composited** (``RGBA``, ``LA``, ``PA``, palette transparency), the
  same as torchvision's ``read_image(..., ImageReadMode.RGB)``. Ask for ``mode="RGBA"`` to keep it.
* **High bit depths are scaled to 0..255 from the range the file declares**, never clipped
  (Pillow's own ``convert`` clips 16-bit values at 255):

  ============================  ===================================  ======================
  stored as                     nominal range                        8-bit value
  ============================  ===================================  ======================
  16-bit grey (PNG, TIFF)       0..65535 (``I;16``, ``I;16B``)       ``v >> 8``
  16-bit RGB/RGBA/LA PNG        0..65535                             ``v >> 8`` (Pillow)
  12-bit grey TIFF              0..4095                              ``v >> 4``
  16-bit grey PPM/PGM           0..maxval, rescaled by Pillow to     ``v >> 8``
                                0..65535
  signed 16-bit grey TIFF       0..32767, negatives -> 0             ``v >> 7``
  unsigned 32-bit grey TIFF     0..2**32-1                           ``v >> 24``
  signed 32-bit ``I`` (TIFF     0..2**31-1, negatives -> 0           ``v >> 23``
  and any other ``I`` source)
  32-bit float ``F``            0.0..1.0 (the PyTorch convention     ``floor(255 * v + .5)``
                                for float images), clamped; NaN -> 0
  ============================  ===================================  ======================
"""

from __future__ import annotations

import numpy as np
from PIL import Image

__all__ = ["is_high_bit", "sample_depth", "to_mode"]

# Modes Pillow cannot convert straight to "L".
_TO_L_VIA_RGB = frozenset({"LAB"})

_TIFF_BITS_PER_SAMPLE = 258
_TIFF_SAMPLE_FORMAT = 339  # 1 unsigned int, 2 signed int, 3 float


def is_high_bit(img_mode: str) -> bool:
    """True for the modes of more than 8 bits per sample (``I``, ``I;16*``, ``F``)."""
    return img_mode in ("I", "F") or img_mode.startswith("I;16")


def to_mode(img: Image.Image, mode: str, depth: tuple[int, bool] | None) -> Image.Image:
    """Bring a loaded image to ``mode`` (``RGB``, ``RGBA`` or ``L``) by the table of the module
    docstring; ``depth`` as from :func:`sample_depth` for ``I`` modes (read before any transpose)."""
    if img.mode == mode:
        return img
    if img.mode == "F":
        img = _float_to_8bit(img)
    elif depth is not None:
        img = _int_to_8bit(img, depth)
    elif img.mode == "P" and mode != "RGBA" and "transparency" in img.info:
        # Alpha is dropped anyway; without this Pillow warns on every bytes-transparency image.
        del img.info["transparency"]
    if img.mode == mode:
        return img
    if mode == "L" and img.mode in _TO_L_VIA_RGB:
        img = img.convert("RGB")
    return img.convert(mode)


def _float_to_8bit(img: Image.Image) -> Image.Image:
    """Mode ``F`` (nominal range 0.0..1.0) to mode ``L``: clamp, NaN -> 0, round half up."""
    values = np.nan_to_num(np.clip(np.asarray(img), 0.0, 1.0), nan=0.0)
    return Image.fromarray(np.floor(values * 255.0 + 0.5).astype(np.uint8))


def _int_to_8bit(img: Image.Image, depth: tuple[int, bool]) -> Image.Image:
    """Mode ``I;16*`` or ``I`` to mode ``L`` by keeping the top 8 bits of the stored range.

    ``depth`` is ``(bits, signed)`` of the stored samples; negative values become 0.
    """
    values = np.asarray(img)
    bits, signed = depth
    if signed:
        values = np.maximum(values, 0)
        bits -= 1
    elif bits == 32:
        values = values.view(np.uint32)  # stored unsigned, read by Pillow into int32
    shifted = values >> max(bits - 8, 0)
    return Image.fromarray(np.minimum(shifted, 255).astype(np.uint8))


def sample_depth(img: Image.Image) -> tuple[int, bool] | None:
    """``(bits, signed)`` of the stored grey samples of an ``I;16*`` or ``I`` image, else None.

    TIFF says so in its BitsPerSample and SampleFormat tags; Pillow rescales PPM/PGM samples
    to 16 bits and opens 16-bit PNG as ``I;16``; any other ``I`` is taken as signed 32-bit.
    """
    if img.mode != "I" and not img.mode.startswith("I;16"):
        return None
    if img.format == "TIFF":
        tags = img.tag_v2  # type: ignore[attr-defined]
        bits = tags.get(_TIFF_BITS_PER_SAMPLE, 16 if img.mode.startswith("I;16") else 32)
        sample_format = tags.get(_TIFF_SAMPLE_FORMAT, 1)
        bits = bits[0] if isinstance(bits, tuple) else bits
        sample_format = sample_format[0] if isinstance(sample_format, tuple) else sample_format
        return int(bits), sample_format == 2
    if img.mode.startswith("I;16") or img.format == "PPM":
        return 16, False
    return 32, True
