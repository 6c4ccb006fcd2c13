"""Images made smaller once, when they are packed: ``convert ... --max-side N``.

Photos from cameras and crawls are 2-12 megapixels and are trained at 224-512 pixels. An image
whose long side exceeds ``max_side`` is shrunk with Pillow's own ``Image.thumbnail`` (aspect
ratio kept, the long side becomes ``max_side``, Lanczos filtering after libjpeg's reduced
decode, as ``thumbnail`` does by default) and re-encoded once in its own format: a JPEG stays a
JPEG (at ``quality``, with the encoder's default chroma subsampling), a PNG stays a PNG, a WebP a
WebP (at ``quality``), anything else in the format Pillow read. An image at or under the limit
is kept byte for byte. Before shrinking, the EXIF orientation is applied
(``PIL.ImageOps.exif_transpose``), since the metadata that held it is not carried over: the
stored image then shows upright without it. Palette and 1-bit images are shrunk in RGB(A) and
grey, as resampling needs. Pillow's encoders are deterministic, so a re-run writes the same
bytes.
"""

from __future__ import annotations

import io

from ..errors import DecodeError

__all__ = ["DEFAULT_QUALITY", "shrink_image"]

DEFAULT_QUALITY = 90
"""JPEG and WebP quality of a re-encoded image when none is given (1..100)."""

_LOSSY = frozenset({"JPEG", "WEBP"})
_ORIENTATION = 0x0112  # the EXIF orientation tag (PIL.ExifTags.Base.Orientation)


def shrink_image(data: bytes, max_side: int, quality: int = DEFAULT_QUALITY) -> bytes | None:
    """Shrink one encoded image whose long side exceeds ``max_side`` (see the module docstring).

    Args:
        data: the encoded image, any format Pillow reads.
        max_side: the longest side allowed after packing, in pixels (> 0).
        quality: JPEG/WebP quality of the re-encoded image, 1..100.

    Returns:
        The re-encoded bytes, or None when the image already fits (keep ``data`` as it is).

    Raises:
        DecodeError: Pillow cannot read or re-encode the image.
        ValueError: ``max_side`` or ``quality`` out of range.
    """
    if isinstance(max_side, bool) or not isinstance(max_side, int) or max_side < 1:
        raise ValueError(f"max_side must be a positive int, got {max_side!r}")
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an int in 1..100, got {quality!r}")
    from PIL import Image, ImageOps  # here: a conversion without --max-side never imports Pillow for it

    try:
        img = Image.open(io.BytesIO(data))
        if max(img.size) <= max_side:
            return None
        fmt = img.format or "PNG"
        if img.getexif().get(_ORIENTATION, 1) in (2, 3, 4, 5, 6, 7, 8):
            img = ImageOps.exif_transpose(img)  # else keep the unloaded file: thumbnail's reduced decode
        if img.mode == "P":
            img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        elif img.mode == "1":
            img = img.convert("L")
        img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
        out = io.BytesIO()
        options = {"quality": quality} if fmt in _LOSSY else {}
        if fmt == "JPEG" and img.mode not in ("L", "RGB", "CMYK"):
            img = img.convert("RGB")
        img.save(out, fmt, **options)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DecodeError(f"cannot shrink the image to {max_side} pixels: {type(e).__name__}: {e}") from e
    return out.getvalue()
