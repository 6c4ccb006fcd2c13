"""Tests for shardflow.codecs.jpeg: the header parse and Pillow's decoder run without
``Image.open``, proven pixel-equal to ``Image.open`` and safe on hostile headers."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import sklearn.datasets
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shardflow.codecs.image import decode_image
from shardflow.codecs.jpeg import JpegHeader, decode_jpeg_pillow, read_jpeg_header
from shardflow.errors import DecodeError

pytestmark = [pytest.mark.filterwarnings("error"), pytest.mark.usefixtures("others_garbage_collected")]


def jpeg(array: np.ndarray, mode: str | None = None, **save: object) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(array)
    (img.convert(mode) if mode else img).save(buf, "JPEG", **save)
    return buf.getvalue()


def pillow_open(data: bytes, mode: str = "RGB") -> np.ndarray:
    """The reference: ``Image.open``, then the mode asked for."""
    img = Image.open(io.BytesIO(data))
    return np.asarray(img if img.mode == mode else img.convert(mode))


def with_segment(data: bytes, marker: int, payload: bytes) -> bytes:
    """``data`` with one more marker segment right after SOI."""
    return data[:2] + struct.pack(">BBH", 0xFF, marker, len(payload) + 2) + payload + data[2:]


def segments(data: bytes) -> list[tuple[int, int, int]]:
    """``(marker, offset, length)`` of each segment before the scan."""
    out, pos = [], 2
    while True:
        marker, length = data[pos + 1], struct.unpack_from(">H", data, pos + 2)[0]
        out.append((marker, pos, length))
        if marker == 0xDA:
            return out
        pos += 2 + length


def patched(data: bytes, marker: int, offset: int, value: bytes) -> bytes:
    """``data`` with ``value`` written ``offset`` bytes into the first ``marker`` segment."""
    _, pos, _ = next(s for s in segments(data) if s[0] == marker)
    return data[: pos + offset] + value + data[pos + offset + len(value) :]


@pytest.fixture(scope="module")
def photos() -> list[np.ndarray]:
    return [np.asarray(p) for p in sklearn.datasets.load_sample_images().images]


def corpus(photos: list[np.ndarray]) -> dict[str, bytes]:
    """JPEGs of every kind the fast path takes."""
    out = {}
    for k, photo in enumerate(photos):
        crop = np.ascontiguousarray(photo[40:290, 60:390])
        for quality in (50, 90):
            for subsampling, name in ((0, "444"), (1, "422"), (2, "420")):
                out[f"p{k} q{quality} {name}"] = jpeg(crop, quality=quality, subsampling=subsampling)
        out[f"p{k} progressive"] = jpeg(crop, quality=85, progressive=True)
        out[f"p{k} progressive 444"] = jpeg(crop, quality=85, progressive=True, subsampling=0)
        out[f"p{k} grey"] = jpeg(crop, "L")
        out[f"p{k} grey progressive"] = jpeg(crop, "L", progressive=True)
        out[f"p{k} restart blocks"] = jpeg(crop, restart_marker_blocks=3)
        out[f"p{k} restart rows"] = jpeg(crop, restart_marker_rows=1, progressive=True)
        out[f"p{k} odd 37x53"] = jpeg(np.ascontiguousarray(photo[:37, :53]))
        out[f"p{k} 1x1"] = jpeg(np.ascontiguousarray(photo[:1, :1]))
        out[f"p{k} 64x64"] = jpeg(np.ascontiguousarray(photo[100:164, 200:264]), quality=90)
        out[f"p{k} comment icc"] = jpeg(crop[:64, :64].copy(), comment=b"hello", icc_profile=b"\0" * 300)
    base = out["p0 64x64"]
    # Adobe APP14 without JFIF (which libjpeg would obey first): transform 1 (YCbCr) and 0
    # (stored as RGB: libjpeg skips the colour conversion)
    _, app0, length = segments(base)[0]
    no_jfif = base[:app0] + base[app0 + 2 + length :]
    for transform in (0, 1):
        out[f"adobe transform {transform}"] = with_segment(no_jfif, 0xEE, b"Adobe\0\x64\0\0\0\0" + bytes([transform]))
    out["fill bytes"] = base[:2] + b"\xff\xff\xff" + base[2:]
    return out


def test_pixels_equal_image_open_for_every_kind(photos):
    cases = corpus(photos)
    assert len(cases) == 2 * 16 + 3
    for name, data in cases.items():
        header = read_jpeg_header(data)
        assert header is not None and not header.has_app1, name  # the fast path decodes it
        img = Image.open(io.BytesIO(data))
        assert (header.width, header.height) == img.size, name
        assert header.components == (1 if img.mode == "L" else 3), name
        fast = decode_jpeg_pillow(data, header)
        np.testing.assert_array_equal(np.asarray(fast), pillow_open(data, img.mode), err_msg=name)
        for mode in ("RGB", "L", "RGBA"):
            out = decode_image(data, mode=mode)
            np.testing.assert_array_equal(out.reshape(pillow_open(data, mode).shape), pillow_open(data, mode), err_msg=name)
        chw = decode_image(data, "torch")
        assert chw.is_contiguous() and chw.shape == (3, header.height, header.width)
        np.testing.assert_array_equal(chw.permute(1, 2, 0).numpy(), pillow_open(data), err_msg=name)


def test_adobe_rgb_transform_decodes_as_image_open_does(photos):
    """Transform 0 really changes the pixels (so the marker reached libjpeg), equally in both paths."""
    cases = corpus(photos)
    plain, rgb = cases["p0 64x64"], cases["adobe transform 0"]
    assert not np.array_equal(pillow_open(plain), pillow_open(rgb))
    np.testing.assert_array_equal(decode_image(rgb), pillow_open(rgb))


def test_bytearray_and_memoryview_take_the_fast_path(photos):
    data = corpus(photos)["p1 q90 420"]
    for view in (bytearray(data), memoryview(data)):
        assert read_jpeg_header(view) == read_jpeg_header(data)
        np.testing.assert_array_equal(decode_image(view), pillow_open(data))


def exif_jpeg(array: np.ndarray, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return jpeg(array, exif=exif.tobytes())


def test_exif_orientation_still_applied(photos):
    array = np.ascontiguousarray(photos[0][:40, :60])
    data = exif_jpeg(array, 6)
    assert read_jpeg_header(data) == JpegHeader(60, 40, 3, True)
    stored = pillow_open(data)
    out = decode_image(data)
    assert out.shape == (60, 40, 3)
    np.testing.assert_array_equal(out, np.rot90(stored, -1))
    # without orientation the fast path decodes the stored order
    np.testing.assert_array_equal(decode_image(data, exif_transpose=False), stored)
    xmp = with_segment(jpeg(array), 0xE1, b"http://ns.adobe.com/xap/1.0/\x00" + b'<x tiff:Orientation="3"/>')
    assert read_jpeg_header(xmp).has_app1
    np.testing.assert_array_equal(decode_image(xmp), pillow_open(xmp)[::-1, ::-1])


def test_cmyk_and_12_bit_and_arithmetic_fall_back_to_image_open(photos):
    array = np.ascontiguousarray(photos[1][:48, :48])
    cmyk = jpeg(array, "CMYK")
    assert read_jpeg_header(cmyk) is None
    np.testing.assert_array_equal(decode_image(cmyk), pillow_open(cmyk))
    base = jpeg(array)
    assert read_jpeg_header(patched(base, 0xC0, 4, b"\x0c")) is None  # 12-bit samples
    sof = next(s for s in segments(base) if s[0] == 0xC0)[1]
    arithmetic = base[: sof + 1] + b"\xc9" + base[sof + 2 :]
    assert read_jpeg_header(arithmetic) is None
    lossless = base[: sof + 1] + b"\xc3" + base[sof + 2 :]
    assert read_jpeg_header(lossless) is None


def test_max_pixels_is_checked_from_the_header_before_decoding(photos):
    base = jpeg(np.ascontiguousarray(photos[0][:16, :16]))
    huge = patched(base, 0xC0, 5, struct.pack(">HH", 60000, 60000))  # 3.6e9 pixels declared
    assert read_jpeg_header(huge)[:2] == (60000, 60000)
    with pytest.raises(DecodeError, match="60000x60000 = 3600000000 pixels exceeds max_pixels=1000000"):
        decode_image(huge, max_pixels=1_000_000)
    with pytest.raises(DecodeError, match="exceeds max_pixels=255"):
        decode_image(base, max_pixels=255)
    assert decode_image(base, max_pixels=256).shape == (16, 16, 3)


@pytest.mark.parametrize("cut", [0.9, 0.5, 0.1])
def test_truncated_data_is_pillows_decode_error(photos, cut):
    data = corpus(photos)["p0 q90 420"]
    short = data[: int(len(data) * cut)]
    with pytest.raises(DecodeError, match="truncated|cannot") as info:
        decode_image(short)
    assert info.value.__cause__ is not None


def test_corrupt_scan_is_a_decode_error(photos):
    data = corpus(photos)["p0 q90 420"]
    scan = segments(data)[-1][1] + 2 + segments(data)[-1][2]
    broken = data[: scan + 40] + b"\xff\xd0" * 50 + b"\xff\xd9"  # restart markers, then the end
    assert read_jpeg_header(broken) is not None
    try:
        out = decode_image(broken)
    except DecodeError as e:
        assert e.__cause__ is not None
    else:  # libjpeg pads a damaged scan as Image.open does: then the same pixels
        np.testing.assert_array_equal(out, pillow_open(broken))


def hostile_headers(base: bytes) -> dict[str, bytes]:
    sof = next(s for s in segments(base) if s[0] == 0xC0)[1]
    no_sof = b"".join(base[p : p + 2 + n] for m, p, n in segments(base)[:-1] if m != 0xC0)
    return {
        "SOI only": b"\xff\xd8\xff",
        "length past the end": base[:2] + b"\xff\xe0\xff\xf0" + base[6:40],
        "length 0": base[:2] + b"\xff\xe0\x00\x00" + base[6:],
        "length 1": base[:2] + b"\xff\xe0\x00\x01" + base[6:],
        "no SOF before the scan": base[:2] + no_sof + base[segments(base)[-1][1] :],
        "zero height": patched(base, 0xC0, 5, b"\x00\x00"),
        "zero width": patched(base, 0xC0, 7, b"\x00\x00"),
        "two components": patched(base, 0xC0, 9, b"\x02"),
        "SOF length wrong": patched(base, 0xC0, 2, b"\x00\x0b"),
        "two SOFs": base[: sof] + base[sof : sof + 19] + base[sof:],
        "junk between segments": base[:2] + b"\x00\x00" + base[2:],
        "EOI before the scan": base[:2] + b"\xff\xd9" + base[2:],
        "DNL": with_segment(base, 0xDC, b"\x00\x10"),
        "all fill bytes": b"\xff\xd8" + b"\xff" * 100_000,
        "no scan": base[: segments(base)[-1][1]],
    }


def test_hostile_headers_fall_back_and_never_over_read(photos):
    base = jpeg(np.ascontiguousarray(photos[0][:16, :16]))
    for name, data in hostile_headers(base).items():
        assert read_jpeg_header(data) is None, name
        try:
            out = decode_image(data)
        except DecodeError:
            continue
        np.testing.assert_array_equal(out, pillow_open(data), err_msg=name)  # Pillow's own result


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_jpegs_decode_as_image_open_or_raise_decode_error(data):
    """Random byte edits and cuts of a valid JPEG: the parse never raises or reads past the
    end, and ``decode_image`` gives Image.open's pixels or a DecodeError."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    base = bytearray(jpeg(rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)))
    head = segments(bytes(base))[-1][1] + 12  # edits land in the header and the scan's start
    for _ in range(data.draw(st.integers(1, 4))):
        base[data.draw(st.integers(2, head))] = data.draw(st.integers(0, 255))
    blob = bytes(base[: data.draw(st.integers(3, len(base)))])
    header = read_jpeg_header(blob)
    assert header is None or (header.width > 0 and header.height > 0 and header.components in (1, 3))
    try:
        out = decode_image(blob, max_pixels=1_000_000)
    except DecodeError:
        return
    mode = "RGB"
    np.testing.assert_array_equal(out, pillow_open(blob, mode))


@pytest.mark.parametrize("subsampling", ["411", "440"])
def test_411_and_440_subsampling_equal_image_open(photos, subsampling):
    """Sampling factors Pillow's encoder does not write (4:1:1 is 4x1 luma blocks per chroma block)."""
    simplejpeg = pytest.importorskip("simplejpeg", reason="simplejpeg writes 4:1:1 and 4:4:0 JPEGs")
    for crop in (photos[0][40:141, 60:187], photos[1][:64, :64]):
        data = simplejpeg.encode_jpeg(np.ascontiguousarray(crop), quality=80, colorsubsampling=subsampling)
        header = read_jpeg_header(data)
        assert header is not None and header[:3] == (crop.shape[1], crop.shape[0], 3)
        for mode in ("RGB", "L"):
            out = decode_image(data, mode=mode)
            np.testing.assert_array_equal(out.reshape(pillow_open(data, mode).shape), pillow_open(data, mode))
        accurate = simplejpeg.encode_jpeg(np.ascontiguousarray(crop), quality=95, colorsubsampling=subsampling,
                                          fastdct=False)  # another encoder setting, other quant tables
        np.testing.assert_array_equal(decode_image(accurate), pillow_open(accurate))
