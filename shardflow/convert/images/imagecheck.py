"""The worker side of ``convert imagefolder``: read each image, check its header, build its sample.

Every image is checked as it is read, without decoding its pixels: the header
must parse (a JPEG's segments up to its first scan, a PNG's signature and
``IHDR``; any other format by Pillow's own header parser, as ``Image.open``
does) and declare a non-empty size, and the file must be complete as far as its
format tells cheaply: a JPEG ends with its end-of-image marker, a PNG with its
``IEND`` chunk, a GIF with its trailer, a WebP or BMP is as long as its header
says (TIFF and PNM: the header only). A file that fails the last check alone
(truncated, or with data appended after the image, as motion photos have) is
decoded once to tell which. A corrupt file is skipped and named in the
manifest (``meta.skipped``, with the reason), or refused with
``on_error="raise"``. Files the walk takes are listed in
:mod:`shardflow.convert.images.imageclasses`.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ...codecs.jpegheader import read_jpeg_header
from ...codecs.resize import DEFAULT_QUALITY, shrink_image
from ...errors import ConversionError, DecodeError, redact
from ...policy import CONVERT_ON_ERROR
from ..engine.groups import Skipped
from .imageclasses import Descriptor
from .walk import LocalTree, Tree

__all__ = ["BuildContext", "build", "check_image", "checked", "skipped", "READ_THREADS"]

log = logging.getLogger(__name__)

READ_THREADS = 16
"""Objects a worker reads at once from a bucket (in order; at most twice as many held)."""

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_IHDR = struct.Struct(">I4sII")


@dataclass(frozen=True)
class BuildContext:
    """What every worker needs (picklable): the tree and the policy for corrupt images."""

    tree: Tree
    on_error: str = "skip"
    max_side: int | None = None
    quality: int = DEFAULT_QUALITY

    def __post_init__(self) -> None:
        if self.on_error not in CONVERT_ON_ERROR:
            raise ValueError(f"on_error must be one of {CONVERT_ON_ERROR}, got {self.on_error!r}")
        if self.max_side is not None and (isinstance(self.max_side, bool) or not isinstance(self.max_side, int)
                                          or self.max_side < 1):  # fmt: skip
            raise ValueError(f"max_side must be a positive int or None, got {self.max_side!r}")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise ValueError(f"quality must be an int in 1..100, got {self.quality!r}")


def _header_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from the header; raises DecodeError when it does not parse."""
    if data[:8] == _PNG_SIGNATURE and len(data) >= 24:
        _, chunk, width, height = _IHDR.unpack_from(data, 8)
        if chunk == b"IHDR":
            return width, height
    if data[:2] == b"\xff\xd8":
        header = read_jpeg_header(data)
        if header is not None:
            return header.width, header.height
    from ...codecs.image import image_size

    return image_size(data)  # Pillow's parser: other formats, unusual JPEG layouts


def _ends_well(data: bytes) -> bool:
    """Whether the file is as long as its format says: a JPEG ends with its EOI marker, a PNG
    with its IEND chunk, a GIF with its trailer; a WebP (RIFF) and a BMP are at least as long
    as their header declares. Other formats (TIFF, PNM, ...): True, the header is all we check."""
    if data[:2] == b"\xff\xd8":
        return data.rstrip(b"\0")[-2:] == b"\xff\xd9"
    if data[:8] == _PNG_SIGNATURE:
        return data[-8:-4] == b"IEND"
    if data[:4] == b"GIF8":
        return data.rstrip(b"\0")[-1:] == b";"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return len(data) >= 8 + int.from_bytes(data[4:8], "little")
    if data[:2] == b"BM" and len(data) >= 6:
        return len(data) >= int.from_bytes(data[2:6], "little")
    return True


