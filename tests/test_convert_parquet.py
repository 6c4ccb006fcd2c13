"""convert parquet: Hugging Face parquet datasets (image structs, ClassLabel) -> one sample per row.

The reference for every value is pyarrow's own read of the files; the shards are read
back with the reference reader (stdlib ``tarfile``, tests/reference.py).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
from PIL import Image  # noqa: E402

import shardflow  # noqa: E402
from shardflow.cli import main  # noqa: E402
from shardflow.convert.engine.engine import ConvertOptions  # noqa: E402
from shardflow.convert.records.parquet import convert_parquet  # noqa: E402
from shardflow.errors import ConversionError  # noqa: E402
from tests.order_reference import reference_parquet  # noqa: E402
from tests.reference import read_dataset  # noqa: E402

NAMES = ["cat", "dog", "fish"]
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
HF_META = {b"huggingface": json.dumps({"info": {"features": {
    "image": {"_type": "Image"}, "label": {"names": NAMES, "_type": "ClassLabel"}}}}).encode()}  # fmt: skip


def image_bytes(i: int) -> bytes:
    """Image ``i``: PNG for odd ``i``, JPEG for even, of a few sizes."""
    rng = np.random.default_rng(i)
    pixels = rng.integers(0, 256, (6 + i % 4, 5 + i % 3, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG" if i % 2 else "JPEG", quality=90)
    return buf.getvalue()


def hf_dataset(root: Path, sizes=(37, 26), row_group_size=7) -> list[Path]:
    """Hugging Face's layout: ``root/data/train-0000N-of-00002.parquet``, an Image struct and a ClassLabel."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    files, first = [], 0
    for n_file, n in enumerate(sizes):
        rows = range(first, first + n)
        table = pa.table({
            "image": pa.array([{"bytes": image_bytes(i), "path": f"img_{i}.x"} for i in rows], IMAGE),
            "label": pa.array([i % 3 for i in rows], pa.int64()),
        }).replace_schema_metadata(HF_META)  # fmt: skip
        path = root / "data" / f"train-{n_file:05d}-of-{len(sizes):05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        files.append(path)
        first += n
    return files


