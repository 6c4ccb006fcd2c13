"""What a value's bytes are, from their first bytes: the field a converter stores them under.

Converters of stores that do not name their values' formats (a Hugging Face
image column, an LMDB value) keep the bytes unchanged and choose the field from
the content: JPEG is ``jpg``, PNG ``png``, WebP ``webp``, GIF ``gif``, TIFF
``tif``, BMP ``bmp`` (the image codec decodes each of them on read), a ``.npy``
array ``npy``. A pickle (protocol 2 or later: ``\\x80`` then the protocol number)
is recognised so that it can be refused: nothing is unpickled, and a converter
stores one only when the user opts in.
"""

from __future__ import annotations

__all__ = ["IMAGE_FORMAT_NAMES", "image_format", "is_pickle", "content_field", "describe_head"]

IMAGE_FORMAT_NAMES = {"jpg": "JPEG", "png": "PNG", "webp": "WebP", "gif": "GIF", "tif": "TIFF", "bmp": "BMP"}
"""Field extension -> format name of the image formats recognised by their bytes."""

_NPY_MAGIC = b"\x93NUMPY"


def image_format(data: bytes | memoryview) -> str | None:
    """The field extension of an image's bytes, or None when they are no image format known here.

    Args:
        data: the value's bytes (only the first 16 are looked at).

    Returns:
        ``"jpg"``, ``"png"``, ``"webp"``, ``"gif"``, ``"tif"`` or ``"bmp"``, else None.
    """
    head = bytes(data[:16])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tif"
    if head[:2] == b"BM" and len(head) >= 14 and head[6:10] == b"\x00\x00\x00\x00":  # BITMAPFILEHEADER: reserved zeros
        return "bmp"
    return None


def is_pickle(data: bytes | memoryview) -> bool:
    """Whether the bytes start like a pickle of protocol 2 to 5 (``\\x80`` and the protocol)."""
    return len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5


def content_field(data: bytes | memoryview) -> str | None:
    """The field extension for bytes of a known format: an image's (:func:`image_format`) or ``npy``.

    Returns:
        The extension, or None (a pickle, or bytes of no format known here).
    """
    ext = image_format(data)
    if ext is not None:
        return ext
    if bytes(data[:6]) == _NPY_MAGIC:
        return "npy"
    return None


def describe_head(data: bytes | memoryview, n: int = 12) -> str:
    """``"1234 bytes starting b'...'"``: how an error message shows a value it could not place."""
    head = bytes(data[:n])
    return f"{len(data)} bytes starting {head!r}" + ("..." if len(data) > n else "")
