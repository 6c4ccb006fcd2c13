"""The header check of convert imagefolder (shardflow.convert.images.imagecheck): corrupt images are
skipped and named in the manifest and the CLI summary, or refused with on_error='raise'; valid
images of every format, and a JPEG with data after its end, pass. Real Pillow images."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from PIL import Image

import shardflow
from shardflow.cli import main
from shardflow.codecs.image import decode_image
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.images.imagecheck import check_image
from shardflow.convert.images.imagefolder import convert_imagefolder
from shardflow.errors import ConversionError
from tests.helpers import tiny_image

FORMATS = ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM"]
LENGTH_CHECKED = ["JPEG", "PNG", "WEBP", "GIF", "BMP"]  # truncation found without decoding


@pytest.mark.parametrize("fmt", FORMATS)
def test_valid_images_pass_and_broken_ones_do_not(fmt: str) -> None:
    data = tiny_image(fmt, 1, size=(64, 48))
    assert check_image(data) is None
    Image.open(io.BytesIO(data)).load()  # the reference agrees
    broken_ones = [b"\0" * 10 + data[10:], b"", data[:5]]
    if fmt in LENGTH_CHECKED:
        broken_ones.append(data[: len(data) // 3])
    for broken in broken_ones:
        why = check_image(broken)
        with contextlib.suppress(Exception):
            Image.open(io.BytesIO(broken)).load()
            decode_image(broken)
            # Pillow reads it whole after all (some formats survive a zeroed prefix): so may we
            assert why is None
            continue
        assert why is not None and why.startswith("corrupt image"), (fmt, why)


def test_a_jpeg_with_bytes_after_its_end_passes() -> None:
    data = tiny_image("JPEG", 2, size=(32, 32)) + b"appended video data" * 10  # a motion photo's layout
    assert check_image(data) is None
    assert check_image(b"\xff\xd8\xff\xe0 not a jpeg at all") is not None


def bad_tree(root: Path) -> dict[str, bytes]:
    files = {
        "cat/a.jpg": tiny_image("JPEG", 1),
        "cat/b.png": tiny_image("PNG", 2),
        "cat/c.jpg": tiny_image("JPEG", 3)[:40],  # truncated
        "dog/d.jpg": tiny_image("JPEG", 4),
        "dog/e.png": b"\x89PNG\r\n\x1a\n broken",  # a PNG signature, no header
        "dog/notes.txt": b"not an image",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_corrupt_images_are_skipped_and_named(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    files = bad_tree(root)
    dst = tmp_path / "out"
    m = convert_imagefolder(root, str(dst), options=ConvertOptions(max_count=2, workers=2))
    got = {s["__key__"]: s for s in shardflow.ShardDataset(str(dst), decode=None)}
    assert sorted(got) == ["cat/a", "cat/b", "dog/d"]
    assert got["cat/b"]["png"] == files["cat/b.png"]
    stored = json.loads((dst / "shardflow.json").read_text())["meta"]
    assert stored["skipped_count"] == 2
    assert [e["path"] for e in stored["skipped"]] == ["cat/c.jpg", "dog/e.png"]
    assert all(e["reason"].startswith("corrupt image: ") for e in stored["skipped"])
    assert stored["ignored"] == [{"path": "dog/notes.txt", "reason": "not an image (extension)"}]
    # the samples written, not the files the walk took before the check (issue 32)
    assert stored["class_counts"] == {"cat": 2, "dog": 1}
    assert m.num_samples == 3
    # a re-run keeps every shard and still names the skipped files
    again = convert_imagefolder(root, str(dst), options=ConvertOptions(max_count=2, workers=1))
    assert again.meta["skipped"] == stored["skipped"] and again.num_samples == 3


def test_on_error_raise_names_the_file(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    bad_tree(root)
    with pytest.raises(ConversionError, match=r"cat/c\.jpg: corrupt image") as info:
        convert_imagefolder(root, str(tmp_path / "out"), options=ConvertOptions(workers=1), on_error="raise")
    assert info.value.reason == "corrupt_image"
    with pytest.raises(ValueError, match="on_error"):
        convert_imagefolder(root, str(tmp_path / "out"), on_error="ignore")


def test_cli_summary_names_corrupt_and_ignored_files(tmp_path: Path, capsys) -> None:
    root = tmp_path / "tree"
    bad_tree(root)
    assert main(["convert", "imagefolder", str(root), str(tmp_path / "out"), "--workers", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("3 samples, 2 classes, 1 shard in ")
    assert out[1] == "skipped (corrupt): 2"
    assert out[2].startswith("  cat/c.jpg: corrupt image: ") and out[3].startswith("  dog/e.png: corrupt image: ")
    assert out[4:] == ["ignored: 1", "  dog/notes.txt: not an image (extension)"]
    rc = main(["convert", "imagefolder", str(root), str(tmp_path / "out2"), "--workers", "1", "--on-error", "raise"])
    assert rc == 1
    assert "cat/c.jpg: corrupt image" in capsys.readouterr().err
