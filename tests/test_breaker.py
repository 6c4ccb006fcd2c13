"""Hostile inputs against the features that landed on 2026-12-01 (reviewer's reproducers).

Each test is a bug found by attacking the new code; the reference is the data
written (the keys and bytes given to the writer), never the code under test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from shardflow import IndexedShardDataset, ShardDataset, ShardWriter
from shardflow.errors import ManifestError


def _write(folder: Path, n: int, per: int, seed: int = 0, **kw: object) -> list[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    blobs = [rng.bytes(20_000) for _ in range(n)]
    with ShardWriter(str(folder / "s-%06d.tar"), max_count=per, **kw) as sink:
        for i, blob in enumerate(blobs):
            sink.write({"__key__": f"{i:06d}", "bin": blob})
    return blobs


def test_random_access_refuses_a_shard_replaced_by_a_longer_one(tmp_path: Path) -> None:
    """Shard 1 (30 samples, keys 30-59) replaced behind the manifest by a 32-sample shard
    (keys 32-63): sample 45 must not silently come back as key 000047 (the streaming reader
    already refuses the longer shard with ManifestError reason changed_shard)."""
    _write(tmp_path / "a", 60, 30)
    _write(tmp_path / "b", 64, 32)
    listed = (tmp_path / "a" / "s-000001.tar").stat().st_size  # 30 x (512 + 20,480) + 1,024 = 630,784
    shutil.copy(tmp_path / "b" / "s-000001.tar", tmp_path / "a" / "s-000001.tar")
    assert listed == 630_784 and (tmp_path / "a" / "s-000001.tar").stat().st_size == 672_768
    with pytest.raises(ManifestError, match=r"s-000001\.tar: the shard has 672768 bytes but the manifest lists 630784"):
        list(ShardDataset(str(tmp_path / "a"), decode=None))
    ds = IndexedShardDataset(str(tmp_path / "a"), decode=None)
    assert ds[29]["__key__"] == "000029"  # shard 0 is intact
    with pytest.raises(ManifestError, match=r"s-000001\.tar: the shard has 672768 bytes") as info:
        ds[45]
    assert info.value.reason == "changed_shard"


def _classlabel_parquet(path: Path, labels: list[int]) -> None:
    import io
    import json

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buf, "PNG")
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": ["cat", "dog"]}}
    schema = pa.schema([("image", image), ("label", pa.int64())],
                       metadata={b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    rows = [{"bytes": buf.getvalue(), "path": f"{i}.png"} for i in range(len(labels))]
    pq.write_table(pa.table({"image": pa.array(rows, image), "label": pa.array(labels, pa.int64())}, schema=schema), path)


@pytest.mark.parametrize("bad", [2, 7, -2])
def test_parquet_classlabel_out_of_range_is_an_error(tmp_path: Path, bad: int) -> None:
    """A ClassLabel column with names [cat, dog]: label 7 was stored as cls 7 beside
    class_to_idx {cat: 0, dog: 1}, a class no name maps to."""
    from shardflow.convert.records.parquet import convert_parquet
    from shardflow.errors import ConversionError

    _classlabel_parquet(tmp_path / "t.parquet", [0, 1, bad])
    with pytest.raises(ConversionError, match=rf"row 2, key 000000002\): column 'label': label {bad} is not one of"):
        convert_parquet(str(tmp_path / "t.parquet"), str(tmp_path / "out"))


def test_parquet_classlabel_minus_one_is_kept(tmp_path: Path) -> None:
    """-1 is Hugging Face's "no label" (test splits): still converted, as cls -1."""
    from shardflow.convert.records.parquet import convert_parquet

    _classlabel_parquet(tmp_path / "t.parquet", [1, -1])
    convert_parquet(str(tmp_path / "t.parquet"), str(tmp_path / "out"))
    got = {s["__key__"]: s["cls"] for s in ShardDataset(str(tmp_path / "out"), decode=None)}
    assert got == {"000000000": b"1", "000000001": b"-1"}


@pytest.mark.parametrize("name", ["7", "null", "true", "1.5"])
def test_classes_from_a_text_list_of_one_name_that_parses_as_json(tmp_path: Path, name: str) -> None:
    """A one-line text list "7" was taken as the JSON number 7 and refused."""
    from shardflow.convert.images.imageclasses import classes_from

    (tmp_path / "names.txt").write_text(f"{name}\n")
    assert classes_from(str(tmp_path / "names.txt")) == {name: 0}


@pytest.mark.parametrize("lie", ["frames", "index"])
def test_a_framed_shard_whose_tables_lie_is_not_called_unframed(tmp_path: Path, lie: str) -> None:
    """One .tar.zst shard of 60 samples split over 4 ranks; its frame table's tar offsets
    shifted by 512 (or its offset index's entry 30): rank 1-2 got "compressed shard, but the
    manifest gives it an offset index... (compressed shards then stream whole)", advice that
    is wrong for a framed shard. The tar reader's own error (the byte where the header is bad)
    is the one to report."""
    pytest.importorskip("zstandard")
    from shardflow.errors import ShardFormatError

    _write(tmp_path, 60, 100, compression="zstd")
    if lie == "frames":
        table = np.load(tmp_path / "s-000000.tar.zst.frames.npy")
        table[1:-1, 0] += 512
        np.save(tmp_path / "s-000000.tar.zst.frames.npy", table)
    else:
        idx = np.load(tmp_path / "s-000000.tar.zst.idx.npy")
        idx[30] += 512
        np.save(tmp_path / "s-000000.tar.zst.idx.npy", idx)
    with pytest.raises(ShardFormatError) as info:
        list(ShardDataset(str(tmp_path), decode=None, rank=2, world_size=4))
    assert "s-000000.tar.zst" in str(info.value)
    assert info.value.reason != "compressed_shard" and "cannot seek into a compressed stream" not in str(info.value)
