"""JPEG fast paths for :func:`shardflow.codecs.image.decode_image`.

Pillow's ``Image.open`` identifies a JPEG by parsing its marker segments in Python, one
``read`` per byte or segment, which is about 40% of the time to decode a 64x64 JPEG. Here the
header is parsed once, over the bytes in memory, and the pixels are decoded by Pillow's own
``jpeg`` decoder through the public ``Image.frombytes``, with the mode and decoder arguments
that ``JpegImagePlugin`` gives it for a 1- or 3-component JPEG (``("L", "")`` or
``("RGB", "")``: libjpeg reads the whole stream, markers included, as it does under
``Image.open``). The pixels are therefore Pillow's, bit for bit (``tests/test_jpeg_codec.py``
compares them with ``Image.open`` on baseline, progressive, 4:4:4/4:2:2/4:2:0, grey,
restart-interval, Adobe-marker and odd-sized JPEGs).

:func:`read_jpeg_header` (:mod:`shardflow.codecs.jpegheader`) accepts only what that call decodes the same way as ``Image.open``:
8-bit baseline, extended or progressive Huffman JPEGs (SOF0/1/2) of 1 or 3 components and
nonzero size, every segment length inside the data, a scan after the frame. Anything else
(CMYK/YCCK, 12-bit, arithmetic or lossless coding, a DNL height, junk between segments, a
length running past the end) gives ``None``, and the caller takes Pillow's full path, whose
errors it reports. The parse touches each segment header once, so it ends after at most
``len(data)`` steps on any input.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from ..errors import DecodeError
from .jpegheader import JpegHeader, read_jpeg_header

__all__ = [
    "JPEG_SCALES",
    "JpegHeader",
    "decode_jpeg_pillow",
    "decode_jpeg_simplejpeg",
    "jpeg_has_app1",
    "jpeg_scale",
    "read_jpeg_header",
]

JPEG_SCALES: tuple[int, ...] = (8, 4, 2, 1)
"""The reductions libjpeg decodes at directly (1/8, 1/4, 1/2, whole), as Pillow's ``Image.draft`` uses them."""

_SOS, _APP1 = 0xDA, 0xE1  # start of scan, APP1 (EXIF, XMP)


def jpeg_scale(width: int, height: int, min_side: int | None) -> int:
    """The largest libjpeg reduction that keeps a JPEG's short side at least ``min_side``.

    Args:
        width: stored width in pixels.
        height: stored height in pixels.
        min_side: the smallest short side wanted, in pixels; None or 0: no reduction.

    Returns:
        One of :data:`JPEG_SCALES`: the image decodes to ``ceil(width / s)`` x
        ``ceil(height / s)`` pixels (libjpeg rounds up, as ``Image.draft`` does); 1 when even
        1/2 would go below ``min_side``.
    """
    if not min_side:
        return 1
    short = min(width, height)
    for s in JPEG_SCALES:
        if -(-short // s) >= min_side:
            return s
    return 1


def decode_jpeg_pillow(data: bytes | bytearray | memoryview, header: JpegHeader, scale: int = 1) -> Image.Image | None:
    """Decode with Pillow's ``jpeg`` decoder as ``Image.open(...).load()`` runs it.

    Args:
        data: the whole encoded image.
        header: its :func:`read_jpeg_header`.
        scale: a reduction of :data:`JPEG_SCALES`, decoded by libjpeg itself with the decoder
            arguments ``Image.draft`` sets (its DCT scaling: not a resize of the whole image).

    Returns:
        A loaded ``PIL.Image.Image`` of mode ``L`` (1 component) or ``RGB`` (3), size
        ``(ceil(header.width / scale), ceil(header.height / scale))``; None when Pillow's decoder
        stopped (truncated or corrupt data): the caller decodes through ``Image.open`` for
        Pillow's own error (or its ``ImageFile.LOAD_TRUNCATED_IMAGES`` behaviour).
    """
    mode = "L" if header.components == 1 else "RGB"
    size = (-(-header.width // scale), -(-header.height // scale))
    try:
        if scale == 1:
            return Image.frombytes(mode, size, data, "jpeg", mode, "")
        return Image.frombytes(mode, size, data, "jpeg", mode, "", scale, 0)
    except (ValueError, OSError):  # "not enough image data", "cannot decode image data"
        return None


def decode_jpeg_simplejpeg(
    data: bytes, max_pixels: int | None, exif_transpose: bool, min_side: int | None = None
) -> np.ndarray | None:
    """RGB uint8 (H, W, 3) from simplejpeg, or None where Pillow must decode.

    None for colour spaces other than YCbCr and grey, for APP1 (EXIF/XMP) metadata while
    ``exif_transpose`` is on (Pillow applies the orientation), and for data simplejpeg refuses.
    With ``min_side``, the JPEG is decoded at :func:`jpeg_scale`'s reduction (the same size
    as Pillow's scaled decode).

    Raises:
        DecodeError: the header declares more than ``max_pixels`` pixels.
    """
    import simplejpeg  # checked by DecodeOptions; imported once by preload()

    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # noqa: BLE001 - Pillow decodes it, or raises the error to report
        return None
    if colorspace not in ("YCbCr", "Gray"):
        return None
    if max_pixels is not None and width * height > max_pixels:
        raise DecodeError(
            f"JPEG image of {width}x{height} = {width * height} pixels exceeds "
            f"max_pixels={max_pixels}; pass a larger max_pixels (or None) to decode it"
        )
    if exif_transpose and jpeg_has_app1(data):
        return None  # EXIF or XMP: Pillow applies the orientation
    scale = jpeg_scale(width, height, min_side)
    try:
        if scale == 1:
            return simplejpeg.decode_jpeg(data, colorspace="RGB")
        return simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_factor=scale, min_height=-(-height // scale), min_width=-(-width // scale)
        )
    except Exception:  # noqa: BLE001 - as above
        return None


def jpeg_has_app1(data: bytes) -> bool:
    """Whether a JPEG has an APP1 segment (EXIF or XMP) before its scan; True when unsure."""
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return True
        marker = data[pos + 1]
        if marker == _SOS:  # start of scan: no more metadata segments
            return False
        if marker == _APP1:
            return True
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return True
