"""Image field codec: bytes of any image Pillow reads -> PIL image, numpy array or torch tensor.

What comes out, whatever was stored:

* ``mode="RGB"`` (the default) gives 3 channels of uint8, ``"RGBA"`` 4, ``"L"`` 1. Every Pillow
  mode is brought there; alpha is dropped, not composited, and high bit depths are scaled to
  0..255 from the range the file declares, never clipped (:mod:`shardflow.codecs.modes` has the
  table).
* EXIF orientation (the EXIF 2.3 ``Orientation`` tag, or ``tiff:Orientation`` in XMP) is
  applied by default, exactly as :func:`PIL.ImageOps.exif_transpose` does.
* Multi-frame files (GIF, APNG, multi-page TIFF, animated WebP) give their first frame.

JPEGs decoded to arrays or tensors skip ``Image.open``: the header is parsed over the bytes in
memory and Pillow's own ``jpeg`` decoder runs through ``Image.frombytes`` with the arguments
``Image.open`` would give it, so the pixels are Pillow's (1.3-1.5x faster on 64x64 JPEGs; see
:mod:`shardflow.codecs.jpeg`). CMYK/YCCK, 12-bit, arithmetic-coded JPEGs, JPEGs with EXIF or
XMP metadata while ``exif_transpose`` is on, corrupt ones and the ``"pil"`` form (a
``JpegImageFile`` with its ``info``) take ``Image.open`` as before.

Pixel limit and Pillow's global state. ``decode_image`` refuses an image whose header declares
more than ``max_pixels`` pixels before any pixel is decoded. Pillow's own decompression-bomb
guard reads the process-wide ``PIL.Image.MAX_IMAGE_PIXELS``; changing that (or installing a
``warnings`` filter around ``Image.open``) would race with every other thread in the process.
So this module never reads or writes it and never touches warning filters: it identifies the
file through Pillow's public plugin registry (``Image.ID`` / ``Image.OPEN``, filled by
``Image.register_open``) exactly as ``Image.open`` does, minus the global check, and applies
its own per-call limit instead. Images above Pillow's threshold but under ``max_pixels`` thus
decode with neither ``DecompressionBombWarning`` nor ``DecompressionBombError``. Limitation: a
few plugins repeat Pillow's check internally (TIFF on loading a tile, WebP on opening, GIF
frames that grow the canvas, MPO); there Pillow's global limit still applies, and an image
refused by it raises :class:`~shardflow.errors.DecodeError` saying so. With the defaults the
two limits agree (see :data:`DEFAULT_MAX_PIXELS`).
"""

from __future__ import annotations

import io
import struct
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import ExifTags, Image, ImageFile, ImageOps

from shardflow import fastpath
from shardflow.codecs.jpeg import decode_jpeg_pillow, decode_jpeg_simplejpeg, jpeg_scale, read_jpeg_header
from shardflow.codecs.modes import is_high_bit, sample_depth, to_mode
from shardflow.errors import DecodeError
from shardflow.format.keys import IMAGE_EXTENSIONS

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "FORMS",
    "IMAGE_EXTENSIONS",
    "JPEG_DECODERS",
    "MODES",
    "decode_image",
    "encode_image",
    "image_size",
]

JPEG_DECODERS: tuple[str, ...] = ("pillow", "simplejpeg")
"""Values of ``jpeg_decoder``: Pillow (any image) or simplejpeg (the optional fast JPEG path)."""

DEFAULT_MAX_PIXELS: int = 178_956_970
"""Default pixel limit per image: ``2 * 89_478_485``, the size at which Pillow with its default
``MAX_IMAGE_PIXELS`` raises ``DecompressionBombError``. As 3-channel uint8 that is 512 MiB."""

FORMS: tuple[str, ...] = ("pil", "numpy", "torch")
"""Values accepted for ``form``."""

MODES: tuple[str, ...] = ("RGB", "RGBA", "L")
"""Values accepted for ``mode``: output channels 3, 4 and 1."""

