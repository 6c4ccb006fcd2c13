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

import shardflow
from shardflow import IndexedShardDataset, IOOptions, ShardDataset, ShardWriter
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.errors import ConversionError, DestinationExistsError, ManifestError, ShardflowError
from shardflow.sources.listed import IncompleteDatasetError

from .helpers import make_shards, tiny_image

pytestmark = pytest.mark.timeout(120)


def test_parquet_uint64_label_past_int64_is_refused_at_conversion(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from shardflow.convert.records.parquet import convert_parquet

    src = tmp_path / "u64.parquet"
    pq.write_table(pa.table({"label": pa.array([1, 2**64 - 1, 3], pa.uint64())}), src)
    with pytest.raises(ConversionError, match=r"row 1.*18446744073709551615 does not fit an int64"):
        convert_parquet(str(src), str(tmp_path / "out"), options=ConvertOptions(workers=1))
    # every label that fits is read back exactly, the int64 extremes included
    ok = tmp_path / "ok.parquet"
    labels = [0, 2**63 - 1, 7]
    pq.write_table(pa.table({"label": pa.array(labels, pa.uint64())}), ok)
    convert_parquet(str(ok), str(tmp_path / "ok"), options=ConvertOptions(workers=1))
    by_key = lambda folder: sorted(ShardDataset(str(folder)), key=lambda s: s["__key__"])  # noqa: E731 (any order)
    assert [s["cls"] for s in by_key(tmp_path / "ok")] == labels
    signed = tmp_path / "signed.parquet"
    pq.write_table(pa.table({"label": pa.array([-(2**63), -1], pa.int64())}), signed)
    convert_parquet(str(signed), str(tmp_path / "signed"), options=ConvertOptions(workers=1))
    assert [s["cls"] for s in by_key(tmp_path / "signed")] == [-(2**63), -1]


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
    from shardflow.convert.images.imagefolder import convert_imagefolder

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


# --------------------------------------------------------------------------------------------
# a folder being written, or left unfinished


PROBES: list[BaseException | int] = []  # what reading the destination gave while it was written


def _probing(dst: str):
    def fn(i: int) -> dict:
        if i == 25:  # groups 0 and 1 (10 inputs each) are finished and named by now
            try:
                PROBES.append(sum(1 for _ in ShardDataset(dst, decode=None)))
            except ShardflowError as e:
                PROBES.append(e)
            try:
                PROBES.append(sum(1 for _ in ShardDataset(dst, decode=None, io=IOOptions(allow_incomplete=True))))
            except FileNotFoundError:  # no shard named yet (the commits run in threads)
                PROBES.append(0)
        if i == 37 and os.environ.get("SHARDFLOW_TEST_FAIL"):
            raise RuntimeError("disk on fire")
        return {"__key__": f"k{i:04d}", "cls": i}

    return fn


def test_a_folder_a_conversion_is_writing_is_refused_with_the_writer_named(tmp_path: Path) -> None:
    dst = str(tmp_path / "dst")
    PROBES.clear()
    shardflow.write_shards(_probing(dst), range(60), dst, max_count=10, workers=1)
    refused, partial = PROBES
    assert isinstance(refused, IncompleteDatasetError) and isinstance(refused, OSError)
    assert f"a writer (pid {os.getpid()} on " in str(refused)
    assert dst in str(refused) and "allow_incomplete=True" in str(refused)
    assert partial in (0, 10, 20)  # read on purpose: finished groups only (those recorded by then)
    assert sum(1 for _ in ShardDataset(dst, decode=None)) == 60  # finished: read as any folder


def test_a_conversion_that_did_not_finish_is_refused_unless_asked_for(tmp_path: Path, monkeypatch) -> None:
    dst = tmp_path / "dst"
    PROBES.clear()
    monkeypatch.setenv("SHARDFLOW_TEST_FAIL", "1")
    with pytest.raises(ConversionError, match="disk on fire"):
        shardflow.write_shards(_probing(str(dst)), range(60), str(dst), max_count=10, workers=1)
    assert json.loads((dst / "shardflow.json").read_text())["meta"]["conversion"] == {"complete": False}
    with pytest.raises(IncompleteDatasetError, match=r"did not finish .*re-run the conversion.*allow_incomplete=True"):
        ShardDataset(str(dst))
    with pytest.raises(IncompleteDatasetError):
        ShardDataset(str(dst / "shardflow.json"))
    with pytest.raises(IncompleteDatasetError):
        IndexedShardDataset(str(dst))
    on_purpose = ShardDataset(str(dst), io=IOOptions(allow_incomplete=True))
    assert [s["cls"] for s in on_purpose] == list(range(30))  # the three groups that finished
    monkeypatch.delenv("SHARDFLOW_TEST_FAIL")
    shardflow.write_shards(_probing(str(dst)), range(60), str(dst), max_count=10, workers=1)  # resumes
    assert [s["cls"] for s in ShardDataset(str(dst))] == list(range(60))


def test_a_folder_a_shard_writer_holds_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "w"
    with ShardWriter(str(folder / "train-%06d.tar"), max_count=10) as w:
        for i in range(35):
            w.write({"__key__": f"k{i:04d}", "cls": i})
        with pytest.raises(IncompleteDatasetError, match=rf"{folder}: a writer \(pid {os.getpid()} on "):
            ShardDataset(str(folder))
        with pytest.raises(IncompleteDatasetError):
            ShardDataset(str(folder / "train-{000000..000002}.tar"))
        on_purpose = ShardDataset(str(folder), io=IOOptions(allow_incomplete=True))
        assert [s["cls"] for s in on_purpose] == list(range(30))  # the shards it finished
    assert [s["cls"] for s in ShardDataset(str(folder))] == list(range(35))


def test_a_shard_listed_without_bytes_cannot_size_arrays_by_its_count(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [4, 4])
    manifest = json.loads((folder / "shardflow.json").read_text())
    del manifest["shards"][1]["bytes"]
    manifest["shards"][1]["samples"] = 400_000_000  # 3.1 GB of plan arrays, a bare MemoryError before
    (folder / "shardflow.json").write_text(json.dumps(manifest))
    size = (folder / "train-000001.tar").stat().st_size
    with pytest.raises(ManifestError, match=rf"'train-000001.tar' declares 400000000 samples in {size} bytes"):
        ShardDataset(str(folder), shuffle=True)
    # a count the stored size can hold is read as before
    manifest["shards"][1]["samples"] = 4
    (folder / "shardflow.json").write_text(json.dumps(manifest))
    assert [s["cls"] for s in ShardDataset(str(folder))] == list(range(8))
    # no size to bound it by: named, not guessed
    os.remove(folder / "train-000001.tar")
    with pytest.raises(ManifestError, match=r"'train-000001.tar' is listed with 4 samples but no \"bytes\""):
        ShardDataset(str(folder))


def _sample(i: int) -> dict:
    return {"__key__": f"k{i:05d}", "cls": i}


def test_a_shard_writer_never_replaces_a_conversions_shards(tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    shardflow.write_shards(_sample, range(5600), str(dst), max_count=1000, workers=1)
    before = {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file()}
    with pytest.raises(DestinationExistsError, match=r"conversion's shards of this series \(train-000000.tar.*5600 "
                                                     r"samples\).*never replaces shards it did not write"):
        with ShardWriter(str(dst / "train-%06d.tar"), max_count=10) as w:
            for i in range(30):
                w.write(_sample(100_000 + i))
    assert {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file()} == before  # shards and manifest intact
    assert [s["cls"] for s in ShardDataset(str(dst))] == list(range(5600))
    # another series beside them: the conversion's shards stay listed and untouched
    with ShardWriter(str(dst / "extra-%06d.tar"), max_count=10) as w:
        for i in range(30):
            w.write(_sample(100_000 + i))
    assert [s["cls"] for s in ShardDataset(str(dst))] == list(range(5600)) + list(range(100_000, 100_030))
    assert all((dst / name).read_bytes() == data for name, data in before.items() if name.endswith(".tar"))
