"""Silent partial reads and deletes (issue 32): a folder being written (or left unfinished) is
refused unless asked for, a writer never deletes shards it did not write, labels round-trip or
are refused at conversion, a manifest entry cannot size arrays by its sample count alone, a
shard linked outside its folder is refused, and the manifest's counts leave out skipped files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardflow import IOOptions, ShardDataset, ShardWriter
from shardflow.convert.engine import ConvertOptions
from shardflow.errors import ConversionError, ManifestError

from .helpers import make_shards, tiny_image

pytestmark = pytest.mark.timeout(120)


def test_parquet_uint64_label_past_int64_is_refused_at_conversion(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from shardflow.convert.parquet import convert_parquet

    src = tmp_path / "u64.parquet"
    pq.write_table(pa.table({"label": pa.array([1, 2**64 - 1, 3], pa.uint64())}), src)
    with pytest.raises(ConversionError, match=r"row 1.*18446744073709551615 does not fit an int64"):
        convert_parquet(str(src), str(tmp_path / "out"), options=ConvertOptions(workers=1))
    # every label that fits is read back exactly, the int64 extremes included
    ok = tmp_path / "ok.parquet"
    labels = [0, 2**63 - 1, 7]
    pq.write_table(pa.table({"label": pa.array(labels, pa.uint64())}), ok)
    convert_parquet(str(ok), str(tmp_path / "ok"), options=ConvertOptions(workers=1))
    assert [s["cls"] for s in ShardDataset(str(tmp_path / "ok"))] == labels
    signed = tmp_path / "signed.parquet"
    pq.write_table(pa.table({"label": pa.array([-(2**63), -1], pa.int64())}), signed)
    convert_parquet(str(signed), str(tmp_path / "signed"), options=ConvertOptions(workers=1))
    assert [s["cls"] for s in ShardDataset(str(tmp_path / "signed"))] == [-(2**63), -1]


def test_shard_writer_refuses_a_label_the_reader_would_refuse(tmp_path: Path) -> None:
    with ShardWriter(str(tmp_path / "w" / "train-%06d.tar")) as w:
        with pytest.raises(ValueError, match="does not fit an int64"):
            w.write({"__key__": "a", "cls": 2**64 - 1})
        w.write({"__key__": "b", "cls": 2**63 - 1})
    assert [s["cls"] for s in ShardDataset(str(tmp_path / "w"))] == [2**63 - 1]


def test_a_shard_linked_to_a_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [3, 3])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.replace(folder / "train-000001.tar", outside / "planted.tar")
    os.symlink(outside / "planted.tar", folder / "train-000001.tar")
    with pytest.raises(ManifestError, match=r"'train-000001.tar' is a symbolic link .* outside the manifest's folder"):
        ShardDataset(str(folder))
    # a folder on the way that links out is refused alike
    sub = make_shards(tmp_path, [2], name="sub")
    nested = tmp_path / "nested"
    nested.mkdir()
    os.symlink(sub, nested / "part")
    manifest = json.loads((sub / "shardflow.json").read_text())
    for s in manifest["shards"]:
        s["url"] = "part/" + s["url"]
        s["index"] = "part/" + s["index"] if s.get("index") else None
    (nested / "shardflow.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"'part/train-000000.tar' is a symbolic link"):
        ShardDataset(str(nested))
    # opened on purpose, as URLs outside the folder are
    trusted = ShardDataset(str(folder), io=IOOptions(trust_manifest_urls=True))
    assert [s["cls"] for s in trusted] == list(range(6))
    # a link that stays inside the folder is read
    os.remove(folder / "train-000001.tar")
    os.replace(outside / "planted.tar", folder / "real.tar")
    os.symlink("real.tar", folder / "train-000001.tar")
    assert [s["cls"] for s in ShardDataset(str(folder))] == list(range(6))


def test_imagefolder_counts_leave_out_the_corrupt_images_it_skipped(tmp_path: Path) -> None:
    from shardflow.convert.imagefolder import convert_imagefolder

    src = tmp_path / "src"
    for cls, names in {"cat": ["a.jpg", "b.jpg", "c.png", "bad.jpg"], "dog": ["d.jpg", "bad.png"]}.items():
        (src / cls).mkdir(parents=True)
        for i, name in enumerate(names):
            fmt = "PNG" if name.endswith("png") else "JPEG"
            data = tiny_image(fmt, i)
            (src / cls / name).write_bytes(data[: len(data) // 2] if name.startswith("bad") else data)
    dst = tmp_path / "dst"
    manifest = convert_imagefolder(str(src), str(dst), options=ConvertOptions(workers=1, max_count=2), on_error="skip")
    samples = list(ShardDataset(str(dst), decode=None))
    assert len(samples) == manifest.num_samples == 4
    meta = json.loads((dst / "shardflow.json").read_text())["meta"]
    assert meta["skipped_count"] == 2
    assert meta["class_counts"] == {"cat": 3, "dog": 1}  # was {"cat": 4, "dog": 2}: 6 against 4 samples
    assert meta["image_fields"] == {"jpg": 3, "png": 1}
    assert sum(meta["class_counts"].values()) == sum(meta["image_fields"].values()) == len(samples)
    # a re-run keeps the finished groups (and their skips): the counts stay the same
    convert_imagefolder(str(src), str(dst), options=ConvertOptions(workers=1, max_count=2), on_error="skip")
    again = json.loads((dst / "shardflow.json").read_text())["meta"]
    assert again["class_counts"] == meta["class_counts"] and again["image_fields"] == meta["image_fields"]