def group_rows(files) -> list[int]:
    """Rows of every row group of the files, in order."""
    out = []
    for f in files:
        meta = pq.ParquetFile(f).metadata
        out += [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    return out


def reference_rows(files) -> list[dict]:
    """What pyarrow reads: every row of the files in order."""
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def tar_samples(dst: Path) -> list[dict]:
    """Every sample of the dataset's shards, in manifest order, read by the reference reader (``tarfile``)."""
    return [{"__key__": s.key, **s.fields} for s in read_dataset(dst)[0]]


def test_hugging_face_layout_converts_with_defaults(tmp_path, capsys):
    files = hf_dataset(tmp_path / "hf")
    dst = tmp_path / "out"
    assert main(["convert", "parquet", str(tmp_path / "hf"), str(dst)]) == 0
    assert "63 rows of 2 files, 3 classes -> 1 shard" in capsys.readouterr().out
    ref = reference_rows(files)
    got = tar_samples(dst)
    assert len(got) == len(ref) == 63
    order = reference_parquet(group_rows(files), 10_000)  # the default order: one shard, row groups of 7 shuffled
    assert sorted(order) == list(range(63))
    for i, sample in zip(order, got):
        row = ref[i]
        ext = "png" if row["image"]["bytes"].startswith(b"\x89PNG") else "jpg"
        assert ext == ("png" if i % 2 else "jpg")
        assert sample == {"__key__": f"{i:09d}", ext: row["image"]["bytes"], "cls": str(row["label"]).encode()}
    meta = json.loads((dst / "shardflow.json").read_text())["meta"]
    assert meta["order"] == "shuffled" and meta["order_seed"] == 0
    assert meta["class_to_idx"] == {"cat": 0, "dog": 1, "fish": 2}
    assert meta["columns"] == [
        {"column": "image", "kind": "image", "field": "<format>"},
        {"column": "label", "kind": "int", "field": "cls", "class_names": NAMES},
    ]
    assert meta["rows"] == 63 and [f["rows"] for f in meta["files"]] == [37, 26]


@pytest.mark.parametrize("order", ["shuffled", "walk"])
def test_shards_span_row_groups_and_files_in_parallel(tmp_path, order):
    files = hf_dataset(tmp_path / "hf")
    m = convert_parquet(tmp_path / "hf" / "data" / "train-*.parquet", str(tmp_path / "out"), order=order,
                        options=ConvertOptions(max_count=10, workers=2))  # fmt: skip
    assert [s.samples for s in m.shards] == [10, 10, 10, 10, 10, 10, 3]
    rows = reference_parquet(group_rows(files), 10) if order == "shuffled" else list(range(63))
    ref = [reference_rows(files)[i] for i in rows]
    got = tar_samples(tmp_path / "out")
    assert [s["__key__"] for s in got] == [f"{i:09d}" for i in rows]
    assert [s.get("jpg", s.get("png")) for s in got] == [r["image"]["bytes"] for r in ref]
    assert [int(s["cls"]) for s in got] == [r["label"] for r in ref]
    # the streaming reader decodes them: mixed formats read as one "image" field
    ds = shardflow.ShardDataset(str(tmp_path / "out"), decode="numpy", fields=("image", "cls"))
    first = next(iter(ds))
    assert first["image"].shape == np.asarray(Image.open(io.BytesIO(ref[0]["image"]["bytes"]))).shape


def test_columns_pick_and_rename(tmp_path):
    files = hf_dataset(tmp_path / "hf", sizes=(9,), row_group_size=4)
    m = convert_parquet(files[0], str(tmp_path / "out"), columns="label:target,image:image",
                        options=ConvertOptions(workers=1))  # fmt: skip
    ref = reference_rows(files)
    got = tar_samples(tmp_path / "out")
    assert got == [{"__key__": f"{i:09d}", "target.cls": str(ref[i]["label"]).encode(), "image": ref[i]["image"]["bytes"]}
                   for i in reference_parquet(group_rows(files), 10_000)]  # fmt: skip
    assert m.meta["class_to_idx"] == {"cat": 0, "dog": 1, "fish": 2}  # the one ClassLabel column, renamed


def test_a_missing_column_is_named(tmp_path):
    files = hf_dataset(tmp_path / "hf", sizes=(4,))
    with pytest.raises(ConversionError, match=r"no column 'labels'; its columns are 'image', 'label'"):
        convert_parquet(files[0], str(tmp_path / "out"), columns="image,labels")
    assert main(["convert", "parquet", str(files[0]), str(tmp_path / "o2"), "--columns", "img"]) == 1


def test_an_image_field_of_one_format_refuses_another(tmp_path):
    files = hf_dataset(tmp_path / "hf", sizes=(4,))
    first_png = next(i for i in reference_parquet(group_rows(files), 10_000) if i % 2)  # the first one written
    with pytest.raises(ConversionError, match=rf"row {first_png}, key 00000000{first_png}\): column 'image': field "
                       r"'jpg' takes JPEG images, this value is PNG"):  # fmt: skip
        convert_parquet(files[0], str(tmp_path / "out"), columns="image:jpg,label:cls",
                        options=ConvertOptions(workers=1))  # fmt: skip


def test_column_kinds_and_default_names(tmp_path):
    table = pa.table({
        "text": ["a", None, "ü ✓"],
        "score": [0.5, 1.25, None],
        "tags": [[1, 2], [], [3]],
        "Coarse Label": pa.array([1, 2, 3], pa.int32()),
        "fine": pa.array([7, 8, 9], pa.uint8()),
        "when": pa.array([0, 86_400_000, None], pa.timestamp("ms")),
        "raw": pa.array([b"\x00\x01", image_bytes(2), None], pa.binary()),
        "__index_level_0__": [0, 1, 2],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    m = convert_parquet(tmp_path / "t.parquet", str(tmp_path / "out"), options=ConvertOptions(workers=1))
    listed = tar_samples(tmp_path / "out")
    assert [int(s["__key__"]) for s in listed] == reference_parquet([3], 10_000)
    got = sorted(listed, key=lambda s: s["__key__"])
    assert got[0] == {"__key__": "000000000", "txt": b"a", "score.json": b"0.5", "tags.json": b"[1,2]",
                      "coarse_label.cls": b"1", "fine.cls": b"7", "when.json": b'"1970-01-01T00:00:00"',
                      "raw.bin": b"\x00\x01"}  # fmt: skip
    assert got[1]["jpg"] == image_bytes(2) and "txt" not in got[1]  # the one image column: bare "jpg"; a null left out
    assert got[1]["when.json"] == b'"1970-01-02T00:00:00"'
    assert got[2] == {"__key__": "000000002", "txt": "ü ✓".encode(), "tags.json": b"[3]",
                      "coarse_label.cls": b"3", "fine.cls": b"9"}  # fmt: skip
    assert [c["column"] for c in m.meta["columns"]] == ["text", "score", "tags", "Coarse Label", "fine", "when", "raw"]
    assert "class_to_idx" not in m.meta


def test_a_folder_of_several_splits_is_refused_and_a_glob_picks_one(tmp_path):
    hf_dataset(tmp_path / "hf", sizes=(5, 4))
    pq.write_table(pq.read_table(tmp_path / "hf/data/train-00000-of-00002.parquet"),
                   tmp_path / "hf/data/test-00000-of-00001.parquet")  # fmt: skip
    with pytest.raises(ConversionError, match=r"holds the parquet files of 2 splits \(test, train\)"):
        convert_parquet(tmp_path / "hf", str(tmp_path / "out"))
    m = convert_parquet(str(tmp_path / "hf/data/train-*.parquet"), str(tmp_path / "out"), options=ConvertOptions(workers=1))
    assert m.num_samples == 9


def test_an_fsspec_source(tmp_path):
    files = hf_dataset(tmp_path / "hf", sizes=(6, 5), row_group_size=4)
    fs = fsspec.filesystem("memory")
    for f in files:
        fs.pipe(f"/pq-src/data/{f.name}", f.read_bytes())
    try:
        m = convert_parquet("memory://pq-src", str(tmp_path / "out"), options=ConvertOptions(max_count=4, workers=1))
    finally:
        fs.rm("/pq-src", recursive=True)
    assert [s.samples for s in m.shards] == [4, 4, 3]
    ref = reference_rows(files)
    rows = reference_parquet(group_rows(files), 4)
    assert [s.get("jpg", s.get("png")) for s in tar_samples(tmp_path / "out")] == [ref[i]["image"]["bytes"] for i in rows]


def test_a_rerun_keeps_the_finished_shards(tmp_path):
    hf_dataset(tmp_path / "hf", sizes=(12,))
    first = convert_parquet(tmp_path / "hf", str(tmp_path / "out"), options=ConvertOptions(max_count=5, workers=1))
    kept = []

    class Progress:
        def __call__(self, n):
            pass

        def kept(self, n):
            kept.append(n)

    again = convert_parquet(tmp_path / "hf", str(tmp_path / "out"), options=ConvertOptions(max_count=5, workers=1),
                            progress=Progress())  # fmt: skip
    assert kept == [3] and [s.sha256 for s in again.shards] == [s.sha256 for s in first.shards]


def test_files_with_other_class_names_are_refused(tmp_path):
    files = hf_dataset(tmp_path / "hf", sizes=(3, 3))
    other = {b"huggingface": HF_META[b"huggingface"].replace(b'"fish"', b'"bird"')}
    pq.write_table(pq.read_table(files[1]).replace_schema_metadata(other), files[1])
    with pytest.raises(ConversionError, match="other ClassLabel names than the first file"):
        convert_parquet(tmp_path / "hf", str(tmp_path / "out"), options=ConvertOptions(workers=1))


def test_hf_urls_without_huggingface_hub_name_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails, as when not installed
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "hf", raising=False)  # not imported before
    with pytest.raises(ImportError, match=r"'huggingface_hub'.*pip install 'shardflow\[hf\]'"):
        convert_parquet("hf://datasets/someone/something/data/train-*.parquet", str(tmp_path / "out"))
