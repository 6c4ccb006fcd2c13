"""Tests for shardflow.codecs.image: real images from installed packages, every Pillow mode,
EXIF orientation, the per-call pixel limit, corrupt input, and the encoder."""

from __future__ import annotations

import io
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import skimage.data
import sklearn.datasets
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image, ImageOps

from shardflow.codecs.image import (
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    decode_image,
    encode_image,
    image_size,
)
from shardflow.errors import DecodeError, SampleError

# Any warning (Pillow's DecompressionBombWarning, its palette-transparency warning...) fails a test.
pytestmark = [pytest.mark.filterwarnings("error"), pytest.mark.usefixtures("others_garbage_collected")]

SKIMAGE_DIR = Path(skimage.data.__file__).parent
SKLEARN_DIR = Path(sklearn.datasets.__file__).parent / "images"
PILLOW_DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # int(1024 * 1024 * 1024 // 4 // 3)


# --------------------------------------------------------------------------------------------
# builders


def pil_bytes(img: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


def png_chunk(tag: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(tag + payload)
    return struct.pack(">I", len(payload)) + tag + payload + struct.pack(">I", crc)


def png_bytes(array: np.ndarray, color_type: int, bit_depth: int) -> bytes:
    """A PNG written by hand, for sample layouts Pillow cannot write (16-bit RGB/RGBA/LA).

    ``array``: shape (H, W) or (H, W, C); samples stored big-endian, no filtering.
    """
    height, width = array.shape[:2]
    dtype = ">u2" if bit_depth == 16 else np.uint8
    rows = array.astype(dtype).reshape(height, -1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(raw))
        + png_chunk(b"IEND", b"")
    )


def blank_png(width: int, height: int, *, rows: int | None = None) -> bytes:
    """An 8-bit grey PNG of zeros, compressed row by row (cheap even for huge sizes).

    ``rows``: store only this many rows (a truncated image) instead of ``height``.
    """
    compressor = zlib.compressobj(1)
    row = b"\x00" * (width + 1)
    parts = [compressor.compress(row) for _ in range(height if rows is None else rows)]
    idat = b"".join(parts) + (compressor.flush() if rows is None else b"")
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


def grey_tiff(array: np.ndarray, bits: int, sample_format: int) -> bytes:
    """A little-endian one-strip grey TIFF written by hand (SampleFormat 1 uint, 2 int).

    For sample layouts Pillow cannot write: signed 16-bit, unsigned 32-bit.
    """
    height, width = array.shape
    dtype = {(16, 1): "<u2", (16, 2): "<i2", (32, 1): "<u4", (32, 2): "<i4"}[bits, sample_format]
    pixels = array.astype(dtype).tobytes()
    entries = [  # (tag, type, value); type 3 SHORT, 4 LONG
        (256, 4, width),
        (257, 4, height),
        (258, 3, bits),
        (259, 3, 1),  # no compression
        (262, 3, 1),  # BlackIsZero
        (273, 4, 0),  # StripOffsets, patched below
        (277, 3, 1),
        (278, 4, height),
        (279, 4, len(pixels)),
        (339, 3, sample_format),
    ]
    ifd_size = 2 + 12 * len(entries) + 4
    data_offset = 8 + ifd_size
    ifd = struct.pack("<H", len(entries))
    for tag, typ, value in entries:
        value = data_offset if tag == 273 else value
        packed = struct.pack("<Hxx", value) if typ == 3 else struct.pack("<I", value)
        ifd += struct.pack("<HHI", tag, typ, 1) + packed
    ifd += struct.pack("<I", 0)
    return b"II*\x00" + struct.pack("<I", 8) + ifd + pixels


def with_exif_orientation(array: np.ndarray, orientation: int, fmt: str) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return pil_bytes(Image.fromarray(array), fmt, exif=exif.tobytes())


def pillow_rgb(data: bytes) -> np.ndarray:
    """The reference: plain Pillow decode to RGB."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def grey3(values: np.ndarray) -> np.ndarray:
    return np.repeat(np.asarray(values, dtype=np.uint8)[..., None], 3, axis=-1)


@pytest.fixture(scope="module")
def astronaut() -> np.ndarray:
    return skimage.data.astronaut()


@pytest.fixture(scope="module")
def china_jpg() -> bytes:
    return (SKLEARN_DIR / "china.jpg").read_bytes()


# --------------------------------------------------------------------------------------------
# real images


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea", "camera", "moon", "text"])
def test_png_round_trip_of_skimage_images_is_exact(name):
    source = getattr(skimage.data, name)()
    out = decode_image(pil_bytes(Image.fromarray(source), "PNG"))
    assert out.shape == (*source.shape[:2], 3)
    assert out.dtype == np.uint8
    expected = source if source.ndim == 3 else grey3(source)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("name", ["astronaut", "coffee", "camera"])
def test_jpeg_of_skimage_images_matches_pillow(name):
    source = getattr(skimage.data, name)()
    data = pil_bytes(Image.fromarray(source), "JPEG", quality=90)
    out = decode_image(data)
    assert out.shape == (*source.shape[:2], 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, pillow_rgb(data))
    expected = source if source.ndim == 3 else grey3(source)
    assert np.abs(out.astype(int) - expected).mean() < 4  # JPEG loss stays small


def test_sklearn_sample_jpegs_match_sklearns_decode():
    bunch = sklearn.datasets.load_sample_images()
    for path, expected in zip(bunch.filenames, bunch.images):
        out = decode_image(Path(path).read_bytes())
        assert out.shape == expected.shape == (427, 640, 3)
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "filename, shape",
    [
        ("rocket.jpg", (427, 640, 3)),
        ("hubble_deep_field.jpg", (872, 1000, 3)),
        ("retina.jpg", (1411, 1411, 3)),
        ("camera.png", (512, 512, 3)),  # mode L
        ("logo.png", (500, 500, 3)),  # RGBA
        ("horse.png", (328, 400, 3)),  # RGBA
        ("multipage.tif", (15, 10, 3)),  # first page
        ("no_time_for_that_tiny.gif", (25, 14, 3)),  # animated palette GIF, first frame
    ],
)
def test_files_shipped_with_skimage_match_pillow(filename, shape):
    data = (SKIMAGE_DIR / filename).read_bytes()
    out = decode_image(data)
    assert out.shape == shape and out.dtype == np.uint8
    np.testing.assert_array_equal(out, pillow_rgb(data))
    assert image_size(data) == (shape[1], shape[0])


def test_rgba_png_drops_alpha_and_keeps_rgb_exactly():
    horse = np.asarray(Image.open(SKIMAGE_DIR / "horse.png"))  # RGBA, translucent corners
    assert horse.shape == (328, 400, 4) and horse[..., 3].min() < 255
    data = (SKIMAGE_DIR / "horse.png").read_bytes()
    np.testing.assert_array_equal(decode_image(data), horse[..., :3])  # not composited
    np.testing.assert_array_equal(decode_image(data, mode="RGBA"), horse)
    astronaut = skimage.data.astronaut()
    alpha = np.tile(np.arange(512, dtype=np.uint16) // 2, (512, 1)).astype(np.uint8)[..., None]
    data = pil_bytes(Image.fromarray(np.concatenate([astronaut, alpha], -1)), "PNG")
    np.testing.assert_array_equal(decode_image(data), astronaut)


@pytest.mark.parametrize("fmt, options", [
    ("BMP", {}), ("PPM", {}), ("TIFF", {}), ("WEBP", {"lossless": True}), ("PNG", {}),
])  # fmt: skip
def test_lossless_formats_round_trip_exactly(astronaut, fmt, options):
    data = pil_bytes(Image.fromarray(astronaut), fmt, **options)
    np.testing.assert_array_equal(decode_image(data), astronaut)


def test_image_extensions_are_lower_case_and_cover_the_shard_format():
    assert all(ext == ext.lower() and not ext.startswith(".") for ext in IMAGE_EXTENSIONS)
    assert {"jpg", "jpeg", "png", "webp"} <= set(IMAGE_EXTENSIONS)


# --------------------------------------------------------------------------------------------
# every mode -> (H, W, 3) uint8 with documented values


def test_mode_1_gives_0_and_255():
    bits = np.array([[0, 1, 1], [1, 0, 0]], dtype=bool)
    img = Image.fromarray(bits)
    assert img.mode == "1"
    out = decode_image(pil_bytes(img, "PNG"))
    np.testing.assert_array_equal(out, grey3(bits * 255))


def test_mode_la_replicates_grey_and_drops_alpha():
    la = np.stack([np.array([[0, 100], [200, 255]]), np.array([[0, 0], [255, 7]])], -1)
    img = Image.fromarray(la.astype(np.uint8), "LA")
    data = pil_bytes(img, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "LA"
    np.testing.assert_array_equal(decode_image(data), grey3([[0, 100], [200, 255]]))


def test_mode_p_expands_the_palette():
    img = Image.new("P", (3, 2))
    img.putpalette([10, 20, 30, 40, 50, 60, 70, 80, 90])
    img.putdata([0, 1, 2, 2, 1, 0])
    out = decode_image(pil_bytes(img, "PNG"))
    palette = np.array([[10, 20, 30], [40, 50, 60], [70, 80, 90]], dtype=np.uint8)
    np.testing.assert_array_equal(out, palette[np.array([[0, 1, 2], [2, 1, 0]])])


def test_mode_p_with_transparency_drops_alpha_without_warning():
    img = Image.new("P", (3, 1))
    img.putpalette([10, 20, 30, 40, 50, 60, 70, 80, 90])
    img.putdata([0, 1, 2])
    data = pil_bytes(img, "PNG", transparency=bytes([255, 0, 128]))  # tRNS: alpha per entry
    assert Image.open(io.BytesIO(data)).info["transparency"] == b"\xff\x00\x80"
    out = decode_image(data)  # module-level filter turns Pillow's warning into a failure
    np.testing.assert_array_equal(out, [[[10, 20, 30], [40, 50, 60], [70, 80, 90]]])
    rgba = decode_image(data, mode="RGBA")
    np.testing.assert_array_equal(rgba[0, :, 3], [255, 0, 128])


def test_gif_with_transparent_index():
    img = Image.new("P", (2, 1))
    img.putpalette([1, 2, 3, 4, 5, 6])
    img.putdata([0, 1])
    data = pil_bytes(img, "GIF", transparency=1)
    np.testing.assert_array_equal(decode_image(data), [[[1, 2, 3], [4, 5, 6]]])
    np.testing.assert_array_equal(decode_image(data, mode="RGBA")[0, :, 3], [255, 0])


def test_cmyk_jpeg_is_converted_like_pillow():
    cmyk = np.zeros((16, 32, 4), dtype=np.uint8)
    cmyk[:, :16] = (0, 255, 255, 0)  # red
    cmyk[:, 16:] = (255, 0, 0, 128)  # dark cyan
    data = pil_bytes(Image.fromarray(cmyk, "CMYK"), "JPEG", quality=100)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    out = decode_image(data)
    assert out.shape == (16, 32, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, pillow_rgb(data))
    # Pillow's formula: channel = (255 - ink) * (255 - K) / 255.
    np.testing.assert_allclose(out[8, 4], [255, 0, 0], atol=3)
    np.testing.assert_allclose(out[8, 20], [0, 127, 127], atol=3)


SIXTEEN_BIT = np.array([[0, 255, 256, 4095], [32768, 65279, 65280, 65535]], dtype=np.uint16)
SIXTEEN_BIT_AS_8 = np.array([[0, 0, 1, 15], [128, 254, 255, 255]], dtype=np.uint8)  # v >> 8


def test_16_bit_grey_png_keeps_the_high_byte():
    data = pil_bytes(Image.fromarray(SIXTEEN_BIT), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    np.testing.assert_array_equal(decode_image(data), grey3(SIXTEEN_BIT_AS_8))
    # Pillow's own convert clips instead of scaling: the reason for the custom path.
    assert pillow_rgb(data)[0, 1, 0] == 255


def test_16_bit_big_endian_tiff_keeps_the_high_byte():
    img = Image.fromarray(SIXTEEN_BIT.astype(">u2"))
    data = pil_bytes(img, "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "I;16B"
    np.testing.assert_array_equal(decode_image(data), grey3(SIXTEEN_BIT_AS_8))


def test_16_bit_little_endian_tiff_keeps_the_high_byte():
    data = pil_bytes(Image.fromarray(SIXTEEN_BIT), "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    np.testing.assert_array_equal(decode_image(data), grey3(SIXTEEN_BIT_AS_8))


@pytest.mark.parametrize(
    "color_type, channels, pillow_mode", [(2, 3, "RGB"), (6, 4, "RGBA"), (4, 2, "RGBA")]
)
def test_16_bit_colour_pngs_keep_the_high_byte(color_type, channels, pillow_mode):
    rng = np.random.default_rng(0)
    values = rng.integers(0, 65536, (3, 5, channels), dtype=np.uint16)
    values[0, 0] = [65535, 256, 255, 0][:channels]
    data = png_bytes(values, color_type, 16)
    assert Image.open(io.BytesIO(data)).mode == pillow_mode
    high = (values >> 8).astype(np.uint8)
    expected = grey3(high[..., 0]) if channels == 2 else high[..., :3]
    np.testing.assert_array_equal(decode_image(data), expected)


def test_signed_16_bit_tiff_scales_0_to_32767_and_clips_negatives():
    values = np.array([[-32768, -5, 0, 127, 128, 32767]])
    data = grey_tiff(values, 16, 2)
    assert Image.open(io.BytesIO(data)).mode == "I"
    np.testing.assert_array_equal(decode_image(data), grey3([[0, 0, 0, 0, 1, 255]]))  # v >> 7


def test_signed_32_bit_tiff_scales_0_to_2_31_and_clips_negatives():
    values = np.array([[-(2**31), -5, 0, 2**23 - 1, 2**23, 2**30, 2**31 - 1]], dtype=np.int32)
    data = pil_bytes(Image.fromarray(values), "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "I"
    expected = [[0, 0, 0, 0, 1, 128, 255]]  # v >> 23
    np.testing.assert_array_equal(decode_image(data), grey3(expected))


def test_unsigned_32_bit_tiff_scales_the_full_range():
    values = np.array([[0, 2**24 - 1, 2**24, 2**31, 2**32 - 1]], dtype=np.uint32)
    data = grey_tiff(values, 32, 1)
    assert Image.open(io.BytesIO(data)).mode == "I"
    np.testing.assert_array_equal(decode_image(data), grey3([[0, 0, 1, 128, 255]]))  # v >> 24


def test_float_tiff_scales_0_to_1_with_clamping_and_nan_as_0():
    values = np.array([[-1.0, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, np.nan]], dtype=np.float32)
    data = pil_bytes(Image.fromarray(values), "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "F"
    expected = [[0, 0, 26, 64, 128, 255, 255, 0]]  # floor(255 * v + 0.5)
    np.testing.assert_array_equal(decode_image(data), grey3(expected))


@pytest.mark.parametrize("maxval, stored, expected", [
    (65535, [0, 255, 256, 65535], [0, 0, 1, 255]),  # v >> 8
    (1000, [0, 500, 1000, 4], [0, 128, 255, 1]),  # Pillow rescales to 0..65535 first
])  # fmt: skip
def test_16_bit_pgm(maxval, stored, expected):
    data = b"P5\n4 1\n%d\n" % maxval + np.array(stored, dtype=">u2").tobytes()
    assert Image.open(io.BytesIO(data)).mode == "I"
    np.testing.assert_array_equal(decode_image(data), grey3([expected]))


def test_grey_mode_output_is_hw1():
    camera = skimage.data.camera()
    data = pil_bytes(Image.fromarray(camera), "PNG")
    out = decode_image(data, mode="L")
    assert out.shape == (512, 512, 1)
    np.testing.assert_array_equal(out[..., 0], camera)
    assert decode_image(data, "torch", mode="L").shape == (1, 512, 512)
    assert decode_image(data, "pil", mode="L").mode == "L"


# --------------------------------------------------------------------------------------------
# EXIF orientation

ORIENTED = {  # what the viewer shows for each EXIF Orientation, as numpy operations
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),  # rotate 90 degrees clockwise
    7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
    8: lambda a: np.rot90(a, 1),  # rotate 90 degrees counter-clockwise
}


@pytest.mark.parametrize("orientation", sorted(ORIENTED))
def test_exif_orientation_is_applied_exactly(orientation):
    raw = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 10
    data = with_exif_orientation(raw, orientation, "PNG")
    out = decode_image(data)
    np.testing.assert_array_equal(out, ORIENTED[orientation](raw))
    golden = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    np.testing.assert_array_equal(out, golden)
    np.testing.assert_array_equal(decode_image(data, exif_transpose=False), raw)


def test_jpeg_orientation_6_rotates_clockwise():
    raw = np.zeros((32, 64, 3), dtype=np.uint8)  # H=32, W=64
    raw[:16, :16] = (255, 0, 0)  # red block at the stored top-left
    data = with_exif_orientation(raw, 6, "JPEG")
    out = decode_image(data)
    assert out.shape == (64, 32, 3)
    np.testing.assert_array_equal(out, np.rot90(pillow_rgb(data), -1))
    # A clockwise turn brings the stored top-left corner to the displayed top-right.
    # (block interiors: JPEG chroma bleeds across the edges)
    assert out[2:14, 18:30].mean(axis=(0, 1)) == pytest.approx([255, 0, 0], abs=8)
    assert out[2:14, 2:14].max() < 8
    raw_out = decode_image(data, exif_transpose=False)
    assert raw_out.shape == (32, 64, 3)
    np.testing.assert_array_equal(raw_out, pillow_rgb(data))
    assert decode_image(data, "torch").shape == (3, 64, 32)
    assert image_size(data) == (64, 32)  # stored size, header only


def test_pil_form_after_orientation_does_not_rotate_twice():
    raw = np.zeros((2, 4, 3), dtype=np.uint8)
    img = decode_image(with_exif_orientation(raw, 8, "PNG"), "pil")
    assert img.size == (2, 4)
    assert ImageOps.exif_transpose(img).size == (2, 4)


def test_orientation_applies_before_the_16_bit_scaling():
    exif = Image.Exif()
    exif[0x0112] = 3
    data = pil_bytes(Image.fromarray(SIXTEEN_BIT), "PNG", exif=exif.tobytes())
    np.testing.assert_array_equal(decode_image(data), grey3(SIXTEEN_BIT_AS_8[::-1, ::-1]))


# --------------------------------------------------------------------------------------------
# pixel limit, without Pillow's global state


def test_pixel_limit_refuses_large_image_and_names_the_size():
    data = blank_png(5000, 5000)
    assert len(data) < 200_000  # a small file that would decode to 25 MB
    before = Image.MAX_IMAGE_PIXELS
    expected = r"5000x5000 = 25000000 pixels exceeds max_pixels=1000000"
    with pytest.raises(DecodeError, match=expected):
        decode_image(data, max_pixels=1_000_000)
    assert Image.MAX_IMAGE_PIXELS == before
    out = decode_image(data, "pil", max_pixels=25_000_000, mode="L")  # exactly at the limit
    assert out.size == (5000, 5000)


def test_pixel_limit_is_checked_before_decoding_pixels():
    # The header claims 10 gigapixels; the data holds one row. Decoding would fail with
    # "truncated" (after a 10 GB allocation); the limit must refuse it from the header.
    data = blank_png(100_000, 100_000, rows=1)
    with pytest.raises(DecodeError, match=r"100000x100000 = 10000000000 pixels"):
        decode_image(data)  # the default limit
    with pytest.raises(DecodeError, match=r"max_pixels=1000\b"):
        decode_image(data, max_pixels=1000)


def test_default_limit_equals_pillows_default_error_threshold():
    assert DEFAULT_MAX_PIXELS == 2 * PILLOW_DEFAULT_MAX_IMAGE_PIXELS
    data = blank_png(20_000, 10_000, rows=1)  # 200 M pixels
    with pytest.raises(DecodeError, match=f"max_pixels={DEFAULT_MAX_PIXELS}"):
        decode_image(data)


def test_decodes_above_pillows_warning_threshold_without_warning():
    assert Image.MAX_IMAGE_PIXELS == PILLOW_DEFAULT_MAX_IMAGE_PIXELS
    data = blank_png(10_000, 9_000)  # 90 M pixels: Pillow warns, it is under our default
    with pytest.warns(Image.DecompressionBombWarning):
        Image.open(io.BytesIO(data))
    img = decode_image(data, "pil", mode="L")  # any warning fails this test
    assert img.size == (10_000, 9_000)
    assert img.getextrema() == (0, 0)
    assert Image.MAX_IMAGE_PIXELS == PILLOW_DEFAULT_MAX_IMAGE_PIXELS


def test_pillows_error_threshold_is_not_applied_at_open():
    # 200 M pixels (above Pillow's error threshold), with one stored row so the test stays
    # cheap: Image.open refuses the header; we read it and fail only on the missing rows.
    data = blank_png(20_000, 10_000, rows=1)
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(data))
    assert image_size(data) == (20_000, 10_000)
    with pytest.raises(DecodeError, match="truncated|cannot decode") as info:
        decode_image(data, max_pixels=None)
    assert "max_pixels" not in str(info.value) and "MAX_IMAGE_PIXELS" not in str(info.value)


def test_pillows_global_limit_is_not_read(monkeypatch):
    data = pil_bytes(Image.fromarray(skimage.data.camera()), "PNG")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(data))
    assert decode_image(data).shape == (512, 512, 3)
    assert Image.MAX_IMAGE_PIXELS == 10


def test_limits_are_per_call_across_threads():
    data = pil_bytes(Image.fromarray(skimage.data.camera()), "PNG")  # 262144 pixels
    results: dict[int, str] = {}

    def work(i: int) -> None:
        limit = 262_144 if i % 2 else 262_143
        outcomes = set()
        for _ in range(20):
            try:
                decode_image(data, max_pixels=limit)
                outcomes.add("ok")
            except DecodeError:
                outcomes.add("refused")
        results[i] = ",".join(sorted(outcomes))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: "ok" if i % 2 else "refused" for i in range(8)}
    assert Image.MAX_IMAGE_PIXELS == PILLOW_DEFAULT_MAX_IMAGE_PIXELS


# --------------------------------------------------------------------------------------------
# corrupt input


@pytest.mark.parametrize("cut", [0.5, 0.1])
def test_truncated_jpeg_raises_decode_error_with_cause(china_jpg, cut):
    data = china_jpg[: int(len(china_jpg) * cut)]
    with pytest.raises(DecodeError, match="truncated") as info:
        decode_image(data)
    assert info.value.__cause__ is not None


def test_truncated_png_raises_decode_error(astronaut):
    data = pil_bytes(Image.fromarray(astronaut), "PNG")
    with pytest.raises(DecodeError) as info:
        decode_image(data[: len(data) // 2])
    assert info.value.__cause__ is not None


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not an image at all",
        bytes(range(256)) * 4,
        b"\xff\xd8\xff\xe0" + b"\x00" * 200,  # JPEG magic, garbage after
        b"\x89PNG\r\n\x1a\n" + b"garbage" * 10,  # PNG magic, garbage after
    ],
)
def test_garbage_raises_decode_error(data):
    with pytest.raises(DecodeError):
        decode_image(data)
    with pytest.raises(DecodeError):
        image_size(data)


def test_decode_error_is_a_sample_error_and_a_value_error():
    with pytest.raises(ValueError):
        decode_image(b"garbage")
    assert issubclass(DecodeError, SampleError)


def test_header_only_image_size_needs_no_pixels(china_jpg):
    assert image_size(china_jpg) == (640, 427)
    start_of_scan = china_jpg.index(b"\xff\xda")  # the header ends here, pixel data follows
    assert image_size(china_jpg[: start_of_scan + 16]) == (640, 427)


# --------------------------------------------------------------------------------------------
# forms and arguments


def test_torch_form_is_the_numpy_form_in_chw(china_jpg):
    array = decode_image(china_jpg, "numpy")
    tensor = decode_image(china_jpg, "torch")
    assert tensor.dtype == torch.uint8 and tensor.shape == (3, 427, 640)
    assert tensor.is_contiguous()
    torch.testing.assert_close(tensor, torch.from_numpy(array.copy()).permute(2, 0, 1))
    tensor[0, 0, 0] = 0  # writable, owns its memory


def test_numpy_form_is_hwc_and_read_only(china_jpg):
    array = decode_image(china_jpg, "numpy")
    assert array.shape == (427, 640, 3) and array.dtype == np.uint8
    assert not array.flags.writeable  # documented: no copy is made; .copy() to write
    array.copy()[0, 0] = 0


def test_pil_form(china_jpg):
    img = decode_image(china_jpg, "pil")
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (640, 427)
    np.testing.assert_array_equal(np.asarray(img), decode_image(china_jpg))
    grey = pil_bytes(Image.fromarray(skimage.data.camera()), "PNG")
    assert decode_image(grey, "pil").mode == "RGB"


@pytest.mark.parametrize("kwargs", [
    {"form": "tensor"}, {"mode": "CMYK"}, {"max_pixels": 0}, {"max_pixels": 1.5},
])  # fmt: skip
def test_bad_arguments_raise_value_error(china_jpg, kwargs):
    with pytest.raises(ValueError) as info:
        decode_image(china_jpg, **kwargs)
    assert not isinstance(info.value, DecodeError)


def test_non_bytes_raise_type_error():
    with pytest.raises(TypeError):
        decode_image("a string")  # type: ignore[arg-type]


def test_bytearray_and_memoryview_are_accepted(china_jpg):
    expected = decode_image(china_jpg)
    np.testing.assert_array_equal(decode_image(bytearray(china_jpg)), expected)
    np.testing.assert_array_equal(decode_image(memoryview(china_jpg)), expected)


# --------------------------------------------------------------------------------------------
# encode_image


def test_encode_png_is_lossless_for_every_input_kind(astronaut):
    camera = skimage.data.camera()
    logo = skimage.data.logo()
    np.testing.assert_array_equal(decode_image(encode_image(astronaut, "png")), astronaut)
    grey = decode_image(encode_image(camera, "png"), mode="L")
    np.testing.assert_array_equal(grey[..., 0], camera)
    np.testing.assert_array_equal(
        decode_image(encode_image(camera[..., None], "PNG"), mode="L")[..., 0], camera
    )
    np.testing.assert_array_equal(decode_image(encode_image(logo, "png"), mode="RGBA"), logo)
    chw = torch.from_numpy(astronaut).permute(2, 0, 1)
    np.testing.assert_array_equal(decode_image(encode_image(chw, "png")), astronaut)
    np.testing.assert_array_equal(
        decode_image(encode_image(torch.from_numpy(camera)[None], "png"), mode="L")[..., 0], camera
    )
    np.testing.assert_array_equal(
        decode_image(encode_image(Image.fromarray(astronaut), "png")), astronaut
    )


def test_encode_covers_every_image_extension():
    for ext in IMAGE_EXTENSIONS:
        assert decode_image(encode_image(np.zeros((2, 3), np.uint8), ext)).shape == (2, 3, 3)


@pytest.mark.parametrize("ext", ["png", "tif", "tiff", "bmp", "ppm", "pgm"])
def test_encode_lossless_formats_round_trip_grey_and_rgb_exactly(astronaut, ext):
    camera = skimage.data.camera()
    np.testing.assert_array_equal(decode_image(encode_image(astronaut, ext)), astronaut)
    out = decode_image(encode_image(camera, ext), mode="L")
    np.testing.assert_array_equal(out[..., 0], camera)


def test_encode_binary_pbm_and_small_palette_gif_exactly():
    bits = Image.fromarray(np.array([[0, 1, 0], [1, 1, 0]], dtype=bool))
    np.testing.assert_array_equal(decode_image(encode_image(bits, "pbm"), mode="L")[..., 0],
                                  [[0, 255, 0], [255, 255, 0]])  # fmt: skip
    few_colours = np.array([[[1, 2, 3], [4, 5, 6]], [[7, 8, 9], [1, 2, 3]]], dtype=np.uint8)
    np.testing.assert_array_equal(decode_image(encode_image(few_colours, "gif")), few_colours)
    palette = Image.new("P", (2, 1))
    palette.putpalette([1, 2, 3, 4, 5, 6])
    palette.putdata([0, 1])
    palette.info["transparency"] = 1
    data = encode_image(palette, "gif")  # palette transparency is kept, not refused
    np.testing.assert_array_equal(decode_image(data, mode="RGBA")[0, :, 3], [255, 0])


@pytest.mark.parametrize("ext", ["jpg", "jpeg", "webp"])
def test_encode_lossy_formats(astronaut, ext):
    data = encode_image(astronaut, ext, quality=90)
    out = decode_image(data)
    assert out.shape == astronaut.shape
    assert np.abs(out.astype(int) - astronaut).mean() < 4
    assert len(encode_image(astronaut, ext, quality=30)) < len(data)


def test_encode_jpeg_of_grey_and_16_bit_pil():
    camera = skimage.data.camera()
    data = encode_image(camera, "jpg")
    assert Image.open(io.BytesIO(data)).mode == "L"
    data16 = encode_image(Image.fromarray(SIXTEEN_BIT), "jpg", quality=100)
    np.testing.assert_allclose(decode_image(data16)[..., 0], SIXTEEN_BIT_AS_8, atol=2)


def test_encode_errors(astronaut):
    with pytest.raises(ValueError, match="png"):
        encode_image(astronaut, "xcf")
    with pytest.raises(ValueError, match="uint8"):
        encode_image(astronaut.astype(np.float32), "png")
    with pytest.raises(ValueError, match="uint8"):
        encode_image(torch.zeros(3, 4, 4), "png")
    with pytest.raises(ValueError, match="shape"):
        encode_image(np.zeros((4, 4, 2), np.uint8), "png")
    with pytest.raises(ValueError, match="shape"):
        encode_image(torch.zeros(5, 4, 4, dtype=torch.uint8), "png")
    for ext in ("jpg", "bmp", "ppm", "gif"):
        with pytest.raises(ValueError, match="alpha"):
            encode_image(skimage.data.logo(), ext)
    with pytest.raises(TypeError):
        encode_image([[0, 1], [2, 3]], "png")


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        np.uint8,
        st.tuples(st.integers(1, 9), st.integers(1, 9), st.sampled_from([1, 3, 4])),
    )
)
def test_png_round_trip_property(array):
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[array.shape[2]]
    out = decode_image(encode_image(array, "png"), mode=mode)
    np.testing.assert_array_equal(out, array)
    chw = torch.from_numpy(array).permute(2, 0, 1)
    tensor = decode_image(encode_image(chw, "png"), "torch", mode=mode)
    torch.testing.assert_close(tensor, chw.contiguous())


# --------------------------------------------------------------------------------------------
# the optional simplejpeg decoder (jpeg_decoder="simplejpeg")


def _jpeg(array: np.ndarray, **save: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "JPEG", **save)
    return buf.getvalue()


def _photo_jpegs() -> list[tuple[str, bytes]]:
    out = []
    for k, photo in enumerate(sklearn.datasets.load_sample_images().images):
        photo = np.asarray(photo)
        for quality in (50, 75, 90, 95):
            for subsampling in (0, 1, 2):  # 4:4:4, 4:2:2, 4:2:0
                crop = photo[17 * quality % 90 :][:350, :400]
                out.append((f"photo{k} q{quality} s{subsampling}", _jpeg(crop, quality=quality, subsampling=subsampling)))
        out.append((f"photo{k} progressive", _jpeg(photo[:333, :401], quality=85, progressive=True)))
        out.append((f"photo{k} grey", _jpeg(np.ascontiguousarray(photo[:64, :64, 1]))))
        out.append((f"photo{k} 64x64", _jpeg(np.ascontiguousarray(photo[100:164, 200:264]), quality=90)))
        out.append((f"photo{k} odd size", _jpeg(np.ascontiguousarray(photo[:37, :53]), quality=90)))
    return out


def test_simplejpeg_pixels_equal_pillows():
    """simplejpeg and Pillow both run libjpeg-turbo with the accurate integer DCT and fancy
    upsampling: on these 32 JPEGs (4:4:4/4:2:2/4:2:0, qualities 50-95, progressive, grey,
    odd sizes) every pixel is equal. Measured, not assumed: the maximum difference is asserted."""
    pytest.importorskip("simplejpeg")
    diffs = {}
    for name, data in _photo_jpegs():
        fast = decode_image(data, "numpy", jpeg_decoder="simplejpeg")
        slow = decode_image(data, "numpy")
        assert fast.shape == slow.shape and fast.dtype == np.uint8, name
        diffs[name] = int(np.abs(fast.astype(np.int16) - slow.astype(np.int16)).max())
        torch.testing.assert_close(decode_image(data, "torch", jpeg_decoder="simplejpeg"), torch.from_numpy(fast).permute(2, 0, 1).contiguous())
    assert len(diffs) == 32 and max(diffs.values()) == 0, diffs


def test_simplejpeg_leaves_to_pillow_what_it_cannot_do_the_same(china_jpg):
    pytest.importorskip("simplejpeg")
    raw = np.asarray(Image.open(io.BytesIO(china_jpg)).convert("RGB"))[:40, :60]
    # EXIF orientation: Pillow applies it (the fast path would return the stored order)
    oriented = with_exif_orientation(raw, 6, "JPEG")
    out = decode_image(oriented, "numpy", jpeg_decoder="simplejpeg")
    assert out.shape == (60, 40, 3)
    np.testing.assert_array_equal(out, decode_image(oriented, "numpy"))
    assert decode_image(oriented, "numpy", exif_transpose=False, jpeg_decoder="simplejpeg").shape == (40, 60, 3)
    # CMYK JPEG: Pillow's conversion, not libjpeg's
    cmyk = io.BytesIO()
    Image.fromarray(raw).convert("CMYK").save(cmyk, "JPEG")
    np.testing.assert_array_equal(decode_image(cmyk.getvalue(), "numpy", jpeg_decoder="simplejpeg"),
                                  decode_image(cmyk.getvalue(), "numpy"))
    # the "pil" form and other modes are Pillow's
    assert isinstance(decode_image(china_jpg, "pil", jpeg_decoder="simplejpeg"), Image.Image)
    assert decode_image(china_jpg, "numpy", mode="L", jpeg_decoder="simplejpeg").shape[2] == 1
    # corrupt data: Pillow's error, as DecodeError
    with pytest.raises(DecodeError):
        decode_image(china_jpg[: len(china_jpg) // 3], "numpy", jpeg_decoder="simplejpeg")
    # the pixel limit holds before any pixel is decoded
    with pytest.raises(DecodeError, match="exceeds max_pixels=100"):
        decode_image(china_jpg, "numpy", max_pixels=100, jpeg_decoder="simplejpeg")
    with pytest.raises(ValueError, match="jpeg_decoder"):
        decode_image(china_jpg, "numpy", jpeg_decoder="turbo")


def test_simplejpeg_option_through_a_dataset(tmp_path):
    pytest.importorskip("simplejpeg")
    import shardflow

    jpegs = [data for _, data in _photo_jpegs()[:6]]
    with shardflow.ShardWriter(str(tmp_path / "t-%06d.tar"), max_count=4) as w:
        for i, data in enumerate(jpegs):
            w.write({"__key__": f"s{i}", "jpg": data, "cls": i})
    fast = list(shardflow.ShardDataset(str(tmp_path), decode=shardflow.DecodeOptions(jpeg_decoder="simplejpeg")))
    slow = list(shardflow.ShardDataset(str(tmp_path), decode="numpy"))
    assert [s["cls"] for s in fast] == list(range(6))
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a["jpg"], b["jpg"])
    with pytest.raises(ValueError, match="jpeg_decoder must be"):
        shardflow.DecodeOptions(jpeg_decoder="turbo")
