"""The header of a JPEG, parsed over its bytes in memory (no Pillow, no decode).

:func:`read_jpeg_header` accepts only what :mod:`shardflow.codecs.jpeg`'s fast decode decodes
the same way as ``Image.open``: 8-bit baseline, extended or progressive Huffman JPEGs
(SOF0/1/2) of 1 or 3 components and nonzero size, every segment length inside the data, a
scan after the frame. Anything else (CMYK/YCCK, 12-bit, arithmetic or lossless coding, a DNL
height, junk between segments, a length running past the end) gives ``None``. The parse
touches each segment header once, so it ends after at most ``len(data)`` steps on any input.

A module of its own, without Pillow or numpy: ``convert imagefolder`` checks every image's
header with it, and imports neither for JPEGs (they cost a conversion's process ~10 ms).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

__all__ = ["JpegHeader", "read_jpeg_header"]

_SOF_HUFFMAN = frozenset({0xC0, 0xC1, 0xC2})  # baseline, extended sequential, progressive
_SKIPPED = frozenset({0xC4, 0xDB, 0xDD, 0xFE} | set(range(0xE0, 0xF0)))  # DHT DQT DRI COM APPn
_SOS, _APP1 = 0xDA, 0xE1
_SEGMENT = struct.Struct(">BBH")  # a segment's start: 0xFF, its marker, its length
_SIZE = struct.Struct(">HH")  # SOF: lines, then pixels per line


class JpegHeader(NamedTuple):
    """What :func:`read_jpeg_header` found: the frame and the metadata that matters.

    Attributes:
        width: pixels per line, > 0.
        height: lines, > 0.
        components: 1 (grey) or 3 (YCbCr, or RGB under an Adobe marker: libjpeg reads which).
        has_app1: an APP1 segment (EXIF or XMP: where a JPEG keeps its orientation) precedes
            the scan.
    """

    width: int
    height: int
    components: int
    has_app1: bool


# the bytes of the last JPEG parsed up to the end of its scan's segment header, and its header
# (to start, bytes whose parse gives None: a segment marked 0xD8 is never a JPEG's first)
_last_header: tuple[bytes, JpegHeader | None] = (b"\xff\xd8\xff\xd8", None)


def read_jpeg_header(data: bytes | bytearray | memoryview) -> JpegHeader | None:
    """Parse a JPEG's segments up to its first scan, without decoding.

    The parse reads nothing past the end of the scan's segment header, so its result is
    that of the last JPEG parsed whenever ``data`` starts with the same bytes up to there
    (images of one size written by one encoder: resized datasets, camera bursts without
    EXIF); that one comparison replaces the walk over the segments.

    Args:
        data: the whole encoded image.

    Returns:
        The header, or None where the fast decode does not apply (see the module docstring):
        not a JPEG, an unusual or hostile layout, or a frame other than 8-bit SOF0/1/2 with 1
        or 3 components.
    """
    global _last_header
    prefix, known = _last_header
    if isinstance(data, bytes) and data.startswith(prefix):
        return known
    end = len(data)
    if end < 4 or data[0] != 0xFF or data[1] != 0xD8 or data[2] != 0xFF:
        return None
    pos, frame, app1 = 2, None, False
    while pos + 4 <= end:
        ff, marker, length = _SEGMENT.unpack_from(data, pos)
        if ff != 0xFF:
            return None  # junk between segments: Pillow's parser skips it, we do not guess
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if length < 2 or pos + 2 + length > end:
            return None
        if marker == _SOS:
            if frame is None:
                return None
            header = JpegHeader(frame[0], frame[1], frame[2], app1)
            _last_header = (bytes(data[: pos + 2 + length]), header)  # one tuple: a consistent pair
            return header
        if marker in _SOF_HUFFMAN:
            if frame is not None or length < 8:
                return None
            bits, components = data[pos + 4], data[pos + 9]
            height, width = _SIZE.unpack_from(data, pos + 5)
            if bits != 8 or components not in (1, 3) or not width or not height or length != 8 + 3 * components:
                return None
            frame = (width, height, components)
        elif marker == _APP1:
            app1 = True
        elif marker not in _SKIPPED:
            return None  # other frames (CMYK is 4 components of SOF0..2, caught above), DNL, EXP, JPGn...
        pos += 2 + length
    return None
