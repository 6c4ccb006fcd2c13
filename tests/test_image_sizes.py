"""Images at the size they are used: ``convert imagefolder --max-side`` (shrunk once, when packed)
and ``DecodeOptions(min_side=...)`` (JPEGs decoded at a libjpeg reduction), each checked against
Pillow doing the same thing itself (``Image.thumbnail``, ``Image.draft``)."""

from __future__ import annotations

import filecmp
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import shardflow
from shardflow.cli import main
from shardflow.codecs import DecodeOptions
from shardflow.codecs.image import decode_image
from shardflow.codecs.jpeg import jpeg_scale
from shardflow.codecs.resize import shrink_image
from shardflow.convert.images.imagefolder import convert_imagefolder


def photo(width: int, height: int, fmt: str = "JPEG", seed: int = 0, mode: str = "RGB", **save) -> bytes:
    """A smooth image with some noise (compresses like a photo), encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels).convert(mode)
    out = io.BytesIO()
    img.save(out, fmt, **save)
    return out.getvalue()


def thumbnail_reference(data: bytes, max_side: int, quality: int = 90) -> bytes:
    img = Image.open(io.BytesIO(data))
    fmt = img.format
    img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    img.save(out, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return out.getvalue()


# ---------------------------------------------------------------- --max-side


@pytest.mark.parametrize(("size", "fmt"), [((1200, 800), "JPEG"), ((640, 900), "PNG"), ((2000, 100), "JPEG")])
def test_shrink_equals_pillows_thumbnail(size: tuple[int, int], fmt: str) -> None:
    data = photo(*size, fmt=fmt)
    out = shrink_image(data, 512, quality=85)
    assert out == thumbnail_reference(data, 512, quality=85)
    shrunk = Image.open(io.BytesIO(out))
    assert shrunk.format == fmt and max(shrunk.size) == 512
    assert shrunk.size == (512, 341) if size == (1200, 800) else True


def test_shrink_keeps_small_images_and_rejects_bad_options() -> None:
    data = photo(512, 300)
    assert shrink_image(data, 512) is None
    assert shrink_image(photo(300, 513), 512) is not None
    with pytest.raises(ValueError, match="max_side"):
        shrink_image(data, 0)
    with pytest.raises(ValueError, match="quality"):
        shrink_image(data, 100, quality=101)


def test_shrink_applies_exif_orientation_before_dropping_it() -> None:
    img = Image.open(io.BytesIO(photo(1000, 600)))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    out = io.BytesIO()
    img.save(out, "JPEG", exif=exif.tobytes(), quality=95)
    data = out.getvalue()
    shrunk = shrink_image(data, 500)
    upright = decode_image(data, "pil")  # what a reader shows for the original
    assert upright.size == (600, 1000)
    stored = Image.open(io.BytesIO(shrunk))
    assert stored.size == (300, 500) and stored.getexif().get(0x0112) is None
    assert decode_image(shrunk, "numpy").shape == (500, 300, 3)


@pytest.fixture
def photo_tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    sizes = {"big.jpg": (900, 600, "JPEG"), "small.jpg": (200, 150, "JPEG"), "wide.png": (1000, 400, "PNG"),
             "edge.jpg": (400, 300, "JPEG")}  # fmt: skip
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i, (name, (w, h, fmt)) in enumerate(sizes.items()):
            (root / cls / name).write_bytes(photo(w, h, fmt, seed=i + (cls == "b") * 10))
    return root


def _stored(folder: Path) -> dict[str, dict[str, bytes]]:
    """Every sample's fields, read with CPython's tarfile (key and field split at the first dot)."""
    out: dict[str, dict[str, bytes]] = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, field = member.name.split(".", 1)
                out.setdefault(key, {})[field] = tar.extractfile(member).read()
    return out


def test_convert_max_side_shrinks_big_images_keeps_small_ones(photo_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    manifest = convert_imagefolder(photo_tree, str(dst), max_side=400, quality=80)
    assert manifest.meta["resize"] == {"max_side": 400, "quality": 80}
    stored = _stored(dst)
    assert len(stored) == 8
    for key, fields in stored.items():
        (field,) = [f for f in fields if f != "cls"]
        original = (photo_tree / f"{key}.{field}").read_bytes()
        if max(Image.open(io.BytesIO(original)).size) <= 400:
            assert fields[field] == original, key  # byte for byte
        else:
            assert fields[field] == thumbnail_reference(original, 400, 80), key
            assert max(Image.open(io.BytesIO(fields[field])).size) == 400
    again = tmp_path / "again"
    convert_imagefolder(photo_tree, str(again), max_side=400, quality=80)
    for shard in sorted(dst.glob("*.tar")):
        assert filecmp.cmp(shard, again / shard.name, shallow=False)


def test_convert_without_max_side_is_unchanged_and_a_changed_setting_rewrites(photo_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    manifest = convert_imagefolder(photo_tree, str(dst))
    assert "resize" not in manifest.meta
    assert all(fields[f] == (photo_tree / f"{k}.{f}").read_bytes()
               for k, fields in _stored(dst).items() for f in fields if f != "cls")  # fmt: skip
    from shardflow.convert.engine.engine import ConvertOptions

    with pytest.raises(shardflow.ShardflowError):
        convert_imagefolder(photo_tree, str(dst), max_side=300)  # not the dataset that is there
    convert_imagefolder(photo_tree, str(dst), max_side=300, options=ConvertOptions(overwrite=True))
    assert json.loads((dst / "shardflow.json").read_text())["meta"]["resize"]["max_side"] == 300


def test_cli_max_side(photo_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "cli"
    assert main(["convert", "imagefolder", str(photo_tree), str(dst), "--max-side", "256", "--quality", "70"]) == 0
    meta = json.loads((dst / "shardflow.json").read_text())["meta"]
    assert meta["resize"] == {"max_side": 256, "quality": 70}
    sizes = [Image.open(io.BytesIO(v)).size for f in _stored(dst).values() for k, v in f.items() if k != "cls"]
    assert max(max(s) for s in sizes) == 256 and (200, 150) in sizes


# ---------------------------------------------------------------- min_side


@pytest.mark.parametrize(("width", "height", "min_side", "scale"),
                         [(3000, 2000, 256, 4), (3000, 2000, 250, 8), (3000, 2000, 251, 4), (800, 600, 300, 2),
                          (800, 600, 301, 1), (64, 48, 256, 1), (1001, 999, 125, 8), (1001, 999, 126, 4)])  # fmt: skip
def test_jpeg_scale(width: int, height: int, min_side: int, scale: int) -> None:
    assert jpeg_scale(width, height, min_side) == scale
    assert -(-min(width, height) // scale) >= min_side or scale == 1


@pytest.mark.parametrize("decoder", ["pillow", "simplejpeg"])
@pytest.mark.parametrize(("size", "min_side"), [((1200, 800), 224), ((1200, 800), 100), ((333, 251), 60)])
def test_reduced_decode_equals_pillows_draft(size: tuple[int, int], min_side: int, decoder: str) -> None:
    pytest.importorskip("simplejpeg") if decoder == "simplejpeg" else None
    data = photo(*size)
    s = jpeg_scale(*size, min_side)
    assert s > 1
    ref = Image.open(io.BytesIO(data))
    ref.draft("RGB", (size[0] // s, size[1] // s))
    expected = np.asarray(ref.convert("RGB"))
    got = decode_image(data, "numpy", min_side=min_side, jpeg_decoder=decoder)
    assert got.shape == (-(-size[1] // s), -(-size[0] // s), 3) and min(got.shape[:2]) >= min_side
    np.testing.assert_array_equal(got, expected)
    pil = decode_image(data, "pil", min_side=min_side)
    np.testing.assert_array_equal(np.asarray(pil), expected)
    tensor = decode_image(data, "torch", min_side=min_side)
    assert tuple(tensor.shape) == (3, *expected.shape[:2])


def test_reduced_decode_leaves_small_jpegs_and_other_formats_alone() -> None:
    small = photo(300, 200)
    np.testing.assert_array_equal(decode_image(small, "numpy", min_side=150), decode_image(small, "numpy"))
    png = photo(1200, 800, "PNG")
    np.testing.assert_array_equal(decode_image(png, "numpy", min_side=100), decode_image(png, "numpy"))
    with pytest.raises(ValueError, match="min_side"):
        decode_image(small, "numpy", min_side=0)
    with pytest.raises(ValueError, match="min_side"):
        DecodeOptions(min_side=-1)


def test_reduced_decode_with_exif_orientation_takes_pillows_path() -> None:
    img = Image.open(io.BytesIO(photo(1200, 800)))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    img.save(out, "JPEG", exif=exif.tobytes(), quality=95)
    got = decode_image(out.getvalue(), "numpy", min_side=200)
    full = decode_image(out.getvalue(), "numpy")
    assert full.shape == (1200, 800, 3) and got.shape == (300, 200, 3)


def test_dataset_min_side(photo_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    convert_imagefolder(photo_tree, str(dst))
    ds = shardflow.ShardDataset(str(dst), decode=DecodeOptions(image="numpy", min_side=150), fields=("image", "cls"))
    shapes = {s["__key__"]: s["image"].shape for s in ds}
    assert shapes["a/big"] == (150, 225, 3)  # 900x600 at 1/4: the short side is exactly 150
    assert shapes["a/small"] == (150, 200, 3)  # already at the size: full decode
    assert shapes["a/wide"] == (400, 1000, 3)  # PNG: unaffected