# Extension -> (Pillow format, whether it stores alpha) for encode_image.
_ENCODERS: dict[str, tuple[str, bool]] = {
    "jpg": ("JPEG", False), "jpeg": ("JPEG", False), "png": ("PNG", True),
    "webp": ("WEBP", True), "ppm": ("PPM", False), "pgm": ("PPM", False),
    "pbm": ("PPM", False), "bmp": ("BMP", False), "tif": ("TIFF", True),
    "tiff": ("TIFF", True), "gif": ("GIF", False),
}  # fmt: skip

# Exceptions with which a Pillow plugin says "not my format" while identifying a file
# (the set Image.open skips over).
_NOT_THIS_FORMAT = (SyntaxError, IndexError, TypeError, struct.error)

_ORIENTATION = ExifTags.Base.Orientation


def decode_image(
    data: bytes,
    form: str = "numpy",
    *,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    exif_transpose: bool = True,
    mode: str = "RGB",
    jpeg_decoder: str = "pillow",
    min_side: int | None = None,
) -> Image.Image | np.ndarray | torch.Tensor:
    """Decode one image field.

    Args:
        data: the encoded image (any format Pillow reads; see the module docstring for how each
            pixel mode is mapped to 8 bits).
        form: ``"pil"``: a loaded ``PIL.Image.Image`` in ``mode``; ``"numpy"``: a uint8 ndarray,
            shape (H, W, C), C = 3, 4, 1 for ``mode`` RGB, RGBA, L; read-only, since it wraps
            Pillow's output without a copy (as ``np.asarray(pil_image)`` does): ``.copy()`` it
            to write in place.
            ``"torch"``: a contiguous, writable uint8 tensor, shape (C, H, W).
        max_pixels: refuse images with more than this many pixels (width * height, read from
            the header before decoding); ``None`` for no limit. Per call: Pillow's global
            ``MAX_IMAGE_PIXELS`` is neither read nor changed.
        exif_transpose: apply the EXIF Orientation (default ``True``), as
            :func:`PIL.ImageOps.exif_transpose`; the result's H and W are then the displayed
            ones. ``False`` keeps the stored pixel order.
        mode: ``"RGB"`` (default; alpha dropped), ``"RGBA"`` (opaque where the file has no
            alpha) or ``"L"`` (grey, ITU-R 601-2 luma from colour as Pillow computes it).
        jpeg_decoder: ``"pillow"`` (default) or ``"simplejpeg"``: baseline and progressive
            YCbCr and grey JPEGs decoded to RGB arrays by simplejpeg (libjpeg-turbo, about
            2-3x Pillow's speed; ``pip install shardflow[jpeg]``). Its pixels equal Pillow's
            for the libjpeg-turbo builds tested (``tests/test_image_codec.py`` measures it).
            Pillow still decodes everything else: other formats, the ``"pil"`` form, modes
            other than RGB, CMYK/YCCK JPEGs, JPEGs with EXIF or XMP metadata (orientation)
            while ``exif_transpose`` is on, and any JPEG simplejpeg refuses (so errors are
            Pillow's).
        min_side: reduced decode for JPEGs: decode at the largest libjpeg reduction (1/2, 1/4
            or 1/8, :data:`~shardflow.codecs.jpeg.JPEG_SCALES`) that keeps the short side at
            least ``min_side`` pixels, as ``PIL.Image.draft`` does, and leave the exact resize
            to the transform. The pixels are those of ``Image.draft`` (libjpeg's DCT scaling),
            not of a full decode followed by a resize, whenever a reduction applies, that is
            when the short side is at least ``2 * min_side``; smaller JPEGs and every other
            format decode exactly as without it. None (default): full size.

    Returns:
        The image in the requested form.

    Raises:
        DecodeError: the bytes are not an image Pillow can identify, are truncated or corrupt,
            carry unreadable EXIF while ``exif_transpose`` is on, or the image is larger than
            ``max_pixels``. The underlying exception is chained as ``__cause__``.
        ValueError: ``form``, ``mode`` or ``max_pixels`` is not one of the accepted values.
        TypeError: ``data`` is not bytes-like.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if max_pixels is not None and (not isinstance(max_pixels, int) or max_pixels <= 0):
        raise ValueError(f"max_pixels must be a positive int or None, got {max_pixels!r}")
    if min_side is not None and (isinstance(min_side, bool) or not isinstance(min_side, int) or min_side <= 0):
        raise ValueError(f"min_side must be a positive int or None, got {min_side!r}")
    if jpeg_decoder != "pillow":
        if jpeg_decoder not in JPEG_DECODERS:
            raise ValueError(f"jpeg_decoder must be one of {JPEG_DECODERS}, got {jpeg_decoder!r}")
        if form != "pil" and mode == "RGB" and data[:2] == b"\xff\xd8":
            fast = decode_jpeg_simplejpeg(data, max_pixels, exif_transpose, min_side)
            if fast is not None:
                return fast if form == "numpy" else _chw_tensor(fast)

    img = _load_jpeg(data, max_pixels, exif_transpose, min_side) if form != "pil" and fastpath.enabled("jpeg") else None
    depth = None
    if img is None:
        img = _load(data, max_pixels, min_side)
        # Read the sample depth now: transposing gives a plain Image without format or TIFF tags.
        depth = sample_depth(img)
        if exif_transpose:
            img = _apply_orientation(img)
    try:
        img = to_mode(img, mode, depth)
    except Exception as e:
        raise DecodeError(
            f"cannot convert {img.format or 'JPEG'} image of mode {img.mode} to {mode}: {e}"
        ) from e

    if form == "pil":
        return img
    array = np.asarray(img)
    if array.ndim == 2:
        array = array[:, :, None]
    if form == "numpy":
        return array
    return _chw_tensor(array)


def _load_jpeg(data: bytes, max_pixels: int | None, exif_transpose: bool, min_side: int | None) -> Image.Image | None:
    """A JPEG decoded by Pillow without ``Image.open`` (see :mod:`shardflow.codecs.jpeg`), or
    None where the full path must run: not such a JPEG, EXIF/XMP metadata while
    ``exif_transpose`` is on (Pillow reads the orientation), or data Pillow's decoder stopped
    on (the full path then reports Pillow's error)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image data must be bytes-like, got {type(data).__name__}")
    header = read_jpeg_header(data)
    if header is None or (exif_transpose and header.has_app1):
        return None
    width, height = header.width, header.height
    if max_pixels is not None and width * height > max_pixels:
        raise DecodeError(
            f"JPEG image of {width}x{height} = {width * height} pixels exceeds "
            f"max_pixels={max_pixels}; pass a larger max_pixels (or None) to decode it"
        )
    return decode_jpeg_pillow(data, header, jpeg_scale(width, height, min_side))


def _load(data: bytes, max_pixels: int | None, min_side: int | None = None) -> ImageFile.ImageFile:
    """Identify, check the pixel limit, decode: ``Image.open(...).load()`` minus the global check
    (a JPEG at :func:`~shardflow.codecs.jpeg.jpeg_scale`'s reduction, through ``Image.draft``)."""
    img = _open_header(data)
    fmt = img.format
    width, height = img.size
    if max_pixels is not None and width * height > max_pixels:
        raise DecodeError(
            f"{fmt} image of {width}x{height} = {width * height} pixels exceeds "
            f"max_pixels={max_pixels}; pass a larger max_pixels (or None) to decode it"
        )
    scale = jpeg_scale(width, height, min_side) if fmt == "JPEG" else 1
    if scale > 1:
        img.draft(img.mode, (width // scale, height // scale))
    try:
        img.load()
    except Image.DecompressionBombError as e:
        raise DecodeError(
            f"{fmt} image of {width}x{height}: Pillow's own plugin refused it with its "
            f"global PIL.Image.MAX_IMAGE_PIXELS limit ({e})"
        ) from e
    except Exception as e:  # Pillow plugins raise many types on corrupt data
        raise DecodeError(
            f"cannot decode {fmt} image of {width}x{height} "
            f"({len(data)} bytes): {type(e).__name__}: {e}"
        ) from e
    return img


def _chw_tensor(array: np.ndarray) -> torch.Tensor:
    import torch  # lazily: only the torch form needs it

    # One copy into CHW order, which also makes it writable (Pillow's array is read-only).
    return torch.from_numpy(np.array(array.transpose(2, 0, 1), order="C"))


def image_size(data: bytes) -> tuple[int, int]:
    """Read an image's size from its header, without decoding pixels.

    Args:
        data: the encoded image.

    Returns:
        ``(width, height)`` in pixels as stored, before any EXIF orientation (which can swap
        them in :func:`decode_image`). No pixel limit is applied.

    Raises:
        DecodeError: the header is not one Pillow can identify.
        TypeError: ``data`` is not bytes-like.
    """
    return _open_header(data).size


def encode_image(array_or_pil: Any, ext: str, quality: int = 95) -> bytes:
    """Encode an image for writing into a shard (used by converters).

    Args:
        array_or_pil: a uint8 ndarray of shape (H, W), (H, W, 1), (H, W, 3) or (H, W, 4)
            (grey, RGB, RGBA); a uint8 tensor of shape (C, H, W) with C in 1, 3, 4, or (H, W)
            (moved to the CPU if needed); or a ``PIL.Image.Image`` of any mode.
        ext: one of :data:`IMAGE_EXTENSIONS`, case-insensitive, without the dot. ``png``,
            ``tif``/``tiff``, ``bmp`` and ``ppm``/``pgm``/``pbm`` are lossless (they decode back
            to the same values; the PPM family picks P4/P5/P6 from the mode, whatever the
            extension); ``jpg``/``jpeg`` and ``webp`` are lossy; ``gif`` is lossless up to 256
            colours and quantised beyond.
        quality: JPEG/WebP quality, 1..100; ignored by the other formats.

    Returns:
        The encoded bytes.

    Raises:
        ValueError: unknown ``ext``; an array or tensor that is not uint8 or has an unsupported
            shape; an image with alpha for a format that cannot store it (only ``png``,
            ``webp`` and ``tif``/``tiff`` can; ``gif`` keeps palette transparency), or a mode
            the format cannot store. Nothing is dropped silently.
        TypeError: ``array_or_pil`` is none of the accepted types.
    """
    ext = ext.lower()
    if ext not in _ENCODERS:
        raise ValueError(f"cannot encode images as {ext!r}; known extensions: {IMAGE_EXTENSIONS}")
    fmt, keeps_alpha = _ENCODERS[ext]
    img = _as_pil(array_or_pil)
    if fmt == "GIF":
        keeps_alpha = img.mode == "P"
    if _has_alpha(img) and not keeps_alpha:
        raise ValueError(
            f"{ext} cannot store the alpha of a mode {img.mode} image; "
            "drop it or encode as png, webp or tiff"
        )
    options: dict[str, Any] = {}
    if fmt in ("JPEG", "WEBP"):
        options["quality"] = quality
    if fmt == "JPEG":
        if is_high_bit(img.mode):
            img = to_mode(img, "L", sample_depth(img))
        elif img.mode not in ("1", "L", "RGB", "CMYK"):
            img = img.convert("RGB")
    out = io.BytesIO()
    try:
        img.save(out, fmt, **options)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cannot encode a mode {img.mode} image as {ext}: {e}") from e
    return out.getvalue()


# ---------------------------------------------------------------------------------------------
# decoding steps


def _open_header(data: bytes) -> ImageFile.ImageFile:
    """Identify ``data`` and read its header, as ``Image.open`` does minus the global bomb check.

    Only Pillow's public registry is used (``Image.preinit``/``init`` fill ``Image.ID`` and
    ``Image.OPEN``); nothing global is changed beyond Pillow loading its plugins.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image data must be bytes-like, got {type(data).__name__}")
    fp = io.BytesIO(data)
    prefix = fp.read(16)
    Image.preinit()
    tried = list(Image.ID)
    try:
        img = _identify(fp, prefix, tried)
        if img is None:
            Image.init()  # load every plugin, then try the ones not tried yet
            img = _identify(fp, prefix, [f for f in Image.ID if f not in tried])
    except Image.DecompressionBombError as e:
        raise DecodeError(
            f"image header refused by a Pillow plugin under its global "
            f"PIL.Image.MAX_IMAGE_PIXELS limit: {e}"
        ) from e
    except Exception as e:  # a plugin recognised the format but the header is corrupt
        raise DecodeError(
            f"cannot read image header ({len(data)} bytes): {type(e).__name__}: {e}"
        ) from e
    if img is None:
        raise DecodeError(
            f"not an image format Pillow can read ({len(data)} bytes starting {prefix[:8]!r})"
        )
    return img


def _identify(fp: io.BytesIO, prefix: bytes, formats: list[str]) -> ImageFile.ImageFile | None:
    for fmt in formats:
        factory, accept = Image.OPEN[fmt]
        # accept() returns a str to explain a recognised but unsupported variant: skip, as
        # Image.open does.
        if accept is not None and (not (ok := accept(prefix)) or isinstance(ok, str)):
            continue
        fp.seek(0)
        try:
            return factory(fp, "")
        except _NOT_THIS_FORMAT:
            continue
    return None


def _apply_orientation(img: Image.Image) -> Image.Image:
    if img.format == "JPEG" and "exif" not in img.info and "xmp" not in img.info:
        return img  # a JPEG's orientation lives in EXIF (APP1) or XMP only: nothing to parse
    try:
        orientation = img.getexif().get(_ORIENTATION, 1)
    except Exception as e:
        raise DecodeError(
            f"unreadable EXIF in {img.format} image ({type(e).__name__}: {e}); "
            "pass exif_transpose=False to decode it without orientation"
        ) from e
    if orientation in (2, 3, 4, 5, 6, 7, 8):
        return ImageOps.exif_transpose(img)
    return img


# ---------------------------------------------------------------------------------------------
# encoding helpers


def _as_pil(obj: Any) -> Image.Image:
    if isinstance(obj, Image.Image):
        return obj
    torch = sys.modules.get("torch")  # a tensor implies torch is already imported
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.dtype != torch.uint8:
            raise ValueError(f"image tensor must be uint8, got {obj.dtype}")
        if obj.ndim == 3:
            if obj.shape[0] not in (1, 3, 4):
                raise ValueError(
                    f"image tensor must have shape (C, H, W) with C in 1, 3, 4 or (H, W), "
                    f"got {tuple(obj.shape)}"
                )
            obj = obj.permute(1, 2, 0)
        obj = obj.detach().cpu().numpy()
    if not isinstance(obj, np.ndarray):
        raise TypeError(
            f"expected a uint8 ndarray, a uint8 tensor or a PIL image, got {type(obj).__name__}"
        )
    if obj.dtype != np.uint8:
        raise ValueError(f"image array must be uint8, got {obj.dtype}")
    if obj.ndim == 3 and obj.shape[2] == 1:
        obj = obj[:, :, 0]
    if not (obj.ndim == 2 or (obj.ndim == 3 and obj.shape[2] in (3, 4))):
        raise ValueError(
            f"image array must have shape (H, W), (H, W, 1), (H, W, 3) or (H, W, 4), "
            f"got {obj.shape}"
        )
    return Image.fromarray(np.ascontiguousarray(obj))


def _has_alpha(img: Image.Image) -> bool:
    return img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        img.mode == "P" and "transparency" in img.info
    )
