"""convert imagefolder from a bucket: an S3 tree (moto on loopback) and memory:// give the
same classes, keys, order, class_to_idx and shard bytes as a local copy of the tree;
listings are per folder (never the whole bucket); another dataset in DST is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.images.imagefolder import convert_imagefolder, count_images, find_classes
from shardflow.errors import ConversionError, DestinationExistsError
from tests.helpers import tiny_image

pytestmark = pytest.mark.timeout(120)

# relative path -> bytes: nested folders, upper-case extensions, shared stems, dots in
# names, hidden and non-image files, classes whose names sort differently by case
TREE = {
    "cat/0001.jpg": tiny_image("JPEG", 1),
    "cat/0002.JPG": tiny_image("JPEG", 2),
    "cat/a.b.png": tiny_image("PNG", 3),
    "cat/x.jpg": tiny_image("JPEG", 4),
    "cat/x.png": tiny_image("PNG", 5),
    "cat/.DS_Store": b"junk",
    "cat/notes.txt": b"not an image",
    "cat/deep/er/0003.jpg": tiny_image("JPEG", 8),
    "cat/deep/0004.webp": tiny_image("WEBP", 9),
    "Dog/0001.jpg": tiny_image("JPEG", 10),
    "Dog/.hidden/0009.jpg": b"hidden",
    "dog/0001.jpg": tiny_image("JPEG", 12),
    "dog/0002.jpeg": tiny_image("JPEG", 13),
    "README.md": b"root file",
}


def write_local(root: Path) -> Path:
    for rel, data in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def same_dataset(local: Path, remote: Path, local_src: str, remote_src: str) -> None:
    """Byte-identical shards and index files; the manifests identical byte for byte once the
    one line that differs, meta.source (where the tree was), is put in the same form."""
    a, b = folder_bytes(local), folder_bytes(remote)
    assert sorted(a) == sorted(b)
    for name in a:
        if name != "shardflow.json":
            assert a[name] == b[name], name
    assert json.loads(a["shardflow.json"])["meta"]["source"] == local_src
    assert json.loads(b["shardflow.json"])["meta"]["source"] == remote_src
    assert a["shardflow.json"].replace(json.dumps(local_src).encode(), json.dumps(remote_src).encode()) == b["shardflow.json"]


@pytest.fixture
def s3_tree(moto_server, s3_prefix: str, tmp_path: Path) -> tuple[str, Path]:
    fs = moto_server.fs()
    base = s3_prefix.removeprefix("s3://") + "tree/"
    for rel, data in TREE.items():
        fs.pipe_file(base + rel, data)
    return s3_prefix + "tree", write_local(tmp_path / "local")


@pytest.mark.parametrize("workers", [1, 2])
def test_s3_tree_same_bytes_as_local_copy(s3_tree, s3_options, tmp_path: Path, workers: int) -> None:
    src, local = s3_tree
    options = ConvertOptions(max_count=3, workers=workers, storage_options=s3_options)
    m_remote = convert_imagefolder(src, str(tmp_path / "from-s3"), options=options)
    m_local = convert_imagefolder(str(local), str(tmp_path / "from-disk"), options=ConvertOptions(max_count=3, workers=1))
    same_dataset(tmp_path / "from-disk", tmp_path / "from-s3", str(local), src)
    assert m_remote.meta["class_to_idx"] == {"Dog": 0, "cat": 1, "dog": 2}
    assert m_remote.meta["class_counts"] == {"Dog": 1, "cat": 7, "dog": 2}
    assert m_remote.meta["ignored_files"] == 3 and m_remote.meta["skipped_dirs"] == 1
    assert m_remote.num_samples == m_local.num_samples == 10
    assert find_classes(src, s3_options) == ["Dog", "cat", "dog"]
    assert count_images(src, storage_options=s3_options) == {"Dog": 1, "cat": 7, "dog": 2}


def test_s3_listing_is_per_folder_and_resumes(s3_tree, s3_options, tmp_path: Path, monkeypatch) -> None:
    """Every listing names one folder with a delimiter (never the whole bucket); a re-run
    keeps every shard and lists nothing it does not need."""
    import s3fs

    src, _ = s3_tree
    calls: list[tuple[str, str | None]] = []
    real = s3fs.S3FileSystem._lsdir

    async def counting(self, path, refresh=False, max_items=None, delimiter="/", prefix="", versions=False):
        calls.append((path, delimiter))
        return await real(self, path, refresh=refresh, max_items=max_items, delimiter=delimiter, prefix=prefix, versions=versions)

    requests: list[str] = []
    real_call = s3fs.S3FileSystem._call_s3

    async def recording(self, method, *args, **kwargs):
        requests.append(method)
        return await real_call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_lsdir", counting)
    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", recording)
    dst = tmp_path / "out"
    options = ConvertOptions(max_count=3, workers=1, storage_options=s3_options)
    first = convert_imagefolder(src, str(dst), options=options)
    assert calls and all(d == "/" for _, d in calls)
    # one GET per image, no HEAD: sizes and ETags come from the listings
    assert requests.count("get_object") == first.num_samples == 10
    assert "head_object" not in requests
    base = src.removeprefix("s3://")
    assert {p for p, _ in calls} == {base, *(f"{base}/{d}" for d in ("cat", "cat/deep", "cat/deep/er", "Dog", "dog"))}
    mtimes = {s.url: (dst / s.url).stat().st_mtime_ns for s in first.shards}
    again = convert_imagefolder(src, str(dst), options=options)
    assert again.to_json() == first.to_json()
    assert {s.url: (dst / s.url).stat().st_mtime_ns for s in again.shards} == mtimes


def test_s3_destination(s3_tree, s3_options, s3_prefix: str, tmp_path: Path) -> None:
    src, local = s3_tree
    dst = s3_prefix + "shards"
    m = convert_imagefolder(src, dst, options=ConvertOptions(max_count=4, workers=2, storage_options=s3_options))
    local_m = convert_imagefolder(str(local), str(tmp_path / "d"), options=ConvertOptions(max_count=4, workers=1))
    assert [(s.url, s.sha256) for s in m.shards] == [(s.url, s.sha256) for s in local_m.shards]
    with pytest.raises(ConversionError, match="inside the source tree"):
        convert_imagefolder(src, src + "/cat/out", options=ConvertOptions(storage_options=s3_options))


def test_memory_tree(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    for rel, data in TREE.items():
        fs.pipe_file(f"/convert-tree/{rel}", data)
    local = write_local(tmp_path / "local")
    convert_imagefolder("memory://convert-tree", str(tmp_path / "m"), options=ConvertOptions(max_count=3, workers=2))
    convert_imagefolder(str(local), str(tmp_path / "l"), options=ConvertOptions(max_count=3, workers=1))
    same_dataset(tmp_path / "l", tmp_path / "m", str(local), "memory://convert-tree")


def test_cli_refuses_another_dataset_and_reports_kept_shards(tmp_path: Path) -> None:
    a = write_local(tmp_path / "a")
    b = tmp_path / "b"
    (b / "x").mkdir(parents=True)
    (b / "x" / "1.jpg").write_bytes(tiny_image("JPEG", 99))
    dst = tmp_path / "out"
    cli = [sys.executable, "-m", "shardflow.cli", "convert", "imagefolder"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.run([*cli, str(a), str(dst), "--max-count", "4", "--workers", "1"], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    assert "kept" not in first.stdout
    again = subprocess.run([*cli, str(a), str(dst), "--max-count", "4", "--workers", "1"], capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "(kept 3 finished shards of an earlier run)" in again.stdout
    other = subprocess.run([*cli, str(b), str(dst), "--workers", "1"], capture_output=True, text=True, env=env)
    assert other.returncode == 1
    assert f"already holds a dataset converted by converter imagefolder, source {a}" in other.stderr
    assert "--overwrite" in other.stderr
    forced = subprocess.run([*cli, str(b), str(dst), "--workers", "1", "--overwrite"], capture_output=True, text=True, env=env)
    assert forced.returncode == 0, forced.stderr
    assert sorted(p.name for p in dst.iterdir() if not p.name.startswith(".")) == [
        "shardflow.json", "train-000000.tar", "train-000000.tar.idx.npy",
    ]  # fmt: skip


def test_refusal_in_python(tmp_path: Path) -> None:
    a = write_local(tmp_path / "a")
    dst = tmp_path / "out"
    convert_imagefolder(str(a), str(dst), options=ConvertOptions(max_count=4, workers=1))
    with pytest.raises(DestinationExistsError) as err:
        convert_imagefolder(str(a / "cat"), str(dst), options=ConvertOptions(workers=1))
    assert isinstance(err.value, FileExistsError)