def check_image(data: bytes) -> str | None:
    """Why ``data`` is not a readable image, or None when it is (see the module docstring).

    Args:
        data: the file's bytes.

    Returns:
        None, or a reason such as ``"corrupt image: not an image format Pillow can read (...)"``.
    """
    if data[:2] == b"\xff\xd8" and data[-2:] == b"\xff\xd9" and read_jpeg_header(data) is not None:
        return None  # the usual JPEG, as the steps below find it: its header parses (size > 0), its EOI ends it
    if not data:
        return "corrupt image: empty file"
    try:
        width, height = _header_size(data)
    except (DecodeError, struct.error) as e:
        return f"corrupt image: {e}"
    if width <= 0 or height <= 0:
        return f"corrupt image: the header declares {width}x{height} pixels"
    if _ends_well(data):
        return None
    from ...codecs.image import DEFAULT_MAX_PIXELS, decode_image

    if width * height > DEFAULT_MAX_PIXELS:
        return None  # too big to decode here just to tell; the reader's pixel limit decides
    try:
        decode_image(data, "numpy", exif_transpose=False)
    except DecodeError as e:
        return f"corrupt image: {e}"
    return None  # data appended after a complete image


def _shrunk(data: bytes, ctx: BuildContext) -> tuple[bytes, str | None]:
    """``(bytes to store, None)``: the image shrunk to ``ctx.max_side`` when its long side exceeds
    it (:func:`~shardflow.codecs.resize.shrink_image`), else as it is; ``(data, reason)`` when
    Pillow cannot decode it after all (a corrupt image, under ``on_error``)."""
    try:
        smaller = shrink_image(data, ctx.max_side, ctx.quality)
    except DecodeError as e:
        return data, f"corrupt image: {e}"
    return (data if smaller is None else smaller), None


def _read_in_order(tree: Tree, descriptors: list[Descriptor]) -> Iterator[bytes]:
    """The files' bytes in order; from a bucket :data:`READ_THREADS` objects at a time."""
    if isinstance(tree, LocalTree):
        for d in descriptors:
            yield tree.read(d[2], d[4])
        return
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="shardflow-read") as pool:
        window: list[Any] = []
        for d in descriptors:
            window.append(pool.submit(tree.read, d[2]))
            if len(window) >= 2 * READ_THREADS:
                yield window.pop(0).result()
        for fut in window:
            yield fut.result()


def build(descriptors: list[Descriptor], ctx: BuildContext) -> Iterator[Any]:
    """Engine build step (worker): read each image's bytes as stored, check them, yield the
    sample, or a :class:`~shardflow.convert.engine.groups.Skipped` for a corrupt image."""
    tree = ctx.tree
    reads = _read_in_order(tree, descriptors)
    for key, field, rel, idx, size, _ in descriptors:
        try:
            data = next(reads)
        except (OSError, ValueError) as e:
            raise ConversionError(f"{tree.url(rel)}: cannot read the image: {e}") from e
        if len(data) != size:
            raise ConversionError(
                f"{tree.url(rel)}: changed during the conversion ({size} bytes when listed, {len(data)} when read)"
            )
        data, why = checked(data, ctx)
        if why is None:
            yield key, {field: data, "cls": b"%d" % idx}
        else:
            yield skipped(rel, why, ctx)


def checked(data: bytes, ctx: BuildContext) -> tuple[bytes, str | None]:
    """``(bytes to store, None)`` for an image that checks out (:func:`check_image`; shrunk
    to ``ctx.max_side`` where that applies), ``(data, why)`` for a corrupt one."""
    usual_jpeg = data[:2] == b"\xff\xd8" and data[-2:] == b"\xff\xd9" and read_jpeg_header(data) is not None
    if usual_jpeg and ctx.max_side is None:
        return data, None  # the usual JPEG (check_image's first test), kept as it is
    why = check_image(data)
    if why is None and ctx.max_side is not None:
        data, why = _shrunk(data, ctx)
    return data, why


def skipped(rel: str, why: str, ctx: BuildContext) -> Skipped:
    """The :class:`~shardflow.convert.engine.groups.Skipped` item of a corrupt image (logged).

    Raises:
        ConversionError: ``ctx.on_error`` is ``"raise"`` (reason ``corrupt_image``).
    """
    if ctx.on_error == "raise":
        raise ConversionError(f"{ctx.tree.url(rel)}: {why} (on_error='skip' / --on-error skip leaves it out)",
                              reason="corrupt_image")  # fmt: skip
    log.warning("%s: %s, skipped", redact(ctx.tree.url(rel)), why)
    return Skipped(rel, why)
